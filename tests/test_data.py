"""Packing, masking, sharding and the encoded corpus."""

import numpy as np
import pytest

from mmadapt.data import MLMBatches, encode_corpus, load_tokenizer, mask_tokens, pack_blocks
from mmadapt.tokens import BOS_ID, EOS_ID, IGNORE_INDEX, MASK_ID, NUM_SPECIAL


def test_full_sentences_packing_by_hand():
    # seq_length 8 leaves 6 tokens between <s> and </s>.
    sents = [(True, [10, 11]), (False, [12, 13, 14]), (False, [15, 16]),  # doc 1
             (True, [20]),                                                # doc 2: separator fits
             (True, [30, 31, 32, 33, 34, 35, 36, 37, 38])]                # doc 3: longer than a block
    blocks = list(pack_blocks(sents, 8))
    assert blocks == [[BOS_ID, 10, 11, 12, 13, 14, EOS_ID],
                      [BOS_ID, 15, 16, EOS_ID, 20, EOS_ID],
                      [BOS_ID, 30, 31, 32, 33, 34, 35, EOS_ID],
                      [BOS_ID, 36, 37, 38, EOS_ID]]


def test_masking_80_10_10_and_determinism():
    block = np.concatenate([[BOS_ID], np.arange(NUM_SPECIAL, NUM_SPECIAL + 20_000) % 900 + NUM_SPECIAL, [EOS_ID]])
    ids, labels = mask_tokens(block, np.random.default_rng(0), 1000, 0.15)
    sel = labels != IGNORE_INDEX
    assert labels[0] == IGNORE_INDEX and labels[-1] == IGNORE_INDEX  # special tokens never selected
    assert abs(sel.mean() - 0.15) < 0.01
    assert (labels[sel] == block[sel]).all()
    frac_mask = (ids[sel] == MASK_ID).mean()
    frac_same = (ids[sel] == block[sel]).mean()
    assert abs(frac_mask - 0.8) < 0.02 and 0.08 < frac_same < 0.13  # 10% kept (+ random hits)
    assert (ids[~sel] == block[~sel]).all()
    ids2, labels2 = mask_tokens(block, np.random.default_rng(0), 1000, 0.15)
    assert (ids == ids2).all() and (labels == labels2).all()


@pytest.fixture(scope="module")
def encoded(corpus, tokenizer, tmp_path_factory):
    return encode_corpus(corpus, tokenizer, tmp_path_factory.mktemp("enc"), 64)


def test_encoded_blocks_round_trip_the_corpus(encoded, corpus, tokenizer):
    sp = load_tokenizer(tokenizer, 1000)
    tokens = np.memmap(encoded / "tokens.bin", dtype=np.uint16, mode="r")
    blocks = np.load(encoded / "blocks.npy")
    assert blocks[:, 1].max() <= 64
    first = tokens[blocks[0, 0]:blocks[0, 0] + blocks[0, 1]].tolist()
    assert first[0] == BOS_ID and first[-1] == EOS_ID
    assert sp.decode(first[1:-1]).startswith("In the beginning God created the heaven and the earth.")
    # Every corpus token appears once, in order (separators and block markers aside).
    text_ids = [t for t in tokens.tolist() if t >= NUM_SPECIAL]
    expected = [t for line in corpus.read_text().splitlines() if line.strip() for t in sp.encode(line)]
    assert text_ids == [t for t in expected if t >= NUM_SPECIAL]


def test_encoding_is_reused_and_invalidated(encoded, corpus, tokenizer):
    mtime = (encoded / "tokens.bin").stat().st_mtime_ns
    encode_corpus(corpus, tokenizer, encoded, 64)
    assert (encoded / "tokens.bin").stat().st_mtime_ns == mtime
    encode_corpus(corpus, tokenizer, encoded, 32)  # another seq_length re-packs
    assert np.load(encoded / "blocks.npy")[:, 1].max() <= 32
    encode_corpus(corpus, tokenizer, encoded, 64)


def test_data_parallel_shards_equal_single_process_accumulation(encoded):
    single = MLMBatches(encoded, 64, 1000, seed=5, mask_prob=0.15, micro_batch_size=4,
                        gradient_accumulation_steps=2)
    ranks = [MLMBatches(encoded, 64, 1000, seed=5, mask_prob=0.15, micro_batch_size=4,
                        gradient_accumulation_steps=1, dp_rank=r, dp_world=2) for r in range(2)]
    for step in (0, 7):
        ref = single.step_batches(step)
        for r in range(2):
            (ids, labels), = ranks[r].step_batches(step)
            assert (ids == ref[r][0]).all() and (labels == ref[r][1]).all()
    a, b = single.step_batches(0), single.step_batches(1)
    assert not (a[0][0] == b[0][0]).all()  # steps differ


def test_epochs_reshuffle_and_remask(encoded):
    data = MLMBatches(encoded, 64, 1000, seed=5, mask_prob=0.15, micro_batch_size=1, gradient_accumulation_steps=1)
    n = len(data)
    assert sorted(data.order(g) for g in range(n)) == list(range(n))  # an epoch is a permutation
    assert [data.order(g) for g in range(5)] != [data.order(n + g) for g in range(5)]
    # The same block seen in two epochs gets different masks (dynamic masking).
    g2 = n + [data.order(n + g) for g in range(n)].index(data.order(0))
    assert not np.array_equal(data.sample(0)[1], data.sample(g2)[1])
