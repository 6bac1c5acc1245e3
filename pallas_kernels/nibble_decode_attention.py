"""Paged decode attention over 4-bit per-token caches: kv_format="int4" (affine codes) and "turbo3" /
"turbo4" (codebook codes), the int8 kernel's structure with two codes per byte.

out[b, h] = softmax(q[b, h] . K_b^T / sqrt(head_dim)) V_b over the first kv_lens[b] tokens, where row t
of K_b (and V_b) is stored as u8 codes, two per byte, half-planar (hack_jax.kv_cache.int4.pack_nibbles:
byte j holds channel j in its low nibble and channel j + head_dim / 2 in its high nibble), with
  int4:  K_b[t] = k_scale[t] * (code - 8) + k_min[t]    (one f16 scale and folded minimum per (token, kv head))
  turbo: K_b[t] = k_scale[t] * codebook[code]          (one f16 scale per (token, kv head))
q and the output are in the cache's rotated basis: hack_jax.attention multiplies q by M and the output
by M^T outside this kernel (the K/V rotation of kv_cache.kv_rotation).
Each [block_k, head_dim / 2] byte tile is split into its low and high nibble tiles (a mask and a
shift, no interleave), turned into bf16 (int4: the centred codes code - 8, exact; turbo: codebook[code], 16
compare-and-selects against the table's entries, rounded to bf16), and both dots run per half:
  logits = (k_scale * (q_lo . lo^T + q_hi . hi^T) + k_min * sum(q)) * sm_scale   (turbo: no k_min term),
  acc_lo += bf16(p * v_scale) . v_lo + sum_t(p_t * v_min_t),  acc_hi likewise  (turbo: no v_min term),
the per-token scale and minimum applied on the dots' float32 results (the int8 kernel's identity,
exact per token). Grid, tiles, split-K and the log-sum-exp combine are pallas_kernels.
bf16_decode_attention's (KernelConfig, default_config), launched by common.per_token_paged_decode.

Reference twin: hack_jax.attention.decode_attention(..., impl="reference") on the int4 / turbo layer
(dequantize, then float32 attention). Supported: head_dim a power of two >= 32 (each half >= 16 for the
dots), page_size / heads as the bf16 kernel; scales and minima any float dtype (the cache stores f16).
Tested: interpret mode on CPU vs the float64 twin (tests/test_rotated_caches.py) and lowered to Triton IR
for CUDA from the CPU; the gpu-marked tests there run it on a GPU (not yet run on one).
Caveats: q rounded to bf16 before the QK^T dot, the PV weights p * v_scale to bf16, turbo's codebook
values to bf16 (relative 2**-9); kv_lens clipped to the capacity; page ids outside [0, num_pages) read
page 0; whatever is read past kv_len is masked (NaN scales / minima there cannot leak).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.bf16_decode_attention import KernelConfig, default_config

__all__ = ["KernelConfig", "default_config", "int4_decode_attention", "turbo_decode_attention"]


def _nibble_decode_kernel(page_indices_ref, kv_lens_ref, q_ref, *refs, block_k: int, num_splits: int,
                          sm_scale: float, affine: bool):
    """q_ref bf16[block_h, head_dim]; then (this kv head's pools) affine: k_ref u8[num_pages, page_size,
    head_dim // 2], ks_ref, km_ref float[num_pages, page_size], v_ref, vs_ref, vm_ref alike; codebook:
    k_ref, ks_ref, v_ref, vs_ref and cb_ref f32[2**bits]; outputs acc_ref f32[block_h, head_dim], m_ref,
    l_ref f32[block_h] (this split's partial softmax)."""
    if affine:
        k_ref, ks_ref, km_ref, v_ref, vs_ref, vm_ref, acc_ref, m_ref, l_ref = refs
    else:
        k_ref, ks_ref, v_ref, vs_ref, cb_ref, acc_ref, m_ref, l_ref = refs
    half = k_ref.shape[2]
    block_h = q_ref.shape[0]
    kv_len, load, loop = common.per_token_tiles(page_indices_ref, kv_lens_ref, k_ref.shape, block_k=block_k,
                                                num_splits=num_splits)
    q_lo = q_ref[:, pl.ds(0, half)]  # bf16[block_h, half]: channels [0, half)
    q_hi = q_ref[:, pl.ds(half, half)]  # channels [half, head_dim)
    q_sum = q_lo.astype(jnp.float32).sum(axis=1) + q_hi.astype(jnp.float32).sum(axis=1)  # f32[block_h]

    if not affine:  # the 16 codebook entries as scalars, read once per program
        table = [cb_ref[j] for j in range(16)]

    def lookup(codes):
        """codebook[codes] by 16 compare-and-selects on one live tile. A gather (`cb_ref[codes]`) staged
        the tile in shared memory (299 KB at block_k 512, over the H200's 227 KB); either form is the
        kernel's bottleneck, ~8x the bf16 kernel's time (bench/NOTES_formats.md)."""
        out = jnp.full(codes.shape, table[0], jnp.float32)
        for j in range(1, 16):
            out = jnp.where(codes == j, table[j], out)
        return out.astype(jnp.bfloat16)

    def values(ref, i):
        """The low and high nibble tiles of tile i as bf16[block_k, half] each."""
        b = load(ref, i).astype(jnp.int32)  # [block_k, half]
        lo, hi = b & 15, b >> 4
        if affine:
            return (lo - 8).astype(jnp.bfloat16), (hi - 8).astype(jnp.bfloat16)
        return lookup(lo), lookup(hi)

    def step(masked, i, carry):
        acc_lo, acc_hi, m, l = carry
        k_lo, k_hi = values(k_ref, i)
        v_lo, v_hi = values(v_ref, i)
        ks, vs = load(ks_ref, i).astype(jnp.float32), load(vs_ref, i).astype(jnp.float32)
        s = (jnp.dot(q_lo, k_lo.T, preferred_element_type=jnp.float32)
             + jnp.dot(q_hi, k_hi.T, preferred_element_type=jnp.float32))  # f32[block_h, block_k]
        s = s * ks[None, :]
        if affine:
            s = s + q_sum[:, None] * load(km_ref, i).astype(jnp.float32)[None, :]
        s = s * sm_scale
        if masked:
            valid = i * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0) < kv_len
            s = jnp.where(valid[None, :], s, -jnp.inf)
            vs = jnp.where(valid, vs, 0.0)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])  # [block_h, block_k]
        l = alpha * l + p.sum(axis=1)
        pv = (p * vs[None, :]).astype(jnp.bfloat16)
        acc_lo = alpha[:, None] * acc_lo + jnp.dot(pv, v_lo, preferred_element_type=jnp.float32)
        acc_hi = alpha[:, None] * acc_hi + jnp.dot(pv, v_hi, preferred_element_type=jnp.float32)
        if affine:
            vm = load(vm_ref, i).astype(jnp.float32)
            if masked:
                vm = jnp.where(valid, vm, 0.0)
            p_min = (p * vm[None, :]).sum(axis=1)[:, None]  # f32[block_h, 1]
            acc_lo, acc_hi = acc_lo + p_min, acc_hi + p_min
        return acc_lo, acc_hi, m_new, l

    carry = (jnp.zeros((block_h, half), jnp.float32), jnp.zeros((block_h, half), jnp.float32),
             jnp.full((block_h,), -jnp.inf, jnp.float32), jnp.zeros((block_h,), jnp.float32))
    acc_lo, acc_hi, m, l = loop(step, carry)
    acc_ref[:, pl.ds(0, half)] = acc_lo
    acc_ref[:, pl.ds(half, half)] = acc_hi
    m_ref[...] = m
    l_ref[...] = l


def _check(q, codes, metadata):
    if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, num_q_heads, head_dim], got {q.shape=} {q.dtype=}")
    head_dim = q.shape[2]
    if head_dim < 32:
        raise ValueError(f"head_dim must be >= 32 (each nibble half feeds a dot of >= 16), got {head_dim=}")
    first = codes[0][1]
    for name, x in codes:
        if x.dtype != jnp.uint8 or x.ndim != 4 or x.shape != first.shape or 2 * x.shape[3] != head_dim:
            raise ValueError(f"{name} must be uint8[num_pages, num_kv_heads, page_size, head_dim // 2 = "
                             f"{head_dim // 2}] like {codes[0][0]}, got {x.shape=} {x.dtype=}")
    for name, x in metadata:
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.shape != first.shape[:3]:
            raise ValueError(f"{name} must be float{list(first.shape[:3])}, got {x.shape=} {x.dtype=}")


@common.quiet
@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def int4_decode_attention(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, page_indices, kv_lens, *,
                          config: KernelConfig | None = None, interpret: bool = False):
    """Decode attention over a paged int4 cache (q already in its rotated basis).

    Args:
      q: float[batch, num_q_heads, head_dim].
      k_codes, v_codes: u8[num_pages, num_kv_heads, page_size, head_dim // 2] (two codes per byte).
      k_scale, k_min, v_scale, v_min: float[num_pages, num_kv_heads, page_size] (f16 in the cache).
      page_indices: i32[batch, pages_per_seq]; kv_lens: i32[batch] (0 -> output 0).
      config: None -> default_config(...); interpret: the Pallas interpreter (CPU tests).
    Returns f32[batch, num_q_heads, head_dim] (in the rotated basis).
    Raises ValueError on inconsistent shapes or dtypes.
    """
    _check(q, (("k_codes", k_codes), ("v_codes", v_codes)),
           (("k_scale", k_scale), ("k_min", k_min), ("v_scale", v_scale), ("v_min", v_min)))
    return common.per_token_paged_decode(
        functools.partial(_nibble_decode_kernel, affine=True), q, (k_codes, k_scale, k_min, v_codes, v_scale, v_min),
        page_indices, kv_lens, config=config, default_config=default_config, name="int4_decode_attention",
        interpret=interpret, codes_per_element=2)


@common.quiet
@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def turbo_decode_attention(q, k_codes, k_scale, v_codes, v_scale, codebook, page_indices, kv_lens, *,
                           config: KernelConfig | None = None, interpret: bool = False):
    """Decode attention over a paged turbo cache (q already in its rotated basis).

    Args:
      q: float[batch, num_q_heads, head_dim].
      k_codes, v_codes: u8[num_pages, num_kv_heads, page_size, head_dim // 2] (two codes per byte).
      k_scale, v_scale: float[num_pages, num_kv_heads, page_size] (f16 in the cache).
      codebook: f32[n], n = 8 or 16 (hack_jax.kv_cache.turbo.codebook); codes index it.
      page_indices, kv_lens, config, interpret: as int4_decode_attention.
    Returns f32[batch, num_q_heads, head_dim] (in the rotated basis).
    Raises ValueError on inconsistent shapes or dtypes.
    """
    _check(q, (("k_codes", k_codes), ("v_codes", v_codes)), (("k_scale", k_scale), ("v_scale", v_scale)))
    if codebook.ndim != 1 or codebook.shape[0] not in (8, 16) or not jnp.issubdtype(codebook.dtype, jnp.floating):
        raise ValueError(f"codebook must be float[8 or 16], got {codebook.shape=} {codebook.dtype=}")
    # Codes are 4-bit slots: a 3-bit codebook is padded to 16 entries so no code reads past the table.
    table = jnp.pad(codebook.astype(jnp.float32), (0, 16 - codebook.shape[0]))
    return common.per_token_paged_decode(
        functools.partial(_nibble_decode_kernel, affine=False), q, (k_codes, k_scale, v_codes, v_scale, table),
        page_indices, kv_lens, config=config, default_config=default_config, name="turbo_decode_attention",
        interpret=interpret, codes_per_element=2)
