"""Baseline: decode attention on the paged INT2 kivi cache with the codes dequantized in registers.

What it computes: the same cache, grid, rows and loads as pallas_kernels.decode_attention (read its
docstring), but instead of HACK's integer dots each 2-bit plane is dequantized in registers
(K_jc = sigma_bc k_jc + mu_bc, V_jc = tau_jp v_jc + nu_jp), rounded to bf16, and attention is
ordinary float math: logits = bf16(q * sm_scale) . bf16(K) with float32 accumulation, block-local
softmax weights W in float32, PV = bf16(W) . bf16(V) with float32 accumulation, l = sum W. Sinks and
the open block exactly as in the HACK kernel (float32, first split). This is the "fused dequant"
baseline HACK.md §7 compares against: same bytes read, no INT8 transients, more ALU per element.

Shapes: as hack_decode_attention (same arguments).

Measured on one NVIDIA H200 (jax 0.11.2, Triton 3.6): bench/NOTES_decode.md, bench/results/.
Caveats: bf16 rounding of q, K, V and W makes it less accurate than float32 attention over the
dequantized cache (the tests bound its error by 2x that of the same math done naively in bf16).

Reference twin: dense float attention over the dequantized codes (hack_jax.kv_cache.dequantize_cache
then float attention); the tests carry an independent float64 NumPy twin (tests/test_decode_kernels.py::numpy_dequant_decode).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.common import NUM_PLANES
from pallas_kernels.decode_attention import KernelConfig, default_config, resolve_config

__all__ = ["dequant_decode_attention", "KernelConfig", "default_config"]


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


def _dequant_decode_kernel(kv_lens_ref, page_indices_ref, q_ref, k_codes_ref, k_scale_ref, k_min_ref,
                           v_codes_ref, v_scale_ref, v_min_ref, open_k_ref, open_v_ref, *refs,
                           partition_size, num_channel_groups, q_per_kv, q_per_kv_pad, packing_groups_per_page,
                           num_sink_tokens, num_pages, max_blocks, num_splits, sm_scale):
    # kv_lens_ref       i32[S]
    # page_indices_ref  i32[S, pages_per_seq]
    # q_ref             float[S, Hq, D]
    # k_codes_ref       u8[N, H, page_size // 4, D]
    # k_scale_ref, k_min_ref  f16[N, H, bpp, D]
    # v_codes_ref       u8[N, H, D, page_size // 4]   (token-major)
    # v_scale_ref, v_min_ref  f16[N, H, page_size, NP]
    # open_k_ref, open_v_ref  bf16[S, H, P, D]
    # refs = (sink_k_ref, sink_v_ref  bf16[S, H, ns, D],)  if ns else ()
    #        + (acc_ref f32[q_per_kv_pad, D], m_ref f32[q_per_kv_pad], l_ref f32[q_per_kv_pad])
    ns, P, NP = num_sink_tokens, partition_size, num_channel_groups
    acc_ref, m_ref, l_ref = refs[-3:]
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    R = NUM_PLANES * q_per_kv_pad
    Pc = q_ref.shape[-1] // NP

    kv_len = kv_lens_ref[b]
    after_sinks = jnp.clip(kv_len - ns, 0, max_blocks * P)  # beyond the capacity: clipped (as kv_cache)
    num_blocks = after_sinks // P  # sealed blocks
    num_packing_groups = (num_blocks + NUM_PLANES - 1) // NUM_PLANES
    g_lo, g_hi = common.split_range(split, num_packing_groups, num_splits)

    row_plane = jax.lax.broadcasted_iota(jnp.int32, (R,), 0) // q_per_kv_pad  # [R]
    q = common.load_q_rows(q_ref, b, h, q_per_kv=q_per_kv, q_per_kv_pad=q_per_kv_pad, num_channel_groups=NP,
                           sm_scale=sm_scale)
    q_bf16 = [x.astype(jnp.bfloat16) for x in q]

    init = jax.lax.cond(
        split == 0,
        lambda: common.sinks_and_open_block_state(q, open_k_ref, open_v_ref, refs[:2] if ns else (), b, h,
                                                  kv_len, after_sinks % P, row_plane),
        lambda: common.empty_state(R, Pc, NP))

    def body(packing_group, carry):
        m, l, accs = carry
        page, packing_group_in_page = ((packing_group, 0) if packing_groups_per_page == 1 else
                                       (packing_group // packing_groups_per_page,
                                        packing_group % packing_groups_per_page))
        pid = page_indices_ref[b, page]
        pid = jnp.where((pid >= 0) & (pid < num_pages), pid, 0)
        code_row0 = packing_group_in_page * P
        slot0 = packing_group_in_page * NUM_PLANES
        valid = NUM_PLANES * packing_group + row_plane < num_blocks  # [R]

        logits = jnp.zeros((R, P), jnp.float32)
        for p in range(NP):
            channels = pl.ds(p * Pc, Pc)
            k_tile = k_codes_ref[pid, h, pl.ds(code_row0, P), channels]  # u8[P, Pc]
            dots = []
            for j in range(NUM_PLANES):
                sigma = k_scale_ref[pid, h, slot0 + j, channels].astype(jnp.float32)  # [Pc]
                mu = k_min_ref[pid, h, slot0 + j, channels].astype(jnp.float32)  # [Pc]
                codes = common.plane(k_tile, j).astype(jnp.float32)  # [P, Pc]
                k_deq = (codes * sigma[None, :] + mu[None, :]).astype(jnp.bfloat16)
                dots.append(jnp.dot(q_bf16[p], k_deq.T, preferred_element_type=jnp.float32))  # [R, P]
            logits += common.select_rows(row_plane, dots)

        mb = jnp.max(logits, axis=1)  # [R]
        w = jnp.exp(logits - mb[:, None])  # [R, P]
        lb = jnp.sum(w, axis=1)
        w_bf16 = w.astype(jnp.bfloat16)

        outs = []
        for p in range(NP):
            # token-major u8[Pc, P], transposed as bytes: the dequantized bf16 [Pc, P] planes as transposed
            # dot operands were 12% more loop instructions (offline SASS, b8/32K: 4649 vs 4167)
            v_tile = v_codes_ref[pid, h, pl.ds(p * Pc, Pc), pl.ds(code_row0, P)].T  # u8[P, Pc]
            pvs = []
            for j in range(NUM_PLANES):
                tokens = pl.ds((slot0 + j) * P, P)
                tau = v_scale_ref[pid, h, tokens, p].astype(jnp.float32)  # [P]
                nu = v_min_ref[pid, h, tokens, p].astype(jnp.float32)  # [P]
                codes = common.plane(v_tile, j).astype(jnp.float32)  # [P, Pc]
                v_deq = (codes * tau[:, None] + nu[:, None]).astype(jnp.bfloat16)
                pvs.append(jnp.dot(w_bf16, v_deq, preferred_element_type=jnp.float32))  # [R, Pc]
            outs.append(common.select_rows(row_plane, pvs))
        return common.merge_state(m, l, accs, mb, lb, tuple(outs), valid)

    m, l, accs = jax.lax.fori_loop(g_lo, g_hi, body, init)
    m, l, accs = common.merge_streams(m, l, accs, NUM_PLANES)  # [q_per_kv_pad], [q_per_kv_pad], NP x [q_per_kv_pad, Pc]
    for p in range(NP):
        acc_ref[:, pl.ds(p * Pc, Pc)] = accs[p]
    m_ref[...] = m
    l_ref[...] = l


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("partition_size", "num_sink_tokens", "config", "interpret"))
def _dequant_decode(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, open_k, open_v, sink_k, sink_v,
                    page_indices, kv_lens, *, partition_size, num_sink_tokens, config, interpret):
    batch, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, _, _ = k_codes.shape
    page_size = v_scale.shape[2]
    pages_per_seq = page_indices.shape[1]
    pad = common.q_per_kv_pad(num_q_heads // num_kv_heads, at_least=4)
    packing_groups_per_page = page_size // (NUM_PLANES * partition_size)
    splits = config.num_splits
    # the partials' rows (a power of two where combine_splits' kernel merges them); it reads the first `splits`
    out_rows = common.split_slots(splits, pad, head_dim)
    inputs = [kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32), q,
              k_codes, k_scale, k_min, v_codes, v_scale, v_min, open_k, open_v]
    if num_sink_tokens:
        inputs += [sink_k, sink_v]
    kernel = functools.partial(
        _dequant_decode_kernel, partition_size=partition_size, num_channel_groups=v_scale.shape[3],
        q_per_kv=num_q_heads // num_kv_heads, q_per_kv_pad=pad, sm_scale=1.0 / math.sqrt(head_dim),
        packing_groups_per_page=packing_groups_per_page, num_sink_tokens=num_sink_tokens, num_pages=num_pages,
        max_blocks=pages_per_seq * (page_size // partition_size),
        num_splits=splits)
    acc, m, l = common.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((batch, num_kv_heads, out_rows, pad, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, out_rows, pad), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, out_rows, pad), jnp.float32)],
        grid=(batch, num_kv_heads, splits),
        in_specs=[common.full_spec(x) for x in inputs],
        out_specs=[pl.BlockSpec((None, None, None, pad, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
                   pl.BlockSpec((None, None, None, pad), lambda b, h, s: (b, h, s, 0)),
                   pl.BlockSpec((None, None, None, pad), lambda b, h, s: (b, h, s, 0))],
        num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret,
        name="dequant_decode_attention")(*inputs)
    return common.combine_splits(acc, m, l, num_q_heads, programs=splits, interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


@common.quiet
def dequant_decode_attention(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                             sink_k, sink_v, page_indices, kv_lens, *, partition_size: int, num_sink_tokens: int,
                             v_group: int | None = None, num_splits: int | None = None, config: KernelConfig | None = None,
                             interpret: bool = False, bits: int = 2):
    """Fused-dequant decode attention over the paged INT2 kivi cache (module docstring).

    Same arguments as pallas_kernels.decode_attention.hack_decode_attention (the code sums k_sums /
    v_sums are validated but not read, and may be None: a cache without them; config.dot_dtype, config.open_split and config.interleaved are ignored: the math
    is bf16 operands with float32 accumulation, the splits as the "int8" kernel's).
    Returns f32[batch, num_q_heads, head_dim]; ValueError as there; NotImplementedError for bits != 2.
    """
    common.require_2bit("dequant_decode_attention", bits)
    page_indices, kv_lens = common.as_index_arrays(page_indices, kv_lens)
    common.check_kivi_inputs(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k,
                             open_v, sink_k, sink_v, page_indices, kv_lens, partition_size=partition_size,
                             num_sink_tokens=num_sink_tokens, v_group=v_group)
    config = resolve_config(q, k_codes, v_scale, page_indices, partition_size=partition_size,
                            num_splits=num_splits, config=config)
    if num_sink_tokens == 0:
        sink_k = sink_v = None
    return _dequant_decode(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, open_k, open_v, sink_k, sink_v,
                           page_indices, kv_lens, partition_size=partition_size,
                           num_sink_tokens=num_sink_tokens, config=config, interpret=interpret)
