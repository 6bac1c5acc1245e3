"""What one compiled decode step is made of on the GPU, and whether the host or the GPU sets its pace.

  python3 bench/probe_step.py --out DIR [--formats hack bf16] [--layers 32] [--batch 1] [--context 4096]

Per format: the whole Llama-3.1-8B-shaped decoder (random weights, `--layers` of them), one decode
step compiled as bench_generate.py compiles it (models.stepper.forward_step, seal="never" for hack: the
63 of 64 steps that seal nothing), then
  hlo     the optimized HLO (`Compiled.as_text()`): the entry computation's instructions by opcode /
          custom-call target, split into those inside command buffers (XLA's CommandBufferScheduling
          wraps captured runs into `command_buffer` computations: one CUDA graph each) and those
          launched one by one from the host; the number of command buffers.
  timing  `--steps` steps back to back (each feeding its sampled tokens to the next, no host sync):
          enqueue = host time until the call returns, wall = time per step with block_until_ready at
          the end. enqueue ~ wall says the host sets the pace.
Writes DIR/probe_step.json and DIR/<format>_hlo.txt (the optimized HLO); with --profile N, the GPU time per kernel of N
traced steps (bench_generate.profile_kernels). XLA_FLAGS apply as given (run once per setting, in its own process).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import bench_generate as bg  # noqa: E402
from hack_jax.step import Step  # noqa: E402
from models import generate as mgen  # noqa: E402
from models import llama as mllama  # noqa: E402
from models import stepper as mstep  # noqa: E402

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = [^=]*?\b([a-z][\w\-]*)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CALLS = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")


def computations(text):
    """HLO module text -> ({name: [instruction lines]}, entry name)."""
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            name = m.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif name and line.strip() == "}":
            name = None
        elif name:
            comps[name].append(line)
    return comps, entry


def kind(line):
    """An instruction line -> its opcode, custom calls by target, fusions by their kind."""
    m = _INSTR.match(line)
    if not m:
        return None
    op = m.group(1)
    if op == "custom-call":
        t = _TARGET.search(line)
        return f"custom-call:{t.group(1) if t else '?'}"
    if op == "fusion":
        k = re.search(r"kind=(\w+)", line)
        return f"fusion:{k.group(1) if k else '?'}"
    return op


def analyze(text):
    comps, entry = computations(text)
    outside, inside = collections.Counter(), collections.Counter()
    buffers = 0
    for line in comps.get(entry, []):
        k = kind(line)
        if k is None or k in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
            continue
        callee = _CALLS.search(line)
        if k == "call" and callee and "command_buffer" in callee.group(1):
            buffers += 1
            for inner in comps.get(callee.group(1), []):
                ki = kind(inner)
                if ki and ki not in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
                    inside[ki] += 1
        else:
            outside[k] += 1
    return dict(command_buffers=buffers, inside=dict(inside.most_common()),
                outside=dict(outside.most_common()), inside_total=sum(inside.values()),
                outside_total=sum(outside.values()))


def probe(fmt, seals, args, state):
    """Rows for one format: per compiled step (seal mode) its HLO counts, timing and profile; with
    --alternate K (hack) one more row timing K-1 non-sealing steps then 1 sealing step, repeated."""
    cfg = bg.model_config(args.model, fmt, args.impl, False, scan_layers=args.scan)
    cfg = dataclasses.replace(cfg, num_layers=args.layers) if args.layers else cfg
    quant = bg.quant_config(fmt)
    graphdef = nnx.split(nnx.eval_shape(lambda: mllama.Llama(cfg, rngs=nnx.Rngs(0))))[0]
    cache, _ = bg.filled_cache(cfg, quant, args.batch, args.context + 256)
    table = jnp.array(np.asarray(cache.page_indices))
    b = args.batch
    tokens, targets = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32)
    active, key = jnp.ones((b,), bool), jax.random.key(2)
    ctx = args.context - args.context % 64 + 1  # the step after ctx holds no sealing position

    def record(i, seal):
        return Step("decode", table, jnp.full((b,), ctx + i, jnp.int32), active, key, seal)

    def timed(plan):  # plan: [(executable, record)] run back to back -> (enqueue, wall) ms per step
        nonlocal cache, tokens
        for exe, r in plan[:3]:
            cache, tokens, _ = exe(state, tokens, r, cache, None, targets)
        jax.block_until_ready((cache, tokens))
        runs = []
        for _ in range(args.reps):
            enqueue = 0.0
            t = time.perf_counter()
            for exe, r in plan:
                t1 = time.perf_counter()
                cache, tokens, _ = exe(state, tokens, r, cache, None, targets)
                enqueue += time.perf_counter() - t1
            jax.block_until_ready((cache, tokens))
            runs.append((enqueue / len(plan) * 1e3, (time.perf_counter() - t) / len(plan) * 1e3))
        enq, wall = np.median(np.array(runs), axis=0)
        return round(float(enq), 3), round(float(wall), 3), runs

    rows, exes = [], {}
    for seal in seals:
        t0 = time.perf_counter()
        exe = mstep.forward_step.lower(state, tokens, record(0, seal), cache, None, targets, graphdef=graphdef,
                                       attention=cfg.attention, head=mstep.SampleHead(mgen.Sampling())).compile()
        compile_s = time.perf_counter() - t0
        exes[seal] = exe
        text = exe.as_text()
        if args.save_hlo:
            with open(os.path.join(args.out, f"{fmt}_{seal}_hlo.txt"), "w") as fh:
                fh.write(text)
        row = dict(format=fmt, seal=seal, scan_layers=args.scan, layers=cfg.num_layers, batch=b, context=args.context,
                   compile_s=round(compile_s, 2), xla_flags=os.environ.get("XLA_FLAGS", ""), **analyze(text))
        plan = [(exe, record(i % 60, seal)) for i in range(args.steps)]
        jax.block_until_ready(plan[-1][1])
        row["enqueue_ms"], row["wall_ms"], row["runs"] = timed(plan)
        if args.profile:
            def run_steps():
                nonlocal cache, tokens
                for exe_, r in plan[:args.profile]:
                    cache, tokens, _ = exe_(state, tokens, r, cache, None, targets)
                jax.block_until_ready((cache, tokens))
            row.update(bg.profile_kernels(run_steps, args.profile, os.path.join(args.out, "trace_tmp"), top=25))
        report(row, f"{fmt} seal={seal}: {row['layers']} layers, compile {compile_s:.1f} s; ")
        rows.append(row)
    if args.alternate and {"never", "always"} <= set(exes):
        k = args.alternate
        plan = [(exes["always"], record(i % 60, "always")) if i % k == k - 1 else
                (exes["never"], record(i % 60, "never")) for i in range(args.steps)]
        row = dict(format=fmt, seal=f"alternate {k - 1} never + 1 always", layers=cfg.num_layers, batch=b,
                   context=args.context, xla_flags=os.environ.get("XLA_FLAGS", ""))
        row["enqueue_ms"], row["wall_ms"], row["runs"] = timed(plan)
        report(row, f"{fmt} {row['seal']}: ")
        rows.append(row)
    del cache
    return rows


def report(row, head):
    print(head + (f"command buffers {row['command_buffers']} holding {row['inside_total']} ops, "
                  f"{row['outside_total']} ops outside; " if "outside_total" in row else "")
          + f"enqueue {row['enqueue_ms']:.3f} ms/step, wall {row['wall_ms']:.3f} ms/step", flush=True)
    if "outside" in row:
        print(f"  outside: {row['outside']}", flush=True)
    if "gpu_kernels" in row:
        print(f"  GPU busy {row['gpu_us_per_step']:.0f} us/step; dearest kernels (us/step, calls/step):", flush=True)
        for name, us, calls in row["gpu_kernels"][:14]:
            print(f"    {us:9.1f} {calls:7.2f}  {name[:110]}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--formats", nargs="+", default=["hack", "bf16"])
    ap.add_argument("--layers", type=int, default=0, help="0 = the model's own count")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--impl", default="pallas", choices=("pallas", "reference"))
    ap.add_argument("--seal", nargs="+", default=["never"], choices=("never", "after", "always"),
                    help="hack's compiled step(s): never = the 63 of 64 steps that seal no block")
    ap.add_argument("--profile", type=int, default=0, help="trace this many steps: GPU time per kernel")
    ap.add_argument("--alternate", type=int, default=0,
                    help="K: also time K-1 non-sealing steps then 1 sealing step, repeated (hack, both seals)")
    ap.add_argument("--scan", action="store_true", help="the layers as one lax.scan (ModelConfig.scan_layers)")
    ap.add_argument("--save-hlo", action="store_true", help="write DIR/<format>_<seal>_hlo.txt")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cfg0 = bg.model_config(args.model, "bf16", args.impl, False, scan_layers=args.scan)
    if args.layers:
        cfg0 = dataclasses.replace(cfg0, num_layers=args.layers)
    _, state, _ = bg.random_state(cfg0, init="hash")
    rows = [row for fmt in args.formats for row in probe(fmt, args.seal if fmt == "hack" else ["always"], args, state)]
    with open(os.path.join(args.out, "probe_step.json"), "a") as fh:
        for row in rows:
            fh.write(json.dumps(dict(row, jax=jax.__version__, device=str(jax.devices()[0]))) + "\n")


if __name__ == "__main__":
    main()
