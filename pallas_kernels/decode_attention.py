"""HACK decode attention on the paged INT2 cache (kivi layout), one Pallas kernel lowered to Triton.

What it computes: one query token per sequence attends over its paged cache exactly as
docs/DESIGN.md "Homomorphic attention semantics" (layout="kivi") says, on the 2-bit codes:
per sealed block b, Q*sigma_b quantized INT8 per (row, channel group), QK^T as an integer dot on
the K codes plus the K code sums and q.mu_b terms; block-local softmax weights W; W*tau quantized
INT8 per (row, channel group) over the block; PV as an integer dot on the V codes plus the V code
sums and W.nu terms. Sinks and the 16-bit open block in float32. Nothing is dequantized.

Shapes (DESIGN.md "Paged cache layout"; P = partition_size, Pc = min(P, head_dim),
NP = head_dim // Pc, bpp = page_size // P, S = max_seqs = batch, ns = num_sink_tokens):
  q          float[S, num_q_heads, head_dim]          -> out f32[S, num_q_heads, head_dim]
  k_codes    u8[num_pages, num_kv_heads, page_size // 4, head_dim]   (planar per group of 4 blocks)
  k_scale, k_min  f16[num_pages, num_kv_heads, bpp, head_dim]
  k_sums     u8|u16[num_pages, num_kv_heads, page_size, NP]
  v_codes    u8[num_pages, num_kv_heads, head_dim, page_size // 4]   (token-major: k_codes' bytes transposed)
  v_scale, v_min  f16[num_pages, num_kv_heads, page_size, NP]
  v_sums     u8|u16[num_pages, num_kv_heads, bpp, head_dim]
  open_k, open_v  bf16[S, num_kv_heads, P, head_dim];  sink_k, sink_v  bf16[S, num_kv_heads, ns, head_dim]
  page_indices i32[S, pages_per_seq];  kv_lens i32[S] (sinks + sealed + open tokens)

Kernel structure. Grid (batch, num_kv_heads, num_splits): one program serves all G query heads of a
kv head over a contiguous range of packing groups (4 blocks = one [P, head_dim] u8 tile of K codes and
one [head_dim, P] u8 tile of V codes; `split_range`: the sequence's groups balanced over the splits to
within one, split 0 the smallest). Its R = 4 * G_pad rows are (plane j, head g), G_pad = max(4,
next_pow2(G)): row (j, g) handles block j of every packing group, so the 4 blocks of a tile are processed
in one [R, ...] pass with every row doing useful work when G = 4 (Llama-3 8B), and R >= 16 satisfies the
dot's M. Row (j, g) carries its own online softmax (stream j); the 4 streams are merged at the end of the
program, the splits by log-sum-exp outside the kernel. Per packing group and channel group p, 4 dots
(one per plane; each row keeps its own plane's result, selected in int32) give the QK^T and PV integer
parts. The block metadata (sigma, mu, omega: one [4, Pc] tile; kappa, tau, nu: one strided [4P]
vector per group and channel group) are read once and broadcast to the (plane, head) rows in
registers (KernelConfig.dedup; the v2 path gathered them per row with index vectors: 4x the loads,
240 instead of 168 registers). Sinks and the open block: float32 math in the first split (split 0),
merged into stream 0 rows (not a separate partial).

Dot variants (`dot_dtype`, common.plane): "int8" (int8 x int8 -> int32, the method as written),
"bf16" (bf16 operands holding the same integers, float32 accumulation, exact) and "f16" (f16
operands 1024 + code built by bit operations, no int-to-float convert; exact for inner dims <= 64).
GPU.md measured bf16 *matmuls* 2-3x faster than int8 in Pallas-Triton, but this kernel is bound by
the work around the MMAs, not the MMAs: on the H200 "int8" was 1.2-1.3x faster than "bf16" (I2F
converts) and "f16", unpacking 4 codes per instruction with inline PTX (KernelConfig.unpack_asm)
another 1.33x, and the INT8 rounding of the transients by one PTX cvt (KernelConfig.fast_quant)
1.05x; the default is "int8" + unpack_asm + dedup + fast_quant, one wave of programs
(bench/NOTES_decode.md v3). H200, Llama-3.1-8B heads (bench/results/decode_attention.md, 2026-12-01
session 3, default config, token-major V codes): 135 us at batch 8 / 32K (1.3 TB/s on the 170 MiB read;
our bf16 paged kernel: 266 us), 31.9 us at batch 1 / 32K, 75.7 us at batch 1 / 128K, 10.8 us at batch 1 /
1K (bf16: 13.6 us). Token-major V (the cache's layout since, DESIGN.md "2-bit packing") was 3-6% faster
than channel-major at >= 8K tokens in the kernel-only loop (b8/32K 149.5 -> 140.9 us, b1/128K 81.6 ->
78.2 us) and 4-8% in the official matrix (b8/32K 146.0 -> 135.4, b8/128K 528.4 -> 494.1).
What limits it: ~1.42k SASS instructions, 54 CTA barriers and ~110 shared-memory instructions per warp
and packing group (channel-major V: 1.54k and ~170; offline SASS of the
default config, bench_hack_decode.py --stages sass; Triton's layout conversions and cross-warp row
reductions of [16, 64] tiles), not HBM, not the MMAs; and not issue alone: 15% fewer instructions gave 5%
less time.

Tried and removed (bench/NOTES_decode.md 2026-12-01, code in commits 1a904a9 / 7f20914): 1-warp programs
with the accumulators in global memory and two packing groups per loop trip (fewer barriers, fewer
resident programs): 1.3-1.7x slower on the H200. 8- and 16-warp programs (token-major V, 128 registers: 2 and 1 programs
per SM): 1.75x and 2.8x slower at b8/32K (2026-12-01, session 3). Loop-instruction cuts (bench/NOTES_decode.md
2026-12-01 "decode-diet"): KernelConfig.fast_div (the quantizers' division as x * rcp(s), the GPU's
div.full bits), fast_exp (exp2(x log2 e)), block_meta (per-token metadata as strided [4, P] tiles),
masked_planes (int8 planes without shifts, 4**-e on the dot) and fma_order (running FMA sums) are on by
default for "int8" dots since the H200 run of 2026-12-01 (session 2): 3-8% faster at Llama-3.1-8B heads
and >= 8K tokens (b8/32K 151 -> 146 us, b1/128K 87 -> 82 us, b32/128K 2169 -> 2038 us), SmolLM2 heads
within +-8% either way (geometric mean 0.98). A sixth cut, q . mu added to the block max only
(qmu_rowconst), was removed after that run: every flag set with it compiled 1.5-1.8x slower (b8/32K
147 -> 272 us; code in commit c4e62c3).

Tested: CPU interpret mode (jax 0.10.2), tests/test_decode_kernels.py; H200 (jax 0.11.2): see
bench/NOTES_decode.md. Caveats: partition_size and head_dim powers of two >= 32 with page_size a
multiple of 4 * partition_size; INT8 codes of the transient operands could differ from the
reference at near-.5 ties (the GPU's float32 division; none seen on the H200), which the gpu tests'
tolerance allows; unpack_asm and fast_quant are inline PTX (Triton only; interpret mode uses jnp,
same bits, checked on the H200);
page ids outside [0, num_pages) read page 0 (the null page, hack_jax.paging); kv_lens beyond the
capacity (ns + pages_per_seq * page_size) are clipped to it, as hack_jax.kv_cache.read_blocks does.

Reference twin: hack_jax.reference.kivi_block_attention_step + float_attention_step, reached via
hack_jax.attention.decode_attention(..., impl="reference"); the tests also carry an independent
float64 NumPy twin (tests/test_decode_kernels.py::numpy_kivi_decode).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common

NUM_PLANES = 4  # 2-bit codes per byte = blocks per packing group (DESIGN.md "2-bit packing")
DOT_DTYPES = ("bf16", "int8", "f16", "folded_f16", "folded_bf16")
H200_NUM_SMS = 132
# Programs of the default config resident per SM at once: 4 warps x 168 registers (ptxas, sm_90,
# Triton 3.6; bench/NOTES_decode.md v3) -> 3 programs in the 64K registers of an SM.
RESIDENT_PROGRAMS_PER_SM = 3


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


def _hack_decode_kernel(kv_lens_ref, page_indices_ref, q_ref, k_codes_ref, k_scale_ref, k_min_ref,
                        k_sums_ref, v_codes_ref, v_scale_ref, v_min_ref, v_sums_ref, open_k_ref,
                        open_v_ref, *refs, partition_size, num_groups, group, group_pad, groups_per_page,
                        num_sink_tokens, num_pages, max_blocks, num_splits, open_split, sm_scale, dot_dtype,
                        unpack_asm, dedup, fast_quant, fast_div=False,
                        fast_exp=False, block_meta=False, masked_planes=False,
                        fma_order=False, interpret):
    # kv_lens_ref       i32[S]
    # page_indices_ref  i32[S, pages_per_seq]
    # q_ref             float[S, Hq, D]
    # k_codes_ref       u8[N, H, page_size // 4, D]
    # k_scale_ref, k_min_ref  f16[N, H, bpp, D]
    # k_sums_ref        u8|u16[N, H, page_size, NP]
    # v_codes_ref       u8[N, H, D, page_size // 4]   (token-major)
    # v_scale_ref, v_min_ref  f16[N, H, page_size, NP]
    # v_sums_ref        u8|u16[N, H, bpp, D]
    # open_k_ref, open_v_ref  bf16[S, H, P, D]
    # refs = (sink_k_ref, sink_v_ref  bf16[S, H, ns, D],)  if ns else ()
    #        + (acc_ref f32[G_pad, D], m_ref f32[G_pad], l_ref f32[G_pad])   outputs of this program
    ns, P, NP = num_sink_tokens, partition_size, num_groups
    if ns:
        sink_k_ref, sink_v_ref, acc_ref, m_ref, l_ref = refs
    else:
        acc_ref, m_ref, l_ref = refs
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    R = NUM_PLANES * group_pad
    Pc = q_ref.shape[-1] // NP

    kv_len = kv_lens_ref[b]
    after_sinks = jnp.clip(kv_len - ns, 0, max_blocks * P)  # beyond the capacity: clipped (as kv_cache)
    num_blocks = after_sinks // P  # sealed blocks
    num_open = after_sinks % P
    num_tile_groups = (num_blocks + NUM_PLANES - 1) // NUM_PLANES
    # open_split: programs 0..num_splits-1 take the sealed blocks, program num_splits the sinks and the
    # open block alone; otherwise split 0 takes them besides its (fewest) groups
    prologue_split = num_splits if open_split else 0
    g_lo, g_hi = split_range(jnp.minimum(split, num_splits - 1), num_tile_groups, num_splits)
    if open_split:
        g_hi = jnp.where(split < num_splits, g_hi, g_lo)

    row_plane = jax.lax.broadcasted_iota(jnp.int32, (R,), 0) // group_pad  # [R] block j of the row
    token = jax.lax.broadcasted_iota(jnp.int32, (P,), 0)  # [P]
    q = load_q_rows(q_ref, b, h, group=group, group_pad=group_pad, num_groups=NP, sm_scale=sm_scale)
    int8 = dot_dtype == "int8"
    folded = dot_dtype in common.FOLDED_PLANES
    if folded:
        fold_dtype = common.FOLDED_PLANES[dot_dtype][0]
        fold_w, fold_off = common.folded_plane_constants(dot_dtype)
        fold_asm = unpack_asm and not interpret

        def fold_dot(x, tile):
            """x f32[R, n] rounded to 16 bits, dotted with each row's own plane of tile [m, n] -> (f32[R, m]
            = the rounded x times the codes, the rounded x as f32[R, n])."""
            xr = x.astype(fold_dtype)
            dots = [jnp.dot(xr, common.folded_plane(tile, j, dot_dtype, asm=fold_asm).T,
                            preferred_element_type=jnp.float32) for j in range(NUM_PLANES)]
            xf = xr.astype(jnp.float32)
            return fold_w * common.select_rows(row_plane, dots), xf
    else:
        plane_w = common.plane_weights(row_plane, dot_dtype, masked=masked_planes and int8)  # [R]
        op_dtype = common.operand_dtype(dot_dtype)
    if masked_planes and int8:  # code_j * 4**e_j, no shift for planes 0-2; 4**-e_j in plane_w
        asm = unpack_asm and not interpret
        plane = lambda tile, j, _: common.plane_int8_masked(tile, j, asm=asm)  # noqa: E731
    elif unpack_asm and int8 and not interpret:
        plane = lambda tile, j, _: common.plane_int8_asm(tile, j)  # noqa: E731
    else:
        plane = common.plane

    def int_part(x, tile):
        """x f32[R, n] quantized INT8 per row -> (per-row-plane dot of the codes with the row's
        plane of tile [m, n] (K codes [P, Pc], token-major V codes [Pc, P]: the inner dim n is the
        tile's contiguous axis either way), f32[R, m]; scale [R]; minimum [R]). int8: the 4 plane dots
        are selected per row in int32 and converted once."""
        if int8:
            xc, xs, xm = common.quantize_rows_int8_codes(x, interpret=interpret, fast=fast_quant,
                                                         fast_div=fast_div)
            dots = [jnp.dot(xc, plane(tile, j, dot_dtype).T, preferred_element_type=jnp.int32)
                    for j in range(NUM_PLANES)]
            return common.select_rows(row_plane, dots).astype(jnp.float32), xs, xm
        xc, xs, xm = common.quantize_rows_int8(x, interpret=interpret)  # (bf16 / f16 operands: float codes)
        dots = [common.int_dot(xc.astype(op_dtype), plane(tile, j, dot_dtype), dot_dtype, trans_b=True)
                for j in range(NUM_PLANES)]
        return common.unbias(common.select_rows(row_plane, dots), xc, dot_dtype), xs, xm

    exp = functools.partial(common.exp, fast=fast_exp)

    def per_token(ref, pid, slot0, tok0, p):
        """[4, P] per-token metadata (kappa, tau, nu) of the 4 blocks of a packing group, channel group p.
        block_meta: ref is [N, H, bpp, P, NP] (the wrapper's free reshape) and the [4, P] tile is one
        strided 2-D load in the layout its consumer wants; else a [4P] strided vector reshaped to
        [4, P] (a register layout change through shared memory)."""
        if block_meta:
            return ref[pid, h, pl.ds(slot0, NUM_PLANES), :, p]
        return ref[pid, h, pl.ds(tok0, NUM_PLANES * P), p].reshape(NUM_PLANES, P)

    init = jax.lax.cond(
        split == prologue_split,
        lambda: sinks_and_open_block_state(q, open_k_ref, open_v_ref, refs[:2] if ns else (), b, h, kv_len,
                                           num_open, row_plane),
        lambda: empty_state(R, Pc, NP))

    def body(tg, carry):
        # One packing group tg: blocks 4 tg + j (j = 0..3), row (j, g) handles block 4 tg + j.
        m, l, accs = carry
        page, group_in_page = (tg, 0) if groups_per_page == 1 else (tg // groups_per_page, tg % groups_per_page)
        pid = page_indices_ref[b, page]
        pid = jnp.where((pid >= 0) & (pid < num_pages), pid, 0)
        code_row0 = group_in_page * P
        slot = group_in_page * NUM_PLANES + row_plane  # [R] block slot in the page
        tok = slot[:, None] * P + token[None, :]  # [R, P] token row in the page
        valid = NUM_PLANES * tg + row_plane < num_blocks  # [R]
        slot0, tok0 = group_in_page * NUM_PLANES, group_in_page * NUM_PLANES * P

        def rows(x4):  # [4, X] per block of the group -> f32[R, X], row (j, g) = x4[j]
            x4 = x4.astype(jnp.float32)
            return jnp.broadcast_to(x4[:, None, :], (NUM_PLANES, group_pad, x4.shape[1])).reshape(R, x4.shape[1])

        # QK^T: logit_j = sum_p [ s_p sum_{c in p} qc_c k_jc + m_p kappa_jp ] + q . mu
        logits = jnp.zeros((R, P), jnp.float32)
        for p in range(NP):
            channels = pl.ds(p * Pc, Pc)
            if folded:  # logit_j = sum_c bf(q_c sigma_c) k_jc + q . mu (the plane offset folded into the constant)
                k_tile = k_codes_ref[pid, h, pl.ds(code_row0, P), channels]  # u8[P, Pc]
                sigma = rows(k_scale_ref[pid, h, pl.ds(slot0, NUM_PLANES), channels])  # [R, Pc]
                mu = rows(k_min_ref[pid, h, pl.ds(slot0, NUM_PLANES), channels])  # [R, Pc]
                dot, a = fold_dot(q[p] * sigma, k_tile)  # [R, P], [R, Pc]
                logits += dot + jnp.sum(q[p] * mu - fold_off * a, axis=1)[:, None]
                continue
            k_tile = common.widen(k_codes_ref[pid, h, pl.ds(code_row0, P), channels], dot_dtype)  # u8[P, Pc]
            if dedup:
                sigma = rows(k_scale_ref[pid, h, pl.ds(slot0, NUM_PLANES), channels])  # [R, Pc]
                mu = rows(k_min_ref[pid, h, pl.ds(slot0, NUM_PLANES), channels])  # [R, Pc]
                kappa = rows(per_token(k_sums_ref, pid, slot0, tok0, p))  # [R, P]
            else:
                sigma = k_scale_ref[pid, h, slot, channels].astype(jnp.float32)  # [R, Pc]
                mu = k_min_ref[pid, h, slot, channels].astype(jnp.float32)  # [R, Pc]
                kappa = k_sums_ref[pid, h, tok, p].astype(jnp.float32)  # [R, P]
            dot, qs, qm = int_part(q[p] * sigma, k_tile)  # [R, P], [R], [R]
            logits += ((qs * plane_w)[:, None] * dot + qm[:, None] * kappa
                       + jnp.sum(q[p] * mu, axis=1)[:, None])

        mb = jnp.max(logits, axis=1)  # [R] block-local max (sealed blocks are full: no mask)
        w = exp(logits - mb[:, None])  # [R, P]
        lb = jnp.sum(w, axis=1)

        # PV: o_c = s'_p sum_j wc_jp v_jc + m'_p omega_c + sum_j W_j nu_jp, c in p; each channel
        # group's accumulator is merged as soon as its block output is ready (same SASS as merging
        # all at the end, measured)
        m_new, l_new, alpha, beta = common.merge_weights(m, l, mb, lb, valid, exp=exp)
        new_accs = []
        for p in range(NP):
            channels = pl.ds(p * Pc, Pc)
            # u8[Pc, P], token-major: 4 consecutive tokens per 32-bit word, the int8 MMA's B layout (a
            # channel-major [P, Pc] tile was transposed byte by byte through shared memory)
            v_tile = common.widen(v_codes_ref[pid, h, channels, pl.ds(code_row0, P)], dot_dtype)
            if folded:  # o_c = sum_j bf(W_j tau_j) v_jc + sum_j W_j nu_j
                tau = rows(per_token(v_scale_ref, pid, slot0, tok0, p))  # [R, P]
                nu = rows(per_token(v_min_ref, pid, slot0, tok0, p))  # [R, P]
                pv, b16 = fold_dot(w * tau, v_tile)  # [R, Pc], [R, P]
                out = jnp.sum(w * nu - fold_off * b16, axis=1)[:, None] + pv
                new_accs.append(common.merge_acc(accs[p], out, alpha, beta, valid))
                continue
            if dedup:
                tau = rows(per_token(v_scale_ref, pid, slot0, tok0, p))  # [R, P]
                nu = rows(per_token(v_min_ref, pid, slot0, tok0, p))  # [R, P]
                omega = rows(v_sums_ref[pid, h, pl.ds(slot0, NUM_PLANES), channels])  # [R, Pc]
            else:
                tau = v_scale_ref[pid, h, tok, p].astype(jnp.float32)  # [R, P]
                nu = v_min_ref[pid, h, tok, p].astype(jnp.float32)  # [R, P]
                omega = v_sums_ref[pid, h, slot, channels].astype(jnp.float32)  # [R, Pc]
            pv, ws, wm = int_part(w * tau, v_tile)  # [R, Pc], [R], [R]
            if fma_order:  # wnu + wm omega + ws pv: 2 FFMAs per element instead of FMUL + FFMA + FADD
                out = (jnp.sum(w * nu, axis=1)[:, None] + wm[:, None] * omega) + (ws * plane_w)[:, None] * pv
            else:
                out = (ws * plane_w)[:, None] * pv + wm[:, None] * omega + jnp.sum(w * nu, axis=1)[:, None]
            new_accs.append(common.merge_acc(accs[p], out, alpha, beta, valid))
        return m_new, l_new, tuple(new_accs)

    m, l, accs = jax.lax.fori_loop(g_lo, g_hi, body, init)
    m, l, accs = common.merge_streams(m, l, accs, NUM_PLANES)  # [G_pad], [G_pad], NP x [G_pad, Pc]
    for p in range(NP):
        acc_ref[:, pl.ds(p * Pc, Pc)] = accs[p]
    m_ref[...] = m
    l_ref[...] = l


def split_range(split, num_groups, num_splits):
    """Packing groups [g_lo, g_hi) of program `split` out of a sequence's `num_groups` (traced):
    split s takes [s n // S, (s + 1) n // S), so every split gets floor(n / S) or one more, whatever
    the sequence's length (a short sequence of a ragged batch is spread over all splits too), and
    split 0, which also takes the sinks and the open block, gets the fewest."""
    return split * num_groups // num_splits, (split + 1) * num_groups // num_splits


def load_q_rows(q_ref, b, h, *, group, group_pad, num_groups, sm_scale):
    """NP x f32[R, Pc]: q * sm_scale in the (plane j, head g) row layout, gathered from q_ref
    float[S, Hq, D] (row (j, g) = query head h * G + g; rows g >= G are 0)."""
    R = NUM_PLANES * group_pad
    Pc = q_ref.shape[-1] // num_groups
    g = jax.lax.broadcasted_iota(jnp.int32, (R,), 0) % group_pad
    head = h * group + jnp.minimum(g, group - 1)  # [R]
    return [jnp.where((g < group)[:, None], q_ref[b, head, pl.ds(p * Pc, Pc)].astype(jnp.float32) * sm_scale, 0.0)
            for p in range(num_groups)]


def empty_state(rows, width, num_groups):
    """(m, l, accs) of no keys: -inf, 0, num_groups x zeros[rows, width]."""
    return (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(num_groups)))


def sinks_and_open_block_state(q, open_k_ref, open_v_ref, sink_refs, b, h, kv_len, num_open, row_plane):
    """Float32 attention over the sinks and the open block's num_open tokens (DESIGN.md: plain
    float attention on their 16-bit K/V), as one softmax part on the stream-0 rows (row_plane == 0);
    other rows get the empty state. Rows/tokens beyond the lengths are selected away (NaN-safe).

    q: NP x f32[R, Pc] (q * sm_scale); open_k_ref, open_v_ref: [S, H, P, D]; sink_refs:
    (sink_k_ref, sink_v_ref) [S, H, ns, D] or (). Returns (m [R], l [R], NP x acc [R, Pc]).
    """
    NP = len(q)
    R, Pc = q[0].shape
    P = open_k_ref.shape[2]
    ns = sink_refs[0].shape[2] if sink_refs else 0
    token = jax.lax.broadcasted_iota(jnp.int32, (P,), 0)
    open_ok = token < num_open  # [P]
    zero = jnp.zeros((), jnp.bfloat16)
    k_open = [jnp.where(open_ok[:, None], open_k_ref[b, h, :, pl.ds(p * Pc, Pc)].astype(jnp.bfloat16), zero)
              for p in range(NP)]  # NP x bf16[P, Pc]
    logits = sum(common.f32_bf16_dot(q[p], k_open[p], trans_b=True) for p in range(NP))  # [R, P]
    logits = jnp.where(open_ok[None, :], logits, -jnp.inf)
    sink_logits, sink_v = [], []
    for t in range(ns):
        ok = t < kv_len
        k_t = [jnp.where(ok, sink_refs[0][b, h, t, pl.ds(p * Pc, Pc)].astype(jnp.float32), 0.0)
               for p in range(NP)]  # NP x [Pc]
        sink_logits.append(jnp.where(ok, sum(jnp.sum(q[p] * k_t[p][None, :], axis=1) for p in range(NP)),
                                     -jnp.inf))  # [R]
        sink_v.append([jnp.where(ok, sink_refs[1][b, h, t, pl.ds(p * Pc, Pc)].astype(jnp.float32), 0.0)
                       for p in range(NP)])  # NP x [Pc]
    m = jnp.max(logits, axis=1)
    for s_t in sink_logits:
        m = jnp.maximum(m, s_t)
    stream0 = row_plane == 0
    m = jnp.where(stream0, m, -jnp.inf)
    base = jnp.where(m > -jnp.inf, m, 0.0)
    w = jnp.where(stream0[:, None] & open_ok[None, :], jnp.exp(logits - base[:, None]), 0.0)  # [R, P]
    w_sinks = [jnp.where(stream0, jnp.exp(s_t - base), 0.0) for s_t in sink_logits]  # ns x [R]
    l = jnp.sum(w, axis=1) + sum(w_sinks, jnp.zeros((R,), jnp.float32))
    accs = []
    for p in range(NP):
        v_open = jnp.where(open_ok[:, None], open_v_ref[b, h, :, pl.ds(p * Pc, Pc)].astype(jnp.bfloat16), zero)
        acc = common.f32_bf16_dot(w, v_open)  # [R, Pc]
        for w_t, v_t in zip(w_sinks, sink_v):
            acc = acc + w_t[:, None] * v_t[p][None, :]
        accs.append(acc)
    return m, l, tuple(accs)


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch choices. num_splits: programs per (sequence, kv head) along the sequence (split-K);
    open_split: one more program per (sequence, kv head) for the sinks and the open block alone (short
    sequences: otherwise split 0 does them after its packing groups; hack kernel only, the dequant
    baseline ignores it)."""

    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    dot_dtype: Literal["int8", "bf16", "f16"] = "int8"
    unpack_asm: bool = False  # "int8" on GPU: unpack 4 codes per instruction with inline PTX
    dedup: bool = False  # metadata read once per block ([4, X] tiles), broadcast to the rows in registers
    fast_quant: bool = False  # "int8" on GPU: INT8 round + clip + convert by one PTX cvt.rni.s8.f32
    open_split: bool = False  # sinks + open block in a program of their own (see above)
    # Loop-instruction cuts (bench/NOTES_decode.md 2026-12-01 "decode-diet"; GPU-only ones fall back to
    # jnp in interpret mode): fast_div ("int8" dots): the INT8 quantizers' (x - mf) / s as x * rcp(s),
    # one reciprocal per row (the same bits as Triton's div.full.f32 division); fast_exp: exp as
    # exp2(x log2 e) (ex2.approx on the GPU, flash-attention style, a few ulp) in the block softmax
    # and the merges
    fast_div: bool = False
    fast_exp: bool = False
    # block_meta (needs dedup): kappa / tau / nu read as one strided [4, P] tile per group and channel
    # group from a [N, H, bpp, P, NP] view of their arrays (free reshape in the wrapper) instead of a
    # [4P] vector reshaped to [4, P] in registers (a shared-memory round trip with 2 barriers each)
    block_meta: bool = False
    # masked_planes ("int8"): planes 0-2 as byte & (3 << 2j) = code * 4**j (one AND per 4 codes, no shift),
    # plane 3 as (byte >> 2) & 0x30 = code * 16 (int8-safe), 4**-e undone exactly on the dot result
    masked_planes: bool = False
    # fma_order: the block output's correction sum written as running FMAs, (w.nu + m' omega) + s' pv:
    # one instruction less per element
    fma_order: bool = False


def default_config(*, batch: int, num_kv_heads: int, pages_per_seq: int, page_size: int,
                   partition_size: int, dot_dtype: str = "int8", num_sms: int = H200_NUM_SMS) -> KernelConfig:
    """Heuristic from the H200 runs (bench/NOTES_decode.md). Splits: the kernel is latency-bound and a
    program's time is ~linear in its packing groups, so the time is ~ waves x groups per program,
    with RESIDENT_PROGRAMS_PER_SM x num_sms programs per wave (set by the register count);
    `choose_num_splits` minimizes that (a partial last wave costs a whole one; at batch 32 one split
    per (sequence, kv head) would leave a third of the slots empty). 4 warps, 2 stages; "int8" planes
    unpacked by inline PTX, metadata deduplicated, INT8 rounding by one cvt (GPU only; interpret mode
    falls back to jnp with the same results), and for "int8" the decode-diet flags fast_div, fast_exp,
    block_meta, masked_planes, fma_order (3-8% faster on the H200 at >= 8K tokens; NOTES_decode.md)."""
    groups = max(1, pages_per_seq * page_size // (NUM_PLANES * partition_size))
    int8 = dot_dtype == "int8"
    splits, open_split = choose_num_splits(batch * num_kv_heads, groups, RESIDENT_PROGRAMS_PER_SM * num_sms)
    fast = int8 or dot_dtype in common.FOLDED_PLANES
    return KernelConfig(num_splits=splits, num_warps=4, num_stages=2, dot_dtype=dot_dtype,
                        unpack_asm=fast, dedup=True, fast_quant=int8, open_split=open_split,
                        fast_div=int8, fast_exp=fast, block_meta=fast, masked_planes=int8, fma_order=int8)


def choose_num_splits(num_pairs: int, num_groups: int, slots: int) -> tuple[int, bool]:
    """(splits, open_split) per (sequence, kv head) minimizing waves x (work of the longest program + 1):
    waves = ceil(num_pairs * programs / slots) with programs = splits (+ 1 with open_split); the
    longest program's work in packing groups is ceil(n / splits) with open_split, else
    floor(n / splits) + 1 (split 0 also does the sinks and the open block, ~1 group); the + 1 is a
    program's fixed cost (prologue, epilogue, its share of the split combine). Ties go to fewer
    programs. E.g. H200, 8 kv heads, 32K tokens (128 groups): batch 1 -> 43, batch 8 -> 6, batch 32 ->
    3 (2 full waves of 43 groups instead of one two-thirds-empty wave of 128); 1K tokens (4 groups) at
    batch 1 and 8 -> 4 splits + the open split (each program one unit of work instead of two)."""
    best, best_cost = (1, False), None
    for s in range(1, num_groups + 1):
        for open_split in (False, True):
            work = -(-num_groups // s) if open_split else num_groups // s + 1
            cost = -(-num_pairs * (s + open_split) // slots) * (work + 1)
            if best_cost is None or cost < best_cost:
                best, best_cost = (s, open_split), cost
    return best


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def group_pad(num_q_heads: int, num_kv_heads: int) -> int:
    """Rows per plane stream: G rounded up to a power of two, at least 4 (so R = 4 G_pad >= 16)."""
    return max(4, _next_pow2(num_q_heads // num_kv_heads))


def combine_splits(acc, m, l, num_q_heads: int):
    """Merge the split-K partials: acc f32[S, H, splits, G_pad, D], m, l f32[S, H, splits, G_pad]
    -> f32[S, Hq, D] (0 for rows that attended to nothing)."""
    batch, num_kv_heads, _, _, head_dim = acc.shape
    out = common.lse_combine(m, l, acc, axes=2)  # [S, H, G_pad, D]
    group = num_q_heads // num_kv_heads
    return out[:, :, :group].reshape(batch, num_q_heads, head_dim)


def _full_spec(x):
    # The whole array is one block: on Triton a pointer base, so whole page pools cost nothing (in
    # interpret mode every program copies them: keep CPU test pools tiny).
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


@functools.partial(jax.jit, static_argnames=("partition_size", "num_sink_tokens", "config", "interpret"))
def _hack_decode(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                 sink_k, sink_v, page_indices, kv_lens, *, partition_size, num_sink_tokens, config,
                 interpret):
    batch, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, _, _ = k_codes.shape
    page_size = k_sums.shape[2]
    num_groups = k_sums.shape[3]
    pages_per_seq = page_indices.shape[1]
    pad = group_pad(num_q_heads, num_kv_heads)
    groups_per_page = page_size // (NUM_PLANES * partition_size)
    splits = config.num_splits
    programs = splits + config.open_split

    if config.block_meta:  # per-token metadata as [N, H, bpp, P, NP]: a free (contiguous) reshape
        k_sums, v_scale, v_min = (x.reshape(num_pages, num_kv_heads, page_size // partition_size, partition_size,
                                            num_groups) for x in (k_sums, v_scale, v_min))
    inputs = [kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32), q, k_codes, k_scale, k_min,
              k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v]
    if num_sink_tokens:
        inputs += [sink_k, sink_v]
    kernel = functools.partial(
        _hack_decode_kernel, partition_size=partition_size, num_groups=num_groups,
        group=num_q_heads // num_kv_heads, group_pad=pad, sm_scale=1.0 / math.sqrt(head_dim),
        groups_per_page=groups_per_page, num_sink_tokens=num_sink_tokens, num_pages=num_pages,
        max_blocks=pages_per_seq * (page_size // partition_size), num_splits=splits,
        open_split=config.open_split,
        dot_dtype=config.dot_dtype, unpack_asm=config.unpack_asm, dedup=config.dedup,
        fast_quant=config.fast_quant, fast_div=config.fast_div, fast_exp=config.fast_exp,
        block_meta=config.block_meta, masked_planes=config.masked_planes,
        fma_order=config.fma_order, interpret=interpret)
    out_shape = [jax.ShapeDtypeStruct((batch, num_kv_heads, programs, pad, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, num_kv_heads, programs, pad), jnp.float32),
                 jax.ShapeDtypeStruct((batch, num_kv_heads, programs, pad), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, pad, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, pad), lambda b, h, s: (b, h, s, 0)),
                 pl.BlockSpec((None, None, None, pad), lambda b, h, s: (b, h, s, 0))]
    acc, m, l = common.pallas_call(
        kernel, out_shape=out_shape, grid=(batch, num_kv_heads, programs),
        in_specs=[_full_spec(x) for x in inputs], out_specs=out_specs,
        num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret,
        name="hack_decode_attention")(*inputs)
    return combine_splits(acc, m, l, num_q_heads)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def validate_inputs(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                    sink_k, sink_v, page_indices, kv_lens, *, partition_size, num_sink_tokens):
    """Trace-time checks of shapes and dtypes against DESIGN.md's kivi layout; raises ValueError."""
    P, ns = partition_size, num_sink_tokens
    if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, num_q_heads, head_dim], got {q.shape=}, {q.dtype=}")
    batch, num_q_heads, head_dim = q.shape
    if k_codes.ndim != 4:
        raise ValueError(f"k_codes must be u8[num_pages, num_kv_heads, page_size // 4, head_dim], got {k_codes.shape=}")
    num_pages, num_kv_heads, quarter, _ = k_codes.shape
    page_size = 4 * quarter
    common.check_kivi_geometry(P, head_dim, page_size)
    if not isinstance(ns, int) or ns < 0:
        raise ValueError(f"num_sink_tokens must be an int >= 0, got {num_sink_tokens=}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads must be a multiple of num_kv_heads, got {num_q_heads=}, {num_kv_heads=}")
    bpp, Pc = page_size // P, min(P, head_dim)
    NP = head_dim // Pc
    expect = {
        "k_codes": ((num_pages, num_kv_heads, page_size // 4, head_dim), (jnp.uint8,)),
        "v_codes": ((num_pages, num_kv_heads, head_dim, page_size // 4), (jnp.uint8,)),  # token-major
        "k_scale": ((num_pages, num_kv_heads, bpp, head_dim), None),
        "k_min": ((num_pages, num_kv_heads, bpp, head_dim), None),
        "k_sums": ((num_pages, num_kv_heads, page_size, NP), (jnp.uint8, jnp.uint16)),
        "v_scale": ((num_pages, num_kv_heads, page_size, NP), None),
        "v_min": ((num_pages, num_kv_heads, page_size, NP), None),
        "v_sums": ((num_pages, num_kv_heads, bpp, head_dim), (jnp.uint8, jnp.uint16)),
        "open_k": ((batch, num_kv_heads, P, head_dim), None),
        "open_v": ((batch, num_kv_heads, P, head_dim), None),
        "sink_k": ((batch, num_kv_heads, ns, head_dim), None),
        "sink_v": ((batch, num_kv_heads, ns, head_dim), None),
    }
    arrays = dict(k_codes=k_codes, v_codes=v_codes, k_scale=k_scale, k_min=k_min, k_sums=k_sums,
                  v_scale=v_scale, v_min=v_min, v_sums=v_sums, open_k=open_k, open_v=open_v,
                  sink_k=sink_k, sink_v=sink_v)
    for name, (shape, dtypes) in expect.items():
        x = arrays[name]
        if x is None and name.startswith("sink") and ns == 0:
            continue
        if x is None or tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (DESIGN.md kivi layout), got "
                             f"{None if x is None else x.shape}")
        ok = (x.dtype in dtypes) if dtypes else jnp.issubdtype(x.dtype, jnp.floating)
        if not ok:
            raise ValueError(f"{name} has dtype {x.dtype}, expected {dtypes or 'a float dtype'}")
    if page_indices.ndim != 2 or page_indices.shape[0] != batch or page_indices.dtype != jnp.int32:
        raise ValueError(f"page_indices must be i32[{batch}, pages_per_seq], got {page_indices.shape=}, "
                         f"{page_indices.dtype=}")
    if kv_lens.shape != (batch,) or kv_lens.dtype != jnp.int32:
        raise ValueError(f"kv_lens must be i32[{batch}], got {kv_lens.shape=}, {kv_lens.dtype=}")


def _is_layer(x) -> bool:
    return hasattr(x, "k_codes") and hasattr(x, "config")


@common.quiet
def hack_decode_attention(q, k_codes, k_scale=None, k_min=None, k_sums=None, v_codes=None, v_scale=None,
                          v_min=None, v_sums=None, open_k=None, open_v=None, sink_k=None, sink_v=None,
                          page_indices=None, kv_lens=None, *, partition_size: int | None = None,
                          num_sink_tokens: int | None = None, dot_dtype: str = "int8",
                          num_splits: int | None = None, config: KernelConfig | None = None,
                          interpret: bool = False):
    """HACK decode attention over the paged INT2 kivi cache (module docstring; shapes there).

    Two call forms:
      hack_decode_attention(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums,
                            open_k, open_v, sink_k, sink_v, page_indices, kv_lens,
                            partition_size=P, num_sink_tokens=ns, ...)
      hack_decode_attention(q, layer, page_indices, kv_lens, ...)   (how hack_jax.attention calls it)
    where `layer` has the DESIGN.md kivi fields (hack_jax.kv_cache.KiviPages) and its
    config.partition_size / config.num_sink_tokens.

    Args:
      q: float[batch, num_q_heads, head_dim], one query token per sequence (sm_scale = 1/sqrt(d)
        is applied here). Cache arrays, page_indices, kv_lens: DESIGN.md kivi layout (module
        docstring); sink_k/sink_v may be None when num_sink_tokens == 0.
      partition_size: P (the quantization block). num_sink_tokens: ns.
      dot_dtype: "int8" | "bf16" | "f16", the operand type of the integer dots (ignored if config is
        given; "f16" needs partition_size <= 64).
      num_splits: split-K programs per (sequence, kv head); overrides the config's.
      config: KernelConfig; None picks default_config(...).
      interpret: run the kernel in Pallas interpret mode (CPU tests).

    Returns:
      f32[batch, num_q_heads, head_dim]; rows with kv_lens = 0 are 0.

    Raises:
      ValueError: shapes/dtypes off the layout, unsupported sizes, bad dot_dtype or num_splits.
    """
    if _is_layer(k_codes):
        layer, page_indices, kv_lens = k_codes, k_scale, k_min
        if any(x is not None for x in (k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v, sink_k, sink_v)):
            raise ValueError("layer form takes (q, layer, page_indices, kv_lens) only")
        return hack_decode_attention(
            q, layer.k_codes, layer.k_scale, layer.k_min, layer.k_sums, layer.v_codes, layer.v_scale,
            layer.v_min, layer.v_sums, layer.open_k, layer.open_v, layer.sink_k, layer.sink_v,
            page_indices, kv_lens, partition_size=layer.config.partition_size,
            num_sink_tokens=layer.config.num_sink_tokens, dot_dtype=dot_dtype, num_splits=num_splits,
            config=config, interpret=interpret)
    if partition_size is None or num_sink_tokens is None:
        raise ValueError(f"partition_size and num_sink_tokens are required, got {partition_size=}, "
                         f"{num_sink_tokens=}")
    page_indices, kv_lens = common.as_index_arrays(page_indices, kv_lens)
    validate_inputs(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                    sink_k, sink_v, page_indices, kv_lens, partition_size=partition_size,
                    num_sink_tokens=num_sink_tokens)
    config = resolve_config(q, k_codes, k_sums, page_indices, partition_size=partition_size,
                            dot_dtype=dot_dtype, num_splits=num_splits, config=config)
    if num_sink_tokens == 0:
        sink_k = sink_v = None
    return _hack_decode(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                        sink_k, sink_v, page_indices, kv_lens, partition_size=partition_size,
                        num_sink_tokens=num_sink_tokens, config=config, interpret=interpret)


def resolve_config(q, k_codes, k_sums, page_indices, *, partition_size, dot_dtype, num_splits, config):
    """The KernelConfig to launch (inputs already validated): `config` or default_config(...),
    num_splits overriding; ValueError on a bad dot_dtype or num_splits."""
    if config is None:
        if dot_dtype not in DOT_DTYPES:
            raise ValueError(f"dot_dtype must be one of {DOT_DTYPES}, got {dot_dtype=}")
        config = default_config(batch=q.shape[0], num_kv_heads=k_codes.shape[1],
                                pages_per_seq=page_indices.shape[1], page_size=k_sums.shape[2],
                                partition_size=partition_size, dot_dtype=dot_dtype)
    elif config.dot_dtype not in DOT_DTYPES:
        raise ValueError(f"config.dot_dtype must be one of {DOT_DTYPES}, got {config.dot_dtype=}")
    if num_splits is not None:
        if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int, got {num_splits=}")
        config = dataclasses.replace(config, num_splits=num_splits)
    if config.block_meta and not config.dedup:
        raise ValueError(f"block_meta needs dedup=True, got dedup={config.dedup!r}")
    if config.dot_dtype == "f16" and max(partition_size, min(partition_size, q.shape[-1])) > 64:
        raise ValueError(f"dot_dtype='f16' is exact only for inner dims <= 64 (1024-offset operands): "
                         f"got {partition_size=}, head_dim={q.shape[-1]}")
    return config
