"""The micro-batch fit (mmadapt/microbatch.py), its arithmetic and its merge by hand; a whole
run's re-split is tested on the decoder, whose blocks score alike (test_llama_steps)."""

import torch

from mmadapt.microbatch import GIB, fitted_merge, merged


def test_the_largest_merge_predicted_to_fit():
    """resident + m * micro * per_block <= limit, m dividing the accumulation: the H200's
    roberta-base Step 1 (~4 GiB resident, ~0.16 GiB a block: benchmarks/results/
    gpu_summary_h200_20261129.md) asked for as micro 32 x 8."""
    assert fitted_merge(32, 8, 4 * GIB, 0.16 * GIB, 0.9 * 141 * GIB) == 8  # 4 + 41 GiB of 127
    assert fitted_merge(32, 8, 4 * GIB, 0.16 * GIB, 0.9 * 24 * GIB) == 2  # 14.2 of 21.6; m = 4 would need 24.5
    assert fitted_merge(32, 6, 4 * GIB, 0.16 * GIB, 0.9 * 24 * GIB) == 3  # 19.4 of 21.6: 3 divides 6, 4 does not
    assert fitted_merge(32, 8, 4 * GIB, 0.16 * GIB, 9 * GIB) == 1  # not even 2 x 32 blocks: as given
    assert fitted_merge(32, 1, 0, 0, 80 * GIB) == 1  # one micro-batch: nothing to merge


def _micro(first: int, b: int = 2, s: int = 3):
    ids = torch.arange(first * s, (first + b) * s).view(b, s)
    return ids, -ids


def test_merge_concatenates_in_order():
    """Four micro-batches of 2 rows merged by 2: rows 0-3 and 4-7, in order; by 1: as they are."""
    four = [_micro(2 * j) for j in range(4)]
    two = merged(four, 2)
    assert [tuple(ids.shape) for ids, _ in two] == [(4, 3), (4, 3)]
    assert torch.equal(torch.cat([ids for ids, _ in two]), torch.cat([ids for ids, _ in four]))
    assert torch.equal(two[1][1], -two[1][0])
    assert merged(four, 1) is four


def test_merge_keeps_the_replay_rows_first():
    """With replay (ReplayBatches: the first r rows of a micro-batch are the replay text's), the
    group's replay rows come first and their count adds up: [r0 t0 t0] + [r1 r1 t1] -> [r0 r1 r1 t0 t0 t1], 3."""
    a, b = _micro(0, 3), _micro(3, 3)
    (ids, labels, rows), = merged([(*a, 1), (*b, 2)], 2)
    assert rows == 3
    assert torch.equal(ids, torch.cat([a[0][:1], b[0][:2], a[0][1:], b[0][2:]]))
    assert torch.equal(labels, -ids)
