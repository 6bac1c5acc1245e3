"""Copies of the cache pages in the compiled decode step, per layer form (XLA's optimized HLO).

Builds a small random Llama (4 layers, 2 kv heads, head_dim 64, default QuantConfig pages, 37 pages
per layer: shapes no other array has), compiles one decode step (jax.jit(...).lower(...).compile(),
the platform's own compiler: CPU here, the GPU on the device) in three forms and counts, in the
optimized HLO text, the instructions that produce an array of a cache-page shape:
  scan (in place)  ModelConfig.scan_layers=True: hack_jax.kv_cache.stacked's flat pool in the carry
  scan (sliced)    the same scan with each layer's slice copied in and out (the form before the
                   flat pool; the default on the CPU). Both scans are forced here through
                   kv_cache.stacked.use_flat (True / False)
  unrolled         scan_layers=False, a tuple of layer caches
Shapes counted: a layer's pool [N, ...] of each paged array ("layer"), the stacked [L, N, ...]
and the flat [L * N, ...] ("whole"); per opcode: copy, dynamic-slice, dynamic-update-slice,
fusion (a fusion producing such an array is a copy or slice kernel unless it is a scatter in place).

  PYTHONPATH=. python bench/scan_layers_hlo.py [--formats hack bf16 int8] [--impl reference]
  PYTHONPATH=. python bench/scan_layers_hlo.py --formats hack bf16 --impl pallas   # GPU (CPU: interpret)

--time: instead, per form, the compile time (lower + compile) of that decode step and its time per
step (--reps runs of --steps steps back to back, cache donated, the forms' runs alternating; min
and median) at a small model shape
(--layers layers, embed 256, 8 / 2 heads of 64, default QuantConfig pages, batch 2, 1024 tokens
held per slot; "scan (sliced)" here is the form before the flat pool).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hack_jax.config import QuantConfig
from hack_jax.kv_cache import stacked
from hack_jax.step import Step
from models.config import ModelConfig
from models.llama import Llama, init_cache

L, N, S, PPS = 4, 37, 2, 18
OPS = ("copy", "dynamic-slice", "dynamic-update-slice", "fusion", "scatter")


def _model(scan, impl, small=True, layers=L):
    from hack_jax.backend import Backend
    sizes = (dict(vocab_size=96, embed_dim=64, hidden_dim=80, num_q_heads=4, head_dim=64) if small else
             dict(vocab_size=512, embed_dim=256, hidden_dim=512, num_q_heads=8, head_dim=64))
    cfg = ModelConfig(architecture="llama", num_layers=layers, num_kv_heads=2, rms_norm_eps=1e-5,
                      rope_theta=1e4, max_seq_len=4096, tied_embeddings=True, qkv_bias=False,
                      scan_layers=scan, **sizes,
                      attention=Backend(impl, options={"interpret": True} if impl != "reference"
                                        and jax.default_backend() == "cpu" else {}))
    return Llama(cfg, rngs=nnx.Rngs(0))


def decode_fn(fmt, scan, impl, in_place=True, small=True, layers=L):
    """(jitted decode step, state, cache, step) of the HLO shapes (small) or the timing shapes."""
    model = _model(scan, impl, small, layers)
    if small:
        quant = QuantConfig(kv_format=fmt)
        num_pages, pps, lens = N, PPS, [300, 7]
    else:
        quant = QuantConfig(kv_format=fmt)
        num_pages, pps, lens = 1 + S * 5, 5, [1024, 1024]
    cache = init_cache(model.config, quant, num_pages=num_pages, max_seqs=S, pages_per_seq=pps)
    graphdef, state = nnx.split(model)
    table = np.arange(1, 1 + S * pps, dtype=np.int32).reshape(S, pps)
    step = Step.decode(table, lens, [True, True], jax.random.key(0), seal="always")

    def decode(state, tokens, cache, step):
        m = nnx.merge(graphdef, state)
        cache, hidden = m.run(tokens[:, None], step.kv_lens[:, None] - 1, cache, step)
        return cache, m.logits(hidden[:, 0])

    fn = jax.jit(decode, donate_argnames="cache")
    return fn, state, cache, step


def compiled_text(fmt, scan, impl, in_place=True):
    fn, state, cache, step = decode_fn(fmt, scan, impl, in_place)
    with mock.patch.object(stacked, "use_flat", lambda layers: in_place):
        lowered = fn.lower(state, jnp.zeros((S,), jnp.int32), cache, step)
    return lowered.compile().as_text(), cache


def timed(fmt, impl, layers, steps, reps, forms):
    """{form name: (compile s, [s per decode step of each rep])}: all forms compiled first, then the
    reps alternate between them (a loaded machine slows them alike)."""
    exes, out = {}, {}
    tokens = jnp.zeros((S,), jnp.int32)
    for name, scan, in_place in forms:
        fn, state, cache, step = decode_fn(fmt, scan, impl, in_place, small=False, layers=layers)
        t0 = time.perf_counter()
        with mock.patch.object(stacked, "use_flat", lambda layers: in_place):
            exe = fn.lower(state, tokens, cache, step).compile()
        out[name] = (time.perf_counter() - t0, [])
        cache, _ = exe(state, tokens, cache, step)  # warm-up
        exes[name] = [exe, state, cache, step]
    for _ in range(reps):
        for name, e in exes.items():
            exe, state, cache, step = e
            t = time.perf_counter()
            for _ in range(steps):
                cache, logits = exe(state, tokens, cache, step)
            jax.block_until_ready((cache, logits))
            e[2] = cache
            out[name][1].append((time.perf_counter() - t) / steps)
    return out


def page_shapes(cache):
    """{'layer': set of dims tuples, 'whole': ...} of the cache's paged arrays."""
    layer = cache.layers if not cache.stacked else jax.tree.map(lambda a: a[0], cache.layers)
    if isinstance(layer, tuple):
        layer = layer[0]
    shapes = {"layer": set(), "whole": set()}
    for f in dataclasses.fields(layer):
        if f.name != "config" and stacked.is_paged(f.name):
            dims = tuple(getattr(layer, f.name).shape)
            shapes["layer"].add(dims)
            shapes["whole"] |= {(L,) + dims, (L * dims[0],) + dims[1:]}
    return shapes


_INSTR = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) ([\w\-]+)\(")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def count(text, shapes):
    """Counter of (kind, opcode): instructions with an output (or tuple element) of those shapes."""
    counts = collections.Counter()
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m or m.group(2) not in OPS:
            continue
        outs = {tuple(int(d) for d in g.split(",") if d) for g in _SHAPE.findall(m.group(1))}
        for kind, ss in shapes.items():
            counts[kind, m.group(2)] += len(outs & ss)
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["hack", "bf16", "int8"])
    ap.add_argument("--impl", default="reference")
    ap.add_argument("--time", action="store_true", help="compile and per-step times instead of counts")
    ap.add_argument("--layers", type=int, default=8, help="--time: layers of the model")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    forms = (("scan (in place)", True, True), ("scan (sliced)", True, False), ("unrolled", False, True))
    if args.time:
        print(f"platform {jax.default_backend()}, jax {jax.__version__}, {args.layers} layers, impl "
              f"{args.impl}, batch {S}, 1024 tokens per slot\n")
        print("| format | form | compile s | ms / decode step: min | median | all reps |\n|---|---|---|---|---|---|")
        for fmt in args.formats:
            for name, (c, ts) in timed(fmt, args.impl, args.layers, args.steps, args.reps, forms).items():
                ms = sorted(t * 1e3 for t in ts)
                print(f"| {fmt} | {name} | {c:.2f} | {ms[0]:.2f} | {float(np.median(ms)):.2f} | "
                      f"{', '.join(f'{t * 1e3:.1f}' for t in ts)} |", flush=True)
        return
    print(f"platform {jax.default_backend()}, jax {jax.__version__}, L={L} layers, N={N} pages/layer, "
          f"impl {args.impl}")
    print("| format | form | " + " | ".join(f"{k} {op}" for k in ("layer", "whole") for op in OPS) + " |")
    print("|---|---|" + "---|" * (2 * len(OPS)))
    for fmt in args.formats:
        for name, scan, in_place in forms:
            text, cache = compiled_text(fmt, scan, args.impl, in_place)
            c = count(text, page_shapes(cache))
            print(f"| {fmt} | {name} | " + " | ".join(str(c[k, op]) for k in ("layer", "whole") for op in OPS)
                  + " |", flush=True)


if __name__ == "__main__":
    main()
