"""End-to-end generation on real model shapes (random weights): decode TPOT, prefill, capacity, JCT.

The whole decoder (models.llama.Llama built from
models.config.PRESETS in bf16, random weights: the KV path's speed does not depend on weight values)
runs the same jitted steps as models.generate.Generator (models.stepper.forward_step with its SampleHead), for
Llama-3.1-8B and Qwen2.5-7B shapes, per cache "format":
  hack      kv_format="hack" (kivi, P=64, pages of 256, 4 sinks) + our Pallas kernels (impl=pallas)
  hack4     the same with 4-bit codes (QuantConfig.bits=4; not in the default --formats); hack4-magic: with the
            1024 + 64c planes instead of the subnormal ones (the default since session 18: hack4-dn, which asks
            for them, is now the same as hack4)
  bf16      kv_format="bf16" paged + our bf16 Pallas kernels
  bf16_xla  kv_format="bf16" paged, decode attention by plain jnp/XLA (this file's adapter
            `xla_paged_decode`: the dispatch has no jax-native impl; the model receives it as its
            attention backend, XlaDecodeBackend, so the library is untouched). It walks the sequence in chunks of CHUNK_PAGES pages (a
            gather of the chunk's pages, two einsums, an online softmax) for ceil(max kv_len /
            chunk) iterations, so its cost follows the runtime length like a paged kernel's.
  fp8       kv_format="fp8" (e4m3 + f32 scale per (token, kv head), vLLM's fp8) + its Pallas decode kernel
  int8      kv_format="int8" (i8 codes + f16 scale and min per (token, kv head)) + its Pallas decode kernel
            (pallas_kernels/int8_decode_attention.py; no prefill kernel: JCT rows lack its prefill time)
  kivi2     kv_format="kivi2" (KIVI-2, G=32, R=128) + its Pallas decode kernel (dequantizes in registers)
  int4, turbo3, turbo4  kv_format="int4" (SAW-INT4) / "turbo3" / "turbo4" (TurboQuant): rotated K/V, two
            4-bit codes per byte + f16 scale (and min) per (token, kv head), one Pallas decode kernel
            (pallas_kernels/nibble_decode_attention.py; q and the output rotated outside it)

What is measured
  decode   per (model, format, batch): one compiled decode step (AOT `.lower().compile()`, its time
           is compile_s) over a cache of capacity max(contexts that fit) + MARGIN tokens per slot.
           The cache is filled SYNTHETICALLY: every array of every layer gets pseudo-random finite
           values (an integer hash of the element index) in its own layout (codes: any byte; sums:
           [0, 192); scales: [0.01, 0.1]; minima, open blocks, sinks, bf16 K/V: uniform [-2, 2]),
           pages assigned contiguously per slot; then per context C the steps' records
           (hack_jax.step.Step, built before the timed region) hold kv_lens C + 1, C + 2, ... for
           every slot (runtime values: one compile serves all contexts; the kernels split work by
           the runtime length, but their launch config (splits) is chosen for the capacity) and
           `--steps` decode steps run back to back (each feeds the previous
           step's sampled tokens, device to device: no host sync inside), timed as one region with
           block_until_ready; TPOT = median over `--reps` regions / steps (after `--warmup` steps).
           tokens/s = batch / TPOT. Each step appends one real token per slot through
           kv_cache.append (for hack: quantizes and seals blocks) and runs all layers, lm_head and
           greedy sampling, in the layer form(s) of --scan-layers. hack (--seal host, default): as the Generator, two compiled steps, the
           one without the sealing path on the steps where no slot fills its open block
           (kv_cache.seals_block) and the one that seals in every layer; where the backend defers the seal
           (models.stepper.defers_seal) one step (seal "after") plus the seal of every layer after the steps
           that fill a region. The sink rows' writes are compiled out (Step.sinks False,
           kv_cache.writes_sink: no context is shorter than the sinks; column sink_writes). Compiled in parallel threads (compile_s = the wall incl. lowering,
           compile_each per executable) and run once before the timed regions.
  prefill  batch 1 (`--prefill-batches`), one prompt of C random tokens (bucket = C) through
           `forward_step` (a prefill Step) into an empty cache of that format (write_prefill + prefill attention):
           median of `--prefill-reps` runs after one warm-up run (single timed run at >= 64K).
  capacity computed, not allocated: free = bytes_limit - bytes_in_use of
           jax.devices()[0].memory_stats() after the weights are resident, minus RESERVE_GIB for
           activations/workspace; per format the largest batch per context whose cache
           (kv_cache.cache_bytes_report: whole pages + null page + open blocks + sinks) fits.
           Without memory_stats (CPU) an assumed H200 size (--assume-gib) is used and said so.
  jct      per model, context, format: prefill time (measured, batch 1) + KV bytes to move
           (kv_bytes = kv_cache.bytes_per_token x C, plus the per-sequence 16-bit open block and
           sinks for hack) at 10/25/100 Gb/s + decode time for `--output-tokens` tokens (that many
           x the measured batch-1 TPOT at C), per format (the paper's Figure 4 spirit, HACK.md).

Budget: `--max-seconds` (default 240) stops starting new items (an item that the last item of its
kind and format, else the dearest item so far, would push past the budget is skipped too); every skipped, OOM or failed
item is a row with `error`; outputs are rewritten after each item, so a killed run keeps its rows.
Items run in two passes over the models (`plan`): core = decode batch 8 and 1 (all formats),
prefill 16K; extended = decode batch 32, prefill 4K, prefill 64K. Weights are rebuilt per pass.

Usage:
  python bench/bench_generate.py                          # GPU, the default full run (<= ~300 s)
  python bench/bench_generate.py --quick                  # GPU, llama only, batch 1 and 8
  python bench/bench_generate.py --quick --profile-steps 4  # + GPU time per kernel (jax.profiler trace)
  python bench/bench_generate.py --quick --scan-layers on off  # both layer forms (compile s, TPOT)
  python bench/bench_generate.py --models toy --contexts 256 512 --batches 1 2 --impl reference
                                                          # CPU check of the script at toy shapes
Outputs (--out, default bench/results): generate.jsonl, generate.md, generate_decode.png,
generate_jct.png, generate_capacity.png.
"""

from __future__ import annotations

import os

# Let the capacity part (and the biggest bf16 caches) use most of the GPU (jax's default is 75%).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import argparse  # noqa: E402
import collections  # noqa: E402
import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402

from hack_jax.backend import Backend, write  # noqa: E402
from hack_jax.prefill import PREFILL_ATTENTION  # noqa: E402
from hack_jax import kv_cache, paging  # noqa: E402
from hack_jax.config import QuantConfig  # noqa: E402
from hack_jax.kv_cache import stacked as stacked_cache  # noqa: E402
from hack_jax.kv_cache import mixed  # noqa: E402
from models import generate as mgen  # noqa: E402
from models import stepper as mstep  # noqa: E402
from models import llama as mllama  # noqa: E402
from models import sharding  # noqa: E402
from hack_jax.step import Step  # noqa: E402
from models.config import PRESETS, ModelConfig  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)  # Pallas-Triton, jax >= 0.11

TOY = {  # same code path, tiny widths: CPU checks of this script (and the pytest smoke test)
    "toy": dict(architecture="llama", vocab_size=512, num_layers=2, embed_dim=128, hidden_dim=256,
                num_q_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_seq_len=1 << 20, tied_embeddings=False, qkv_bias=False),
    "toy-qwen2": dict(architecture="qwen2", vocab_size=512, num_layers=2, embed_dim=128,
                      hidden_dim=256, num_q_heads=4, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_seq_len=1 << 20, tied_embeddings=False, qkv_bias=True),
}
MODELS = ("llama-3.1-8b", "qwen2.5-7b")
CONTEXTS = (4096, 16384, 65536)
BATCHES = (1, 8, 32)
FORMATS = ("hack", "bf16", "bf16_xla", "fp8", "int8", "kivi2", "int4", "turbo3", "turbo4")  # timed
CAPACITY_FORMATS = ("bf16", "int8", "hack")     # capacity / JCT bytes
EXTRA_FORMATS = ("hack4", "hack4-dn", "hack-clip", "hack-i", "hack-dn", "hack-magic", "hack-st3",
                 "hack-w8", "hack-nocap", "hack4-magic")  # --formats choices
KV_FORMAT = {"hack": "hack", "hack4": "hack", "hack4-dn": "hack", "hack-clip": "hack", "hack-i": "hack",
             "hack-dn": "hack", "hack-magic": "hack", "hack-st3": "hack", "hack-w8": "hack", "hack-nocap": "hack",
             "hack4-magic": "hack",
             "bf16": "bf16",
             "bf16_xla": "bf16",
             "int8": "int8", "fp8": "fp8", "kivi2": "kivi2", "int4": "int4", "turbo3": "turbo3", "turbo4": "turbo4"}
CODE_BITS = {"hack4": 4, "hack4-dn": 4, "hack4-magic": 4}  # QuantConfig.bits of a format (default 2)
CLIP = {"hack-clip": 5}  # QuantConfig.clip of a format (default 0: min-max partitions)
# Backend options of a format: KernelConfig.interleaved / .denormal, the decode loop's pipeline depth, its warps,
# its register cap removed
DECODE_OPTIONS = {"hack-i": {"interleaved": True}, "hack-dn": {"denormal": True}, "hack-magic": {"denormal": False},
                  "hack4-dn": {"denormal": True},
                  "hack-st3": {"num_stages": 3}, "hack-w8": {"num_warps": 8}, "hack-nocap": {"maxnreg": 0},
                  "hack4-magic": {"denormal": False}}
PREFILL_FORMATS = ("hack", "bf16")
LINK_GBPS = (10, 25, 100)
MESH = None          # --tp N > 1: the tensor-parallel mesh (models/sharding.py), set by main()
MARGIN = 64          # tokens per slot beyond the largest context (decode steps append)
CHUNK_PAGES = 16     # bf16_xla adapter: pages per chunk (4096 tokens at page_size 256)
RESERVE_GIB = 6.0    # capacity: left for activations, logits, workspace
LONG_PREFILL = 65536  # prefills this long run once (after the warm-up) and last in the order


# ----------------------------------------------------------------------------- jax adapter

def xla_paged_decode(q, layer, page_indices, kv_lens, *, chunk_pages=CHUNK_PAGES):
    """Decode attention over a paged bf16 cache in plain jnp (XLA): q f32[B, Hq, D] -> f32[B, Hq, D].

    Chunks of `chunk_pages` pages per sequence (gathered through page_indices), two einsums per
    chunk (bf16 operands, f32 accumulation), one online softmax; a while loop runs
    ceil(max kv_len / chunk tokens) chunks, so the work follows the runtime lengths."""
    b, hq, d = q.shape
    _, h, ps, _ = layer.k.shape
    g = hq // h
    pps = page_indices.shape[1]
    cp = min(chunk_pages, pps)
    n_static = -(-pps // cp)
    table = jnp.pad(page_indices, ((0, 0), (0, n_static * cp - pps)))
    qg = (q.astype(jnp.float32) * d ** -0.5).reshape(b, h, g, d).astype(jnp.bfloat16)
    n_chunks = jnp.minimum((jnp.max(kv_lens) + cp * ps - 1) // (cp * ps), n_static)
    tok = jnp.arange(cp * ps, dtype=jnp.int32).reshape(cp, ps)

    def body(i, state):
        m, l, acc = state  # [B, H, G], [B, H, G], [B, H, G, D]
        ids = lax.dynamic_slice_in_dim(table, i * cp, cp, axis=1)  # [B, cp]
        k, v = layer.k[ids], layer.v[ids]  # [B, cp, H, ps, D]
        s = jnp.einsum("bhgd,bphxd->bhgpx", qg, k, preferred_element_type=jnp.float32)
        valid = (i * cp * ps + tok)[None] < kv_lens[:, None, None]  # [B, cp, ps]
        s = jnp.where(valid[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=(-2, -1)))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None, None])
        alpha = jnp.exp(m - m_safe)
        v = jnp.where(valid[:, :, None, :, None], v, jnp.zeros_like(v))
        pv = jnp.einsum("bhgpx,bphxd->bhgd", p.astype(jnp.bfloat16), v,
                        preferred_element_type=jnp.float32)
        return m_new, alpha * l + p.sum(axis=(-2, -1)), alpha[..., None] * acc + pv

    init = (jnp.full((b, h, g), -jnp.inf, jnp.float32), jnp.zeros((b, h, g), jnp.float32),
            jnp.zeros((b, h, g, d), jnp.float32))
    _, l, acc = lax.fori_loop(0, n_chunks, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(b, hq, d)


@dataclasses.dataclass(frozen=True)
class XlaDecodeBackend:
    """bf16_xla's attention backend (hack_jax.backend.Backend's methods): the cache write of
    hack_jax.backend.write, decode attention by xla_paged_decode. Prefill is not timed for it."""

    def prefill(self, q, k, v, layer, step, *, layer_index):
        raise NotImplementedError("bf16_xla has a decode adapter only (prefill is not timed for it)")

    def decode(self, q, k, v, layer, step, *, layer_index):
        layer = write(layer, k, v, step, layer_index=layer_index)
        return layer, xla_paged_decode(q, layer, step.page_indices, step.kv_lens)


# ----------------------------------------------------------------------------- setup

# --scan-layers values: on = stacked weights + lax.scan; off = unrolled (the cache stacked where
# ModelConfig.stack_cache's default puts it: off the CPU); tuple = unrolled over a tuple of layer caches
LAYER_FORMS = {"on": dict(scan_layers=True), "off": dict(scan_layers=False),
               "tuple": dict(scan_layers=False, stack_cache=False)}


def model_config(name, fmt, impl, interpret, scan_layers=True, prefill_attention="auto", stack_cache=None):
    fields = dict(TOY[name]) if name in TOY else dict(PRESETS[name])
    if fmt == "bf16_xla":
        attention = XlaDecodeBackend()
    else:
        options = dict(DECODE_OPTIONS.get(fmt, {}))
        if interpret and impl != "reference":
            options["interpret"] = True
        attention = Backend(impl, options, prefill_attention=prefill_attention)
    if MESH is not None:  # --tp: every layer's cache write + attention per shard of kv heads
        attention = sharding.ShardedBackend(attention, MESH)
    return ModelConfig(**fields, dtype=jnp.bfloat16, attention=attention, scan_layers=scan_layers,
                       stack_cache=stack_cache)


def shape_fields(cfg: ModelConfig):
    return dict(num_layers=cfg.num_layers, embed_dim=cfg.embed_dim, hidden_dim=cfg.hidden_dim,
                num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                vocab_size=cfg.vocab_size, qkv_bias=cfg.qkv_bias, dtype="bfloat16")


def random_state(cfg: ModelConfig, seed=0, init="llama"):
    """Random bf16 weights -> (graphdef, state, bytes). init="llama": Llama's own initializer
    (eager: a few small compiles, one per parameter shape); "hash": the module built abstractly
    (nnx.eval_shape) and every parameter filled by one jitted integer hash, uniform with std 0.02
    (norm scales 1): cheaper to compile on a CPU (the pytest smoke test)."""
    if init == "llama":
        graphdef, state = nnx.split(mllama.Llama(cfg, rngs=nnx.Rngs(seed)))
    else:
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: mllama.Llama(cfg, rngs=nnx.Rngs(seed))))
        leaves, treedef = jax.tree.flatten(abstract)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]

        @jax.jit
        def fill():
            out = []
            for i, (path, x) in enumerate(zip(paths, leaves)):
                if "norm" in path:
                    out.append(jnp.ones(x.shape, x.dtype))
                    continue
                h = _hash_u32(x.shape, seed * 7919 + i)
                unit = (h & jnp.uint32(0xFFFF)).astype(jnp.float32) / 65535.0
                out.append((0.02 * 3 ** 0.5 * (2 * unit - 1)).astype(x.dtype))
            return out

        state = jax.tree.unflatten(treedef, fill())
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    if MESH is not None:  # --tp: weights placed sharded (models/sharding.py); nbytes stays the total
        sharding.check_config(cfg, MESH)
        state = jax.device_put(state, sharding.param_shardings(state, MESH, cfg))
    return graphdef, state, nbytes


def quant_config(fmt):
    return QuantConfig(kv_format=KV_FORMAT[fmt], bits=CODE_BITS.get(fmt, 2), clip=CLIP.get(fmt, 0))


def _hash_u32(shape, seed):
    """Pseudo-random uint32 of `shape` from an integer hash of the element index (no PRNG: cheap to
    compile and bound by write bandwidth, so filling tens of GiB takes milliseconds on the GPU)."""
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        idx = idx + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[axis]
    h = idx * jnp.uint32(2654435761) + jnp.uint32((seed * 40503 + 1) & 0xFFFFFFFF)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(2246822519)
    return h ^ (h >> 13)


def layer_fill_fn(layer_shapes):
    """jit(seed) -> a LayerCache of pseudo-random finite contents shaped like layer_shapes (one
    compile per shape, reused for every layer). Codes: any byte (int8: any value); sums: [0, 192);
    scales: [0.01, 0.1]; everything else (minima, open blocks, sinks, bf16 K/V): uniform [-2, 2]."""
    names = [f.name for f in dataclasses.fields(layer_shapes)  # not the arrays a format leaves out (None)
             if f.name != "config" and getattr(layer_shapes, f.name) is not None]

    @jax.jit
    def fill(seed):
        fields = {}
        for i, name in enumerate(names):
            s = getattr(layer_shapes, name)
            h = _hash_u32(s.shape, 0) ^ (seed.astype(jnp.uint32) * jnp.uint32(7919 + 104729 * i))
            h = h * jnp.uint32(2246822519)
            h = h ^ (h >> 16)
            unit = (h & jnp.uint32(0xFFFF)).astype(jnp.float32) / 65535.0  # [0, 1]
            if name.endswith("codes") and s.dtype == jnp.float8_e4m3fn:  # finite e4m3 values
                fields[name] = (4.0 * unit - 2.0).astype(s.dtype)
            elif name.endswith("codes"):
                fields[name] = lax.bitcast_convert_type((h >> 8).astype(jnp.uint8), s.dtype) \
                    if s.dtype == jnp.int8 else (h >> 8).astype(s.dtype)
            elif name.endswith("sums"):
                fields[name] = (h % jnp.uint32(192)).astype(s.dtype)
            elif name.endswith("scale"):
                fields[name] = (0.01 + 0.09 * unit).astype(s.dtype)
            else:
                fields[name] = (4.0 * unit - 2.0).astype(s.dtype)
        return dataclasses.replace(layer_shapes, **fields)

    return fill


def filled_cache(cfg, quant, batch, capacity, seed=1):
    """A KVCache of `batch` slots x `capacity` tokens, pages contiguous per slot, random contents."""
    sinks = kv_cache.sink_tokens(quant)
    pps = paging.pages_needed(capacity, page_size=quant.page_size, num_sink_tokens=sinks)
    num_pages = 1 + batch * pps
    shapes = jax.eval_shape(lambda: kv_cache.init_cache(
        quant, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        num_pages=num_pages, max_seqs=batch, pages_per_seq=pps))
    fill = layer_fill_fn(shapes.layers[0])
    stacked, group_layers = mllama.cache_layout(cfg, quant, num_pages=num_pages, max_seqs=batch, pages_per_seq=pps)
    if stacked:
        # stacked (one LayerCache with a leading layer axis, or groups of them) as models.llama.init_cache
        # makes it for cfg, filled layer by layer in place (peak memory: the stacked cache + one layer)
        put = jax.jit(lambda st, layer, i: jax.tree.map(lambda a, b: a.at[i].set(b), st, layer),
                      donate_argnums=0)
        empty = jax.eval_shape(lambda: mllama.init_cache(cfg, quant, num_pages=num_pages, max_seqs=batch,
                                                         pages_per_seq=pps)).layers
        groups, layer_map = mixed.groups_of(empty)
        groups = [jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), g) for g in groups]
        for i, (g, j) in enumerate(layer_map):
            groups[g] = put(groups[g], fill(jnp.int32(seed * 1000 + i)), j)
        layers = mixed.with_groups(empty, groups)
    else:
        layers = tuple(fill(jnp.int32(seed * 1000 + i)) for i in range(cfg.num_layers))
    table = jnp.asarray(1 + np.arange(batch * pps, dtype=np.int32).reshape(batch, pps))
    cache = dataclasses.replace(shapes, layers=layers, page_indices=table,
                                kv_lens=jnp.zeros((batch,), jnp.int32))
    return (cache if MESH is None else sharding.shard_cache(cache, MESH)), pps


def tree_bytes(tree):
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def device_memory():
    """(bytes_limit, bytes_in_use) from memory_stats, or None."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (not every backend has it)
        stats = None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def cache_total_bytes(quant, cfg, context, batch):
    """Cache bytes per device (the whole cache / tp with --tp: sharded by kv heads)."""
    report = kv_cache.cache_bytes_report(quant, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                         head_dim=cfg.head_dim, seq_len=context, max_seqs=batch)
    return report["total"] / sharding.tp_size(MESH)


def residual_bytes_per_seq(quant, cfg):
    """Per-sequence 16-bit bytes outside the pages (hack: open block + sinks, all layers)."""
    r = kv_cache.cache_bytes_report(quant, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=cfg.head_dim, seq_len=quant.page_size, max_seqs=1)
    return int(r["open_blocks"] + r["sinks"])


def bpt(quant, cfg):
    return kv_cache.bytes_per_token(quant, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers)


def max_batch(quant, cfg, context, free):
    """Largest batch whose cache (cache_bytes_report) fits in `free` bytes (0 if none)."""
    per = cache_total_bytes(quant, cfg, context, 1)
    hi = max(1, int(free // max(per, 1)) + 2)
    lo = 0
    while lo < hi:  # bisection on the exact report (the null page is shared)
        mid = (lo + hi + 1) // 2
        if cache_total_bytes(quant, cfg, context, mid) <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ----------------------------------------------------------------------------- timed items

def profile_kernels(run_steps, steps, trace_dir, top=30):
    """Trace `run_steps()` (`steps` decode steps) with jax.profiler (perfetto trace) and sum the
    device-side events per name: {gpu_us_per_step, gpu_kernels: [[name, us per step, calls per
    step], ...] (the `top` dearest)}. The trace directory is removed afterwards."""
    import gzip
    import shutil
    shutil.rmtree(trace_dir, ignore_errors=True)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        run_steps()
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        return dict(profile_error=f"no perfetto trace under {trace_dir}")
    with gzip.open(paths[0]) as fh:
        trace = json.load(fh)
    shutil.rmtree(trace_dir, ignore_errors=True)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in procs.items() if "host" not in name.lower()}
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            total[e["name"]] += float(e.get("dur", 0.0))
            calls[e["name"]] += 1
    return dict(gpu_us_per_step=round(sum(total.values()) / steps, 1),
                gpu_processes=sorted(procs[p] for p in device),
                gpu_kernels=[[name, round(us / steps, 2), round(calls[name] / steps, 2)]
                             for name, us in total.most_common(top)])


def time_decode(cfg, fmt, batch, contexts, state, graphdef, args, emit, base):
    """One cache + one compiled decode step per (model, format, batch); a row per context."""
    quant = quant_config(fmt)
    capacity = max(contexts) + MARGIN
    t0 = time.perf_counter()
    cache, pps = filled_cache(cfg, quant, batch, capacity)
    jax.block_until_ready(cache)
    fill_s = time.perf_counter() - t0
    cache_bytes = tree_bytes(cache)
    table = jnp.array(np.asarray(cache.page_indices))  # its own buffer: the cache's copy is donated
    tokens = jnp.zeros((batch,), jnp.int32)
    active = jnp.ones((batch,), bool)
    key = jax.random.key(2)
    targets = jnp.zeros((batch,), jnp.int32)
    sampling = mgen.Sampling()

    # as models.stepper.decode_record: the sink rows' writes compiled in only if a step writes one (a
    # context shorter than the sinks: never at the contexts timed here), one step for every context
    sinks = kv_cache.writes_sink(quant, np.full(batch, min(contexts) + 1), np.ones(batch, bool))

    def step_record(ctx, seal):  # the decode step after which every slot holds ctx tokens
        return Step("decode", table, jnp.full((batch,), ctx, jnp.int32), active, key, seal, sinks=sinks)

    t0 = time.perf_counter()
    # --seal host: as models.generate.Generator. Where the backend defers the seal
    # (models.stepper.defers_seal): one decode step for every step (seal "after") plus the seal of every
    # layer after the steps that fill a region (models.stepper.seal_step); else the step without the
    # sealing path wherever no slot fills its open block (kv_cache.seals_block) and the one that seals
    # in every layer ("always"). Otherwise one mode for every step.
    hack = KV_FORMAT[fmt] == "hack"
    deferred = hack and args.seal in ("host", "after") and mstep.defers_seal(cfg.attention, quant)
    modes = (["after"] if deferred else ["always", "never"] if args.seal == "host" and hack
             else ["always" if args.seal == "host" else args.seal])
    def lower(mode):
        if mode == "seal":
            return mstep.seal_step.lower(cache, step_record(1, "after"), None, attention=cfg.attention)
        return mstep.forward_step.lower(state, tokens, step_record(1, mode), cache, None, targets,
                                        graphdef=graphdef, attention=cfg.attention, head=mstep.SampleHead(sampling))

    def timed_compile(low):
        t = time.perf_counter()
        return low.compile(), time.perf_counter() - t

    # as models.stepper.Stepper.compile_many: each executable compiled in its own thread as soon as it is
    # lowered (the seal lowers while the step compiles); compile_s is what a user waits
    names = modes + (["seal"] if deferred else [])
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        futures = {mode: pool.submit(timed_compile, lower(mode)) for mode in names}
        done = {mode: f.result() for mode, f in futures.items()}
    compiled = {mode: exe for mode, (exe, _) in done.items()}
    compile_each = {mode: round(dt, 2) for mode, (_, dt) in done.items()}
    compile_s = time.perf_counter() - t0
    seal_exe = compiled.pop("seal", None)

    def step_for(lens):  # lens: tokens held after the step -> (executable, its Step, seal after it)
        fills = hack and kv_cache.seals_block(quant, lens, np.ones(batch, bool))
        mode = modes[0] if len(modes) == 1 else ("always" if fills else "never")
        return compiled[mode], step_record(int(lens[0]), mode), seal_exe if deferred and fills else None
    print(f"    compiled decode in {compile_s:.1f} s ({compile_each}; cache {cache_bytes / 2**30:.2f} GiB, "
          f"filled in {fill_s:.1f} s)", flush=True)

    def run(n, ctx):
        nonlocal cache, tokens
        steps = [step_for(np.full(batch, ctx + 1 + i)) for i in range(n)]  # host-side, before timing
        jax.block_until_ready(steps)
        t = time.perf_counter()
        for exe, step, seal in steps:
            cache, tokens, _ = exe(state, tokens, step, cache, None, targets)
            if seal is not None:
                (cache,) = seal(cache, step, None)
        jax.block_until_ready((cache, tokens))
        return time.perf_counter() - t

    for ctx in sorted(contexts):
        row = dict(base, kind="decode", context=ctx, capacity=capacity, pages_per_seq=pps,
                   scan_in_place=all(map(stacked_cache.use_flat, mixed.groups_of(cache.layers)[0])) if cache.stacked else None,
                   stacked_cache=cache.stacked,
                   compile_s=round(compile_s, 3), compile_each=compile_each, fill_s=round(fill_s, 3),
                   cache_alloc_bytes=cache_bytes, bytes_per_token=bpt(quant, cfg),
                   kv_bytes=bpt(quant, cfg) * batch * ctx, steps=args.steps, reps=args.reps,
                   seal=args.seal if hack else None, sink_writes=sinks if hack else None,
                   seal_steps=sum(kv_cache.seals_block(quant, np.full(batch, ctx + 1 + i), np.ones(batch, bool))
                                  for i in range(args.steps)) if hack else None)
        try:
            row["warmup_s"] = round(run(args.warmup, ctx), 4)  # first one: incl. any lazy kernel compile
            for mode, exe in compiled.items():  # --seal host: every executable loaded before the timed regions
                cache, tokens, _ = exe(state, tokens, step_record(ctx + 1, mode), cache, None, targets)
                if seal_exe is not None:
                    (cache,) = seal_exe(cache, step_record(ctx + 1, mode), None)
            times = [run(args.steps, ctx) for _ in range(args.reps)]
            tpot = float(np.median(times)) / args.steps
            if not bool(jnp.all((tokens >= 0) & (tokens < cfg.vocab_size))):
                raise FloatingPointError("sampled tokens out of range (non-finite logits?)")
            row.update(tpot_ms=tpot * 1e3, tokens_per_s=batch / tpot,
                       region_s=[round(t, 5) for t in times])
            if args.profile_steps:
                row.update(profile_kernels(lambda: run(args.profile_steps, ctx), args.profile_steps,
                                           os.path.join(args.out, "trace_tmp"), top=args.profile_top))
        except Exception as e:  # noqa: BLE001
            row.update(error=f"{type(e).__name__}: {str(e)[:1500]}",
                       traceback=traceback.format_exc()[-2000:])
        emit(row)
    del cache, compiled


def time_prefill(cfg, fmt, batch, context, state, graphdef, args, emit, base):
    """One row per --prefill-modes entry, in this process: "one" (one step padded to the length
    bucket), "pow2" (one step padded to the next power of two), "chunk" (chunks of --prefill-chunk)."""
    for mode in args.prefill_modes:
        _time_prefill(cfg, fmt, batch, context, state, graphdef, args, emit, base, mode)


def _time_prefill(cfg, fmt, batch, context, state, graphdef, args, emit, base, mode):
    quant = quant_config(fmt)
    sinks = kv_cache.sink_tokens(quant)
    pps = paging.pages_needed(context + MARGIN, page_size=quant.page_size, num_sink_tokens=sinks)
    cache = mllama.init_cache(cfg, quant, num_pages=1 + batch * pps, max_seqs=batch, pages_per_seq=pps)
    cache = cache if MESH is None else sharding.shard_cache(cache, MESH)
    table = jnp.asarray(1 + np.arange(batch * pps, dtype=np.int32).reshape(batch, pps))
    chunk = args.prefill_chunk if mode == "chunk" and args.prefill_chunk < context else None
    bucket = 1 << (context - 1).bit_length() if mode == "pow2" else mgen.length_bucket(context)
    t_len = chunk or bucket
    tokens = jax.random.randint(jax.random.key(3), (batch, t_len), 0, cfg.vocab_size, jnp.int32)
    full = np.full((batch,), t_len if chunk else context, np.int32)
    # the first chunk (or the whole prompt) as a prefill step, the others as chunk steps (one compile each)
    records = [jax.device_put(Step.prefill(table, full, jax.random.key(4)))] + [
        jax.device_put(Step.chunk(table, np.full((batch,), c0, np.int32), np.minimum(full, context - c0),
                                  jax.random.key(4))) for c0 in range(t_len, context, t_len)]
    targets = jnp.zeros((batch,), jnp.int32)
    t0 = time.perf_counter()
    lower = lambda record: mstep.forward_step.lower(
        state, tokens, record, cache, None, targets, graphdef=graphdef, attention=cfg.attention,
        head=mstep.SampleHead(mgen.Sampling())).compile()
    steps = [lower(records[0])] + ([lower(records[1])] if len(records) > 1 else [])
    compile_s = time.perf_counter() - t0
    print(f"    compiled prefill in {compile_s:.1f} s ({f'chunks of {chunk}' if chunk else f'{t_len} tokens'})",
          flush=True)

    def run():
        nonlocal cache
        t = time.perf_counter()
        for i, record in enumerate(records):
            cache, nxt, _ = steps[min(i, 1)](state, tokens, record, cache, None, targets)
        jax.block_until_ready((cache, nxt))
        return time.perf_counter() - t

    warm_s = run()
    reps = 1 if context >= LONG_PREFILL else args.prefill_reps
    times = [run() for _ in range(reps)]
    t = float(np.median(times))
    emit(dict(base, kind="prefill", context=context, chunk=chunk, bucket=t_len,
              **({"pow2_bucket": True} if mode == "pow2" else {}), compile_s=round(compile_s, 3),
              first_run_s=round(warm_s, 4), prefill_ms=t * 1e3, prefill_tok_s=batch * context / t,
              bytes_per_token=bpt(quant, cfg), kv_bytes=bpt(quant, cfg) * batch * context,
              reps=reps, region_s=[round(x, 5) for x in times]))
    del cache, steps


# ----------------------------------------------------------------------------- derived rows

def capacity_rows(cfg, name, free, source, contexts, batches, common):
    rows = []
    for fmt in CAPACITY_FORMATS:
        quant = quant_config(fmt)
        b_tok = bpt(quant, cfg)
        for ctx in sorted(set(contexts) | {4096, 16384, 32768, 65536, 131072}):
            mb = max_batch(quant, cfg, ctx, free)
            rows.append(dict(common, kind="capacity", model=name, format=fmt, context=ctx,
                             **shape_fields(cfg), bytes_per_token=b_tok,
                             residual_bytes_per_seq=residual_bytes_per_seq(quant, cfg),
                             free_bytes=int(free), memory_source=source, max_batch=mb,
                             max_tokens=mb * ctx, computed_not_allocated=True,
                             fits={str(b): bool(cache_total_bytes(quant, cfg, ctx, b) <= free)
                                   for b in batches}))
    return rows


def jct_rows(rows, cfg, name, output_tokens, common):
    out = []
    pre = {(r["format"], r["context"]): r for r in rows
           if r.get("kind") == "prefill" and r.get("model") == name and r.get("batch") == 1
           and "prefill_ms" in r and not r.get("chunk") and not r.get("pow2_bucket")}  # one step, own bucket
    dec = {(r["format"], r["context"]): r for r in rows
           if r.get("kind") == "decode" and r.get("model") == name and r.get("batch") == 1
           and "tpot_ms" in r}
    contexts = sorted({c for _, c in pre} | {c for _, c in dec})
    for ctx in contexts:
        for fmt in ("bf16", "int8", "hack"):
            quant = quant_config(fmt)
            kv = bpt(quant, cfg) * ctx
            resid = residual_bytes_per_seq(quant, cfg)
            p, d = pre.get((fmt, ctx)), dec.get((fmt, ctx))
            row = dict(common, kind="jct", model=name, format=fmt, context=ctx, batch=1,
                       **shape_fields(cfg), output_tokens=output_tokens,
                       bytes_per_token=bpt(quant, cfg), kv_bytes=kv, residual_bytes=resid,
                       transfer_bytes=kv + resid,
                       transfer_s={str(g): (kv + resid) * 8 / (g * 1e9) for g in LINK_GBPS},
                       prefill_s=p["prefill_ms"] / 1e3 if p else None,
                       tpot_ms=d["tpot_ms"] if d else None,
                       decode_s=d["tpot_ms"] / 1e3 * output_tokens if d else None)
            if p and d:
                row["total_s"] = {g: row["prefill_s"] + t + row["decode_s"]
                                  for g, t in row["transfer_s"].items()}
            else:
                row["note"] = ("no Pallas prefill kernel for int8: bytes, transfer and decode only"
                               if fmt == "int8" and d else "prefill or batch-1 decode not measured")
            out.append(row)
    return out


# ----------------------------------------------------------------------------- outputs

def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def _layers(row):
    """scan (the stacked cache read and written in place), scan-sliced (each layer's slice copied in
    and out: kv_cache.stacked.use_flat was False), unrolled."""
    if row.get("scan_layers") and row.get("scan_in_place") is False:
        return "scan-sliced"
    if row.get("scan_layers") is False and row.get("stacked_cache"):
        return "unrolled, stacked cache"
    return {True: "scan", False: "unrolled"}.get(row.get("scan_layers"), "-")


# Kernel names of a decode step's profile (XLA:GPU fusion names and our Pallas kernels' names) -> kind
KINDS = (("attention", ("decode_attention",)),
         ("append", ("dynamic_update_slice", "scatter")),
         ("matmul", ("gemm", "cublas", "dot", "gemv")))


def kernel_kinds(row):
    """GPU us per step of a profiled decode row by kind: attention (our decode kernels), append (the
    cache's row writes: XLA scatters and dynamic-update-slices), matmul (GEMM fusions / cuBLAS), other (the
    rest of the step, incl. the split combine (XLA's fusions or combine_splits' kernel), norms, RoPE,
    activations and the kernels beyond the profile's top N: gpu_us_per_step minus the three). None without a
    profile."""
    if not row.get("gpu_kernels") or not row.get("gpu_us_per_step"):
        return None
    out = dict.fromkeys([k for k, _ in KINDS], 0.0)
    for name, us, _ in row["gpu_kernels"]:
        kind = next((k for k, keys in KINDS if any(key in name for key in keys)), None)
        if kind:
            out[kind] += us
    out["other"] = row["gpu_us_per_step"] - sum(out.values())
    return out


def write_markdown(rows, path, header):
    ok = lambda r: not r.get("error")  # noqa: E731
    lines = [header, ""]
    dec = [r for r in rows if r.get("kind") == "decode"]
    if dec:
        base = {(r["model"], r["batch"], r["context"], _layers(r)): r["tpot_ms"] for r in dec
                if r["format"] == "bf16" and "tpot_ms" in r}
        lines += ["## Decode (whole model, one token per sequence per step)", "",
                  "| model | batch | context | format | layers | TPOT ms | tokens/s | TPOT / bf16 | KV GiB "
                  "(bytes_per_token x batch x context) | cache alloc GiB | compile s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in dec:
            if not ok(r):
                lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['format']} | "
                             f"{_layers(r)} | - | - | - "
                             f"| {r.get('kv_bytes', 0) / 2**30:.2f} | - | - | "
                             f"{r['error'][:100].replace('|', '/')} |")
                continue
            b = base.get((r["model"], r["batch"], r["context"], _layers(r)))
            lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['format']} | {_layers(r)} | "
                         f"{r['tpot_ms']:.2f} | {r['tokens_per_s']:.1f} | "
                         f"{_f(r['tpot_ms'] / b if b else None)} | {r['kv_bytes'] / 2**30:.2f} | "
                         f"{r['cache_alloc_bytes'] / 2**30:.2f} | {r['compile_s']:.1f} |")
        lines.append("")
    prof = [(r, kernel_kinds(r)) for r in dec if ok(r) and kernel_kinds(r)]
    if prof:
        lines += ["## GPU time per decode step, by kind (rows with --profile-steps)", "",
                  "From the profiler's device events over the profiled steps (`kernel_kinds`): attention = our decode "
                  "kernels; append = the cache's row writes (scatters, dynamic-update-slices); matmul = GEMM fusions; "
                  "other = the rest (the split combine, norms, RoPE, activations, small kernels). "
                  "kernels / TPOT = the summed kernel time of a profiled step over the timed TPOT: near or above "
                  "100% the GPU does not wait on the host (the profiled steps run under the tracer, and events of "
                  "concurrent kernels overlap, so it can exceed 100%).", "",
                  "| model | batch | context | format | TPOT ms | GPU us/step | kernels / TPOT | attention | append "
                  "| matmul | other |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r, k in prof:
            lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['format']} | {r['tpot_ms']:.2f} | "
                         f"{r['gpu_us_per_step']:.0f} | {r['gpu_us_per_step'] / (10 * r['tpot_ms']):.0f}% | "
                         + " | ".join(f"{k[name]:.0f}" for name in ("attention", "append", "matmul", "other"))
                         + " |")
        lines.append("")
    pre = [r for r in rows if r.get("kind") == "prefill"]
    if pre:
        lines += ["## Prefill", "", "chunk: prefilled in chunks of that many tokens (- : one step padded to "
                  "`bucket` tokens).", "",
                  "| model | batch | context | bucket | chunk | format | layers | ms | tokens/s | compile s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in pre:
            head = (f"| {r['model']} | {r['batch']} | {r['context']} | {r.get('bucket', '-')} | "
                    f"{r.get('chunk') or '-'} | {r['format']} | {_layers(r)} |")
            if not ok(r):
                lines.append(f"{head} - | - | {r['error'][:100].replace('|', '/')} |")
            else:
                lines.append(f"{head} {r['prefill_ms']:.1f} | {r['prefill_tok_s']:.0f} | {r['compile_s']:.1f} |")
        lines.append("")
    cap = [r for r in rows if r.get("kind") == "capacity"]
    if cap:
        free = {r["model"]: f"{r['free_bytes'] / 2**30:.1f} GiB ({r['memory_source']})" for r in cap}
        lines += ["## Capacity (computed, not allocated)", "",
                  "Free memory next to the weights: " + "; ".join(f"{m}: {v}" for m, v in free.items()) + ". "
                  "Largest batch per context whose cache (whole pages + null page + per-sequence open "
                  "blocks and sinks) fits; `fits` marks the benchmark's batches.", "",
                  "| model | format | bytes/token | context | max batch | fits (batch: yes/no) |",
                  "|---|---|---|---|---|---|"]
        for r in cap:
            fits = " ".join(f"{b}:{'yes' if v else 'no'}" for b, v in r["fits"].items())
            lines.append(f"| {r['model']} | {r['format']} | {r['bytes_per_token']:.0f} | {r['context']} | "
                         f"{r['max_batch']} | {fits} |")
        lines.append("")
    jct = [r for r in rows if r.get("kind") == "jct"]
    if jct:
        lines += ["## JCT, disaggregated prefill -> decode (batch 1)", "",
                  "total = prefill + transfer of the KV cache + decode of N tokens (N x TPOT).", "",
                  "| model | context | format | prefill s | KV MiB | transfer s @10/25/100 Gb/s | decode s "
                  "(N) | total s @10/25/100 Gb/s |", "|---|---|---|---|---|---|---|---|"]
        for r in jct:
            tr = "/".join(f"{r['transfer_s'][str(g)]:.3f}" for g in LINK_GBPS)
            tot = ("/".join(f"{r['total_s'][str(g)]:.3f}" for g in LINK_GBPS) if r.get("total_s")
                   else r.get("note", "-"))
            lines.append(f"| {r['model']} | {r['context']} | {r['format']} | {_f(r['prefill_s'], '{:.3f}')} "
                         f"| {r['transfer_bytes'] / 2**20:.1f} | {tr} | "
                         f"{_f(r['decode_s'], '{:.3f}')} ({r['output_tokens']}) | {tot} |")
        lines.append("")
    skipped = [r for r in rows if r.get("error") and r.get("kind") not in ("decode", "prefill")]
    if skipped:
        lines += ["## Not run / failed", ""] + [f"- {r.get('kind')} {r.get('model')} {r.get('format', '')} "
                                                f"b{r.get('batch', '')} ctx {r.get('context', '')}: "
                                                f"{r['error'][:200]}" for r in skipped] + [""]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plots(rows, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no plots: {e}", flush=True)
        return
    dec = [r for r in rows if r.get("kind") == "decode" and "tpot_ms" in r]
    panels = sorted({(r["model"], r["batch"]) for r in dec})
    if panels:
        cols = min(3, len(panels))
        nr = -(-len(panels) // cols)
        fig, axes = plt.subplots(nr, cols, figsize=(5 * cols, 4 * nr), squeeze=False)
        for ax, (m, b) in zip(axes.flat, panels):
            for fmt in sorted({r["format"] for r in dec}):
                pts = sorted((r["context"], r["tpot_ms"]) for r in dec
                             if (r["model"], r["batch"], r["format"]) == (m, b, fmt))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=fmt)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{m}, batch {b}")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("TPOT (ms)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "generate_decode.png"), dpi=110)
        plt.close(fig)
    jct = [r for r in rows if r.get("kind") == "jct" and r.get("total_s")]
    if jct:
        keys = sorted({(r["model"], r["context"]) for r in jct})
        cols = min(3, len(keys))
        nr = -(-len(keys) // cols)
        fig, axes = plt.subplots(nr, cols, figsize=(5 * cols, 4 * nr), squeeze=False)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        for ax, (m, c) in zip(axes.flat, keys):
            labels, parts = [], []
            for r in (r for r in jct if (r["model"], r["context"]) == (m, c)):
                for g in LINK_GBPS:
                    labels.append(f"{r['format']}\n{g}G")
                    parts.append((r["prefill_s"], r["transfer_s"][str(g)], r["decode_s"]))
            bottom = np.zeros(len(parts))
            for i, (name, color) in enumerate((("prefill", "C0"), ("transfer", "C1"), ("decode", "C2"))):
                vals = np.array([p[i] for p in parts])
                ax.bar(range(len(parts)), vals, bottom=bottom, color=color, label=name)
                bottom += vals
            ax.set_xticks(range(len(parts)), labels, fontsize=7)
            ax.set_ylabel("seconds")
            ax.set_title(f"JCT {m}, ctx {c}, batch 1, {jct[0]['output_tokens']} out")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "generate_jct.png"), dpi=110)
        plt.close(fig)
    cap = [r for r in rows if r.get("kind") == "capacity"]
    if cap:
        models = sorted({r["model"] for r in cap})
        fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
        for ax, m in zip(axes.flat, models):
            for fmt in CAPACITY_FORMATS:
                pts = sorted((r["context"], max(r["max_batch"], 0.5)) for r in cap
                             if (r["model"], r["format"]) == (m, fmt))
                ax.plot(*zip(*pts), marker="o", label=fmt)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("max batch (computed)")
            ax.set_title(f"{m}: capacity next to the weights")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "generate_capacity.png"), dpi=110)
        plt.close(fig)


# ----------------------------------------------------------------------------- main

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(PRESETS) + sorted(TOY))
    ap.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS + EXTRA_FORMATS,
                    help="decode formats (none: prefill items only); hack4: the hack cache with 4-bit codes")
    ap.add_argument("--prefill-contexts", nargs="*", type=int, default=None,
                    help="default: --contexts (batch 1); >= 64K runs once, last")
    ap.add_argument("--prefill-batches", nargs="*", type=int, default=[1])
    ap.add_argument("--prefill-formats", nargs="*", default=list(PREFILL_FORMATS),
                    choices=PREFILL_FORMATS + ("hack-clip",))
    ap.add_argument("--prefill-attention", default="auto", choices=PREFILL_ATTENTION,
                    help="the prompt's own attention (hack_jax.prefill): exact on the fresh 16-bit K/V "
                         "(auto: cuDNN on a GPU), or homomorphic over the 2-bit cache")
    ap.add_argument("--impl", default="pallas", choices=("pallas", "reference"),
                    help="attention impl of the hack and bf16 formats (reference: CPU checks)")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--steps", type=int, default=64,
                    help="decode steps per timed region (64: one sealing step per slot, as in generation at P=64)")
    ap.add_argument("--reps", type=int, default=3, help="timed regions per context (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps per context")
    ap.add_argument("--prefill-reps", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill contexts longer than this in chunks of this many tokens (the first a prefill "
                         "step, the rest chunk steps over the cached prefix) instead of one padded step")
    ap.add_argument("--prefill-modes", nargs="+", choices=("one", "pow2", "chunk"), default=None,
                    help="prefill rows per context, in one process: one = one step padded to the length bucket "
                         "(models.stepper.length_bucket), pow2 = one step padded to the next power of two (the "
                         "buckets before FINE_BUCKETS_FROM), chunk = chunks of --prefill-chunk (default: chunk "
                         "with --prefill-chunk, else one)")
    ap.add_argument("--output-tokens", type=int, default=256, help="JCT: decoded tokens")
    ap.add_argument("--max-seconds", type=float, default=240.0,
                    help="wall budget from the start of main (after imports): no item starts past it or "
                         "when the last item of its kind (else the dearest so far) would end past it")
    ap.add_argument("--assume-gib", type=float, default=141.0,
                    help="device memory assumed when memory_stats is unavailable (H200: ~141 GiB)")
    ap.add_argument("--init", default="llama", choices=("llama", "hash"),
                    help="random weights: Llama's initializer, or a cheap integer hash (CPU tests)")
    ap.add_argument("--quick", action="store_true", help="llama only, batches 1 and 8")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--seal", default="host", choices=("host", "always", "after", "never"),
                    help="hack decode steps: host = as the Generator (a step without the block-sealing "
                         "path where no slot fills its open block, chosen on the host per step), or one "
                         "kv_cache.append seal mode for every step (never: timing only, blocks not sealed)")
    ap.add_argument("--scan-layers", nargs="+", default=["off"], choices=tuple(LAYER_FORMS),
                    help="layer form(s) to time, in order: on = stacked weights and cache, one "
                         "lax.scan over the layers (compiled once); off = the layer loop unrolled "
                         "(ModelConfig.scan_layers; the cache stacked off the CPU: ModelConfig."
                         "stack_cache); tuple = unrolled over a tuple of per-layer caches. Rows carry "
                         "scan_layers and stacked_cache; JCT uses the first")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing each decode context, trace this many more steps with jax.profiler "
                         "and add the GPU time per step by kernel name to the row (gpu_kernels)")
    ap.add_argument("--profile-top", type=int, default=30, help="kernels kept per row by --profile-steps")
    ap.add_argument("--warm-compile", action="store_true",
                    help="compile a small matmul + bf16 Pallas decode kernel first, so that no row pays the "
                         "process' one-time compiler start-up (a fair compile_s between formats; each "
                         "format in a fresh process)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallelism over this many devices (kv heads; models/sharding.py): "
                         "weights and cache sharded, rows carry tp; memory fits are per device")
    args = ap.parse_args(argv)
    optioned = [f for f in args.formats if f in DECODE_OPTIONS]
    if optioned and args.impl != "pallas":
        ap.error(f"formats {optioned} set options of the Pallas decode kernel: they need --impl pallas")
    if args.quick:
        args.models, args.batches = ["llama-3.1-8b"], [b for b in args.batches if b in (1, 8)] or [1]
    if args.prefill_contexts is None:
        args.prefill_contexts = list(args.contexts)
    if args.prefill_modes is None:
        args.prefill_modes = ["chunk"] if args.prefill_chunk else ["one"]
    if "chunk" in args.prefill_modes and not args.prefill_chunk:
        raise SystemExit("--prefill-modes chunk needs --prefill-chunk")
    return args


def plan(args):
    """Work items (kind, format, batch, prefill context) in two passes, each over all models, so a
    budget-capped run still covers every model's core: core = decode at batch 8 and 1 (or the first
    two of --batches) for every format, then the longest prefill below LONG_PREFILL; extended =
    the other batches, the other short prefills, then long prefills."""
    pre_short = sorted(c for c in args.prefill_contexts if c < LONG_PREFILL)
    pre_long = sorted(c for c in args.prefill_contexts if c >= LONG_PREFILL)
    batches = sorted(set(args.batches), key=lambda b: (b != 8, b))
    core, extended = [], []
    for b in batches[:2]:
        core += [("decode", f, b, None) for f in args.formats]
    for b in args.prefill_batches:
        core += [("prefill", f, b, c) for c in pre_short[-1:] for f in args.prefill_formats]
    for b in batches[2:]:
        extended += [("decode", f, b, None) for f in args.formats]
    for b in args.prefill_batches:
        extended += [("prefill", f, b, c) for c in pre_short[:-1][::-1] + pre_long
                     for f in args.prefill_formats]
    return [items for items in (core, extended) if items]


def run_model(name, items, args, start, rows, emit, flush, common, compile_est, capacity_done,
              layer_form):
    """Random weights for `name` in one layer form (LAYER_FORMS[layer_form]; freed at the end),
    capacity rows (once per model), then `items`."""
    form = LAYER_FORMS[layer_form]
    scan_layers, stack_cache = form["scan_layers"], form.get("stack_cache")
    device = jax.devices()[0]
    elapsed = time.perf_counter() - start
    if elapsed > args.max_seconds:
        for kind, fmt, batch, ctx in items:
            for c in (args.contexts if kind == "decode" else [ctx]):
                emit(dict(common, kind=kind, model=name, format=fmt, batch=batch, context=c,
                          error=f"skipped: --max-seconds budget ({elapsed:.0f} s elapsed)"))
        return
    cfg0 = model_config(name, "bf16", args.impl, args.interpret, scan_layers, args.prefill_attention)
    t0 = time.perf_counter()
    try:
        _, state, wbytes = random_state(cfg0, init=args.init)
        jax.block_until_ready(state)
    except Exception as e:  # noqa: BLE001
        rows.append(dict(common, kind="model", model=name, error=f"{type(e).__name__}: {e}",
                         traceback=traceback.format_exc()[-2000:]))
        flush()
        return
    init_s = time.perf_counter() - t0
    mem = device_memory()
    if mem:
        free = mem[0] - mem[1] - RESERVE_GIB * 2**30
        source = (f"memory_stats: bytes_limit {mem[0] / 2**30:.1f} GiB - bytes_in_use "
                  f"{mem[1] / 2**30:.1f} GiB (weights resident) - {RESERVE_GIB:g} GiB reserve")
    else:
        free = args.assume_gib * 2**30 - wbytes - RESERVE_GIB * 2**30
        source = (f"ASSUMED {args.assume_gib:g} GiB device (no memory_stats on "
                  f"{device.platform}) - weights {wbytes / 2**30:.1f} GiB - {RESERVE_GIB:g} GiB reserve")
    print(f"{name}: random bf16 weights {wbytes / 2**30:.2f} GiB in {init_s:.1f} s; free for KV "
          f"{free / 2**30:.1f} GiB ({source})", flush=True)
    rows.append(dict(common, kind="model", model=name, **shape_fields(cfg0), weight_bytes=wbytes,
                     scan_layers=scan_layers,
                     init_s=round(init_s, 2), memory_source=source, free_bytes=int(free)))
    if name not in capacity_done:
        capacity_done.add(name)
        rows.extend(capacity_rows(cfg0, name, free, source, args.contexts, args.batches, common))
    flush()
    graphdefs = {}
    for kind, fmt, batch, ctx in items:
        cfg = model_config(name, fmt, args.impl, args.interpret, scan_layers, args.prefill_attention,
                           stack_cache)
        if fmt not in graphdefs:  # same weights, format-specific static config
            graphdefs[fmt] = nnx.split(nnx.eval_shape(lambda c=cfg: mllama.Llama(c, rngs=nnx.Rngs(0))))[0]
        base = dict(common, model=name, format=fmt, kv_format=KV_FORMAT[fmt], batch=batch,
                    impl=("xla adapter" if fmt == "bf16_xla" else args.impl), scan_layers=scan_layers,
                    **shape_fields(cfg), weight_bytes=wbytes)
        quant = quant_config(fmt)
        if kind == "decode":
            fit = [c for c in args.contexts if cache_total_bytes(quant, cfg, c + MARGIN, batch) <= free]
            for c in sorted(set(args.contexts) - set(fit)):
                emit(dict(base, kind="decode", context=c, kv_bytes=bpt(quant, cfg) * batch * c,
                          bytes_per_token=bpt(quant, cfg),
                          error=f"skipped: does not fit (cache {cache_total_bytes(quant, cfg, c, batch) / 2**30:.1f}"
                                f" GiB > free {free / 2**30:.1f} GiB, computed)"))
            targets_ctx = fit
        else:
            targets_ctx = [ctx]
        if not targets_ctx:
            continue
        # Predicted cost: the last item of this kind and format (else the dearest item so far).
        est = compile_est.get((kind, fmt, layer_form), max(compile_est.values(), default=0.0))
        if kind == "prefill" and ctx >= LONG_PREFILL:
            est *= 2.5  # quadratic attention: a 64K prefill runs ~16x a 16K one (one timed run)
        elapsed = time.perf_counter() - start
        if elapsed + est > args.max_seconds:
            for c in targets_ctx:
                emit(dict(base, kind=kind, context=c, error=f"skipped: --max-seconds budget "
                          f"({elapsed:.0f} s elapsed + ~{est:.0f} s predicted > {args.max_seconds:.0f} s)"))
            continue
        print(f"[{elapsed:.0f} s] {name} {kind} {fmt} batch {batch} contexts {targets_ctx}", flush=True)
        n_before, t_item = len(rows), time.perf_counter()
        try:
            if kind == "decode":
                time_decode(cfg, fmt, batch, targets_ctx, state, graphdefs[fmt], args, emit, base)
            else:
                time_prefill(cfg, fmt, batch, ctx, state, graphdefs[fmt], args, emit, base)
        except Exception as e:  # noqa: BLE001  (OOM, compile or kernel failure)
            done = {r["context"] for r in rows[n_before:]}
            for c in targets_ctx:
                if c not in done:
                    emit(dict(base, kind=kind, context=c, error=f"{type(e).__name__}: {str(e)[:1500]}",
                              traceback=traceback.format_exc()[-2000:]))
        compile_est[(kind, fmt, layer_form)] = time.perf_counter() - t_item  # wall of the whole item
        gc.collect()
    del state
    gc.collect()


def warm_compiler(impl, interpret):
    """One small executable with a matmul and the bf16 format's decode attention (impl pallas: its
    Pallas kernel), compiled and run, so that XLA's and the Triton pipeline's one-time start-up land
    before any timed compile."""
    from hack_jax import attention
    layer = kv_cache.init_layer(quant_config("bf16"), num_pages=2, num_kv_heads=1, head_dim=64, max_seqs=1)
    table, lens = jnp.ones((1, 1), jnp.int32), jnp.ones((1,), jnp.int32)
    opts = dict(interpret=True) if interpret and impl == "pallas" else {}

    def f(x, q):
        o = attention.decode_attention(q, layer, page_indices=table, kv_lens=lens, impl=impl, **opts)
        return (x @ x).sum() + o.sum()
    x, q = jnp.ones((256, 256), jnp.bfloat16), jnp.ones((1, 1, 64), jnp.float32)
    t = time.perf_counter()
    jax.block_until_ready(jax.jit(f).lower(x, q).compile()(x, q))
    print(f"warm-up compile {time.perf_counter() - t:.1f} s", flush=True)


def main(argv=None):
    global MESH
    args = parse_args(argv)
    MESH = sharding.make_mesh(args.tp) if args.tp > 1 else None
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    device = jax.devices()[0]
    gpu = getattr(device, "device_kind", str(device))
    command = "python bench/bench_generate.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                   else sys.argv[1:]))
    # XLA_FLAGS (read by XLA at start-up, one setting per process): e.g.
    # --xla_gpu_enable_dynamic_slice_fusion=true to let the scanned layers' matmuls read their slice
    # of the stacked weights in place (bench/NOTES_generate.md, "Layer scan in place")
    common = dict(gpu=gpu, platform=device.platform, jax_version=jax.__version__,
                  python=platform.python_version(), tp=args.tp,
                  xla_flags=os.environ.get("XLA_FLAGS", ""))
    print(f"{gpu} ({device.platform}) jax {jax.__version__}  budget {args.max_seconds:.0f} s  "
          f"models {args.models} contexts {args.contexts} batches {args.batches} formats {args.formats}",
          flush=True)
    if args.warm_compile:
        warm_compiler(args.impl, args.interpret)
    rows = []
    jsonl = os.path.join(args.out, "generate.jsonl")
    timing = (f"decode: {args.steps} steps back to back per timed region (tokens fed device to device, "
              f"block_until_ready at the end), median of {args.reps} regions after {args.warmup} warm-up "
              f"steps; prefill: median of {args.prefill_reps} runs after one warm-up (1 run at >= "
              f"{LONG_PREFILL}); AOT compile timed separately (compile_s)")
    fill = ("decode caches filled synthetically: pseudo-random finite values (an integer hash) written "
            "directly into every array of every layer in its own layout, pages contiguous per slot; "
            "kv_lens set to the context per slot (one compiled step per model, format and batch, "
            "capacity = largest context that fits + 64)")

    def flush():
        with open(jsonl, "w") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
        header = (f"# End-to-end generation, random weights, real shapes ({gpu}, jax {jax.__version__})\n\n"
                  f"Command: `{command}`\n\nXLA_FLAGS: `{common['xla_flags'] or '(none)'}`\n\nTiming: {timing}. Cache: {fill}. Formats: hack = 2-bit kivi "
                  f"cache + our Pallas kernels (impl={args.impl}); bf16 = paged bf16 + our Pallas bf16 "
                  f"kernels; bf16_xla = paged bf16, decode attention in plain jnp/XLA (chunked "
                  f"gather + einsum + online softmax, bench adapter). Wall time of the run so far: "
                  f"{time.perf_counter() - start:.0f} s.")
        if device.platform == "cpu":
            header += "\n\n**CPU run (toy shapes or reference impl): the numbers mean nothing.**"
        write_markdown(rows, os.path.join(args.out, "generate.md"), header)

    def emit(row):
        rows.append(row)
        if "error" in row:
            status = row["error"][:160].replace("\n", " ")
        elif row["kind"] == "decode":
            status = f"TPOT {row['tpot_ms']:.2f} ms  {row['tokens_per_s']:.1f} tok/s"
        else:
            status = f"{row['prefill_ms']:.1f} ms  {row['prefill_tok_s']:.0f} tok/s"
        print(f"  {row['model']:14s} {row['kind']:7s} {row['format']:9s} b{row['batch']:<3d} "
              f"ctx {row['context']:<6d} {status}   [{time.perf_counter() - start:.0f} s]", flush=True)
        flush()

    compile_est, capacity_done = {}, set()
    for items in plan(args):
        for name in args.models:
            for scan in args.scan_layers:
                run_model(name, items, args, start, rows, emit, flush, common, compile_est,
                          capacity_done, scan)
    for name in args.models:  # JCT from every pass's prefill and batch-1 decode rows (first layer form)
        cfg0 = model_config(name, "bf16", args.impl, args.interpret)
        first = [r for r in rows if r.get("scan_layers", args.scan_layers[0] == "on")
                 == (args.scan_layers[0] == "on")]
        rows.extend(jct_rows(first, cfg0, name, args.output_tokens, common))
    total = time.perf_counter() - start
    rows.append(dict(common, kind="run", wall_s=round(total, 1), command=command, timing=timing, fill=fill))
    flush()
    if not args.no_plot:
        write_plots(rows, args.out)
    failed = [r for r in rows if r.get("error") and not r["error"].startswith("skipped")]
    print(f"wrote {args.out}/generate.{{jsonl,md}}{'' if args.no_plot else ' + plots'}; {len(rows)} rows, {len(failed)} failed; "
          f"wall {total:.0f} s", flush=True)
    return rows


if __name__ == "__main__":
    main()
