"""The `tiny` preset trains: its MLM output biases start at the training text's unigram
log-frequencies (ModelConfig.output_bias_init), and a 60-update `--preset tiny` model fine-tunes
above chance on a learnable two-class Bible task (benchmarks/results/tiny_preset_*: at the old
preset, every such model fine-tuned at 50%)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from conftest import REPO, VOCAB, base_args, run_pretrain
from mmadapt import steps
from mmadapt.cli import pretrain_main
from mmadapt.config import FinetuneConfig, apply_recipe
from mmadapt.models import PRESETS
from mmadapt.data import MANIFEST, TEXT
from mmadapt.parallel import init_parallel
from mmadapt.run import RunSpec, load_weights


TINY = 1e-20


def _start(corpus, tokenizer, out, bias: str) -> dict:
    """The weights a MINIJOINT run starts from, up to its one update at lr 1e-30 (an lr must be
    > 0): Adam moves each weight by at most about lr, so by no more than 1e-20 (TINY)."""
    model, train = PRESETS["tiny"]
    model = apply_recipe(dataclasses.replace(model, vocab_size=VOCAB, output_bias_init=bias), "minijoint")
    train = dataclasses.replace(train, train_iters=1, save_interval=1, lr=1e-30)
    steps.pretrain(run=RunSpec(output_dir=out, corpus=corpus, tokenizer=tokenizer, ds_config=REPO / "ds_configs" /
                               "zero0.json"), step=steps.Pretrain(model=model, train=train, recipe="minijoint"))
    return load_weights(out)[1]


def test_output_biases_start_at_the_unigram_log_frequencies(corpus, tokenizer, tmp_path):
    """Both heads' biases are log((count + 1) / total) of the pieces of the prepared training text
    (counted here from its token file); every other weight is the seeded init a zeros start has."""
    init_parallel(1, 1)
    assert PRESETS["tiny"][0].output_bias_init == "unigram"
    unigram = _start(corpus, tokenizer, tmp_path / "unigram", "unigram")
    zeros = _start(corpus, tokenizer, tmp_path / "zeros", "zeros")
    data = tmp_path / "unigram" / "data"
    dtype = json.loads((data / MANIFEST).read_text())["dtype"]
    counts = np.bincount(np.fromfile(data / f"{TEXT}.bin", dtype=dtype).astype(np.int64), minlength=VOCAB) + 1.0
    expected = torch.from_numpy(np.log(counts / counts.sum())).float()
    assert expected.std() > 1.0  # frequencies far from uniform: a start that says something
    for head in ("heads.heads.0.bias", "heads.heads.1.bias"):
        torch.testing.assert_close(unigram[head], expected)
        assert zeros[head].abs().max() <= TINY
    assert {k for k in unigram if not torch.allclose(unigram[k], zeros[k], rtol=0, atol=TINY)} == {
        "heads.heads.0.bias", "heads.heads.1.bias"}


def test_a_decoder_has_no_output_bias_to_start(tmp_path, capsys):
    out = tmp_path / "run"
    assert pretrain_main(["--preset", "llama-tiny", "--corpus", "bible:en", "--output_dir", str(out),
                          "--output_bias_init", "unigram"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: output_bias_init unigram starts an MLM head's output bias; the llama family's LM head has "
                   "none: drop it")
    assert not out.exists()


@pytest.mark.slow
def test_sixty_updates_of_the_tiny_preset_fine_tune_above_chance(corpus, tokenizer, tmp_path):
    """`pretrain --preset tiny --train_iters 60`, then bible-testament (Old vs New Testament,
    2,000 English training verses, 2 epochs) scored on 500 held-out verses of books no training
    verse comes from: chance is 50%, and 60% is 4.5 binomial standard errors above it."""
    init_parallel(1, 1)
    primary = tmp_path / "tiny"
    run_pretrain(1, *base_args(corpus, tokenizer, primary, "--train_iters", "60"))
    cfg = FinetuneConfig(seq_length=64, epochs=2.0, lr=5e-4, log_interval=10)
    record, _ = steps.finetune(run=RunSpec(output_dir=tmp_path / "ft", ds_config=REPO / "ds_configs" / "zero0.json"),
                               step=steps.Finetune(task="bible-testament", primary=primary, cfg=cfg, eval_file="bible"))
    assert record["source_chance"]["chance"] == 50.0 and record["source_chance"]["scored_items"] == 500
    assert record["source_score"] > 60, record["source_scores"]
    assert record["warnings"] == []
