"""New-language embeddings (Step 2): the model each system trains over, the overlap start of the
new vocabulary's rows, and the artifact Step 4 swaps in.

Everything here works on full ("single-device") state dicts in the family's parameter names
(family.py); train.py shards them onto whatever tensor/pipeline layout a run uses.

The model each system trains its new embeddings over in Step 2 (paper section 2):
    bl_base    the full primary model (its last head)
    bl_small   the N-layer model of Step 1 with recipe bl_small
    minijoint  the bottom N layers of a MINIJOINT primary model + its secondary head (after layer N);
               a MINIJOINT run with several secondary heads holds a mini-model per head: Step 2
               names its depth N (`mini_layers`), and its records are shown as `minijoint@N`
    minipost   the (N + K)-layer mini-model built in Step 1b: bottom N layers, K new layers, primary head

Step-2 runs train the parameters indexed by vocabulary piece (ModelFamily.vocab_params): the
word embedding [V, h] (tied with the output projection where the family ties them) and what
else the family indexes by piece: the encoder's output bias [V], a decoder's untied output
projection [V, h]. The encoder's bias is trained because the source model's belongs to the
source vocabulary and means nothing for most target pieces; it adds V elements to the h*V of the
embedding and no matmul FLOPs. TrainConfig.train_output_bias=False is the paper's setting: the
embeddings alone, the bias frozen at its overlap initialisation.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import sentencepiece as spm
import torch
from sentencepiece import sentencepiece_model_pb2 as sp_model

from mmadapt import checkpoint
from mmadapt.config import EMBEDDING_INITS, EXPAND_OUTPUT_STARTS, SYSTEMS, ModelConfig, TrainConfig
from mmadapt.data import load_checked_tokenizer
from mmadapt.family import WORD, ModelFamily, OutputPath
from mmadapt.models.layers import new_rows_name
from mmadapt.run import Source, read_source
from mmadapt.tokenizer import WORD_BOUNDARY
from mmadapt.tokenizer import load as load_tokenizer
from mmadapt.tokenizer import pieces as tokenizer_pieces
from mmadapt.tokenizer import source_form
from mmadapt.tokens import UNK_ID
from mmadapt.vocab import check_expansion

ARTIFACT_FILE = "embeddings.pt"


def body_config(family: ModelFamily, system: str, cfg: ModelConfig, mini_layers: int | None = None) -> ModelConfig:
    """The config of the model Step 2 trains embeddings over, from the source's config alone.
    mini_layers: minijoint only, which of the source's mini-models (ModelFamily.minijoint_depth)."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")
    if system == "minijoint":
        return family.minijoint_config(cfg, mini_layers)
    if mini_layers is not None:
        raise ValueError(f"--mini_layers picks one of a MINIJOINT run's mini-models; {system}'s model comes whole "
                         "from its source run")
    return family.primary_config(cfg)


def body_weights(family: ModelFamily, system: str, cfg: ModelConfig, state: dict, body: ModelConfig) -> dict:
    """The weights of the model Step 2 trains embeddings over (`body`, body_config's) from
    `state`, the full weights of the system's source run (whose config is `cfg`)."""
    if system == "minijoint":
        return family.extract_minijoint(cfg, state, body.num_layers)[1]
    return family.primary_model(cfg, state)[1]


def system_label(meta: dict) -> str:
    """How an artifact's records name its system, in every Step-4 table and plot:
    `<recipe>:full` for a ceiling, full-model Step 2 over a source pretrained as another system
    (bl_base over a MINIJOINT run: `minijoint:full`, the embeddings the mini-model's are
    measured against); `minijoint@N` when its MINIJOINT source has several mini-models (meta
    `mini_depths`), so that curves of different depths stay apart; otherwise the system itself.
    A decoder's Step 2 that scored a fraction p < 1 of the positions (meta `score_fraction`) adds
    ` p=<p>` (SCORED_LABEL), so that its curves stay apart from full scoring's."""
    return _system_name(meta) + (f"{SCORED_LABEL}{meta['score_fraction']:g}" if "score_fraction" in meta else "")


SCORED_LABEL = " p="  # system_label's mark of a Step 2 that scored a fraction of the positions


def _system_name(meta: dict) -> str:
    if meta["system"] == "bl_base" and "source" in meta:
        recipe = json.loads((Path(meta["source"]) / "run.json").read_text()).get("recipe")
        if recipe not in (None, "bl_base"):  # None: an imported Hugging Face model
            return f"{recipe}:full"
    if meta["system"] == "minijoint" and len(meta.get("mini_depths") or ()) > 1:
        return f"minijoint@{meta['mini_layers']}"
    return meta["system"]


# --- the new vocabulary's starting rows ---------------------------------------------------------------

def overlap_init(src_pieces: list[str], src: dict[str, torch.Tensor], trg_pieces: list[str], std: float,
                 seed: int) -> tuple[dict[str, torch.Tensor], int]:
    """Target rows of each vocabulary-indexed tensor of `src` (name -> [V_src, ...], the word
    embedding first), after the paper's footnote 1 (Pfeiffer et al. 2021): a piece that is also in
    the source vocabulary (special tokens included) gets the source row; every other row is
    N(0, std) in a matrix and 0 in a vector (a bias). Returns (name -> [V_trg, ...], number of
    shared pieces). The random rows depend only on `seed`, drawn matrix by matrix in `src`'s order."""
    src_index = {p: i for i, p in enumerate(src_pieces)}
    gen = torch.Generator().manual_seed(seed)
    trg_rows = [i for i, p in enumerate(trg_pieces) if p in src_index]
    src_rows = [src_index[trg_pieces[i]] for i in trg_rows]
    out = {}
    for name, t in src.items():
        if t.ndim == 2:
            new = torch.randn(len(trg_pieces), t.shape[1], generator=gen, dtype=torch.float32) * std
        else:
            new = torch.zeros(len(trg_pieces), dtype=torch.float32)
        new[trg_rows] = t[src_rows].float()
        out[name] = new
    return out, len(trg_rows)


def source_split(src_tokenizer: Path):
    """piece -> the source tokenizer's ids for that piece's surface form, as FVT splits a new
    piece (Gee et al. 2022): '▁' read as the space it stands for, and nothing added to the text, so
    a word-initial piece '▁foo' splits as ' foo' does inside a text and a word-internal 'oo' as
    'oo' does (a SentencePiece source gets a copy of its model without the dummy prefix and with
    spaces kept; a byte-level BPE source's pre-tokenizer adds no prefix space already; a
    WordPiece source splits a word-internal piece into `##` continuations,
    HFTokenizer.split_surface). The unknown piece is dropped from a split: its row says nothing
    about the piece."""
    tok = load_tokenizer(src_tokenizer)
    if not isinstance(tok, spm.SentencePieceProcessor):
        return tok.split_surface  # an imported tokenizer (HFTokenizer)
    proto = sp_model.ModelProto()
    proto.ParseFromString(Path(src_tokenizer).read_bytes())
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    tok = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())

    def split(piece: str) -> list[int]:
        return [i for i in tok.encode(piece.replace(WORD_BOUNDARY, " ")) if i != UNK_ID]
    return split


def subword_mean_init(split, src_pieces: list[str], src: dict[str, torch.Tensor], trg_pieces: list[str], std: float,
                      seed: int) -> tuple[dict[str, torch.Tensor], int, int]:
    """overlap_init, then every target piece that is not shared and that the source tokenizer
    splits (`split`, source_split) gets the mean of the source rows of its split, in every
    vocabulary-indexed tensor (the bias likewise); a piece with an empty split keeps its N(0, std)
    row. -> (name -> [V_trg, ...], shared pieces, pieces given a mean)."""
    out, shared = overlap_init(src_pieces, src, trg_pieces, std, seed)
    src_index = {p: i for i, p in enumerate(src_pieces)}
    composed = 0
    for i, piece in enumerate(trg_pieces):
        if piece in src_index:
            continue
        ids = split(piece)
        if not ids:
            continue
        composed += 1
        for name, t in src.items():
            out[name][i] = t[ids].float().mean(0)
    return out, shared, composed


def init_rows(how: str, src_tokenizer: Path, src: dict[str, torch.Tensor], trg_pieces: list[str], std: float,
              seed: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The rows of the pieces `trg_pieces` (surface forms, tokenizer.pieces) in the
    vocabulary-indexed tensors `src` by TrainConfig.embedding_init: overlap (the paper: shared
    pieces copied, the rest N(0, std)), subword_mean (FVT: subword_mean_init) or normal (every
    row drawn, nothing copied: the baseline that shows what the copies are worth). -> (name ->
    [len(trg_pieces), ...], how many rows started which way: shared_pieces, subword_mean_pieces,
    random_pieces)."""
    src_pieces = tokenizer_pieces(src_tokenizer)
    # in the source's normal form (an uncased WordPiece's lower case): a piece shares the row its text reaches
    trg_pieces = list(map(source_form(src_tokenizer), trg_pieces))
    composed = 0
    if how == "normal":
        out, shared = overlap_init([], src, trg_pieces, std, seed)
    elif how == "subword_mean":
        out, shared, composed = subword_mean_init(source_split(src_tokenizer), src_pieces, src, trg_pieces, std, seed)
    elif how == "overlap":
        out, shared = overlap_init(src_pieces, src, trg_pieces, std, seed)
    else:
        raise ValueError(f"unknown embedding_init {how!r}; choose one of {', '.join(EMBEDDING_INITS)}")
    return out, {"shared_pieces": shared, "subword_mean_pieces": composed,
                 "random_pieces": len(trg_pieces) - shared - composed}


def new_vocabulary(family: ModelFamily, body: ModelConfig, state: dict, src_tokenizer: Path, target_tokenizer: Path,
                   seed: int, embedding_init: str = "overlap", vocab_mode: str = "replace"
                   ) -> tuple[dict, dict[str, int]]:
    """Step 2's starting weights: the body's weights `state` (body_weights) with the new
    vocabulary's rows of every vocabulary-indexed parameter (init_rows). vocab_mode "replace": the
    rows of every piece of `target_tokenizer`; "expand" (`target_tokenizer` is then the merged
    one, vocab.py): the source's rows kept under their names and the rows of the appended pieces
    under `new_rows_name`s. Random rows are N(0, the source model's init_method_std), drawn from
    `seed`. -> (full state dict, how many rows started which way)."""
    std = body.init_method_std
    vocab = {name: state[name] for name in family.vocab_params(body)}
    trg_pieces = tokenizer_pieces(target_tokenizer)
    if vocab_mode == "replace":
        new, counts = init_rows(embedding_init, src_tokenizer, vocab, trg_pieces, std, seed)
        return {**state, **new}, counts
    source_size = check_expansion(src_tokenizer, target_tokenizer)
    new, counts = init_rows(embedding_init, src_tokenizer, vocab, trg_pieces[source_size:], std, seed)
    return {**state, **{new_rows_name(name): rows for name, rows in new.items()}}, counts


# --- an expanded vocabulary's output side (TrainConfig.expand_output_start) ---------------------------
# The new pieces join the softmax of a model that stays the source's: at any position they can only
# take probability mass from the source pieces, and the source-language loss there rises by
# exactly -log(1 - their share), which is also the KL from the source model's distribution to the
# expanded one. Hewitt ("Initializing new word embeddings for pretrained language models"): a new
# output row at the mean mu of the n source rows scores exp(mu . y + mean(b)) <= Z / n (Jensen;
# Z the source pieces' sum of exp(logit)). A row mu + d scores at most exp(excess(d)) times that,
# excess(d) = max over the head's normed output y of d . y (`logit_excess`), and a bias b_new
# scales it by exp(b_new - mean(b)). So k new pieces together add at most
#     Z / n * sum_i exp(excess(d_i) + b_new_i - mean(b))
# to the softmax's sum (`mass_bound`), whatever the text. The bounded start
# (`bounded_start`) chooses what it can of each row:
#   encoder (tied word embedding and an output bias): the row is also the input embedding, so it
#       stays --embedding_init's; each new bias entry is mean(b) - excess(d_i) + log(n eps / ((1 -
#       eps) k)), which caps the new pieces' share at eps = 1 - exp(-nats): the loss and the KL
#       rise by at most nats (TrainConfig.expand_source_nats) at any position, at update 0;
#   decoder with an output projection of its own (no bias): its new rows at mu (d = 0), the input
#       rows --embedding_init's: a rise of at most log(1 + k / n);
#   decoder with a tied projection (no bias): nothing but the row itself holds the mass back, so
#       the new rows start at mu on both sides (--embedding_init gives way): log(1 + k / n) again.
# The decoders' bound is Hewitt's, loose where k is near n (0.055 nats measured at k / n = 0.9, the
# demo's decoder, 2026-11-25). With no bias, no row bounds the share at every position (a row
# that scores low for every y would have to be -infinity), but it can be low where the source text
# puts y. The mean rise over source positions is convex in the row: `output_shift` walks down it
# from mu until it is nats / 2, half the encoder's bound, on source text (the source run's or
# the replay data's training split; held-out text measures it after, run.json's expand_report);
# plugin.off_source_start applies it (run.json records how far the row moved, the rise it leaves
# on that text, and the worst-case bound, now loose). The encoder's worst case is far from what
# the source text sees (its new bias entries ~12 nats under the source mean on the demo's encoder,
# 5e-6 nats of rise on source text: the target pays for the slack), so it is calibrated the same
# way: `bias_shift` raises every new entry by one c until the mean rise on source text is nats / 2
# (run.json's `bias_shift`; the worst case rises by c with it).


def logit_excess(d: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor | None = None) -> torch.Tensor:
    """d [k, h] -> [k]: max over y = w * x_hat + beta, ||x_hat|| <= sqrt(h) (the head's LayerNorm or
    RMSNorm output, whatever its input) of d . y, by Cauchy-Schwarz sqrt(h) ||d * w|| + d . beta:
    how far above the mean row's logit a row mean + d can score anywhere."""
    d, w = d.float(), norm_weight.float()
    excess = d.shape[1] ** 0.5 * (d * w).norm(dim=1)
    return excess if norm_bias is None else excess + d @ norm_bias.float()


def mass_bound(excess: torch.Tensor, n: int) -> float:
    """The most, in nats, that k new pieces whose logits exceed the mean source row's by at most
    `excess` [k] (bias included) can raise the loss of a source piece, at any position: log(1 +
    sum_i exp(excess_i) / n) (the comment above)."""
    return float(torch.logsumexp(torch.cat([excess.double(), excess.new_zeros(1).double() + math.log(n)]), 0)
                 - math.log(n))


def _excess(path: OutputPath, head: dict, rows: dict) -> torch.Tensor:
    """[k]: the bound on each new piece's logit above the mean source row's, bias included, in
    the one-head model `head` (full state, source vocabulary) with the new rows `rows`."""
    d = rows[path.matrix].float() - head[path.matrix].float().mean(0)
    excess = logit_excess(d, head[path.norm_weight], head[path.norm_bias] if path.norm_bias else None)
    if path.bias is not None and path.bias in rows:
        excess = excess + rows[path.bias].float() - head[path.bias].float().mean()
    return excess


def bounded_start(path: OutputPath, heads: list[dict], new: dict[str, torch.Tensor], nats: float, word: str = WORD
                  ) -> tuple[dict[str, torch.Tensor], float]:
    """The new rows `new` (name -> [k, ...], an --embedding_init start) with their output side
    started so that the new pieces take a bounded share of the mass (the comment above), in each
    one-head model of `heads` (full states of the source vocabulary that will score them: Step
    2's body and the primary model, whose heads differ for MINIJOINT; `word`: the family's input
    embedding, the output matrix too where it is tied; `nats`: the encoder's bound,
    TrainConfig.expand_source_nats) -> (rows, the bound in nats, the largest over `heads`)."""
    out, n = dict(new), heads[0][path.matrix].shape[0]
    k = out[path.matrix].shape[0]
    if path.matrix != word or path.bias is None:
        out[path.matrix] = heads[0][path.matrix].float().mean(0).expand(k, -1).clone()
    if path.bias is not None and path.bias in out:
        eps = -math.expm1(-nats)
        rows = {**out, path.bias: torch.zeros(k)}  # -_excess: mean(b) - excess(d_i) of each head
        out[path.bias] = torch.stack([-_excess(path, h, rows) for h in heads]).min(0).values \
            + math.log(n * eps / ((1 - eps) * k))
    return out, max(mass_bound(_excess(path, h, out), n) for h in heads)


def output_shift(y: torch.Tensor, lse: torch.Tensor, row: torch.Tensor, k: int, target: float
                 ) -> tuple[torch.Tensor, float]:
    """A decoder's bounded start, moved off the source text (the comment above): y [m, h] the
    head's normed outputs at m source positions, lse [m] the source logits' logsumexp there, row
    [h] the k new rows' start (the source rows' mean) -> (the new row [h], the mean rise in nats
    it leaves there). The nearest row to `row` whose mean rise, mean_i log(1 + k exp(y_i . r -
    lse_i)) (convex in r), is at most `target`: the minimiser of rise(r) + lam/2 ||r - row||^2
    (L-BFGS), lam found by bisection (log scale) as the largest that gets there; a row that moves
    no further than it must stays close to where the source puts the text (a far row scores
    unseen contexts high). Where no lam gets there, the lowest rise found."""
    y, base, mu = y.double(), lse.double() - math.log(k), row.detach().double()

    def rise(r: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(y @ r - base).mean()

    def nearest(lam: float, start: torch.Tensor) -> tuple[torch.Tensor, float]:
        r = start.clone().requires_grad_(True)
        opt = torch.optim.LBFGS([r], lr=1, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15,
                                line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = rise(r) + lam / 2 * (r - mu).square().sum()
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            return r.detach(), float(rise(r))

    with torch.no_grad():
        if float(rise(mu)) <= target:
            return mu.float(), float(rise(mu))
    lo, hi = -12.0, 6.0  # log10 lam: the far end reaches (nearly) the unconstrained minimum
    best = nearest(10 ** lo, mu)
    if best[1] > target:
        return best[0].float(), best[1]
    while hi - lo > 0.05:  # log10 lam to 5%: ~9 solves
        mid = (lo + hi) / 2
        r, got = nearest(10 ** mid, best[0])
        if got <= target:
            lo, best = mid, (r, got)
        else:
            hi = mid
    return best[0].float(), best[1]


def bias_shift(y: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor,
               target: float) -> tuple[float, float]:
    """An encoder's bounded start, raised toward the source text (the comment above): y [m, h] the
    head's normed outputs at m source positions, lse [m] the source logits' logsumexp there, rows
    [k, h] and bias [k] the new pieces' output rows and (bounded_start's) bias entries -> (c >= 0,
    the mean rise in nats it leaves there): the largest c to add to every new entry with mean_i
    log(1 + sum_j exp(y_i . rows_j + bias_j + c - lse_i)) <= target. The rise grows with c, so
    bisection finds it (to 1e-6 nats of c); where c = 0 is already over, c = 0."""
    excess = torch.logsumexp(y.double() @ rows.double().T + bias.double(), 1) - lse.double()  # [m]

    def rise(c: float) -> float:
        return float(torch.nn.functional.softplus(excess + c).mean())

    if rise(0.0) > target:
        return 0.0, rise(0.0)
    lo, hi = 0.0, 1.0
    while rise(hi) <= target:  # the rise grows without bound in c: this ends
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rise(mid) <= target else (lo, mid)
    return lo, rise(lo)


def bounded_over(path: OutputPath, heads: list[dict], state: dict) -> float:
    """The worst-case bound (mass_bound) on what the new rows of `state` (under new_rows_name)
    add to a source piece's loss, the largest over the one-head models `heads` (full states)."""
    new = {name: state[new_rows_name(name)] for name in (path.matrix, path.bias)
           if name is not None and new_rows_name(name) in state}
    return max(mass_bound(_excess(path, h, new), h[path.matrix].shape[0]) for h in heads)


def expand_output_start(family: ModelFamily, body: ModelConfig, state: dict, primary: dict,
                        output_start: str = "embedding_init", nats: float = TrainConfig.expand_source_nats
                        ) -> tuple[dict, float]:
    """An expanded vocabulary's start (new_vocabulary's `state`, the new rows under
    `new_rows_name`s as --embedding_init starts them) with their output side started by
    `output_start` (TrainConfig.expand_output_start: "bounded" and "worst_case", bounded_start,
    which Step 2 then calibrates for "bounded" (plugin.off_source_start); "embedding_init": as the
    input side), scored through the body's head and the primary model's (`primary`: its
    one-head full state, family.primary_model's) -> (the state, `new_mass_bound`: the bound in
    nats on what the new pieces can add to a source piece's loss at update 0)."""
    if output_start not in EXPAND_OUTPUT_STARTS:
        raise ValueError(f"unknown expand_output_start {output_start!r}; choose one of {', '.join(EXPAND_OUTPUT_STARTS)}")
    path, heads = family.output_path(body), [state, primary]
    new = {name: state[new_rows_name(name)] for name in family.vocab_params(body) if new_rows_name(name) in state}
    if output_start in ("bounded", "worst_case"):
        new, bound = bounded_start(path, heads, new, nats, family.word)
    else:
        bound = max(mass_bound(_excess(path, h, new), state[path.matrix].shape[0]) for h in heads)
    return {**state, **{new_rows_name(name): rows for name, rows in new.items()}}, bound


def step2_start(system: str, source: Path | Source, tag: str | None, target_tokenizer: Path, seed: int,
                mini_layers: int | None = None, embedding_init: str = "overlap", vocab_mode: str = "replace",
                output_start: str = "embedding_init", nats: float = TrainConfig.expand_source_nats
                ) -> tuple[ModelConfig, dict, dict[str, int]]:
    """step2_start_with_primary without the primary model's state."""
    return step2_start_with_primary(system, source, tag, target_tokenizer, seed, mini_layers, embedding_init,
                                    vocab_mode, output_start, nats)[:3]


def step2_start_with_primary(system: str, source: Path | Source, tag: str | None, target_tokenizer: Path, seed: int,
                             mini_layers: int | None = None, embedding_init: str = "overlap",
                             vocab_mode: str = "replace", output_start: str = "embedding_init",
                             nats: float = TrainConfig.expand_source_nats
                             ) -> tuple[ModelConfig, dict, dict[str, int], dict | None]:
    """Step 2's start from the source run `source` (checkpoint `tag`) alone, as adapt_embeddings
    computes it (body_config, body_weights, new_vocabulary; expand: expand_output_start with
    `output_start` and `nats`): what the plug-in metric scores as "start" for a run without an artifact of
    update 0; adapt_embeddings' own start (`source` the run it read, `tag` unused), which then
    moves a bounded start off the source text (plugin.off_source_start). -> (the body's config,
    full state dict, how many rows started which way; expand: and `new_mass_bound`; expand: the
    primary model's one-head full state, which the calibration bounds through, else None: the
    source's weights are read once)."""
    src = source if isinstance(source, Source) else read_source(source, tag)
    body, weights = body_config(src.family, system, src.cfg, mini_layers), src.weights()
    state = body_weights(src.family, system, src.cfg, weights, body)
    init, counts = new_vocabulary(src.family, body, state, src.tokenizer, target_tokenizer, seed, embedding_init,
                                  vocab_mode)
    primary = None
    if vocab_mode == "expand":
        primary = src.family.primary_model(src.cfg, weights)[1]
        init, counts["new_mass_bound"] = expand_output_start(src.family, body, init, primary, output_start, nats)
    return body, init, counts, primary


def step2_trainable(family: ModelFamily, cfg: ModelConfig, train_output_bias: bool = True) -> tuple[str, ...]:
    """The parameters Step 2 trains: the vocabulary-indexed ones (ModelFamily.vocab_params), or,
    for an expanded vocabulary (cfg.frozen_vocab_size), only their new rows."""
    names = family.vocab_params(cfg, train_output_bias)
    return tuple(map(new_rows_name, names)) if cfg.frozen_vocab_size else names


# --- the artifact ----------------------------------------------------------------------------------------

def write_artifact(out_dir: Path, tensors: dict[str, torch.Tensor], tokenizer: Path, meta: dict) -> Path:
    """The Step-2 product that Step 4 swaps into the primary model: embeddings.pt (the
    vocabulary-indexed tensors under ModelFamily.artifact_keys' keys: "word_embeddings" [V, h],
    the encoder's "output_bias" [V]), the target tokenizer, and meta.json. Published whole
    (checkpoint.staged_dir): a reader never sees half an artifact."""
    with checkpoint.staged_dir(out_dir, replace=True) as tmp:
        torch.save({k: v.contiguous() for k, v in tensors.items()}, tmp / ARTIFACT_FILE)
        (tmp / "spm.model").write_bytes(Path(tokenizer).read_bytes())
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    return out_dir


def read_artifact(path: str | os.PathLike) -> tuple[dict, Path, dict]:
    """-> ({"word_embeddings": [V, h], ...}, tokenizer path, meta)."""
    path = Path(path)
    if not (path / ARTIFACT_FILE).is_file():
        raise ValueError(f"{path} is not a Step-2 embedding artifact (no embeddings.pt): pass a "
                         "directory under <adapt run>/embeddings/")
    art = checkpoint.load_pt(path / ARTIFACT_FILE, "Step-2 artifact file", weights_only=True)
    if not isinstance(art, dict) or "word_embeddings" not in art:
        raise ValueError(f"{path / ARTIFACT_FILE} holds no word_embeddings: it is not a Step-2 artifact")
    # A piece id past the last row would index outside the embedding (rows past the last id are
    # harmless: a vocabulary padded for tensor parallelism has them).
    rows, pieces = art["word_embeddings"].shape[0], load_checked_tokenizer(path / "spm.model").get_piece_size()
    if rows < pieces:
        raise ValueError(f"{path}: its embeddings have {rows} rows but its tokenizer spm.model has {pieces} pieces: "
                         "they do not belong together; use the artifact directory as adapt wrote it")
    return art, path / "spm.model", checkpoint.read_json(path / "meta.json", "Step-2 artifact file")


def artifact_state(family: ModelFamily, art: dict, meta: dict | None = None,
                   own: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """An artifact's tensors under the family's parameter names (those it holds). An expanded
    vocabulary's artifact (meta["vocab_mode"] "expand") put into a model whose own tensors are
    `own` (the primary model's, of the source vocabulary) keeps the model's own source rows and
    appends the artifact's new rows: the word embedding's source rows are the same either way
    (frozen in Step 2, and the primary's in every system), while a MINIJOINT encoder's output
    bias would otherwise bring its secondary head's source rows into the primary head."""
    out = {name: art[key] for key, name in family.artifact_keys().items() if key in art}
    if meta is None or meta.get("vocab_mode", "replace") != "expand":
        return out
    size = meta["source_vocab_size"]
    for name, t in out.items():
        if own[name].shape[0] != size:
            raise ValueError(f"the artifact expands a {size}-piece vocabulary, the model's {name} has "
                             f"{own[name].shape[0]} rows: it was trained for another model")
        out[name] = torch.cat([own[name].to(t.device, t.dtype), t[size:]])
    return out


__all__ = ["body_config", "body_weights", "new_vocabulary", "system_label", "overlap_init", "source_split",
           "subword_mean_init", "init_rows", "output_shift", "bias_shift", "bounded_over", "logit_excess", "mass_bound", "bounded_start",
           "expand_output_start", "step2_start", "step2_start_with_primary", "step2_trainable", "write_artifact", "read_artifact", "artifact_state"]
