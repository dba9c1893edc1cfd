"""Host-side bookkeeping that every family's pipeline stages share (models/<family>/pipeline.py).

DeepSpeed's pipeline engine calls each stage's layers once per micro-batch, in micro-batch
order, with only the activation tuple. What the host already knows about those micro-batches
(each one's Padding, and on the last stage its scored positions and their targets) is queued on
the modules that need it before train_batch/eval_batch (`set_host_batches`), so no layer has to
ask the device. The heads record each micro-batch's per-head losses for logging
(`take_head_losses`). Both stay out of compiled graphs (torch.compiler.disable): traced, dynamo
would guard on each micro-batch's values and recompile for every new one.
"""

from __future__ import annotations

import collections

import torch

from mmadapt.models.layers import Padding, masked_positions


class PaddingQueue:
    """Mixin of a stage layer that builds its attention mask: the Padding of each micro-batch
    to come, in order (empty: count it on the device)."""

    def init_queue(self) -> None:
        self.pending: collections.deque = collections.deque()

    @torch.compiler.disable
    def next_padding(self) -> Padding | None:
        return self.pending.popleft() if self.pending else None


class ScoredQueue:
    """Mixin of the last stage's heads: (masked_index, targets, split, factor) of each micro-batch
    to come, in order (the tensors on the device; split: layers.head_losses', or None; factor:
    train.per_token_factors', on its loss, or None), and each micro-batch's logged losses
    [num heads (+ 4 with a split)]."""

    def init_queue(self) -> None:
        self.pending: collections.deque = collections.deque()
        self.head_losses: list[torch.Tensor] = []
        self.factor, self.split = None, None

    @torch.compiler.disable
    def next_scored(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        masked_index, targets, split, self.factor = (self.pending.popleft() if self.pending else
                                                     (*masked_positions(labels), None, None))
        self.split = split
        return masked_index, targets, split

    @torch.compiler.disable
    def record(self, loss: torch.Tensor, per_head: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss for DeepSpeed's backward, its per-head losses kept for logging,
        both times its factor (as train.lm_step scales them off a pipeline: `scaled_losses`)."""
        loss, per_head = scaled_losses(loss, per_head, self.factor, self.split)
        self.head_losses.append(per_head)
        return loss


def scaled_losses(loss: torch.Tensor, per_head: torch.Tensor, factor, split: int | None):
    """A micro-batch's (loss, logged losses) times its loss factor (train.per_token_factors; None:
    as they are), but for a replay split's (loss sum, count) pairs (layers.split_sums), which stay
    as they are: added over micro-batches and ranks, their ratio is the loss per scored piece of
    each text (scaled, it would weigh each micro-batch by its scored count a second time)."""
    if factor is None:
        return loss, per_head
    logged = per_head * factor if split is None else torch.cat([per_head[:-4] * factor, per_head[-4:]])
    return loss * factor, logged


def set_host_batches(pipe: torch.nn.Module, padding: list[Padding], masked: list[tuple]) -> None:
    """Hand this rank's stage what the host knows about the micro-batches of the next
    train_batch / eval_batch, in their order: each one's Padding, and (masked_index, targets,
    split, factor) for the heads (ScoredQueue)."""
    for m in pipe.modules():
        if isinstance(m, (PaddingQueue, ScoredQueue)):
            m.pending.clear()
            m.pending.extend(padding if isinstance(m, PaddingQueue) else masked)


def take_head_losses(pipe: torch.nn.Module, num_heads: int, device: torch.device) -> torch.Tensor:
    """Each head's loss over the micro-batches just run (num_heads: how many losses each
    micro-batch logs, layers.head_losses), on the last stage (which holds the heads); zeros on
    the other stages."""
    heads = next((m for m in pipe.modules() if isinstance(m, ScoredQueue)), None)
    per_head = torch.zeros(num_heads, device=device)
    if heads is not None and heads.head_losses:
        per_head += torch.stack(heads.head_losses).mean(0)
        heads.head_losses.clear()
    return per_head
