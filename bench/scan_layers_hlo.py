"""Copies of the cache pages in the compiled decode step, per layer form (XLA's optimized HLO).

Builds a small random Llama (4 layers, 2 kv heads, head_dim 48, page_size 64, 37 pages: shapes no
other array has), compiles one decode step (jax.jit(...).lower(...).compile(), the platform's own
compiler: CPU here, the GPU on the device) in three forms and counts, in the optimized HLO text,
the instructions that produce an array of a cache-page shape:
  scan (in place)  ModelConfig.scan_layers=True: hack_jax.kv_cache.stacked's flat pool in the carry
  scan (sliced)    the same scan with each layer's slice copied in and out (the form before the
                   flat pool; forced here through kv_cache.stacked.flat_is_addressable = False)
  unrolled         scan_layers=False, a tuple of layer caches
Shapes counted: a layer's pool [N, ...] of each paged array ("layer"), the stacked [L, N, ...]
and the flat [L * N, ...] ("whole"); per opcode: copy, dynamic-slice, dynamic-update-slice,
fusion (a fusion producing such an array is a copy or slice kernel unless it is a scatter in place).

  PYTHONPATH=. python bench/scan_layers_hlo.py [--formats hack bf16 int8] [--impl reference]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
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


def _model(scan, impl):
    from hack_jax.backend import Backend
    cfg = ModelConfig(architecture="llama", vocab_size=96, num_layers=L, embed_dim=64, hidden_dim=80,
                      num_q_heads=4, num_kv_heads=2, head_dim=48, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_seq_len=2048, tied_embeddings=True, qkv_bias=False, scan_layers=scan,
                      attention=Backend(impl, options={"interpret": True} if impl != "reference" else {}))
    return Llama(cfg, rngs=nnx.Rngs(0))


def compiled_text(fmt, scan, impl, in_place=True):
    model = _model(scan, impl)
    quant = QuantConfig(kv_format=fmt, partition_size=16, page_size=64)
    cache = init_cache(model.config, quant, num_pages=N, max_seqs=S, pages_per_seq=PPS)
    graphdef, state = nnx.split(model)
    table = np.arange(1, 1 + S * PPS, dtype=np.int32).reshape(S, PPS)
    step = Step.decode(table, [100, 7], [True, True], jax.random.key(0), seal="always")

    def decode(state, tokens, cache, step):
        m = nnx.merge(graphdef, state)
        cache, hidden = m.run(tokens[:, None], step.kv_lens[:, None] - 1, cache, step)
        return cache, m.logits(hidden[:, 0])

    fn = jax.jit(decode, donate_argnames="cache")
    with mock.patch.object(stacked, "flat_is_addressable", lambda layers: in_place):
        lowered = fn.lower(state, jnp.zeros((S,), jnp.int32), cache, step)
    return lowered.compile().as_text(), cache


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
    args = ap.parse_args()
    print(f"platform {jax.default_backend()}, jax {jax.__version__}, L={L} layers, N={N} pages/layer, "
          f"impl {args.impl}")
    print("| format | form | " + " | ".join(f"{k} {op}" for k in ("layer", "whole") for op in OPS) + " |")
    print("|---|---|" + "---|" * (2 * len(OPS)))
    for fmt in args.formats:
        for name, scan, in_place in (("scan (in place)", True, True), ("scan (sliced)", True, False),
                                     ("unrolled", False, True)):
            text, cache = compiled_text(fmt, scan, args.impl, in_place)
            c = count(text, page_shapes(cache))
            print(f"| {fmt} | {name} | " + " | ".join(str(c[k, op]) for k in ("layer", "whole") for op in OPS)
                  + " |", flush=True)


if __name__ == "__main__":
    main()
