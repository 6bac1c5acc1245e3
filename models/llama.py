"""Llama-family decoder (llama, qwen2) in Flax NNX, attending through the hack_jax KV cache.

x -> [RMSNorm -> attention (+residual) -> RMSNorm -> SwiGLU (+residual)] * num_layers -> RMSNorm
  -> logits = x @ embed^T (tied) or x @ lm_head.

RoPE: rotate-half, pairs (x[i], x[i + head_dim/2]), base config.rope_theta. llama GGUF files store
Q/K rows permuted for adjacent-pair RoPE; models/gguf_loader.py undoes that permutation at load time
so one RoPE serves every architecture (qwen2 files are already rotate-half).

Two ways to run:
  model(tokens)                         full causal forward without a cache (tests, oracle checks);
  model.run(tokens, positions, cache, step) -> (cache, hidden)
                                        cached prefill / decode: each layer hands its fresh q/k/v, its
                                        cache layer and the step record (hack_jax.step.Step,
                                        unchanged) to the attention backend (config.attention, a
                                        hack_jax.backend.Backend unless overridden), which writes
                                        the K/V and attends.
Per-layer cache formats (hack_jax.layer_formats.LayerFormats as `quant`): the stacked cache is one
stacked cache per format (hack_jax.kv_cache.mixed.LayerGroups); the unrolled loop hands layer i the
slot of its format's stack, the scan runs once per run of consecutive layers of one format. A stack
the kernels could not address whole is held the same way, as groups of consecutive layers
(`cache_layout`).
Layers: config.scan_layers=True stacks the layer weights (one Block whose parameters carry a leading
num_layers axis) and runs the layers as one jax.lax.scan (the cache's layers stacked the same way,
kv_cache.init_cache(stacked=True), its pages read and written in place: hack_jax.kv_cache.stacked);
False keeps one Block per layer and a Python loop over a tuple of layer caches, or over a stacked
cache in the same flat form (config.stack_cache, the GPU default: fewer step arguments). The layer
index goes to the backend explicitly (an int, or a traced i32 in the scan).
Einsum axes: B batch, T query tokens, S key tokens, D embed_dim, F hidden_dim, N q heads,
K kv heads, G q heads per kv head, H head_dim, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hack_jax import kv_cache
from hack_jax.config import QuantConfig
from hack_jax.layer_formats import LayerFormats
from hack_jax.kv_cache import mixed, stacked as stacked_cache
from hack_jax.step import Step
from models.config import ModelConfig

f32 = jnp.float32


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


def pad_rows(x: jax.Array, rows: int = 2) -> jax.Array:
  """x [B, ...] with zero rows appended up to `rows` along B."""
  return jnp.concatenate([x, jnp.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])


class Attention(nnx.Module):
  """GQA self-attention with RoPE and optional q/k/v bias (qwen2)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, dt = config, config.dtype
    self.config = config
    self.q = _normal(rngs, (c.embed_dim, c.num_q_heads, c.head_dim), dt)
    self.k = _normal(rngs, (c.embed_dim, c.num_kv_heads, c.head_dim), dt)
    self.v = _normal(rngs, (c.embed_dim, c.num_kv_heads, c.head_dim), dt)
    self.o = _normal(rngs, (c.num_q_heads, c.head_dim, c.embed_dim), dt)
    if c.qkv_bias:
      self.q_bias = nnx.Param(jnp.zeros((c.num_q_heads, c.head_dim), dt))
      self.k_bias = nnx.Param(jnp.zeros((c.num_kv_heads, c.head_dim), dt))
      self.v_bias = nnx.Param(jnp.zeros((c.num_kv_heads, c.head_dim), dt))

  def __call__(self, x: jax.Array, positions: jax.Array, cache: Any = None, step: Step | None = None,
               attention: Any = None, layer_index: Any = 0) -> tuple[Any, jax.Array]:
    """x [B, T, D], positions i32[B, T] (or, from Llama.run's one-token path, x [2, 1, D] whose second
    row is zero padding with positions [1, 1]: q, k, v of the real row only reach RoPE and the
    backend, the output keeps x's rows); cache: this layer's hack_jax LayerCache or None;
    attention: the backend (prefill / decode methods). Returns (new layer cache or None,
    out [B, T, D] in x.dtype). ValueError if positions' rows match neither form."""
    c = self.config
    rows = positions.shape[0]
    if rows != x.shape[0] and (rows, x.shape[:2]) != (1, (2, 1)):
      raise ValueError(f"positions {tuple(positions.shape)} need one row per row of x {tuple(x.shape)}")
    q = jnp.einsum("BTD,DNH->BTNH", x, self.q[...])[:rows]
    k = jnp.einsum("BTD,DKH->BTKH", x, self.k[...])[:rows]
    v = jnp.einsum("BTD,DKH->BTKH", x, self.v[...])[:rows]
    if c.qkv_bias:
      q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
    q = rope(q, positions, c.rope_theta, c.rope_freq_factors)
    k = rope(k, positions, c.rope_theta, c.rope_freq_factors)
    if cache is None:
      out = causal_attention(q, k, v, positions)
    elif step.mode in ("prefill", "chunk"):
      cache, out = attention.prefill(q, k, v, cache, step, layer_index=layer_index)
    else:
      cache, out = attention.decode(q[:, 0], k[:, 0], v[:, 0], cache, step, layer_index=layer_index)
      out = out[:, None]
    out = out.astype(x.dtype)
    if x.shape[0] > rows:
      out = pad_rows(out, x.shape[0])
    return cache, jnp.einsum("BTNH,NHD->BTD", out, self.o[...])


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
  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(config.embed_dim, config.rms_norm_eps, config.dtype)
    self.attn = Attention(config, rngs=rngs)
    self.ffn_norm = RMSNorm(config.embed_dim, config.rms_norm_eps, config.dtype)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, positions, cache=None, step=None, attention=None, layer_index=0):
    cache, h = self.attn(self.attn_norm(x), positions, cache, step, attention, layer_index)
    x = x + h
    return cache, x + self.mlp(self.ffn_norm(x))


def cache_layout(config: ModelConfig, quant: QuantConfig, *, num_pages: int, max_seqs: int,
                 pages_per_seq: int) -> tuple[bool, int | None]:
  """(stacked, group_layers): how init_cache lays out `config`'s cache. Stacked always with
  scan_layers, with unrolled layers when config.stack_cache. A stack whose pool the Pallas kernels
  could not address whole (kv_cache.stacked.pallas_addressable: a 1-byte pool in (2**31, 2**32]
  bytes) is cut into groups of at most group_layers consecutive layers that they can
  (kv_cache.stacked.addressable_depth; kv_cache.mixed.LayerGroups), so the seal stays one vectorized
  call per group; group_layers None: one stack per format. Where even one layer is beyond that
  reach: a tuple of layers (unrolled), one stack (scan_layers)."""
  if not (config.scan_layers or config.stack_cache):
    return False, None
  configs = (quant.configs(config.num_layers) if isinstance(quant, LayerFormats)
             else (quant,) * config.num_layers)
  depth = None
  for c in dict.fromkeys(configs):  # each format's stack: its own layers
    count = configs.count(c)
    layer = jax.eval_shape(lambda c=c: kv_cache.init_layer(
        c, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, num_pages=num_pages, max_seqs=max_seqs))
    n = stacked_cache.addressable_depth(layer, count)
    if n is None:  # a scan reads a stack still (per-layer slices: kv_cache.stacked.use_flat)
      return config.scan_layers, None
    if n < count:
      depth = n if depth is None else min(depth, n)
  return True, depth


def init_cache(config: ModelConfig, quant: QuantConfig, *, num_pages: int, max_seqs: int,
               pages_per_seq: int) -> kv_cache.KVCache:
  """An empty KVCache in the layout Llama.run reads for `config` (`cache_layout`): the layers
  stacked (one LayerCache with a leading num_layers axis, or groups of them) or a tuple of
  LayerCaches. Raises as kv_cache.init_cache."""
  sizes = dict(num_pages=num_pages, max_seqs=max_seqs, pages_per_seq=pages_per_seq)
  stacked, group_layers = cache_layout(config, quant, **sizes)
  return kv_cache.init_cache(quant, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                             head_dim=config.head_dim, **sizes, stacked=stacked, group_layers=group_layers)


# Per layer: GGUF weight name (models/gguf_loader.py) -> path of the parameter in a Block.
_BLOCK_PARAMS = dict(attn_norm=("attn_norm", "scale"), ffn_norm=("ffn_norm", "scale"),
                     q=("attn", "q"), k=("attn", "k"), v=("attn", "v"), o=("attn", "o"),
                     q_bias=("attn", "q_bias"), k_bias=("attn", "k_bias"),
                     v_bias=("attn", "v_bias"), gate=("mlp", "gate"), up=("mlp", "up"),
                     down=("mlp", "down"))


def _stack_blocks(blocks: list[Block]) -> Block:
  """One Block whose every parameter is the layers' parameters stacked on a leading axis."""
  state = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
  return nnx.merge(nnx.graphdef(blocks[0]), state)


class Llama(nnx.Module):
  """The decoder. Llama(config, rngs=...) initializes random weights (benchmarks on real shapes;
  the same weights with either config.scan_layers); Llama.from_weights(config, weights) loads those
  of models.gguf_loader."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.embed = _normal(rngs, (c.vocab_size, c.embed_dim), c.dtype)
    blocks = [Block(c, rngs=rngs) for _ in range(c.num_layers)]
    self.layers = _stack_blocks(blocks) if c.scan_layers else nnx.List(blocks)
    self.final_norm = RMSNorm(c.embed_dim, c.rms_norm_eps, c.dtype)
    if not c.tied_embeddings:
      self.lm_head = _normal(rngs, (c.embed_dim, c.vocab_size), c.dtype)

  @classmethod
  def from_weights(cls, config: ModelConfig, weights: dict[str, Any]) -> "Llama":
    """Builds the module without random init and fills it with `weights` (gguf_loader layout:
    embed, final_norm, lm_head unless tied, layers = one dict per layer); with scan_layers the
    per-layer weights are stacked.

    Raises:
      ValueError: a weight's shape differs from the config's, or the layer count does.
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
    layers = weights["layers"]
    if len(layers) != config.num_layers:
      raise ValueError(f"{len(layers)} layers of weights != {config.num_layers=}")
    names = [n for n in _BLOCK_PARAMS if config.qkv_bias or not n.endswith("_bias")]
    param = lambda block, name: getattr(getattr(block, _BLOCK_PARAMS[name][0]), _BLOCK_PARAMS[name][1])
    for name in names:
      if config.scan_layers:
        put(param(model.layers, name), np.stack([np.asarray(w[name]) for w in layers]))
      else:
        for block, w in zip(model.layers, layers):
          put(param(block, name), w[name])
    return model

  def run(self, tokens: jax.Array, positions: jax.Array, cache: Any = None,
          step: Step | None = None, attention: Any = None) -> tuple[Any, jax.Array]:
    """tokens i32[B, T], positions i32[B, T]; cache: hack_jax KVCache (B = max_seqs; layers
    stacked or a tuple, as init_cache made it for config) or None; step: the hack_jax.step.Step
    record (with a cache);
    attention: the backend, None = config.attention.

    Returns (new KVCache or None, final-normed hidden [B, T, D] in config.dtype).
    """
    attention = self.config.attention if attention is None else attention
    x = jnp.take(self.embed[...], tokens, axis=0)
    # One token (a batch-1 decode step) runs the layers on two rows, the second zero, dropped at the
    # end (the attention computes the real rows only): XLA:GPU rewrites a vector x matrix dot whose
    # operands hold < 1e7 elements (the K / V projections of 7-8B models) into a product it writes out
    # and a reduction, and its one-row GEMMs are slower than two-row ones: 15-20% of a Llama-3.1-8B
    # batch-1 step (bench/probe_gemv.py, bench/NOTES_generate.md).
    one_row = x.shape[0] * x.shape[1] == 1
    if one_row:
      x = pad_rows(x)
    layers = None if cache is None else cache.layers
    if self.config.scan_layers and layers is None:
      x, _ = self._scan(x, positions, None, step, attention)
    elif self.config.scan_layers:
      groups, layer_map = mixed.groups_of(layers)
      for g, first, stop, offset in mixed.runs(layer_map):
        x, groups[g] = self._scan(x, positions, groups[g], step, attention, (first, stop, offset))
      layers = mixed.with_groups(layers, groups)
    elif cache is not None and cache.stacked:
      x, layers = self._unrolled_in_place(x, positions, layers, step, attention)
    else:
      layers = [None] * len(self.layers) if layers is None else list(layers)
      for i, block in enumerate(self.layers):
        layers[i], x = block(x, positions, layers[i], step, attention, i)
      layers = tuple(layers)
    if cache is not None:
      cache = dataclasses.replace(cache, layers=layers)
    return cache, self.final_norm(x[:1] if one_row else x)

  def _unrolled_in_place(self, x, positions, layers, step, attention):
    """The unrolled layer loop over a stacked cache, nothing copied per layer. A backend that takes
    them (`takes_stacked_layers`, hack_jax.backend.Backend) gets layer i as a
    hack_jax.kv_cache.stacked.StackedLayer: a non-sealing decode step appends and attends in place (the
    kernels read layer i of the stacked arrays); other steps take the layer out in the flat form. Other
    backends get the flat form: layer i reads and scatters into the whole flat pool through its mapped
    page table (no copy of its pages); its open blocks and sinks are sliced out and written back."""
    groups, layer_map = mixed.groups_of(layers)  # per-layer formats: layer i is groups[g][j]
    if getattr(attention, "takes_stacked_layers", False):
      for i, block in enumerate(self.layers):
        g, j = layer_map[i]
        view, x = block(x, positions, stacked_cache.StackedLayer(groups[g], j), step, attention, i)
        groups[g] = view.stacked
      return x, mixed.with_groups(layers, groups)
    num_pages = stacked_cache.pages_per_layer(groups[0])
    flat = [stacked_cache.flatten(group) for group in groups]
    for i, block in enumerate(self.layers):
      g, j = layer_map[i]
      layer_step = dataclasses.replace(
          step, page_indices=stacked_cache.layer_page_indices(step.page_indices, j, num_pages))
      layer, x = block(x, positions, stacked_cache.layer_of(flat[g], j), layer_step, attention, i)
      flat[g] = stacked_cache.put_layer(flat[g], layer, j)
    return x, mixed.with_groups(layers, [stacked_cache.unflatten(f, mixed.num_stacked(group))
                                         for f, group in zip(flat, groups)])

  def _scan(self, x, positions, layers, step, attention, run=None):
    """The layer loop as one jax.lax.scan over (stacked weights, layer index). run: None (every
    layer, `layers` holding them all) or (first, stop, offset): layers first..stop-1, whose caches
    are `layers`' entries offset.. (one format's stack of a per-layer-format cache). The stacked cache
    rides in the carry in hack_jax.kv_cache.stacked's flat form: each layer's paged arrays are the
    whole flat pool, read and scattered in place through the page table mapped into that layer's
    pages (no copy of a layer's pages); only the per-sequence open blocks and sinks are sliced and
    written back. Where the flat form does not pay (kv_cache.stacked.use_flat: on the CPU, and in
    the Pallas lowering's 32-bit offset window), each layer's slice is copied in and out instead."""
    graphdef, params = nnx.split(self.layers)
    first, stop, offset = (0, self.config.num_layers, 0) if run is None else run
    if (first, stop) != (0, self.config.num_layers):  # a static slice of the stacked weights
      params = jax.tree.map(lambda p: p[first:stop], params)
    num_stacked = None if layers is None else mixed.num_stacked(layers)
    flat = layers is not None and stacked_cache.use_flat(layers)
    if flat:
      num_pages = stacked_cache.pages_per_layer(layers)
      layers = stacked_cache.flatten(layers)

    def body(carry, xs):
      x, layers = carry
      p, i = xs
      j = i - (first - offset)  # the layer's entry in `layers`
      layer, layer_step = None, step
      if flat:
        layer = stacked_cache.layer_of(layers, j)
        layer_step = dataclasses.replace(
            step, page_indices=stacked_cache.layer_page_indices(step.page_indices, j, num_pages))
      elif layers is not None:
        layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), layers)
      layer, x = nnx.merge(graphdef, p)(x, positions, layer, layer_step, attention, i)
      if flat:
        layers = stacked_cache.put_layer(layers, layer, j)
      elif layers is not None:
        layers = jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, j, 0),
                              layers, layer)
      return (x, layers), None

    index = jnp.arange(first, stop, dtype=jnp.int32)
    (x, layers), _ = jax.lax.scan(body, (x, layers), (params, index))
    if flat:
      layers = stacked_cache.unflatten(layers, num_stacked)
    return x, layers

  def logits(self, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> f32[..., V]."""
    head = self.lm_head[...] if not self.config.tied_embeddings else self.embed[...].T
    return jnp.einsum("...D,DV->...V", hidden, head, preferred_element_type=f32)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Full causal forward without a cache: tokens i32[B, T] -> logits f32[B, T, V]
    (right-padded rows are fine: position t sees only tokens <= t)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return self.logits(self.run(tokens, positions)[1])
