"""HACK decode attention on the paged INT2 cache (kivi layout), one Pallas kernel lowered to Triton.

Computes, for one query token per sequence, softmax(q K^T / sqrt(d)) V over the sequence's paged cache
exactly as docs/DESIGN.md "Homomorphic attention semantics" (layout="kivi") defines it, on the 2-bit
codes: nothing is dequantized. Per sealed block b of P tokens (K quantized per channel: sigma_b, mu_b;
V per token and channel group: tau_j, nu_j), in one of two operand modes (`dot_dtype`):
  "int8" (HACK as written, the default): Q*sigma_b and the block's softmax weights W*tau quantized
    INT8 per (row, channel group); QK^T and PV as int8 x int8 -> int32 dots on the codes plus the code
    sums (kappa, omega) and the q.mu_b, W.nu terms.
  "folded_f16" / "folded_bf16" (scale-folded): logits = dot(r(Q*sigma_b), K codes) + Q.mu_b and
    PV = dot(r(W*tau), V codes) + W.nu with r() a rounding to f16 / bf16 and the codes as exact 16-bit
    floats (by default f16 subnormals, common.denormal_plane; else 1024 + 64c,
    common.folded_plane; KernelConfig.denormal); no requantization, no row min/max, the code sums are
    not read.
Sinks and the 16-bit open region (the open block, or QuantConfig.window W: the newest u % W tokens
after the sinks; then (u // W) * (W // P) blocks are sealed): float32 attention. sm_scale = 1/sqrt(head_dim)
is applied here.

Shapes (P = partition_size, Pc = min(P, head_dim), NP = head_dim // Pc, bpp = page_size // P,
S = batch, ns = num_sink_tokens; DESIGN.md "Paged cache layout"), shown for 2-bit codes (`bits` = 2, the
default); with bits = 4 (QuantConfig.bits) the code arrays hold page_size // 2 rows (2 blocks per byte,
two nibble planes) and everything below that says 4 blocks / planes says C = 8 // bits:
  q          float[S, num_q_heads, head_dim]          -> out f32[S, num_q_heads, head_dim]
  k_codes    u8[num_pages, num_kv_heads, page_size // 4, head_dim]   (planar per packing group of 4 blocks)
  k_scale, k_min  f16[num_pages, num_kv_heads, bpp, head_dim]
  k_sums     u8|u16[num_pages, num_kv_heads, page_size, NP]   (None: a cache without code sums, folded modes)
  v_codes    u8[num_pages, num_kv_heads, head_dim, page_size // 4]   (token-major)
  v_scale, v_min  f16[num_pages, num_kv_heads, page_size, NP]
  v_sums     u8|u16[num_pages, num_kv_heads, bpp, head_dim]         (None as k_sums)
  open_k, open_v  bf16[S, num_kv_heads, W, head_dim] (W = window or P);  sink_k, sink_v  bf16[S, num_kv_heads, ns, head_dim]
  page_indices i32[S, pages_per_seq];  kv_lens i32[S] (sinks + sealed + open tokens, the new one included)

Structure. Grid (batch, num_kv_heads, programs): one program serves the q_per_kv query heads of a kv
head over a contiguous range of loop trips of 4 blocks each (2 bits: one packing group, one u8[P, Pc] K tile
and one u8[Pc, P] V tile per channel group; 4 bits: two consecutive packing groups of one page, two tiles
each, read as 4 virtual planes, plane j = nibble j % 2 of tile j // 2 (`common.trip_plane`); a 4-bit page
of an odd number of packing groups keeps trips of one group, 2 blocks: `common.blocks_per_trip`;
`common.split_range` balances the trips over the splits). Its R = 4 * q_per_kv_pad rows (q_per_kv_pad =
max(4, next_pow2(q_per_kv)), so R >= 16, the dot's M; 2-block trips: R = 2 * q_per_kv_pad with
q_per_kv_pad = max(8, ...)) are (plane j, head g): row (j, g) handles block j of every trip and carries its
own online softmax; the 4 dots per tile set (one per plane) keep each row's own plane. Block metadata are
read once per trip as [4, X] tiles and broadcast to the rows. The 4 row streams merge at the end of the
program, the splits by log-sum-exp outside the kernel. Sinks and
the open block run in split 0, or in a program of their own (KernelConfig.open_split). On the GPU the
code planes are unpacked by inline PTX (4 codes per 32-bit register) and the INT8 rounding / division /
exp use single PTX instructions (common.py); interpret mode computes the same values with jnp.

Measured on one NVIDIA H200 (jax 0.11.2, Triton 3.6, Llama-3.1-8B heads: 32 q / 8 kv, d 128, P 64,
page 256): every mode is faster than our bf16 paged kernel at every measured shape; "folded_f16" (with
default_config's register cap) is faster than "int8" at the measured shapes and ~20x closer to the exact
identity, so a model decodes with it
(hack_jax.backend.DECODE_DOT_DTYPE); the kernel's default stays "int8", the paper's numerics. Numbers,
offline SASS counts and what limits the speed: bench/NOTES_decode.md, bench/results/decode_attention.md,
docs/DESIGN.md "Decode numerics".

Stacked caches: `layer_index` i (an int or i32 scalar) reads layer i of arrays with a leading
num_layers axis in place: they are viewed flat and one i32[2] operand gives the layer's first page and
sequence row (common.stacked_view), so one compiled kernel serves every layer (one layer's own arrays:
no operand, the kernel's offsets are zeros).

Caveats: partition_size and head_dim powers of two >= 32, page_size a multiple of 4 * partition_size.
"int8": a transient INT8 code at a near-.5 tie may round differently from the reference (the GPU's
float32 order); the gpu tests allow it. "folded_f16": |q * sigma| / sqrt(head_dim) beyond f16's 65504
overflows (keys of |K| ~ 1e5 and more); "folded_bf16" has bf16's range and ~8 bits of precision. Page ids
outside [0, num_pages) read page 0 (the null page, hack_jax.paging); kv_lens beyond the capacity
(ns + pages_per_seq * page_size) are clipped to it, as hack_jax.kv_cache.read_blocks does.

Reference twin: hack_jax.reference.kivi_block_attention_step + float_attention_step, reached via
hack_jax.attention.decode_attention(..., impl="reference") (the "int8" mode, code for code); the tests
carry independent float64 NumPy twins (tests/test_decode_kernels.py: numpy_kivi_decode for "int8",
numpy_dequant_decode / numpy_folded_decode for the folded modes).
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

DotDtype = Literal["int8", "folded_f16", "folded_bf16"]
DOT_DTYPES = ("int8", "folded_f16", "folded_bf16")
H200_NUM_SMS = 132
# Programs per SM the split model counts as one wave, by operand mode: 4 warps x at most 168 registers,
# 3 resident. Uncapped, XLA gives the folded modes 220 registers (2 resident); default_config caps them at
# 168 (KernelConfig.maxnreg, DEFAULT_MAXNREG): the kernel is latency-bound, and on the H200 the third
# program per SM made it 1.5x faster (104 vs 154 us at Llama 8 x 32K; bench/NOTES_decode.md, session 17).
RESIDENT_PROGRAMS_PER_SM = {"int8": 3, "folded_f16": 3, "folded_bf16": 3}
DEFAULT_MAXNREG = {"int8": None, "folded_f16": 168, "folded_bf16": 168}


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


def _hack_decode_kernel(kv_lens_ref, page_indices_ref, offsets_ref, q_ref, k_codes_ref, k_scale_ref, k_min_ref,
                        k_sums_ref, v_codes_ref, v_scale_ref, v_min_ref, v_sums_ref, open_k_ref,
                        open_v_ref, *refs, partition_size, num_channel_groups, q_per_kv, q_per_kv_pad,
                        num_sink_tokens, num_pages, max_blocks, num_splits, open_split,
                        sm_scale, dot_dtype, interpret, open_full=False, bits=2, interleaved=False,
                        denormal=False, open_state=common.sinks_and_open_block_state):
    # kv_lens_ref       i32[S]
    # page_indices_ref  i32[S, pages_per_seq]   layer-local page ids
    # offsets_ref       i32[2]: (first page, first sequence row) of the layer read, in the arrays below:
    #                   (i N, i S) for layer i of a stacked cache seen flat; None: (0, 0) (no operand)
    # q_ref             float[S, Hq, D]
    # k_codes_ref       u8[N, H, page_size // C, D]   C = 8 // bits planes (blocks) per packing group; a
    #                   loop trip reads T = common.blocks_per_trip blocks = T // C packing groups of one page
    # k_scale_ref, k_min_ref  f16[N, H, bpp, D]
    # k_sums_ref        u8|u16[N, H, bpp, P * NP]   (the wrapper's free reshape of [N, H, page_size, NP]);
    #                   None without code sums (k_sums_ref, v_sums_ref: read by dot_dtype "int8" only)
    # v_codes_ref       u8[N, H, D, page_size // C]   (token-major)
    # v_scale_ref, v_min_ref  f16[N, H, bpp, P * NP]   (reshaped likewise)
    # v_sums_ref        u8|u16[N, H, bpp, D]
    # open_k_ref, open_v_ref  bf16[S, H, W, D]   the open region (W = window, or P)
    # refs = (sink_k_ref, sink_v_ref  bf16[S, H, ns, D],)  if ns else ()
    #        + (acc_ref f32[q_per_kv_pad, D], m_ref f32[q_per_kv_pad], l_ref f32[q_per_kv_pad])   this program's
    #        outputs
    # open_state: the sinks + open block part (common.sinks_and_open_block_state's signature); the fused
    # append kernel (fused_decode_attention.py) passes one that also sees the token it writes
    ns, P, NP = num_sink_tokens, partition_size, num_channel_groups
    acc_ref, m_ref, l_ref = refs[-3:]
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    C = common.num_planes(bits)  # blocks per packing group (planes per byte)
    bpp = k_scale_ref.shape[2]
    T = common.blocks_per_trip(bits, bpp * P, P)  # blocks per loop trip = row streams per program
    trips_per_page = bpp // T
    R = T * q_per_kv_pad
    Pc = q_ref.shape[-1] // NP

    kv_len = kv_lens_ref[b]
    # row: this sequence's open block / sinks
    first_page, row = (0, b) if offsets_ref is None else (offsets_ref[0], offsets_ref[1] + b)
    after_sinks = jnp.clip(kv_len - ns, 0, max_blocks * P)  # beyond the capacity: clipped (as kv_cache)
    W = open_k_ref.shape[2]
    # sealed blocks: the open region's W // P seal together; open_full: a full region is still open (its
    # 16-bit rows read: kv_cache.append(seal="after") sealed nothing yet), so it holds 1..W tokens
    num_blocks = ((jnp.maximum(after_sinks - 1, 0) if open_full else after_sinks) // W) * (W // P)
    num_open = after_sinks - num_blocks * P
    num_trips = (num_blocks + T - 1) // T
    # open_split: programs 0..num_splits-1 take the sealed blocks, program num_splits the sinks and the
    # open block alone; otherwise split 0 takes them besides its (fewest) trips
    prologue_split = num_splits if open_split else 0
    g_lo, g_hi = common.split_range(jnp.minimum(split, num_splits - 1), num_trips, num_splits)
    if open_split:
        g_hi = jnp.where(split < num_splits, g_hi, g_lo)

    row_plane = jax.lax.broadcasted_iota(jnp.int32, (R,), 0) // q_per_kv_pad  # [R] block j of the trip
    q = common.load_q_rows(q_ref, b, h, q_per_kv=q_per_kv, q_per_kv_pad=q_per_kv_pad, num_channel_groups=NP,
                           sm_scale=sm_scale, planes=T)
    asm = not interpret  # inline PTX has no interpret-mode rule; the jnp forms give the same values
    exp = functools.partial(common.exp, fast=True)
    int8 = dot_dtype == "int8"
    if int8:
        plane_w = common.masked_plane_weights(row_plane, bits, T)  # [R]
    elif interleaved:  # folded_f16 with common.interleaved_plane: per-plane constants, as [R, 1] columns
        fold_dtype = jnp.float16
        consts = common.interleaved_plane_constants(bits)
        fold_w, fold_off = (sum(jnp.where(row_plane % C == j, c[i], 0.0) for j, c in enumerate(consts))[:, None]
                            for i in range(2))
        qi = common.load_q_rows(q_ref, b, h, q_per_kv=q_per_kv, q_per_kv_pad=q_per_kv_pad, num_channel_groups=NP,
                                sm_scale=sm_scale, planes=T, interleaved=True)
        perm_c, perm_t = common.interleaved_index(Pc), common.interleaved_index(P)
    elif denormal:  # folded_f16 with common.denormal_plane: a weight per plane, no offset
        fold_dtype, fold_off = jnp.float16, None
        fold_w = sum(jnp.where(row_plane % C == j, common.denormal_plane_weight(j, bits), 0.0)
                     for j in range(C))[:, None]
    else:
        fold_dtype = common.FOLDED_PLANES[dot_dtype][0]
        fold_w, fold_off = common.folded_plane_constants(dot_dtype, bits)
    if not interleaved:
        qi = q

    def int8_dot(x, tiles):
        """x f32[R, n] quantized INT8 per row, dotted with each row's own (virtual) plane of the trip's u8
        tiles [m, n] (the inner dim n is the tiles' contiguous axis) -> (f32[R, m] integer dot, scale [R],
        min [R])."""
        xc, xs, xm = common.quantize_rows_int8_codes(x, interpret=interpret, fast=True, fast_div=True)
        dots = [jnp.dot(xc, common.trip_plane(tiles, j, common.plane_int8_masked, asm=asm, bits=bits).T,
                        preferred_element_type=jnp.int32)
                for j in range(T)]
        return common.select_rows(row_plane, dots).astype(jnp.float32), xs, xm

    def fold_dot(x, tiles):
        """x f32[R, n] rounded to 16 bits, dotted with each row's own (virtual) plane of the trip's u8 tiles
        [m, n] -> (f32[R, m] = dot of the rounded x with the codes up to the plane offset, the rounded x
        f32[R, n])."""
        dots, xr = fold_plane_dots(x, tiles, None)
        return fold_w * common.select_rows(row_plane, dots), xr

    def fold_plane_dots(x, tiles, acc):
        """`fold_dot` before the row select and fold_w: (T x f32[R, m], the dots of the rounded x with each
        (virtual) plane, each plus acc's (None: nothing), the rounded x f32[R, n])."""
        xr = x.astype(fold_dtype)
        plane = (functools.partial(common.trip_plane, plane_fn=common.interleaved_plane) if interleaved else
                 functools.partial(common.trip_plane, plane_fn=common.denormal_plane) if denormal else
                 functools.partial(common.trip_plane, plane_fn=common.folded_plane, dot_dtype=dot_dtype))
        dots = [jnp.dot(xr, plane(tiles, j, asm=asm, bits=bits).T, preferred_element_type=jnp.float32)
                for j in range(T)]
        if acc is not None:  # dot + acc: the combine pass's dot(a, b, 0) + c -> dot(a, b, c)
            dots = [d + c for d, c in zip(dots, acc)]
        return dots, xr.astype(jnp.float32)

    init = jax.lax.cond(
        split == prologue_split,
        lambda: open_state(q, open_k_ref, open_v_ref, refs[:2] if ns else (), row, h, kv_len, num_open,
                           row_plane),
        lambda: common.empty_state(R, Pc, NP))

    def body(trip, carry):
        # One trip: blocks T trip + j (j < T) of one page (T // C packing groups), row (j, g) handles block
        # T trip + j, read as plane j % C of the trip's packing group j // C (common.trip_plane).
        m, l, accs = carry
        page, trip_in_page = ((trip, 0) if trips_per_page == 1 else
                              (trip // trips_per_page, trip % trips_per_page))
        pid = page_indices_ref[b, page]
        pid = first_page + jnp.where((pid >= 0) & (pid < num_pages), pid, 0)  # outside the layer: its null page
        code_row0 = trip_in_page * (T // C * P)
        code_rows = [code_row0 + i * P if i else code_row0 for i in range(T // C)]  # per packing group
        slot0 = trip_in_page * T  # block slot of plane 0 in the page
        valid = T * trip + row_plane < num_blocks  # [R]

        def rows(xc):  # [T, X] per block of the trip -> f32[R, X], row (j, g) = xc[j]
            xc = xc.astype(jnp.float32)
            return jnp.broadcast_to(xc[:, None, :], (T, q_per_kv_pad, xc.shape[1])).reshape(R, xc.shape[1])

        slots = (slot0 + jax.lax.broadcasted_iota(jnp.int32, (T,), 0))[:, None] if interleaved else None

        def per_channel(ref, channels):  # [T, Pc] block metadata (sigma, mu, omega) -> [R, Pc]
            if interleaved:  # channels in the K planes' order
                return rows(ref[pid, h, slots, (channels.start + perm_c)[None, :]])
            return rows(ref[pid, h, pl.ds(slot0, T), channels])

        def per_token(ref):  # per-token metadata (kappa, tau, nu) [N, H, bpp, P NP] -> NP x [T, P], one per group
            if interleaved:  # tokens in the order the permuted K rows gave the logits
                return [ref[pid, h, slots, (perm_t * NP + p)[None, :]] for p in range(NP)]
            # the trip's [T, P NP] tile (token t's group p at t NP + p) in one contiguous 2-D load, split in
            # registers: a channel group's [T, P] column alone is a stride-NP gather of 2-byte elements, which
            # Triton cannot issue as cp.async (a synchronous load each trip waited on: bench/NOTES_decode.md,
            # session 17); as a 2-D tile (not [T, P, NP]) each cp.async copies whole rows
            tile = ref[pid, h, pl.ds(slot0, T), :]
            if NP == 1:
                return [tile]
            return [jnp.squeeze(x, axis=2) for x in jnp.split(tile.reshape(T, P, NP), NP, axis=2)]

        def k_tile(r0, channels):  # u8[P, Pc] of a packing group (interleaved: rows = tokens permuted)
            if interleaved:
                return k_codes_ref[pid, h, (r0 + perm_t)[:, None],
                                   (channels.start + jax.lax.broadcasted_iota(jnp.int32, (Pc,), 0))[None, :]]
            return k_codes_ref[pid, h, pl.ds(r0, P), channels]

        # QK^T. int8: logit_j = sum_p [ s_p sum_{c in p} qc_c k_jc + m_p kappa_jp ] + q . mu;
        # folded: logit_j = sum_c r(q_c sigma_c) k_jc + q . mu (the plane offset folded into the constant)
        logits = jnp.zeros((R, P), jnp.float32) if int8 else None  # folded: set after the loop
        kappas = per_token(k_sums_ref) if int8 else None
        # folded: a plane's channel-group dots summed before the row select (the dots are linear in the
        # channels; fold_w is a power of two per row, applied once after), written `dot_p + dot_{p-1}` so
        # that Triton's combine pass (XLA's MakeTTIR runs it) chains them through the MMA accumulator: one
        # select, one fold_w multiply and one [R] bias (one layout conversion) per trip instead of NP
        plane_dots, bias_sum = None, None
        for p in range(NP):
            channels = pl.ds(p * Pc, Pc)
            k_tiles = [k_tile(r0, channels) for r0 in code_rows]  # T // C x u8[P, Pc]
            sigma = per_channel(k_scale_ref, channels)  # [R, Pc]
            mu = per_channel(k_min_ref, channels)  # [R, Pc]
            if int8:
                kappa = rows(kappas[p])  # [R, P]
                dot, qs, qm = int8_dot(q[p] * sigma, k_tiles)  # [R, P], [R], [R]
                logits += ((qs * plane_w)[:, None] * dot + qm[:, None] * kappa
                           + jnp.sum(q[p] * mu, axis=1)[:, None])
            else:
                plane_dots, a = fold_plane_dots(qi[p] * sigma, k_tiles, plane_dots)  # T x [R, P], [R, Pc]
                bias = qi[p] * mu if fold_off is None else qi[p] * mu - fold_off * a
                bias = jnp.sum(bias, axis=1)
                bias_sum = bias if bias_sum is None else bias_sum + bias
        if not int8:
            logits = fold_w * common.select_rows(row_plane, plane_dots) + bias_sum[:, None]

        mb = jnp.max(logits, axis=1)  # [R] block-local max (sealed blocks are full: no mask)
        w = exp(logits - mb[:, None])  # [R, P]
        lb = jnp.sum(w, axis=1)

        # PV. int8: o_c = s'_p sum_j wc_jp v_jc + m'_p omega_c + sum_j W_j nu_jp (c in p), as running FMAs;
        # folded: o_c = sum_j r(W_j tau_j) v_jc + sum_j W_j nu_j. Each channel group's accumulator is merged
        # as soon as its block output is ready.
        m_new, l_new, alpha, beta = common.merge_weights(m, l, mb, lb, valid, exp=exp)
        new_accs = []
        taus, nus = per_token(v_scale_ref), per_token(v_min_ref)  # NP x [T, P]
        for p in range(NP):
            channels = pl.ds(p * Pc, Pc)
            # T // C x u8[Pc, P], token-major: 4 consecutive tokens per 32-bit word, the MMA's B layout
            v_tiles = [v_codes_ref[pid, h, channels, pl.ds(r0, P)] for r0 in code_rows]
            # [R, P], broadcast per channel group (fewer live at once). tau + 0 * nu (= tau for finite nu) puts
            # the nu tile on the dot operand's input chain: Triton's pipeliner issues a load as cp.async one
            # trip ahead only when a dot depends on it, so nu was a synchronous load each trip waited on
            # (bench/NOTES_decode.md, session 18)
            tau, nu = rows(taus[p] + 0 * nus[p]), rows(nus[p])
            if int8:
                omega = per_channel(v_sums_ref, channels)  # [R, Pc]
                pv, ws, wm = int8_dot(w * tau, v_tiles)  # [R, Pc], [R], [R]
                out = (jnp.sum(w * nu, axis=1)[:, None] + wm[:, None] * omega) + (ws * plane_w)[:, None] * pv
            else:
                pv, wt = fold_dot(w * tau, v_tiles)  # [R, Pc], [R, P]
                out = jnp.sum(w * nu if fold_off is None else w * nu - fold_off * wt, axis=1)[:, None] + pv
            new_accs.append(common.merge_acc(accs[p], out, alpha, beta, valid))
        return m_new, l_new, tuple(new_accs)

    m, l, accs = jax.lax.fori_loop(g_lo, g_hi, body, init)
    m, l, accs = common.merge_streams(m, l, accs, T)  # [q_per_kv_pad], [q_per_kv_pad], NP x [q_per_kv_pad, Pc]
    for p in range(NP):
        acc_ref[:, pl.ds(p * Pc, Pc)] = accs[p]
    m_ref[...] = m
    l_ref[...] = l


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch choices; a bare KernelConfig() is the fast "int8" path with one split (a bare folded_f16 one
    has the 1024 + 64c planes: default_config is what picks the subnormal planes).

    num_splits: programs per (sequence, kv head) along the sequence (split-K). open_split: one more
    program per (sequence, kv head) for the sinks and the open block alone (short sequences; otherwise
    split 0 does them after its packing groups; the dequant baseline ignores it). dot_dtype: the operand
    mode (module docstring). num_warps, num_stages: Triton's (4 and 2 measured best; 8 warps and 3-4 stages
    measured no faster as defaults, bench/NOTES_decode.md). interleaved ("folded_f16",
    2-bit codes only): the codes unpacked by `common.interleaved_plane` (no byte permutes; the K rows, q,
    sigma, mu, tau and nu read in the matching order), the same dots up to float32 rounding; 4.6% fewer
    loop instructions offline (bench/NOTES_decode.md, session 12); on the H200 24% slower at batch 8:
    off by default. denormal ("folded_f16" only, not with interleaved): the codes unpacked by
    `common.denormal_plane` as exact f16 subnormals (no magic exponent: no offset term, no per-plane
    shift; 15% fewer loop instructions); default_config's choice for folded_f16 at 2 and 4 bits (with a
    float32 q, `common.kernel_q`; measured on the H200: docs/DESIGN.md "Decode numerics"). maxnreg: a cap
    on the registers per thread (`common.pallas_call`), None for the compiler's choice; default_config's is
    DEFAULT_MAXNREG."""

    num_splits: int = 1
    open_split: bool = False
    dot_dtype: DotDtype = "int8"
    num_warps: int = 4
    num_stages: int = 2
    interleaved: bool = False
    denormal: bool = False
    maxnreg: int | None = None


def default_config(*, batch: int, num_kv_heads: int, pages_per_seq: int, page_size: int,
                   partition_size: int, dot_dtype: DotDtype = "int8", num_sms: int = H200_NUM_SMS,
                   bits: int = 2) -> KernelConfig:
    """Splits from the H200 runs (bench/NOTES_decode.md): the kernel is latency-bound and a program's
    time is ~linear in its loop trips (`common.blocks_per_trip` blocks: one 2-bit packing group, two
    4-bit ones where the page allows), so the time is ~ waves x trips per program, with
    RESIDENT_PROGRAMS_PER_SM[dot_dtype] x num_sms programs per wave (set by the register count);
    `choose_num_splits` minimizes that (a partial last wave costs a whole one)."""
    if dot_dtype not in DOT_DTYPES:
        raise ValueError(f"dot_dtype must be one of {DOT_DTYPES}, got {dot_dtype=}")
    trips = max(1, pages_per_seq * page_size // (common.blocks_per_trip(bits, page_size, partition_size)
                                                 * partition_size))
    slots = RESIDENT_PROGRAMS_PER_SM[dot_dtype] * num_sms
    splits, open_split = choose_num_splits(batch * num_kv_heads, trips, slots)
    return KernelConfig(num_splits=splits, open_split=open_split, dot_dtype=dot_dtype,
                        denormal=dot_dtype == "folded_f16", maxnreg=DEFAULT_MAXNREG[dot_dtype])


def choose_num_splits(num_pairs: int, num_packing_groups: int, slots: int) -> tuple[int, bool]:
    """(splits, open_split) per (sequence, kv head) minimizing waves x (work of the longest program + 1):
    waves = ceil(num_pairs * programs / slots) with programs = splits (+ 1 with open_split); the
    longest program's work in packing groups is ceil(n / splits) with open_split, else
    floor(n / splits) + 1 (split 0 also does the sinks and the open block, ~1 group); the + 1 is a
    program's fixed cost (prologue, epilogue, its share of the split combine). Ties go to fewer
    programs. E.g. H200, 8 kv heads, 32K tokens (128 groups): batch 1 -> 43, batch 8 -> 6, batch 32 ->
    3 (2 full waves of 43 groups instead of one two-thirds-empty wave of 128); 1K tokens (4 groups) at
    batch 1 and 8 -> 4 splits + the open split (each program one unit of work instead of two)."""
    best, best_cost = (1, False), None
    for s in range(1, num_packing_groups + 1):
        for open_split in (False, True):
            cost = split_cost(num_pairs, num_packing_groups, slots, s, open_split)
            if best_cost is None or cost < best_cost:
                best, best_cost = (s, open_split), cost
    return best


def split_cost(num_pairs: int, num_packing_groups: int, slots: int, splits: int, open_split: bool) -> int:
    """`choose_num_splits`'s predicted time, in packing-group units: waves x (longest program's work + 1)."""
    work = -(-num_packing_groups // splits) if open_split else num_packing_groups // splits + 1
    return -(-num_pairs * (splits + open_split) // slots) * (work + 1)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("partition_size", "num_sink_tokens", "num_layers", "config",
                                             "open_full", "interpret", "bits"))
def _hack_decode(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                 sink_k, sink_v, page_indices, kv_lens, offsets, *, partition_size, num_sink_tokens, num_layers,
                 config, open_full, interpret, bits):
    # the cache arrays of num_layers layers seen flat ([num_layers * N, ...], [num_layers * S, ...]);
    # offsets i32[2] picks the layer (the kernel's offsets_ref); None: the first (no operand)
    q = common.kernel_q(q, config)
    batch, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, _, _ = k_codes.shape  # of all the layers
    page_size, num_channel_groups = v_scale.shape[2], v_scale.shape[3]  # [N, H, page_size, NP], as k_sums
    pages_per_seq = page_indices.shape[1]
    trip = common.blocks_per_trip(bits, page_size, partition_size)
    pad = common.q_per_kv_pad(num_q_heads // num_kv_heads, at_least=16 // trip)  # R = trip * pad >= 16
    splits = config.num_splits
    programs = splits + config.open_split
    # the partials' rows (a power of two where combine_splits' kernel merges them); it reads the first `programs`
    out_rows = common.split_slots(programs, pad, head_dim)
    # per-token metadata as [N, H, bpp, P * NP] (a free reshape): the kernel reads a trip's blocks as one
    # contiguous 2-D tile (its per_token)
    k_sums, v_scale, v_min = (None if x is None else
                              x.reshape(num_pages, num_kv_heads, page_size // partition_size,
                                        partition_size * num_channel_groups) for x in (k_sums, v_scale, v_min))
    inputs = [kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32)] + ([] if offsets is None else [offsets])
    # absent code sums (a cache without them, the folded modes only): no operand, the kernel gets None
    inputs += [x for x in (q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v)
               if x is not None]
    if num_sink_tokens:
        inputs += [sink_k, sink_v]
    kernel = functools.partial(
        _hack_decode_kernel, partition_size=partition_size, num_channel_groups=num_channel_groups,
        q_per_kv=num_q_heads // num_kv_heads, q_per_kv_pad=pad, sm_scale=1.0 / math.sqrt(head_dim),
        num_sink_tokens=num_sink_tokens, num_pages=num_pages // num_layers,
        max_blocks=pages_per_seq * (page_size // partition_size),
        num_splits=splits, open_split=config.open_split, dot_dtype=config.dot_dtype, interpret=interpret,
        interleaved=config.interleaved, denormal=config.denormal,
        open_full=open_full, bits=bits)
    # the kernel's ref positions of v_sums, k_sums and offsets, highest first (each wrapper sees the refs
    # with the lower absent ones already put back)
    kernel = common.without_operand(kernel, 11, v_sums is not None)
    kernel = common.without_operand(kernel, 7, k_sums is not None)
    kernel = common.without_operand(kernel, 2, offsets is not None)
    out_shape = [jax.ShapeDtypeStruct((batch, num_kv_heads, out_rows, pad, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, num_kv_heads, out_rows, pad), jnp.float32),
                 jax.ShapeDtypeStruct((batch, num_kv_heads, out_rows, pad), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, None, pad, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, pad), lambda b, h, s: (b, h, s, 0)),
                 pl.BlockSpec((None, None, None, pad), lambda b, h, s: (b, h, s, 0))]
    acc, m, l = common.pallas_call(
        kernel, out_shape=out_shape, grid=(batch, num_kv_heads, programs),
        in_specs=[common.full_spec(x) for x in inputs], out_specs=out_specs,
        num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret,
        name="hack_decode_attention", maxnreg=config.maxnreg)(*inputs)
    return common.combine_splits(acc, m, l, num_q_heads, programs=programs, interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


@common.quiet
def hack_decode_attention(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                          sink_k, sink_v, page_indices, kv_lens, *, partition_size: int, num_sink_tokens: int,
                          v_group: int | None = None, window: int | None = None, bits: int = 2,
                          dot_dtype: DotDtype = "int8", num_splits: int | None = None,
                          num_stages: int | None = None, num_warps: int | None = None,
                          config: KernelConfig | None = None, layer_index=None,
                          open_full: bool = False, interleaved: bool = False, denormal: bool | None = None,
                          maxnreg: int | None = None, interpret: bool = False):
    """HACK decode attention over the paged INT2 (or INT4) kivi cache (module docstring; shapes there).

    Args:
      q: float[batch, num_q_heads, head_dim], one query token per sequence.
      k_codes ... sink_v: the cache arrays of one layer (module docstring); sink_k / sink_v may be None
        when num_sink_tokens == 0; k_sums / v_sums are validated but not read by the folded modes, and may
        be None for them (a cache without code sums, QuantConfig.code_sums False: no operand is passed).
      page_indices: i32[batch, pages_per_seq]; kv_lens: i32[batch] (lists / NumPy arrays of ints accepted).
      partition_size: P (the quantization block). num_sink_tokens: ns.
      v_group: channels per V / query channel group (None: P), clamped to head_dim; the kernel reads
        it from v_scale's shape, this checks the arrays against it.
      window: the 16-bit open region's length W (None: P; QuantConfig.window), a power-of-two multiple
        of P dividing page_size; the kernel reads it from open_k's shape, this checks it.
      bits: the code width (QuantConfig.bits): 2 (4 blocks per packing group) or 4 (2 blocks, the
        code arrays [.., page_size // 2, ..]); checked against the arrays.
      dot_dtype: "int8" | "folded_f16" | "folded_bf16", the operand mode (ignored if config is given).
      num_splits: split-K programs per (sequence, kv head); overrides the config's.
      num_stages: the loop's software-pipeline depth (loads in flight + 1); overrides the config's.
      num_warps: warps per program (a power of two in [1, 16]); overrides the config's.
      config: KernelConfig; None picks default_config(...).
      layer_index: None, or an int / i32 scalar i: then every cache array (k_codes ... sink_v) carries a
        leading num_layers axis (a stacked cache: [L, num_pages, ...], [L, batch, ...]) and the kernel
        reads layer i in place (`common.stacked_view`); page ids stay layer-local.
      open_full: False: a sequence whose kv_len fills its open region (kv_len - ns a positive multiple of W)
        reads the region's blocks as sealed codes (the cache's invariant). True: it reads the region's W
        16-bit rows instead: the blocks are not sealed yet (kv_cache.append(seal="after"): the decode step
        that wrote the filling token; hack_jax.attention.decode_step). Other lengths read the same either way.
      interleaved: True sets KernelConfig.interleaved on the config (given or default), in place of its
        subnormal planes: 2-bit codes with dot_dtype "folded_f16" only (ValueError otherwise).
      denormal: None keeps the config's KernelConfig.denormal (default_config: True for folded_f16;
        False where interleaved=True); True / False set it (True: dot_dtype "folded_f16" only, not with
        interleaved).
      maxnreg: None keeps the config's KernelConfig.maxnreg (default_config: 168 for the folded modes); 0
        removes the register cap; an int in [24, 255] sets it.
      interpret: run the kernel in Pallas interpret mode (CPU tests).

    Returns:
      f32[batch, num_q_heads, head_dim]; rows with kv_lens = 0 are 0.

    Raises:
      ValueError: shapes/dtypes off the layout, unsupported sizes, bad dot_dtype, num_splits, num_stages,
        num_warps, interleaved, denormal or maxnreg; dot_dtype "int8" without k_sums / v_sums.
    """
    page_indices, kv_lens = common.as_index_arrays(page_indices, kv_lens)
    if num_sink_tokens == 0:
        sink_k = sink_v = None
    cache = (k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v, sink_k, sink_v)
    view = common.stacked_view(cache, layer_index, batch=q.shape[0])
    common.check_kivi_inputs(q, *view.layer, page_indices, kv_lens, partition_size=partition_size,
                             num_sink_tokens=num_sink_tokens, v_group=v_group, window=window, bits=bits)
    config = resolve_config(q, view.layer[0], view.layer[5], page_indices, partition_size=partition_size,
                            dot_dtype=dot_dtype, num_splits=num_splits, config=config, bits=bits,
                            interleaved=interleaved, num_stages=num_stages, num_warps=num_warps,
                            denormal=denormal, maxnreg=maxnreg)
    if config.dot_dtype == "int8":
        common.require_code_sums("hack_decode_attention", config.dot_dtype, k_sums, v_sums)
    if not isinstance(open_full, bool):
        raise ValueError(f"open_full must be a bool, got {open_full=}")
    return _hack_decode(q, *view.flat, page_indices, kv_lens, view.offsets, partition_size=partition_size,
                        num_sink_tokens=num_sink_tokens, num_layers=view.num_layers, config=config,
                        open_full=open_full, interpret=interpret, bits=bits)


def resolve_config(q, k_codes, per_token, page_indices, *, partition_size, dot_dtype="int8", num_splits=None,
                   config=None, bits=2, interleaved=False, num_stages=None, num_warps=None,
                   denormal=None, maxnreg=None) -> KernelConfig:
    """The KernelConfig to launch (inputs already validated; per_token: a per-token page array
    [num_pages, H, page_size, X], v_scale or k_sums, giving page_size): `config` or default_config(...),
    num_splits, num_stages, num_warps, interleaved=True (with denormal None: in place of the subnormal
    planes), denormal True / False and maxnreg (0: no cap) overriding; ValueError on a bad dot_dtype, config,
    num_splits, num_stages, num_warps, interleaved, denormal (or both set) or maxnreg."""
    if config is None:
        config = default_config(batch=q.shape[0], num_kv_heads=k_codes.shape[1],
                                pages_per_seq=page_indices.shape[1], page_size=per_token.shape[2],
                                partition_size=partition_size, dot_dtype=dot_dtype, bits=bits)
    elif not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a decode_attention.KernelConfig, got {type(config).__name__}")
    elif config.dot_dtype not in DOT_DTYPES:
        raise ValueError(f"config.dot_dtype must be one of {DOT_DTYPES}, got {config.dot_dtype=}")
    if num_splits is not None:
        if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int, got {num_splits=}")
        config = dataclasses.replace(config, num_splits=num_splits)
    if num_stages is not None:
        if not isinstance(num_stages, int) or isinstance(num_stages, bool) or not 1 <= num_stages <= 8:
            raise ValueError(f"num_stages must be an int in [1, 8], got {num_stages=}")
        config = dataclasses.replace(config, num_stages=num_stages)
    if num_warps is not None:
        if not isinstance(num_warps, int) or isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two in [1, 16], got {num_warps=}")
        config = dataclasses.replace(config, num_warps=num_warps)
    if interleaved is not False:
        if interleaved is not True:
            raise ValueError(f"interleaved must be a bool, got {interleaved=}")
        # the asked-for planes replace the config's subnormal ones unless denormal=True is asked for too
        config = dataclasses.replace(config, interleaved=True, **({} if denormal is not None else {"denormal": False}))
    if denormal is not None:
        if not isinstance(denormal, bool):
            raise ValueError(f"denormal must be a bool or None, got {denormal=}")
        config = dataclasses.replace(config, denormal=denormal)
    if maxnreg is not None:
        common.check_maxnreg(maxnreg, zero=True)
        config = dataclasses.replace(config, maxnreg=maxnreg or None)
    if not isinstance(config.num_splits, int) or config.num_splits < 1:
        raise ValueError(f"config.num_splits must be a positive int, got {config.num_splits=}")
    common.check_maxnreg(config.maxnreg, "config.maxnreg")
    if config.interleaved is not False and (config.interleaved is not True or config.dot_dtype != "folded_f16"
                                            or bits != 2):
        raise ValueError(f"config.interleaved=True needs dot_dtype 'folded_f16' and 2-bit codes (at 4 bits it "
                         f"saves nothing), got {config.interleaved=}, {config.dot_dtype=}, {bits=}")
    if config.denormal is not False and (config.denormal is not True or config.dot_dtype != "folded_f16"
                                         or config.interleaved):
        raise ValueError(f"config.denormal=True needs dot_dtype 'folded_f16' (f16 subnormal planes) and not "
                         f"interleaved, got {config.denormal=}, {config.dot_dtype=}, {config.interleaved=}")
    return config
