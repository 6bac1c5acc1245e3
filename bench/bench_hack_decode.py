"""HACK decode kernel (pallas_kernels.decode_attention) and its fused-dequant baseline: configs on the GPU.

Per shape (Llama-3.1-8B heads: 32 q / 8 kv, head_dim 128; P 64, page 256, 4 sinks) and kernel
variant (dot dtype, num_splits, num_warps, num_stages): us per call, bytes read, GB/s and % of
4.3 TB/s; plus an accuracy pass (kernel vs the NumPy twin of tests/test_decode_kernels.py and vs
hack_jax's paged reference) and, best effort, ptxas' resource report of the compiled kernel.

Timing: one jitted lax.fori_loop of n trips x --calls-per-iter calls (default 8, as the bf16 benchmark;
run 3 used 1, which adds the loop trip's ~25-30 us to every call: NOTES_decode.md), each call's query =
q + 1e-3 * previous output (no hoisting), wall clock / calls, median of --reps loops. Caches smaller than 256 MiB are held in several
copies in one page pool and the calls rotate through them (page-table offset), so consecutive
calls do not hit the 60 MB L2.
bytes = codes + metadata (+ the code sums, for the int8 rows only: the other kernels do not read them) of
the kv_len tokens (80 B per token per kv head at d 128, P 64; 84 with the sums) + open block + sinks + page
table.

Usage: PYTHONPATH=. python3 bench/bench_hack_decode.py --out DIR [--shapes b8_32k b1_32k ...]
Stages (--stages): bench, accuracy, resources (ptxas report of the device's own compile), profile
(plain calls for an outside profiler: bench/gpu_check.sh NCU=1), sass (CPU-only, below).
CPU-only static report (registers, loop SASS counts; pip triton importable, e.g. installed with
`pip install --target /tmp/tri triton==3.6.0` and /tmp/tri in PYTHONPATH):
  python3 bench/bench_hack_decode.py --out DIR --stages sass --variants int8=int8 folded=folded_f16 [--bits 4]
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import subprocess
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)

from pallas_kernels.decode_attention import (H200_NUM_SMS, choose_num_splits, default_config,  # noqa: E402
                                             hack_decode_attention)
from pallas_kernels.dequant_decode_attention import dequant_decode_attention  # noqa: E402

HQ, HKV, D, P, PAGE, NS = 32, 8, 128, 64, 256, 4
ROOF = 4.3e12
SHAPES = {"b8_32k": (8, 32768), "b8_64k": (8, 65536), "b8_128k": (8, 131072), "b1_32k": (1, 32768),
          "b1_128k": (1, 131072), "b8_8k": (8, 8192),
          "b8_1k": (8, 1024), "tiny": (1, 1024)}  # tiny: CPU smoke test of this script (--interpret)
FIELDS = ("k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums", "open_k",
          "open_v", "sink_k", "sink_v")


DEFAULT_VARIANTS = ["hack=int8", "hack_folded=folded_f16", "dequant=dequant:d:4:2", "bf16paged=bf16paged"]
DOTS = ("int8", "folded_f16", "folded_bf16")  # decode_attention.DOT_DTYPES
# folded_f16 with a plane encoding set: KernelConfig.interleaved / .denormal True / False
PLANE_VARIANTS = {"folded_f16i": dict(interleaved=True, denormal=False), "folded_f16d": dict(denormal=True),
                  "folded_f16m": dict(denormal=False)}


def variants(batch, kv_len, specs, bits=2):
    """specs: NAME=DOT (default_config of operand mode DOT: int8 | folded_f16 | folded_bf16 |
    folded_f16i / folded_f16d / folded_f16m (folded_f16 with KernelConfig.interleaved / .denormal True / False);
    "default" = int8), NAME=bf16paged (the bf16 paged
    kernel on a bf16 cache of the same length), or
    NAME=DOT:SPLITS:WARPS:STAGES[:MAXNREG] with DOT an operand mode or dequant, SPLITS a number, d
    (default_config's, with its open_split) or dN (choose_num_splits' choice, open_split included, for N
    resident programs per SM: e.g. d4 with a cap of 128 registers at 4 warps), MAXNREG the HACK kernel's
    register cap (KernelConfig.maxnreg; 0: none; absent: default_config's; the dequant kernel has none), e.g.
    fold_w8=folded_f16:d2:8:2:128, uncapped=folded_f16:d:4:2:0. (The INT8-in-float dots and the
    KernelConfig flags of earlier runs are gone: their settled choices are the code; bench/NOTES_decode.md.)"""
    pps = kv_len // PAGE
    out = []
    for spec in specs:
        name, rest = spec.split("=")
        if rest == "bf16paged":
            out.append((name, "bf16paged", None))
            continue
        dot, *launch = rest.split(":")
        dot = "int8" if dot == "default" else dot
        flags = PLANE_VARIANTS.get(dot, {})
        dot = "folded_f16" if flags else dot
        if dot not in DOTS + ("dequant",):
            raise ValueError(f"variant {spec!r}: operand mode must be one of "
                             f"{DOTS + ('dequant',) + tuple(PLANE_VARIANTS)}")
        base = default_config(batch=batch, num_kv_heads=HKV, pages_per_seq=pps, page_size=PAGE, partition_size=P,
                              dot_dtype="int8" if dot == "dequant" else dot, bits=bits)
        base = dataclasses.replace(base, **flags)
        fn = dequant_decode_attention if dot == "dequant" else hack_decode_attention
        if not launch:
            out.append((name, fn, base))
            continue
        if len(launch) not in (3, 4):
            raise ValueError(f"variant {spec!r}: expected DOT:SPLITS:WARPS:STAGES[:MAXNREG]")
        splits, warps, stages, *cap = launch
        if splits == "d":
            cfg = base
        elif splits.startswith("d"):
            if not splits[1:].isdigit() or int(splits[1:]) < 1:
                raise ValueError(f"variant {spec!r}: dN needs N >= 1 resident programs per SM")
            s, o = choose_num_splits(batch * HKV, max(1, pps * PAGE // (4 * P)), int(splits[1:]) * H200_NUM_SMS)
            cfg = dataclasses.replace(base, num_splits=s, open_split=o)
        else:
            cfg = dataclasses.replace(base, num_splits=min(int(splits), pps * PAGE // (4 * P)), open_split=False)
        if cap:
            cfg = dataclasses.replace(cfg, maxnreg=int(cap[0]) or None)
        out.append((name, fn, dataclasses.replace(cfg, num_warps=int(warps), num_stages=int(stages))))
    return out


def cache_bytes(batch, kv_len, bits=2, sums=True):
    """Bytes a launch must read: codes + metadata (+ the code sums, which only the int8 modes read) of the
    kv_len tokens, the open blocks and sinks, the page table."""
    NP = D // min(P, D)
    per_token = 2 * D * bits // 8 + 2 * 2 * D // P + 2 * 2 * NP + (D // P + NP if sums else 0)
    return batch * HKV * (kv_len * per_token + 2 * 2 * (P + NS) * D) + batch * (kv_len // PAGE) * 4


def layer_specs(batch, kv_len, bits=2):
    """ShapeDtypeStructs of hack_decode_attention's positional operands (q, FIELDS..., page_indices, kv_lens)
    at Llama heads, P 64, pages of 256, one spare page column per sequence (never read)."""
    pps = kv_len // PAGE + 1
    N, NP, bpp, rows = batch * pps + 1, D // min(P, D), PAGE // P, PAGE // (8 // bits)
    S = jax.ShapeDtypeStruct
    return [S((batch, HQ, D), jnp.float32), S((N, HKV, rows, D), jnp.uint8), S((N, HKV, bpp, D), jnp.float16),
            S((N, HKV, bpp, D), jnp.float16), S((N, HKV, PAGE, NP), jnp.uint8), S((N, HKV, D, rows), jnp.uint8),
            S((N, HKV, PAGE, NP), jnp.float16), S((N, HKV, PAGE, NP), jnp.float16), S((N, HKV, bpp, D), jnp.uint8),
            S((batch, HKV, P, D), jnp.bfloat16), S((batch, HKV, P, D), jnp.bfloat16), S((batch, HKV, NS, D), jnp.bfloat16),
            S((batch, HKV, NS, D), jnp.bfloat16), S((batch, pps), jnp.int32), S((batch,), jnp.int32)]


def make_inputs(batch, kv_len, n_copies, seed=0):
    """Random finite cache contents for n_copies copies of the batch's pages (page 0 = null)."""
    pps = kv_len // PAGE + 1  # one spare page column (never read: kv_len = 4 + 32 k P is block-exact + sinks)
    pages_per_copy = batch * pps
    num_pages = 1 + n_copies * pages_per_copy
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, 12)
    NP, bpp = D // min(P, D), PAGE // P
    u8 = lambda k, shape, hi=256: jax.random.randint(k, shape, 0, hi, jnp.int32).astype(jnp.uint8)
    f16 = lambda k, shape, lo, hi: jax.random.uniform(k, shape, jnp.float32, lo, hi).astype(jnp.float16)
    bf = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16)
    c = dict(
        k_codes=u8(ks[0], (num_pages, HKV, PAGE // 4, D)), v_codes=u8(ks[1], (num_pages, HKV, D, PAGE // 4)),
        k_scale=f16(ks[2], (num_pages, HKV, bpp, D), 0.01, 0.3), k_min=f16(ks[3], (num_pages, HKV, bpp, D), -1, 0),
        k_sums=u8(ks[4], (num_pages, HKV, PAGE, NP), 193),
        v_scale=f16(ks[5], (num_pages, HKV, PAGE, NP), 0.01, 0.3), v_min=f16(ks[6], (num_pages, HKV, PAGE, NP), -1, 0),
        v_sums=u8(ks[7], (num_pages, HKV, bpp, D), 193),
        open_k=bf(ks[8], (batch, HKV, P, D)), open_v=bf(ks[9], (batch, HKV, P, D)),
        sink_k=bf(ks[10], (batch, HKV, NS, D)), sink_v=bf(ks[11], (batch, HKV, NS, D)))
    perm = np.random.default_rng(seed).permutation(pages_per_copy).astype(np.int32) + 1
    table = jnp.asarray(perm.reshape(batch, pps))
    lens = jnp.full((batch,), kv_len + NS, jnp.int32)  # kv_len tokens in sealed blocks + the sinks
    return c, table, lens, pages_per_copy


def bf16_inputs(batch, kv_len, n_copies, seed=0):
    """A bf16 paged cache (DESIGN.md kv_format="bf16") of the same lengths for the bf16 kernel:
    (k, v, table, lens, pages_per_copy); no sinks, no open block."""
    pps = kv_len // PAGE
    pages_per_copy = batch * pps
    num_pages = 1 + n_copies * pages_per_copy
    kk, kv = jax.random.split(jax.random.PRNGKey(seed + 5))
    k = jax.random.normal(kk, (num_pages, HKV, PAGE, D), jnp.bfloat16)
    v = jax.random.normal(kv, (num_pages, HKV, PAGE, D), jnp.bfloat16)
    perm = np.random.default_rng(seed).permutation(pages_per_copy).astype(np.int32) + 1
    return k, v, jnp.asarray(perm.reshape(batch, pps)), jnp.full((batch,), kv_len, jnp.int32), pages_per_copy


def time_variant(fn, config, c, table, lens, pages_per_copy, n_copies, batch, reps, target_ms, interpret=False,
                 calls_per_iter=1):
    q0 = jax.random.normal(jax.random.PRNGKey(1), (batch, HQ, D), jnp.float32)
    if fn == "bf16paged":
        from pallas_kernels.bf16_decode_attention import bf16_decode_attention
        arrays = [c["k"], c["v"]]
        call = lambda q, arrays, t, lens: bf16_decode_attention(q, *arrays, t, lens, interpret=interpret)  # noqa: E731
    else:
        arrays = [c[f] for f in FIELDS]
        call = lambda q, arrays, t, lens: fn(q, *arrays, t, lens, partition_size=P, num_sink_tokens=NS,  # noqa: E731
                                             config=config, interpret=interpret)

    @jax.jit
    def loop(q, n_iter, table, lens, *arrays):
        def body(i, q):
            for k in range(calls_per_iter):  # several calls per loop trip: the trip's own cost is shared
                t = table + ((i * calls_per_iter + k) % n_copies) * pages_per_copy
                q = q + 1e-3 * call(q, arrays, t, lens)
            return q
        return jax.lax.fori_loop(0, n_iter, body, q)

    t0 = time.perf_counter()
    jax.block_until_ready(loop(q0, 2, table, lens, *arrays))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(loop(q0, 10, table, lens, *arrays))
    per = (time.perf_counter() - t0) / 10
    n = max(10, int(target_ms * 1e-3 / max(per, 1e-6)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(q0, n, table, lens, *arrays))
        times.append((time.perf_counter() - t0) / (n * calls_per_iter))
    return float(np.median(times)) * 1e6, compile_s, n * calls_per_iter


def copies(nbytes):
    """How many copies of a call's pages to rotate through so that consecutive calls do not hit the L2: enough
    for 256 MiB in all, at most 8."""
    return max(1, min(8, math.ceil((256 << 20) / nbytes)))


def time_bf16(batch, kv_len, reps, target_ms, interpret=False, calls_per_iter=8):
    """Our bf16 paged kernel on a bf16 cache of the same length, timed as time_variant times the HACK
    kernel: (us, compile s, calls, bytes it must read (512 B per token per kv head), copies)."""
    nbytes = batch * HKV * kv_len * 2 * D * 2
    n_copies = copies(nbytes)
    k, v, table, lens, ppc = bf16_inputs(batch, kv_len, n_copies)
    us, comp, n = time_variant("bf16paged", None, dict(k=k, v=v), table, lens, ppc, n_copies, batch, reps, target_ms,
                               interpret, calls_per_iter)
    return us, comp, n, nbytes, n_copies


def bench(args, log):
    for shape in args.shapes:
        batch, kv_len = SHAPES[shape]
        nbytes = cache_bytes(batch, kv_len)
        n_copies = copies(nbytes)
        c, table, lens, ppc = make_inputs(batch, kv_len, n_copies)
        for name, fn, config in variants(batch, kv_len, args.variants):
            row = dict(shape=shape, batch=batch, kv_len=kv_len, variant=name, config=str(config), bytes=nbytes,
                       copies=n_copies, calls_per_iter=args.calls_per_iter)
            try:
                if fn == "bf16paged":  # its own cache
                    us, comp, n, nbytes_row, nc = time_bf16(batch, kv_len, args.reps, args.target_ms, args.interpret,
                                                            args.calls_per_iter)
                    row.update(bytes=nbytes_row, copies=nc, config="bf16_decode_attention default_config")
                else:
                    us, comp, n = time_variant(fn, config, c, table, lens, ppc, n_copies, batch, args.reps,
                                               args.target_ms, args.interpret, args.calls_per_iter)
                    # only the int8 mode reads the code sums
                    nbytes_row = cache_bytes(batch, kv_len, sums=fn is hack_decode_attention
                                             and config.dot_dtype == "int8")
                    row.update(bytes=nbytes_row)
                row.update(us=round(us, 2), gbps=round(nbytes_row / us / 1e3, 1),
                           roof_pct=round(100 * nbytes_row / us / 1e-6 / ROOF, 1), compile_s=round(comp, 1), calls=n)
            except Exception as e:  # keep going: a failing variant is a result too
                row.update(error=f"{type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc()
            log(row)
        del c


def accuracy(log, mode="gpu"):
    """Kernel vs the NumPy twin and hack_jax's paged reference on a mid-size Llama-heads cache."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import test_decode_kernels as t
    from hack_jax import attention, kv_cache
    from hack_jax.config import QuantConfig

    case = t.Case("llama_acc", 128, 64, 256, 8, 4, 8, (4 + 64 * 20 + 37, 1000, 65, 1))  # capacity 4 + 8 * 256
    q, c = t.build(case, seed=7)
    twin = t.numpy_kivi_decode(q, c, P=P, ns=NS)
    layer = kv_cache.KiviPages(**{f: jnp.asarray(c[f]) for f in FIELDS},
                               config=QuantConfig(partition_size=P, page_size=PAGE, num_sink_tokens=NS))
    # under jit: the test cache leaves page-table columns of open-block tokens unallocated (the kernels never
    # read them), which the dispatch's eager page-table check would refuse
    ref = np.asarray(jax.jit(lambda q, pi, kl: attention.decode_attention(q, layer, page_indices=pi, kv_lens=kl,
                                                                          impl="reference"))(
        jnp.asarray(q), jnp.asarray(c["page_indices"]), jnp.asarray(c["kv_lens"])))
    scale = t.v_scale_of(c)
    log(dict(accuracy="hack_jax_reference_vs_twin", max_err=float(np.abs(ref - twin).max()), scale=scale))
    exact = t.numpy_dequant_decode(q, c, P=P, ns=NS)  # float64 attention over the dequantized cache
    log(dict(accuracy="int8_twin_vs_exact", max_err=float(np.abs(twin - exact).max()), scale=scale))
    for dot, dtype in (("folded_f16", np.float16), ("folded_bf16", t.BF16)):
        naive = t.numpy_folded_decode(q, c, P=P, ns=NS, dtype=dtype)
        log(dict(accuracy=f"naive_{dot}_vs_exact", max_err=float(np.abs(naive - exact).max()),
                 mean_err=float(np.abs(naive - exact).mean()), scale=scale))
    for dot, splits in (("int8", 1), ("int8", 5), ("folded_f16", 5), ("folded_bf16", 5), ("folded_f16i", 5),
                        ("folded_f16d", 5), ("folded_f16m", 5)):
        kcase = t.Case("x", 128, 64, 256, 8, 4, 8, case.kv_lens, num_splits=splits)
        kw = dict(dot_dtype="folded_f16", **PLANE_VARIANTS[dot]) if dot in PLANE_VARIANTS else dict(dot_dtype=dot)
        out = t.run_kernel(hack_decode_attention, q, c, kcase, mode, **kw)
        for rname, r in (("exact", exact), ("int8_twin", twin), ("hack_jax_ref", ref)):
            err = np.abs(out - r)
            log(dict(accuracy=f"hack_{dot}_splits{splits}_vs_{rname}", max_err=float(err.max()),
                     mean_err=float(err.mean()), rel_max=float(err.max() / scale), scale=scale))


def profile(args, log):
    """A few plain calls of each variant on the first shape, for a profiler attached from outside
    (bench/gpu_check.sh runs this stage under `ncu -k regex:hack_decode|bf16_decode --launch-skip 2
    --launch-count 1`): warm-up calls first, so the profiled launch is a steady-state one."""
    batch, kv_len = SHAPES[args.shapes[0]]
    c, table, lens, _ = make_inputs(batch, kv_len, 1)
    q = jax.random.normal(jax.random.PRNGKey(1), (batch, HQ, D), jnp.float32)
    for name, fn, config in variants(batch, kv_len, args.variants):
        if fn == "bf16paged":
            from pallas_kernels.bf16_decode_attention import bf16_decode_attention
            k, v, bt, bl, _ = bf16_inputs(batch, kv_len, 1)
            call = jax.jit(lambda q: bf16_decode_attention(q, k, v, bt, bl, interpret=args.interpret))
        else:
            call = jax.jit(lambda q, fn=fn, config=config: fn(q, *[c[f] for f in FIELDS], table, lens,
                                                                partition_size=P, num_sink_tokens=NS, config=config,
                                                                interpret=args.interpret))
        for _ in range(4):
            jax.block_until_ready(call(q))
        log(dict(profile=name, shape=args.shapes[0], config=str(config)))


def resources(out_dir, log):
    """ptxas' resource report (registers, spills, shared memory) of the kernel as this jax compiles it:
    jax._src.lib.triton.compile (called by the Pallas-Triton lowering of jax >= 0.11) is wrapped to keep
    the PTX of one lowering of the int8 and folded_f16 default configs at Llama-heads b8_32k, then ptxas -v
    (Triton's copy) compiles it for sm_90a. Best effort, not yet run on the device in this form (run 3's
    version looked for a handler dict jax 0.11.2 does not have); the CPU route is in NOTES_decode.md v3."""
    from jax._src.lib import triton as jl_triton
    ptx = []
    compile_fn = getattr(jl_triton, "compile", None)  # run 3: jax 0.11.2 has no _compilation_handlers dict
    if compile_fn is None:
        log(dict(resources="jax._src.lib.triton has no compile(): no PTX to report"))
        return

    def keep(platform, module, arch, **kw):
        r = compile_fn(platform, module, arch, **kw)
        asm = getattr(r, "asm", None) or getattr(r, "ptx", None)
        if asm is None:
            lines.append(f"compile result has no asm/ptx attribute: {[a for a in dir(r) if not a.startswith('_')]}")
        else:
            ptx.append((kw.get("num_warps"), asm if isinstance(asm, str) else asm.decode(),
                        getattr(r, "smem_bytes", None)))
        return r
    lines = []
    jl_triton.compile = keep
    try:
        batch, kv_len = SHAPES["b8_32k"]
        c, table, lens, _ = make_inputs(batch, 4096, 1)
        q = jnp.ones((batch, HQ, D), jnp.float32)
        for name, cfg in ((dot, default_config(batch=batch, num_kv_heads=HKV, pages_per_seq=kv_len // PAGE,
                                               page_size=PAGE, partition_size=P, dot_dtype=dot)) for dot in DOTS[:2]):
            ptx.clear()
            jax.jit(lambda q, *a: hack_decode_attention(q, *a, partition_size=P, num_sink_tokens=NS, config=cfg)
                    ).lower(q, *[c[f] for f in FIELDS], table, lens).compile()
            if not ptx:
                lines.append(f"== {name}: no PTX captured")
                continue
            path = os.path.join("/tmp", f"hack_{name}.ptx")
            open(path, "w").write(ptx[-1][1])
            import triton
            ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
            r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", "/dev/null"], capture_output=True,
                               text=True, timeout=120)
            lines.append(f"== {name} {cfg} smem={ptx[-1][2]}\n{r.stderr[-3000:]}")
    finally:
        jl_triton.compile = compile_fn
    with open(os.path.join(out_dir, "resources.txt"), "w") as fh:
        fh.write("\n".join(lines))
    log(dict(resources=[ln.replace("\n", " | ")[-400:] for ln in lines]))


def sass(out_dir, log, specs, bits=2):
    """CPU-only static report (bench/NOTES_decode.md v3): lower each variant at Llama-heads b8_32k for
    cuda (TTIR from the Pallas-Triton lowering), compile it with pip `triton` (e.g. 3.6.0 in
    PYTHONPATH; XLA's bundled Triton may differ a little) for sm_90, and report ptxas' registers /
    stack and the main loop's SASS: instructions per warp and loop trip (and per 64-token block: the trip
    covers `blocks_per_trip` blocks), BAR.SYNC, shared-memory and global loads, shuffles, IMMA. bits: the
    code width (QuantConfig.bits; --bits). No GPU needed. The compile and SASS parsing are
    bench/triton_offline.py's (shared with bench_prefill_attention.py --sass)."""
    import triton_offline
    from pallas_kernels import common
    batch, kv_len = SHAPES["b8_32k"]
    trip = getattr(common, "blocks_per_trip", lambda b, *_: common.num_planes(b))(bits, PAGE, P)
    args = layer_specs(batch, kv_len, bits)
    for name, fn, cfg in variants(batch, kv_len, specs, bits):
        if fn == "bf16paged":
            continue
        extra = dict(bits=bits) if bits != 2 else {}
        ttir = triton_offline.lower_ttir(
            lambda *xs: fn(*xs, partition_size=P, num_sink_tokens=NS, config=cfg, **extra), *args)
        c = triton_offline.compile_sm90(ttir, out_dir, name, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        loops = triton_offline.loops(c["sass"], innermost=False)  # the widest loop, as before
        lo, hi, _ = max(loops, key=lambda x: x[1] - x[0]) if loops else (0, -1, 0)
        ops = triton_offline.op_counts(c["sass"], lo, hi)
        regs, stack = triton_offline.resources(c["res"])
        n = sum(ops.values())
        log(dict(sass=name, bits=bits, config=str(cfg), regs=regs, stack=stack, shared=c["shared"], loop_instr=n,
                 blocks_per_trip=trip, loop_instr_per_block=round(n / trip, 1), STL=ops["STL"], LDL=ops["LDL"],
                 **{k_: ops[k_] for k_ in ("BAR", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "SHFL", "IMMA", "HMMA", "MUFU")}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=["b8_32k", "b1_32k", "b1_128k", "b8_1k"], choices=sorted(SHAPES))
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="NAME=DOT:SPLITS:WARPS:STAGES")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls-per-iter", type=int, default=8,
                    help="kernel calls per fori_loop trip (run 3 used 1: each call then also paid the loop trip, "
                         "~25-30 us, see NOTES_decode.md; the bf16 benchmark uses 8)")
    ap.add_argument("--target-ms", type=float, default=40.0)
    ap.add_argument("--stages", nargs="+", default=["bench", "accuracy", "resources"])
    ap.add_argument("--bits", type=int, default=2, choices=(2, 4), help="code width of the sass stage's kernel")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of the script (numbers mean nothing)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "hack_decode.jsonl")

    def log(row):
        print(json.dumps(row), flush=True)
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    log(dict(jax=jax.__version__, device=str(jax.devices()[0]), device_kind=jax.devices()[0].device_kind))
    for stage in args.stages:
        try:
            {"bench": lambda: bench(args, log), "accuracy": lambda: accuracy(log, "interpret" if args.interpret else "gpu"),
             "resources": lambda: resources(args.out, log), "profile": lambda: profile(args, log),
             "sass": lambda: sass(args.out, log, args.variants, args.bits)}[stage]()
        except Exception as e:
            log(dict(stage=stage, error=f"{type(e).__name__}: {str(e)[:600]}"))
            traceback.print_exc()


if __name__ == "__main__":
    main()
