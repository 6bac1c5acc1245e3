"""Prefill attention: HACK (2-bit codes; bf16 / int8 dots) vs our bf16 kernel vs cuDNN vs jax's Pallas mha.

One causal prefill of one layer's attention, Llama-3.1-8B heads (32 q / 8 kv, head_dim 128), batch 1,
prompts of 4K, 16K and 32K tokens. Per impl and shape: us per call and effective TFLOP/s, all impls
counted alike: causal attention = 2 * 2 * B * Hq * S^2 * d / 2 flops (QK^T and PV, half the square).

Impls:
  hack_bf16dot, hack_int8dot  pallas_kernels.prefill_attention.hack_prefill_attention on a kivi cache
                              (P 64, page 256, 4 sinks) written by hack_jax.kv_cache.write_prefill from
                              random K/V; dot_dtype "bf16" / "int8"; default_config unless a sweep name
                              says otherwise (hack_bf16dot[block_q=32,num_warps=8] ...).
  hack_write                  hack_jax.kv_cache.write_prefill of the prompt's K/V into that cache (the
                              one-time quantization + page write prefill adds to the attention; no flops).
  bf16                        pallas_kernels.bf16_prefill_attention (ours, paged bf16 cache, page 256).
  cudnn                       jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
                              contiguous bf16 [B, S, heads, d], GQA native.
  jax_mha                     jax.experimental.pallas.ops.gpu.attention.mha(causal=True), bf16, block
                              128 x 128; MHA only, so K/V are stored repeated to 32 heads (not timed).
  prefill_*                   the per-layer call the model makes, hack_jax.prefill.prefill(q, k, v, empty
                              layer, ...): the cache write + the prompt's attention. prefill_exact: hack
                              cache, exact attention on the 16-bit K/V ("auto": cuDNN on the GPU);
                              prefill_pallas: the same with our bf16 Pallas kernel; prefill_homomorphic:
                              hack cache, the paper's homomorphic kernel over the written codes (Pallas,
                              bf16 dots); prefill_bf16: bf16 cache + cuDNN (a bf16 runtime's prefill).
  prefix_hack_f16, prefix_hack_int8, prefix_cudnn
                              a chunked prefill's cached-prefix half: S queries over S cached tokens, no
                              mask (their flops count the full square, 2x the causal count): the HACK
                              kernel with prefix=True (dot_dtype "folded_f16" / "bf16" = INT8 requantized)
                              and cuDNN over a contiguous bf16 prefix.

Timing (us): per impl one jitted lax.fori_loop of n calls; each call's query depends on the previous
call's output (one element of q += 1e-30 * out[0]), so no call can be hoisted or merged; loops of n
and 2n calls are timed wall-clock (block_until_ready), median of --reps each, us = (t(2n) - t(n)) / n
(dispatch and other fixed costs cancel; if noise makes that implausible, t(2n) / 2n). us_wall: the
median of single jitted calls with block_until_ready. Any impl that fails for a shape is recorded
with its error and the run goes on; outputs are rewritten after every row, and rows past
--time-budget seconds are recorded as skipped, so a time limit loses nothing already measured.

Usage: python3 bench/bench_prefill_attention.py [--quick | --smoke] [--impls ...] [--out DIR]
  --quick: the 3 shapes with every impl, plus a small config sweep of our kernels at 16K.
  --smoke: CPU check of the script itself (interpret=True, tiny shapes); numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)  # Pallas-Triton and ops/gpu, jax >= 0.11

HEADS = {"llama3.1-8b": (32, 8, 128), "tiny": (4, 2, 64)}
SEQS = (4096, 16384, 32768)
SMOKE = [("tiny", 1, 128), ("tiny", 2, 256)]
IMPLS = ("hack_bf16dot", "hack_int8dot", "hack_write", "bf16", "cudnn", "jax_mha",
         "prefill_exact", "prefill_pallas", "prefill_homomorphic", "prefill_bf16",
         "prefix_hack_f16", "prefix_hack_int8", "prefix_cudnn")
PREFIX_DOTS = {"prefix_hack_f16": "folded_f16", "prefix_hack_int8": "bf16"}  # prefix impl -> kernel dot_dtype
PREFILL_PATHS = {  # impl -> (kv_format, hack_jax.prefill attention): the whole per-layer prefill call
    "prefill_exact": ("hack", "auto"), "prefill_pallas": ("hack", "pallas"),
    "prefill_homomorphic": ("hack", "homomorphic"), "prefill_bf16": ("bf16", "auto")}
# --quick's sweep at 16K (name suffix -> KernelConfig fields): rows = block_q * 4 (G = 4).
QUICK_SWEEP_SEQ = 16384
HACK_SWEEP = [  # NOTES_prefill.md v2: the offline SASS ranking's candidates (the default is in the matrix)
    ("bf16", dict(block_q=32, num_warps=8)),  # 128 rows: 3539 vs 3461 loop instructions per 16 rows
    ("int8", dict()),  # int8 dots (IGMMA; V codes token-major: offline 3504 loop instructions)
]
PREFIX_SWEEP = [dict(block_q=32, num_warps=8), dict(block_q=16, num_warps=8), dict(block_q=32, num_warps=4)]
BF16_SWEEP = [dict(block_q=16, block_k=64, num_warps=4), dict(block_q=32, block_k=128, num_warps=8),
              dict(block_q=32, block_k=64, num_warps=8, num_stages=3), dict(block_q=64, block_k=64, num_warps=8)]
PAGE_SIZE = 256


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: str
    batch: int
    seq: int

    @property
    def dims(self):
        return HEADS[self.heads]

    @property
    def flops(self):  # causal: half of the S^2 work of QK^T and PV
        num_q_heads, _, head_dim = self.dims
        return 2 * 2 * self.batch * num_q_heads * self.seq ** 2 * head_dim // 2


@dataclasses.dataclass
class Prepared:
    """call(q, arrays) -> any array (its first element feeds the next call's q)."""
    call: object
    arrays: object
    config: str
    flops: float = 1.0  # times Shape.flops (the causal count); 0: no flops (a write)


def rand_bf16(key, shape, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)


def shuffled_table(key, batch, pages_per_seq):
    """i32[batch, pages_per_seq]: a shuffled pool of pages 1..batch * pages_per_seq (0 = null page)."""
    perm = jax.random.permutation(key, batch * pages_per_seq).astype(jnp.int32) + 1
    return perm.reshape(batch, pages_per_seq)


# ----------------------------------------------------------------------------- impls

def _hack_cache(shape, key):
    from hack_jax import kv_cache, paging
    from hack_jax.config import QuantConfig
    config = QuantConfig(page_size=PAGE_SIZE)
    num_q_heads, num_kv_heads, head_dim = shape.dims
    pps = paging.pages_needed(shape.seq, page_size=PAGE_SIZE, num_sink_tokens=config.num_sink_tokens)
    k1, k2, k3 = jax.random.split(key, 3)
    table = shuffled_table(k1, shape.batch, pps)
    kv = (shape.batch, shape.seq, num_kv_heads, head_dim)
    k = jax.random.normal(k2, kv, jnp.float32) + 0.5  # a per-channel-ish offset, like real K
    v = jax.random.normal(k3, kv, jnp.float32)
    lens = jnp.full((shape.batch,), shape.seq, jnp.int32)
    layer = kv_cache.init_layer(config, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                num_pages=1 + shape.batch * pps, max_seqs=shape.batch)
    layer = jax.jit(kv_cache.write_prefill)(layer, k, v, lengths=lens, page_indices=table)
    return layer, table, lens, k, v


def prep_hack(shape, key, *, interpret, dot_dtype, fields=None):
    from hack_jax import attention
    from pallas_kernels import prefill_attention as mod
    layer, table, lens, _, _ = _hack_cache(shape, key)
    arrays, static = attention.kernel_args(layer)  # the kernel takes a layer's arrays, as the dispatch passes them
    num_q_heads, num_kv_heads, _ = shape.dims
    config = mod.default_config(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, q_len=shape.seq,
                                dot_dtype=dot_dtype)
    config = dataclasses.replace(config, **(fields or {}))

    def call(q, a):
        return mod.hack_prefill_attention(q, *a["cache"], a["table"], a["lens"], **static, config=config,
                                          interpret=interpret)

    return Prepared(call, dict(cache=arrays, table=table, lens=lens),
                    f"kivi P=64 page_size={PAGE_SIZE} ns=4 {config}")


def prep_hack_write(shape, key, *, interpret):
    from hack_jax import kv_cache
    del interpret
    layer, table, lens, k, v = _hack_cache(shape, key)
    empty = jax.tree.map(jnp.zeros_like, layer)

    def call(q, a):
        k = a["k"].at[0, 0, 0, 0].add(1e-30 * q[0, 0, 0, 0].astype(jnp.float32))  # depends on the carry
        return kv_cache.write_prefill(a["empty"], k, a["v"], lengths=a["lens"], page_indices=a["table"]).k_scale

    return Prepared(call, dict(empty=empty, k=k, v=v, table=table, lens=lens),
                    f"kv_cache.write_prefill, kivi P=64 page_size={PAGE_SIZE} ns=4, f32 K/V in", flops=0.0)


def prep_prefix_hack(shape, key, *, interpret, dot_dtype, fields=None):
    """A chunk of S queries over S cached tokens, all visible (the HACK prefill kernel, prefix=True)."""
    from hack_jax import attention
    from pallas_kernels import prefill_attention as mod
    layer, table, lens, _, _ = _hack_cache(shape, key)
    arrays, static = attention.kernel_args(layer)
    num_q_heads, num_kv_heads, _ = shape.dims
    config = dataclasses.replace(mod.default_config(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                                    q_len=shape.seq, dot_dtype=dot_dtype), **(fields or {}))

    def call(q, a):
        return mod.hack_prefill_attention(q, *a["cache"], a["table"], a["lens"], **static, prefix=True,
                                          config=config, interpret=interpret)[0]

    return Prepared(call, dict(cache=arrays, table=table, lens=lens),
                    f"prefix=True {config}, kivi P=64 page_size={PAGE_SIZE} ns=4; S queries x S "
                    "cached keys, no mask (flops: the full square)", flops=2.0)


def prep_prefix_cudnn(shape, key, *, interpret):
    """The bf16 runtime's chunk-over-prefix: cuDNN, S queries over S contiguous bf16 keys, no mask."""
    del interpret
    _, num_kv_heads, head_dim = shape.dims

    def call(q, a):
        return jax.nn.dot_product_attention(q, a["k"], a["v"], scale=1 / math.sqrt(head_dim), implementation="cudnn")

    return Prepared(call, _contiguous(shape, key, num_kv_heads),
                    "jax.nn.dot_product_attention(implementation='cudnn'), no mask, bf16 [B, S, N, d], GQA "
                    "(flops: the full square; the model also gathers the pages first, not timed here)", flops=2.0)


def prep_bf16(shape, key, *, interpret, fields=None):
    from pallas_kernels import bf16_prefill_attention as mod
    num_q_heads, num_kv_heads, head_dim = shape.dims
    pps = -(-shape.seq // PAGE_SIZE)
    k1, k2, k3 = jax.random.split(key, 3)
    pool = (1 + shape.batch * pps, num_kv_heads, PAGE_SIZE, head_dim)
    arrays = dict(k=rand_bf16(k2, pool), v=rand_bf16(k3, pool), table=shuffled_table(k1, shape.batch, pps),
                  lens=jnp.full((shape.batch,), shape.seq, jnp.int32))
    config = mod.default_config(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, q_len=shape.seq,
                                head_dim=head_dim, page_size=PAGE_SIZE)
    config = dataclasses.replace(config, **(fields or {}))

    def call(q, a):
        return mod.bf16_prefill_attention(q, a["k"], a["v"], a["table"], a["lens"], config=config,
                                          interpret=interpret)

    return Prepared(call, arrays, f"paged page_size={PAGE_SIZE} {config}")


def prep_prefill(shape, key, *, interpret, kv_format, attention):
    from hack_jax import kv_cache, paging
    from hack_jax import prefill as hp
    from hack_jax.config import QuantConfig
    config = QuantConfig(kv_format=kv_format, page_size=PAGE_SIZE)
    _, num_kv_heads, head_dim = shape.dims
    sinks = kv_cache.sink_tokens(config)
    pps = paging.pages_needed(shape.seq, page_size=PAGE_SIZE, num_sink_tokens=sinks)
    k1, k2 = jax.random.split(key)
    arrays = dict(_contiguous(shape, k2, num_kv_heads), table=shuffled_table(k1, shape.batch, pps),
                  lens=jnp.full((shape.batch,), shape.seq, jnp.int32),
                  empty=kv_cache.init_layer(config, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                            num_pages=1 + shape.batch * pps, max_seqs=shape.batch))
    options = dict(impl="pallas", interpret=interpret) if attention == "homomorphic" else (
        dict(interpret=interpret) if attention == "pallas" else {})

    def call(q, a):
        return hp.prefill(q, a["k"], a["v"], a["empty"], page_indices=a["table"], lengths=a["lens"],
                          attention=attention, **options)[1]

    backend = attention if attention == "homomorphic" else hp.resolve(attention, jnp.bfloat16, jnp.bfloat16)
    return Prepared(call, arrays, f"hack_jax.prefill.prefill(attention={attention!r} -> {backend}), "
                    f"kv_format={kv_format} page_size={PAGE_SIZE}, bf16 q/k/v: write + attention")


def _contiguous(shape, key, kv_heads):
    _, _, head_dim = shape.dims
    k1, k2 = jax.random.split(key)
    kv = (shape.batch, shape.seq, kv_heads, head_dim)
    return dict(k=rand_bf16(k1, kv), v=rand_bf16(k2, kv))


def prep_cudnn(shape, key, *, interpret):
    del interpret
    num_q_heads, num_kv_heads, head_dim = shape.dims

    def call(q, a):
        return jax.nn.dot_product_attention(q, a["k"], a["v"], is_causal=True, scale=1 / math.sqrt(head_dim),
                                            implementation="cudnn")

    return Prepared(call, _contiguous(shape, key, num_kv_heads),
                    "jax.nn.dot_product_attention(implementation='cudnn', is_causal=True), bf16 [B, S, N, d], GQA")


def prep_jax_mha(shape, key, *, interpret):
    from jax.experimental.pallas.ops.gpu import attention as jax_attention
    num_q_heads, num_kv_heads, head_dim = shape.dims
    arrays = _contiguous(shape, key, num_kv_heads)
    arrays = {n: jnp.repeat(x, num_q_heads // num_kv_heads, axis=2) for n, x in arrays.items()}  # MHA only
    block = min(128, shape.seq)
    sizes = jax_attention.BlockSizes(block_q=block, block_k=block)

    def call(q, a):
        return jax_attention.mha(q, a["k"], a["v"], None, sm_scale=1 / math.sqrt(head_dim), causal=True,
                                 block_sizes=sizes, interpret=interpret)

    return Prepared(call, arrays, f"ops.gpu.attention.mha causal, block {block}x{block}, num_warps default, "
                    "num_stages 2, K/V pre-repeated to the q heads (not timed)")


# ----------------------------------------------------------------------------- timing

def time_impl(prep, shape, *, reps, target_s, key, wall_calls, lower_only=False):
    """Returns (us per call from the loop slope, us per call wall clock, first call s, n_iter);
    lower_only: lowers the timed loop for CUDA instead (no GPU needed) and returns None."""
    num_q_heads, _, head_dim = shape.dims
    q0 = jax.random.normal(key, (shape.batch, shape.seq, num_q_heads, head_dim), jnp.float32).astype(jnp.bfloat16)

    @jax.jit
    def loop(q0, n_iter, arrays):
        def body(_, q):
            out = prep.call(q, arrays)
            feed = 1e-30 * out.reshape(-1)[0].astype(jnp.float32)
            return q.at[0, 0, 0, 0].add(feed.astype(q.dtype))  # one element: the next call depends on this one
        return lax.fori_loop(0, n_iter, body, q0)

    if lower_only:
        loop.trace(q0, jnp.int32(1), prep.arrays).lower(lowering_platforms=("cuda",))
        jax.jit(prep.call).trace(q0, prep.arrays).lower(lowering_platforms=("cuda",))
        return None

    def run(n_iter):
        t0 = time.perf_counter()
        loop(q0, jnp.int32(n_iter), prep.arrays).block_until_ready()
        return time.perf_counter() - t0

    first_s = run(1)  # compile + warm up
    out = jax.jit(prep.call)(q0, prep.arrays)
    if not bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))):
        raise FloatingPointError("non-finite output")
    t1 = run(1)
    n_iter = int(np.clip(target_s / max(t1, 1e-6), 2, 1000))
    t_n = float(np.median([run(n_iter) for _ in range(reps)]))
    t_2n = float(np.median([run(2 * n_iter) for _ in range(reps)]))
    us = (t_2n - t_n) / n_iter * 1e6
    plain = t_2n / (2 * n_iter) * 1e6  # fixed costs included: an upper bound
    if not 0.5 * plain < us <= plain * 1.05:
        us = plain
    one = jax.jit(prep.call)
    walls = []
    for _ in range(wall_calls):
        t0 = time.perf_counter()
        one(q0, prep.arrays).block_until_ready()
        walls.append(time.perf_counter() - t0)
    return us, float(np.median(walls)) * 1e6, first_s, n_iter


# ----------------------------------------------------------------------------- outputs

def write_outputs(rows, out_dir, header, no_plot):
    order = {name: i for i, name in enumerate(IMPLS)}
    rows.sort(key=lambda r: (r["heads"], r["batch"], r["seq"], order.get(r["impl"].split("[")[0], 99), r["impl"]))
    base = {(r["heads"], r["batch"], r["seq"]): r["us"] for r in rows if r["impl"] == "cudnn" and "us" in r}
    for r in rows:
        b = base.get((r["heads"], r["batch"], r["seq"]))
        r["time_vs_cudnn"] = r["us"] / b if b and "us" in r else None
    with open(os.path.join(out_dir, "prefill_attention.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    lines = [header, "", "| heads | batch | seq | impl | us | us wall | TFLOP/s | time / cuDNN | config / note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['heads']} | {r['batch']} | {r['seq']} | {r['impl']} |"
        if "us" not in r:
            lines.append(f"{head} - | - | - | - | {'FAILED: ' if 'skipped' not in r['error'] else ''}"
                         f"{r['error'][:160].replace('|', '/').replace(chr(10), ' ')} |")
            continue
        tf = f"{r['tflops']:.3g}" if r.get("tflops") is not None else "-"
        ratio = f"{r['time_vs_cudnn']:.2f}" if r.get("time_vs_cudnn") is not None else "-"
        lines.append(f"{head} {r['us']:.0f} | {r['us_wall']:.0f} | {tf} | {ratio} | {r['config'][:160]} |")
    with open(os.path.join(out_dir, "prefill_attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not no_plot:
        write_plot(rows, os.path.join(out_dir, "prefill_attention.png"))


def write_plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no plot: {e}")
        return
    ok = [r for r in rows if r.get("tflops") is not None and "[" not in r["impl"]]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in sorted({r["impl"] for r in ok}, key=lambda x: IMPLS.index(x) if x in IMPLS else 99):
        pts = sorted((r["seq"], r["tflops"]) for r in ok if r["impl"] == impl)
        ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("effective TFLOP/s (causal)")
    r0 = ok[0]
    ax.set_title(f"causal prefill attention, {r0['heads']} heads, batch {r0['batch']}\n"
                 f"{r0['gpu']}, jax {r0['jax_version']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def impl_preps(names, interpret, sweep, bf16_sweep=True):
    """[(name, shape filter or None, prep_fn)]: the default configs, plus --quick's sweep at 16K (the
    hack sweep runs once if any hack dot impl is listed, whatever its entries' dot dtypes)."""
    preps = []
    hack_swept = False
    for name in names:
        if name.startswith("hack_") and name != "hack_write":
            dot = name[len("hack_"):-len("dot")]
            preps.append((name, None, functools.partial(prep_hack, interpret=interpret, dot_dtype=dot)))
            for d, fields in (HACK_SWEEP if sweep and not hack_swept else []):
                label = f"hack_{d}dot[{','.join(f'{k}={v}' for k, v in fields.items()) or 'default'}]"
                preps.append((label, QUICK_SWEEP_SEQ, functools.partial(prep_hack, interpret=interpret,
                                                                       dot_dtype=d, fields=fields)))
            hack_swept = True
        elif name == "bf16":
            preps.append((name, None, functools.partial(prep_bf16, interpret=interpret)))
            for fields in (BF16_SWEEP if sweep and bf16_sweep else []):
                label = f"bf16[{','.join(f'{k}={v}' for k, v in fields.items())}]"
                preps.append((label, QUICK_SWEEP_SEQ, functools.partial(prep_bf16, interpret=interpret,
                                                                       fields=fields)))
        elif name in PREFIX_DOTS:
            preps.append((name, None, functools.partial(prep_prefix_hack, interpret=interpret,
                                                        dot_dtype=PREFIX_DOTS[name])))
            for fields in (PREFIX_SWEEP if sweep and name == "prefix_hack_f16" else []):
                label = f"{name}[{','.join(f'{k}={v}' for k, v in fields.items())}]"
                preps.append((label, QUICK_SWEEP_SEQ, functools.partial(
                    prep_prefix_hack, interpret=interpret, dot_dtype=PREFIX_DOTS[name], fields=fields)))
        elif name in PREFILL_PATHS:
            fmt, attention = PREFILL_PATHS[name]
            preps.append((name, None, functools.partial(prep_prefill, interpret=interpret, kv_format=fmt,
                                                        attention=attention)))
        else:
            fn = {"hack_write": prep_hack_write, "cudnn": prep_cudnn, "jax_mha": prep_jax_mha,
                  "prefix_cudnn": prep_prefix_cudnn}[name]
            preps.append((name, None, functools.partial(fn, interpret=interpret)))
    return preps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true", help="3 shapes, every impl, + a config sweep at 16K")
    ap.add_argument("--smoke", action="store_true", help="CPU check: interpret=True, tiny shapes")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--seqs", nargs="+", type=int, default=list(SEQS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sweep", action="store_true", help="the config sweep at 16K (on with --quick)")
    ap.add_argument("--no-bf16-sweep", action="store_true", help="sweep the hack kernel only")
    ap.add_argument("--sweep-early", action="store_true",
                    help="run the 16K sweep right after the 16K rows, before longer shapes (default: after all)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--target-s", type=float, default=0.4, help="wall time of one timed loop of n calls")
    ap.add_argument("--wall-calls", type=int, default=5)
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds; later rows are skipped")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--lower-cuda", action="store_true",
                    help="CPU check: build every impl (at --seqs, default 4096) and lower its timed loop for CUDA "
                         "(Pallas -> Triton IR) instead of running it; writes nothing")
    ap.add_argument("--sass", metavar="DIR",
                    help="CPU-only: compile every hack config of the run offline for sm_90 (pip triton 3.6.0 in "
                         "PYTHONPATH, e.g. /tmp/tri) and report registers and the main loops' SASS; writes DIR/sass.jsonl")
    ap.add_argument("--sass-configs", nargs="*", metavar="NAME:FIELDS",
                    help="extra configs for --sass, e.g. q32w8:block_q=32,num_warps=8,dot_dtype=int8 "
                         "(prefix=1: prefix mode)")
    args = ap.parse_args(argv)
    if args.sass:
        return sass_report(args)
    if args.lower_cuda:
        return lower_cuda(args)
    t_start = time.perf_counter()
    interpret = args.smoke
    if args.smoke:
        shapes = [Shape(*s) for s in SMOKE]
        args.reps, args.target_s, args.wall_calls = 2, 0.01, 2
    else:
        shapes = [Shape("llama3.1-8b", args.batch, s) for s in args.seqs]
    sweep = args.sweep or args.quick or args.smoke
    os.makedirs(args.out, exist_ok=True)

    device = jax.devices()[0]
    gpu = getattr(device, "device_kind", str(device))
    timing = (f"us: slope of wall clock over jitted lax.fori_loops of n and 2n calls (median of {args.reps} "
              f"loops each, n for ~{args.target_s:g} s), each call's q depending on the previous output; "
              f"us_wall: median of {args.wall_calls} single jitted calls with block_until_ready")
    print(f"{gpu} jax {jax.__version__} interpret={interpret}", flush=True)
    header = (f"# Causal prefill attention, one layer ({gpu}, jax {jax.__version__})\n\n"
              f"TFLOP/s = 2 * 2 * B * Hq * S^2 * d / 2 / time (the same count for every impl). {timing}. "
              f"time / cuDNN < 1: faster than cuDNN."
              + ("\n\n**SMOKE RUN (interpret mode on CPU): the numbers mean nothing.**" if interpret else ""))

    rows = []
    key = jax.random.key(0)
    sweep_seq = shapes[-1].seq if interpret else QUICK_SWEEP_SEQ
    preps = impl_preps(args.impls, interpret, sweep, bf16_sweep=not args.no_bf16_sweep)
    # Every impl at every shape first, then the sweep: a time budget can only cut sweep rows.
    runs = [(shape, impl, fn) for shape in shapes for impl, only, fn in preps if only is None]
    swept = [(shape, impl, fn) for impl, only, fn in preps if only is not None
             for shape in shapes if shape.seq == sweep_seq]
    if args.sweep_early:  # the sweep right after its shape's rows (longer shapes after it)
        cut = max((i + 1 for i, (shape, _, _) in enumerate(runs) if shape.seq <= sweep_seq), default=len(runs))
        runs = runs[:cut] + swept + runs[cut:]
    else:
        runs += swept
    for shape, impl, prep_fn in runs:
        num_q_heads, num_kv_heads, head_dim = shape.dims
        row = dict(impl=impl, heads=shape.heads, batch=shape.batch, seq=shape.seq, num_q_heads=num_q_heads,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, gpu=gpu, jax_version=jax.__version__,
                   timing_method=timing)
        if time.perf_counter() - t_start > args.time_budget:
            row["error"] = f"skipped: time budget of {args.time_budget:g} s spent"
        else:
            key, k_data, k_q = jax.random.split(key, 3)
            prep = None
            try:
                prep = prep_fn(shape, k_data)
                us, us_wall, first_s, n_iter = time_impl(prep, shape, reps=args.reps, target_s=args.target_s,
                                                         key=k_q, wall_calls=args.wall_calls)
                flops = shape.flops * prep.flops if prep.flops else None
                row.update(us=us, us_wall=us_wall, config=prep.config, first_call_s=round(first_s, 2),
                           n_iter=n_iter, flops=flops, tflops=flops / us / 1e6 if flops else None)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
                row["traceback"] = traceback.format_exc()[-3000:]
            finally:
                del prep
        rows.append(row)
        status = (f"{row['us']:10.0f} us {row['tflops'] or 0:6.1f} TFLOP/s (wall {row['us_wall']:.0f} us, "
                  f"first call {row['first_call_s']:.1f} s)" if "us" in row
                  else row["error"][:150].replace("\n", " "))
        print(f"{shape.heads:12s} b{shape.batch} s{shape.seq:<6d} {impl:44s} {status}", flush=True)
        write_outputs(rows, args.out, header, args.no_plot)
    failed = [r for r in rows if r.get("error") and not r["error"].startswith("skipped")]
    print(f"wrote {args.out}/prefill_attention.{{jsonl,md,png}}; {len(rows)} rows, {len(failed)} failed, "
          f"{time.perf_counter() - t_start:.0f} s")
    return rows


def parse_fields(text):
    """"block_q=32,num_warps=8,dot_dtype=int8" -> KernelConfig fields (ints; dot_dtype a str); --sass-configs
    also takes prefix=1 (the kernel's prefix mode)."""
    out = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        out[k] = v if k == "dot_dtype" else int(v)
    return out


# Measured on the H200 (NOTES_prefill.md): block_q=16, 4 warps, 2 programs/SM: ~8.8k SM-cycles per
# (64-row program, K block) at 3874... 4214 loop instructions per warp: ~0.24 instructions/cycle per warp.
IPC_PER_WARP = 0.24


def sass_report(args):
    """--sass DIR: every hack config of the run (defaults of --impls' hack dot dtypes, the 16K sweep,
    --sass-configs) lowered at Llama heads / --seqs[0] for CUDA and compiled offline for sm_90 with
    pip triton (bench/triton_offline.py): registers, stack, shared memory, and per main loop (full
    blocks, then diagonal blocks) SASS instructions per warp and K block, plus the model's figures:
    instructions per K block per 16 query rows, resident warps per SM (registers, 64k per SM), and
    predicted SM-cycles per (K block, 64 rows) = instr per 16 rows * 4 / 4 schedulers / min(1,
    IPC_PER_WARP * warps per scheduler). Writes DIR/sass.jsonl (+ ttir/ttgir/ptx/cubin/sass files)."""
    import triton_offline
    from pallas_kernels import prefill_attention as mod
    seq = args.seqs[0] if args.seqs != list(SEQS) else QUICK_SWEEP_SEQ
    num_q_heads, num_kv_heads, head_dim = HEADS["llama3.1-8b"]
    P, NS, B = 64, 4, args.batch
    pps = -(-seq // PAGE_SIZE) + 1
    N, NP, bpp = B * pps + 1, head_dim // min(P, head_dim), PAGE_SIZE // P
    S = jax.ShapeDtypeStruct
    u8, f16, bf = jnp.uint8, jnp.float16, jnp.bfloat16
    H, D, PG = num_kv_heads, head_dim, PAGE_SIZE
    xs = [S((B, seq, num_q_heads, D), bf), S((N, H, PG // 4, D), u8), S((N, H, bpp, D), f16), S((N, H, bpp, D), f16),
          S((N, H, PG, NP), u8), S((N, H, D, PG // 4), u8), S((N, H, PG, NP), f16), S((N, H, PG, NP), f16),
          S((N, H, bpp, D), u8), S((B, H, P, D), bf), S((B, H, P, D), bf), S((B, H, NS, D), bf), S((B, H, NS, D), bf),
          S((B, pps), jnp.int32), S((B,), jnp.int32), S((B,), jnp.int32)]
    configs = []  # (name, KernelConfig, prefix mode)
    hack = [i for i in args.impls if (i.startswith("hack_") and i != "hack_write") or i in PREFIX_DOTS]
    for name, only, fn in impl_preps(hack, False, True):
        kw = fn.keywords
        base = mod.default_config(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, q_len=seq,
                                  dot_dtype=kw["dot_dtype"])
        configs.append((name, dataclasses.replace(base, **(kw.get("fields") or {})), name in PREFIX_DOTS))
    for spec in args.sass_configs or []:
        name, _, fields = spec.partition(":")
        fields = parse_fields(fields)
        prefix = bool(fields.pop("prefix", 0))
        base = mod.default_config(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, q_len=seq)
        configs.append((name, dataclasses.replace(base, **fields), prefix))
    os.makedirs(args.sass, exist_ok=True)
    pad = mod.q_per_kv_pad(num_q_heads // num_kv_heads)
    for name, cfg, prefix in configs:
        t0 = time.perf_counter()
        try:
            ttir = triton_offline.lower_ttir(
                lambda *a: mod._hack_prefill(*a, partition_size=P, num_sink_tokens=NS, config=cfg, interpret=False,
                                             prefix=prefix), *xs)
            fname = "".join(c if c.isalnum() or c in "_=-" else "_" for c in name)
            row = triton_offline.report(ttir, args.sass, fname, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            rows = cfg.block_q * pad
            regs = -(-(row["regs"] or 255) // 8) * 8
            warps_sm = min(64, 65536 // (regs * 32 * cfg.num_warps) * cfg.num_warps)
            main = row["loops"][0] if row["loops"] else {"instr": 0}
            per16 = main["instr"] * cfg.num_warps * 16 / rows
            ipc = min(1.0, IPC_PER_WARP * warps_sm / 4)
            row.update(name=name, config=str(cfg), rows=rows, instr_per_block_16rows=round(per16),
                       warps_per_sm=warps_sm, pred_cycles_per_block_64rows=round(per16 * 4 / 4 / ipc),
                       compile_s=round(time.perf_counter() - t0, 1))
        except Exception as e:
            row = dict(name=name, config=str(cfg), error=f"{type(e).__name__}: {str(e)[:400]}")
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.sass, "sass.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")


def lower_cuda(args):
    """--lower-cuda: every impl's timed program lowered for CUDA on this (CPU) machine."""
    seqs = args.seqs if args.seqs != list(SEQS) else [4096]
    bad = 0
    for seq in seqs:
        shape = Shape("llama3.1-8b", args.batch, seq)
        for impl, only_seq, prep_fn in impl_preps(args.impls, False, True):
            try:
                time_impl(prep_fn(shape, jax.random.key(0)), shape, reps=1, target_s=0, key=jax.random.key(1),
                          wall_calls=0, lower_only=True)
                status = "lowered for cuda"
            except Exception as e:
                status, bad = f"FAILED {type(e).__name__}: {str(e)[:200]}", bad + 1
            print(f"s{seq:<6d} {impl:48s} {status}", flush=True)
    return bad


if __name__ == "__main__":
    main()
