"""HACK prefill attention on the paged INT2 (or 4-bit) cache (kivi layout), one Pallas kernel lowered to Triton.

Computes, for every sequence s, query row t (position q_start[s] + t) and query head h (kv head
h // q_per_kv), causal attention softmax(q K^T / sqrt(head_dim)) V over the keys at positions
<= q_start[s] + t (and < kv_lens[s]), exactly as docs/DESIGN.md "Homomorphic attention semantics"
(layout="kivi") defines it on the 2-bit (or 4-bit) codes: nothing is dequantized. Per (query tile, sealed
block b): Q*sigma_b quantized INT8 per (row, channel group); QK^T as an integer dot on the K codes
plus the K code sums and q.mu_b terms; block-local softmax weights W (masked keys out of the max,
W = 0 for them); W*tau quantized INT8 per (row, channel group) over the block; PV as an integer dot
on the V codes plus the V code sums and W.nu terms; one online-softmax merge. Sinks and the 16-bit
open block in float32. The K/V were quantized once by hack_jax.kv_cache.write_prefill: prefill and
decode read the same codes.

Reference twin: hack_jax.attention.prefill_attention(..., impl="reference") (per block:
hack_jax.reference.kivi_block_attention_step); prefix mode: attention.cached_prefix_state(...,
impl="reference"). Both repeat the INT8 modes' arithmetic; tests/test_prefill_kernels.py also checks
every mode against an independent float64 NumPy twin (the folded modes: within 2x the error of the
same math done naively with the 16-bit rounding, as the decode kernel's folded modes). hack_jax.attention is the caller that unpacks a cache
layer into these arrays.

Shapes and dtypes (P = partition_size, Pc = min(v_group or P, head_dim), NP = num_channel_groups =
head_dim // Pc, bpp = page_size // P blocks per page, S = batch, H = num_kv_heads, ns =
num_sink_tokens; DESIGN.md "Paged cache layout"), shown for 2-bit codes; with bits = 4 (QuantConfig.bits)
the code arrays hold page_size // 2 rows / columns (packing groups of 2 blocks, one nibble plane each):
  q          float[S, T, num_q_heads, head_dim]          -> out f32[S, T, num_q_heads, head_dim]
  k_codes    u8[num_pages, H, page_size // 4, head_dim]   (planar per packing group of 4 blocks)
  k_scale, k_min  f16[num_pages, H, bpp, head_dim]
  k_sums     u8|u16[num_pages, H, page_size, NP]          (None: a cache without code sums, folded modes)
  v_codes    u8[num_pages, H, head_dim, page_size // 4]   (token-major: the same packing, transposed)
  v_scale, v_min  f16[num_pages, H, page_size, NP]
  v_sums     u8|u16[num_pages, H, bpp, head_dim]          (None as k_sums)
  open_k, open_v  bf16[S, H, P, head_dim];  sink_k, sink_v  bf16[S, H, ns, head_dim] (None if ns = 0)
  page_indices i32[S, pages_per_seq];  kv_lens i32[S] tokens held, this prompt (chunk) included
  q_start    i32[S] position of query row 0 (0: a whole prompt; > 0: a chunk after a cached prefix);
             rows at or past kv_lens return 0.
Supported: partition_size and head_dim powers of two >= 32, page_size a multiple of (8 // bits) * partition_size,
v_group None or a power of two >= 32, any GQA ratio (q_per_kv padded to a power of two), any T.

Structure. Grid (S, H, query tiles), the heaviest (last) tiles first. A program holds block_q query
positions of all q_per_kv query heads of one kv head: R = block_q * q_per_kv_pad rows (r = t *
q_per_kv_pad + g: GQA folded into the dot's M, so each K/V block is read once for all its query
heads), q / sqrt(head_dim) held in registers as NP [R, Pc] float32 tiles. It walks the sealed blocks
the tile can see, first those every row sees whole (no mask), then the diagonal ones (causal mask).
Per block and channel group: the block's plane of the packed [P, Pc] K and [Pc, P] V code tiles
(plane = the block's slot in its packing group, a traced shift of 2 or 4 bits: `common.dynamic_plane`), the
per-token metadata (kappa, tau, nu) of all channel groups as [P, NP] tiles split in registers (Triton
pipelines them into shared memory), two integer dots, the INT8 quantizations
(`common.quantize_rows_int8_ffma`) and the corrections, one merge. Sinks (elementwise: ns is no dot
size) before, the open block (float32 through `common.f32_bf16_dot`, 3 bf16 MMAs) after, in the
reference's order. On the GPU the code planes are unpacked by inline PTX and the INT8 codes rounded
by the FFMA itself; interpret mode computes the same values with jnp.

Dot operands (`dot_dtype`): "bf16" (default: bf16 operands holding the integer codes, float32
accumulation, exact while partial sums stay below 2**24) or "int8" (int8 x int8 -> int32, the method
as written); or the scale-folded modes of the decode kernel, "folded_f16" / "folded_bf16": the same
codes as exact 16-bit operands against Q*sigma_b and W*tau rounded to f16 / bf16 (no requantization,
no row min/max, the code sums unread; f16's range caveat as in decode_attention). fp8 e4m3 is not
offered: it holds the 2-bit codes but not every INT8 code (17 -> 16, 127 -> 128), so an e4m3 dot
would not be exact.

Prefix mode (`prefix=True`, the cached-prefix half of a chunked prefill, hack_jax.prefill): every
query row sits after the kv_lens cached tokens and sees all of them (no diagonal blocks); the kernel
also returns each row's log-sum-exp, so the caller merges it with the chunk's own flash attention.
Default operands there: PREFIX_DOT_DTYPE ("folded_f16", what a model's decode steps use), measured
2x faster than the INT8 modes and ~3.8x cuDNN's time for the same unmasked attention.

Measured on one NVIDIA H200 (jax 0.11.2, Triton 3.6; bench/NOTES_prefill.md, bench/results/
prefill_attention.md): the gpu tests pass; at Llama-3.1-8B heads (32 q / 8 kv, head_dim 128, P 64)
it takes about 7x cuDNN flash attention's time, issue-bound on the per-block INT8 requantization; the
"bf16" dots measured faster than "int8". A model's prefill therefore does not use it by default:
hack_jax.prefill attends the prompt exactly on its 16-bit K/V and this kernel is the
`attention="homomorphic"` option, which is not causal within a block (a query sees its own block's
codes, whose min/max include later tokens; hack_jax.prefill).

Caveats: transient INT8 codes can differ from the reference's by one where float32 evaluation order
(or the GPU's float32 reciprocal and exp) moves a value across a rounding tie (the tests bound the
effect); page ids outside [0, num_pages) read page 0; kv_lens beyond the capacity are clipped to it
(as hack_jax.kv_cache.read_blocks does); in interpret mode every program copies the whole page pools
(keep CPU test pools small).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import common

DotDtype = Literal["bf16", "int8", "folded_f16", "folded_bf16"]
DOT_DTYPES = get_args(DotDtype)
FOLDED = ("folded_f16", "folded_bf16")  # scale-folded operands: no INT8 requantization (module docstring)
OPERAND_DTYPES = {"bf16": jnp.bfloat16, "int8": jnp.int8, "folded_f16": jnp.float16, "folded_bf16": jnp.bfloat16}
PREFIX_DOT_DTYPE = "folded_f16"  # prefix=True's default: the model's decode numerics (backend.DECODE_DOT_DTYPE)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


def _hack_prefill_kernel(kv_lens_ref, q_start_ref, page_indices_ref, q_ref, k_codes_ref, k_scale_ref,
                         k_min_ref, k_sums_ref, v_codes_ref, v_scale_ref, v_min_ref, v_sums_ref,
                         open_k_ref, open_v_ref, *refs, partition_size, num_channel_groups, q_per_kv_pad,
                         block_q, num_q_tiles, num_sink_tokens, num_pages, max_blocks, dot_dtype, interpret,
                         prefix, bits):
    # kv_lens_ref, q_start_ref  i32[S]
    # page_indices_ref  i32[S, pages_per_seq]
    # q_ref             float[block_q, q_per_kv_pad, D]   this tile: positions x the kv head's query heads
    # k_codes_ref       u8[N, H, page_size // C, D]   C = 8 // bits blocks (planes) per packing group
    # k_scale_ref, k_min_ref  f16[N, H, bpp, D]
    # k_sums_ref        u8|u16[N, H, page_size, NP]   (k_sums_ref, v_sums_ref: None without code sums; the
    #                   folded modes never read them)
    # v_codes_ref       u8[N, H, D, page_size // C]   (token-major)
    # v_scale_ref, v_min_ref  f16[N, H, page_size, NP]
    # v_sums_ref        u8|u16[N, H, bpp, D]
    # open_k_ref, open_v_ref  bf16[S, H, P, D]
    # refs = (sink_k_ref, sink_v_ref  bf16[S, H, ns, D],) if ns else ()
    #        + (o_ref f32[block_q, q_per_kv_pad, D],) + (lse_ref f32[block_q, q_per_kv_pad],) if prefix
    ns, P, NP = num_sink_tokens, partition_size, num_channel_groups
    *sink_refs, o_ref, lse_ref = refs if prefix else refs + (None,)
    b, h = pl.program_id(0), pl.program_id(1)
    tile = num_q_tiles - 1 - pl.program_id(2)  # the longest rows first (causal load balance)
    D = q_ref.shape[-1]
    Pc = D // NP
    R = block_q * q_per_kv_pad
    bpp = k_scale_ref.shape[2]
    op_dtype = OPERAND_DTYPES[dot_dtype]
    folded = dot_dtype in FOLDED
    C = common.num_planes(bits)  # blocks per packing group
    asm = not interpret  # inline PTX has no interpret-mode rule; the jnp forms give the same values

    kv_len = jnp.clip(kv_lens_ref[b], 0, ns + max_blocks * P)  # beyond the capacity: clipped
    if prefix:  # every row sits after the kv_len cached tokens: all of them visible, no diagonal block
        lo = hi = kv_len - 1
        pos = jnp.full((R,), kv_len - 1, jnp.int32)
    else:
        lo = q_start_ref[b] + tile * block_q  # position of the tile's first row
        hi = jnp.minimum(lo + block_q, kv_len) - 1  # last position of a valid row (< lo: none)
        pos = lo + _div(jax.lax.broadcasted_iota(jnp.int32, (R,), 0), q_per_kv_pad)  # [R]
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
    quantize = functools.partial(common.quantize_rows_int8_ffma, dtype=op_dtype, interpret=interpret)

    def block(masked, k, state):
        """Sealed block k of this sequence (DESIGN.md steps 1-4)."""
        m, l, accs = state
        pid = page_indices_ref[b, _div(k, bpp)]
        pid = jnp.where((pid >= 0) & (pid < num_pages), pid, 0)
        slot = _mod(k, bpp)
        code_rows = pl.ds(_div(slot, C) * P, P)  # the packing group's K code rows / V columns
        shift = bits * _mod(slot, C)  # i32: the block's plane in its packing group
        tokens = pl.ds(slot * P, P)
        plane = lambda tile_u8: common.dynamic_plane(tile_u8, shift, op_dtype, asm=asm, bits=bits)

        # the per-token metadata of all channel groups as [P, NP] tiles, split in registers
        cols = lambda ref, f: [f(x.reshape(P)) for x in jnp.split(ref[pid, h, tokens, :], NP, axis=1)]
        kappas = None if folded else cols(k_sums_ref, _u_to_f32)  # NP x [P]
        taus = cols(v_scale_ref, lambda x: x.astype(jnp.float32))
        nus = cols(v_min_ref, lambda x: x.astype(jnp.float32))

        # logit_j = sum_p [ s_p sum_{c in p} qc_c k_jc + m_p kappa_jp ] + q . mu
        # (folded: sum_c r(q_c sigma_c) k_jc + q . mu, r() the rounding to the 16-bit operand)
        logits = qmu = None
        for p in range(NP):
            ch = pl.ds(p * Pc, Pc)
            kc = plane(k_codes_ref[pid, h, code_rows, ch])  # [P, Pc]
            sigma = k_scale_ref[pid, h, slot, ch].astype(jnp.float32)  # [Pc]
            mu = k_min_ref[pid, h, slot, ch].astype(jnp.float32)  # [Pc]
            if folded:
                part = jnp.dot((q[p] * sigma[None, :]).astype(op_dtype), kc.T, preferred_element_type=jnp.float32)
            else:
                qc, qs, qm = quantize(q[p] * sigma[None, :])  # [R, Pc], [R], [R]
                dot = common.int_dot(qc, kc, dot_dtype, trans_b=True)  # [R, P]
                part = qs[:, None] * dot + qm[:, None] * kappas[p][None, :]
            q_mu = jnp.sum(q[p] * mu[None, :], axis=1)  # [R]
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
        # (folded: sum_j r(W_j tau_jp) v_jc + sum_j W_j nu_jp)
        # merge_state's arithmetic, each accumulator merged as soon as its part exists (fewer live tiles)
        m_new, l_new, alpha, beta = common.merge_weights(m, l, mb, lb, valid)
        outs = []
        for p in range(NP):
            ch = pl.ds(p * Pc, Pc)
            vc = plane(v_codes_ref[pid, h, ch, code_rows])  # [Pc, P] (token-major)
            w_nu = jnp.sum(w * nus[p][None, :], axis=1)[:, None]
            if folded:
                o_p = jnp.dot((w * taus[p][None, :]).astype(op_dtype), vc.T,
                              preferred_element_type=jnp.float32) + w_nu
            else:
                omega = _u_to_f32(v_sums_ref[pid, h, slot, ch])  # [Pc]
                wc, ws, wm = quantize(w * taus[p][None, :])  # [R, P], [R], [R]
                pv = common.int_dot(wc, vc, dot_dtype, trans_b=True)  # [R, Pc]
                o_p = ws[:, None] * pv + wm[:, None] * omega[None, :] + w_nu
            outs.append(common.merge_acc(accs[p], o_p, alpha, beta, valid))
        return m_new, l_new, tuple(outs)

    state = sink_state(q, sink_refs, b, h, kv_len, pos) if ns else common.empty_state(R, Pc, NP)
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
        o_ref[:, :, pl.ds(p * Pc, Pc)] = out.reshape(block_q, q_per_kv_pad, Pc)
    if prefix:  # natural log-sum-exp of the row's logits; -inf where nothing is cached, NaN stays NaN
        lse = jnp.where(l != 0, m + jnp.log(jnp.where(l != 0, l, 1.0)), -jnp.inf)
        lse_ref[...] = lse.reshape(block_q, q_per_kv_pad)


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
    """Launch choices. block_q: query positions per program (rows = block_q * q_per_kv_pad, at least
    16 for the dots' M); num_warps, num_stages: Triton's; dot_dtype: the dots' operands (module
    docstring; of the INT8 modes "bf16" measured faster on the H200; "int8" is the method as written)."""

    block_q: int = 16
    num_warps: int = 4
    num_stages: int = 2
    dot_dtype: DotDtype = "bf16"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


q_per_kv_pad = common.q_per_kv_pad  # at_least=1: rows are positions x padded heads


def default_config(*, num_q_heads: int, num_kv_heads: int, q_len: int, dot_dtype: DotDtype = "bf16",
                   rows: int = 64) -> KernelConfig:
    """`rows` query rows per program (64: Hopper's wgmma wants M % 64 == 0; the q tile, the
    accumulators and the [rows, P] logits stay in registers at 4 warps), fewer for short prompts
    but at least 16 (the dots' M); 4 warps, 2 stages (the page loads of the next block overlap)."""
    pad = q_per_kv_pad(num_q_heads // num_kv_heads)
    block_q = max(1, min(rows // pad, _next_pow2(q_len)), 16 // pad)
    return KernelConfig(block_q=block_q, num_warps=4, num_stages=2, dot_dtype=dot_dtype)


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("partition_size", "num_sink_tokens", "config", "interpret",
                                             "prefix", "bits"))
def _hack_prefill(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                  sink_k, sink_v, page_indices, kv_lens, q_start, *, partition_size, num_sink_tokens,
                  config, interpret, prefix, bits):
    batch, q_len, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, _, _ = k_codes.shape
    page_size, num_channel_groups = v_scale.shape[2], v_scale.shape[3]  # [N, H, page_size, NP], as k_sums
    q_per_kv = num_q_heads // num_kv_heads
    pad = q_per_kv_pad(q_per_kv)
    block_q = config.block_q
    tiles = -(-q_len // block_q)
    qg = q.reshape(batch, q_len, num_kv_heads, q_per_kv, head_dim)
    if tiles * block_q != q_len or pad != q_per_kv:
        qg = jnp.pad(qg, ((0, 0), (0, tiles * block_q - q_len), (0, 0), (0, pad - q_per_kv), (0, 0)))

    # absent code sums (the folded modes on a cache without them): no operand, the kernel gets None
    inputs = [x for x in (kv_lens, q_start, page_indices, qg, k_codes, k_scale, k_min, k_sums, v_codes, v_scale,
                          v_min, v_sums, open_k, open_v) if x is not None]
    inputs += [sink_k, sink_v] if num_sink_tokens else []
    q_tile = pl.BlockSpec((None, block_q, None, pad, head_dim), lambda b, h, i: (b, tiles - 1 - i, h, 0, 0))
    in_specs = [common.full_spec(x) for x in inputs]  # page pools whole: on Triton a base pointer
    in_specs[3] = q_tile
    kernel = functools.partial(
        _hack_prefill_kernel, partition_size=partition_size, num_channel_groups=num_channel_groups,
        q_per_kv_pad=pad, block_q=block_q, num_q_tiles=tiles, num_sink_tokens=num_sink_tokens,
        num_pages=num_pages, max_blocks=page_indices.shape[1] * (page_size // partition_size),
        dot_dtype=config.dot_dtype, interpret=interpret, prefix=prefix, bits=bits)
    kernel = common.without_operand(kernel, 11, v_sums is not None)  # ref positions, the higher first
    kernel = common.without_operand(kernel, 7, k_sums is not None)
    out_shape, out_specs = jax.ShapeDtypeStruct(qg.shape, jnp.float32), q_tile
    if prefix:  # + the rows' log-sum-exp f32[batch, T_pad, H, pad]
        lse_tile = pl.BlockSpec((None, block_q, None, pad), lambda b, h, i: (b, tiles - 1 - i, h, 0))
        out_shape, out_specs = (out_shape, jax.ShapeDtypeStruct(qg.shape[:-1], jnp.float32)), (q_tile, lse_tile)
    got = common.pallas_call(
        kernel, out_shape=out_shape, grid=(batch, num_kv_heads, tiles), in_specs=in_specs, out_specs=out_specs,
        num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret,
        name="hack_prefix_attention" if prefix else "hack_prefill_attention")(*inputs)
    out = (got[0] if prefix else got)[:, :q_len, :, :q_per_kv].reshape(batch, q_len, num_q_heads, head_dim)
    if not prefix:
        return out
    return out, got[1][:, :q_len, :, :q_per_kv].reshape(batch, q_len, num_q_heads)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


@common.quiet
def hack_prefill_attention(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                           sink_k, sink_v, page_indices, kv_lens, *, partition_size: int, num_sink_tokens: int,
                           v_group: int | None = None, q_start=None, dot_dtype: DotDtype | None = None,
                           config: KernelConfig | None = None, interpret: bool = False, bits: int = 2,
                           prefix: bool = False):
    """HACK causal prefill attention over the paged INT2 (or 4-bit) kivi cache (module docstring; shapes there).
    With prefix=True: the cached-prefix half of a chunked prefill instead (every query row after the
    kv_lens cached tokens, all of them visible; returns the log-sum-exp too).

    The argument order of hack_decode_attention, plus q_start; hack_jax.attention.prefill_attention(...,
    impl="pallas") calls it with a kivi layer's arrays (attention.kernel_args).

    Args:
      q: float[batch, T, num_q_heads, head_dim]; row t is the query at position q_start + t.
      k_codes ... sink_v: the cache arrays of one layer, this prompt written (write_prefill first);
        sink_k / sink_v may be None when num_sink_tokens == 0; k_sums / v_sums may be None (a cache
        without code sums, QuantConfig.code_sums False) with a folded dot_dtype, which never reads them.
      page_indices: i32[batch, pages_per_seq]; kv_lens: i32[batch] tokens held (lists / NumPy arrays
        of ints accepted).
      partition_size: P (the quantization block). num_sink_tokens: ns.
      v_group: channels per V / query channel group (None: P), clamped to head_dim; the kernel reads
        it from v_scale's shape, this checks the arrays against it.
      q_start: i32[batch] position of query row 0; None = 0. Must be None with prefix=True.
      dot_dtype: "bf16" | "int8" (INT8 requantization of Q*sigma and W*tau, the paper's numerics, the
        codes as bf16 or int8 dot operands) | "folded_f16" | "folded_bf16" (Q*sigma and W*tau rounded
        to f16 / bf16 against the exact codes, as the decode kernel's folded modes); None: "bf16", or
        PREFIX_DOT_DTYPE with prefix=True or without code sums (ignored if config is given).
      config: KernelConfig; None picks default_config(...).
      interpret: run the kernel in Pallas interpret mode (CPU tests).
      bits: the cache's code width (QuantConfig.bits): 2 or 4.
      prefix: every row is a query after all kv_lens cached tokens (a chunk's queries over the tokens
        cached before it): no causal mask, no row beyond the sequence.

    Returns:
      f32[batch, T, num_q_heads, head_dim]; rows with q_start + t >= kv_lens are 0. With prefix=True:
      (out, lse f32[batch, T, num_q_heads]), lse = log sum_j exp(logit_j) over the cached tokens (-inf
      and out 0 where kv_lens is 0), for a log-sum-exp merge with the chunk's own attention.

    Raises:
      TypeError: a cache argument that is not an array (e.g. a whole cache layer).
      ValueError: shapes/dtypes off the layout, unsupported sizes, a negative q_start (when
        concrete), a bad dot_dtype, config or block_q; dot_dtype "bf16" / "int8" (the INT8 numerics, which
        read the code sums) without k_sums / v_sums.
    """
    page_indices, kv_lens, q_start = common.as_index_arrays(page_indices, kv_lens, q_start)
    if not hasattr(q, "shape"):
        raise TypeError(f"q must be an array, got {type(q).__name__}")
    if q.ndim != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, T, num_q_heads, head_dim], got {q.shape=}, {q.dtype=}")
    batch, q_len, num_q_heads, head_dim = q.shape
    q_row = jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), q.dtype)  # the per-token checks of decode
    common.check_kivi_inputs(q_row, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums,
                             open_k, open_v, sink_k, sink_v, page_indices, kv_lens,
                             partition_size=partition_size, num_sink_tokens=num_sink_tokens,
                             v_group=v_group, bits=bits)
    if prefix and q_start is not None:
        raise ValueError("q_start must be None with prefix=True (every row sits after the kv_lens cached tokens)")
    if dot_dtype is None:
        # without code sums the INT8 numerics cannot run: the folded operands are the default there
        dot_dtype = PREFIX_DOT_DTYPE if prefix or k_sums is None or v_sums is None else "bf16"
    if q_start is None:
        q_start = jnp.zeros_like(kv_lens)
    if q_start.shape != (batch,) or q_start.dtype != jnp.int32:
        raise ValueError(f"q_start must be i32[{batch}], got {q_start.shape=}, {q_start.dtype=}")
    if not isinstance(q_start, jax.core.Tracer) and q_start.size and int(np.min(np.asarray(q_start))) < 0:
        raise ValueError(f"q_start must be >= 0, got {np.asarray(q_start).tolist()}")
    config = resolve_config(num_q_heads=num_q_heads, num_kv_heads=k_codes.shape[1], q_len=q_len,
                            dot_dtype=dot_dtype, config=config)
    if config.dot_dtype not in FOLDED:
        common.require_code_sums("hack_prefill_attention", config.dot_dtype, k_sums, v_sums)
    if num_sink_tokens == 0:
        sink_k = sink_v = None
    return _hack_prefill(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                         sink_k, sink_v, page_indices, kv_lens, q_start, partition_size=partition_size,
                         num_sink_tokens=num_sink_tokens, config=config, interpret=interpret, prefix=bool(prefix),
                         bits=bits)


def resolve_config(*, num_q_heads: int, num_kv_heads: int, q_len: int, dot_dtype: DotDtype = "bf16",
                   config: KernelConfig | None = None) -> KernelConfig:
    """The KernelConfig to launch: `config`, or default_config(...) for dot_dtype; ValueError on a bad
    dot_dtype or config (block_q a power of two with block_q * q_per_kv_pad >= 16, the dots' M)."""
    if config is None:
        if dot_dtype not in DOT_DTYPES:
            raise ValueError(f"dot_dtype must be one of {DOT_DTYPES}, got {dot_dtype=}")
        config = default_config(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, q_len=q_len,
                                dot_dtype=dot_dtype)
    elif not isinstance(config, KernelConfig):
        raise ValueError(f"config must be a prefill_attention.KernelConfig, got {type(config).__name__}")
    if config.dot_dtype not in DOT_DTYPES:
        raise ValueError(f"config.dot_dtype must be one of {DOT_DTYPES}, got {config.dot_dtype=}")
    pad = q_per_kv_pad(num_q_heads // num_kv_heads)
    if not common.is_pow2(config.block_q) or config.block_q * pad < 16:
        raise ValueError(f"block_q must be a power of two with block_q * q_per_kv_pad >= 16 (the dots' M), "
                         f"got {config.block_q=}, q_per_kv_pad={pad}")
    if not common.is_pow2(config.num_warps) or not (isinstance(config.num_stages, int) and config.num_stages >= 1):
        raise ValueError(f"num_warps must be a power of two and num_stages an int >= 1, got {config=}")
    return config
