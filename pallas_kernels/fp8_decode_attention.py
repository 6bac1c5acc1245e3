"""Paged fp8 (e4m3) decode attention: the bf16 decode kernel's structure over kv_format="fp8" pages.

out[b, h] = softmax(q[b, h] . K_b^T / sqrt(head_dim)) V_b over the first kv_lens[b] tokens, with
K_b[t] = float(k_codes[t]) * k_scale[t] and V_b[t] = float(v_codes[t]) * v_scale[t] (one float32
scale per (token, kv head), hack_jax.kv_cache.fp8). In the kernel each float8_e4m3fn tile is
converted to bf16 (exact: e4m3 values are bf16 values) for the two dots; the per-token scales are
applied on the dots' float32 results, where they are exact per token: logits = (q . codes^T) *
k_scale * sm_scale, and the PV dot takes (p * v_scale) rounded to bf16 against the V codes.
Grid, tiles, split-K and the log-sum-exp combine are pallas_kernels.bf16_decode_attention's
(same KernelConfig and default_config; the tiles are half the bytes).

Reference twin: hack_jax.attention.decode_attention(..., impl="reference") on the fp8 layer
(dequantize, then float32 attention). Tested: interpret mode on CPU; the gpu-marked tests in
tests/test_baseline_kernels.py also check that Pallas-Triton lowers float8_e4m3fn loads.
Caveats: q is rounded to bf16 before the QK^T dot; kv_lens are clipped to the capacity; page ids
outside [0, num_pages) read page 0; whatever is read past kv_len is masked (NaN cannot leak).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import common
from pallas_kernels.bf16_decode_attention import KernelConfig, default_config

__all__ = ["KernelConfig", "default_config", "fp8_decode_attention"]


def _fp8_decode_kernel(page_indices_ref, kv_lens_ref, q_ref, k_ref, ks_ref, v_ref, vs_ref, acc_ref, m_ref,
                       l_ref, *, block_k: int, num_splits: int, sm_scale: float):
    """k_ref, v_ref f8[num_pages, page_size, head_dim]; ks_ref, vs_ref f32[num_pages, page_size] (this
    kv head's pools); q_ref bf16[block_h, head_dim]; outputs as the bf16 kernel's."""
    head_dim = k_ref.shape[2]
    block_h = q_ref.shape[0]
    kv_len, load, loop = common.per_token_tiles(page_indices_ref, kv_lens_ref, k_ref.shape, block_k=block_k,
                                                num_splits=num_splits)
    q = q_ref[...]

    def step(masked, i, carry):
        acc, m, l = carry
        k = load(k_ref, i).astype(jnp.bfloat16)
        v = load(v_ref, i).astype(jnp.bfloat16)
        ks, vs = load(ks_ref, i), load(vs_ref, i)  # f32[block_k]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * (ks * sm_scale)[None, :]
        if masked:
            valid = i * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0) < kv_len
            s = jnp.where(valid[None, :], s, -jnp.inf)
            v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
            vs = jnp.where(valid, vs, 0.0)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = alpha * l + p.sum(axis=1)
        pv = (p * vs[None, :]).astype(jnp.bfloat16)
        acc = alpha[:, None] * acc + jnp.dot(pv, v, preferred_element_type=jnp.float32)
        return acc, m_new, l

    carry = (jnp.zeros((block_h, head_dim), jnp.float32), jnp.full((block_h,), -jnp.inf, jnp.float32),
             jnp.zeros((block_h,), jnp.float32))
    acc, m, l = loop(step, carry)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@common.quiet
@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def fp8_decode_attention(q, k_codes, k_scale, v_codes, v_scale, page_indices, kv_lens, *,
                         config: KernelConfig | None = None, interpret: bool = False):
    """Decode attention over a paged fp8 cache.

    Args:
      q: float[batch, num_q_heads, head_dim].
      k_codes, v_codes: float8_e4m3fn[num_pages, num_kv_heads, page_size, head_dim].
      k_scale, v_scale: f32[num_pages, num_kv_heads, page_size].
      page_indices: i32[batch, pages_per_seq]; kv_lens: i32[batch] (0 -> output 0).
      config: None -> default_config(...); interpret: the Pallas interpreter (CPU tests).
    Returns f32[batch, num_q_heads, head_dim].
    Raises ValueError on inconsistent shapes or dtypes.
    """
    if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, num_q_heads, head_dim], got {q.shape=} {q.dtype=}")
    batch, num_q_heads, head_dim = q.shape
    for name, x in (("k_codes", k_codes), ("v_codes", v_codes)):
        if x.dtype != jnp.float8_e4m3fn or x.ndim != 4 or x.shape != k_codes.shape:
            raise ValueError(f"{name} must be float8_e4m3fn[num_pages, num_kv_heads, page_size, head_dim] "
                             f"like k_codes, got {x.shape=} {x.dtype=}")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x.dtype != jnp.float32 or x.shape != k_codes.shape[:3]:
            raise ValueError(f"{name} must be f32{list(k_codes.shape[:3])}, got {x.shape=} {x.dtype=}")
    return common.per_token_paged_decode(
        _fp8_decode_kernel, q, (k_codes, k_scale, v_codes, v_scale), page_indices, kv_lens, config=config,
        default_config=default_config, name="fp8_decode_attention", interpret=interpret)
