"""Llama-family decoders (llama, qwen2 GGUF checkpoints) running on the hack_jax KV cache.

Data flow: tokens -> models.llama (Flax NNX decoder) -> hack_jax.kv_cache (write) ->
hack_jax.attention (the one dispatch) -> logits. models.stepper holds the compiled forward
steps that both drivers run: models.generate (fixed batches, perplexity) and models.engine
(continuous batching: CLI generate, server, disaggregated serving); models.cli is the `hack-jax`
console script.

Importing this package sets one XLA flag for the process unless XLA_FLAGS already names it:
`--xla_gpu_graph_min_graph_size=1`, so XLA's GPU command buffers (CUDA graphs) also capture the short
runs of kernels between a decode step's custom calls (XLA's default minimum leaves them as
separate launches). It only takes effect if jax has not initialized its GPU backend yet, and changes
nothing on the CPU. Measured on the H200 at batch 1 (bench/NOTES_generate.md).
"""
import os as _os

_GRAPH_FLAG = "--xla_gpu_graph_min_graph_size=1"
if "xla_gpu_graph_min_graph_size" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = f"{_os.environ.get('XLA_FLAGS', '')} {_GRAPH_FLAG}".strip()
