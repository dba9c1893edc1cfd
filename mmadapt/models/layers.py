"""Building blocks that every model family shares: seeded full-weight initialisation, the
choice between megatron-core's tensor-parallel layers (TP > 1) and plain torch layers of the same
names and shapes (TP = 1), the vocab-parallel word embedding, and what a batch's padding and
scored positions look like to the layers.

Every family draws each full weight from its own seeded generator (`derive_seed`), so a model
starts from the same full weights in every tensor/pipeline layout, and a TP = 1 model runs with
no process group at all (evaluation, export, notebooks). Nothing here imports DeepSpeed.

Shapes (batch first throughout): b batch, s sequence, h hidden_size, m scored positions in the
batch (MLM: the masked ones; causal LM: every position with a next token), V vocab_size,
Vp = V / tensor_model_parallel_size.
"""

from __future__ import annotations

import warnings
import zlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core import ModelParallelConfig, tensor_parallel
from torch import nn

from mmadapt.config import ModelConfig
from mmadapt.parallel import seeded
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
    reset would consume one)."""
    module.to_empty(device="cpu")
    with torch.no_grad():
        init(module.weight)
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()
    return module


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


def to_tp_region(x: torch.Tensor, tp: int) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over the TP ranks (none at TP=1)."""
    return x if tp == 1 else tensor_parallel.copy_to_tensor_model_parallel_region(x)


class WordEmbedding(nn.Module):
    """Vocab-parallel token embedding [V, h], also the output projection of every MLM head."""

    def __init__(self, config: ModelConfig, seed: int = 1234):
        super().__init__()
        init = normal_init(config.init_method_std)
        with seeded(derive_seed(seed, "word_embeddings")):
            if config.tensor_model_parallel_size == 1:
                self.word_embeddings = init_like_megatron(
                    nn.Embedding(config.vocab_size, config.hidden_size, device="meta"), init)
            else:
                self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
                    config.vocab_size, config.hidden_size, init_method=init, config=mp_config(config))

    @property
    def weight(self) -> nn.Parameter:  # [Vp, h]
        return self.word_embeddings.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        return self.word_embeddings(input_ids)


def masked_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [b, s] (-100: not scored) -> (masked_index [m], targets [m]): the flat indices into
    b * s of the scored positions (MLM: the masked ones; causal LM: those with a next token), in row-major order, and their targets. Call it on the host
    copy of a batch (train.to_device does): on a device tensor, `nonzero` waits for the device."""
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


# torch warns that nested tensors are a prototype when its CPU fallback builds strided ones;
# "varlen" uses the jagged layout, the one torch recommends.
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")


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


def run_layers(layers: nn.ModuleList, x: torch.Tensor, wanted: tuple[int, ...], *args) -> list[torch.Tensor]:
    """x [b, s, h] through every layer (each called with `args` after x) -> the output [b, s, h]
    of each layer whose 1-based `layer_number` is in `wanted`, in order."""
    out = []
    for layer in layers:
        x = layer(x, *args)
        if layer.layer_number in wanted:
            out.append(x)
    return out


def head_losses(heads: nn.ModuleList, hiddens: list[torch.Tensor], masked_index: torch.Tensor,
                targets: torch.Tensor, output_weight: torch.Tensor, loss_weights: tuple[float, ...] | None):
    """Every head's loss over the scored positions, and the model's loss from them.

    hiddens: one [b, s, h] per head; masked_index [m]: the scored positions as flat indices into
    b * s (`masked_positions`), targets [m]; each head maps its rows [m, h] and the output weight
    [Vp, h] to logits [m, Vp]. Only the m scored rows reach a head: the rows are gathered by
    index, not by a boolean mask, so m comes from the host (a boolean gather on the device would
    make the host wait for the device to count m). Cross-entropy in fp32, vocab-parallel at TP > 1.
    -> (the mean of the heads' losses, or their weighted mean with loss_weights (normalised);
    each head's loss [num heads], detached)."""
    losses = []
    for head, h in zip(heads, hiddens):
        logits = head(h.reshape(-1, h.shape[-1]).index_select(0, masked_index), output_weight).float()  # [m, Vp]
        if head.tp == 1:
            losses.append(F.cross_entropy(logits, targets))
        else:
            losses.append(tensor_parallel.vocab_parallel_cross_entropy(logits, targets).mean())
    per_head = torch.stack(losses)
    if loss_weights is None:
        return per_head.mean(), per_head.detach()
    return (per_head * per_head.new_tensor(loss_weights)).sum(), per_head.detach()
