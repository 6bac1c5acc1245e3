"""Llama-family decoders (llama, qwen2 GGUF checkpoints) running on the hack_jax KV cache.

Data flow: tokens -> models.llama (Flax NNX decoder) -> hack_jax.kv_cache (write) ->
hack_jax.attention (the one dispatch) -> logits. models.generate drives prefill/decode;
models.cli is the `hack-jax` console script.
"""
