"""The decoder family's presets: a model size and the schedule that goes with it
(ModelFamily.presets). `llama-tiny` is its small preset."""

from mmadapt.config import ModelConfig, TrainConfig

# LLAMA_TINY, 682,560 parameters: 12 x 46,208 per layer (QKV 64 x (4 + 2 x 2) x 16, out 64 x 64,
# gate/up 2 x 176 x 64, down 176 x 64, two norms) + the tied embedding 2000 x 64 + the final norm.
# ffn 176 = 8h/3 rounded up to a multiple of 16, Llama's ratio.
# init_method_std 0.05, not the 0.02 of h >= 768 models: at h = 64, 0.02 scales each projection's
# output to 0.02 * sqrt(64) = 0.16 of its normed input, and SwiGLU multiplies two such factors, so
# the feed-forward starts near zero and each factor's gradient is scaled by the other's smallness.
# Measured (2026-11-23, TINY's 200-update schedule on Genesis + Exodus, two seeds), validation loss:
# 4.63 with 0.02, 4.40 with 0.05, 4.42-4.45 with 0.08 (small_init's sqrt(2 / 5h)), 4.55 with 1/sqrt(h).
LLAMA_TINY = ModelConfig(family="llama", num_layers=12, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=176, vocab_size=2000, max_position_embeddings=128, hidden_dropout=0.0,
                         attention_dropout=0.0, init_method_std=0.05, share_embeddings_and_output_weights=True,
                         rotary_base=10000.0)

# Shaped as Qwen2-0.5B (its config.json): 494,032,768 parameters, as transformers'
# Qwen2ForCausalLM of that config counts them: 24 x 14,912,384 per layer (QKV 896 x (14 + 2 x 2)
# x 64 with its bias, out 896^2, gate/up 2 x 4864 x 896, down 4864 x 896, two norms) + the tied
# embedding 151,936 x 896 + the final norm.
QWEN2_0_5B = ModelConfig(family="llama", num_layers=24, hidden_size=896, num_attention_heads=14, num_query_groups=2,
                         ffn_hidden_size=4864, vocab_size=151_936, max_position_embeddings=32_768,
                         hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-6, init_method_std=0.02,
                         add_qkv_bias=True, rotary_base=1_000_000.0, share_embeddings_and_output_weights=True)

PRESETS: dict[str, tuple[ModelConfig, TrainConfig]] = {
    # The decoder at the encoder's tiny size and schedule: tests, CI and the decoder demo.
    "llama-tiny": (LLAMA_TINY, TrainConfig(seq_length=64, train_micro_batch_size_per_gpu=16,
                                           gradient_accumulation_steps=1, train_iters=200, lr=2e-3,
                                           lr_warmup_iters=20, log_interval=10, save_interval=100)),
    # A real decoder size: Qwen2-0.5B's shape, 2048-token blocks, a 1M-token global batch (micro 8
    # x 64 data-parallel GPUs), lr 3e-4 with 2,000 warm-up updates (set the batch fields for your
    # cluster; a Hugging Face Qwen2 checkpoint comes in through import-hf instead).
    "qwen2-0.5b": (QWEN2_0_5B, TrainConfig(seq_length=2048, train_micro_batch_size_per_gpu=8,
                                           gradient_accumulation_steps=1, train_iters=100_000, lr=3e-4,
                                           lr_warmup_iters=2000, weight_decay=0.1, adam_beta2=0.95,
                                           adam_eps=1e-8, gradient_clipping=1.0)),
}
SMALL = "llama-tiny"  # the schedule later steps run over a decoder run by default, and the demo's model
