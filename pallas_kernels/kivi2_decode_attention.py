"""Paged KIVI-2 decode attention, dequantizing the 2-bit codes in the kernel (kv_format="kivi2").

The cache (hack_jax.kv_cache.kivi2; G = quant_group_size, R = 4 G): K per (channel, G-token group), V per
(token, G-channel group), 2-bit codes packed 4 per byte so that chunk m of a page (R tokens) is one
[G, head_dim] byte tile whose plane j (bits 2j..2j+1) is the chunk's token group j. For a sequence
holding L tokens: K of tokens < R nk (nk = (L - 1) // R) comes from the codes, the rest from
open_k (row t % R); V of tokens < nq = max(L - 1 - R, 0) from the codes, the rest from open_v
(row t % 2R).

Grid (batch, num_kv_heads, num_splits); one program serves all q heads of a kv head (padded to
block_h >= 16 rows). Each split walks its share of the nk sealed chunks, one chunk (R tokens) per
iteration: per plane j, K_j = bf16(code * scale + min) [G, head_dim] and one dot q K_j^T; V_j likewise
(the per-token scales of each G-channel group broadcast over the group's columns), replaced by
open_v rows for tokens >= nq in the chunks that straddle nq; online softmax in float32, PV dots on
bf16 weights. The last split also attends the residual (tokens [R nk, L), open_k / open_v, masked).
Splits are merged outside with common.lse_combine. kv_lens = 0 gives 0.

Reference twin: hack_jax.attention.decode_attention(..., impl="reference") on the kivi2 layer.
Tested: interpret mode on CPU (tests/test_baseline_kernels.py; gpu-marked variants for the H200).
Supported: head_dim a power of two >= 32 and a multiple of G; page_size a multiple of R; any GQA
group. Caveats: q is rounded to bf16; dequantized K/V rounded to bf16 before the dots.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common

NUM_SMS_H200 = 132


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """num_splits: split-K programs per (sequence, kv head); num_warps, num_stages: Triton's."""

    num_splits: int = 8
    num_warps: int = 4
    num_stages: int = 2


def default_config(*, batch: int, num_kv_heads: int, capacity: int, residual: int) -> KernelConfig:
    """Enough programs for the H200's 132 SMs (~8 per SM), each split keeping >= 4 chunks."""
    chunks = max(1, capacity // residual)
    splits = max(1, min(pl.cdiv(8 * NUM_SMS_H200, batch * num_kv_heads), pl.cdiv(chunks, 4)))
    return KernelConfig(num_splits=splits)


def _kernel(page_indices_ref, kv_lens_ref, q_ref, kc_ref, ks_ref, km_ref, vc_ref, vs_ref, vm_ref,
            ok_ref, ov_ref, acc_ref, m_ref, l_ref, *, quant_group_size: int, num_splits: int,
            sm_scale: float):
    """kc/vc u8[num_pages, page_size // 4, D]; ks/km f16[num_pages, page_size // G, D];
    vs/vm f16[num_pages, D // G, page_size]; ok bf16[R, D], ov bf16[2 R, D] (this sequence, kv head)."""
    G = quant_group_size
    num_pages, rows, head_dim = kc_ref.shape
    page_size = 4 * rows
    r = 4 * G
    chunks_per_page = page_size // r
    block_h = q_ref.shape[0]
    kv_len = kv_lens_ref[0]
    nk = jnp.maximum(kv_len - 1, 0) // r
    nq = jnp.maximum(kv_len - 1 - r, 0)
    split = pl.program_id(2)
    per_split = pl.cdiv(nk, num_splits)
    start = jnp.minimum(split * per_split, nk)
    end = jnp.minimum(start + per_split, nk)
    pure_end = jnp.clip(nq // r, start, end)  # chunks before this one read no open_v row
    q = q_ref[...]  # bf16[block_h, D]
    col_group = lax.broadcasted_iota(jnp.int32, (G, head_dim), 1) // G
    rows_g = lax.broadcasted_iota(jnp.int32, (G,), 0)

    def online(carry, s, v):
        """Merge logits s f32[block_h, n] with values v bf16[n, D]."""
        acc, m, l = carry
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        return (alpha[:, None] * acc + jnp.dot(p.astype(jnp.bfloat16), v, preferred_element_type=jnp.float32),
                m_new, alpha * l + p.sum(axis=1))

    def chunk(mixed, c, carry):
        page = page_indices_ref[c // chunks_per_page]
        page = jnp.where((page >= 0) & (page < num_pages), page, 0)
        mc = c % chunks_per_page
        kc = kc_ref[page, pl.ds(mc * G, G), :]  # u8[G, D]
        vc = vc_ref[page, pl.ds(mc * G, G), :]
        logits, values = [], []
        for j in range(4):
            plane = lambda x: ((x >> jnp.uint8(2 * j)) & jnp.uint8(3)).astype(jnp.float32) if j else (
                x & jnp.uint8(3)).astype(jnp.float32)
            g = mc * 4 + j
            k_j = (plane(kc) * ks_ref[page, g, :].astype(jnp.float32)[None, :]
                   + km_ref[page, g, :].astype(jnp.float32)[None, :]).astype(jnp.bfloat16)
            logits.append(jnp.dot(q, k_j.T, preferred_element_type=jnp.float32) * sm_scale)
            tok0 = mc * r + j * G  # page row of the plane's first token
            scale = jnp.zeros((G, head_dim), jnp.float32)
            minimum = jnp.zeros((G, head_dim), jnp.float32)
            for cg in range(head_dim // G):
                scale = jnp.where(col_group == cg, vs_ref[page, cg, pl.ds(tok0, G)].astype(jnp.float32)[:, None],
                                  scale)
                minimum = jnp.where(col_group == cg,
                                    vm_ref[page, cg, pl.ds(tok0, G)].astype(jnp.float32)[:, None], minimum)
            v_j = (plane(vc) * scale + minimum).astype(jnp.bfloat16)
            if mixed:
                t = c * r + j * G + rows_g
                ring = ov_ref[pl.ds((c % 2) * r + j * G, G), :]
                v_j = jnp.where((t < nq)[:, None], v_j, ring)
            values.append(v_j)
        for s, v in zip(logits, values):
            carry = online(carry, s, v)
        return carry

    carry = (jnp.zeros((block_h, head_dim), jnp.float32), jnp.full((block_h,), -jnp.inf, jnp.float32),
             jnp.zeros((block_h,), jnp.float32))
    carry = lax.fori_loop(start, pure_end, functools.partial(chunk, False), carry)
    carry = lax.fori_loop(pure_end, end, functools.partial(chunk, True), carry)

    def residual(_, carry):  # tokens [R nk, kv_len): open_k rows i, open_v rows (nk % 2) R + i
        i = lax.broadcasted_iota(jnp.int32, (r,), 0)
        valid = nk * r + i < kv_len
        k = ok_ref[...]
        v = ov_ref[pl.ds((nk % 2) * r, r), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * sm_scale
        s = jnp.where(valid[None, :], s, -jnp.inf)
        return online(carry, s, jnp.where(valid[:, None], v, jnp.zeros_like(v)))

    last = (split == num_splits - 1) & (kv_len > 0)
    acc, m, l = lax.fori_loop(0, last.astype(jnp.int32), residual, carry)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@common.quiet
@functools.partial(jax.jit, static_argnames=("quant_group_size", "config", "interpret"))
def kivi2_decode_attention(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, open_k, open_v, page_indices,
                           kv_lens, *, quant_group_size: int = 32, config: KernelConfig | None = None,
                           interpret: bool = False):
    """Decode attention over a paged KIVI-2 cache (shapes: hack_jax.kv_cache.kivi2.Kivi2Pages).

    Args:
      q: float[batch, num_q_heads, head_dim]; the layer's arrays; page_indices i32[batch, pages_per_seq];
      kv_lens i32[batch] tokens held (0 -> output 0); quant_group_size: G, tokens / channels per
      quantization group (the residual R = 4 G).
      config: None -> default_config(...); interpret: the Pallas interpreter (CPU tests).
    Returns f32[batch, num_q_heads, head_dim].
    Raises ValueError on inconsistent shapes or dtypes.
    """
    G = quant_group_size
    if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, num_q_heads, head_dim], got {q.shape=} {q.dtype=}")
    batch, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, rows, _ = k_codes.shape
    page_size, r = 4 * rows, 4 * G
    expect = dict(k_codes=((num_pages, num_kv_heads, rows, head_dim), jnp.uint8),
                  v_codes=((num_pages, num_kv_heads, rows, head_dim), jnp.uint8),
                  k_scale=((num_pages, num_kv_heads, page_size // G, head_dim), jnp.float16),
                  k_min=((num_pages, num_kv_heads, page_size // G, head_dim), jnp.float16),
                  v_scale=((num_pages, num_kv_heads, head_dim // G, page_size), jnp.float16),
                  v_min=((num_pages, num_kv_heads, head_dim // G, page_size), jnp.float16),
                  open_k=((batch, num_kv_heads, r, head_dim), jnp.bfloat16),
                  open_v=((batch, num_kv_heads, 2 * r, head_dim), jnp.bfloat16))
    given = dict(k_codes=k_codes, v_codes=v_codes, k_scale=k_scale, k_min=k_min, v_scale=v_scale, v_min=v_min,
                 open_k=open_k, open_v=open_v)
    for name, (shape, dtype) in expect.items():
        x = given[name]
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"{name} must be {jnp.dtype(dtype).name}{list(shape)}, got {x.shape=} {x.dtype=}")
    if (not common.is_pow2(head_dim) or head_dim % G or not common.is_pow2(G) or G < 16
            or page_size % r or num_q_heads % num_kv_heads):
        raise ValueError(f"unsupported geometry: {head_dim=} {quant_group_size=} {page_size=} {num_q_heads=} "
                         f"{num_kv_heads=}")
    if page_indices.ndim != 2 or page_indices.shape[0] != batch or page_indices.dtype != jnp.int32:
        raise ValueError(f"page_indices must be i32[batch, pages_per_seq], got {page_indices.shape=}")
    if kv_lens.shape != (batch,) or kv_lens.dtype != jnp.int32:
        raise ValueError(f"kv_lens must be i32[batch], got {kv_lens.shape=} {kv_lens.dtype=}")
    pps = page_indices.shape[1]
    if config is None:
        config = default_config(batch=batch, num_kv_heads=num_kv_heads, capacity=pps * page_size, residual=r)
    gq = num_q_heads // num_kv_heads
    block_h = max(16, pl.next_power_of_2(gq))
    q_g = q.astype(jnp.bfloat16).reshape(batch, num_kv_heads, gq, head_dim)
    q_g = jnp.pad(q_g, ((0, 0), (0, 0), (0, block_h - gq), (0, 0)))
    kv_lens = jnp.clip(kv_lens, 0, pps * page_size)
    splits = config.num_splits
    kernel = functools.partial(_kernel, quant_group_size=G, num_splits=splits, sm_scale=1.0 / math.sqrt(head_dim))
    pool = lambda x: pl.BlockSpec((num_pages, None) + x.shape[2:], lambda b, h, s: (0, h, 0, 0))
    per_seq = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda b, h, s: (b, h, 0, 0))
    acc_spec = pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, s: (b, h, s, 0, 0))
    row_spec = pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0))
    acc, m, l = common.pallas_call(
        kernel, grid=(batch, num_kv_heads, splits),
        in_specs=[pl.BlockSpec((None, pps), lambda b, h, s: (b, 0)), pl.BlockSpec((1,), lambda b, h, s: (b,)),
                  pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0)),
                  pool(k_codes), pool(k_scale), pool(k_min), pool(v_codes), pool(v_scale), pool(v_min),
                  per_seq(open_k), per_seq(open_v)],
        out_specs=[acc_spec, row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, num_kv_heads, splits, block_h, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, splits, block_h), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, splits, block_h), jnp.float32)],
        num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret,
        name="kivi2_decode_attention",
    )(page_indices, kv_lens, q_g, k_codes, k_scale, k_min, v_codes, v_scale, v_min, open_k, open_v)
    out = common.lse_combine(m[..., :gq], l[..., :gq], acc[..., :gq, :], 2)
    return out.reshape(batch, num_q_heads, head_dim)
