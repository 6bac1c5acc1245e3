"""HACK decode kernel (pallas_kernels.decode_attention) and its fused-dequant baseline: configs on the GPU.

Per shape (Llama-3.1-8B heads: 32 q / 8 kv, head_dim 128; P 64, page 256, 4 sinks) and kernel
variant (dot dtype, num_splits, num_warps, num_stages): us per call, bytes read, GB/s and % of
4.3 TB/s; plus an accuracy pass (kernel vs the NumPy twin of tests/test_decode_kernels.py and vs
hack_jax's paged reference) and, best effort, ptxas' resource report of the compiled kernel.

Timing: one jitted lax.fori_loop of n calls, each call's query = q + 1e-3 * previous output (no
hoisting), wall clock / n, median of --reps loops. Caches smaller than 256 MiB are held in several
copies in one page pool and the calls rotate through them (page-table offset), so consecutive
calls do not hit the 60 MB L2.
bytes = codes + metadata + code sums of the kv_len tokens (84 B per token per kv head at d 128,
P 64) + open block + sinks + page table.

Usage: PYTHONPATH=. python3 bench/bench_hack_decode.py --out DIR [--shapes b8_32k b1_32k ...]
"""
from __future__ import annotations

import argparse
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

from pallas_kernels.decode_attention import KernelConfig, default_config, hack_decode_attention  # noqa: E402
from pallas_kernels.dequant_decode_attention import dequant_decode_attention  # noqa: E402

HQ, HKV, D, P, PAGE, NS = 32, 8, 128, 64, 256, 4
ROOF = 4.3e12
SHAPES = {"b8_32k": (8, 32768), "b1_32k": (1, 32768), "b1_128k": (1, 131072), "b8_8k": (8, 8192),
          "tiny": (1, 1024)}  # tiny: CPU smoke test of this script (--interpret)
FIELDS = ("k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums", "open_k",
          "open_v", "sink_k", "sink_v")


DEFAULT_VARIANTS = ["hack_int8=int8:d:4:2", "hack_f16=f16:d:4:2", "hack_bf16=bf16:d:4:2", "dequant=dequant:d:4:2"]


def variants(batch, kv_len, specs):
    """specs: NAME=DOT:SPLITS:WARPS:STAGES (DOT int8|int8asm|bf16|f16|dequant; SPLITS d = default_config's)."""
    pps = kv_len // PAGE
    base = default_config(batch=batch, num_kv_heads=HKV, pages_per_seq=pps, page_size=PAGE, partition_size=P)
    out = []
    for spec in specs:
        name, rest = spec.split("=")
        dot, splits, warps, stages = rest.split(":")
        splits = base.num_splits if splits == "d" else min(int(splits), pps)
        fn = dequant_decode_attention if dot == "dequant" else hack_decode_attention
        asm = dot == "int8asm"
        dot = {"dequant": "bf16", "int8asm": "int8"}.get(dot, dot)
        out.append((name, fn, KernelConfig(splits, int(warps), int(stages), dot, asm)))
    return out


def cache_bytes(batch, kv_len):
    per_token = 2 * D // 4 + 2 * 2 * D // P + D // P + 2 * 2 * (D // min(P, D)) + D // min(P, D)
    return batch * HKV * (kv_len * per_token + 2 * 2 * (P + NS) * D) + batch * (kv_len // PAGE) * 4


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
        k_codes=u8(ks[0], (num_pages, HKV, PAGE // 4, D)), v_codes=u8(ks[1], (num_pages, HKV, PAGE // 4, D)),
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


def time_variant(fn, config, c, table, lens, pages_per_copy, n_copies, batch, reps, target_ms, interpret=False):
    q0 = jax.random.normal(jax.random.PRNGKey(1), (batch, HQ, D), jnp.float32)
    arrays = [c[f] for f in FIELDS]

    @jax.jit
    def loop(q, n_iter, table, lens, *arrays):
        def body(i, q):
            t = table + (i % n_copies) * pages_per_copy
            out = fn(q, *arrays, t, lens, partition_size=P, num_sink_tokens=NS, config=config,
                     interpret=interpret)
            return q + 1e-3 * out
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
        times.append((time.perf_counter() - t0) / n)
    return float(np.median(times)) * 1e6, compile_s, n


def bench(args, log):
    for shape in args.shapes:
        batch, kv_len = SHAPES[shape]
        nbytes = cache_bytes(batch, kv_len)
        n_copies = max(1, min(8, math.ceil((256 << 20) / nbytes)))
        c, table, lens, ppc = make_inputs(batch, kv_len, n_copies)
        for name, fn, config in variants(batch, kv_len, args.variants):
            row = dict(shape=shape, batch=batch, kv_len=kv_len, variant=name, config=str(config), bytes=nbytes,
                       copies=n_copies)
            try:
                us, comp, n = time_variant(fn, config, c, table, lens, ppc, n_copies, batch, args.reps,
                                           args.target_ms, args.interpret)
                row.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), roof_pct=round(100 * nbytes / us / 1e-6 / ROOF, 1),
                           compile_s=round(comp, 1), calls=n)
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

    case = t.Case("llama_acc", 128, 64, 256, 8, 4, 8, (2048 + 4 + 37, 1000, 65, 1))
    q, c = t.build(case, seed=7)
    twin = t.numpy_kivi_decode(q, c, P=P, ns=NS)
    layer = kv_cache.KiviPages(**{f: jnp.asarray(c[f]) for f in FIELDS},
                               config=QuantConfig(partition_size=P, page_size=PAGE, num_sink_tokens=NS))
    ref = np.asarray(attention.decode_attention(jnp.asarray(q), layer, page_indices=jnp.asarray(c["page_indices"]),
                                                kv_lens=jnp.asarray(c["kv_lens"]), impl="reference"))
    scale = t.v_scale_of(c)
    log(dict(accuracy="hack_jax_reference_vs_twin", max_err=float(np.abs(ref - twin).max()), scale=scale))
    for dot in ("int8", "f16", "bf16"):
        for splits in (1, 5):
            out = t.run_kernel(hack_decode_attention, q, c, t.Case("x", 128, 64, 256, 8, 4, 8, case.kv_lens,
                                                                  num_splits=splits), mode, dot_dtype=dot)
            for name, r in (("twin", twin), ("hack_jax_ref", ref)):
                err = np.abs(out - r)
                log(dict(accuracy=f"hack_{dot}_splits{splits}_vs_{name}", max_err=float(err.max()),
                         mean_err=float(err.mean()), frac_over_tight=float((err > t.TIGHT * scale).mean()),
                         tight=t.TIGHT * scale, scale=scale))


def resources(out_dir, log):
    """Compile one small call with XLA dumping, then run ptxas -v on the PTX that holds the kernels."""
    dump = "/tmp/xla_dump_hack"
    code = ("import os,sys; sys.path.insert(0,'.'); sys.path.insert(0,'bench');"
            "import bench_hack_decode as b, jax;"
            "c,t,l,ppc=b.make_inputs(1,4096,1);"
            "q=jax.numpy.ones((1,32,128));"
            "[jax.block_until_ready(f(q,*[c[x] for x in b.FIELDS],t,l,partition_size=64,num_sink_tokens=4,config=cfg))"
            " for f,cfg in ((b.hack_decode_attention,b.KernelConfig(4,4,2,'int8')),(b.hack_decode_attention,b.KernelConfig(4,4,2,'f16')))]")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump}")
    subprocess.run([sys.executable, "-c", code], env=env, timeout=180, check=False)
    ptx_files = glob.glob(f"{dump}/**/*.ptx", recursive=True)
    import triton
    ptxas = [p for p in glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))]
    ptxas = ptxas[0] if ptxas else "ptxas"
    lines = [f"ptx files: {len(ptx_files)}; ptxas: {ptxas}"]
    for f in ptx_files:
        text = open(f).read()
        if "hack_decode" not in text and "dequant_decode" not in text:
            continue
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f, "-o", "/dev/null"], capture_output=True,
                           text=True, timeout=120)
        lines.append(f"== {os.path.basename(f)}\n{r.stderr[-6000:]}")
    with open(os.path.join(out_dir, "resources.txt"), "w") as fh:
        fh.write("\n".join(lines))
    log(dict(resources=lines[0], files=[os.path.basename(f) for f in ptx_files][:20]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=["b8_32k", "b1_32k", "b1_128k"], choices=sorted(SHAPES))
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="NAME=DOT:SPLITS:WARPS:STAGES")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=40.0)
    ap.add_argument("--stages", nargs="+", default=["bench", "accuracy", "resources"])
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
             "resources": lambda: resources(args.out, log)}[stage]()
        except Exception as e:
            log(dict(stage=stage, error=f"{type(e).__name__}: {str(e)[:600]}"))
            traceback.print_exc()


if __name__ == "__main__":
    main()
