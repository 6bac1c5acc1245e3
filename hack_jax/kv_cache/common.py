"""Pieces every cache format shares: the pytree dataclass, page-id masking, masked scatters, the
unblocked formats' writers, the format registry's record type, and the boundary checks of the
public writers."""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import paging
from hack_jax.config import QuantConfig
from hack_jax.quantization import quantize, saturation_bound

STATIC = dict(static=True)
ALL = slice(None)

Format = Literal["kivi", "seed", "bf16", "float32", "int8", "fp8", "kivi2", "int4", "turbo3", "turbo4"]
Seal = Literal["always", "never", "after"]


def format_of(config: QuantConfig) -> Format:
    """The registry key of a config: its layout for kv_format="hack", else its kv_format."""
    return config.layout if config.kv_format == "hack" else config.kv_format


def pytree_dataclass(cls):
    """A frozen dataclass registered as a pytree (fields with STATIC metadata are static)."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


class Pages:
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


@dataclasses.dataclass(frozen=True)
class FormatOps:
    """One cache format behind the public functions of hack_jax.kv_cache (one registry entry).

      pages: its LayerCache class.
      blocked: tokens are kept as sinks + sealed P-token blocks + a 16-bit open block (the 2-bit
        formats); False: token t lives in page column t // page_size, no sinks.
      init(config, n, h, d, s): the all-zero layer (sizes already validated).
      write_prefill(layer, k, v, lengths, page_indices, start, key) and
      append(layer, k, v, kv_lens, active, page_indices, key, seal, sinks): the writers, inputs validated
        (seal, sinks: kv_cache.append's, static; the formats without open blocks / sinks ignore them).
      dequantize(layer, page_indices, kv_lens) -> (k, v, k_step, v_step) f32[S, capacity, H, D],
        before the mask at kv_lens.
      read_blocks: (layer, page_indices, kv_lens) -> HackBlocks for the blocked formats, else None.
      seal: (layer, kv_lens, active, page_indices, key) -> layer, the sealing half of append(seal="always")
        after an append(seal="after") (kv_lens: the new token's position, as append's), for the formats
        that can defer it (kivi), else None.
      rotation: (config, head_dim) -> the orthogonal f32[D, D] K and V rows are multiplied by before
        they are stored (int4, turbo: hack_jax.rotation.kv_rotation), or None (no rotation).
    """

    pages: type
    blocked: bool
    init: Callable
    write_prefill: Callable
    append: Callable
    dequantize: Callable
    read_blocks: Callable | None = None
    seal: Callable | None = None
    rotation: Callable | None = None


def array_fields(layer) -> list[str]:
    """Names of the arrays a LayerCache holds, in field order: every field but config, less the ones it
    leaves None (kivi's k_sums / v_sums with QuantConfig.code_sums False: no bytes, no operand)."""
    return [f.name for f in dataclasses.fields(layer) if f.name != "config" and getattr(layer, f.name) is not None]


def geometry(config: QuantConfig, head_dim: int):
    """(P, Pc, NP, bpp): token block, channel group (min(config.channel_group, head_dim)), channel
    groups per head, blocks per page."""
    p = config.partition_size
    pc = min(config.channel_group, head_dim)
    return p, pc, head_dim // pc, config.page_size // p


def sums_dtype(num_summed: int, bits: int = 2):
    """Dtype of sums of num_summed `bits`-bit codes: u8 while (2**bits - 1) * num_summed fits, else u16."""
    return jnp.uint8 if ((1 << bits) - 1) * num_summed <= 255 else jnp.uint16


def safe_ids(page_indices, num_pages):
    """i32 page table with ids outside [0, num_pages) replaced by the null page (for reads)."""
    ids = jnp.asarray(page_indices, jnp.int32)
    return jnp.where((ids >= 0) & (ids < num_pages), ids, paging.NULL_PAGE)


def page_ids(page_indices, col, ok, num_pages):
    """Page id of table column `col` (int[S, ...]) per sequence for writing; num_pages (an
    out-of-bounds id, dropped by `mode="drop"` writes) where not ok, where the table entry is out of
    range, or where it is the null page (which writes never touch)."""
    pps = page_indices.shape[1]
    flat = col.reshape(col.shape[0], -1)
    ids = jnp.take_along_axis(page_indices, jnp.clip(flat, 0, pps - 1), axis=1).reshape(col.shape)
    good = ok & (col >= 0) & (col < pps) & (ids > paging.NULL_PAGE) & (ids < num_pages)
    return jnp.where(good, ids, num_pages)


def put(a, index, x):
    """a.at[index].set(x), out-of-bounds entries dropped: how every write here is masked."""
    return a.at[index].set(x.astype(a.dtype), mode="drop")


def token_noise(config, key, which, positions, num_kv_heads, head_dim):
    """The stochastic-rounding noise of tokens, keyed by (sequence key, token position): U[0, 1)
    f32[S, H, N, D] for the tokens at positions i32[S, N] (sinks included in the count); element
    (s, h, n, d) is drawn from fold_in(fold_in(key_s, which), positions[s, n]) alone, so a token's
    codes never depend on its slot, its batch mates or how its sequence was split into prefill
    chunks and appends (given the same key). which: 0 for K, 1 for V.

    key: one PRNG key shared by every slot, or one per slot (a key array [S]: independent noise per
    sequence); raw uint32 keys are accepted. None for rounding="nearest" (returns None);
    ValueError for rounding="stochastic" without a key.
    """
    if config.rounding != "stochastic":
        return None
    if key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key, got key=None")
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    if key.ndim not in (0, 1) or (key.ndim == 1 and key.shape[0] != positions.shape[0]):
        raise ValueError(f"key must be one PRNG key or one per slot [{positions.shape[0]}], got "
                         f"key.shape={key.shape}")

    def one(k, t):  # one token: [H, D]
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(k, which), t),
                                  (num_kv_heads, head_dim), jnp.float32)

    per_seq = jax.vmap(lambda k, ts: jax.vmap(lambda t: one(k, t))(ts), in_axes=(0 if key.ndim else None, 0))
    return jnp.swapaxes(per_seq(key, positions), 1, 2)  # [S, N, H, D] -> [S, H, N, D]


def token_targets(layer, lengths, page_indices, t_len, start):
    """(pages i32[S, T], rows i32[S, T]) for rows 0..T-1 (tokens start + t) of the unblocked
    formats; pages is out of bounds (dropped) for rows t >= lengths[s]."""
    ps = layer.config.page_size
    t = jnp.broadcast_to(jnp.arange(t_len), (lengths.shape[0], t_len))
    ok = t < lengths[:, None]
    if start is not None:
        t = t + start[:, None]
    return page_ids(page_indices, t // ps, ok, layer.num_pages), t % ps


def per_token_writers(encode):
    """(write_prefill, append) with FormatOps' signatures for the unblocked formats (token t in page
    column t // page_size, row t % page_size): encode(layer, x) maps rows x float[..., H, D] to
    {suffix: array[..., H, ...]}, each stored in the layer's fields "k" + suffix and "v" + suffix."""

    def write(layer, index, k, v):
        return dataclasses.replace(layer, **{
            name + suffix: put(getattr(layer, name + suffix), index, a)
            for name, x in (("k", k), ("v", v)) for suffix, a in encode(layer, x).items()})

    def write_prefill(layer, k, v, lengths, page_indices, start, key):
        pages, rows = token_targets(layer, lengths, page_indices, k.shape[1], start)
        return write(layer, (pages, ALL, rows), k, v)

    def append(layer, k, v, kv_lens, active, page_indices, key, seal, sinks):
        ps = layer.config.page_size
        pages = page_ids(page_indices, kv_lens // ps, active, layer.num_pages)  # [S]
        return write(layer, (pages, ALL, kv_lens % ps), k, v)

    return write_prefill, append


def flat_tokens(a, ids, dtype=jnp.float32):
    """[N, H, page_size, ...] pages read through ids i32[S, pps] -> dtype[S, pps * page_size, H, ...]."""
    g = jnp.swapaxes(a[ids], 2, 3)  # [S, pps, ps, H, ...]
    return g.reshape((ids.shape[0], -1) + g.shape[3:]).astype(dtype)


def quant_blocks_over_tokens(blocks, config, noise):
    """Per (block, channel): blocks f32[..., NB, P, D] -> codes u8[..., NB, P, D],
    scale/min f16[..., NB, D], sums i32[..., NB, D] (sum over the block's tokens). noise: blocks'
    shape (token_noise), or None for nearest rounding. config.clip: the clipping search of quantize."""
    q = quantize(blocks, bits=config.bits, axis=blocks.ndim - 2, partition_size=config.partition_size,
                 rounding=config.rounding, noise=noise, meta_dtype=config.meta_dtype, clip=config.clip)
    return q.codes, q.scale[..., 0, :], q.minimum[..., 0, :], q.code_sums[..., 0, :]


def quant_tokens_over_channels(x, config, pc, noise):
    """Per (token, channel group): x f32[..., D] -> codes u8[..., D], scale/min f16[..., NP],
    sums i32[..., NP]. noise: x's shape (token_noise), or None for nearest rounding."""
    q = quantize(x, bits=config.bits, axis=x.ndim - 1, partition_size=pc, rounding=config.rounding,
                 noise=noise, meta_dtype=config.meta_dtype, clip=config.clip)
    return q.codes, q.scale, q.minimum, q.code_sums


def is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def check_kv(layer, k, v, ndim, what):
    if k.ndim != ndim or v.ndim != ndim:
        raise ValueError(f"{what}: k and v must have {ndim} axes, got {k.shape=} {v.shape=}")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k and v must have the same shape: {k.shape=} {v.shape=}")
    if not (jnp.issubdtype(k.dtype, jnp.floating) and jnp.issubdtype(v.dtype, jnp.floating)):
        raise ValueError(f"{what}: k and v must be floating, got {k.dtype=} {v.dtype=}")
    if (k.shape[-2], k.shape[-1]) != (layer.num_kv_heads, layer.head_dim):
        raise ValueError(f"{what}: k's (num_kv_heads, head_dim) must match the cache "
                         f"({layer.num_kv_heads}, {layer.head_dim}): {k.shape=}")


# kv_formats whose scale / min are config.meta_dtype
F16_META_FORMATS = ("hack", "int8", "kivi2", "int4", "turbo3", "turbo4")


@jax.jit
def _finite_stats(x, rows):
    """(count of NaN / inf, max |x| over the finite-or-not values) of x's rows where rows (bool over
    x's leading axes) holds; other rows count as 0. One compiled program per x shape, whatever rows
    selects (an eager x[rows] compiles its gather and reductions per selected count)."""
    keep = rows.reshape(rows.shape + (1,) * (x.ndim - rows.ndim))
    bad = jnp.sum(keep & ~jnp.isfinite(x), dtype=jnp.int32)
    return bad, jnp.max(jnp.where(keep, jnp.abs(x), jnp.zeros((), x.dtype)))


def check_finite(k, v, what, config=None, rows=None):
    """Concrete K/V only (a host sync; inside jit nothing can raise): ValueError on NaN or inf, which
    no format can store (2-bit codes would hold garbage for the whole block), and, for the quantized
    formats with float16 scale/min (config given, kv_format "hack" / "int8" / "kivi2"; fp8's scale is
    float32), on a finite value beyond the float16 metadata's
    range (|x| > saturation_bound, 65504): quantize would clip it there silently. Under jit those
    values saturate (quantize's documented behaviour) and NaN stays NaN. rows: None = every value of
    k / v is checked, or a host bool array over their leading axes: only those rows (k[rows] and
    v[rows], read in place)."""
    bound = None
    if config is not None and config.kv_format in F16_META_FORMATS:
        bound = saturation_bound(2, config.meta_dtype)  # finfo(meta_dtype).max for bits > 1
    for name, x in (("k", k), ("v", v)):
        if is_traced(x) or not x.size:
            continue
        if rows is not None:
            mask = np.asarray(rows, bool)
            if not mask.any():
                continue
            n, top = jax.device_get(_finite_stats(x, mask))
            n, top = int(n), float(top)
        else:
            n = 0 if bool(jnp.isfinite(x).all()) else int((~jnp.isfinite(x)).sum())
            top = None
        if n:
            raise ValueError(f"{what}: {name} holds {n} NaN or inf value(s) in the rows to be written")
        if bound is not None:
            top = float(jnp.abs(x).max()) if top is None else top
            if top > bound:
                raise ValueError(f"{what}: {name} holds |value| up to {top:g}, beyond "
                                 f"{bound:g}, the largest the {jnp.dtype(config.meta_dtype).name} scale/min "
                                 f"of kv_format={config.kv_format!r} hold (it would be clipped); rescale, "
                                 f"or use kv_format='bf16' / 'float32'")
