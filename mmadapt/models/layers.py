"""Building blocks that every model family shares: seeded full-weight initialisation, the
choice between megatron-core's tensor-parallel layers (TP > 1) and plain torch layers of the same
names and shapes (TP = 1), the vocab-parallel word embedding, and what a batch's padding and
scored positions look like to the layers.

Every family draws each full weight from its own seeded generator (`derive_seed`), so a model
starts from the same full weights in every tensor/pipeline layout, and a TP = 1 model runs with
no process group at all (evaluation, export, notebooks). Nothing here imports DeepSpeed.

Shapes (batch first throughout): b batch, s sequence, h hidden_size, m scored positions in the
batch (MLM: the masked ones; causal LM: every position with a next token), V vocab_size,
Vp = padded_vocab_size / tensor_model_parallel_size (ModelConfig.padded_vocab_size: V rounded up
to a multiple of the TP size).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import zlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mmadapt.config import ModelConfig
from mmadapt.mcore import ModelParallelConfig, tensor_parallel
from mmadapt.parallel import MODEL_PARALLEL_RNG, seeded, tp_rank
from mmadapt.tokens import PAD_ID


def derive_seed(seed: int, name: str) -> int:
    """A per-module seed: stable across runs, processes and parallel layouts."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**31


def mp_config(config: ModelConfig) -> ModelParallelConfig:
    # CPU initialisation builds each full ("master") weight from our seeded generator and keeps
    # this rank's slice, so every tensor-parallel layout starts from the same full weights.
    return ModelParallelConfig(tensor_model_parallel_size=config.tensor_model_parallel_size,
                               use_cpu_initialization=True, params_dtype=torch.float32)


def normal_init(std: float):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def init_like_megatron(module: nn.Module, init) -> nn.Module:
    """Materialise a layer built on the meta device as megatron's CPU initialisation does:
    `init` on the full weight, bias 0, and no other draw from the generator (the layer's own
    reset would consume one). Inside `with torch.device("meta")` (family.param_names: names and
    shapes only) it stays there: a 7B model's layers would take 28 GB and billions of draws."""
    if torch.get_default_device().type == "meta":
        return module
    module.to_empty(device="cpu")
    with torch.no_grad():
        init(module.weight)
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()
    return module


_CPU_PATHS = [True]  # off inside gpu_paths()


@contextlib.contextmanager
def gpu_paths():
    """Within it, a CPU runs the ops that a GPU would (F.dropout, SDPA with dropout) instead of
    its own faster ones (`dropout`, the attention's CPU path): for counting the host-side work of
    a GPU update on a CPU (tests/test_host_sync.py)."""
    _CPU_PATHS[0] = False
    try:
        yield
    finally:
        _CPU_PATHS[0] = True


def cpu_path(x: torch.Tensor) -> bool:
    """Whether `x`'s ops take a CPU-only path (outside gpu_paths())."""
    return x.device.type == "cpu" and _CPU_PATHS[0]


def attention_rng(x: torch.Tensor, tp: int):
    """The context an attention core's dropout draws in: the model-parallel stream
    (parallel.MODEL_PARALLEL_RNG), because heads are partitioned across tensor-parallel ranks and
    each rank's must draw its own masks. Its fork swaps the device generator's state, which dynamo
    cannot trace: in a compiled layer it is a graph break, which splits the layer into three graphs
    around an eager attention core (and on a GPU keeps CUDA graphs from spanning a layer). Inside a
    compiled graph at TP 1 there are no other ranks' heads to keep apart, so the core draws from the
    default generator, which also seeds the generator of the graph's other dropouts (fusion.py);
    eager models fork as always, so their draws, and every eager result, are unchanged."""
    if tp == 1 and torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return MODEL_PARALLEL_RNG.fork(x.device)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """F.dropout(x, p, training), with a cheaper keep mask on a CPU.

    torch's CPU dropout draws its mask with bernoulli_, one Mersenne-Twister draw (~13 ns) per
    element: 23% of a demo Step-2 update's operator time at one thread (benchmarks/results/
    demo_full_cpu2_20261130.md, where this dropout's forward and backward take 0.67 ms against
    1.64 for 131,072 elements). Here each 64-bit draw of the same generator gives four uniform
    16-bit integers u, and an element is kept where u < k = round((1 - p) * 2^16): with
    probability k / 2^16, within 7.6e-6 of 1 - p, and scaled by 2^16 / k, so that its expectation
    is x (in fp32; in bf16 the scale rounds, as F.dropout's does). The masks are as random
    as torch's and as reproducible (the default generator, seeded, saved and forked as before,
    parallel.ModelParallelRNG), but not the same draws. On other devices, in compiled graphs and
    for p within 2^-17 of 0 or 1, F.dropout: CUDA draws its mask inside the fused kernel."""
    if not training or p == 0.0:
        return x
    k = round((1.0 - p) * 65536)
    if not cpu_path(x) or not 0 < k < 65536 or torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    bits = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-2**63, None)  # 64 random bits each
    keep = torch.empty_like(x)  # compared straight into x's dtype: a bool mask's .to() costs twice the draw
    torch.lt(bits.view(torch.int16)[:x.numel()].view(x.shape), k - 32768, out=keep)  # u - 2^15 < k - 2^15
    return x * keep.mul_(65536 / k)


def position_rows(table: nn.Embedding, s: int) -> torch.Tensor:
    """Learned positions 0..s-1 -> [s, h]. Frozen (Step 2 on), the table's first s rows as a
    view: the same numbers as their lookup, without its arange and gather. Trained, the lookup,
    whose backward sums each position's gradient in the order it always has (a broadcast add's
    backward would sum the batch in another order: other bits)."""
    if table.weight.requires_grad and torch.is_grad_enabled():
        return table(torch.arange(s, device=table.weight.device))
    return table.weight[:s]


class Dropout(nn.Dropout):
    """nn.Dropout through `dropout` (the faster CPU mask)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


class Linear(nn.Linear):
    """torch's linear with megatron's call convention (returns `(output, None)`), for TP=1."""

    def __init__(self, in_features: int, out_features: int, init, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias, device="meta")
        init_like_megatron(self, init)

    def forward(self, x: torch.Tensor):
        return super().forward(x), None


def column_linear(config: ModelConfig, in_features: int, out_features: int, init, bias: bool = True):
    """y = xW^T (+ b), W [out, in] split by rows over TP ranks: each rank computes its slice of y."""
    if config.tensor_model_parallel_size == 1:
        return Linear(in_features, out_features, init, bias)
    return tensor_parallel.ColumnParallelLinear(in_features, out_features, config=mp_config(config),
                                                init_method=init, bias=bias, gather_output=False)


def row_linear(config: ModelConfig, in_features: int, out_features: int, init, bias: bool = True):
    """y = xW^T (+ b), W [out, in] split by columns over TP ranks: partial products summed."""
    if config.tensor_model_parallel_size == 1:
        return Linear(in_features, out_features, init, bias)
    return tensor_parallel.RowParallelLinear(in_features, out_features, config=mp_config(config), init_method=init,
                                             bias=bias, input_is_parallel=True, skip_bias_add=False)


# --- a vocabulary padded for tensor parallelism (ModelConfig.padded_vocab_size) --------------------------

def padded_init(init, config: ModelConfig):
    """`init` for the full weight [Vp_total, ...] of a padded vocabulary: the V real rows drawn as an
    unpadded layer draws them (the same full weights as tensor parallel 1's), the padding zeros."""
    v = config.vocab_size

    def draw(w: torch.Tensor) -> torch.Tensor:
        init(w[:v])
        w[v:].zero_()
        return w
    return draw if config.padded_vocab_size != v else init


def real_rows(config: ModelConfig) -> int | None:
    """How many of this tensor-parallel rank's Vp vocabulary rows are pieces (the rest padding:
    ModelConfig.padded_vocab_size); None where the vocabulary is not padded. A head passes it to
    vocab_linear."""
    if config.padded_vocab_size == config.vocab_size:
        return None
    start, stop = vocab_range(config)
    return max(0, min(stop, config.vocab_size) - start)


def tag_vocab_padding(p: nn.Parameter, config: ModelConfig) -> nn.Parameter:
    """Tag this rank's slice of a vocabulary-indexed weight of a padded vocabulary with
    `vocab_padded_from`, the real vocab_size: what a full state dict holds (engine._shard pads it
    for the rank; the checkpoint's client state names it, and checkpoint.load_full_state_dict
    cuts the padding). An unpadded vocabulary's parameter is left as it is."""
    if config.padded_vocab_size != config.vocab_size:
        p.vocab_padded_from = config.vocab_size
    return p


def to_tp_region(x: torch.Tensor, tp: int) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over the TP ranks (none at TP=1)."""
    return x if tp == 1 else tensor_parallel.copy_to_tensor_model_parallel_region(x)


class WordEmbedding(nn.Module):
    """Vocab-parallel token embedding, [Vp, h] on each rank, also the output projection of every
    MLM head (and of a decoder whose output projection is tied). An expanded vocabulary
    (frozen_vocab_size > 0) holds its rows as two parameters (SplitVocabEmbedding)."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__()
        init = normal_init(config.init_method_std)
        with seeded(derive_seed(seed, "word_embeddings")):
            if config.frozen_vocab_size:
                self.word_embeddings = SplitVocabEmbedding(config, init)
            elif config.tensor_model_parallel_size == 1:
                self.word_embeddings = init_like_megatron(
                    nn.Embedding(config.vocab_size, config.hidden_size, device="meta"), init)
            else:
                self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
                    config.padded_vocab_size, config.hidden_size, init_method=padded_init(init, config),
                    config=mp_config(config))
                tag_vocab_padding(self.word_embeddings.weight, config)

    @property
    def weight(self) -> nn.Parameter:  # [Vp, h]; an expanded vocabulary's is `rows`
        return _one_block(self.word_embeddings)

    @property
    def rows(self) -> tuple[nn.Parameter, ...]:
        """This rank's rows of the embedding as consecutive blocks (`vocab_linear` projects with
        them): ([Vp, h],), or, for an expanded vocabulary, its source rows and its new rows."""
        return vocab_rows(self.word_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        return self.word_embeddings(input_ids)


# --- an expanded vocabulary (Step 2 --vocab_mode expand, mmadapt/expand.py) -------------------------------
# The source's F = frozen_vocab_size rows of every vocabulary-indexed weight keep their ids; the
# target's new pieces are rows F..V-1. Those are held as two parameters, `<name>` (the source's
# rows, frozen) and `new_<name>` (the new rows, trained), so the optimizer holds the new rows and
# nothing else: no gradient mask over a whole matrix, which AdamW's weight decay (or any
# optimizer's state) could still move. At TP > 1 each rank holds megatron's even slice
# [r * Vp, (r + 1) * Vp) of the V rows, which may fall in the source rows, in the new rows or
# across both: its share of each part (possibly none) is a parameter of its own.

def new_rows_name(name: str) -> str:
    """The parameter that holds the new rows of the vocabulary-indexed parameter `name` in an
    expanded vocabulary: `heads.heads.0.bias` -> `heads.heads.0.new_bias`."""
    module, _, attr = name.rpartition(".")
    return f"{module}.new_{attr}" if module else f"new_{attr}"


def vocab_range(config: ModelConfig) -> tuple[int, int]:
    """This tensor-parallel rank's rows [start, stop) of the (padded) vocabulary (megatron's even split)."""
    per = config.padded_vocab_size // config.tensor_model_parallel_size
    rank = tp_rank() if config.tensor_model_parallel_size > 1 else 0
    return rank * per, (rank + 1) * per


def split_vocab(full: torch.Tensor, config: ModelConfig) -> tuple[nn.Parameter, nn.Parameter]:
    """This rank's rows of `full` [V, ...] as (its source rows, its new rows): each a parameter
    tagged with `vocab_rows`, its rows [lo, hi) in its own part's full tensor (the source's
    [F, ...], the new rows' [V - F, ...]; engine.load_full_weights slices by it), and, at TP > 1,
    as megatron tags a vocab-parallel weight (partition dim 0: checkpoints concatenate the ranks'
    slices in rank order, and gradient norms count each rank's rows once); `vocab_part` says
    which part it is."""
    start, stop = vocab_range(config)
    f = config.frozen_vocab_size
    parts = []
    for part, lo, hi, offset in (("source", min(start, f), min(stop, f), 0), ("new", max(start, f), max(stop, f), f)):
        p = nn.Parameter(full[lo:hi].clone())
        p.vocab_rows, p.vocab_part = (lo - offset, hi - offset), part
        if config.tensor_model_parallel_size > 1:
            tensor_parallel.set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)
        parts.append(p)
    return parts[0], parts[1]


class SplitVocabRows(nn.Module):
    """A vocabulary-indexed weight [V, h] of an expanded vocabulary: `weight` (this rank's source
    rows) and `new_weight` (its new rows), drawn as one full matrix by `init` (the same full
    weights as the unsplit layer's in every layout) and then split. The decoder's untied output
    projection, and the storage of SplitVocabEmbedding."""

    def __init__(self, config: ModelConfig, init):
        super().__init__()
        full = torch.empty(config.vocab_size, config.hidden_size)
        init(full)
        self.weight, self.new_weight = split_vocab(full, config)
        self.tp = config.tensor_model_parallel_size
        self.start = vocab_range(config)[0]

    @property
    def rows(self) -> tuple[nn.Parameter, nn.Parameter]:
        return self.weight, self.new_weight


class SplitVocabEmbedding(SplitVocabRows):
    """The word embedding of an expanded vocabulary, looked up as megatron's VocabParallelEmbedding
    does (ids outside this rank's rows give zeros, the ranks' outputs are summed), one lookup per
    part: the backward writes only into the parameter that holds the row."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        out = None
        for part, base in ((self.weight, self.start), (self.new_weight, self.start + self.weight.shape[0])):
            if part.shape[0] == 0:
                continue
            local = input_ids - base
            outside = (local < 0) | (local >= part.shape[0])
            rows = F.embedding(local.clamp(0, part.shape[0] - 1), part).masked_fill(outside[..., None], 0.0)
            out = rows if out is None else out + rows
        if self.tp == 1:
            return out
        if torch.is_grad_enabled() and not out.requires_grad:
            # This rank holds no row that trains (its slice is all source rows), but the ranks
            # that do need the body's backward, whose tensor-parallel collectives every rank must
            # join: start the graph here.
            out = out.detach().requires_grad_()
        return tensor_parallel.reduce_from_tensor_model_parallel_region(out)


def _one_block(module: nn.Module) -> nn.Parameter:
    if isinstance(module, SplitVocabRows):
        raise TypeError("an expanded vocabulary's weight is two parameters: use its `rows` (layers.vocab_rows)")
    return module.weight


def vocab_rows(module: nn.Module) -> tuple[nn.Parameter, ...]:
    """The row blocks of a vocabulary-indexed linear or embedding layer: (weight,) or, split,
    (source rows, new rows)."""
    return module.rows if isinstance(module, SplitVocabRows) else (module.weight,)


def vocab_blocks(config: ModelConfig) -> int:
    """How many row blocks a vocabulary-indexed weight has (`vocab_rows`): 2 when expanded."""
    return 2 if config.frozen_vocab_size else 1


def trained_vocab_attrs(config: ModelConfig, module: str) -> list[str]:
    """The attributes under `module` of a vocabulary-indexed weight's blocks that can train on this
    rank (a pipeline's tied weight: DeepSpeed all-reduces their gradients between its copies):
    the whole weight, or the new rows, when this rank holds any."""
    if not config.frozen_vocab_size:
        return [f"{module}.weight"]
    start, stop = vocab_range(config)
    return [f"{module}.new_weight"] if stop > config.frozen_vocab_size else []


def vocab_linear(x: torch.Tensor, weights: torch.Tensor | tuple[torch.Tensor, ...],
                 biases: torch.Tensor | tuple[torch.Tensor, ...] | None = None, real: int | None = None
                 ) -> torch.Tensor:
    """logits [m, Vp] = x [m, h] W^T (+ b), W [Vp, h] (and b [Vp]) one tensor or its rows as
    consecutive blocks (`vocab_rows`). One block: F.linear. Several (an expanded vocabulary): one
    product per block, concatenated, so autograd computes the weight gradient of the new rows
    only (the source rows' would be 2 m h F FLOPs spent on a matrix that does not train).
    real: how many of the Vp rows are pieces (`real_rows`; None: all): the padding's logits -inf."""
    weights = (weights,) if isinstance(weights, torch.Tensor) else weights
    biases = (biases,) if isinstance(biases, torch.Tensor) else biases or (None,) * len(weights)
    out = [F.linear(x, w, b) for w, b in zip(weights, biases) if len(weights) == 1 or w.shape[0]]
    out = out[0] if len(out) == 1 else torch.cat(out, dim=-1)
    if real is not None and real < out.shape[-1]:
        # This rank's padding rows are no piece: -inf, so that the softmax, the loss and its
        # gradient (zero there) are those of the unpadded vocabulary. In place: F.linear's
        # backward reads its inputs, not its output.
        out.narrow(-1, real, out.shape[-1] - real).fill_(float("-inf"))
    return out


def masked_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [b, s] (-100: not scored) -> (masked_index [m], targets [m]): the flat indices into
    b * s of the scored positions (MLM: the masked ones; causal LM: those with a next token), in row-major order, and their targets. Call it on the host
    copy of a batch (train.batch_to_device does): on a device tensor, `nonzero` waits for the device."""
    flat = labels.reshape(-1)
    masked_index = flat.ge(0).nonzero().squeeze(1)
    return masked_index, flat.index_select(0, masked_index)


class Padding(NamedTuple):
    """Where a batch's padding is, counted on the host (train.host_batch) so that no layer has to
    ask the device: `any`, whether input_ids holds PAD_ID at all; `tokens`, how many positions
    do not (T); `max_len`, the longest sequence without its padding."""
    any: bool
    tokens: int
    max_len: int

    @staticmethod
    def of(input_ids: torch.Tensor) -> "Padding":
        """Count on `input_ids` [b, s]: free on a host tensor, a device wait on a device one."""
        lengths = input_ids.ne(PAD_ID).sum(1)
        return Padding(bool(lengths.lt(input_ids.shape[1]).any()), int(lengths.sum()), int(lengths.max()))


class Jagged(NamedTuple):
    """The real tokens of a padded batch, for attention_impl "varlen": token_index [T], their flat
    indices into b * s in row-major order (so each sequence's tokens are contiguous), and
    offsets [b + 1], where each sequence starts among them."""
    token_index: torch.Tensor
    offsets: torch.Tensor
    max_len: int


def attention_mask(input_ids: torch.Tensor, padding: Padding | None, impl: str = "sdpa"):
    """What every layer's attention needs to know about padding, built once per forward:
    None when the batch has none (attention then gets no mask, which is what lets SDPA choose its
    flash kernel on a GPU); for "varlen", the `Jagged` layout of the real tokens; otherwise
    [b, 1, 1, s] bool, True where a key may be attended. `padding` comes from the host
    (train.host_batch); None counts it here, which makes the host wait for the device
    (evaluation, tests)."""
    padding = Padding.of(input_ids) if padding is None else padding
    if not padding.any:
        return None
    attend = input_ids.ne(PAD_ID)  # [b, s]
    if impl != "varlen":
        return attend[:, None, None, :]
    # nonzero_static: the host already knows T, so the device need not report it.
    token_index = torch.nonzero_static(attend.reshape(-1), size=padding.tokens).squeeze(1)
    return Jagged(token_index, F.pad(attend.sum(1).cumsum(0), (1, 0)), padding.max_len)


# (torch warns that nested tensors are a prototype when its CPU fallback builds strided ones;
# "varlen" uses the jagged layout, the one torch recommends: filtered by quiet.py, which
# --verbose undoes.)


# Never traced by torch.compile (--fusion compile): the jagged tensors are a tensor subclass, and
# AOTAutograd's compiled backward over them failed on CUDA (torch 2.11: "expected
# len(meta.attrs) == len(runtime_subclass_keys), got 3 != 4", benchmarks/results/
# gpu_summary_h200_20261126.md). Nothing is lost: SDPA is one fused kernel either way, and the
# packing around it is two index copies; the layer's other work is still compiled.
@torch.compiler.disable
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, jagged: Jagged, p: float) -> torch.Tensor:
    """q, k, v [b, np, s, hd] -> context [b, np, s, hd] computed over the real tokens only, as
    jagged (nested) tensors: on a GPU, SDPA runs them through its variable-length flash kernel
    (dropout included) and spends nothing on padding; padded positions get a zero context.
    Their outputs are never read (every loss and pooling skips padding), and no real token
    attends to them, as with a mask."""
    b, heads, s, hd = q.shape

    def pack(x):  # [b, np, s, hd] -> jagged [b, np, j, hd]
        real = x.transpose(1, 2).reshape(b * s, heads, hd).index_select(0, jagged.token_index)  # [T, np, hd]
        return torch.nested.nested_tensor_from_jagged(real, jagged.offsets, max_seqlen=jagged.max_len).transpose(1, 2)

    out = F.scaled_dot_product_attention(pack(q), pack(k), pack(v), dropout_p=p).transpose(1, 2).values()
    full = out.new_zeros(b * s, heads, hd).index_copy(0, jagged.token_index, out)  # [b * s, np, hd]
    return full.view(b, s, heads, hd).transpose(1, 2)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@functools.cache
def takes_rows(kind: type, method: str = "forward") -> bool:
    """Whether a class's `method` (a layer's forward, a model's logits) computes its output at
    given rows alone (a `rows` argument)."""
    return "rows" in inspect.signature(getattr(kind, method)).parameters


def run_layers(layers: nn.ModuleList, x: torch.Tensor, wanted: tuple[int, ...], *args,
               rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """x [b, s, h] through the layers up to the highest of `wanted` (each called with `args`
    after x) -> the output [b, s, h] of each layer whose 1-based `layer_number` is in `wanted`, in
    order. The layers above it are not run: nothing reads them (a middle layer's sentence vectors
    cost half a forward pass, not a whole one). rows [m]: flat indices into b * s at which alone
    the highest wanted layer's output is wanted, [m, h]: computed there alone by a layer whose
    forward takes `rows` (the encoder's TransformerLayer), gathered from its whole output from
    any other (a family's own layer class keeps working, without the saving)."""
    out = []
    for layer in layers:
        if rows is not None and layer.layer_number == wanted[-1]:
            x = layer(x, *args, rows=rows) if takes_rows(type(layer)) else gathered(layer(x, *args), rows)
        else:
            x = layer(x, *args)
        if layer.layer_number in wanted:
            out.append(x)
            if len(out) == len(wanted):
                break
    return out


# The most fp32 logits (rows x Vp entries) a head materialises at once: above it the projection and
# cross-entropy run chunk by chunk (linear_cross_entropy). 2^28 entries are 1 GiB of fp32 logits,
# and as much again for their gradient: Qwen2-0.5B's 151,936 pieces at 4 x 2,048 scored rows
# would take 5 GiB each unchunked; below it (every model trained on a CPU here) nothing changes.
LOGITS_BUDGET = 2**28


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(x W^T + b, targets), W [Vp, h] as row blocks, one chunk of
    rows at a time. The loss is a scalar that the model only ever scales (a mean, the heads'
    weights), so d loss / d logits = softmax - onehot is known in the forward: each chunk's
    gradients for x, W and b are computed there and its logits freed, and the backward scales
    them. The same FLOPs as the unchunked path (Liger-Kernel's fused linear cross-entropy does
    the same on a GPU), with logits of `chunk` rows alive instead of all m."""

    @staticmethod
    def forward(ctx, x, targets, chunk: int, grads: bool, n: int, *rows_and_biases):
        # grads: whether the caller records autograd (forward runs with it off, and a parameter's
        # requires_grad stays True under no_grad: an evaluation would compute every gradient)
        weights, biases = rows_and_biases[:n], rows_and_biases[n:]
        gx = torch.zeros_like(x) if grads and x.requires_grad else None
        gw = [torch.zeros_like(w, dtype=torch.float32) if grads and w.requires_grad else None for w in weights]
        gb = [torch.zeros_like(b, dtype=torch.float32) if grads and b is not None and b.requires_grad else None
              for b in biases]
        sizes = [w.shape[0] for w in weights]
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for lo in range(0, x.shape[0], chunk):
            xc, tc = x[lo:lo + chunk], targets[lo:lo + chunk]
            logits = vocab_linear(xc, weights, biases if biases else None).float()  # [c, Vp]
            lse = logits.logsumexp(-1)  # [c]
            total += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            g[torch.arange(len(tc), device=g.device), tc] -= 1.0
            g = g.to(x.dtype)
            for i, part in enumerate(g.split(sizes, dim=1)):
                if gx is not None:  # (not addmm_: FlopCounterMode has no entry for it and counted it as 0)
                    gx[lo:lo + chunk] += part @ weights[i]
                if gw[i] is not None:
                    gw[i].add_((part.t() @ xc).float())
                if gb and gb[i] is not None:
                    gb[i].add_(part.float().sum(0))
        ctx.n, ctx.has = n, [t is not None for t in (gx, *gw, *gb)]
        ctx.dtypes = [w.dtype for w in weights] + [b.dtype for b in biases if b is not None]
        ctx.save_for_backward(*[t for t in (gx, *gw, *gb) if t is not None])
        return total

    @staticmethod
    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) * grad if has else None for has in ctx.has]
        gx, rest = grads[0], grads[1:]
        rest = [g.to(dt) if g is not None else None for g, dt in zip(rest, ctx.dtypes + [None] * len(rest))]
        return (gx, None, None, None, None, *rest)


@torch.compiler.disable  # a loop over a data-dependent number of chunks: eager, between compiled graphs
def linear_cross_entropy(x: torch.Tensor, rows: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor, ...] | None,
                         targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """sum over the m rows of x [m, h] of cross_entropy(x W^T + b, targets [m]) without the [m, Vp]
    logits (_LinearCrossEntropy): W [Vp, h] as row blocks (`vocab_rows`), b [Vp] likewise or None."""
    biases = tuple(biases) if biases is not None else ()
    return _LinearCrossEntropy.apply(x, targets, chunk, torch.is_grad_enabled(), len(rows), *rows, *biases)


def gathered(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [b, s, d] at the flat positions `index` [m] of b * s -> [m, d]; an x of [m, d] is those
    rows already (a last layer run at them alone: `run_layers`' rows)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1]).index_select(0, index)


def head_logits(heads: nn.ModuleList, hiddens: list[torch.Tensor], output_rows: tuple[torch.Tensor, ...],
                rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each head's logits from its hidden states (hiddens: one [b, s, h] per head, the last one
    [m, h] where the model ran its last layer at `rows` alone) and the output projection's row
    blocks (`vocab_rows`) -> [b, s, Vp] per head, or with rows [m] (flat indices into b * s) [m, Vp]
    at those positions alone: no [b * s, Vp] block of which a caller keeps m rows."""
    if rows is None:
        return [head(h.reshape(-1, h.shape[-1]), output_rows).view(*h.shape[:2], -1) for head, h in zip(heads, hiddens)]
    return [head(gathered(h, rows), output_rows) for head, h in zip(heads, hiddens)]


@functools.lru_cache(maxsize=64)
def device_constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`values` as a tensor on `device`, made once: a tensor made from host data in a micro-batch
    is a blocking copy on a GPU (torch synchronises the stream after a pageable host-to-device
    copy), the host waiting for every queued kernel."""
    return torch.tensor(values, device=device, dtype=dtype)


def head_losses(heads: nn.ModuleList, hiddens: list[torch.Tensor], masked_index: torch.Tensor,
                targets: torch.Tensor, output_rows: tuple[torch.Tensor, ...],
                loss_weights: tuple[float, ...] | None, split: int | None = None):
    """Every head's loss over the scored positions, and the model's loss from them.

    hiddens: one [b, s, h] per head (or [m, h]: its scored rows already); masked_index [m]: the
    scored positions as flat indices into b * s (`masked_positions`), targets [m]; each head maps
    its rows [m, h] and the output projection's row blocks (`vocab_rows`: [Vp, h] in all) to
    logits [m, Vp]. Only the m scored rows reach a head: the rows are gathered by
    index, not by a boolean mask, so m comes from the host (a boolean gather on the device would
    make the host wait for the device to count m). Cross-entropy in fp32, vocab-parallel at TP > 1.
    split (Step 2's source-language replay, train.py): the scored positions [0, split) and
    [split, m) are two texts whose losses are logged apart (a host count: the replay rows come
    first in a micro-batch, and masked_index is row-major).
    -> (the mean of the heads' losses, or their weighted mean with loss_weights (normalised);
    each head's loss [num heads], detached; with `split`, followed by `split_sums`' four entries)."""
    losses, sums = [], []
    vocab = sum(w.shape[0] for w in output_rows)
    for head, h in zip(heads, hiddens):
        rows = gathered(h, masked_index)  # [m, h]
        if not len(targets):
            # No scored position in the micro-batch (MLM blocks of a lone </s>: data.mask_tokens):
            # a zero loss through the head, whose parameters then get zero gradients like every
            # other rank's (a mean over no piece was NaN, which stopped the run as diverged)
            losses.append(head(rows, output_rows).float().sum() * 0.0)
            if split is not None:
                sums.append(losses[-1].new_zeros(2))
            continue
        if split is None and head.tp == 1 and len(targets) * vocab > LOGITS_BUDGET:
            # Too many logits to hold at once: the projection and loss chunk by chunk (same loss).
            losses.append(linear_cross_entropy(head.features(rows), output_rows, head.bias_rows, targets,
                                               max(1, LOGITS_BUDGET // vocab)) / len(targets))
            continue
        logits = head(rows, output_rows).float()  # [m, Vp]
        if split is not None:
            per_piece = (F.cross_entropy(logits, targets, reduction="none") if head.tp == 1 else
                tensor_parallel.vocab_parallel_cross_entropy(logits, targets))  # [m]
            losses.append(per_piece.mean())
            sums.append(torch.stack([per_piece[:split].sum(), per_piece[split:].sum()]))
        elif head.tp == 1:
            losses.append(F.cross_entropy(logits, targets))
        else:
            losses.append(tensor_parallel.vocab_parallel_cross_entropy(logits, targets).mean())
    if len(losses) == 1 and loss_weights is None and split is None:
        # One head's mean is its loss, to the bit: no stack and mean (two launches, and their backward)
        return losses[0], losses[0].detach().reshape(1)
    per_head = torch.stack(losses)
    weights = (device_constant(tuple(loss_weights), per_head.device, per_head.dtype)
               if loss_weights is not None else None)
    loss = per_head.mean() if weights is None else (per_head * weights).sum()
    if split is None:
        return loss, per_head.detach()
    return loss, torch.cat([per_head.detach(), split_sums(torch.stack(sums).detach(), weights, split, len(targets))])


def split_sums(sums: torch.Tensor, weights: torch.Tensor | None, split: int, m: int) -> torch.Tensor:
    """sums [num heads, 2] (each head's summed loss over the scored positions [0, split) and
    [split, m)) -> [4]: (loss sum, count) of the first part, then of the second, the heads weighted as
    the loss weighs them. Sums and counts, not means: a micro-batch may hold no position of one
    part, and added over micro-batches and ranks their ratio is the loss per scored piece."""
    w = sums.new_full((sums.shape[0],), 1.0 / sums.shape[0]) if weights is None else weights
    total = (sums * w[:, None]).sum(0)
    # the counts as fills (a kernel each), not copies of host numbers (new_tensor: a stream sync on a GPU)
    return torch.stack([total[0], sums.new_full((), float(split)), total[1], sums.new_full((), float(m - split))])
