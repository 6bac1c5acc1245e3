"""Offline (CPU-only) op count of one layer's non-sealing HACK decode step, lowered for CUDA.

Lowers `jax.jit(step, donate_argnums=0).trace(...).lower(lowering_platforms=("cuda",))` at a model's
shapes (no GPU needed, as bench/triton_offline.py) for two steps that compute the same thing:
  unfused  kv_cache.append(seal="never") then attention.decode_attention(impl="pallas")
  fused    attention.decode_step(impl="pallas", seal="never", fuse=True)  (pallas_kernels.fused_decode_attention)
and counts in the StableHLO: custom calls (each Pallas kernel is one; one launch each), scatters and
reductions (each at least one XLA fusion / launch), and the other compute ops (candidates for fusion;
layout ops such as reshape, slice, broadcast, convert and constants are listed apart, XLA folds most
into their neighbours). XLA's GPU fusion is not run here: the GPU profile (bench_generate.py
--profile-steps) is the measure of launches.

Usage: PYTHONPATH=$PWD python bench/decode_step_offline.py [--batch 1] [--context 4096] [--dump DIR]
"""
from __future__ import annotations

import argparse
import collections
import re

import jax
import jax.numpy as jnp

from hack_jax import attention, kv_cache, paging
from hack_jax.config import QuantConfig

LAYOUT = {"reshape", "broadcast_in_dim", "convert", "constant", "slice", "bitcast_convert", "iota",
          "transpose", "concatenate", "dynamic_slice", "return", "tuple", "get_tuple_element"}


def step_fns(impl_options):
    def unfused(layer, q, k, v, page_indices, kv_lens, active):
        layer = kv_cache.append(layer, k, v, kv_lens=kv_lens, active=active, page_indices=page_indices,
                                seal="never")  # kv_lens: held after the step (hack_jax.step)
        out = attention.decode_attention(q, layer, page_indices=page_indices, kv_lens=kv_lens, impl="pallas",
                                         **impl_options)
        return layer, out

    def fused(layer, q, k, v, page_indices, kv_lens, active):
        return attention.decode_step(q, k, v, layer, page_indices=page_indices, kv_lens=kv_lens, active=active,
                                     impl="pallas", seal="never", fuse=True, **impl_options)

    return dict(unfused=unfused, fused=fused)


def count_ops(text: str) -> collections.Counter:
    """stablehlo / chlo / mhlo op names in the lowered module's text (func.call bodies included)."""
    return collections.Counter(m.group(1) for m in re.finditer(r"=\s*\"?(?:stablehlo|chlo|mhlo)\.(\w+)", text))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--num-q-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dump", help="write each step's StableHLO text to DIR/NAME.mlir")
    args = ap.parse_args()
    config = QuantConfig()  # kivi, P 64, pages of 256, 4 sinks (the bench_generate.py "hack" format)
    pps = paging.pages_needed(args.context + 64, page_size=config.page_size,
                              num_sink_tokens=config.num_sink_tokens)
    s, h, hq, d = args.batch, args.num_kv_heads, args.num_q_heads, args.head_dim
    layer = jax.eval_shape(lambda: kv_cache.init_layer(config, num_kv_heads=h, head_dim=d,
                                                       num_pages=s * pps + 1, max_seqs=s))
    sds = jax.ShapeDtypeStruct
    inputs = (layer, sds((s, hq, d), jnp.bfloat16), sds((s, h, d), jnp.bfloat16), sds((s, h, d), jnp.bfloat16),
              sds((s, pps), jnp.int32), sds((s,), jnp.int32), sds((s,), jnp.bool_))
    print(f"one layer, batch {s}, capacity {pps} pages ({args.context} + 64 tokens), {hq}/{h} heads, d {d}, "
          f"jax {jax.__version__}")
    print(f"| step | custom calls | scatter | reduce | other compute ops | layout ops |")
    print(f"|---|---|---|---|---|---|")
    for name, fn in step_fns({}).items():
        text = jax.jit(fn, donate_argnums=0).trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()
        if args.dump:
            with open(f"{args.dump}/{name}.mlir", "w") as f:
                f.write(text)
        ops = count_ops(text)
        compute = {k: n for k, n in ops.items() if k not in LAYOUT | {"custom_call", "scatter", "reduce"}}
        layout = {k: n for k, n in ops.items() if k in LAYOUT}
        fmt = lambda c: ", ".join(f"{k} {n}" for k, n in sorted(c.items(), key=lambda kv: -kv[1]))
        print(f"| {name} | {ops['custom_call']} | {ops['scatter']} | {ops['reduce']} | "
              f"{sum(compute.values())} ({fmt(compute)}) | {sum(layout.values())} ({fmt(layout)}) |")


if __name__ == "__main__":
    main()
