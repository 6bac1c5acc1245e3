"""GPU probe: the HACK decode kernel on layer i of a stacked cache at the whole-model benchmark's shapes
(Llama-3.1-8B heads, batch 8, capacity 32K + 64 in a 16-layer group vs 64K + 64 in a 32-layer stack), both
plane encodings (KernelConfig.denormal False / True), timed alone: is the subnormal planes' slow whole-model
row at capacity 32K + 64 (bench/NOTES_generate.md, session 14) the kernel at that shape? Also the registers
ptxas gives the device's own PTX of each (jaxlib's Triton compile hook, as bench_hack_decode --stages resources).

Usage: PYTHONPATH=. [PROBE_SHAPES="16:32832 32:65600"] [PROBE_Q=bfloat16|float32] [PROBE_OPEN_FULL=1|0]
       python bench/probe_stacked_speed.py   (PROBE_SHAPES: LAYERS:CAPACITY items)
The answer (session 15, bench/probe_stacked_dump.sh): a bf16 q made the subnormal planes slow; since then
`common.kernel_q` hands them a float32 q whatever PROBE_Q says.
"""
import functools
import os
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention import hack_decode_attention

HQ, HKV, D, P, PAGE, NS, B = 32, 8, 128, 64, 256, 4, 8
CTX = 32768


def arrays(L, cap, key):
    pps = -(-cap // PAGE)
    N = B * pps + 1
    k = iter(jax.random.split(key, 16))
    u8 = lambda *s: jax.random.randint(next(k), (L, N, HKV) + s, 0, 256, jnp.int32).astype(jnp.uint8)  # noqa
    f16 = lambda *s: (0.01 + 0.1 * jax.random.uniform(next(k), (L, N, HKV) + s)).astype(jnp.float16)  # noqa
    seq = lambda r: jax.random.normal(next(k), (L, B, HKV, r, D)).astype(jnp.bfloat16)  # noqa
    cache = [u8(PAGE // 4, D), f16(PAGE // P, D), f16(PAGE // P, D), u8(PAGE, 2), u8(D, PAGE // 4), f16(PAGE, 2),
             f16(PAGE, 2), u8(PAGE // P, D), seq(P), seq(P), seq(NS), seq(NS)]
    table = jnp.asarray(1 + np.arange(B * pps).reshape(B, pps), jnp.int32)
    return cache, table


ptx = []
try:
    from jax._src.lib import triton as jl_triton
    compile_fn = jl_triton.compile

    def keep(platform, module, arch, **kw):
        r = compile_fn(platform, module, arch, **kw)
        asm = getattr(r, "asm", None) or getattr(r, "ptx", None)
        if asm is not None:
            ptx.append(asm if isinstance(asm, str) else asm.decode())
        return r
    jl_triton.compile = keep
except Exception as e:  # noqa: BLE001
    print("no compile hook:", e)


def regs(text, name):
    import triton
    path = f"/tmp/{name}.ptx"
    open(path, "w").write(text)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", "/dev/null"], capture_output=True, text=True)
    return " ".join(ln.strip() for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln)[-300:]


for L, cap in [tuple(map(int, x.split(":"))) for x in os.environ.get("PROBE_SHAPES", "16:32832 32:65600").split()]:
    cache, table = arrays(L, cap, jax.random.key(L))
    lens = jnp.full((B,), NS + CTX, jnp.int32)
    q0 = jax.random.normal(jax.random.key(1), (B, HQ, D), jnp.dtype(os.environ.get("PROBE_Q", "bfloat16")))
    open_full = os.environ.get("PROBE_OPEN_FULL", "1") == "1"
    for dn in (False, True):
        @functools.partial(jax.jit, static_argnames=("n",))
        def loop(q, layer, *c, n):
            def body(i, q):
                out = hack_decode_attention(q, *c[:12], c[12], c[13], partition_size=P, num_sink_tokens=NS,
                                            dot_dtype="folded_f16", denormal=dn, layer_index=layer,
                                            open_full=open_full)
                return (q.astype(jnp.float32) + 1e-3 * out).astype(q.dtype)
            return jax.lax.fori_loop(0, n, body, q)
        ptx.clear()
        args = (q0, jnp.int32(L - 1), *cache, table, lens)
        loop(*args, n=2).block_until_ready()
        ts = {}
        for n in (20, 40):
            t = []
            for _ in range(5):
                s = time.perf_counter()
                loop(*args, n=n).block_until_ready()
                t.append(time.perf_counter() - s)
            ts[n] = float(np.median(t))
        us = (ts[40] - ts[20]) / 20 * 1e6
        name = f"L{L}_cap{cap}_q{q0.dtype}_open{int(open_full)}_{'dn' if dn else 'magic'}"
        print(f"{name}: {us:.1f} us per call; {regs(ptx[-1], name) if ptx else 'no ptx captured'}", flush=True)
    del cache
