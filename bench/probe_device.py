"""What the GPU machine can do for the runtime's design choices, answered in one short run.

  python3 bench/probe_device.py --out DIR

1. jax-triton: a `@triton.jit` kernel through `jax_triton.triton_call` inside `jax.jit` (import,
   compile, result) and the custom-call target it lowers to.
2. Command buffers (CUDA graphs): which custom calls XLA's CommandBufferScheduling pass puts inside
   `command_buffer` computations of a small decode-like step (a Pallas-Triton kernel between XLA
   fusions, and the jax-triton kernel), under the default XLA_FLAGS and the ones passed in
   PROBE_XLA_FLAGS. An uncaptured custom call splits the graph into separate launches.
3. cuDNN attention: `jax.nn.dot_product_attention(implementation="cudnn")` for GQA causal bf16 prefill
   (Llama-3.1-8B heads) with and without per-sequence lengths, timed beside the XLA implementation.
Writes DIR/probe.json and prints a summary.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="xla_dump_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}"
                           " --xla_dump_hlo_as_text").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _time(fn, *args, reps=20):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def probe_jax_triton(report):
    try:
        import jax_triton as jt
        import triton
        import triton.language as tl
    except Exception as e:  # noqa: BLE001 - the report says what failed
        report["jax_triton"] = f"import failed: {type(e).__name__}: {e}"
        return None

    @triton.jit
    def add_kernel(x_ptr, y_ptr, o_ptr, n: tl.constexpr, block: tl.constexpr):
        i = tl.program_id(0) * block + tl.arange(0, block)
        tl.store(o_ptr + i, tl.load(x_ptr + i, mask=i < n) + tl.load(y_ptr + i, mask=i < n), mask=i < n)

    def add(x, y):
        return jt.triton_call(x, y, kernel=add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(x.size // 256,), n=x.size, block=256)

    x = jnp.arange(4096, dtype=jnp.float32)
    try:
        out = jax.jit(add)(x, 2 * x)
        ok = bool(np.allclose(np.asarray(out), 3 * np.arange(4096)))
        hlo = jax.jit(add).lower(x, x).as_text()
        target = re.findall(r'custom_call_target="([^"]+)"', hlo)
        report["jax_triton"] = {"version": getattr(jt, "__version__", "?"), "triton": triton.__version__,
                                "correct": ok, "targets": sorted(set(target))}
    except Exception as e:  # noqa: BLE001
        report["jax_triton"] = f"call failed: {type(e).__name__}: {str(e)[:400]}"
        return None
    return add


def probe_command_buffers(report, jt_add):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    def kern(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0

    def pallas_double(x):
        return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(x)

    def step(x, w):
        h = jnp.tanh(x @ w)            # cuBLAS + fusion
        h = pallas_double(h)           # Pallas-Triton custom call
        h = jnp.sin(h) @ w
        if jt_add is not None:
            h = jt_add(h.reshape(-1), h.reshape(-1)).reshape(h.shape)  # jax-triton custom call
        return jnp.cos(h) @ w

    x = jnp.ones((16, 256), jnp.float32)
    w = jnp.ones((256, 256), jnp.float32) / 256
    f = jax.jit(step)
    jax.block_until_ready(f(x, w))
    files = sorted(glob.glob(os.path.join(DUMP, "*jit_step*after_optimizations.txt")))
    text = open(files[-1]).read() if files else ""
    comps = re.split(r"\n(?=\S)", text)
    inside, outside = set(), set()
    for comp in comps:
        targets = re.findall(r'custom_call_target="([^"]+)"', comp)
        header = comp.split("\n", 1)[0]
        (inside if "command_buffer" in header else outside).update(targets)
    report["command_buffers"] = {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "num_command_buffer_computations": len(re.findall(r"^\S*command_buffer\S* ", text, re.M)),
        "custom_calls_inside": sorted(inside), "custom_calls_outside": sorted(outside - inside),
        "dump_file": os.path.basename(files[-1]) if files else None,
        "step_us": 1e6 * _time(f, x, w, reps=200)}


def probe_cudnn(report):
    b, t, n, k, h = 1, 16384, 32, 8, 128
    rng = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(rng[0], (b, t, n, h), jnp.bfloat16)
    kk = jax.random.normal(rng[1], (b, t, k, h), jnp.bfloat16)
    v = jax.random.normal(rng[2], (b, t, k, h), jnp.bfloat16)
    flops = 4 * b * n * h * t * t / 2
    rows = {}
    for impl in ("cudnn", "xla"):
        for lens in (False, True):
            name = f"{impl}{'_seqlens' if lens else ''}"
            kw = dict(query_seq_lengths=jnp.array([t - 100], jnp.int32),
                      key_value_seq_lengths=jnp.array([t - 100], jnp.int32)) if lens else {}
            fn = jax.jit(lambda q, kk, v, impl=impl, kw=kw: jax.nn.dot_product_attention(
                q, kk, v, is_causal=True, implementation=impl, **kw))
            try:
                s = _time(fn, q, kk, v, reps=5 if impl == "xla" else 20)
                rows[name] = {"ms": 1e3 * s, "tflops": flops / s / 1e12}
            except Exception as e:  # noqa: BLE001
                rows[name] = f"{type(e).__name__}: {str(e)[:300]}"
    report["cudnn_prefill_16k"] = rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    report = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "python": sys.version.split()[0]}
    jt_add = probe_jax_triton(report)
    probe_command_buffers(report, jt_add)
    probe_cudnn(report)
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
