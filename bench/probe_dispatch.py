"""Where a batch-1 decode step's host time and compile time go, in one short run.

  python3 bench/probe_dispatch.py --out DIR

1. Dispatch cost vs the number of array arguments: a jitted step taking N small donated arrays and
   returning them updated (as a decode step takes and returns its cache), N = 16 ... 1024; host time
   per call (enqueue only) and wall time per call in a loop of back-to-back calls. A hack cache layer
   is ~12 arrays (codes, scales, minimums, sums, open blocks, sinks), a bf16 layer 2: at 32 layers
   that is ~400 vs 64 arguments and as many outputs.
2. Compile time of one decode kernel alone (Llama-3.1-8B heads, batch 1, 4K tokens): the HACK kernel
   (int8 and folded_f16 operands) and the bf16 kernel, each jit(...).lower().compile() in a fresh
   cache, twice (the second shows what XLA / Triton cache between executables of one process).
Writes DIR/dispatch.json and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def dispatch(report, counts=(16, 64, 128, 256, 512, 1024), calls=200):
    rows = []
    for n in counts:
        arrays = tuple(jnp.zeros((8, 128), jnp.bfloat16) + i for i in range(n))

        def body(arrays, x):
            return tuple(a + x for a in arrays), x + 1

        step = jax.jit(body, donate_argnums=0)
        x = jnp.ones((), jnp.bfloat16)
        arrays, x = step(arrays, x)
        jax.block_until_ready(arrays)
        t = time.perf_counter()
        enq = 0.0
        for _ in range(calls):
            t1 = time.perf_counter()
            arrays, x = step(arrays, x)
            enq += time.perf_counter() - t1
        jax.block_until_ready(arrays)
        wall = (time.perf_counter() - t) / calls
        rows.append(dict(args=n, enqueue_us=round(enq / calls * 1e6, 1), wall_us=round(wall * 1e6, 1)))
        print(f"  {n:5d} donated arrays in+out: enqueue {enq / calls * 1e6:8.1f} us/call, "
              f"wall {wall * 1e6:8.1f} us/call", flush=True)
    report["dispatch"] = rows


def kernel_compile(report):
    from bench import bench_decode_attention as bda
    shape = bda.Shape("llama3.1-8b", 1, 4096)
    rows = []
    for name, prep, kw in (("hack_int8", bda.prep_hack, dict(variant_kwargs={"dot_dtype": "int8"})),
                           ("hack_folded_f16", bda.prep_hack, dict(variant_kwargs={"dot_dtype": "folded_f16"})),
                           ("bf16", bda.prep_bf16, {})):
        try:
            p = prep(shape, jax.random.key(0), interpret=False, **kw)
            q = jnp.zeros((1, 32, 128), jnp.bfloat16)
            for rep in range(2):
                fn = jax.jit(lambda q, a: p.call(q, 0, a))
                t = time.perf_counter()
                lowered = fn.lower(q, p.arrays)
                t_lower = time.perf_counter() - t
                lowered.compile()
                t_all = time.perf_counter() - t
                rows.append(dict(kernel=name, rep=rep, lower_s=round(t_lower, 3), compile_s=round(t_all - t_lower, 3)))
                print(f"  {name:16s} rep {rep}: lower {t_lower:6.2f} s, compile {t_all - t_lower:6.2f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - the report says what failed
            rows.append(dict(kernel=name, error=f"{type(e).__name__}: {str(e)[:500]}"))
            print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    report["kernel_compile"] = rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    report = dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()],
                  xla_flags=os.environ.get("XLA_FLAGS", ""))
    print("dispatch vs arguments:", flush=True)
    dispatch(report)
    print("decode kernel compile:", flush=True)
    kernel_compile(report)
    with open(os.path.join(args.out, "dispatch.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
