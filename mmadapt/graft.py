"""Graft Step-2 embeddings trained over a base model into its fine-tuned siblings.

People serve a fine-tuned model (an instruct or chat model, a model trained further on their own
text), not the base it came from, and cannot afford Step 2 for every sibling. Franken-Adapter
(Jiang et al., 2025) trains new embeddings on the frozen base and grafts them into the base's
instruction-tuned sibling. mmadapt trains them over the base's mini-model, and `export-hf
--primary <sibling> --embeddings <artifact of the base> --graft` puts them into the sibling.

A sibling shares the base's architecture (every tensor's name and shape) and its source
vocabulary (the same pieces in the same order); `check_siblings` refuses anything else in one
line. It also reports how far the sibling's body moved from the base, layer by layer, as
||sibling - base|| / ||base|| over each layer's tensors: the farther the body moved, the less the
embeddings' fit to the base says about their fit to the sibling.

What the sibling keeps:
- expand: its own source rows, bit for bit (artifact.artifact_state takes the model's own rows;
  only the new pieces' rows come from the artifact). The new pieces' output rows of an untied
  output projection, and their output bias (an encoder's), were started and trained beside the
  base's frozen source entries, so a sibling whose untied output rows or output bias moved is
  refused.
- replace: the artifact's tensors, the target vocabulary's rows of the input embedding and of
  the output side (tied rows, the encoder's output bias, an untied projection), as for the base.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from mmadapt.artifact import SAMPLED_KEY, primary_changed, trained_for
from mmadapt.run import Source, read_source, sampled_fingerprint
from mmadapt.tokenizer import HFTokenizer, SPECIAL_ROLES, is_hf, pieces


# A layer of a fine-tuned sibling moves a few percent of its norm from the base: 0.03-0.12 in
# every sibling fine-tuned here (benchmarks/results/graft_*: 3 epochs of every weight, or 100
# updates), less for a large model's instruction tuning. Two models initialised apart are ~0.5
# (LayerNorm gains and biases shared) to ~1.4 (random matrices of one scale) apart.
FAR = 0.3
# The config fields a sibling may change without changing a tensor's shape (check_siblings warns)
POSITION_AND_NORM = ("max_position_embeddings", "rotary_base", "seq_len_interpolation_factor", "layernorm_epsilon")


def _attention(cfg) -> dict[str, int]:
    """What no fine-tune changes but tensors of the same shapes can hold otherwise (check_siblings
    refuses): 4 heads of 8 and 2 heads of 16 are one [32, h] query matrix read as other attention."""
    heads = cfg.num_attention_heads
    return {"num_attention_heads": heads, "num_query_groups": cfg.num_query_groups or heads,
            "kv_channels": cfg.kv_channels or cfg.hidden_size // heads}


@dataclasses.dataclass(frozen=True)
class SiblingCheck:
    """How far a sibling's weights are from its base's: per group of tensors (`layers.<i>`, the
    embeddings, the rest by their first name), ||sibling - base|| / ||base||."""
    base: Path
    sibling: Path
    distance: dict[str, float]
    warnings: tuple[str, ...] = ()  # check_siblings' own, beside the distances' (lines)
    # the base's weights by the test export_hf's --graft applies (artifact.same_primary: the sampled
    # fingerprint), which refuses to graft into them: extend refuses such an --into before it trains
    same_weights: bool = False

    def lines(self) -> list[str]:
        """What export-hf prints of the check: the distances, a warning where a layer moved
        farther than a fine-tune moves one (FAR), and check_siblings' warnings."""
        moved = [k for k, d in self.distance.items() if d > 0]
        out = [f"graft: {self.sibling} is a sibling of {self.base} (the same architecture and source vocabulary); "
               f"{len(moved)} of {len(self.distance)} tensor groups moved from the base, relative distance "
               "||sibling - base|| / ||base||:"]
        out += [f"  {name:24s} {d:.4f}" for name, d in self.distance.items()]
        layers = {k: d for k, d in self.distance.items() if k.rsplit(".", 1)[-1].isdigit()}
        if layers and max(layers.values()) > FAR:
            name = max(layers, key=layers.get)
            out.append(f"warning: its {name} moved {layers[name]:.2f} of its norm from the base's, farther than a "
                       f"fine-tune moves a layer (> {FAR}): it may be another model of the same shape, over which "
                       "embeddings trained on the base do not hold; score the graft (evaluate --graft) before "
                       "serving it")
        return out + list(self.warnings)



def other_roles(base_tokenizer: Path, sibling_tokenizer: Path) -> str | None:
    """Where two imported tokenizers are one source vocabulary (every token at the same source id,
    the same rows) whose imports gave mmadapt's special roles other tokens, which roles and
    tokens ("eos <|im_end|> (the base's <|endoftext|>)"); else None. An instruct model's
    tokenizer names the end of a turn as its eos, its base the end of a document, so their imports
    put other rows at mmadapt's special ids, and the pieces between move (hf.hf_permutation)."""
    if not (is_hf(base_tokenizer) and is_hf(sibling_tokenizer)):
        return None
    a, b = HFTokenizer.read(base_tokenizer), HFTokenizer.read(sibling_tokenizer)
    if not a.same_vocabulary(b.vocabulary(), len(b.hf_ids)) or (
            a.hf_ids == b.hf_ids).all():
        return None

    def token(tok: HFTokenizer, h: int) -> str:
        return tok.token(h) or f"the row {h} past the tokenizer"
    return ", ".join(f"{role} {token(b, hb)} (the base's {token(a, ha)})"
                     for role, ha, hb in zip(SPECIAL_ROLES, a.hf_ids, b.hf_ids) if ha != hb)


def _group(name: str) -> str:
    m = re.match(r"(.*?layers\.\d+)\.", name)
    return m.group(1) if m else name.split(".")[0]


def sibling_key(base: Path, meta: dict) -> tuple:
    """What check_siblings' verdict on an artifact (its meta.json `meta`) over `base` reads beside
    the two models: whether it is expanded (its output side checked) and the base's weights as its
    Step 2 recorded them. A caller checks once per key, not per base: two Step-2 runs over one base
    can differ in both."""
    return (Path(base), meta.get("vocab_mode") == "expand", meta.get(SAMPLED_KEY), meta.get("primary_fingerprint"))


def read_base(base: str | Path, meta: dict) -> Source:
    """The base `base` of a graft at the checkpoint the artifact (its meta.json `meta`) was
    trained over or for, where the run still holds it (artifact.trained_for; else its newest,
    whose weights check_siblings checks against the artifact's record): a base trained on since
    Step 2 read it, or read at an older --source_tag, is the same model there."""
    return read_source(base, trained_for(Path(base), [meta]))


def check_once(checked: dict, base: Path, sibling: Path, meta: dict, body_only: bool = False) -> None:
    """check_siblings of the run `sibling` against `base` for an artifact (its meta.json `meta`),
    once per sibling_key in `checked` (the caller's dict over its artifacts: key -> its check,
    added to), each line printed once: a base's distances once, a warning that one artifact's
    check alone gives (an expanded one's over tied rows that moved) where that one comes."""
    if (key := sibling_key(base, meta)) in checked:
        return
    check = check_siblings(read_base(base, meta), read_source(sibling), meta, body_only=body_only)
    shown = {line for k, c in checked.items() if k[0] == key[0] for line in c.lines()}
    if lines := [line for line in check.lines() if line not in shown]:
        print("\n".join(lines), flush=True)
    checked[key] = check


def check_siblings(base: Source, sibling: Source, meta: dict,
                   sibling_weights: dict[str, torch.Tensor] | None = None, body_only: bool = False) -> SiblingCheck:
    """Refuse, in one line, a `sibling` that is not one of `base` (another family, tensor name or
    shape, another source vocabulary; for an expanded artifact (`meta`), untied output rows or
    an output bias that moved), or a `base` whose weights changed since the artifact's Step 2 recorded them
    (its fingerprints: artifact.primary_changed), else -> the per-group distances. sibling_weights: the sibling's
    full weights where the caller read them already. body_only: the sibling is a task model's
    encoder (an imported classifier, hf_classifier.py), which takes the artifact's word embeddings
    alone: only the bodies (ModelFamily.task_state) are compared, no output side."""
    what = f"{sibling.path} is not a sibling of {base.path}, the model the embeddings were trained over"
    if sibling.family.name != base.family.name:
        raise ValueError(f"{what}: it is a {sibling.family.name} model, the base a {base.family.name} one")
    mine, theirs = base.weights(), sibling_weights if sibling_weights is not None else sibling.weights()
    if primary_changed(meta, mine):
        raise ValueError(f"the embeddings were trained over {base.path} as its weights were when Step 2 ran, and they "
                         "have changed since (other weights under the same path): restore that model, or train "
                         "Step 2 again over it as it is")
    same = sampled_fingerprint(mine) == sampled_fingerprint(theirs)
    # Each one's primary model: a MINIJOINT base also holds its mini-model's head (after layer N),
    # which its export, and so a model fine-tuned from that, lacks
    (base_cfg, mine), (sibling_cfg, theirs) = (src.family.primary_model(src.cfg, w)
                                               for src, w in ((base, mine), (sibling, theirs)))
    if body_only:  # the encoders alone: a task head's tensors (BERT's pooler) are the sibling's own
        head = set(base.family.hf.task_head_names("classify")) if base.family.hf is not None else set()
        mine, theirs = ({k: v for k, v in base.family.task_state(cfg, w).items() if k not in head}
                        for cfg, w in ((base_cfg, mine), (sibling_cfg, theirs)))
    output = base.family.output_path(base_cfg)
    by_vocabulary = {*base.family.artifact_keys().values(), output.matrix, output.bias} - {None}
    for name in sorted(set(mine) | set(theirs)):
        if (name in by_vocabulary and name in mine and name in theirs and mine[name].shape[1:] == theirs[name].shape[1:]
                and mine[name].shape[0] != theirs[name].shape[0]):  # a fine-tune that added tokens, or resized
            raise ValueError(f"{what}: its vocabulary has {theirs[name].shape[0]} rows, the base's "
                             f"{mine[name].shape[0]} (tokens added, or its embeddings resized): it reads another "
                             "vocabulary; run Step 2 over it instead")
        if name not in mine or name not in theirs or mine[name].shape != theirs[name].shape:
            shape = lambda s: "absent" if name not in s else "x".join(map(str, s[name].shape))  # noqa: E731
            raise ValueError(f"{what}: its {name} is {shape(theirs)}, the base's {shape(mine)} (another "
                             "architecture); graft only into a model fine-tuned from the base")
    for field, ours in _attention(base.cfg).items():
        if (its := _attention(sibling.cfg)[field]) != ours:
            raise ValueError(f"{what}: its {field} is {its}, the base's {ours} (another architecture in tensors of "
                             "the same shapes); graft only into a model fine-tuned from the base")
    roles = other_roles(base.tokenizer, sibling.tokenizer)
    if roles is not None:
        model = (sibling.record.get("imported_from") or {}).get("model", "<its model directory>")
        raise ValueError(f"{sibling.path} has the vocabulary of {base.path}, the model the embeddings were trained "
                         f"over, with other tokens in mmadapt's special roles ({roles}): import it again with the "
                         f"base's roles, mmadapt import-hf --model {model} --output_dir <a new directory> "
                         f"--roles_from {base.path}")
    if pieces(sibling.tokenizer) != pieces(base.tokenizer):
        raise ValueError(f"{what}: its tokenizer has another vocabulary (a source vocabulary other than the base's); "
                         "run Step 2 over it instead")
    if meta.get("vocab_mode") == "expand" and not body_only:
        # The new pieces' output side was started and trained in one softmax beside the base's
        # frozen source entries: a sibling that moved its own scores the new pieces off that scale.
        moved = [(name, what_) for name, what_ in ((output.matrix, "untied output rows"), (output.bias, "output bias"))
                 if name is not None and name != base.family.word and _moved(mine[name], theirs[name], sibling)]
        if moved:
            name, what_ = moved[0]
            raise ValueError(f"{what} for an expanded vocabulary: its {what_} ({name}) moved from the base's, beside "
                             "which the new pieces' output side was trained; graft a --vocab_mode replace artifact "
                             "or run Step 2 over the sibling")
    sums: dict[str, list[float]] = {}
    for name, t in mine.items():
        d = sums.setdefault(_group(name), [0.0, 0.0])
        d[0] += float((theirs[name].double() - t.double()).pow(2).sum())
        d[1] += float(t.double().pow(2).sum())
    distance = {k: (a / b) ** 0.5 if b > 0 else float(a > 0) for k, (a, b) in sums.items()}
    warnings = []
    word = base.family.word
    if (meta.get("vocab_mode") == "expand" and not body_only and output.matrix == word
            and _moved(mine[word], theirs[word], sibling)):
        # Allowed (an instruct model trains its tied embeddings, and the refusal above would leave
        # it no expanded graft at all), but the reason for that refusal holds here too.
        warnings.append(f"warning: its word embeddings moved {distance[_group(word)]:.4f} of their norm from the "
                        "base's, and they are its output projection too (tied): an expanded vocabulary's new output "
                        "rows are trained beside the base's rows, not these; score the graft before serving it "
                        "(evaluate --graft), or use --vocab_mode replace")
    for field in POSITION_AND_NORM:
        ours, its = getattr(base.cfg, field), getattr(sibling.cfg, field)
        if ours != its:  # same shapes, other math: a long-context fine-tune's rotary scaling, say
            warnings.append(f"warning: its {field} is {its}, the base's {ours}: the embeddings were trained under the "
                            "base's; score the graft before serving it (evaluate --graft)")
    return SiblingCheck(base.path, sibling.path, distance, tuple(warnings), same)


def _moved(base: torch.Tensor, sibling: torch.Tensor, source: Source) -> bool:
    """Whether the sibling's tensor is not the base's, as the sibling's import stored it: one
    saved in a half precision (its record's imported_from.dtype: an fp32 base's instruct model
    in bf16) holds the base's frozen rows rounded to it, which is not a move."""
    dtype = (source.record.get("imported_from") or {}).get("dtype")
    if dtype is not None:
        base = base.to(getattr(torch, dtype)).to(sibling.dtype)
    return not torch.equal(base, sibling)


def sibling_check(base_run: str | Path, sibling_run: str | Path, meta: dict) -> SiblingCheck:
    """check_siblings of two run directories."""
    return check_siblings(read_source(base_run), read_source(sibling_run), meta)


def not_a_graft(artifact: str | Path, model: str | Path) -> ValueError:
    """The one refusal of --graft (export-hf, evaluate, predict) for an artifact trained over
    `model` itself, or over a byte-identical copy of it (the same weights): nothing to graft."""
    return ValueError(f"--graft puts embeddings into a sibling of the model they were trained over; {artifact} was "
                      f"trained over {model}'s own weights: drop --graft")


def nothing_to_graft() -> ValueError:
    """The one refusal of --graft (export-hf, predict) given no embeddings to put in."""
    return ValueError("--graft puts Step-2 embeddings into a sibling: pass --embeddings too")


def grafted(record: dict, sibling: str | Path) -> dict:
    """A Step-4 record of embeddings trained over a base and scored grafted into `sibling` (the
    run fine-tuned from the base): `grafted_into` says where, and its system is named apart from
    the same system over the base itself, so that `mmadapt report` given both keeps two curves
    (it draws one per system name) and no baseline lookup takes the graft for the base's own."""
    return {**record, "system": f"{record['system']} [graft into {Path(sibling).name}]", "grafted_into": str(sibling)}
