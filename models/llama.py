"""Llama-family decoder (llama, qwen2) in Flax NNX, attending through the hack_jax KV cache.

x -> [RMSNorm -> attention (+residual) -> RMSNorm -> SwiGLU (+residual)] * num_layers -> RMSNorm
  -> logits = x @ embed^T (tied) or x @ lm_head.

RoPE: rotate-half, pairs (x[i], x[i + head_dim/2]), base config.rope_theta. llama GGUF files store
Q/K rows permuted for adjacent-pair RoPE; models/gguf_loader.py undoes that permutation at load time
so one RoPE serves every architecture (qwen2 files are already rotate-half).

Two ways to run:
  model(tokens)                         full causal forward without a cache (tests, oracle checks);
  model.run(tokens, positions, cache, step) -> (cache, hidden)
                                        cached prefill / decode: each attention layer writes its K/V
                                        into the hack_jax cache and attends through
                                        hack_jax.prefill (config.prefill: exact flash attention
                                        on the fresh 16-bit K/V, or homomorphic) / hack_jax.attention
                                        (impl=config.impl, kernel options config.kernel_options).
Einsum axes: B batch, T query tokens, S key tokens, D embed_dim, F hidden_dim, N q heads,
K kv heads, G q heads per kv head, H head_dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from hack_jax import attention as hack_attention
from hack_jax import kv_cache
from hack_jax import prefill as hack_prefill
from models.config import ModelConfig

f32 = jnp.float32


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["page_indices", "write_lens", "kv_lens", "key"],
                   meta_fields=["mode", "seal"])
@dataclasses.dataclass(frozen=True)
class CacheStep:
  """What one cached forward step writes into the cache and attends over.

  Attributes:
    mode: "prefill" (tokens [max_seqs, T], slot s writes its first write_lens[s] tokens into an
      empty sequence), "chunk" (the same into a sequence already holding kv_lens - write_lens
      tokens: the next chunk of a chunked prefill; hack_jax.prefill) or "decode" (tokens
      [max_seqs, 1], one token per slot with write_lens 1).
    page_indices: i32[max_seqs, pages_per_seq] from the host PageAllocator.
    write_lens: i32[max_seqs] tokens each slot writes this step (0 = slot untouched / inactive).
    kv_lens: i32[max_seqs] tokens each slot holds after this step (includes the written ones).
    key: PRNG key for stochastic rounding (None with rounding="nearest").
    seal: decode only, hack_jax.kv_cache.append's `seal` ("always" | "never": "never" when
      the host knows no slot fills its open block this step, kv_cache.seals_block).
  """
  mode: Literal["prefill", "chunk", "decode"]
  page_indices: jax.Array
  write_lens: jax.Array
  kv_lens: jax.Array
  key: jax.Array | None = None
  seal: str = "always"


def rope(x: jax.Array, positions: jax.Array, theta: float,
         freq_factors: tuple[float, ...] | None = None) -> jax.Array:
  """Rotate-half RoPE. x [B, T, heads, H], positions i32[B, T] -> same shape and dtype as x.
  freq_factors: None or H/2 divisors of the inverse frequencies (ModelConfig.rope_freq_factors)."""
  half = x.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=f32) * 2 / x.shape[-1])   # [H/2]
  if freq_factors is not None:
    inv_freq = inv_freq / jnp.asarray(freq_factors, f32)
  angle = positions.astype(f32)[..., None] * inv_freq                      # [B, T, H/2]
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(f32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
  """Plain softmax attention, query at position p sees keys at positions <= p (no cache).

  q [B, T, N, H], k, v [B, T, K, H], positions i32[B, T] -> f32[B, T, N, H]. GQA: q head n uses
  kv head n // (N // K). Rows past a sequence's end (right padding) see only earlier keys, so
  padding never changes the valid rows.
  """
  b, t, n, h = q.shape
  kh = k.shape[2]
  qg = q.astype(f32).reshape(b, t, kh, n // kh, h) * h ** -0.5
  logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(f32))
  visible = positions[:, None, None, None, :] <= positions[:, None, None, :, None]
  weights = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
  return jnp.einsum("BKGTS,BSKH->BTKGH", weights, v.astype(f32)).reshape(b, t, n, h)


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, computed in float32, returned in x.dtype."""

  def __init__(self, dim: int, eps: float, dtype: Any):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(f32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(f32)).astype(x.dtype)


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
  return nnx.Param((std * jax.random.normal(rngs.params(), shape, f32)).astype(dtype))


class Attention(nnx.Module):
  """GQA self-attention with RoPE and optional q/k/v bias (qwen2)."""

  def __init__(self, config: ModelConfig, layer_index: int, *, rngs: nnx.Rngs):
    c, dt = config, config.dtype
    self.config, self.layer_index = config, layer_index
    self.q = _normal(rngs, (c.embed_dim, c.num_q_heads, c.head_dim), dt)
    self.k = _normal(rngs, (c.embed_dim, c.num_kv_heads, c.head_dim), dt)
    self.v = _normal(rngs, (c.embed_dim, c.num_kv_heads, c.head_dim), dt)
    self.o = _normal(rngs, (c.num_q_heads, c.head_dim, c.embed_dim), dt)
    if c.qkv_bias:
      self.q_bias = nnx.Param(jnp.zeros((c.num_q_heads, c.head_dim), dt))
      self.k_bias = nnx.Param(jnp.zeros((c.num_kv_heads, c.head_dim), dt))
      self.v_bias = nnx.Param(jnp.zeros((c.num_kv_heads, c.head_dim), dt))

  def __call__(self, x: jax.Array, positions: jax.Array, cache: Any = None,
               step: CacheStep | None = None) -> tuple[Any, jax.Array]:
    """x [B, T, D], positions i32[B, T]; cache: this layer's hack_jax layer cache or None.
    Returns (new layer cache or None, out [B, T, D] in x.dtype)."""
    c = self.config
    q = jnp.einsum("BTD,DNH->BTNH", x, self.q[...])
    k = jnp.einsum("BTD,DKH->BTKH", x, self.k[...])
    v = jnp.einsum("BTD,DKH->BTKH", x, self.v[...])
    if c.qkv_bias:
      q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
    q = rope(q, positions, c.rope_theta, c.rope_freq_factors)
    k = rope(k, positions, c.rope_theta, c.rope_freq_factors)
    if cache is None:
      out = causal_attention(q, k, v, positions)
    else:
      key = None if step.key is None else jax.random.fold_in(step.key, self.layer_index)
      if step.mode in ("prefill", "chunk"):
        q_start = step.kv_lens - step.write_lens if step.mode == "chunk" else None
        cache, out = hack_prefill.prefill(q, k, v, cache, page_indices=step.page_indices,
                                          lengths=step.write_lens, q_start=q_start, key=key,
                                          attention=c.prefill, impl=c.impl,
                                          **dict(c.kernel_options))
      else:
        cache = kv_cache.append(cache, k[:, 0], v[:, 0], kv_lens=step.kv_lens - step.write_lens,
                                active=step.write_lens > 0, page_indices=step.page_indices,
                                key=key, seal=step.seal)
        out = hack_attention.decode_attention(q[:, 0], cache, page_indices=step.page_indices,
                                              kv_lens=step.kv_lens, impl=c.impl,
                                              **dict(c.kernel_options))[:, None]
    return cache, jnp.einsum("BTNH,NHD->BTD", out.astype(x.dtype), self.o[...])


class MLP(nnx.Module):
  """SwiGLU: down(silu(x @ gate) * (x @ up))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.gate = _normal(rngs, (c.embed_dim, c.hidden_dim), c.dtype)
    self.up = _normal(rngs, (c.embed_dim, c.hidden_dim), c.dtype)
    self.down = _normal(rngs, (c.hidden_dim, c.embed_dim), c.dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.silu(jnp.einsum("BTD,DF->BTF", x, self.gate[...]))
    h = h * jnp.einsum("BTD,DF->BTF", x, self.up[...])
    return jnp.einsum("BTF,FD->BTD", h, self.down[...])


class Block(nnx.Module):
  def __init__(self, config: ModelConfig, layer_index: int, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(config.embed_dim, config.rms_norm_eps, config.dtype)
    self.attn = Attention(config, layer_index, rngs=rngs)
    self.ffn_norm = RMSNorm(config.embed_dim, config.rms_norm_eps, config.dtype)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, positions, cache=None, step=None):
    cache, h = self.attn(self.attn_norm(x), positions, cache, step)
    x = x + h
    return cache, x + self.mlp(self.ffn_norm(x))


class Llama(nnx.Module):
  """The decoder. Llama(config, rngs=...) initializes random weights (benchmarks on real shapes);
  Llama.from_weights(config, weights) loads those of models.gguf_loader."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.embed = _normal(rngs, (c.vocab_size, c.embed_dim), c.dtype)
    self.layers = nnx.List([Block(c, i, rngs=rngs) for i in range(c.num_layers)])
    self.final_norm = RMSNorm(c.embed_dim, c.rms_norm_eps, c.dtype)
    if not c.tied_embeddings:
      self.lm_head = _normal(rngs, (c.embed_dim, c.vocab_size), c.dtype)

  @classmethod
  def from_weights(cls, config: ModelConfig, weights: dict[str, Any]) -> "Llama":
    """Builds the module without random init and fills it with `weights` (gguf_loader layout).

    Raises:
      ValueError: a weight's shape differs from the config's.
    """
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))

    def put(param, array):
      if tuple(param.shape) != tuple(array.shape):
        raise ValueError(f"weight shape {array.shape} != expected {param.shape}")
      param.set_value(jnp.asarray(array, config.dtype))

    put(model.embed, weights["embed"])
    put(model.final_norm.scale, weights["final_norm"])
    if not config.tied_embeddings:
      put(model.lm_head, weights["lm_head"])
    for block, w in zip(model.layers, weights["layers"], strict=True):
      put(block.attn_norm.scale, w["attn_norm"])
      put(block.ffn_norm.scale, w["ffn_norm"])
      for name in ("q", "k", "v", "o") + (("q_bias", "k_bias", "v_bias") if config.qkv_bias else ()):
        put(getattr(block.attn, name), w[name])
      for name in ("gate", "up", "down"):
        put(getattr(block.mlp, name), w[name])
    return model

  def run(self, tokens: jax.Array, positions: jax.Array, cache: Any = None,
          step: CacheStep | None = None) -> tuple[Any, jax.Array]:
    """tokens i32[B, T], positions i32[B, T]; cache: hack_jax KVCache (B = max_seqs) or None.

    Returns (new KVCache or None, final-normed hidden [B, T, D] in config.dtype).
    """
    x = jnp.take(self.embed[...], tokens, axis=0)
    layers = [None] * len(self.layers) if cache is None else list(cache.layers)
    for i, block in enumerate(self.layers):
      layers[i], x = block(x, positions, layers[i], step)
    if cache is not None:
      cache = dataclasses.replace(cache, layers=tuple(layers), page_indices=step.page_indices,
                                  kv_lens=step.kv_lens)
    return cache, self.final_norm(x)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> f32[..., V]."""
    head = self.lm_head[...] if not self.config.tied_embeddings else self.embed[...].T
    return jnp.einsum("...D,DV->...V", hidden, head, preferred_element_type=f32)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Full causal forward without a cache: tokens i32[B, T] -> logits f32[B, T, V]
    (right-padded rows are fine: position t sees only tokens <= t)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return self.logits(self.run(tokens, positions)[1])
