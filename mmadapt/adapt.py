"""Mini-models (MINIJOINT extraction, MINIPOST Step 1b) and new-language embeddings (Step 2).

Everything here works on full ("single-device") state dicts in RobertaMLM's parameter names;
train.py shards them onto whatever tensor/pipeline layout a run uses.

The model each system trains its new embeddings over in Step 2 (paper section 2):
    bl_base    the full primary model (its last head)
    bl_small   the 4-layer model of Step 1 with recipe bl_small
    minijoint  the bottom N layers of a MINIJOINT primary model + its secondary head (after layer N);
               a MINIJOINT run with several secondary heads holds a mini-model per head: Step 2
               names its depth N (`mini_layers`), and its records are shown as `minijoint@N`
    minipost   the (N + K)-layer mini-model built in Step 1b: bottom N layers, K new layers, primary head

Step-2 runs train two tensors: the word embedding [V, h], tied with the output projection, and
the output bias [V]. The bias is trained because it is indexed by vocabulary piece: the source
model's bias belongs to the source vocabulary and means nothing for most target pieces (it is
initialised like the embeddings: copied for shared pieces, zero otherwise). It adds V elements
to the h*V of the embedding and no matmul FLOPs. TrainConfig.train_output_bias=False is the
paper's setting: the embeddings alone, the bias frozen at that initialisation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mmadapt import checkpoint
from mmadapt.config import ModelConfig

SYSTEMS = ("bl_base", "bl_small", "minijoint", "minipost")
# Which Step-1 (or 1b) recipe each Step-2 system adapts.
SOURCE_RECIPES = {"bl_base": ("bl_base", "minijoint"), "bl_small": ("bl_small",),
                  "minijoint": ("minijoint",), "minipost": ("minipost",)}
WORD = "word_embeddings.word_embeddings.weight"
BIAS = "heads.heads.0.bias"
ADAPT_TRAINABLE = (WORD, BIAS)


def adapt_trainable(train_output_bias: bool = True) -> tuple[str, ...]:
    """What Step 2 trains: the word embedding, and the output bias unless the paper's setting."""
    return ADAPT_TRAINABLE if train_output_bias else (WORD,)


def _parallel_free(cfg: ModelConfig, **changes) -> ModelConfig:
    d = {**vars(cfg), "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, **changes}
    return ModelConfig(**d)


# --- reading Step-1 / Step-1b runs ----------------------------------------------------------

def read_run(run_dir: str | os.PathLike) -> dict:
    """run.json of a finished run, checked to have a complete checkpoint."""
    run_dir = Path(run_dir)
    run_file = run_dir / "run.json"
    if not run_file.is_file():
        raise ValueError(f"{run_dir} is not an mmadapt run directory (no run.json): pass the "
                         "--output_dir of a pretrain or build_minipost run")
    if checkpoint.latest_tag(run_dir / "checkpoints") is None:
        raise ValueError(f"{run_dir} has no complete checkpoint yet: let its run save one first")
    if not (run_dir / "tokenizer" / "spm.model").is_file():
        raise ValueError(f"{run_dir} has no tokenizer/spm.model: it is not a complete mmadapt run")
    return checkpoint.read_json(run_file, "run file")


def load_model(run_dir: str | os.PathLike, tag: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Full weights of a Step-1 or Step-1b run (newest complete checkpoint unless `tag`).

    A Step-1b checkpoint holds only the layers it trained; its frozen part is rebuilt from the
    run it references (run.json `frozen_from`), exactly as Step 1b started from it.
    """
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    cfg = _parallel_free(ModelConfig(**run["model"]))
    ckpt = run_dir / "checkpoints"
    own = checkpoint.load_full_state_dict(ckpt, tag or checkpoint.latest_tag(ckpt))
    ref = run.get("frozen_from")
    if run.get("step") == "adapt":
        raise ValueError(f"{run_dir} is a Step-2 run: its product is under {run_dir / 'embeddings'}")
    if ref is None:
        return cfg, own
    src_cfg, src_state = load_model(ref["run_dir"], ref["tag"])
    _, frozen = minipost_layout(src_cfg, src_state, ref["mini_layers"], ref["new_layers"])
    state = {**frozen, **own}
    missing = sorted(set(_expected_names(cfg)) - set(state))
    if missing:
        raise ValueError(f"{run_dir}: the checkpoint lacks {missing[0]}; it was not written by build_minipost")
    return cfg, state


def _expected_names(cfg: ModelConfig) -> list[str]:
    from mmadapt.models.roberta.model import RobertaMLM

    with torch.device("meta"):
        return [n for n, _ in RobertaMLM(cfg).named_parameters()]


# --- the mini-models --------------------------------------------------------------------------

def _rename_head(state: dict, head_index: int) -> dict:
    """Keep head `head_index` as head 0 and drop the other heads."""
    out = {k: v for k, v in state.items() if not k.startswith("heads.heads.")}
    prefix = f"heads.heads.{head_index}."
    out.update({"heads.heads.0." + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    return out


def _keep_layers(state: dict, n: int) -> dict:
    return {k: v for k, v in state.items() if not k.startswith("layers.") or int(k.split(".")[1]) < n}


def mini_depth(cfg: ModelConfig, mini_layers: int | None = None) -> int:
    """The depth N of the MINIJOINT mini-model that Step 2 uses: `mini_layers`, checked to be a
    layer with a secondary head in `cfg`; None: the run's only secondary head. A run with several
    has no default: each is a different cost-quality trade-off (mmadapt sweep compares them)."""
    depths = cfg.heads_after[:-1]
    if not depths:
        raise ValueError(f"a MINIJOINT model has a secondary head before its last layer; this one has head_layers "
                         f"{cfg.heads_after}")
    listed = ", ".join(map(str, depths))
    if mini_layers is None:
        if len(depths) > 1:
            raise ValueError(f"the MINIJOINT source has mini-models after layers {listed}: choose one with "
                             "--mini_layers (mmadapt sweep trains and compares them all)")
        return depths[0]
    if mini_layers not in depths:
        raise ValueError(f"--mini_layers {mini_layers}: the MINIJOINT source has no secondary head after layer "
                         f"{mini_layers}; its mini-models sit after layer{'s' if len(depths) > 1 else ''} {listed}")
    return mini_layers


def extract_minijoint(cfg: ModelConfig, state: dict, mini_layers: int | None = None) -> tuple[ModelConfig, dict]:
    """MINIJOINT's mini-model: embeddings, layers 1..N and the secondary head after layer N
    (`mini_depth`: the run's only secondary head unless `mini_layers` names one)."""
    n = mini_depth(cfg, mini_layers)
    return (_parallel_free(cfg, num_layers=n, head_layers=(n,), head_weights=()),
            _rename_head(_keep_layers(state, n), cfg.heads_after.index(n)))


def primary_model(cfg: ModelConfig, state: dict) -> tuple[ModelConfig, dict]:
    """The full model with only its primary (last-layer) head."""
    return (_parallel_free(cfg, head_layers=(cfg.num_layers,), head_weights=()),
            _rename_head(state, len(cfg.heads_after) - 1))


def minipost_layout(cfg: ModelConfig, state: dict, mini_layers: int, new_layers: int) -> tuple[ModelConfig, dict]:
    """Step 1b's starting point: the bottom N layers, embeddings and primary MLM head of `state`;
    layers N+1..N+K are new (absent from the returned dict: the model's own seeded init)."""
    if not 1 <= mini_layers < cfg.num_layers:
        raise ValueError(f"mini_layers {mini_layers} must be in 1..{cfg.num_layers - 1} for a "
                         f"{cfg.num_layers}-layer primary model")
    if new_layers < 1:
        raise ValueError(f"new_layers must be >= 1, got {new_layers}")
    depth = mini_layers + new_layers
    _, primary = primary_model(cfg, state)
    return (_parallel_free(cfg, num_layers=depth, head_layers=(depth,), head_weights=()),
            _keep_layers(primary, mini_layers))


def minipost_trainable(mini_layers: int, new_layers: int) -> tuple[str, ...]:
    """Name prefixes of the parameters Step 1b trains (0-based layer indices N..N+K-1)."""
    return tuple(f"layers.{i}." for i in range(mini_layers, mini_layers + new_layers))


def adapt_body(system: str, cfg: ModelConfig, state: dict, mini_layers: int | None = None
               ) -> tuple[ModelConfig, dict]:
    """The model Step 2 trains embeddings over, from the weights of the system's source run.
    mini_layers: minijoint only, which of the source's mini-models (see `mini_depth`)."""
    if system == "minijoint":
        return extract_minijoint(cfg, state, mini_layers)
    if system in ("bl_base", "bl_small", "minipost"):
        if mini_layers is not None:
            raise ValueError(f"--mini_layers picks one of a MINIJOINT run's mini-models; {system}'s model comes "
                             "whole from its source run")
        return primary_model(cfg, state)
    raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")


def system_label(meta: dict) -> str:
    """How an artifact's records name its system, in every Step-4 table and plot:
    `<recipe>:full` for a ceiling, full-model Step 2 over a source pretrained as another system
    (bl_base over a MINIJOINT run: `minijoint:full`, the embeddings the mini-model's are
    measured against); `minijoint@N` when its MINIJOINT source has several mini-models (meta
    `mini_depths`), so that curves of different depths stay apart; otherwise the system itself."""
    if meta["system"] == "bl_base" and "source" in meta:
        recipe = json.loads((Path(meta["source"]) / "run.json").read_text()).get("recipe")
        if recipe not in (None, "bl_base"):  # None: an imported Hugging Face model
            return f"{recipe}:full"
    if meta["system"] == "minijoint" and len(meta.get("mini_depths") or ()) > 1:
        return f"minijoint@{meta['mini_layers']}"
    return meta["system"]


# --- new-language embeddings ------------------------------------------------------------------

def tokenizer_pieces(path: str | os.PathLike) -> list[str]:
    """Each id's piece, as a surface form comparable across tokenizers (mmadapt/tokenizer.py)."""
    from mmadapt.tokenizer import pieces

    return pieces(path)


def overlap_init(src_pieces: list[str], src_weight: torch.Tensor, src_bias: torch.Tensor,
                 trg_pieces: list[str], std: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Target embeddings [V_trg, h] and output bias [V_trg] (paper footnote 1, after Pfeiffer et
    al. 2021): a piece that is also in the source vocabulary (special tokens included) gets the
    source row and bias; every other row is N(0, std) and its bias 0. Returns (weight, bias,
    number of shared pieces). The random rows depend only on `seed`."""
    src_index = {p: i for i, p in enumerate(src_pieces)}
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(len(trg_pieces), src_weight.shape[1], generator=gen, dtype=torch.float32) * std
    bias = torch.zeros(len(trg_pieces), dtype=torch.float32)
    trg_rows = [i for i, p in enumerate(trg_pieces) if p in src_index]
    src_rows = [src_index[trg_pieces[i]] for i in trg_rows]
    weight[trg_rows] = src_weight[src_rows].float()
    bias[trg_rows] = src_bias[src_rows].float()
    return weight, bias, len(trg_rows)


def step2_start(system: str, source: Path, tag: str, target_tokenizer: Path, std: float,
                seed: int, mini_layers: int | None = None) -> tuple[ModelConfig, dict, int]:
    """Step 2's starting weights: the system's model from the source run with overlap-initialised
    target embeddings and output bias. -> (model config, full state dict, shared pieces)."""
    cfg, body = adapt_body(system, *load_model(source, tag), mini_layers)
    weight, bias, shared = overlap_init(tokenizer_pieces(Path(source) / "tokenizer" / "spm.model"), body[WORD],
                                        body[BIAS], tokenizer_pieces(target_tokenizer), std, seed)
    return cfg, {**body, WORD: weight, BIAS: bias}, shared


def write_artifact(out_dir: Path, weight: torch.Tensor, bias: torch.Tensor, tokenizer: Path, meta: dict) -> Path:
    """The Step-2 product that Step 4 swaps into the primary model: embeddings.pt (word embedding
    [V, h] and output bias [V]), the target tokenizer, and meta.json. Written to a temporary
    directory and renamed, so a reader never sees half an artifact."""
    import shutil

    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({"word_embeddings": weight.contiguous(), "output_bias": bias.contiguous()}, tmp / "embeddings.pt")
    shutil.copyfile(tokenizer, tmp / "spm.model")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def read_artifact(path: str | os.PathLike) -> tuple[dict, Path, dict]:
    """-> ({"word_embeddings": [V, h], "output_bias": [V]}, tokenizer path, meta)."""
    path = Path(path)
    if not (path / "embeddings.pt").is_file():
        raise ValueError(f"{path} is not a Step-2 embedding artifact (no embeddings.pt): pass a "
                         "directory under <adapt run>/embeddings/")
    art = checkpoint.load_pt(path / "embeddings.pt", "Step-2 artifact file", weights_only=True)
    if not isinstance(art, dict) or not {"word_embeddings", "output_bias"} <= set(art):
        raise ValueError(f"{path / 'embeddings.pt'} holds no word_embeddings/output_bias: it is not a Step-2 artifact")
    return art, path / "spm.model", checkpoint.read_json(path / "meta.json", "Step-2 artifact file")
