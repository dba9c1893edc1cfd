"""The model-family seam through the command line: a family defined in this file and nowhere else
(it subclasses neither shipped family, names its parameters its own way and brings its own preset)
goes through every step as a user runs them, each a `mmadapt` subprocess: Step 1 MINIJOINT, Step 1b
MINIPOST, Step 2 over both mini-models, Step 3, Step 4 and the plug-in metric. Nothing in mmadapt
names it: the subprocesses learn of it from MMADAPT_IMPORT=test_family_cli:register, as a user's
own family would be registered.

The toy is a pre-LayerNorm encoder of plain torch layers with the masked-LM objective (an
objective mmadapt has), learned positions, no output bias, and a classifier on the first token:
its word embedding is `tok.weight`, its layers `blocks.<i>.`, its heads `lm.<k>.`."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import REPO, VOCAB, child_env
from mmadapt.config import ModelConfig, TrainConfig
from mmadapt.family import ModelFamily
from mmadapt.models.layers import attention_mask, derive_seed, masked_positions
from mmadapt.objectives import MLM
from mmadapt.parallel import seeded

# --- the toy family -----------------------------------------------------------------------------------

class ToyBlock(nn.Module):
    """x + Attn(LN(x)), then x + MLP(LN(x)); plain torch layers (tensor-parallel size 1)."""

    def __init__(self, cfg: ModelConfig, number: int, seed: int):
        super().__init__()
        self.layer_number, self.heads, h = number, cfg.num_attention_heads, cfg.hidden_size
        with seeded(derive_seed(seed, f"blocks.{number}")):
            self.ln_attn, self.ln_mlp = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.up, self.down = nn.Linear(h, cfg.ffn_hidden_size), nn.Linear(cfg.ffn_hidden_size, h)
            for lin in (self.qkv, self.proj, self.up, self.down):
                nn.init.normal_(lin.weight, std=cfg.init_method_std)
                nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor, mask) -> torch.Tensor:  # [b, s, h] -> [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.ln_mlp(x))))


class ToyLM(nn.Module):
    """Embeddings, blocks and (heads=True) one LayerNorm head per entry of heads_after, each
    projected by the tied embedding."""

    def __init__(self, cfg: ModelConfig, seed: int = 1234, heads: bool = True):
        super().__init__()
        self.config, h = cfg, cfg.hidden_size
        with seeded(derive_seed(seed, "tok")):
            self.tok = nn.Embedding(cfg.vocab_size, h)
            self.pos = nn.Embedding(cfg.max_position_embeddings, h)
            nn.init.normal_(self.tok.weight, std=cfg.init_method_std)
            nn.init.normal_(self.pos.weight, std=cfg.init_method_std)
        self.blocks = nn.ModuleList(ToyBlock(cfg, i, seed) for i in range(1, cfg.num_layers + 1))
        self.lm = nn.ModuleList(nn.LayerNorm(h) for _ in cfg.heads_after) if heads else None

    def encode(self, input_ids, layers, padding=None) -> list[torch.Tensor]:
        mask = attention_mask(input_ids, padding)
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        out = []
        for block in self.blocks:
            x = block(x, mask)
            if block.layer_number in layers:
                out.append(x)
        return out

    def logits(self, input_ids, padding=None) -> list[torch.Tensor]:
        hiddens = self.encode(input_ids, self.config.heads_after, padding)
        return [norm(h) @ self.tok.weight.T for norm, h in zip(self.lm, hiddens)]

    def forward(self, input_ids, labels=None, *, masked_index=None, targets=None, padding=None):
        if masked_index is None:
            masked_index, targets = masked_positions(labels)
        losses = [F.cross_entropy(norm(h.reshape(-1, h.shape[-1]).index_select(0, masked_index)) @ self.tok.weight.T,
                                  targets)
                  for norm, h in zip(self.lm, self.encode(input_ids, self.config.heads_after, padding))]
        per_head = torch.stack(losses)
        return per_head.mean(), per_head.detach()


class ToyClassifier(ToyLM):
    """The body and a linear classifier on the first position's last-layer output."""

    def __init__(self, cfg: ModelConfig, kind: str, num_labels: int, seed: int = 1234):
        super().__init__(cfg, seed, heads=False)
        self.kind = kind
        with seeded(derive_seed(seed, "cls")):
            self.cls = nn.Linear(cfg.hidden_size, num_labels)

    def forward(self, input_ids, labels=None, padding=None):
        logits = self.cls(self.encode(input_ids, (self.config.num_layers,), padding)[0][:, 0])  # [b, C]
        return (None if labels is None else F.cross_entropy(logits, labels)), logits


TOY_TINY = ModelConfig(family="toy", num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                       vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                       init_method_std=0.05)


class ToyFamily(ModelFamily):
    name = "toy"
    objective = MLM
    task_kinds = ("classify",)
    presets = {"toy-tiny": (TOY_TINY, TrainConfig(seq_length=32, train_micro_batch_size_per_gpu=8, train_iters=6,
                                                  lr=1e-3, lr_warmup_iters=1, log_interval=2, save_interval=6))}
    small_preset = "toy-tiny"
    word, layers_prefix, heads_prefix = "tok.weight", "blocks.", "lm."

    def build_lm(self, cfg, seed=1234):
        return ToyLM(cfg, seed)

    def build_task_model(self, cfg, kind, num_labels, seed=1234):
        return ToyClassifier(cfg, kind, num_labels, seed)

    def build_body(self, cfg, seed=1234):
        return ToyLM(cfg, seed, heads=False)

    def finetune_trainable(self, cfg):
        return ("pos.", "blocks.", "cls.")

    def step_flops(self, step, cfg, s, p, paper=False, trainable_layers=0):
        # 2 FLOPs per multiply-add, forward and twice that backward, of the layers and of the
        # heads' projection over the masked rows (the toy's own count; nothing checks it here).
        h, f, heads = cfg.hidden_size, cfg.ffn_hidden_size, len(cfg.heads_after)
        head = heads * 2 * p * s * h * cfg.vocab_size
        return 3 * (cfg.num_layers * (2 * s * (4 * h * h + 2 * h * f) + 4 * s * s * h) + head)


def register() -> None:
    """What MMADAPT_IMPORT=test_family_cli:register calls in each subprocess."""
    from mmadapt.models import register_family

    register_family(ToyFamily())


# --- the command line ---------------------------------------------------------------------------------

def mmadapt(*args: str) -> str:
    env = child_env(MMADAPT_IMPORT="test_family_cli:register", PYTHONPATH=str(REPO / "tests"))
    proc = subprocess.run([sys.executable, "-m", "mmadapt.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (args[0], proc.stderr[-3000:])
    return proc.stdout


@pytest.mark.slow
def test_a_family_defined_in_a_test_file_runs_every_step_through_the_command_line(
        corpus, tokenizer, de_corpus, de_tokenizer, tmp_path):
    en, de = tmp_path / "en", tmp_path / "de"
    mmadapt("preprocess", "--corpus", str(corpus), "--output_dir", str(en), "--tokenizer", str(tokenizer),
            "--workers", "1")
    mmadapt("preprocess", "--corpus", str(de_corpus), "--output_dir", str(de), "--tokenizer", str(de_tokenizer),
            "--workers", "1", "--valid_fraction", "0.1")

    # Step 1, MINIJOINT: heads after layers 2 and 4 of the toy-tiny preset (which picks the family).
    mmadapt("pretrain", "--preset", "toy-tiny", "--recipe", "minijoint", "--mini_layers", "2", "--data_path", str(en),
            "--output_dir", str(tmp_path / "toy"))
    run = json.loads((tmp_path / "toy" / "run.json").read_text())
    assert run["model"]["family"] == "toy" and run["model"]["head_layers"] == [2, 4]
    assert run["trainable"] is None and run["train"]["train_iters"] == 6
    state = torch.load(next((tmp_path / "toy" / "checkpoints").glob("*/mp_rank_00_model_states.pt")),
                       weights_only=False)["module"]
    assert {"tok.weight", "blocks.3.qkv.weight", "lm.0.weight", "lm.1.weight"} <= set(state)  # the toy's own names

    # Step 1b: MINIPOST from the toy's bottom layer + 1 new one; only the new block trains.
    mmadapt("build_minipost", "--primary", str(tmp_path / "toy"), "--mini_layers", "1", "--new_layers", "1",
            "--output_dir", str(tmp_path / "minipost"), "--train_iters", "2", "--save_interval", "2")
    assert json.loads((tmp_path / "minipost" / "run.json").read_text())["trainable"] == ["blocks.1."]

    # Step 2 over both mini-models: only the toy's word embedding trains.
    for system, source in (("minijoint", "toy"), ("minipost", "minipost")):
        mmadapt("adapt", "--system", system, "--source", str(tmp_path / source), "--lang", "de", "--data_path", str(de),
                "--output_dir", str(tmp_path / f"adapt-{system}"), "--train_iters", "2", "--save_interval", "2")
        record = json.loads((tmp_path / f"adapt-{system}" / "run.json").read_text())
        assert record["model"]["family"] == "toy" and record["trainable"] == ["tok.weight"]
        assert record["model"]["num_layers"] == 2  # N = 2 (MINIJOINT), 1 + 1 (MINIPOST)

    # Step 3 on the toy's primary model, then Step 4 with each artifact swapped in.
    mmadapt("finetune", "--task", "bible-genre", "--primary", str(tmp_path / "toy"), "--output_dir",
            str(tmp_path / "ft"), "--seq_length", "32", "--epochs", "0.05", "--lr", "1e-3")
    ft = json.loads((tmp_path / "ft" / "run.json").read_text())
    assert ft["model"]["family"] == "toy" and ft["updates"] >= 1 and ft["final_loss"] is not None
    scores = tmp_path / "zero-shot.json"
    mmadapt("evaluate", "--finetuned", str(tmp_path / "ft"), "--embeddings", str(tmp_path / "adapt-minijoint"),
            str(tmp_path / "adapt-minipost"), "--eval_file", "bible", "--output", str(scores))
    records = json.loads(scores.read_text())
    # Each Step-2 run's start (update 0) and last artifact, then the fine-tuned run with no adaptation.
    assert [(r["system"], r.get("step")) for r in records] == [("minijoint", 0), ("minijoint", 2), ("minipost", 0),
                                                               ("minipost", 2), ("no_adaptation", None)]
    assert all(r["task"] == "bible-genre" and 0 <= r["score"] <= 100 for r in records)

    # The plug-in metric through the toy's primary model.
    plugin = tmp_path / "plugin.json"
    mmadapt("evaluate", "--primary", str(tmp_path / "toy"), "--embeddings", str(tmp_path / "adapt-minijoint"),
            str(tmp_path / "adapt-minipost"), "--plugin_data", str(de), "--seq_length", "32", "--plugin_blocks", "32",
            "--output", str(plugin))
    for r in json.loads(plugin.read_text()):
        assert r["task"] == "plugin-mlm" and r["score"] == pytest.approx(r["unigram_loss"] - r["loss"])
        assert 0 < r["loss"] < 20 and r["masked_pieces"] > 0
