"""Paged int8 decode attention: the fp8 decode kernel's structure over kv_format="int8" pages.

out[b, h] = softmax(q[b, h] . K_b^T / sqrt(head_dim)) V_b over the first kv_lens[b] tokens, with
K_b[t] = k_scale[t] * k_codes[t] + k_min[t] and V_b[t] = v_scale[t] * v_codes[t] + v_min[t] (int8
codes, one scale and one (folded) minimum per (token, kv head), hack_jax.kv_cache.int8). Nothing is
dequantized elementwise: the int8 tiles are converted to bf16 (exact: |code| <= 128) for the two
dots, and the per-token scale and minimum are applied on the dots' float32 results, exact per token:
  logits = (k_scale * (q . codes^T) + k_min * sum(q)) * sm_scale,
  acc   += bf16(p * v_scale) . v_codes + sum_t(p_t * v_min_t) (broadcast over head_dim),
with sum(q) taken over the bf16-rounded q the dot sees. Grid, tiles, split-K and the log-sum-exp
combine are pallas_kernels.bf16_decode_attention's (same KernelConfig and default_config; the tiles
are half the bytes, like fp8's).

Reference twin: hack_jax.attention.decode_attention(..., impl="reference") on the int8 layer
(dequantize, then float32 attention). Supported: head_dim / page_size / heads as the bf16 kernel
(check_paged_bf16); scales and minima any float dtype (the cache stores f16), read as float32.
Tested: interpret mode on CPU vs the float64 twin (tests/test_baseline_caches.py), and lowered to
Triton IR for CUDA from the CPU; the gpu-marked tests there run it on a GPU (not yet run on one).
Caveats: q is rounded to bf16 before the QK^T dot, the PV weights p * v_scale to bf16; kv_lens are
clipped to the capacity; page ids outside [0, num_pages) read page 0; whatever is read past kv_len
is masked (NaN scales / minima there cannot leak).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import common
from pallas_kernels.bf16_decode_attention import KernelConfig, default_config

__all__ = ["KernelConfig", "default_config", "int8_decode_attention"]


def _int8_decode_kernel(page_indices_ref, kv_lens_ref, q_ref, k_ref, ks_ref, km_ref, v_ref, vs_ref, vm_ref,
                        acc_ref, m_ref, l_ref, *, block_k: int, num_splits: int, sm_scale: float):
    """k_ref, v_ref i8[num_pages, page_size, head_dim]; ks_ref, km_ref, vs_ref, vm_ref
    float[num_pages, page_size] (this kv head's pools); q_ref bf16[block_h, head_dim]; outputs
    acc_ref f32[block_h, head_dim], m_ref, l_ref f32[block_h] (this split's partial softmax)."""
    head_dim = k_ref.shape[2]
    block_h = q_ref.shape[0]
    kv_len, load, loop = common.per_token_tiles(page_indices_ref, kv_lens_ref, k_ref.shape, block_k=block_k,
                                                num_splits=num_splits)
    q = q_ref[...]  # bf16[block_h, head_dim]
    q_sum = q.astype(jnp.float32).sum(axis=1)  # f32[block_h]

    def step(masked, i, carry):
        acc, m, l = carry
        k = load(k_ref, i).astype(jnp.bfloat16)  # [block_k, head_dim]
        v = load(v_ref, i).astype(jnp.bfloat16)
        ks, km, vs, vm = (load(r, i).astype(jnp.float32) for r in (ks_ref, km_ref, vs_ref, vm_ref))
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [block_h, block_k]
        s = (s * ks[None, :] + q_sum[:, None] * km[None, :]) * sm_scale
        if masked:
            valid = i * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0) < kv_len
            s = jnp.where(valid[None, :], s, -jnp.inf)
            vs = jnp.where(valid, vs, 0.0)
            vm = jnp.where(valid, vm, 0.0)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])  # [block_h, block_k]
        l = alpha * l + p.sum(axis=1)
        pv = (p * vs[None, :]).astype(jnp.bfloat16)
        p_min = (p * vm[None, :]).sum(axis=1)  # f32[block_h]
        acc = alpha[:, None] * acc + jnp.dot(pv, v, preferred_element_type=jnp.float32) + p_min[:, None]
        return acc, m_new, l

    carry = (jnp.zeros((block_h, head_dim), jnp.float32), jnp.full((block_h,), -jnp.inf, jnp.float32),
             jnp.zeros((block_h,), jnp.float32))
    acc, m, l = loop(step, carry)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@common.quiet
@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def int8_decode_attention(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, page_indices, kv_lens, *,
                          config: KernelConfig | None = None, interpret: bool = False):
    """Decode attention over a paged int8 cache.

    Args:
      q: float[batch, num_q_heads, head_dim].
      k_codes, v_codes: i8[num_pages, num_kv_heads, page_size, head_dim].
      k_scale, k_min, v_scale, v_min: float[num_pages, num_kv_heads, page_size] (f16 in the cache).
      page_indices: i32[batch, pages_per_seq]; kv_lens: i32[batch] (0 -> output 0).
      config: None -> default_config(...); interpret: the Pallas interpreter (CPU tests).
    Returns f32[batch, num_q_heads, head_dim].
    Raises ValueError on inconsistent shapes or dtypes.
    """
    if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, num_q_heads, head_dim], got {q.shape=} {q.dtype=}")
    batch, num_q_heads, head_dim = q.shape
    for name, x in (("k_codes", k_codes), ("v_codes", v_codes)):
        if x.dtype != jnp.int8 or x.ndim != 4 or x.shape != k_codes.shape:
            raise ValueError(f"{name} must be int8[num_pages, num_kv_heads, page_size, head_dim] like k_codes, "
                             f"got {x.shape=} {x.dtype=}")
    for name, x in (("k_scale", k_scale), ("k_min", k_min), ("v_scale", v_scale), ("v_min", v_min)):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.shape != k_codes.shape[:3]:
            raise ValueError(f"{name} must be float{list(k_codes.shape[:3])}, got {x.shape=} {x.dtype=}")
    return common.per_token_paged_decode(
        _int8_decode_kernel, q, (k_codes, k_scale, k_min, v_codes, v_scale, v_min), page_indices, kv_lens, config=config,
        default_config=default_config, name="int8_decode_attention", interpret=interpret)
