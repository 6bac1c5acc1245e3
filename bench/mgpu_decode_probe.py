"""Probe: the scale-folded HACK-2 decode (sealed blocks only) as a Pallas Mosaic GPU kernel (issue #16).

A benchmark-side prototype, not behind the library's dispatch. For one query token per sequence it
computes attention over the *sealed blocks* of a HACK-2 kivi cache (P = 64, page_size 256: one page =
one packing group = 4 blocks = 4 planes of one u8 tile), with the scale-folded math of
pallas_kernels/decode_attention.py ("folded_f16"):

  logits_j[t, g] = dot(r16(qs_g * sigma_j), K codes_j[t]) + qs_g . mu_j      (qs = q / sqrt(d))
  out[g, c]     += sum_t v_j[c, t] r16(W_j[t, g] tau_j[t, p(c)]) + sum_t W_j[t, g] nu_j[t, p(c)]

online softmax across pages, split-K over (batch, kv_head, splits) with a jnp log-sum-exp combine.
Sinks and the open block are left out (the probe measures the sealed-block stream, >99.8% of the
bytes at >= 32K tokens); the last page of a sequence may be partly sealed (planes masked).

Kernel (one warpgroup per CTA, Lane semantics, explicit layouts; bench/NOTES_mosaic.md has the
reasoning):
  * per page, TMA copies (STAGES-deep ring, one mbarrier per operand and slot) of the u8 K tile
    [64 tok, 128 ch] (swizzle 128), the u8 V tile [128 ch, 64 tok] (swizzle 64), k_scale / k_min
    [4, 128] and v_scale / v_min as [2, 256] (channel group-major: see LAYOUT NOTE below);
  * codes -> exact f16 by bit ops on u16 (the library's magic: plane j at bits 6..7 | 0x6400 reads as
    1024 + 64 code), in the WGMMA register layout, used as the wgmma A operand from registers;
  * QK, swapped: logits^T[64 tok, 8 heads (G=4 padded)] per plane j, all 4 planes in one [64, 32]
    accumulator: A = codes_j (regs), B = r16(qs * sigma_j) [8, 128] K-major in SMEM; the per-(j, g)
    constants (-1024 sum B and 64 qs . mu_j) are two more wgmmas whose A is a constant / a
    row-broadcast of mu_j, so no cross-thread channel reduction is needed;
  * one cross-warp max per page (256 tokens), l and the W.nu term kept as per-thread partial sums
    (reduced in the wrapper), PV swapped: out^T[128 ch, 8] += V codes_j (regs) @ r16(W_j tau_j)
    [64 tok, 8] (K-major in SMEM).

LAYOUT NOTE: v_scale / v_min are read as [N, H, NP, page_size] (channel group-major), transposed once
at setup (not timed); the cache stores [N, H, page_size, NP]. A writer can store them group-major at
no cost; reading the interleaved layout in-kernel needs a strided row load (open item).

Usage (GPU): python bench/mgpu_decode_probe.py --check --bench --out DIR
       (CPU):  python bench/mgpu_decode_probe.py --lower      # Mosaic lowering only, no run
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

P = 64  # partition size (tokens per block)
PAGE = 256  # page size: one packing group of 4 blocks
PLANES = 4
D = 128  # head_dim (Llama)
NP = 2  # channel groups of V metadata (Pc = 64)
GPAD = 8  # q heads per kv head, padded (wgmma N)
STAGES = 3
LOG2E = 1.4426950408889634
MAGIC = 0x6400  # f16 1024.0
TOP = 6  # code bits at 6..7 of the f16 mantissa: value 1024 + 64 * code
H200_SMS = 132


_INTERPRET = [False]  # GPU interpret mode (CPU check): SMEM without tiling/swizzle transforms


def _tx(tiling, swizzle):
    return () if _INTERPRET[0] else (plgpu.TilingTransform(tiling), plgpu.SwizzleTransform(swizzle))


def _smem_u8_tile(rows, cols):
    return plgpu.SMEM((STAGES, rows, cols), jnp.uint8, transforms=_tx((8, cols), cols))  # swizzle = row bytes


def _smem_b16(rows, cols):
    """K-major B operand buffer(s) [.., N=rows, K=cols] f16, tiling (8, 64), swizzle 128."""
    return plgpu.SMEM((rows, cols), jnp.float16, transforms=_tx((8, 64), 128))


def _plane(codes16, j):
    """Plane j of u16-widened code bytes as exact f16 1024 + 64 * code (WGMMA layout kept)."""
    shift = TOP - 2 * j
    x = codes16 << jnp.uint16(shift) if shift > 0 else codes16
    x = (x & jnp.uint16(3 << TOP)) | jnp.uint16(MAGIC)
    return lax.bitcast_convert_type(x, jnp.float16)


def _kernel(nblocks_ref, pt_ref, qf_ref, qh_ref, ql_ref, kc_ref, ks_ref, km_ref, vc_ref, vs_ref, vm_ref,
            o_ref, st_ref,
            kc_s, vc_s, ks_s, km_s, vs_s, vm_s, q_s, qh_s, ql_s, bq_s, bv_s, o_s, st_s, bars, qbar,
            *, num_splits, num_pages_pool):
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    s = lax.axis_index("s")
    nb = nblocks_ref[b]
    npages = (nb + PLANES - 1) // PLANES
    lo = s * npages // num_splits
    hi = (s + 1) * npages // num_splits
    srcs = (kc_ref, vc_ref, ks_ref, km_ref, vs_ref, vm_ref)
    dsts = (kc_s, vc_s, ks_s, km_s, vs_s, vm_s)

    def page_id(i):
        pid = pt_ref[b, i]
        return jnp.where((pid >= 0) & (pid < num_pages_pool), pid, 0)

    def issue(i, slot):
        pid = page_id(i)
        for k, (src, dst) in enumerate(zip(srcs, dsts)):
            plgpu.copy_gmem_to_smem(src.at[pid, h], dst.at[slot], bars.at[k * STAGES + slot])

    # constants: q (f32, for r16(qs * sigma)), 64 qs split hi/lo (f16, B of the qs . mu wgmma)
    plgpu.copy_gmem_to_smem(qf_ref.at[b, h], q_s, qbar.at[0])
    plgpu.copy_gmem_to_smem(qh_ref.at[b, h], qh_s, qbar.at[1])
    plgpu.copy_gmem_to_smem(ql_ref.at[b, h], ql_s, qbar.at[2])
    for st in range(STAGES):
        @pl.when(lo + st < hi)
        def _():
            issue(lo + st, st)
    for k in range(3):
        plgpu.barrier_wait(qbar.at[k])

    # q^T as [128 ch, 8 heads] in the transposed WGMMA layout (K-major store of B below)
    qT = plgpu.load(plgpu.transpose_ref(q_s, (1, 0)), (), layout=plgpu.Layout.WGMMA_TRANSPOSED)
    row_l = plgpu.Layout.WGMMA_TRANSPOSED.reduce(1)
    neg = plgpu.layout_cast(jnp.full((64, D), -1024.0, jnp.float16), plgpu.Layout.WGMMA)
    col8 = plgpu.Layout.WGMMA.reduce(0)
    row64 = plgpu.Layout.WGMMA.reduce(1)

    def body(i, carry):
        acc_o, m, lpart, c0, c1 = carry
        slot = lax.rem(i - lo, STAGES)
        for k in range(6):
            plgpu.barrier_wait(bars.at[k * STAGES + slot])
        # ---- B_j = r16(qs * sigma_j) -> bq_s[8j:8j+8, :] (K-major) and the A operands
        for j in range(PLANES):
            sig = plgpu.load(ks_s.at[slot, j], (), layout=row_l).astype(jnp.float32)
            bj = (qT * lax.broadcast_in_dim(sig, (D, GPAD), (0,))).astype(jnp.float16)
            plgpu.transpose_ref(bq_s.at[pl.ds(GPAD * j, GPAD)], (1, 0))[...] = bj
        k16 = plgpu.load(kc_s.at[slot], (), layout=plgpu.Layout.WGMMA).astype(jnp.uint16)
        v16 = plgpu.load(vc_s.at[slot], (), layout=plgpu.Layout.WGMMA).astype(jnp.uint16)
        mus = [lax.broadcast_in_dim(plgpu.load(km_s.at[slot, j], (), layout=col8), (64, D), (1,))
               for j in range(PLANES)]
        taus = [[plgpu.load(vs_s.at[slot, p, pl.ds(P * j, P)], (), layout=row64).astype(jnp.float32)
                 for p in range(NP)] for j in range(PLANES)]
        nus = [[plgpu.load(vm_s.at[slot, p, pl.ds(P * j, P)], (), layout=row64).astype(jnp.float32)
                for p in range(NP)] for j in range(PLANES)]
        plgpu.commit_smem()  # B stores visible to wgmma; every thread done reading the slot

        @pl.when(i + STAGES < hi)
        def _():
            issue(i + STAGES, slot)

        # ---- QK: acc[:, 8j:8j+8] = 64 * logits_j (sm_scale folded into q)
        def qk(acc_ref):
            for j in range(PLANES):
                a = acc_ref.at[:, pl.ds(GPAD * j, GPAD)]
                bj = plgpu.transpose_ref(bq_s.at[pl.ds(GPAD * j, GPAD)], (1, 0))
                plgpu.wgmma(a, _plane(k16, j), bj)
                plgpu.wgmma(a, neg, bj)
                plgpu.wgmma(a, mus[j], plgpu.transpose_ref(qh_s, (1, 0)))
                plgpu.wgmma(a, mus[j], plgpu.transpose_ref(ql_s, (1, 0)))
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        acc = pl.run_scoped(qk, plgpu.ACC((64, PLANES * GPAD), jnp.float32))
        sc = []
        for j in range(PLANES):
            x = acc[:, GPAD * j:GPAD * (j + 1)] * (LOG2E / 64.0)
            # a scalar bias, not jnp.where: jax 0.11's Mosaic GPU select_n refuses an implicit broadcast
            bias = jnp.where(PLANES * i + j < nb, jnp.float32(0.0), jnp.float32(-jnp.inf))
            sc.append(x + lax.broadcast_in_dim(bias, (64, GPAD), ()))
        mx = jnp.maximum(jnp.maximum(sc[0], sc[1]), jnp.maximum(sc[2], sc[3]))
        m_new = jnp.maximum(m, mx.max(axis=0))  # [8] the page's cross-warp max
        alpha = jnp.exp2(m - m_new)
        mb = lax.broadcast_in_dim(m_new, (64, GPAD), (1,))
        ab = lax.broadcast_in_dim(alpha, (64, GPAD), (1,))
        ws = [jnp.exp2(x - mb) for x in sc]
        lpart = lpart * ab + ((ws[0] + ws[1]) + (ws[2] + ws[3]))
        corr = [c0 * ab, c1 * ab]
        for j in range(PLANES):
            for p in range(NP):
                bvj = (ws[j] * lax.broadcast_in_dim(taus[j][p], (64, GPAD), (0,))).astype(jnp.float16)
                corr[p] = corr[p] + ws[j] * lax.broadcast_in_dim(nus[j][p], (64, GPAD), (0,)) \
                    - 16.0 * bvj.astype(jnp.float32)
                plgpu.transpose_ref(bv_s.at[pl.ds(GPAD * (NP * j + p), GPAD)], (1, 0))[...] = \
                    plgpu.layout_cast(bvj, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()

        # ---- PV: acc_o[64p:64p+64, :] += V codes_j[channels of p] @ bv_{j,p}  (64 * out^T)
        acc_o = acc_o * lax.broadcast_in_dim(alpha, (D, GPAD), (1,))

        def pv(acc_ref):
            for j in range(PLANES):
                vj = _plane(v16, j)
                for p in range(NP):
                    plgpu.wgmma(acc_ref.at[pl.ds(64 * p, 64)], vj[64 * p:64 * (p + 1)],
                                plgpu.transpose_ref(bv_s.at[pl.ds(GPAD * (NP * j + p), GPAD)], (1, 0)))
            plgpu.wgmma_wait(0)

        acc_o = pl.run_state(pv)(plgpu.ACC.init(acc_o))
        return acc_o, m_new, lpart, corr[0], corr[1]

    z = plgpu.layout_cast(jnp.zeros((64, GPAD), jnp.float32), plgpu.Layout.WGMMA)
    init = (plgpu.layout_cast(jnp.zeros((D, GPAD), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((GPAD,), -jnp.inf, jnp.float32), col8), z, z, z)
    acc_o, m, lpart, c0, c1 = lax.fori_loop(lo, hi, body, init)
    o_s[...] = acc_o * (1.0 / 64.0)
    st_s[0] = lax.broadcast_in_dim(m, (64, GPAD), (1,))
    st_s[1] = lpart
    st_s[2] = c0
    st_s[3] = c1
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, h, s])
    plgpu.copy_smem_to_gmem(st_s, st_ref.at[b, h, s])
    plgpu.wait_smem_to_gmem(0)


def probe_call(q, k_codes, k_scale, k_min, v_codes, vs_gm, vm_gm, page_indices, nblocks, *, num_splits,
               interpret=False):
    """q f32[B, Hq, D]; the cache arrays of one layer (vs_gm / vm_gm: v_scale / v_min as
    [N, H, NP, page_size]); nblocks i32[B] sealed blocks per sequence -> (out f32[B, Hq, D] normalized,
    lse state (m, l) f32[B, Hq] in log2 units)."""
    B, Hq, d = q.shape
    N, H = k_codes.shape[:2]
    G = Hq // H
    assert d == D and k_codes.shape[2:] == (PAGE // 4, D) and G <= GPAD
    qs = (q.astype(jnp.float32) / math.sqrt(d)).reshape(B, H, G, d)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, GPAD - G), (0, 0)))  # [B, H, 8, 128]
    q64 = qs * 64.0
    qh = q64.astype(jnp.float16)
    ql = (q64 - qh.astype(jnp.float32)).astype(jnp.float16)
    S = num_splits
    _INTERPRET[0] = bool(interpret)
    kern = functools.partial(_kernel, num_splits=S, num_pages_pool=N)
    f32 = jnp.float32
    out_t = (jax.ShapeDtypeStruct((B, H, S, D, GPAD), f32), jax.ShapeDtypeStruct((B, H, S, 4, 64, GPAD), f32))
    scratch = [
        _smem_u8_tile(PAGE // 4, D),  # kc_s [ST, 64, 128]
        _smem_u8_tile(D, PAGE // 4),  # vc_s [ST, 128, 64]
        plgpu.SMEM((STAGES, PLANES, D), jnp.float16),  # ks_s
        plgpu.SMEM((STAGES, PLANES, D), jnp.float16),  # km_s
        plgpu.SMEM((STAGES, NP, PAGE), jnp.float16),  # vs_s
        plgpu.SMEM((STAGES, NP, PAGE), jnp.float16),  # vm_s
        plgpu.SMEM((GPAD, D), f32, transforms=_tx((8, 32), 128)),
        _smem_b16(GPAD, D),  # qh_s
        _smem_b16(GPAD, D),  # ql_s
        _smem_b16(PLANES * GPAD, D),  # bq_s: B of QK per plane, [32, 128]
        _smem_b16(PLANES * NP * GPAD, P),  # bv_s: B of PV per (plane, group), [64, 64]
        plgpu.SMEM((D, GPAD), f32),  # o_s
        plgpu.SMEM((4, 64, GPAD), f32),  # st_s
        plgpu.Barrier(num_barriers=6 * STAGES),  # bars: operand k, slot -> k * STAGES + slot
        plgpu.Barrier(num_barriers=3),  # qbar
    ]
    o, st = plgpu.kernel(
        kern, out_type=out_t, grid=(B, H, S), grid_names=("b", "h", "s"), scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=2048),
        **(dict(interpret=_interpret_params()) if interpret else {}),
    )(nblocks.astype(jnp.int32), page_indices.astype(jnp.int32), qs, qh, ql, k_codes, k_scale, k_min, v_codes,
      vs_gm, vm_gm)
    return combine(o, st, G)


def _interpret_params():
    """GPU interpret mode (CPU correctness check of the kernel's logic; jax >= 0.10)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def combine(o, st, G):
    """Split partials -> (out f32[B, Hq, D], m, l f32[B, Hq]) (m, l in log2 units)."""
    B, H, S = o.shape[:3]
    m = st[:, :, :, 0, 0, :]  # [B, H, S, 8]
    l = st[:, :, :, 1].sum(axis=3)
    c = st[:, :, :, 2:4].sum(axis=4)  # [B, H, S, NP, 8]
    num = jnp.swapaxes(o, 3, 4)  # [B, H, S, 8, 128]
    num = num + jnp.repeat(jnp.swapaxes(c, 3, 4), D // NP, axis=4)
    mm = jnp.max(m, axis=2, keepdims=True)
    w = jnp.where(jnp.isfinite(m), jnp.exp2(m - jnp.where(jnp.isfinite(mm), mm, 0.0)), 0.0)
    L = jnp.sum(w * l, axis=2)
    out = jnp.sum(w[..., None] * num, axis=2) / jnp.where(L > 0, L, 1.0)[..., None]
    return (out[:, :, :G].reshape(B, H * G, D), mm[:, :, 0, :G].reshape(B, H * G),
            L[:, :, :G].reshape(B, H * G))


# ------------------------------------------------------------------------------------------ offline lowering

def shape_structs(batch, tokens, num_q_heads=32, num_kv_heads=8, copies=1):
    pps = -(-tokens // PAGE)
    N = batch * pps * copies + 1
    sd = jax.ShapeDtypeStruct
    H = num_kv_heads
    return (sd((batch, num_q_heads, D), jnp.float32), sd((N, H, PAGE // 4, D), jnp.uint8),
            sd((N, H, PLANES, D), jnp.float16), sd((N, H, PLANES, D), jnp.float16),
            sd((N, H, D, PAGE // 4), jnp.uint8), sd((N, H, NP, PAGE), jnp.float16),
            sd((N, H, NP, PAGE), jnp.float16), sd((batch, pps), jnp.int32), sd((batch,), jnp.int32))


def lower(batch, tokens, num_splits):
    f = jax.jit(functools.partial(probe_call, num_splits=num_splits))
    return f.trace(*shape_structs(batch, tokens)).lower(lowering_platforms=("cuda",))


def main_lower():
    ok = True
    for batch, tokens, splits in ((1, 1024, 2), (8, 32768, 4)):
        t0 = time.time()
        try:
            txt = lower(batch, tokens, splits).as_text()
            print(f"lower ({batch}, {tokens}) splits={splits}: OK ({time.time() - t0:.1f} s, {len(txt)} chars)")
        except Exception:
            ok = False
            print(f"lower ({batch}, {tokens}) splits={splits}: FAILED")
            traceback.print_exc()
    return ok



# ------------------------------------------------------------------------------------------ reference

def numpy_reference(q, layer, table, nblocks):
    """float64 dequantize-then-attend over the sealed blocks: (out [B, Hq, D], lse2 [B, Hq] (log2 units))."""
    kc, ks, km = (np.asarray(getattr(layer, f)) for f in ("k_codes", "k_scale", "k_min"))
    vc, vs, vm = (np.asarray(getattr(layer, f)) for f in ("v_codes", "v_scale", "v_min"))
    q, table, nblocks = np.asarray(q, np.float64), np.asarray(table), np.asarray(nblocks)
    B, Hq, d = q.shape
    H = kc.shape[1]
    G = Hq // H
    out = np.zeros((B, Hq, d))
    lse = np.full((B, Hq), -np.inf)
    for b in range(B):
        nb = int(nblocks[b])
        if nb == 0:
            continue
        blk = np.arange(nb)
        pid = table[b, blk // PLANES]
        j = (blk % PLANES)[:, None, None]
        for h in range(H):
            kcode = (kc[pid, h].astype(np.int64) >> (2 * j)) & 3  # [nb, 64 tok, D]
            K = kcode * ks[pid, h, blk % PLANES][:, None, :].astype(np.float64) \
                + km[pid, h, blk % PLANES][:, None, :].astype(np.float64)
            vcode = (vc[pid, h].astype(np.int64) >> (2 * j)) & 3  # [nb, D, 64 tok]
            tok = (blk % PLANES)[:, None] * P + np.arange(P)[None, :]  # [nb, 64] row within the page
            tau = vs[pid[:, None], h, tok].astype(np.float64)  # [nb, 64, NP]
            nu = vm[pid[:, None], h, tok].astype(np.float64)
            grp = np.arange(d) // (d // NP)
            V = np.swapaxes(vcode, 1, 2) * tau[:, :, grp] + nu[:, :, grp]  # [nb, 64, D]
            K, V = K.reshape(-1, d), V.reshape(-1, d)
            qs = q[b, h * G:(h + 1) * G] / math.sqrt(d)  # [G, D]
            lg = qs @ K.T
            mx = lg.max(axis=1, keepdims=True)
            w = np.exp(lg - mx)
            l = w.sum(axis=1, keepdims=True)
            out[b, h * G:(h + 1) * G] = (w @ V) / l
            lse[b, h * G:(h + 1) * G] = (mx[:, 0] + np.log(l[:, 0])) * LOG2E
    return out, lse


# ------------------------------------------------------------------------------------------ GPU driver

def _short(tb, n=2500):
    return tb if len(tb) <= n else tb[:600] + "\n ... \n" + tb[-(n - 600):]


def default_splits(batch, kv_heads, pages, ctas_per_sm=2):
    from pallas_kernels import decode_attention as da
    return da.choose_num_splits(batch * kv_heads, max(pages, 1), ctas_per_sm * H200_SMS)[0]


def run_gpu(args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_decode_attention as bda
    from hack_jax import kv_cache
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "mgpu_probe.log"), "w")
    results = []

    def record(row):
        results.append(row)
        with open(os.path.join(args.out, "mgpu_probe.json"), "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=results), f, indent=1)

    def fail(row, stage):
        tb = traceback.format_exc()
        row[f"{stage}_error"] = tb
        log.write(f"==== {row['shape']} {stage}\n{tb}\n")
        log.flush()
        print(f"[{row['shape']}] {stage} FAILED:\n{_short(tb, args.err_chars)}", flush=True)

    print(f"device {jax.devices()[0]}, jax {jax.__version__}", flush=True)
    for batch, tokens in args.shapes:
        shape = bda.Shape("llama3.1-8b", batch, tokens)
        row = dict(shape=f"{batch}x{tokens}")
        key = jax.random.PRNGKey(batch * 7 + tokens)
        try:
            layer, table, pps, hack_bytes, n, config = bda._layer_prep(shape, key, "hack")
            layer = bda._one_copy_slots(layer, shape)
            ns = kv_cache.sink_tokens(config)
            nb = (tokens - ns) // P
            nblocks = jnp.full((batch,), nb, jnp.int32)
            pages = -(-nb // PLANES)
            per_tok = (D // 4) * 2 + 2 * 2 * D / P + 2 * 2 * NP  # codes + k_scale/k_min + v_scale/v_min
            probe_bytes = int(batch * shape.num_kv_heads * nb * P * per_tok + batch * pps * 4)
            vs_gm = jnp.swapaxes(layer.v_scale, 2, 3)  # setup, not timed (LAYOUT NOTE)
            vm_gm = jnp.swapaxes(layer.v_min, 2, 3)
            splits = args.splits or default_splits(batch, shape.num_kv_heads, pages)
            row.update(sealed_blocks=nb, pages=pages, splits=splits, probe_bytes=probe_bytes,
                       hack_bytes=hack_bytes, copies=n)
            q = jax.random.normal(jax.random.fold_in(key, 3), (batch, shape.num_q_heads, D), jnp.float32)
            per_copy = batch * pps
        except Exception:
            fail(row, "setup")
            record(row)
            continue

        def probe_fn(S):
            return jax.jit(functools.partial(probe_call, num_splits=S))

        if args.check:
            try:
                t0 = time.time()
                out, m, l = probe_fn(splits)(q, layer.k_codes, layer.k_scale, layer.k_min, layer.v_codes, vs_gm,
                                             vm_gm, table, nblocks)
                out = np.asarray(out)
                row["first_call_s"] = round(time.time() - t0, 2)
                ref, lse = numpy_reference(q, layer, table, nblocks)
                err = np.abs(out - ref)
                lse_probe = np.asarray(m) + np.log2(np.asarray(l))
                row.update(max_abs_err=float(err.max()), mean_abs_err=float(err.mean()),
                           max_abs_ref=float(np.abs(ref).max()), finite=bool(np.isfinite(out).all()),
                           lse_max_abs_err=float(np.abs(lse_probe - lse).max()))
                print(f"[{row['shape']}] check: max|err| {row['max_abs_err']:.3g} (mean {row['mean_abs_err']:.3g}, "
                      f"max|ref| {row['max_abs_ref']:.3g}, lse err {row['lse_max_abs_err']:.3g}) "
                      f"first call {row['first_call_s']} s", flush=True)
            except Exception:
                fail(row, "check")
        record(row)
        if not args.bench:
            continue
        arrays = dict(layer=layer, table=table, vs=vs_gm, vm=vm_gm, nb=nblocks)
        impls = [(f"mgpu_s{S}", S) for S in dict.fromkeys([splits] + args.extra_splits)] + [("hack_folded_f16", None)]
        if args.bf16:
            impls.append(("bf16", None))
        for name, S in impls:
            try:
                if name == "bf16":
                    prep = bda.prep_bf16(shape, key, interpret=False)
                    nbytes = prep.nbytes
                elif name.startswith("mgpu"):
                    f = functools.partial(probe_call, num_splits=S)

                    def call(qq, i, a, f=f):
                        x = a["layer"]
                        return f(qq, x.k_codes, x.k_scale, x.k_min, x.v_codes, a["vs"], a["vm"],
                                 a["table"] + (i % n) * per_copy, a["nb"])[0]

                    prep = bda.Prepared(call, arrays, probe_bytes, f"mgpu splits={S}", n, append=("open_k", "open_v"))
                    nbytes = probe_bytes
                else:
                    from pallas_kernels import decode_attention as da

                    def call(qq, i, a):
                        cache, static = bda.kivi_call_args(a["layer"])
                        return da.hack_decode_attention(qq, *cache, a["table"] + (i % n) * per_copy,
                                                        jnp.full((batch,), tokens, jnp.int32),
                                                        dot_dtype="folded_f16", **static)

                    prep = bda.Prepared(call, dict(layer=arrays["layer"], table=arrays["table"]), hack_bytes, "folded_f16", n,
                                        append=("open_k", "open_v"))
                    nbytes = hack_bytes
                us, us_wall, first_s, n_iter = bda.time_impl(prep, shape, reps=args.reps, target_ms=args.target_ms,
                                                             key=key, wall_calls=args.wall_calls)
                if name != "bf16" and not name.startswith("mgpu"):
                    arrays["layer"] = prep.arrays["layer"]
                elif name.startswith("mgpu"):
                    arrays = prep.arrays
                r = dict(us=round(us, 2), us_wall=round(us_wall, 1), bytes=nbytes,
                         roof_pct=round(100 * nbytes / (us * 1e-6) / 3.7e12, 1), first_s=round(first_s, 1))
                row[name] = r
                print(f"[{row['shape']}] {name:18s} {r['us']:9.2f} us  wall {r['us_wall']:8.1f}  "
                      f"{nbytes / 2**20:8.1f} MiB  {r['roof_pct']:5.1f}% of 3.7 TB/s", flush=True)
            except Exception:
                fail(row, name)
            record(row)
    # table
    print("\nshape        impl               us/call   MiB      %roof   max|err|")
    for row in results:
        for k, v in row.items():
            if isinstance(v, dict) and "us" in v:
                print(f"{row['shape']:12s} {k:18s} {v['us']:8.2f} {v['bytes'] / 2**20:8.1f} {v['roof_pct']:6.1f}"
                      f"   {row.get('max_abs_err', float('nan')):.3g}")
    log.close()
    return results

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--lower", action="store_true", help="offline: Mosaic lowering for the cuda platform only")
    ap.add_argument("--check", action="store_true", help="GPU: probe vs the float64 reference")
    ap.add_argument("--bench", action="store_true", help="GPU: time probe, hack folded_f16 (and bf16)")
    ap.add_argument("--out", default="/tmp/mgpu_probe")
    ap.add_argument("--shapes", nargs="*", default=["1:1024", "1:32768", "8:32768", "1:131072"])
    ap.add_argument("--splits", type=int, default=0, help="0: choose_num_splits with 2 CTAs per SM")
    ap.add_argument("--extra-splits", nargs="*", type=int, default=[])
    ap.add_argument("--no-bf16", dest="bf16", action="store_false")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=40.0)
    ap.add_argument("--wall-calls", type=int, default=10)
    ap.add_argument("--err-chars", type=int, default=2500, help="traceback chars printed per failure")
    args = ap.parse_args()
    args.shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes]
    if args.lower:
        sys.exit(0 if main_lower() else 1)
    if args.check or args.bench:
        run_gpu(args)
