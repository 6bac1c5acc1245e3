"""HACK prefill attention on the paged INT2 cache (kivi layout), one Pallas kernel lowered to Triton.

What it computes: causal attention of a prompt's (or a prompt chunk's) queries over the sequence as
write_prefill stored it, exactly as docs/DESIGN.md "Homomorphic attention semantics" (layout="kivi")
says, on the codes: per (query tile, sealed block b), Q*sigma_b quantized INT8 per (row, channel
group), QK^T as an integer dot on the K codes plus the K code sums and q.mu_b terms; block-local
softmax weights W (masked keys excluded from the max, W = 0 for them); W*tau quantized INT8 per
(row, channel group) over the block; PV as an integer dot on the V codes plus the V code sums and
W.nu terms. Sinks and the 16-bit open block in float32. Nothing is dequantized. K/V are quantized
once, by hack_jax.kv_cache.write_prefill; prefill and decode read the same codes.

Shapes (DESIGN.md "Paged cache layout"; P = partition_size, Pc = min(P, head_dim),
NP = head_dim // Pc, bpp = page_size // P, S = max_seqs, ns = num_sink_tokens, G = num_q_heads //
num_kv_heads):
  q          float[S, T, num_q_heads, head_dim]     -> out f32[S, T, num_q_heads, head_dim]
  layer      hack_jax.kv_cache.KiviPages: k_codes u8[num_pages, H, page_size // 4, D], v_codes
             u8[num_pages, H, D, page_size // 4] (token-major: the same packing, transposed),
             k_scale/k_min f16[num_pages, H, bpp, D], k_sums u8|u16[num_pages, H, page_size, NP],
             v_scale/v_min f16[num_pages, H, page_size, NP], v_sums u8|u16[num_pages, H, bpp, D],
             open_k/open_v bf16[S, H, P, D], sink_k/sink_v bf16[S, H, ns, D]
  page_indices i32[S, pages_per_seq];  kv_lens i32[S] (tokens held, this prompt included)
  q_start    i32[S]: position of query row 0 (0: a whole prompt; > 0: a chunk continuing a cached
             prefix); row t sees keys at positions <= q_start + t; rows at or past kv_lens give 0.

Kernel structure. Grid (S, num_kv_heads, query tiles), the heaviest (last) tiles first. A program
holds block_q query positions of all G query heads of one kv head: R = block_q * G_pad rows
(r = t * G_pad + g, G_pad = next_pow2(G); GQA folded into the dot's M, so each K/V block is read
once per G heads), q * (1 / sqrt(head_dim)) kept in registers as NP [R, Pc] float32 tiles. It
walks the sealed blocks the tile can see: the ones every row sees whole without a mask, then the
diagonal ones with the causal mask. Per block and channel group: the block's plane of the packed
[P, Pc] K code tile and [Pc, P] V code tile (plane = block % 4 of its packing group, a dynamic
shift), its metadata rows, two integer dots ([R, Pc] x [P, Pc]^T and [R, P] x [Pc, P]^T), the INT8
quantizations and the corrections, one online-softmax merge per block. Sinks (per token, elementwise)
before, the open block (float32 through `common.f32_bf16_dot`, 3 bf16 MMAs) after, as the reference
orders them.

Dot variants (KernelConfig.dot_dtype): "bf16" (bf16 operands holding the integer codes, float32
accumulation: exact, products <= 128 * 3, sums < 2**24) and "int8" (int8 x int8 -> int32, the
method as written). fp8 e4m3 is not offered: it holds the 2-bit codes and every integer up to 16
exactly, but not all INT8 codes (17 rounds to 16, 127 to 128), so an e4m3 dot would not be exact;
splitting each INT8 code into two exact e4m3 digits takes two fp8 MMAs, the same tensor-core time
as one bf16 MMA. Default "bf16": GPU.md measured Pallas-Triton bf16 dots at 2-3x the int8 rate, and
prefill is compute-bound (the decode kernel's int8 win came from cheaper unpacking of a
memory-bound stream); the benchmark measures both (bench/bench_prefill_attention.py).

GPU fast paths (KernelConfig; defaults on; bench/NOTES_prefill.md v2, from the offline SASS): the INT8
quantizers by one reciprocal per row with the rounding done by the FFMA (`quantize_rows_int8_fast`), the
2-bit plane unpacked by inline PTX without integer-to-float converts (`plane_asm`), the per-token metadata
of all channel groups as one [P, NP] tile each (pipelined by Triton). Interpret mode runs the same math
through jnp, except the PTX (the plain jnp unpack gives the same codes).

Tested: CPU interpret mode (jax 0.10.2), tests/test_prefill_kernels.py, against the reference
(hack_jax.attention.prefill_attention(..., impl="reference"), whose per-block step is
hack_jax.reference.kivi_block_attention_step) and an independent float64 NumPy twin; the Triton
lowering of every tested configuration is checked on the CPU (lowered for CUDA). Measured on one
NVIDIA H200 (jax 0.11.2, Triton 3.6): the gpu tests pass, and at Llama-3.1-8B heads it runs ~7x
cuDNN's flash attention time (issue-bound on the per-block INT8 requantization; bench/NOTES_prefill.md
v2). So a model's prefill does not use it by default: hack_jax.prefill attends the prompt exactly on
its 16-bit K/V (cuDNN) and this kernel is the `attention="homomorphic"` option, which is not causal
within a block (hack_jax.prefill's docstring).
Caveats: partition_size and head_dim powers of two >= 32, page_size a multiple of
4 * partition_size; transient INT8 codes can differ from the reference's by one where float32
evaluation order (or the GPU's float32 division and exp) moves a value across a rounding tie (the
tests bound the effect); page ids outside [0, num_pages) read page 0; kv_lens beyond the capacity
are clipped to it (as hack_jax.kv_cache.read_blocks does).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import common

NUM_PLANES = 4  # 2-bit codes per byte = blocks per packing group (DESIGN.md "2-bit packing")
DOT_DTYPES = ("bf16", "int8")
LAYER_FIELDS = ("k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums",
                "open_k", "open_v", "sink_k", "sink_v")


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


def _hack_prefill_kernel(kv_lens_ref, q_start_ref, page_indices_ref, q_ref, k_codes_ref, k_scale_ref,
                         k_min_ref, k_sums_ref, v_codes_ref, v_scale_ref, v_min_ref, v_sums_ref,
                         open_k_ref, open_v_ref, *refs, partition_size, num_groups, group_pad, block_q,
                         num_q_tiles, num_sink_tokens, num_pages, max_blocks, dot_dtype, fast_quant,
                         unpack_asm, q_reload, meta_tiles, interpret):
    # kv_lens_ref, q_start_ref  i32[S]
    # page_indices_ref  i32[S, pages_per_seq]
    # q_ref             float[block_q, G_pad, D]   this tile: positions x the kv head's query heads
    # k_codes_ref       u8[N, H, page_size // 4, D]
    # k_scale_ref, k_min_ref  f16[N, H, bpp, D]
    # k_sums_ref        u8|u16[N, H, page_size, NP]
    # v_codes_ref       u8[N, H, D, page_size // 4]   (token-major)
    # v_scale_ref, v_min_ref  f16[N, H, page_size, NP]
    # v_sums_ref        u8|u16[N, H, bpp, D]
    # open_k_ref, open_v_ref  bf16[S, H, P, D]
    # refs = (sink_k_ref, sink_v_ref  bf16[S, H, ns, D],) if ns else ()
    #        + (o_ref f32[block_q, G_pad, D],)
    ns, P, NP = num_sink_tokens, partition_size, num_groups
    *sink_refs, o_ref = refs
    b, h = pl.program_id(0), pl.program_id(1)
    tile = num_q_tiles - 1 - pl.program_id(2)  # the longest rows first (causal load balance)
    D = q_ref.shape[-1]
    Pc = D // NP
    R = block_q * group_pad
    bpp = k_scale_ref.shape[2]
    op_dtype = jnp.int8 if dot_dtype == "int8" else jnp.bfloat16

    kv_len = jnp.clip(kv_lens_ref[b], 0, ns + max_blocks * P)  # beyond the capacity: clipped
    lo = q_start_ref[b] + tile * block_q  # position of the tile's first row
    hi = jnp.minimum(lo + block_q, kv_len) - 1  # last position of a valid row (< lo: none)
    pos = lo + _div(jax.lax.broadcasted_iota(jnp.int32, (R,), 0), group_pad)  # [R]
    n_u = jnp.clip(kv_len - ns, 0, max_blocks * P)
    num_sealed, num_open = _div(n_u, P), _mod(n_u, P)
    # Sealed blocks k the tile sees (ns + k P <= hi); the first n_full every row sees whole.
    nk = jnp.where((hi >= lo) & (hi >= ns), jnp.minimum(num_sealed, _div(hi - ns, P) + 1), 0)
    n_full = jnp.minimum(_div(jnp.maximum(lo - ns + 1, 0), P), nk)

    # The reference divides q by sqrt(head_dim); XLA rewrites that into a product with the float32
    # reciprocal of the float32 constant: the same q_s here, without a (GPU: approximate) division.
    inv_sqrt_d = np.float32(1) / np.float32(math.sqrt(D))
    q = [(q_ref[:, :, pl.ds(p * Pc, Pc)].astype(jnp.float32) * inv_sqrt_d).reshape(R, Pc)
         for p in range(NP)]  # NP x f32[R, Pc]

    def quantize(x):
        """x f32[R, n] -> (INT8 codes as dot operands, scale [R], folded minimum [R])."""
        if fast_quant:
            return quantize_rows_int8_fast(x, op_dtype, interpret=interpret)
        if dot_dtype == "int8":
            return common.quantize_rows_int8_codes(x, interpret=interpret, fast=False)
        codes, s, mf = common.quantize_rows_int8(x, interpret=interpret)
        return codes.astype(op_dtype), s, mf

    def plane(tile_u8, shift):  # packed u8 tile -> this block's codes as dot operands, same shape
        if unpack_asm and not interpret:
            return plane_asm(tile_u8, shift, op_dtype)
        return ((tile_u8 >> shift.astype(jnp.uint8)) & jnp.uint8(3)).astype(op_dtype)

    def block(masked, k, state):
        """Sealed block k of this sequence (DESIGN.md steps 1-4)."""
        m, l, accs = state
        pid = page_indices_ref[b, _div(k, bpp)]
        pid = jnp.where((pid >= 0) & (pid < num_pages), pid, 0)
        slot = _mod(k, bpp)
        code_rows = pl.ds(_div(slot, NUM_PLANES) * P, P)  # the block group's packed K rows / V columns
        shift = 2 * _mod(slot, NUM_PLANES)  # i32
        tokens = pl.ds(slot * P, P)
        if q_reload:  # q re-read per block (an opaque zero offset keeps the load in the loop)
            zero = jnp.minimum(pid, 0)
            qb = [(q_ref[pl.ds(zero, block_q), :, pl.ds(p * Pc, Pc)].astype(jnp.float32) * inv_sqrt_d)
                  .reshape(R, Pc) for p in range(NP)]
        else:
            qb = q

        if meta_tiles:  # the per-token metadata of all channel groups as [P, NP] tiles, split in registers
            cols = lambda ref, f: [f(x.reshape(P)) for x in jnp.split(ref[pid, h, tokens, :], NP, axis=1)]
            kappas = cols(k_sums_ref, _u_to_f32)
            taus = cols(v_scale_ref, lambda x: x.astype(jnp.float32))
            nus = cols(v_min_ref, lambda x: x.astype(jnp.float32))

        # logit_j = sum_p [ s_p sum_{c in p} qc_c k_jc + m_p kappa_jp ] + q . mu
        logits = qmu = None
        for p in range(NP):
            ch = pl.ds(p * Pc, Pc)
            kc = plane(k_codes_ref[pid, h, code_rows, ch], shift)  # [P, Pc]
            sigma = k_scale_ref[pid, h, slot, ch].astype(jnp.float32)  # [Pc]
            mu = k_min_ref[pid, h, slot, ch].astype(jnp.float32)  # [Pc]
            kappa = kappas[p] if meta_tiles else _u_to_f32(k_sums_ref[pid, h, tokens, p])  # [P]
            qc, qs, qm = quantize(qb[p] * sigma[None, :])  # [R, Pc], [R], [R]
            dot = common.int_dot(qc, kc, dot_dtype, trans_b=True)  # [R, P]
            part = qs[:, None] * dot + qm[:, None] * kappa[None, :]
            q_mu = jnp.sum(qb[p] * mu[None, :], axis=1)  # [R]
            logits, qmu = (part, q_mu) if p == 0 else (logits + part, qmu + q_mu)
        logits = logits + qmu[:, None]  # [R, P]

        if masked:
            key_pos = ns + k * P + jax.lax.broadcasted_iota(jnp.int32, (P,), 0)
            vis = key_pos[None, :] <= pos[:, None]  # [R, P]
            mb = jnp.max(jnp.where(vis, logits, -jnp.inf), axis=1)  # [R]
            valid = mb > -jnp.inf
            w = jnp.where(vis, jnp.exp(logits - jnp.where(valid, mb, 0.0)[:, None]), 0.0)
        else:
            mb = jnp.max(logits, axis=1)
            valid = jnp.ones((R,), jnp.bool_)
            w = jnp.exp(logits - mb[:, None])  # [R, P]
        lb = jnp.sum(w, axis=1)

        # o_c = s'_p sum_j wc_jp v_jc + m'_p omega_c + sum_j W_j nu_jp, c in p
        # merge_state's arithmetic, each accumulator merged as soon as its part exists (fewer live tiles)
        m_new, l_new, alpha, beta = common.merge_weights(m, l, mb, lb, valid)
        outs = []
        for p in range(NP):
            ch = pl.ds(p * Pc, Pc)
            vc = plane(v_codes_ref[pid, h, ch, code_rows], shift)  # [Pc, P] (token-major)
            if meta_tiles:
                tau, nu = taus[p], nus[p]
            else:
                tau = v_scale_ref[pid, h, tokens, p].astype(jnp.float32)  # [P]
                nu = v_min_ref[pid, h, tokens, p].astype(jnp.float32)  # [P]
            omega = _u_to_f32(v_sums_ref[pid, h, slot, ch])  # [Pc]
            wc, ws, wm = quantize(w * tau[None, :])  # [R, P], [R], [R]
            pv = common.int_dot(wc, vc, dot_dtype, trans_b=True)  # [R, Pc]
            o_p = ws[:, None] * pv + wm[:, None] * omega[None, :] + jnp.sum(w * nu[None, :], axis=1)[:, None]
            outs.append(common.merge_acc(accs[p], o_p, alpha, beta, valid))
        return m_new, l_new, tuple(outs)

    state = sink_state(q, sink_refs, b, h, kv_len, pos) if ns else empty_state(R, Pc, NP)
    state = jax.lax.fori_loop(0, n_full, functools.partial(block, False), state)
    state = jax.lax.fori_loop(n_full, nk, functools.partial(block, True), state)
    open_lo = ns + num_sealed * P  # position of the open block's first token
    state = jax.lax.cond((num_open > 0) & (hi >= jnp.maximum(open_lo, lo)),
                         lambda s: open_block_state(q, open_k_ref, open_v_ref, b, h, open_lo, num_open,
                                                    pos, s),
                         lambda s: s, state)

    m, l, accs = state
    ok = (pos < kv_len) & (l != 0)  # != 0: a NaN l stays NaN
    denom = jnp.where(ok, l, 1.0)[:, None]
    for p in range(NP):
        out = jnp.where(ok[:, None], accs[p] / denom, 0.0)  # [R, Pc]
        o_ref[:, :, pl.ds(p * Pc, Pc)] = out.reshape(block_q, group_pad, Pc)


_ROUND_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: in [2**23, 2**24) the float32 ulp is 1


def quantize_rows_int8_fast(x, op_dtype, *, interpret: bool):
    """INT8 per row of f32[R, n] as dot operands (codes, s [R], mf [R]): the reference quantizer's
    scale and folded minimum (common.quantize_rows_int8: s = (hi/2 - lo/2) * (2/255), mf = lo + 128 s),
    codes round((x - mf) * (1/s)) with one reciprocal per row instead of a division per element.

    GPU: the rounding is done by the FFMA itself, u = (x - mf) * r + 1.5 * 2**23 (exact product, one
    rounding to a float whose ulp is 1 = round half to even of the code, |code| <= 128.5 < 2**22), then
    the clip to [M - 128, M + 127] and either u - M (bf16 operands: exact) or, for int8 operands, the low
    byte of u's bits (M's low byte is 0, so it is the code's two's complement: no float-to-int convert).
    Per element: sub, fma, min, max (+ sub for bf16) instead of sub, mul, add, sub, min, max (+ cvt).
    (Both clips stay: they only bind where x - mf loses bits to cancellation, e.g. a near-constant row
    far from 0, and there they must, as in the reference.) Interpret mode: the same reciprocal product,
    rounded by lax.round (XLA folds the magic-number trick away).
    Codes differ from the reference's (which divides) only where x / s is within float32 rounding of
    a half-integer (the GPU's float32 division is approximate anyway: module docstring)."""
    lo = jnp.min(x, axis=1)
    hi = jnp.max(x, axis=1)
    raw = (0.5 * hi - 0.5 * lo) * np.float32(2.0 / 255)
    s = jnp.where(hi > lo, jnp.maximum(raw, jnp.finfo(jnp.float32).tiny), 0.0)
    mf = lo + 128.0 * s
    r = 1.0 / jnp.where(s > 0, s, 1.0)  # [R]
    d = x - mf[:, None]
    if interpret:
        c = jnp.clip(jax.lax.round(d * r[:, None], jax.lax.RoundingMethod.TO_NEAREST_EVEN), -128.0, 127.0)
        return c.astype(op_dtype), s, mf
    u = jnp.clip(d * r[:, None] + _ROUND_MAGIC, _ROUND_MAGIC - np.float32(128), _ROUND_MAGIC + np.float32(127))
    if op_dtype == jnp.int8:
        return jax.lax.bitcast_convert_type(u, jnp.int32).astype(jnp.int8), s, mf
    return (u - _ROUND_MAGIC).astype(op_dtype), s, mf


def plane_asm(tile_u8, shift, op_dtype):
    """Plane `shift // 2` of a packed u8 code tile as dot operands by inline PTX on 4 bytes per 32-bit
    register (GPU only), with a dynamic (traced i32) shift: `t = (word >> shift) & 0x03030303` (the
    shift moves other bytes' bits only into bits 2..7, which the mask drops), then
      int8: t itself (4 codes);
      bf16: two PRMTs put 0x43 above each code byte (bf16 0x43cc = 128 + c, exact) and one
        bf16x2 FMA per pair subtracts 128 (exact): no integer-to-float converts (I2F.BF16 runs at a
        quarter of the ALU rate; it was ~180 of the loop's instructions per warp and block).
    2 + 1.5 instructions per 4 codes (bf16) instead of ~6 per code."""
    shifts = jnp.broadcast_to(jnp.asarray(shift, jnp.int32), tile_u8.shape)
    if op_dtype == jnp.int8:
        [out] = pltriton.elementwise_inline_asm(
            "{ .reg .b32 t; shr.b32 t, $1, $2; and.b32 $0, t, 0x03030303; }", args=[tile_u8, shifts],
            constraints="=r,r,r,r,r,r", pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(tile_u8.shape, jnp.int8)])
        return out
    [out] = pltriton.elementwise_inline_asm(
        "{ .reg .b32 t, hi, one, off; shr.b32 t, $2, $3; and.b32 t, t, 0x03030303; mov.b32 hi, 0x43434343; "
        "mov.b32 one, 0x3F803F80; mov.b32 off, 0xC300C300; "
        "prmt.b32 $0, t, hi, 0x5140; prmt.b32 $1, t, hi, 0x7362; "
        "fma.rn.bf16x2 $0, $0, one, off; fma.rn.bf16x2 $1, $1, one, off; }",
        args=[tile_u8, shifts], constraints="=r,=r,r,r,r,r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(tile_u8.shape, jnp.bfloat16)])
    return out


def _u_to_f32(x):
    """Unsigned code sums (u8 / u16, < 2**16) to float32 without an integer-to-float convert (I2F.U16
    runs at a quarter of the ALU rate): the bits 0x4B000000 | x are the float 2**23 + x; minus 2**23
    is exact. Two full-rate ALU instructions."""
    bits = x.astype(jnp.uint32) | jnp.uint32(0x4B000000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - np.float32(8388608.0)


def _div(x, n: int):
    """x // n for a static n > 0 and x >= 0 (or any x when n is a power of two: a shift, floor
    semantics). Not jnp's // and %: inside a fori_loop with a weakly typed index, jnp.remainder's
    zero-divisor select fails to lower in Pallas-Triton ("AssertionError: ('i32', 'i1')")."""
    if n & (n - 1) == 0:
        return x >> (n.bit_length() - 1)
    return jax.lax.div(x, jnp.asarray(n, jnp.int32))


def _mod(x, n: int):
    """x % n for a static n > 0 and x >= 0."""
    if n & (n - 1) == 0:
        return x & (n - 1)
    return jax.lax.rem(x, jnp.asarray(n, jnp.int32))


def empty_state(rows, width, num_groups):
    """(m, l, accs) of no keys: -inf, 0, num_groups x zeros[rows, width]."""
    return (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(num_groups)))


def sink_state(q, sink_refs, b, h, kv_len, pos):
    """Float32 attention over the sinks (one per token, elementwise: ns is small and not a dot
    size), as the state of the first segment. q: NP x f32[R, Pc]; sink_refs: (sink_k_ref,
    sink_v_ref) bf16[S, H, ns, D]; pos i32[R]. Rows that see no sink get the empty state; rows
    beyond the sequence's sinks are selected away (NaN-safe)."""
    sink_k_ref, sink_v_ref = sink_refs
    NP = len(q)
    Pc = q[0].shape[1]
    ns = sink_k_ref.shape[2]
    logits, vis, values = [], [], []
    for t in range(ns):
        held = t < kv_len
        k_t = [jnp.where(held, sink_k_ref[b, h, t, pl.ds(p * Pc, Pc)].astype(jnp.float32), 0.0)
               for p in range(NP)]  # NP x [Pc]
        values.append([jnp.where(held, sink_v_ref[b, h, t, pl.ds(p * Pc, Pc)].astype(jnp.float32), 0.0)
                       for p in range(NP)])
        logits.append(sum(jnp.sum(q[p] * k_t[p][None, :], axis=1) for p in range(NP)))  # [R]
        vis.append(held & (t <= pos))  # [R]
    m = functools.reduce(jnp.maximum, [jnp.where(v, x, -jnp.inf) for v, x in zip(vis, logits)])
    base = jnp.where(m > -jnp.inf, m, 0.0)
    w = [jnp.where(v, jnp.exp(x - base), 0.0) for v, x in zip(vis, logits)]  # ns x [R]
    accs = tuple(sum(w_t[:, None] * v_t[p][None, :] for w_t, v_t in zip(w, values)) for p in range(NP))
    return m, sum(w), accs


def open_block_state(q, open_k_ref, open_v_ref, b, h, open_lo, num_open, pos, state):
    """Merges float32 attention over the open block's num_open tokens (positions open_lo + i,
    16-bit K/V) into `state`. Rows beyond num_open (stale, possibly NaN) are zeroed before the dots
    (`common.f32_bf16_dot`: float32 accuracy on bf16 tensor cores)."""
    m, l, accs = state
    NP = len(q)
    Pc = q[0].shape[1]
    P = open_k_ref.shape[2]
    i = jax.lax.broadcasted_iota(jnp.int32, (P,), 0)
    held = i < num_open  # [P]
    vis = held[None, :] & (open_lo + i[None, :] <= pos[:, None])  # [R, P]
    zero = jnp.zeros((), jnp.bfloat16)
    rows = lambda ref, p: jnp.where(held[:, None], ref[b, h, :, pl.ds(p * Pc, Pc)].astype(jnp.bfloat16),
                                    zero)  # bf16[P, Pc]
    logits = sum(common.f32_bf16_dot(q[p], rows(open_k_ref, p), trans_b=True) for p in range(NP))
    mb = jnp.max(jnp.where(vis, logits, -jnp.inf), axis=1)  # [R]
    valid = mb > -jnp.inf
    w = jnp.where(vis, jnp.exp(logits - jnp.where(valid, mb, 0.0)[:, None]), 0.0)  # [R, P]
    outs = tuple(common.f32_bf16_dot(w, rows(open_v_ref, p)) for p in range(NP))  # NP x [R, Pc]
    return common.merge_state(m, l, accs, mb, jnp.sum(w, axis=1), outs, valid)


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch choices. block_q: query positions per program (rows = block_q * G_pad, a power of
    two >= 16 for the dots); dot_dtype: operand type of the integer dots.
    GPU-only arithmetic (interpret mode runs the same math through jnp; bench/NOTES_prefill.md v2):
      fast_quant: INT8 transients as `quantize_rows_int8_fast` (one reciprocal per row, the FFMA
        rounds, int8 codes from the float's low byte: no division, no float-to-int convert);
        False: common.quantize_rows_int8 (v1's arithmetic).
      unpack_asm: the block's 2-bit plane by inline PTX on 4 codes per register (`plane_asm`: no
        I2F converts); False: jnp shifts and converts per code.
      q_reload: q re-read (from L1/L2, pipelined into shared memory) per block instead of held in
        registers for the whole loop: half the register spills, +4% instructions.
    meta_tiles: a block's per-token metadata (kappa, tau, nu) of all channel groups loaded as [P, NP]
      tiles and split in registers (Triton then pipelines them into shared memory; per-group strided
      vectors were ~100 exposed global loads per warp and block); False: one strided vector each."""

    block_q: int = 16
    num_warps: int = 4
    num_stages: int = 2
    dot_dtype: Literal["bf16", "int8"] = "bf16"
    fast_quant: bool = True
    unpack_asm: bool = True
    q_reload: bool = False
    meta_tiles: bool = True


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def group_pad(group: int) -> int:
    """Query heads per kv head rounded up to a power of two (rows are positions x padded heads)."""
    return _next_pow2(group)


def default_config(*, num_q_heads: int, num_kv_heads: int, q_len: int, dot_dtype: str = "bf16",
                   rows: int = 64) -> KernelConfig:
    """`rows` query rows per program (64: Hopper's wgmma wants M % 64 == 0; the q tile, the
    accumulator and the [rows, P] logits stay in registers at 4 warps), fewer for short prompts
    but at least 16 (the dots' M); 4 warps, 2 stages (the page loads of the next block overlap)."""
    pad = group_pad(num_q_heads // num_kv_heads)
    block_q = max(1, min(rows // pad, _next_pow2(q_len)), 16 // pad)
    return KernelConfig(block_q=block_q, num_warps=4, num_stages=2, dot_dtype=dot_dtype)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


def _full_spec(x):
    # The whole array is one block: on Triton a pointer base, so whole page pools cost nothing (in
    # interpret mode every program copies them: keep CPU test pools tiny).
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


@functools.partial(jax.jit, static_argnames=("partition_size", "num_sink_tokens", "config", "interpret"))
def _hack_prefill(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                  sink_k, sink_v, page_indices, kv_lens, q_start, *, partition_size, num_sink_tokens,
                  config, interpret):
    batch, q_len, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, _, _ = k_codes.shape
    page_size, num_groups = k_sums.shape[2], k_sums.shape[3]
    group = num_q_heads // num_kv_heads
    pad = group_pad(group)
    block_q = config.block_q
    tiles = -(-q_len // block_q)
    qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    if tiles * block_q != q_len or pad != group:
        qg = jnp.pad(qg, ((0, 0), (0, tiles * block_q - q_len), (0, 0), (0, pad - group), (0, 0)))

    inputs = [kv_lens, q_start, page_indices, qg, k_codes, k_scale, k_min, k_sums, v_codes, v_scale,
              v_min, v_sums, open_k, open_v] + ([sink_k, sink_v] if num_sink_tokens else [])
    tile_spec = pl.BlockSpec((None, block_q, None, pad, head_dim),
                             lambda b, h, i: (b, tiles - 1 - i, h, 0, 0))
    in_specs = [_full_spec(x) for x in inputs]
    in_specs[3] = tile_spec
    kernel = functools.partial(
        _hack_prefill_kernel, partition_size=partition_size, num_groups=num_groups, group_pad=pad,
        block_q=block_q, num_q_tiles=tiles, num_sink_tokens=num_sink_tokens, num_pages=num_pages,
        max_blocks=page_indices.shape[1] * (page_size // partition_size), dot_dtype=config.dot_dtype,
        fast_quant=config.fast_quant, unpack_asm=config.unpack_asm, q_reload=config.q_reload,
        meta_tiles=config.meta_tiles, interpret=interpret)
    out = common.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(qg.shape, jnp.float32),
        grid=(batch, num_kv_heads, tiles), in_specs=in_specs, out_specs=tile_spec,
        num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret,
        name="hack_prefill_attention")(*inputs)
    return out[:, :q_len, :, :group].reshape(batch, q_len, num_q_heads, head_dim)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def validate_inputs(q, layer, page_indices, kv_lens, q_start, config):
    """Trace-time checks of shapes and dtypes against DESIGN.md's kivi layout (ValueError; the
    layer's type is checked by the caller); a concrete q_start is also checked to be >= 0."""
    P, ns = layer.config.partition_size, layer.config.num_sink_tokens
    if q.ndim != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, T, num_q_heads, head_dim], got {q.shape=}, {q.dtype=}")
    batch, _, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, quarter, d = layer.k_codes.shape
    page_size = 4 * quarter
    if d != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q does not match the cache (num_kv_heads={num_kv_heads}, head_dim={d}): {q.shape=}")
    common.check_kivi_geometry(P, head_dim, page_size)
    common.check_channel_group(layer.config.v_group or None)
    Pc = min(layer.config.channel_group, head_dim)
    NP, bpp = head_dim // Pc, page_size // P
    expect = {
        "k_codes": (num_pages, num_kv_heads, page_size // 4, head_dim),
        "v_codes": (num_pages, num_kv_heads, head_dim, page_size // 4),  # token-major
        "k_scale": (num_pages, num_kv_heads, bpp, head_dim), "k_min": (num_pages, num_kv_heads, bpp, head_dim),
        "k_sums": (num_pages, num_kv_heads, page_size, NP),
        "v_scale": (num_pages, num_kv_heads, page_size, NP), "v_min": (num_pages, num_kv_heads, page_size, NP),
        "v_sums": (num_pages, num_kv_heads, bpp, head_dim),
        "open_k": (batch, num_kv_heads, P, head_dim), "open_v": (batch, num_kv_heads, P, head_dim),
        "sink_k": (batch, num_kv_heads, ns, head_dim), "sink_v": (batch, num_kv_heads, ns, head_dim),
    }
    for name, shape in expect.items():
        x = getattr(layer, name)
        if tuple(x.shape) != shape:
            raise ValueError(f"layer.{name} must have shape {shape} (DESIGN.md kivi layout), got {x.shape}")
        if name.endswith("codes") and x.dtype != jnp.uint8:
            raise ValueError(f"layer.{name} must be uint8, got {x.dtype}")
    if page_indices.ndim != 2 or page_indices.shape[0] != batch or page_indices.dtype != jnp.int32:
        raise ValueError(f"page_indices must be i32[{batch}, pages_per_seq], got {page_indices.shape=}, "
                         f"{page_indices.dtype=}")
    for name, x in (("kv_lens", kv_lens), ("q_start", q_start)):
        if x.shape != (batch,) or x.dtype != jnp.int32:
            raise ValueError(f"{name} must be i32[{batch}], got {x.shape=}, {x.dtype=}")
    if not isinstance(q_start, jax.core.Tracer) and q_start.size and int(np.min(np.asarray(q_start))) < 0:
        raise ValueError(f"q_start must be >= 0, got {np.asarray(q_start).tolist()}")
    if config.dot_dtype not in DOT_DTYPES:
        raise ValueError(f"dot_dtype must be one of {DOT_DTYPES}, got {config.dot_dtype=}")
    pad = group_pad(num_q_heads // num_kv_heads)
    if not common.is_pow2(config.block_q) or config.block_q * pad < 16:
        raise ValueError(f"block_q must be a power of two with block_q * G_pad >= 16 (the dots' M), "
                         f"got {config.block_q=}, G_pad={pad}")


@common.quiet
def hack_prefill_attention(q, layer, page_indices, kv_lens, *, q_start=None, dot_dtype: str = "bf16",
                           config: KernelConfig | None = None, interpret: bool = False):
    """HACK causal prefill attention over the paged INT2 kivi cache (module docstring; shapes there).

    Called by hack_jax.attention.prefill_attention(..., impl="pallas") as
    fn(q, layer, page_indices, kv_lens, q_start=..., **kernel_options).

    Args:
      q: float[batch, T, num_q_heads, head_dim]; row t is the query at position q_start + t.
      layer: the kivi cache layer (hack_jax.kv_cache.KiviPages) holding the sequences, this prompt
        included (write_prefill first).
      page_indices: i32[batch, pages_per_seq]; kv_lens: i32[batch] tokens held.
      q_start: i32[batch] position of query row 0; None = 0.
      dot_dtype: "bf16" | "int8" operands of the integer dots (ignored if config is given).
      config: KernelConfig; None picks default_config(...).
      interpret: run the kernel in Pallas interpret mode (CPU tests).

    Returns:
      f32[batch, T, num_q_heads, head_dim]; rows with q_start + t >= kv_lens are 0.

    Raises:
      ValueError: shapes/dtypes off the layout, unsupported sizes, a negative q_start (when
        concrete), bad dot_dtype or block_q.
    """
    if not all(hasattr(layer, f) for f in LAYER_FIELDS) or not hasattr(layer, "config"):
        raise ValueError(f"layer must be a kivi-layout hack cache layer (hack_jax.kv_cache.KiviPages), "
                         f"got {type(layer).__name__}")
    q = jnp.asarray(q)
    page_indices = jnp.asarray(page_indices)
    kv_lens = jnp.asarray(kv_lens)
    q_start = jnp.zeros_like(kv_lens) if q_start is None else jnp.asarray(q_start)
    if config is None:
        if dot_dtype not in DOT_DTYPES:
            raise ValueError(f"dot_dtype must be one of {DOT_DTYPES}, got {dot_dtype=}")
        config = default_config(num_q_heads=q.shape[2], num_kv_heads=layer.k_codes.shape[1],
                                q_len=q.shape[1], dot_dtype=dot_dtype)
    validate_inputs(q, layer, page_indices, kv_lens, q_start, config)
    ns = layer.config.num_sink_tokens
    return _hack_prefill(q, *(getattr(layer, f) for f in LAYER_FIELDS), page_indices, kv_lens, q_start,
                         partition_size=layer.config.partition_size, num_sink_tokens=ns, config=config,
                         interpret=interpret)
