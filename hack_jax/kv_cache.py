"""The paged KV cache: functional pytrees holding 2-bit (or baseline) K/V, HACK.md §4 and §6.

One format per `QuantConfig.kv_format` (and `layout` for "hack"), each a small frozen dataclass
registered as a pytree, all behind the same module-level functions, so models and benchmarks switch
formats with the config alone:

    init_cache / init_layer -> write_prefill -> append (every decode step) -> attention.py reads it.

Page layout (DESIGN.md "Paged cache layout"; axes [num_pages, num_kv_heads, ...]):
- A page holds page_size tokens of every kv head. Axis order [num_pages, num_kv_heads, rows, head_dim]
  makes one (page, kv head) tile contiguous: 8 KiB of K codes at the defaults (256 tokens / 4 per
  byte x head_dim 128). GPU.md measured paged streaming on the H200 at ~0.55 TB/s for 2 KiB tiles
  (one 64-token block of one head) and 1.3-1.75 TB/s for 8-64 KiB tiles, and several small loads
  did not behave like one large one. So page_size defaults to 256 = 4 * partition_size: one page is
  one packing group (4 blocks of P=64 tokens packed 4 codes per byte along tokens, DESIGN.md
  "2-bit packing"), a kernel loads one [P, head_dim] uint8 tile of K codes (one [head_dim, P] tile
  of V codes in the kivi layout) and gets 4 full blocks.
- kivi V codes are stored token-major, [.., head_dim, page_size // 4]: the same bytes as the
  channel-major [.., page_size // 4, head_dim] of K (and of the seed layout), transposed, so 4
  consecutive tokens of a channel are one 32-bit word, the int8 MMA's B operand layout for the PV
  dot (DESIGN.md "Paged cache layout").
- Token t < num_sink_tokens is a sink (residual_dtype, per sequence). Token t >= num_sink_tokens has
  block position u = t - num_sink_tokens, lives in page column u // page_size, row u % page_size.
  The newest incomplete block (hack format) is the 16-bit open block; it is sealed (quantized into
  its page slot with its code sums) when it holds P tokens.
- Unquantized and int8 formats have no sinks and no open block: token t is at page column
  t // page_size (`sink_tokens(config)` is 0 for them).
- page_indices entries that are not assigned hold the null page 0 (hack_jax.paging), which is never
  handed out. Reads of ids outside [0, num_pages) read the null page; writes to them are dropped;
  everything read beyond a sequence's kv_len is masked (metadata zeroed before use, so NaN or stale
  bytes in unused or reused pages cannot leak). Page ids are validated on the host by
  `paging.PageAllocator` / `paging.validate_page_indices` (and eagerly here when not traced).

Why one LayerCache per layer in a tuple (KVCache.layers): a model unrolls its layer loop and
indexes the tuple statically, so each layer's update is a separate buffer that the donated step
updates in place, and benchmarks can time one layer's arrays alone. A stacked [num_layers, ...]
array would turn every layer's write into a dynamic-update of one giant buffer and tie all layers'
shapes together (per-layer formats are open work, HACK.md §4).

All write functions are jit-able, vectorized over sequences and blocks (no Python loop over tokens
or pages at run time), and contain no host round trip; callers donate the cache. append computes the
sealed block of every slot and drops the writes of slots that do not seal, so one compile serves a
whole decode loop. Measured on the H200 (jax 0.11.2, one layer, 32 sequences, 8 kv heads, d 128,
inside a jitted loop): hack append 57-58 us/step with a 19 MiB or a 680 MiB pool, bf16 14-18 us
up to 4 GiB, i.e. updated in place. (XLA's CPU backend upcasts bf16/f16 scatters and copies, so
there the step time grows with the pool.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import packing, paging
from hack_jax.config import QuantConfig
from hack_jax.quantization import quantize

_STATIC = dict(static=True)


def _dataclass(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


class _Pages:
    """Sizes read from array shapes (static under jit); every format stores [num_pages, H, ...]."""

    @property
    def _first(self):
        return getattr(self, dataclasses.fields(self)[0].name)

    @property
    def num_pages(self) -> int:
        return self._first.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self._first.shape[1]

    @property
    def head_dim(self) -> int:
        return self._first.shape[-1]


@_dataclass
class KiviPages(_Pages):
    """kv_format="hack", layout="kivi": K per (block, channel), V per (token, channel group).

    P = partition_size, Pc = min(P, head_dim), NP = head_dim // Pc, bpp = page_size // P,
    S = max_seqs, ns = num_sink_tokens, sums dtype u8 when 3 * group <= 255 else u16:
      k_codes  u8[num_pages, num_kv_heads, page_size // 4, head_dim]  packed per group of 4 blocks
      k_scale, k_min  f16[num_pages, num_kv_heads, bpp, head_dim]      per (block, channel)
      k_sums   u8[num_pages, num_kv_heads, page_size, NP]              kappa, per (token, channel group)
      v_codes  u8[num_pages, num_kv_heads, head_dim, page_size // 4]  token-major: bits 2j..2j+1
               of byte [page, h, c, g * P + r] hold the code of page row (4g + j) P + r (in-block
               token r of block slot 4g + j: block j of packing group g), channel c, j = 0..3
      v_scale, v_min  f16[num_pages, num_kv_heads, page_size, NP]      per (token, channel group)
      v_sums   u8[num_pages, num_kv_heads, bpp, head_dim]              omega, per (block, channel)
      open_k, open_v  bf16[S, num_kv_heads, P, head_dim]               open block, per sequence
      sink_k, sink_v  bf16[S, num_kv_heads, ns, head_dim]
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    k_sums: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    v_sums: jax.Array
    open_k: jax.Array
    open_v: jax.Array
    sink_k: jax.Array
    sink_v: jax.Array
    config: QuantConfig = dataclasses.field(metadata=_STATIC)


@_dataclass
class SeedPages(_Pages):
    """kv_format="hack", layout="seed": K per (token, channel group), V per (block, channel).

    K is quantized as soon as a token arrives (written straight into its page row); only V goes
    through the 16-bit open block (the "V tail", HACK.md §4). Names as in KiviPages, but both code
    arrays channel-major ([.., page_size // 4, head_dim], as KiviPages.k_codes):
      k_codes  u8[num_pages, num_kv_heads, page_size // 4, head_dim]
      k_scale, k_min  f16[num_pages, num_kv_heads, page_size, NP]
      k_sums   u8[num_pages, num_kv_heads, page_size, NP]
      v_codes  u8[num_pages, num_kv_heads, page_size // 4, head_dim]
      v_scale, v_min  f16[num_pages, num_kv_heads, bpp, head_dim]
      v_sums   u8[num_pages, num_kv_heads, bpp, head_dim]
      open_v   bf16[S, num_kv_heads, P, head_dim]
      sink_k, sink_v  bf16[S, num_kv_heads, ns, head_dim]
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    k_sums: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    v_sums: jax.Array
    open_v: jax.Array
    sink_k: jax.Array
    sink_v: jax.Array
    config: QuantConfig = dataclasses.field(metadata=_STATIC)


@_dataclass
class DensePages(_Pages):
    """kv_format="bf16" | "float32": k, v dtype[num_pages, num_kv_heads, page_size, head_dim]."""

    k: jax.Array
    v: jax.Array
    config: QuantConfig = dataclasses.field(metadata=_STATIC)


@_dataclass
class Int8Pages(_Pages):
    """kv_format="int8", per (token, kv head) asymmetric over head_dim (HACK.md §8), always
    round-to-nearest, x ~ scale * code + min:
      k_codes, v_codes  i8[num_pages, num_kv_heads, page_size, head_dim]  (q - 128)
      k_scale, k_min, v_scale, v_min  f16[num_pages, num_kv_heads, page_size]  (min folded, §2)
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    config: QuantConfig = dataclasses.field(metadata=_STATIC)


LayerCache = Union[KiviPages, SeedPages, DensePages, Int8Pages]


@_dataclass
class KVCache:
    """The whole cache: one LayerCache per layer, the page table and the lengths.

      layers: tuple[LayerCache, ...], one per layer (module docstring says why).
      page_indices: i32[max_seqs, pages_per_seq], from paging.PageAllocator (0 = null page).
      kv_lens: i32[max_seqs], tokens held per sequence (sinks + sealed + open).
      config: QuantConfig (static).
    Sizes are properties read from the array shapes (static under jit, never out of sync).
    """

    layers: tuple
    page_indices: jax.Array
    kv_lens: jax.Array
    config: QuantConfig = dataclasses.field(metadata=_STATIC)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_seqs(self) -> int:
        return self.page_indices.shape[0]

    @property
    def pages_per_seq(self) -> int:
        return self.page_indices.shape[1]

    @property
    def num_pages(self) -> int:
        return self.layers[0].num_pages

    @property
    def capacity(self) -> int:
        """Most tokens one sequence can hold."""
        return sink_tokens(self.config) + self.pages_per_seq * self.config.page_size


# ----------------------------------------------------------------------------- sizes and init


def sink_tokens(config: QuantConfig) -> int:
    """Tokens per sequence kept outside pages: num_sink_tokens for "hack", 0 for the baselines."""
    return config.num_sink_tokens if config.kv_format == "hack" else 0


def _groups(config: QuantConfig, head_dim: int):
    """(P, Pc, NP, bpp): partition, channel group, channel groups per head, blocks per page."""
    p = config.partition_size
    pc = min(p, head_dim)
    return p, pc, head_dim // pc, config.page_size // p


def _sums_dtype(group: int):
    return jnp.uint8 if 3 * group <= 255 else jnp.uint16


def _check_ints(**sizes) -> None:
    for name, value in sizes.items():
        paging.require_int(name, value)


def init_layer(config: QuantConfig, *, num_kv_heads: int, head_dim: int, num_pages: int,
               max_seqs: int) -> LayerCache:
    """An all-zero LayerCache of the format config.kv_format / config.layout (shapes: class docs).

    Raises ValueError for a bad kv_format/layout, num_pages < 2 (page 0 is the null page),
    non-positive sizes, or (hack) head_dim not a multiple of min(partition_size, head_dim).
    """
    if not isinstance(config, QuantConfig):
        raise ValueError(f"config must be a QuantConfig, got {type(config).__name__}")
    if config.kv_format not in ("hack", "bf16", "float32", "int8"):
        raise ValueError(f"unknown kv_format: {config.kv_format=}")
    _check_ints(num_kv_heads=num_kv_heads, head_dim=head_dim, num_pages=num_pages,
                max_seqs=max_seqs)
    if num_pages < 2:
        raise ValueError(f"need the null page plus at least one page: {num_pages=}")
    if min(num_kv_heads, head_dim, max_seqs) < 1:
        raise ValueError(f"sizes must be positive: {num_kv_heads=} {head_dim=} {max_seqs=}")
    n, h, d, ps, s = num_pages, num_kv_heads, head_dim, config.page_size, max_seqs
    z = jnp.zeros
    if config.kv_format in ("bf16", "float32"):
        dt = jnp.bfloat16 if config.kv_format == "bf16" else jnp.float32
        return DensePages(k=z((n, h, ps, d), dt), v=z((n, h, ps, d), dt), config=config)
    meta = config.meta_dtype
    if config.kv_format == "int8":
        return Int8Pages(
            k_codes=z((n, h, ps, d), jnp.int8), k_scale=z((n, h, ps), meta), k_min=z((n, h, ps), meta),
            v_codes=z((n, h, ps, d), jnp.int8), v_scale=z((n, h, ps), meta), v_min=z((n, h, ps), meta),
            config=config)
    p, pc, np_, bpp = _groups(config, d)
    if d % pc:
        raise ValueError(f"head_dim must be a multiple of min(partition_size, head_dim)={pc}: {head_dim=}")
    res, ns = config.residual_dtype, config.num_sink_tokens
    codes = lambda: z((n, h, ps // 4, d), jnp.uint8)  # channel-major
    codes_token_major = lambda: z((n, h, d, ps // 4), jnp.uint8)  # kivi v_codes
    per_block = lambda dt: z((n, h, bpp, d), dt)
    per_token = lambda dt: z((n, h, ps, np_), dt)
    open_ = lambda: z((s, h, p, d), res)
    sinks = lambda: z((s, h, ns, d), res)
    if config.layout == "kivi":
        return KiviPages(
            k_codes=codes(), k_scale=per_block(meta), k_min=per_block(meta),
            k_sums=per_token(_sums_dtype(pc)),
            v_codes=codes_token_major(), v_scale=per_token(meta), v_min=per_token(meta),
            v_sums=per_block(_sums_dtype(p)),
            open_k=open_(), open_v=open_(), sink_k=sinks(), sink_v=sinks(), config=config)
    return SeedPages(
        k_codes=codes(), k_scale=per_token(meta), k_min=per_token(meta),
        k_sums=per_token(_sums_dtype(pc)),
        v_codes=codes(), v_scale=per_block(meta), v_min=per_block(meta),
        v_sums=per_block(_sums_dtype(p)),
        open_v=open_(), sink_k=sinks(), sink_v=sinks(), config=config)


def init_cache(config: QuantConfig, *, num_layers: int, num_kv_heads: int, head_dim: int,
               num_pages: int, max_seqs: int, pages_per_seq: int) -> KVCache:
    """An empty KVCache: num_layers zero LayerCaches, page_indices all null (0), kv_lens 0.

    num_pages counts the reserved null page. Raises ValueError as init_layer, and for
    num_layers < 1 or pages_per_seq < 1.
    """
    _check_ints(num_layers=num_layers, pages_per_seq=pages_per_seq)
    if num_layers < 1 or pages_per_seq < 1:
        raise ValueError(f"sizes must be positive: {num_layers=} {pages_per_seq=}")
    layer = init_layer(config, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       num_pages=num_pages, max_seqs=max_seqs)
    layers = (layer,) + tuple(jax.tree.map(jnp.copy, layer) for _ in range(num_layers - 1))
    return KVCache(layers=layers, page_indices=jnp.zeros((max_seqs, pages_per_seq), jnp.int32),
                   kv_lens=jnp.zeros((max_seqs,), jnp.int32), config=config)


# ----------------------------------------------------------------------------- index helpers


def _page_ids(page_indices, col, ok, num_pages):
    """Page id of table column `col` (int[S, ...]) per sequence for writing; num_pages (an
    out-of-bounds id, dropped by `mode="drop"` writes) where not ok, where the table entry is out of
    range, or where it is the null page (which writes never touch)."""
    pps = page_indices.shape[1]
    flat = col.reshape(col.shape[0], -1)
    ids = jnp.take_along_axis(page_indices, jnp.clip(flat, 0, pps - 1), axis=1).reshape(col.shape)
    good = ok & (col >= 0) & (col < pps) & (ids > paging.NULL_PAGE) & (ids < num_pages)
    return jnp.where(good, ids, num_pages)


_ALL = slice(None)


def _put(a, index, x):
    """a.at[index].set(x), out-of-bounds entries dropped: how every write here is masked."""
    return a.at[index].set(x.astype(a.dtype), mode="drop")


def _code_index(pages, rows, token_major):
    """Index of packed code rows `rows` (int, broadcast with `pages`) of pages `pages` in a code array:
    channel-major u8[N, H, page_size // 4, D] or token-major u8[N, H, D, page_size // 4] (kivi V).
    Either way a[index] is [*broadcast(pages, rows).shape, H, D] (the advanced axes first) and
    _put(a, index, x) takes x of that shape: one in-place scatter, no transpose of the pool."""
    return (pages, _ALL, _ALL, rows) if token_major else (pages, _ALL, rows)


def _set_plane(old, codes, plane):
    """Clears plane `plane` (int, broadcastable) of packed bytes `old` and ORs in 2-bit `codes`."""
    shift = packing.plane_shift(plane).astype(jnp.uint8)
    mask = packing.plane_mask(plane).astype(jnp.uint8)
    return (old & ~mask) | (codes.astype(jnp.uint8) << shift)


def _split_key(key):
    return (None, None) if key is None else tuple(jax.random.split(key))


def _maybe_validate(layer, page_indices, kv_lens):
    """Host check of concrete (non-traced) inputs; inside jit the allocator is the check."""
    if any(isinstance(x, jax.core.Tracer) for x in (page_indices, kv_lens)):
        return
    paging.validate_page_indices(page_indices, kv_lens, num_pages=layer.num_pages,
                                 page_size=layer.config.page_size,
                                 num_sink_tokens=sink_tokens(layer.config))


def _check_kv(layer, k, v, ndim, what):
    if k.ndim != ndim or v.ndim != ndim:
        raise ValueError(f"{what}: k and v must have {ndim} axes, got {k.shape=} {v.shape=}")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k and v must have the same shape: {k.shape=} {v.shape=}")
    if not (jnp.issubdtype(k.dtype, jnp.floating) and jnp.issubdtype(v.dtype, jnp.floating)):
        raise ValueError(f"{what}: k and v must be floating, got {k.dtype=} {v.dtype=}")
    if (k.shape[-2], k.shape[-1]) != (layer.num_kv_heads, layer.head_dim):
        raise ValueError(f"{what}: k's (num_kv_heads, head_dim) must match the cache "
                         f"({layer.num_kv_heads}, {layer.head_dim}): {k.shape=}")


def _check_finite(k, v, what):
    """Concrete K/V only (a host sync; inside jit nothing can raise): ValueError on NaN or inf, which
    no format can store (2-bit codes would hold garbage for the whole block)."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, jax.core.Tracer) and x.size and not bool(jnp.isfinite(x).all()):
            n = int((~jnp.isfinite(x)).sum())
            raise ValueError(f"{what}: {name} holds {n} NaN or inf value(s) in the rows to be written")


# ----------------------------------------------------------------------------- prefill


def write_prefill(layer: LayerCache, k, v, *, lengths, page_indices, start=None,
                  key=None) -> LayerCache:
    """Writes prompts, or the next chunk of prompts, into sequence slots (ragged batch).

    Args:
      layer: the LayerCache.
      k, v: float[S, T, num_kv_heads, head_dim], S = max_seqs; row t of slot s is token
        start[s] + t, rows t < lengths[s] are written (left-aligned; rows beyond are ignored).
        T is static (a length bucket).
      lengths: i32[S] tokens to write per slot; 0 leaves the slot untouched.
      page_indices: i32[S, pages_per_seq]; pages must be assigned for start + lengths tokens.
      start: i32[S] tokens the slot already holds (chunked prefill), or None = all 0 (the slot
        must then be empty). The new tokens continue the sequence: they fill the remaining sinks,
        then the open block (sealing it, with its earlier 16-bit tokens, once it holds P), then
        whole blocks, then a new open block; the packing-group planes of blocks sealed before are
        kept. With bf16-exact K/V (what the open block stores anyway) and nearest rounding, any
        split into chunks stores the same bytes as one write_prefill (and as appends).
      key: PRNG key, required for rounding="stochastic" (ValueError otherwise), ignored for nearest.
    Returns the new LayerCache. hack: complete blocks quantized (all at once, scattered into their
    page slots with code sums), the remainder into the open block, sinks in 16 bits; baselines:
    every token into its page row.
    Raises ValueError on shape mismatch, a length beyond T, a negative start, or (concrete inputs
    only) negative lengths, bad page ids / over capacity, NaN or inf in k / v; TypeError for
    non-integer lengths / page_indices / start; under jit, tokens beyond capacity or bound for
    unassigned pages are dropped.
    """
    k, v = jnp.asarray(k), jnp.asarray(v)
    _check_kv(layer, k, v, 4, "write_prefill")
    paging.check_index_dtype("write_prefill", lengths=lengths, page_indices=page_indices, start=start)
    lengths = jnp.asarray(lengths, jnp.int32)
    page_indices = jnp.asarray(page_indices, jnp.int32)
    if lengths.shape != (k.shape[0],) or page_indices.shape[0] != k.shape[0]:
        raise ValueError(f"write_prefill: batch mismatch: {k.shape=} {lengths.shape=} "
                         f"{page_indices.shape=}")
    if not isinstance(lengths, jax.core.Tracer) and lengths.size and int(lengths.max()) > k.shape[1]:
        raise ValueError(f"write_prefill: a length exceeds the prompt axis T={k.shape[1]}: "
                         f"lengths={np.asarray(lengths).tolist()}")
    if start is not None:
        start = jnp.asarray(start, jnp.int32)
        if start.shape != lengths.shape:
            raise ValueError(f"write_prefill: {start.shape=} must be {lengths.shape}")
        if not isinstance(start, jax.core.Tracer) and start.size and int(start.min()) < 0:
            raise ValueError(f"write_prefill: start must be >= 0: start={np.asarray(start).tolist()}")
    if not isinstance(lengths, jax.core.Tracer) and lengths.size and int(lengths.min()) < 0:
        raise ValueError(f"write_prefill: lengths must be >= 0: lengths={np.asarray(lengths).tolist()}")
    _maybe_validate(layer, page_indices, lengths if start is None else start + lengths)
    if not isinstance(lengths, jax.core.Tracer):  # rows t >= lengths[s] are ignored: not checked
        rows = np.arange(k.shape[1])[None, :] < np.asarray(lengths)[:, None]
        _check_finite(k[rows], v[rows], "write_prefill")
    if isinstance(layer, DensePages):
        return _prefill_dense(layer, k, v, lengths, page_indices, start)
    if isinstance(layer, Int8Pages):
        return _prefill_int8(layer, k, v, lengths, page_indices, start)
    return _prefill_hack(layer, k, v, lengths, page_indices, start, key)


def _token_targets(layer, lengths, page_indices, t_len, start):
    """(pages i32[S, T], rows i32[S, T]) for rows 0..T-1 (tokens start + t) of the baseline formats."""
    ps = layer.config.page_size
    t = jnp.broadcast_to(jnp.arange(t_len), (lengths.shape[0], t_len))
    ok = t < lengths[:, None]
    if start is not None:
        t = t + start[:, None]
    pages = _page_ids(page_indices, t // ps, ok, layer.num_pages)
    return pages, t % ps


def _prefill_dense(layer, k, v, lengths, page_indices, start):
    pages, rows = _token_targets(layer, lengths, page_indices, k.shape[1], start)
    put = lambda a, x: _put(a, (pages, _ALL, rows), x)
    return dataclasses.replace(layer, k=put(layer.k, k), v=put(layer.v, v))


def _int8(x):
    """x float[..., head_dim] -> (codes i8[..., D], scale f16[...], min f16[...]) per token."""
    q = quantize(x, bits=8, axis=-1, partition_size=x.shape[-1])
    return q.codes, q.scale[..., 0], q.minimum[..., 0]


def _prefill_int8(layer, k, v, lengths, page_indices, start):
    pages, rows = _token_targets(layer, lengths, page_indices, k.shape[1], start)
    put = lambda a, x: _put(a, (pages, _ALL, rows), x)
    kc, ks, km = _int8(k)  # [S, T, H, D], [S, T, H]
    vc, vs, vm = _int8(v)
    return dataclasses.replace(
        layer, k_codes=put(layer.k_codes, kc), k_scale=put(layer.k_scale, ks),
        k_min=put(layer.k_min, km), v_codes=put(layer.v_codes, vc),
        v_scale=put(layer.v_scale, vs), v_min=put(layer.v_min, vm))


def _quant_blocks_over_tokens(blocks, config, key):
    """Per (block, channel): blocks f32[..., NB, P, D] -> codes u8[..., NB, P, D],
    scale/min f16[..., NB, D], sums i32[..., NB, D] (sum over the block's tokens)."""
    q = quantize(blocks, bits=2, axis=blocks.ndim - 2, partition_size=config.partition_size,
                 rounding=config.rounding, key=key, meta_dtype=config.meta_dtype)
    return q.codes, q.scale[..., 0, :], q.minimum[..., 0, :], q.code_sums[..., 0, :]


def _quant_tokens_over_channels(x, config, pc, key):
    """Per (token, channel group): x f32[..., D] -> codes u8[..., D], scale/min f16[..., NP],
    sums i32[..., NP]."""
    q = quantize(x, bits=2, axis=x.ndim - 1, partition_size=pc, rounding=config.rounding,
                 key=key, meta_dtype=config.meta_dtype)
    return q.codes, q.scale, q.minimum, q.code_sums


def _prefill_hack(layer, k, v, lengths, page_indices, start, key):
    """Rows [0, lengths) of k/v as tokens [start, start + lengths) (start None: 0, empty slots).

    Works on a stream of block positions u = ustart + i (u = token - ns): ustart is the packing
    group of the old open block b0, the stream holds the earlier 16-bit open tokens (u in
    [b0 P, u_old)) followed by the new tokens. Its complete blocks in [b0, sealed_new) are quantized
    and written; packed bytes keep the planes of tokens stored before (u < u_keep).
    """
    cfg = layer.config
    p, pc, np_, bpp = _groups(cfg, layer.head_dim)
    ps, ns, n = cfg.page_size, cfg.num_sink_tokens, layer.num_pages
    s, t_len, h, d = k.shape
    seed = isinstance(layer, SeedPages)
    key_k, key_v = _split_key(key)
    chunked = start is not None
    st = start if chunked else jnp.zeros_like(lengths)

    kt = jnp.swapaxes(k, 1, 2).astype(jnp.float32)  # [S, H, T, D]
    vt = jnp.swapaxes(v, 1, 2).astype(jnp.float32)
    written = lengths > 0
    cap = page_indices.shape[1] * ps
    u_old = jnp.clip(st - ns, 0, cap)  # block positions held before this write (sealed + open)
    u_new = jnp.clip(st + lengths - ns, 0, cap)  # ... and after it
    b0 = u_old // p  # the old open block: the first block this write can seal
    sealed_new = u_new // p
    if chunked:  # (b0 % 4) P + (u_old - b0 P) + T <= T + 4P - 1 stream positions
        ng = -(-(t_len + 4 * p - 1) // (4 * p))
        ustart = (b0 // 4) * (4 * p)
    else:
        ng = max(1, -(-(t_len - ns) // (4 * p)))  # packing groups covering the prompt (>= 1: shapes)
        ustart = jnp.zeros_like(lengths)
    nb, nu = 4 * ng, 4 * ng * p
    u = ustart[:, None] + jnp.arange(nu)[None, :]  # [S, NU] block positions of the stream

    def stream(x, old_open):  # x f32[S, H, T, D] (+ the old open block) -> f32[S, H, NU, D]
        if not chunked:
            return jnp.pad(x[:, :, ns:], ((0, 0), (0, 0), (0, nu - max(t_len - ns, 0)), (0, 0)))
        row = jnp.clip(u + ns - st[:, None], 0, t_len - 1)  # k/v row of the new token at u
        new = jnp.take_along_axis(x, row[:, None, :, None], axis=2)
        old_row = jnp.clip(u - (b0 * p)[:, None], 0, p - 1)
        old = 0.0 if old_open is None else jnp.take_along_axis(
            old_open.astype(jnp.float32), old_row[:, None, :, None], axis=2)
        return jnp.where((u < u_old[:, None])[:, None, :, None], old, new)

    ku = stream(kt, None if seed else layer.open_k)  # seed: K of earlier tokens is in the pages
    vu = stream(vt, layer.open_v)

    gb = (ustart // p)[:, None] + jnp.arange(nb)[None, :]  # [S, NB] block index in the sequence
    in_new_blocks = (u >= (b0 * p)[:, None]) & (u < (sealed_new * p)[:, None])
    tok_sealed = written[:, None] & in_new_blocks  # [S, NU] tokens of the blocks sealed now
    tok_new = written[:, None] & (u >= u_old[:, None]) & (u < u_new[:, None])  # tokens written now
    blk_sealed = written[:, None] & (gb >= b0[:, None]) & (gb < sealed_new[:, None])  # [S, NB]

    # Block slots: page column gb // bpp, slot gb % bpp; token rows u % page_size.
    blk_pages = lambda ok: _page_ids(page_indices, gb // bpp, ok, n)
    tok_pages = lambda ok: _page_ids(page_indices, u // ps, ok, n)
    put_blocks = lambda a, x, ok: _put(a, (blk_pages(ok), _ALL, gb % bpp),
                                       jnp.swapaxes(x, 1, 2))  # x [S, H, NB, X]
    put_tokens = lambda a, x, ok: _put(a, (tok_pages(ok), _ALL, u % ps),
                                       jnp.swapaxes(x, 1, 2))  # x [S, H, NU, X]

    def put_codes(a, codes, ok, u_keep, token_major=False):
        """Packs codes u8[S, H, NU, D] per group (zero where not ok) and writes every group
        holding an ok token into `a` (token_major: kivi v_codes, else channel-major); planes of
        tokens u < u_keep (stored before) are kept (None: the slot was empty, no old plane needs
        keeping)."""
        codes = jnp.where(ok[:, None, :, None], codes, 0).reshape(s, h, ng, 4 * p, d)
        packed = jnp.moveaxis(packing.pack_2bit(codes, axis=3), 1, 3)  # [S, NG, P, H, D]
        gg = (ustart // (4 * p))[:, None] + jnp.arange(ng)[None, :]  # [S, NG] group in the sequence
        g_ok = ok.reshape(s, ng, 4 * p).any(-1)
        pages = _page_ids(page_indices, gg // (bpp // 4), g_ok, n)
        rows = (gg % (bpp // 4))[:, :, None] * p + jnp.arange(p)  # [S, NG, P]
        if u_keep is not None:
            j = jnp.arange(4)[:, None]  # [4, 1] plane = block of the group
            uu = (gg * 4 * p)[:, :, None, None] + j * p + jnp.arange(p)  # [S, NG, 4, P]
            keep = uu < u_keep[:, None, None, None]
            mask = jnp.sum(jnp.where(keep, packing.plane_mask(j), 0), axis=2).astype(jnp.uint8)
            old = a[_code_index(jnp.minimum(pages, n - 1)[:, :, None], rows, token_major)]  # [S, NG, P, H, D]
            packed = (old & mask[..., None, None]) | packed
        return _put(a, _code_index(pages[:, :, None], rows, token_major), packed)

    keep = lambda x: x if chunked else None

    def channel_sums(codes):  # u8[..., D] -> i32[..., NP]
        return codes.reshape(codes.shape[:-1] + (np_, pc)).astype(jnp.int32).sum(-1)

    if seed:
        kc, ksc, kmn, ksum = _quant_tokens_over_channels(ku, cfg, pc, key_k)
        vc, vsc, vmn, vsum = _quant_blocks_over_tokens(vu.reshape(s, h, nb, p, d), cfg, key_v)
        new = dict(
            k_codes=put_codes(layer.k_codes, kc, tok_new, keep(u_old)),
            k_scale=put_tokens(layer.k_scale, ksc, tok_new),
            k_min=put_tokens(layer.k_min, kmn, tok_new),
            k_sums=put_tokens(layer.k_sums, ksum, tok_new),
            v_codes=put_codes(layer.v_codes, vc.reshape(s, h, nu, d), tok_sealed, keep(b0 * p)),
            v_scale=put_blocks(layer.v_scale, vsc, blk_sealed),
            v_min=put_blocks(layer.v_min, vmn, blk_sealed),
            v_sums=put_blocks(layer.v_sums, vsum, blk_sealed))
    else:
        kc, ksc, kmn, _ = _quant_blocks_over_tokens(ku.reshape(s, h, nb, p, d), cfg, key_k)
        kc = kc.reshape(s, h, nu, d)
        vc, vsc, vmn, _ = _quant_tokens_over_channels(vu, cfg, pc, key_v)
        new = dict(
            k_codes=put_codes(layer.k_codes, kc, tok_sealed, keep(b0 * p)),
            k_scale=put_blocks(layer.k_scale, ksc, blk_sealed),
            k_min=put_blocks(layer.k_min, kmn, blk_sealed),
            k_sums=put_tokens(layer.k_sums, channel_sums(kc), tok_sealed),
            v_codes=put_codes(layer.v_codes, vc, tok_sealed, keep(b0 * p), token_major=True),
            v_scale=put_tokens(layer.v_scale, vsc, tok_sealed),
            v_min=put_tokens(layer.v_min, vmn, tok_sealed),
            v_sums=put_blocks(layer.v_sums, vc.reshape(s, h, nb, p, d).astype(jnp.int32).sum(3),
                              blk_sealed))

    # Open block: positions sealed_new * P + i, i < u_new % P; zero beyond.
    i = jnp.arange(p)
    src = jnp.clip((sealed_new * p - ustart)[:, None] + i[None, :], 0, nu - 1)  # [S, P]
    open_ok = (i[None, :] < (u_new - sealed_new * p)[:, None])[:, None, :, None]

    def open_block(x, old):
        blk = jnp.take_along_axis(x, src[:, None, :, None], axis=2)  # [S, H, P, D]
        return jnp.where(written[:, None, None, None], jnp.where(open_ok, blk, 0), old).astype(old.dtype)

    def sinks(x, old):  # rows t < start kept, [start, start + lengths) new, zero beyond
        if ns == 0:
            return old
        t = jnp.arange(ns)[None, :]
        row = jnp.clip(t - st[:, None], 0, t_len - 1)  # [S, ns]
        new_rows = jnp.take_along_axis(x, row[:, None, :, None], axis=2)  # [S, H, ns, D]
        is_new = ((t >= st[:, None]) & (t < (st + lengths)[:, None]))[:, None, :, None]
        kept = (t < st[:, None])[:, None, :, None]
        rows = jnp.where(is_new, new_rows, jnp.where(kept, old.astype(jnp.float32), 0.0))
        return jnp.where(written[:, None, None, None], rows, old).astype(old.dtype)

    new.update(open_v=open_block(vu, layer.open_v),
               sink_k=sinks(kt, layer.sink_k), sink_v=sinks(vt, layer.sink_v))
    if not seed:
        new.update(open_k=open_block(ku, layer.open_k))
    return dataclasses.replace(layer, **new)


# ----------------------------------------------------------------------------- append


SEAL_MODES = ("always", "never")


def seals_block(config: QuantConfig, kv_lens, active) -> bool:
    """Host-side: does an `append` at positions kv_lens (int[S], tokens held before the new one)
    fill some active slot's open block, so that the block must be sealed this step? True iff
    config.kv_format == "hack" and some active slot s has kv_lens[s] >= num_sink_tokens and
    (kv_lens[s] - num_sink_tokens) % partition_size == partition_size - 1. A decode loop that
    knows its lengths on the host (models.generate.Generator) passes seal="never" to `append` on
    the other steps (P - 1 of every P tokens at batch 1). NumPy only (no device sync)."""
    if config.kv_format != "hack":
        return False
    lens = np.asarray(kv_lens, np.int64)
    on = np.asarray(active, bool) & (lens >= config.num_sink_tokens)
    return bool(np.any(on & ((lens - config.num_sink_tokens) % config.partition_size
                             == config.partition_size - 1)))


def append(layer: LayerCache, k, v, *, kv_lens, active, page_indices, key=None,
           seal: str = "always") -> LayerCache:
    """Writes one token per active sequence: token number kv_lens[s] of slot s.

    Args:
      layer: the LayerCache.
      k, v: float[S, num_kv_heads, head_dim], S = max_seqs (rows of inactive slots ignored).
      kv_lens: i32[S] tokens held *before* this token (the new token's position).
      active: bool[S] which slots take a token this step.
      page_indices: i32[S, pages_per_seq]; the new token's page must be assigned.
      key: PRNG key for rounding="stochastic" (ValueError if None then); pass a fresh key per step.
      seal: (hack only; ignored by the other formats) how the sealing of full open blocks is
        compiled. "always" (default): every slot's sealed block is computed and the writes of the
        slots that do not seal are dropped (one compiled append serves a whole decode loop; ~10
        page-pool scatters per layer and step). "never": the caller promises that no active slot fills its
        open block this step (`seals_block(config, kv_lens, active)` is False): the seal path is
        left out. Concrete inputs: a broken promise raises ValueError; under jit it cannot be
        checked, and a slot that fills its block anyway keeps it unsealed while kv_lens count it
        as sealed (attention then reads a stale page slot), so pass "never" only from host-side
        knowledge of the lengths, as models.generate.Generator does.
    Returns the new LayerCache. hack: the token goes into its sink or open-block row; a slot whose
    open block becomes full is sealed (quantized into its page slot with code sums: the block's
    packing-group plane is cleared, then OR-ed, since pages are reused) and its open block zeroed.
    seed: K quantized per token at once into the page; only V goes through the open block.
    Raises ValueError on shape mismatch, an unknown `seal`, or (concrete inputs only) a negative
    kv_len, bad page ids / over capacity, NaN or inf in an active slot's k / v, seal="never" with a
    slot that seals; TypeError for non-integer kv_lens / page_indices. Under jit nothing can raise:
    a token at a negative position or beyond capacity, or bound for the null page or an id outside
    [0, num_pages), is dropped (never written elsewhere).
    """
    if seal not in SEAL_MODES:
        raise ValueError(f"append: seal must be one of {SEAL_MODES}, got {seal!r}")
    k, v = jnp.asarray(k), jnp.asarray(v)
    _check_kv(layer, k, v, 3, "append")
    paging.check_index_dtype("append", kv_lens=kv_lens, page_indices=page_indices)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    active = jnp.asarray(active, bool)
    page_indices = jnp.asarray(page_indices, jnp.int32)
    if kv_lens.shape != (k.shape[0],) or active.shape != kv_lens.shape or (
            page_indices.shape[0] != k.shape[0]):
        raise ValueError(f"append: batch mismatch: {k.shape=} {kv_lens.shape=} {active.shape=} "
                         f"{page_indices.shape=}")
    if not isinstance(kv_lens, jax.core.Tracer) and kv_lens.size and int(kv_lens.min()) < 0:
        raise ValueError(f"append: kv_lens must be >= 0: kv_lens={np.asarray(kv_lens).tolist()}")
    if not isinstance(active, jax.core.Tracer):
        _maybe_validate(layer, page_indices, kv_lens + active.astype(jnp.int32))
    _check_finite(k[np.asarray(active)] if not isinstance(active, jax.core.Tracer) else k,
                  v[np.asarray(active)] if not isinstance(active, jax.core.Tracer) else v, "append")
    if (seal == "never" and not isinstance(kv_lens, jax.core.Tracer) and not isinstance(active, jax.core.Tracer)
            and seals_block(layer.config, kv_lens, active)):
        lens = np.asarray(kv_lens)
        raise ValueError(f"append: seal='never' but an active slot fills its open block at this step "
                         f"(kv_lens={lens.tolist()}, partition_size={layer.config.partition_size}, "
                         f"num_sink_tokens={layer.config.num_sink_tokens}); use seal='always'")
    active = active & (kv_lens >= 0)  # under jit: a negative position is dropped, never wrapped
    if isinstance(layer, (DensePages, Int8Pages)):
        ps = layer.config.page_size
        pages = _page_ids(page_indices, kv_lens // ps, active, layer.num_pages)  # [S]
        put = lambda a, x: _put(a, (pages, _ALL, kv_lens % ps), x)
        if isinstance(layer, DensePages):
            return dataclasses.replace(layer, k=put(layer.k, k), v=put(layer.v, v))
        (kc, ks, km), (vc, vs, vm) = _int8(k), _int8(v)
        return dataclasses.replace(
            layer, k_codes=put(layer.k_codes, kc), k_scale=put(layer.k_scale, ks),
            k_min=put(layer.k_min, km), v_codes=put(layer.v_codes, vc),
            v_scale=put(layer.v_scale, vs), v_min=put(layer.v_min, vm))
    return _append_hack(layer, k, v, kv_lens, active, page_indices, key, seal)


def _append_hack(layer, k, v, kv_lens, active, page_indices, key, seal_mode="always"):
    cfg = layer.config
    p, pc, np_, bpp = _groups(cfg, layer.head_dim)
    ps, ns, n = cfg.page_size, cfg.num_sink_tokens, layer.num_pages
    s = k.shape[0]
    seed = isinstance(layer, SeedPages)
    key_k, key_v = _split_key(key)
    seq = jnp.arange(s)

    is_sink = active & (kv_lens < ns)
    in_pages = active & (kv_lens >= ns) & (kv_lens < ns + page_indices.shape[1] * ps)  # else dropped
    u = jnp.maximum(kv_lens - ns, 0)
    pos, blk = u % p, u // p
    slot = blk % bpp
    seal = in_pages & (pos == p - 1)
    i = jnp.arange(p)

    def put_row(a, x, ok, row):  # a [S, H, R, D] per-sequence buffer, x [S, H, D]
        return _put(a, (seq, _ALL, jnp.where(ok, row, a.shape[2])), x)

    new = dict(sink_k=put_row(layer.sink_k, k, is_sink, kv_lens),
               sink_v=put_row(layer.sink_v, v, is_sink, kv_lens))
    open_v = put_row(layer.open_v, v, in_pages, pos)

    seal_pages = _page_ids(page_indices, blk // bpp, seal, n)  # [S]
    blk_rows = (slot // 4)[:, None] * p + i[None, :]  # [S, P] packed rows of the block
    tok_rows = slot[:, None] * p + i[None, :]  # [S, P] token rows of the block

    def put_block_codes(a, codes, token_major=False):
        """Clears the block's plane in its packing group and ORs the new codes u8[S, H, P, D]
        (token_major: kivi v_codes, else channel-major)."""
        old = a[_code_index(jnp.minimum(seal_pages, n - 1)[:, None], blk_rows, token_major)]  # [S, P, H, D]
        new_bytes = _set_plane(old, jnp.swapaxes(codes, 1, 2), (slot % 4)[:, None, None, None])
        return _put(a, _code_index(seal_pages[:, None], blk_rows, token_major), new_bytes)

    put_block = lambda a, x: _put(a, (seal_pages, _ALL, slot), x)  # x [S, H, X]
    zero_sealed = lambda x: jnp.where(seal[:, None, None, None], 0, x).astype(x.dtype)  # open blocks
    put_block_tokens = lambda a, x: _put(a, (seal_pages[:, None], _ALL, tok_rows),
                                         jnp.swapaxes(x, 1, 2))  # x [S, H, P, X]

    if seed:
        # K: quantized now, written into its row and plane of the page (every step).
        kc, ksc, kmn, ksum = _quant_tokens_over_channels(k.astype(jnp.float32), cfg, pc, key_k)
        tok_pages = _page_ids(page_indices, u // ps, in_pages, n)  # [S]
        prow = (slot // 4) * p + pos
        old = layer.k_codes[jnp.minimum(tok_pages, n - 1), :, prow]  # [S, H, D]
        kbytes = _set_plane(old, kc, (slot % 4)[:, None, None])
        put_tok = lambda a, x: _put(a, (tok_pages, _ALL, u % ps), x)
        new.update(k_codes=_put(layer.k_codes, (tok_pages, _ALL, prow), kbytes),
                   k_scale=put_tok(layer.k_scale, ksc), k_min=put_tok(layer.k_min, kmn),
                   k_sums=put_tok(layer.k_sums, ksum))
        sealed = dict(v_codes=layer.v_codes, v_scale=layer.v_scale, v_min=layer.v_min, v_sums=layer.v_sums,
                      open_v=open_v)

        def seal_blocks(a):  # V: the open block quantized per channel over its tokens
            vc, vsc, vmn, vsum = _quant_blocks_over_tokens(a["open_v"].astype(jnp.float32)[:, :, None], cfg, key_v)
            return dict(v_codes=put_block_codes(a["v_codes"], vc[:, :, 0]),
                        v_scale=put_block(a["v_scale"], vsc[:, :, 0]), v_min=put_block(a["v_min"], vmn[:, :, 0]),
                        v_sums=put_block(a["v_sums"], vsum[:, :, 0]), open_v=zero_sealed(a["open_v"]))
    else:
        open_k = put_row(layer.open_k, k, in_pages, pos)
        sealed = dict(k_codes=layer.k_codes, k_scale=layer.k_scale, k_min=layer.k_min, k_sums=layer.k_sums,
                      v_codes=layer.v_codes, v_scale=layer.v_scale, v_min=layer.v_min, v_sums=layer.v_sums,
                      open_k=open_k, open_v=open_v)

        def seal_blocks(a):  # K per channel over the block's tokens, V per token over channel groups
            kc, ksc, kmn, _ = _quant_blocks_over_tokens(a["open_k"].astype(jnp.float32)[:, :, None], cfg, key_k)
            kc = kc[:, :, 0]  # [S, H, P, D]
            ksum = kc.reshape(kc.shape[:-1] + (np_, pc)).astype(jnp.int32).sum(-1)  # [S, H, P, NP]
            vc, vsc, vmn, _ = _quant_tokens_over_channels(a["open_v"].astype(jnp.float32), cfg, pc, key_v)
            return dict(
                k_codes=put_block_codes(a["k_codes"], kc),
                k_scale=put_block(a["k_scale"], ksc[:, :, 0]), k_min=put_block(a["k_min"], kmn[:, :, 0]),
                k_sums=put_block_tokens(a["k_sums"], ksum),
                v_codes=put_block_codes(a["v_codes"], vc, token_major=True),
                v_scale=put_block_tokens(a["v_scale"], vsc), v_min=put_block_tokens(a["v_min"], vmn),
                v_sums=put_block(a["v_sums"], vc.astype(jnp.int32).sum(2)),
                open_k=zero_sealed(a["open_k"]), open_v=zero_sealed(a["open_v"]))

    if seal_mode == "always":
        sealed = seal_blocks(sealed)
    new.update(sealed)  # "never": the open-block rows written above, nothing sealed
    return dataclasses.replace(layer, **new)


# ----------------------------------------------------------------------------- reading


class HackBlocks(NamedTuple):
    """Every sealed block of every sequence of a hack-format layer, read through page_indices and
    unpacked (NB = pages_per_seq * page_size // P blocks per sequence, in token order).

    Entries beyond a sequence's length are zeroed (codes, metadata and sums), so stale or NaN page
    contents cannot leak. Metadata as stored (f16), sums as i32; per-layout meaning as in
    KiviPages / SeedPages with the page axes replaced by [S, NB]:
      kivi: k_scale/k_min [S, NB, H, D], k_sums [S, NB, H, P, NP],
            v_scale/v_min [S, NB, H, P, NP], v_sums [S, NB, H, D]
      seed: k_scale/k_min/k_sums [S, NB, H, P, NP], v_scale/v_min/v_sums [S, NB, H, D]
      k_codes, v_codes u8[S, NB, H, P, D] in [0, 3].
    seed: K of the tokens in the open block is in block num_sealed (valid rows < num_open).
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    k_sums: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    v_sums: jax.Array
    num_sealed: jax.Array  # i32[S] complete blocks
    num_open: jax.Array  # i32[S] tokens in the open block
    num_sinks: jax.Array  # i32[S] sink tokens held


def read_blocks(layer: KiviPages | SeedPages, page_indices, kv_lens) -> HackBlocks:
    """Gathers a hack-format layer's pages for all sequences (shapes in HackBlocks). jit-able.

    page_indices i32[S, pages_per_seq]; kv_lens i32[S], clipped to the capacity. Ids outside
    [0, num_pages) read the null page (and whatever they hold is masked).
    """
    cfg = layer.config
    p, _, _, bpp = _groups(cfg, layer.head_dim)
    ns, n = cfg.num_sink_tokens, layer.num_pages
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    ids = jnp.asarray(page_indices, jnp.int32)
    ids = jnp.where((ids >= 0) & (ids < n), ids, paging.NULL_PAGE)
    s, pps = ids.shape
    nb = pps * bpp
    n_u = jnp.clip(kv_lens - ns, 0, pps * cfg.page_size)  # lengths beyond capacity are clipped
    num_sealed, num_open = n_u // p, n_u % p
    blk_ok = jnp.arange(nb)[None, :] < num_sealed[:, None]  # [S, NB]
    tok_ok = (jnp.arange(nb * p) < n_u[:, None]).reshape(s, nb, p)  # [S, NB, P]

    def codes(a, token_major=False):  # u8[N, H, ps//4, D] (token_major [N, H, D, ps//4]) -> u8[S, NB, H, P, D]
        g = a[ids]  # [S, pps, H, ps//4, D] (token_major: [S, pps, H, D, ps//4])
        if token_major:
            g = jnp.swapaxes(g, 3, 4)  # the gathered pages only, never the pool
        g = g.reshape(s, pps, g.shape[2], bpp // 4, p, g.shape[-1])
        g = packing.unpack_2bit(g, axis=4).reshape(s, pps, g.shape[2], bpp // 4, 4, p, g.shape[-1])
        return jnp.moveaxis(g, 2, 4).reshape(s, nb, g.shape[2], p, g.shape[-1])

    def per_block(a):  # [N, H, bpp, X] -> [S, NB, H, X]
        g = jnp.swapaxes(a[ids], 2, 3)
        return g.reshape(s, nb, g.shape[3], g.shape[4])

    def per_token(a):  # [N, H, ps, X] -> [S, NB, H, P, X]
        g = a[ids].reshape(s, pps, a.shape[1], bpp, p, a.shape[-1])
        return jnp.swapaxes(g, 2, 3).reshape(s, nb, a.shape[1], p, a.shape[-1])

    blk_mask = lambda x: jnp.where(blk_ok.reshape(s, nb, *([1] * (x.ndim - 2))), x, 0)
    tok_mask = lambda x: jnp.where(tok_ok.reshape(s, nb, 1, p, *([1] * (x.ndim - 4))), x, 0)
    i32 = lambda x: x.astype(jnp.int32)
    if isinstance(layer, SeedPages):
        k_parts = (tok_mask(codes(layer.k_codes)), tok_mask(per_token(layer.k_scale)),
                   tok_mask(per_token(layer.k_min)), i32(tok_mask(per_token(layer.k_sums))))
        v_parts = (blk_mask(codes(layer.v_codes)), blk_mask(per_block(layer.v_scale)),
                   blk_mask(per_block(layer.v_min)), i32(blk_mask(per_block(layer.v_sums))))
    else:
        k_parts = (blk_mask(codes(layer.k_codes)), blk_mask(per_block(layer.k_scale)),
                   blk_mask(per_block(layer.k_min)), i32(blk_mask(per_token(layer.k_sums))))
        v_parts = (blk_mask(codes(layer.v_codes, token_major=True)), blk_mask(per_token(layer.v_scale)),
                   blk_mask(per_token(layer.v_min)), i32(blk_mask(per_block(layer.v_sums))))
    return HackBlocks(*k_parts, *v_parts, num_sealed=num_sealed, num_open=num_open,
                      num_sinks=jnp.minimum(kv_lens, ns))


def _deq_over_tokens(codes, scale, minimum):  # u8[..., P, D], f16[..., D] -> f32[..., P, D]
    f = lambda x: x.astype(jnp.float32)
    return f(codes) * f(scale)[..., None, :] + f(minimum)[..., None, :]


def _deq_over_channels(codes, scale, minimum):  # u8[..., D], f16[..., NP] -> f32[..., D]
    np_ = scale.shape[-1]
    c = codes.astype(jnp.float32).reshape(codes.shape[:-1] + (np_, -1))
    out = c * scale.astype(jnp.float32)[..., None] + minimum.astype(jnp.float32)[..., None]
    return out.reshape(codes.shape)


def _hack_dense(layer, page_indices, kv_lens):
    """(k, v, k_step, v_step) f32[S, capacity, H, D]: dequantized contents and per-element
    quantization scale (0 where stored in 16 bits)."""
    cfg = layer.config
    p = cfg.partition_size
    blocks = read_blocks(layer, page_indices, kv_lens)
    s, nb, h, _, d = blocks.k_codes.shape
    seed = isinstance(layer, SeedPages)
    bcast = lambda x: jnp.broadcast_to(x[..., None, :], x.shape[:-1] + (p, x.shape[-1]))
    chan = lambda x: jnp.repeat(x, d // x.shape[-1], axis=-1)
    k_over_ch, v_over_ch = seed, not seed
    kq = (_deq_over_channels(blocks.k_codes, blocks.k_scale, blocks.k_min) if k_over_ch
          else _deq_over_tokens(blocks.k_codes, blocks.k_scale, blocks.k_min))
    vq = (_deq_over_channels(blocks.v_codes, blocks.v_scale, blocks.v_min) if v_over_ch
          else _deq_over_tokens(blocks.v_codes, blocks.v_scale, blocks.v_min))
    kst = chan(blocks.k_scale) if k_over_ch else bcast(blocks.k_scale)
    vst = chan(blocks.v_scale) if v_over_ch else bcast(blocks.v_scale)
    flat = lambda x: jnp.swapaxes(x, 2, 3).reshape(s, nb * p, h, d).astype(jnp.float32)  # [S, U, H, D]
    kq, vq, kst, vst = map(flat, (kq, vq, kst, vst))

    u = jnp.arange(nb * p)
    in_open = (u[None, :] >= (blocks.num_sealed * p)[:, None]) & (
        u[None, :] < (blocks.num_sealed * p + blocks.num_open)[:, None])  # [S, U]
    j = jnp.clip(u[None, :] - (blocks.num_sealed * p)[:, None], 0, p - 1)

    def overlay(quant, step, open_):  # open_ [S, H, P, D] placed at the open block's positions
        o = jnp.take_along_axis(jnp.swapaxes(open_, 1, 2).astype(jnp.float32), j[:, :, None, None], 1)
        m = in_open[:, :, None, None]
        return jnp.where(m, o, quant), jnp.where(m, 0.0, step)

    if not seed:
        kq, kst = overlay(kq, kst, layer.open_k)
    vq, vst = overlay(vq, vst, layer.open_v)
    sink = lambda x: jnp.swapaxes(x, 1, 2).astype(jnp.float32)  # [S, ns, H, D]
    zeros = jnp.zeros((s, cfg.num_sink_tokens, h, d), jnp.float32)
    k = jnp.concatenate([sink(layer.sink_k), kq], axis=1)
    v = jnp.concatenate([sink(layer.sink_v), vq], axis=1)
    return k, v, jnp.concatenate([zeros, kst], 1), jnp.concatenate([zeros, vst], 1)


def dequantize_cache(layer: LayerCache, page_indices, kv_lens, *, return_step: bool = False):
    """All sequences' cache contents as float32, in token order. jit-able.

    Args:
      page_indices: i32[S, pages_per_seq]; kv_lens: i32[S].
    Returns (k, v) f32[S, capacity, num_kv_heads, head_dim], zero at positions >= kv_lens;
    with return_step, also (k_step, v_step) of the same shape: the quantization scale of each
    element (|x - x_hat| <= step / 2 for nearest rounding), 0 for elements stored in 16 bits or
    unquantized.
    """
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    if kv_lens.shape != (jnp.shape(page_indices)[0],):
        raise ValueError(f"dequantize_cache: kv_lens must be i32[{jnp.shape(page_indices)[0]}] (one per "
                         f"page-table row), got {kv_lens.shape=}")
    if isinstance(layer, (KiviPages, SeedPages)):
        k, v, ks, vs = _hack_dense(layer, page_indices, kv_lens)
    else:
        ids = jnp.asarray(page_indices, jnp.int32)
        ids = jnp.where((ids >= 0) & (ids < layer.num_pages), ids, paging.NULL_PAGE)
        s = ids.shape[0]

        def flat(a):  # [N, H, ps, ...] -> [S, pps * ps, H, ...]
            g = jnp.swapaxes(a[ids], 2, 3)  # [S, pps, ps, H, ...]
            return g.reshape((s, -1) + g.shape[3:]).astype(jnp.float32)

        if isinstance(layer, DensePages):
            k, v = flat(layer.k), flat(layer.v)
            ks = vs = jnp.zeros_like(k)
        else:
            k = flat(layer.k_codes) * flat(layer.k_scale)[..., None] + flat(layer.k_min)[..., None]
            v = flat(layer.v_codes) * flat(layer.v_scale)[..., None] + flat(layer.v_min)[..., None]
            ks = jnp.broadcast_to(flat(layer.k_scale)[..., None], k.shape)
            vs = jnp.broadcast_to(flat(layer.v_scale)[..., None], v.shape)
    valid = (jnp.arange(k.shape[1])[None, :] < kv_lens[:, None])[:, :, None, None]
    k, v, ks, vs = (jnp.where(valid, x, 0.0) for x in (k, v, ks, vs))
    return (k, v, ks, vs) if return_step else (k, v)


def gather(layer: LayerCache, seq: int, kv_len: int, page_indices, *, return_step: bool = False):
    """Host-side test helper: the dequantized contents of one sequence.

    Args:
      seq: sequence slot; kv_len: its length; page_indices: i32[S, pages_per_seq].
    Returns (k, v) np.float32[kv_len, num_kv_heads, head_dim] (and the per-element steps, see
    dequantize_cache, with return_step).
    Raises ValueError for a bad slot, a length beyond capacity, or a bad page id in its row.
    """
    table = np.asarray(page_indices)
    if not 0 <= seq < table.shape[0]:
        raise ValueError(f"sequence slot out of range [0, {table.shape[0]}): {seq=}")
    lens = np.zeros(table.shape[0], np.int32)
    paging.validate_page_indices(table[seq:seq + 1], np.array([kv_len]),
                                 num_pages=layer.num_pages, page_size=layer.config.page_size,
                                 num_sink_tokens=sink_tokens(layer.config))
    lens[seq] = kv_len
    out = _dequantize_jit(layer, jnp.asarray(table, jnp.int32), jnp.asarray(lens), return_step)
    return tuple(np.asarray(x[seq, :kv_len]) for x in out)


_dequantize_jit = jax.jit(
    lambda layer, table, lens, return_step: dequantize_cache(layer, table, lens,
                                                             return_step=return_step),
    static_argnums=3)


# ----------------------------------------------------------------------------- memory


def _layer_shapes(config, num_kv_heads, head_dim, num_pages, max_seqs):
    return jax.eval_shape(lambda: init_layer(config, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                             num_pages=num_pages, max_seqs=max_seqs))


def _nbytes(x) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def _category(name: str) -> str:
    if name.startswith(("open", "sink")):
        return "open_blocks" if name.startswith("open") else "sinks"
    if name.endswith("sums"):
        return "sums"
    if name.endswith(("scale", "min")):
        return "metadata"
    return "codes"  # codes, or the K/V values themselves for bf16/float32


def bytes_per_token(config: QuantConfig, num_kv_heads: int, head_dim: int, num_layers: int) -> float:
    """Page bytes per cached token over all layers (codes + metadata + sums, full pages); the
    per-sequence open blocks and sinks are not per-token and are counted by cache_bytes_report."""
    shapes = _layer_shapes(config, num_kv_heads, head_dim, 2, 1)
    page = sum(_nbytes(getattr(shapes, f.name)) for f in dataclasses.fields(shapes)
               if f.name != "config" and _category(f.name) not in ("open_blocks", "sinks")) / 2
    return num_layers * page / config.page_size


def cache_bytes_report(config: QuantConfig, *, num_layers: int, num_kv_heads: int, head_dim: int,
                       seq_len: int, max_seqs: int = 1) -> dict:
    """Device bytes of a cache holding max_seqs sequences of seq_len tokens, vs bf16.

    Pages are counted whole (pages_needed per sequence, plus the null page), and per-sequence open
    blocks and sinks are included: this is what init_cache would allocate for exactly this load.
    Returns a dict of ints: codes, metadata, sums, open_blocks, sinks, total, num_pages, and
    bf16 (a dense bf16 cache of exactly max_seqs * seq_len tokens), plus ratio = total / bf16.
    """
    per_seq = paging.pages_needed(seq_len, page_size=config.page_size,
                                  num_sink_tokens=sink_tokens(config))
    num_pages = max_seqs * per_seq + 1
    shapes = _layer_shapes(config, num_kv_heads, head_dim, num_pages, max_seqs)
    report = dict(codes=0, metadata=0, sums=0, open_blocks=0, sinks=0)
    for f in dataclasses.fields(shapes):
        if f.name != "config":
            report[_category(f.name)] += num_layers * _nbytes(getattr(shapes, f.name))
    report["total"] = sum(report.values())
    report["num_pages"] = num_pages
    report["bf16"] = num_layers * 2 * max_seqs * seq_len * num_kv_heads * head_dim * 2
    report["ratio"] = report["total"] / report["bf16"]
    return report
