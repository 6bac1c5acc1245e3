"""ModelConfig: the decoder's static shape and numerics, read from GGUF metadata."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax.numpy as jnp

from hack_jax.backend import Backend

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a Llama-family decoder.

  Attributes:
    architecture: "llama" or "qwen2" (GGUF `general.architecture`).
    vocab_size, num_layers, embed_dim (d_model), hidden_dim (SwiGLU width), num_q_heads,
      num_kv_heads, head_dim: sizes. num_q_heads % num_kv_heads == 0 (GQA).
    rms_norm_eps: RMSNorm epsilon.
    rope_theta: RoPE base frequency (rotate-half convention, see models/llama.py).
    rope_freq_factors: None (plain RoPE) or head_dim // 2 positive floats dividing RoPE's inverse
      frequencies theta ** (-2i / head_dim), llama.cpp's `rope_freqs` convention: Llama-3.1's
      scaling (llama3_rope_freq_factors), linear scaling (every factor = the scale). A list or
      array is accepted and converted to a tuple (the config stays hashable).
    max_seq_len: the checkpoint's trained context length.
    tied_embeddings: True when the output projection reuses the token embedding.
    qkv_bias: True for qwen2 (q/k/v projections carry biases).
    dtype: compute dtype of weights and activations (float32 default; bfloat16 allowed).
      Logits, norms and softmax are always float32.
    attention: the attention backend every layer calls with its fresh q/k/v and the step record:
      a hack_jax.backend.Backend (impl + kernel options), or any hashable object with the same
      `prefill` / `decode` methods (models/eval.py's evaluation variants, benchmark adapters).
    scan_layers: True: the layers' weights are stacked (leading num_layers axis) and the cached
      forward is one jax.lax.scan over a single compiled layer body; False: the layer loop is
      unrolled in Python (one copy of the layer per layer in the compiled program); None (default):
      scanned on the CPU, unrolled elsewhere. Same math. Measured (bench/NOTES_generate.md): on the
      CPU the scan compiles ~10x faster; on the H200 the scanned step copied each layer's slice of
      the stacked weights and cache (TPOT 2-8x worse), so the GPU default is unrolled. The cache is
      now read and written in place (hack_jax.kv_cache.stacked); the weight slices are still
      copied unless XLA's dynamic slice fusion feeds them to the matmuls (not measured yet).
    stack_cache: with unrolled layers, whether the cache is one stacked LayerCache (one array per
      field with a leading num_layers axis, its pages read and written in place through
      hack_jax.kv_cache.stacked) rather than a tuple of per-layer LayerCaches. A step's host cost
      grows with its number of array arguments (~5.8 us per donated array on the H200 host,
      bench/probe_dispatch.py): 32 hack layers are ~400 arrays as a tuple, ~12 stacked. None
      (default): stacked off the CPU (where the flat pool was measured slower per step). A scanned
      model's cache is always stacked. Where the flat pool would sit in the Pallas lowering's 32-bit
      offset window (kv_cache.stacked.pallas_addressable), models.llama.init_cache stacks groups of
      layers instead, each addressable (models.llama.cache_layout).
  """

  architecture: Literal["llama", "qwen2"]
  vocab_size: int
  num_layers: int
  embed_dim: int
  hidden_dim: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float
  rope_theta: float
  max_seq_len: int
  tied_embeddings: bool
  qkv_bias: bool
  dtype: Any = jnp.float32
  attention: Any = Backend()
  scan_layers: bool | None = None
  stack_cache: bool | None = None
  rope_freq_factors: tuple[float, ...] | None = None

  def __post_init__(self):
    if self.rope_freq_factors is not None:
      factors = tuple(float(f) for f in self.rope_freq_factors)
      object.__setattr__(self, "rope_freq_factors", factors)
      if len(factors) != self.head_dim // 2 or not all(0 < f < math.inf for f in factors):
        raise ValueError(f"rope_freq_factors must be {self.head_dim // 2} (head_dim // 2) positive "
                         f"finite numbers, got {len(factors)}: {factors[:4]}...")
    if not (callable(getattr(self.attention, "prefill", None))
            and callable(getattr(self.attention, "decode", None))):
      raise TypeError(f"attention must have prefill and decode methods (a hack_jax.backend."
                      f"Backend), got {self.attention!r}")
    try:
      hash(self.attention)
    except TypeError as e:
      raise TypeError(f"attention must be hashable (a jit static), got {self.attention!r}") from e
    if self.scan_layers is None:  # the faster form where it was measured (bench/NOTES_generate.md)
      import jax
      object.__setattr__(self, "scan_layers", jax.default_backend() == "cpu")
    if not isinstance(self.scan_layers, bool):
      raise TypeError(f"scan_layers must be a bool or None, got {self.scan_layers!r}")
    if self.stack_cache is None:
      import jax
      object.__setattr__(self, "stack_cache", self.scan_layers or jax.default_backend() != "cpu")
    if not isinstance(self.stack_cache, bool):
      raise TypeError(f"stack_cache must be a bool or None, got {self.stack_cache!r}")
    if self.scan_layers and not self.stack_cache:
      raise ValueError("stack_cache=False needs unrolled layers (scan_layers=False): a scanned "
                       "model reads one stacked cache")
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"unsupported architecture {self.architecture=}; "
                       f"supported: {SUPPORTED_ARCHITECTURES}")
    if self.num_q_heads % self.num_kv_heads:
      raise ValueError(f"{self.num_q_heads=} must be a multiple of {self.num_kv_heads=}")
    if jnp.dtype(self.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
      raise ValueError(f"{self.dtype=} must be float32 or bfloat16")

  @classmethod
  def from_gguf_fields(cls, fields: dict[str, Any], *, tied_embeddings: bool, **overrides
                       ) -> "ModelConfig":
    """Builds the config from decoded GGUF metadata (key -> Python value).

    Raises:
      ValueError: unsupported `general.architecture`, or metadata inconsistent with the weights.
    """
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"unsupported GGUF architecture {arch!r}; this runtime loads "
                       f"{SUPPORTED_ARCHITECTURES} checkpoints")
    get = lambda key: fields[f"{arch}.{key}"]
    embed_dim = int(get("embedding_length"))
    num_q_heads = int(get("attention.head_count"))
    head_dim = int(fields.get(f"{arch}.attention.key_length", embed_dim // num_q_heads))
    vocab = fields.get(f"{arch}.vocab_size", len(fields["tokenizer.ggml.tokens"]))
    kwargs = dict(
        architecture=arch,
        vocab_size=int(vocab),
        num_layers=int(get("block_count")),
        embed_dim=embed_dim,
        hidden_dim=int(get("feed_forward_length")),
        num_q_heads=num_q_heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", num_q_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        max_seq_len=int(get("context_length")),
        tied_embeddings=tied_embeddings,
        qkv_bias=arch == "qwen2",
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def llama3_rope_freq_factors(head_dim: int, theta: float, *, factor: float, low_freq_factor: float,
                             high_freq_factor: float, original_max_position_embeddings: int
                             ) -> tuple[float, ...]:
  """Llama-3.1's RoPE scaling (transformers' rope_type="llama3") as rope_freq_factors: wavelengths
  shorter than original / high_freq_factor keep their frequency, longer than original /
  low_freq_factor are slowed by `factor`, and those between interpolate smoothly.

  Returns head_dim // 2 floats f with scaled inverse frequency = theta ** (-2i / head_dim) / f.
  Raises ValueError unless factor >= 1 and low_freq_factor < high_freq_factor.
  """
  if not (factor >= 1 and 0 < low_freq_factor < high_freq_factor):
    raise ValueError(f"llama3 rope scaling needs factor >= 1 and 0 < low_freq_factor < "
                     f"high_freq_factor, got {factor=} {low_freq_factor=} {high_freq_factor=}")
  old = float(original_max_position_embeddings)
  factors = []
  for i in range(head_dim // 2):
    wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
    if wavelen < old / high_freq_factor:
      factors.append(1.0)
    elif wavelen > old / low_freq_factor:
      factors.append(float(factor))
    else:
      smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      factors.append(1 / ((1 - smooth) / factor + smooth))
  return tuple(factors)


# Real model shapes for benchmarks with random weights (Llama(config, rngs=...)): the KV path's
# speed does not depend on weight values (docs/MODELS.md, "The GPU machine").
PRESETS = {
    "llama-3.1-8b": dict(architecture="llama", vocab_size=128256, num_layers=32, embed_dim=4096,
                         hidden_dim=14336, num_q_heads=32, num_kv_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072,
                         tied_embeddings=False, qkv_bias=False,
                         rope_freq_factors=llama3_rope_freq_factors(
                             128, 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)),
    "qwen2.5-7b": dict(architecture="qwen2", vocab_size=152064, num_layers=28, embed_dim=3584,
                       hidden_dim=18944, num_q_heads=28, num_kv_heads=4, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=131072,
                       tied_embeddings=False, qkv_bias=True),
}


def preset(name: str, **overrides) -> ModelConfig:
  """ModelConfig of a named real model shape (PRESETS), e.g. preset("llama-3.1-8b",
  dtype=jnp.bfloat16). Raises ValueError for an unknown name."""
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
  return ModelConfig(**{**PRESETS[name], **overrides})
