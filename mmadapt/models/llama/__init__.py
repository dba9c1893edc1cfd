"""The decoder family: a Llama-style causal LM (pre-norm RMSNorm, rotary positions, SwiGLU, grouped-query attention)."""
