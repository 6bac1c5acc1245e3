"""Offline (CPU-only) op count of a whole model's decode step, lowered for CUDA, per layer.

Traces models.stepper.forward_step (the Generator's step: every slot, greedy head) for an abstract
model of --model's layer (models.config.PRESETS, default Llama-3.1-8B: embed 4096, 32 / 8 heads of 128,
hidden 14336; a small vocabulary; --layers layers, unrolled over a stacked cache, the GPU default) with impl="pallas",
batch --batch, a capacity of --context + 64 tokens, and lowers it with
`jax.jit(..., donate cache).trace(...).lower(lowering_platforms=("cuda",))` (no GPU, no weights: every
input is a ShapeDtypeStruct). Counts in the StableHLO, for seal="never" and seal="always", each with the
sink rows' writes (Step.sinks True) and without (False, what the Generator runs once every sequence holds
its sinks; the same for formats without sinks), per format:
custom calls (Pallas kernels: one launch each), scatters, dynamic-slice / dynamic-update-slice, other
compute ops (candidates for XLA fusions) and layout ops, each divided by the layer count after
subtracting the same count at one layer fewer (so the per-layer cost, without the embedding and head).
XLA's GPU fusion is not run: the GPU profile (bench_generate.py --profile-steps) is the measure of
launches; these counts say which ops XLA is handed.

Usage: PYTHONPATH=$PWD python bench/model_step_offline.py [--model qwen2.5-7b] [--batch 1] [--context 4096]
       [--layers 4]
"""
from __future__ import annotations

import argparse
import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hack_jax import kv_cache, paging
from hack_jax.backend import Backend
from hack_jax.config import QuantConfig
from hack_jax.step import Step
from models import stepper
from models.config import PRESETS, ModelConfig
from models.generate import Sampling
from models.llama import Llama, init_cache

LAYOUT = {"reshape", "broadcast_in_dim", "convert", "constant", "slice", "bitcast_convert", "iota",
          "transpose", "concatenate", "return", "tuple", "get_tuple_element", "optimization_barrier"}
# name -> (QuantConfig, Backend options); "hack-unfused": decode_step(fuse=False), the rows scattered in place
FORMATS = {"hack": (QuantConfig(), {}), "hack-unfused": (QuantConfig(), {"fuse": False}),
           "bf16": (QuantConfig(kv_format="bf16", num_sink_tokens=0), {})}
COLUMNS = ("custom_call", "scatter", "dynamic_slice", "dynamic_update_slice")


def count_ops(text: str) -> collections.Counter:
    """stablehlo / chlo / mhlo op names of the lowered module's entry function, each func.call replaced
    by the ops of its callee (jax emits one private function per distinct jitted call, called once per
    layer)."""
    bodies, name = {}, None
    for line in text.splitlines():
        head = re.match(r"\s*func\.func (?:public |private )?@([\w.$-]+)", line)
        if head:
            name = head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)

    @functools.cache
    def ops(fn: str) -> collections.Counter:
        body = "\n".join(bodies[fn])
        out = collections.Counter(m.group(1) for m in re.finditer(r"=\s*\"?(?:stablehlo|chlo|mhlo)\.(\w+)", body))
        for callee in re.findall(r"(?<!custom_)call @([\w.$-]+)\(", body):
            out += ops(callee)
        return out

    return ops("main")


def lowered_ops(fmt: str, layers: int, batch: int, context: int, seal: str, sinks: bool = True,
                model: str = "llama-3.1-8b") -> collections.Counter:
    quant, options = FORMATS[fmt]
    cfg = ModelConfig(**{**PRESETS[model], "num_layers": layers, "vocab_size": 1024, "max_seq_len": context + 64},
                      dtype=jnp.bfloat16, scan_layers=False, stack_cache=True, attention=Backend("pallas", options))
    pps = paging.pages_needed(context + 64, page_size=quant.page_size,
                              num_sink_tokens=kv_cache.sink_tokens(quant))
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: init_cache(cfg, quant, num_pages=batch * pps + 1, max_seqs=batch,
                                              pages_per_seq=pps))
    assert cache.stacked
    sds = jax.ShapeDtypeStruct
    i32 = lambda *shape: sds(shape, jnp.int32)
    step = Step.decode(np.zeros((batch, pps), np.int32), np.ones(batch, np.int32), np.ones(batch, bool),
                       jax.random.key(0), seal, sinks)
    step = jax.tree.map(lambda x: sds(x.shape, x.dtype), step)
    fn = functools.partial(stepper.forward_step, graphdef=graphdef, attention=cfg.attention,
                           head=stepper.SampleHead(Sampling()))
    text = (jax.jit(fn, donate_argnums=3).trace(state, i32(batch), step, cache, None, i32(batch))
            .lower(lowering_platforms=("cuda",)).as_text())
    return count_ops(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS))
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS))
    args = ap.parse_args()
    print(f"{args.model} layer, batch {args.batch}, {args.context} + 64 tokens, stacked cache, unrolled, "
          f"impl='pallas', per layer ({args.layers} vs {args.layers - 1} layers), jax {jax.__version__}")
    print("| format | seal | sinks | custom calls | scatter | dynamic_slice | dynamic_update_slice | other compute "
          "| layout |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in args.formats:
        for seal, sinks in ((seal, sinks) for seal in ("never", "always") for sinks in (True, False)):
            big, small = (lowered_ops(fmt, n, args.batch, args.context, seal, sinks, args.model)
                          for n in (args.layers, args.layers - 1))
            per = {k: big[k] - small[k] for k in set(big) | set(small)}
            compute = {k: n for k, n in per.items() if k not in LAYOUT and k not in COLUMNS and n}
            layout = sum(n for k, n in per.items() if k in LAYOUT)
            detail = ", ".join(f"{k} {n}" for k, n in sorted(compute.items(), key=lambda kv: -kv[1]))
            print(f"| {fmt} | {seal} | {sinks} | " + " | ".join(str(per.get(k, 0)) for k in COLUMNS)
                  + f" | {sum(compute.values())} ({detail}) | {layout} |")


if __name__ == "__main__":
    main()
