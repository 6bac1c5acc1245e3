"""Paged bf16 causal prefill attention (the unquantized baseline of the HACK prefill kernel).

Computes, for every sequence b, query row t (position pos = q_start[b] + t) and query head h (kv
head h // q_per_kv, q_per_kv = num_q_heads // num_kv_heads),

    out[b, t, h] = softmax(q[b, t, h] . K_b[:pos + 1]^T / sqrt(head_dim)) V_b[:pos + 1]

over the keys at positions <= pos (and < kv_lens[b]) of sequence b, whose K/V live in the pages
page_indices[b, 0], page_indices[b, 1], ... of a paged bf16 cache (DESIGN.md kv_format="bf16").
Rows at or past kv_lens[b] return 0. Online softmax in float32 with exp2 (log2(e) folded into the
softmax scale), q and the softmax weights rounded to bf16 for the dots (FlashAttention's numerics).

Reference twin: `hack_jax.attention.prefill_attention(..., impl="reference")` for kv_format="bf16"
(dense float32 attention over the gathered pages); tests/test_prefill_kernels.py also checks it
against an independent float64 NumPy attention with the flash-attention rule (error <= 2x that of
the same math done naively in bf16).

Shapes and dtypes (S = batch, H = num_kv_heads):
  q      float[S, T, num_q_heads, head_dim] (any float dtype, rounded to bf16)
         -> out f32[S, T, num_q_heads, head_dim]
  k, v   bf16[num_pages, H, page_size, head_dim]
  page_indices i32[S, pages_per_seq];  kv_lens i32[S] (this chunk included);  q_start i32[S]
Supported: head_dim and page_size powers of two >= 16, block_k <= page_size, any GQA ratio
(q_per_kv padded to a power of two).

Structure (the same as pallas_kernels/prefill_attention.py, so the two time the same machinery):
grid (S, H, query tiles), the heaviest (last) tiles first; a program holds block_q positions x
q_per_kv_pad query heads of one kv head = R rows (GQA folded into the dot's M: each K/V tile is
loaded once for the q_per_kv heads); it walks the key tiles of block_k tokens (a slice of one page,
page id read from the int32 page table inside the kernel) that the tile can see: unmasked tiles
first, then the diagonal ones with the causal mask.

Measured on one NVIDIA H200 (jax 0.11.2, Triton 3.6): the gpu tests of tests/test_prefill_kernels.py
pass; timings beside the HACK kernel and cuDNN in bench/NOTES_prefill.md. In a model it is the
`attention="pallas"` backend of hack_jax.prefill's exact prefill (the fresh K/V as one page per
sequence).

Caveats: it returns no log-sum-exp, so that backend refuses chunks; kv_lens are clipped to [0,
pages_per_seq * page_size]; page ids outside [0, num_pages) read page 0 (the null page); whatever is
read past kv_len is masked (NaN cannot leak).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common

LOG2_E = math.log2(math.e)


def _bf16_prefill_kernel(kv_lens_ref, q_start_ref, page_indices_ref, q_ref, k_ref, v_ref, o_ref, *,
                         block_k, q_per_kv_pad, block_q, num_q_tiles, sm_scale):
    # kv_lens_ref, q_start_ref  i32[S]
    # page_indices_ref  i32[S, pages_per_seq]
    # q_ref   float[block_q, q_per_kv_pad, D]   this tile: positions x the kv head's query heads
    # k_ref, v_ref  bf16[N, page_size, D]  the pool of this kv head
    # o_ref   f32[block_q, q_per_kv_pad, D]
    num_pages, page_size, head_dim = k_ref.shape
    b = pl.program_id(0)
    tile = num_q_tiles - 1 - pl.program_id(2)  # the longest rows first (causal load balance)
    R = block_q * q_per_kv_pad
    capacity = page_indices_ref.shape[1] * page_size

    kv_len = jnp.clip(kv_lens_ref[b], 0, capacity)
    lo = q_start_ref[b] + tile * block_q  # position of the tile's first row
    hi = jnp.minimum(lo + block_q, kv_len) - 1  # last position of a valid row (< lo: none)
    pos = lo + _div(lax.broadcasted_iota(jnp.int32, (R,), 0), q_per_kv_pad)  # [R]
    num_tiles = jnp.where(hi >= lo, _div(hi, block_k) + 1, 0)  # key tiles the query tile sees
    num_full = jnp.minimum(_div(lo + 1, block_k), num_tiles)  # ... every row sees whole (< kv_len too)

    q = q_ref[...].reshape(R, head_dim).astype(jnp.bfloat16)  # bf16[R, D]
    scale = sm_scale * LOG2_E  # logits in log2 units: exp2 below

    def step(masked, i, carry):
        acc, m, l = carry  # f32[R, D], f32[R], f32[R]
        tok0 = i * block_k
        page = page_indices_ref[b, _div(tok0, page_size)]
        page = jnp.where((page >= 0) & (page < num_pages), page, 0)
        rows = pl.ds(pl.multiple_of(tok0 & (page_size - 1), block_k), block_k)
        k = k_ref[page, rows, :]  # bf16[block_k, D]
        v = v_ref[page, rows, :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale  # f32[R, block_k]
        if masked:
            key = tok0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            held = key < kv_len  # [block_k]
            s = jnp.where(held[None, :] & (key[None, :] <= pos[:, None]), s, -jnp.inf)
            v = jnp.where(held[:, None], v, jnp.zeros_like(v))  # stale rows may hold NaN
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        base = jnp.where(m_new > -jnp.inf, m_new, 0.0)  # a row that saw nothing yet stays empty
        alpha = jnp.exp2(m - base)
        p = jnp.exp2(s - base[:, None])  # f32[R, block_k]
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + jnp.dot(p.astype(jnp.bfloat16), v, preferred_element_type=jnp.float32)
        return acc, m_new, l

    carry = (jnp.zeros((R, head_dim), jnp.float32), jnp.full((R,), -jnp.inf, jnp.float32),
             jnp.zeros((R,), jnp.float32))
    carry = lax.fori_loop(0, num_full, functools.partial(step, False), carry)
    acc, _, l = lax.fori_loop(num_full, num_tiles, functools.partial(step, True), carry)
    ok = (pos < kv_len) & (l != 0)  # != 0: a NaN l stays NaN
    out = jnp.where(ok[:, None], acc / jnp.where(ok, l, 1.0)[:, None], 0.0)
    o_ref[...] = out.reshape(block_q, q_per_kv_pad, head_dim)


def _div(x, n: int):
    """x // n for a power of two n (a shift; see prefill_attention._div for why not jnp's //)."""
    return x >> (n.bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """block_q: query positions per program (rows = block_q * q_per_kv_pad, a power of two >= 16);
    block_k: keys per loop iteration (a power of two >= 16, <= page_size); Triton launch params."""

    block_q: int = 32
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_config(*, num_q_heads: int, num_kv_heads: int, q_len: int, head_dim: int,
                   page_size: int, rows: int = 128) -> KernelConfig:
    """FlashAttention-2-like tiles: 128 query rows (positions x padded heads), 64-token key tiles,
    8 warps for head_dim >= 128 (4 below), 2 stages; fewer rows for short prompts, >= 16."""
    pad = _next_pow2(num_q_heads // num_kv_heads)
    block_q = max(1, min(rows // pad, _next_pow2(q_len)), 16 // pad)
    return KernelConfig(block_q=block_q, block_k=min(64, page_size), num_warps=8 if head_dim >= 128 else 4,
                        num_stages=2)


def _full_spec(x):
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _bf16_prefill(q, k, v, page_indices, kv_lens, q_start, *, config, interpret):
    batch, q_len, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k.shape
    q_per_kv = num_q_heads // num_kv_heads
    pad = _next_pow2(q_per_kv)
    block_q = config.block_q
    tiles = -(-q_len // block_q)
    qg = q.astype(jnp.bfloat16).reshape(batch, q_len, num_kv_heads, q_per_kv, head_dim)
    if tiles * block_q != q_len or pad != q_per_kv:
        qg = jnp.pad(qg, ((0, 0), (0, tiles * block_q - q_len), (0, 0), (0, pad - q_per_kv), (0, 0)))
    tile_spec = pl.BlockSpec((None, block_q, None, pad, head_dim), lambda b, h, i: (b, tiles - 1 - i, h, 0, 0))
    # The whole pool of kv head h: on Triton a block is a base pointer, not a copy.
    pool_spec = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda b, h, i: (0, h, 0, 0))
    kernel = functools.partial(_bf16_prefill_kernel, block_k=config.block_k, q_per_kv_pad=pad, block_q=block_q,
                               num_q_tiles=tiles, sm_scale=1.0 / math.sqrt(head_dim))
    out = common.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(qg.shape, jnp.float32), grid=(batch, num_kv_heads, tiles),
        in_specs=[_full_spec(kv_lens), _full_spec(q_start), _full_spec(page_indices), tile_spec, pool_spec,
                  pool_spec],
        out_specs=tile_spec, num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret,
        name="bf16_prefill_attention")(kv_lens, q_start, page_indices, qg, k, v)
    return out[:, :q_len, :, :q_per_kv].reshape(batch, q_len, num_q_heads, head_dim)


@common.quiet
def bf16_prefill_attention(q, k, v, page_indices, kv_lens, *, q_start=None, config: KernelConfig | None = None,
                           interpret: bool = False):
    """Causal prefill attention over a paged bf16 cache (module docstring).

    Called by hack_jax.attention.prefill_attention(..., impl="pallas") for kv_format="bf16" as
    fn(q, layer.k, layer.v, page_indices, kv_lens, q_start=..., **kernel_options).

    Args:
      q: float[batch, T, num_q_heads, head_dim]; row t is the query at position q_start + t.
      k, v: bf16[num_pages, num_kv_heads, page_size, head_dim]; token t of sequence b is in page
        page_indices[b, t // page_size], row t % page_size.
      page_indices: i32[batch, pages_per_seq]; kv_lens: i32[batch] tokens held (this chunk included).
      q_start: i32[batch] position of query row 0; None = 0.
      config: tiles and launch parameters; None -> default_config(...).
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      f32[batch, T, num_q_heads, head_dim]; rows with q_start + t >= kv_lens are 0.

    Raises:
      ValueError on inconsistent shapes or dtypes, a negative q_start (when concrete), or a config
      that does not fit them.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    page_indices, kv_lens = jnp.asarray(page_indices), jnp.asarray(kv_lens)
    q_start = jnp.zeros_like(kv_lens) if q_start is None else jnp.asarray(q_start)
    if q.ndim != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, T, num_q_heads, head_dim], got {q.shape=} {q.dtype=}")
    batch, q_len, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = common.check_paged_bf16(head_dim, num_q_heads, batch, k, v,
                                                            page_indices)
    for name, x in (("kv_lens", kv_lens), ("q_start", q_start)):
        if x.shape != (batch,) or x.dtype != jnp.int32:
            raise ValueError(f"{name} must be i32[{batch}], got {x.shape=} {x.dtype=}")
    if not isinstance(q_start, jax.core.Tracer) and q_start.size and int(np.min(np.asarray(q_start))) < 0:
        raise ValueError(f"q_start must be >= 0, got {np.asarray(q_start).tolist()}")
    if config is None:
        config = default_config(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, q_len=q_len,
                                head_dim=head_dim, page_size=page_size)
    pad = _next_pow2(num_q_heads // num_kv_heads)
    if (not common.is_pow2(config.block_q) or config.block_q * pad < 16 or not common.is_pow2(config.block_k)
            or not 16 <= config.block_k <= page_size):
        raise ValueError(f"config must have power-of-two block_q with block_q * q_per_kv_pad >= 16 "
                         f"(q_per_kv_pad={pad}) and power-of-two 16 <= block_k <= page_size={page_size}, "
                         f"got {config=}")
    return _bf16_prefill(q, k, v, page_indices, kv_lens, q_start, config=config, interpret=interpret)
