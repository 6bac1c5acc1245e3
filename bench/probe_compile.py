"""Where the decode step's compile time goes: one lowering, compiled under several XLA option sets.

  python3 bench/probe_compile.py --out DIR [--formats hack bf16] [--seal never always seal_step] [--layers 32]
      [--scan]
      [--batch 8] [--context 32768] [--warm-compile]
      [--options '' 'xla_gpu_autotune_level=0' 'xla_gpu_enable_llvm_module_compilation_parallelism=true']

Per format and seal mode: the Llama-3.1-8B-shaped decode step (random weights, models.stepper.forward_step as
bench_generate.py compiles it) is lowered once, then compiled once per `--options` entry (comma-separated
key=value XLA debug options passed to `Lowered.compile`; '' = defaults; ints and booleans are parsed, the rest
kept as strings). Each row: seconds to lower, seconds per compile, and counts from the optimized HLO (fusions,
custom calls, command buffers, computations). Run with TF_CPP_VMODULE=gpu_compiler=1 TF_CPP_MIN_LOG_LEVEL=0 to
get XLA's own phase timers on stderr. Writes DIR/probe_compile.jsonl.
"""
from __future__ import annotations

import argparse
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


def parse_options(spec: str) -> dict:
    """'a=1,b=false,c=x' -> {'a': 1, 'b': False, 'c': 'x'}; '' -> {}."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif re.fullmatch(r"-?\d+", value):
            out[key] = int(value)
        else:
            out[key] = value
    return out


def hlo_counts(text: str) -> dict:
    return dict(fusions=len(re.findall(r"^\s*(?:ROOT )?%?\S+ = \S+ fusion\(", text, re.M)),
                custom_calls=text.count("custom_call_target="),
                command_buffers=len(re.findall(r"^%?command_buffer\S* ", text, re.M)),
                computations=len(re.findall(r"^(?:ENTRY )?%?\S+ .*\{\s*$", text, re.M)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--formats", nargs="+", default=["hack", "bf16"])
    ap.add_argument("--seal", nargs="+", default=["never", "after", "always"],
                    choices=("never", "after", "always", "seal_step"),
                    help="the decode step's seal mode(s); seal_step = the separate seal executable of a deferred "
                         "seal (models.stepper.seal_step, every layer at once)")
    ap.add_argument("--layers", type=int, default=0, help="0 = the model's own count")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--impl", default="pallas", choices=("pallas", "reference"))
    ap.add_argument("--options", nargs="+", default=[""])
    ap.add_argument("--scan", action="store_true", help="the layers as one lax.scan (default: unrolled, the GPU default)")
    ap.add_argument("--warm-compile", action="store_true", help="bench_generate's warm-up compile first")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.warm_compile:
        bg.warm_compiler(args.impl, False)
    cfg0 = bg.model_config(args.model, "bf16", args.impl, False, scan_layers=args.scan)
    cfg0 = dataclasses.replace(cfg0, num_layers=args.layers) if args.layers else cfg0
    _, state, _ = bg.random_state(cfg0, init="hash")
    b = args.batch
    tokens, targets = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32)
    for fmt in args.formats:
        cfg = bg.model_config(args.model, fmt, args.impl, False, scan_layers=args.scan)
        cfg = dataclasses.replace(cfg, num_layers=args.layers) if args.layers else cfg
        graphdef = nnx.split(nnx.eval_shape(lambda: mllama.Llama(cfg, rngs=nnx.Rngs(0))))[0]
        cache, _ = bg.filled_cache(cfg, bg.quant_config(fmt), b, args.context + 256)
        table = jnp.array(np.asarray(cache.page_indices))
        for seal in (args.seal if fmt == "hack" else ["always"]):
            step = Step("decode", table, jnp.full((b,), args.context + 1, jnp.int32), jnp.ones((b,), bool),
                        jax.random.key(2), "after" if seal == "seal_step" else seal)
            t0 = time.perf_counter()
            if seal == "seal_step":
                lowered = mstep.seal_step.lower(cache, step, None, attention=cfg.attention)
            else:
                lowered = mstep.forward_step.lower(state, tokens, step, cache, None, targets, graphdef=graphdef,
                                                   attention=cfg.attention, head=mstep.SampleHead(mgen.Sampling()))
            lower_s = time.perf_counter() - t0
            for spec in args.options:
                t0 = time.perf_counter()
                try:
                    text, error = lowered.compile(parse_options(spec) or None).as_text(), ""
                except Exception as e:  # an unknown option must not cost the other rows
                    text, error = "", f"{type(e).__name__}: {e}"[:300]
                row = dict(format=fmt, seal=seal, scan_layers=args.scan, layers=cfg.num_layers, batch=b, context=args.context,
                           options=spec, lower_s=round(lower_s, 2), compile_s=round(time.perf_counter() - t0, 2),
                           error=error, **hlo_counts(text), jax=jax.__version__, device=str(jax.devices()[0]))
                print(json.dumps(row), flush=True)
                with open(os.path.join(args.out, "probe_compile.jsonl"), "a") as fh:
                    fh.write(json.dumps(row) + "\n")
        del cache


if __name__ == "__main__":
    main()
