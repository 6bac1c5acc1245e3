"""Batch-1 K/V projections on the GPU: how XLA compiles a vector x small-matrix einsum, and what avoids it.

XLA:GPU strength-reduces a dot whose one operand is a vector and whose operands hold < 1e7 elements
(GpuAlgebraicSimplifier + IsMatrixMultiplicationTooSmallForRewriting) into multiply + reduce; at batch 1
the K and V projections of Llama-3.1-8B (4096 x 1024) and Qwen2.5-7B (3584 x 512) fall under it.
This times `layers` projections of one token (distinct weights, so HBM is read every time) per variant:
  plain   einsum("BTD,DKH->BTKH") for q, k, v apart (the model before)
  rows2   k and v of two rows (the token twice), the first row kept
  rows2z  the same with a zero second row
  qkv     one einsum over a fused [D, N + 2K, H] weight
and prints microseconds per layer, the bytes the weights hold, the GB/s that makes, and the number of
reduce / gemm fusions in the optimized HLO.

  PYTHONPATH=. python bench/probe_gemv.py [--layers 32] [--reps 20]
"""
from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp

SHAPES = {"llama-3.1-8b": (4096, 32, 8, 128), "qwen2.5-7b": (3584, 28, 4, 128)}


def variants():
  def plain(x, wq, wk, wv):
    return (jnp.einsum("BTD,DNH->BTNH", x, wq), jnp.einsum("BTD,DKH->BTKH", x, wk),
            jnp.einsum("BTD,DKH->BTKH", x, wv))

  def rows2(x, wq, wk, wv):
    x2 = jnp.concatenate([x, x], axis=0)
    return (jnp.einsum("BTD,DNH->BTNH", x, wq), jnp.einsum("BTD,DKH->BTKH", x2, wk)[:1],
            jnp.einsum("BTD,DKH->BTKH", x2, wv)[:1])

  def rows2z(x, wq, wk, wv):
    x2 = jnp.concatenate([x, jnp.zeros_like(x)], axis=0)
    return (jnp.einsum("BTD,DNH->BTNH", x, wq), jnp.einsum("BTD,DKH->BTKH", x2, wk)[:1],
            jnp.einsum("BTD,DKH->BTKH", x2, wv)[:1])

  def qkv(x, wqkv, n, k):
    y = jnp.einsum("BTD,DNH->BTNH", x, wqkv)
    return y[:, :, :n], y[:, :, n:n + k], y[:, :, n + k:]
  return plain, rows2, rows2z, qkv


def run(model, layers, reps):
  d, n, k, h = SHAPES[model]
  key = jax.random.key(0)
  x = jax.random.normal(key, (1, 1, d), jnp.bfloat16)
  plain, rows2, rows2z, qkv = variants()
  ws = [tuple(jax.random.normal(jax.random.fold_in(key, 3 * i + j), (d, c, h), jnp.bfloat16) * 0.02
              for j, c in enumerate((n, k, k))) for i in range(layers)]
  fused = [jnp.concatenate(w, axis=1) for w in ws]

  def chain(f, weights):
    def body(x):
      acc = x
      for w in weights:
        q, kk, vv = f(acc, *w) if not isinstance(w, jax.Array) else f(acc, w, n, k)
        acc = acc + (q.sum() + kk.sum() + vv.sum()).astype(acc.dtype) * 1e-6
      return acc
    return jax.jit(body)

  bytes_per_layer = d * (n + 2 * k) * h * 2
  for name, f, weights in (("plain", plain, ws), ("rows2", rows2, ws), ("rows2z", rows2z, ws), ("qkv", qkv, fused)):
    fn = chain(f, weights)
    compiled = fn.lower(x).compile()
    hlo = compiled.as_text()
    fusions = {kind: len(re.findall(rf"%{kind}[\w.]* = ", hlo)) for kind in ("input_reduce_fusion", "gemm_fusion",
                                                                             "loop_multiply_fusion", "custom-call")}
    jax.block_until_ready(compiled(x))
    t = time.perf_counter()
    for _ in range(reps):
      y = compiled(x)
    jax.block_until_ready(y)
    us = (time.perf_counter() - t) / reps / layers * 1e6
    print(f"{model:14s} {name:6s} {us:7.2f} us/layer  weights {bytes_per_layer / 1e6:.1f} MB/layer  "
          f"{bytes_per_layer / us / 1e3:6.0f} GB/s  {fusions}", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=32)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--models", nargs="+", default=list(SHAPES))
  a = ap.parse_args()
  print(jax.devices()[0].device_kind, "jax", jax.__version__)
  for m in a.models:
    run(m, a.layers, a.reps)


if __name__ == "__main__":
  main()
