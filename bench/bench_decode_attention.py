"""Decode attention: HACK (2-bit codes) vs dequant vs bf16 kernels vs jax's Pallas gqa vs XLA.

One decode step of one layer (one query token per sequence, every sequence holding kv_len tokens),
for real models' heads: Llama-3.1-8B (32 q / 8 kv heads, head_dim 128) and SmolLM2 (9 / 3, 64).
Per impl and shape: us per call, the bytes it must read, GB/s, % of the HBM roofs measured in the
same run (copy: read + written bytes of a device-to-device copy; read: a sum's read rate), and the
time ratio to our paged bf16 kernel (< 1: faster than it).

Timing (us): per impl one jitted `lax.fori_loop` runs n_iter x UNROLL calls, as a decode loop would:
each call's query is q + 1e-3 * (previous output), and the cache arrays a decode step's append writes
get a one-element in-place write per call (a shrunk cache append; the carry is donated): K and V for
the bf16 caches, the 16-bit open block for HACK (`--touch append`, the default since 2026-12-01;
`--touch all` writes every array >= 1 MiB, as the runs before did, which gave each HACK call ~6 more tiny
kernels than a bf16 call). So no call can be hoisted or
merged, and neither can per-call work on K/V done outside a kernel (jax gqa's and XLA's layout
transposes): with a constant cache XLA hoists it (a first H200 run measured jax gqa at 274 us where
it costs ~1 ms per call). Loops of n and 2n iterations are timed wall-clock (block_until_ready) and
per call = (median t(2n) - median t(n)) / (n * UNROLL): dispatch and other fixed costs cancel (if that
differs from t(2n) / (2n * UNROLL) by more than 2x, noise won and the latter is used); the
tiny query update and cache write (two small fusions per call) are included. us_wall: the median of
single jitted calls with block_until_ready, no loop (GPU.md's anchor method; includes dispatch).
When one call reads less than ROTATE_BYTES, the inputs are held in n_copies copies (one pool for
paged caches, switched by a page-table offset; a stacked axis for contiguous K/V, switched by a
dynamic slice) and the calls rotate through them, so that consecutive calls do not hit the 60 MB L2.

bytes = what an impl must read from HBM at minimum: K+V (+ page table) for bf16; codes + metadata
+ sums + open block + sinks + page table for HACK (only the parts holding the kv_len tokens);
the same minus the code sums for dequant (it does not read them); fp8: codes + scales; int8: codes + scales
+ minima; kivi2: K codes +
metadata of the sealed chunks, V codes + metadata of the quantized tokens, the residual rows in use
(`_kivi2_bytes`, from the layer's array shapes). q and the output are not counted (< 0.1%).

HACK caches are filled with random codes/metadata directly in the layout (hack_jax.kv_cache
dataclasses; timing does not depend on the values, which are finite and nonzero). Any impl that fails
for a shape is recorded with its error and the run goes on.

Usage: python3 bench/bench_decode_attention.py [--quick | --smoke] [--impls ...] [--out DIR]
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

HEADS = {"llama3.1-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128), "smollm2": (9, 3, 64), "tiny": (4, 2, 64)}
BATCHES = (1, 8, 32)
# the issue's target lengths first: a stage cut by its time limit loses the rest
KV_LENS = (32768, 1024, 131072, 8192)
QUICK = [("llama3.1-8b", 8, 32768), ("llama3.1-8b", 1, 32768), ("llama3.1-8b", 32, 8192),
         ("llama3.1-8b", 8, 8192), ("llama3.1-8b", 8, 131072), ("smollm2", 8, 32768)]
SMOKE = [("tiny", 2, 256), ("tiny", 1, 100)]
IMPLS = ("hack", "dequant", "bf16", "fp8", "int8", "kivi2", "int4", "turbo3", "turbo4", "jax_gqa", "xla", "triton")
# Not in the default run: hack4 = the HACK kernel on a 4-bit cache (QuantConfig.bits=4), rows hack4_<mode>;
# hack4p128 = the same at partition_size 128 (page 512: half the blocks, so half the per-block work per token);
# hackw = the HACK kernel on the K 32 / V 64 / 16-bit window 128 cache (issue 18's best 2-bit configuration;
# its V rotation is applied to q and the output outside the kernel, not timed here), rows hackw_<mode>;
# hackwns = hackw without code sums (QuantConfig.code_sums=False: no sums operands; folded modes only);
# gluon* = the Gluon kernel (pallas_kernels.gluon_decode_attention, impl="gluon") with these launch options
GLUON_IMPLS = {"gluon": {}, "gluon168": {"maxnreg": 168}, "gluondirect": {"staging": "direct"},
               "gluonjnp": {"open_in_kernel": False}, "gluonffi": {"launch": "ffi"},
               "gluonlegacy": {"launch": "legacy"}, "gluons32": {"num_splits": 32}, "gluons64": {"num_splits": 64}}
EXTRA_IMPLS = ("hack4", "hack4p128", "hackw", "hackwns") + tuple(GLUON_IMPLS)
HACKW_FIELDS = {"partition_size": 32, "v_group": 64, "window": 128}
PAGE_SIZE = 256  # QuantConfig's default
UNROLL = 8
ROTATE_BYTES = 256 << 20  # >= 4x the H200's 60 MB L2
MAX_COPIES = 8
# What each call writes into the cache (see _touch): "append" = what a decode step's append writes (the
# default since 2026-12-01), "all" = every cache array of >= 1 MiB (the runs before; --touch all).
TOUCH = "append"
MEMORY_LIMIT = 100 << 30
L2_BYTES = 60 << 20


# ----------------------------------------------------------------------------- data

def rand_bf16(key, shape):
    """Random bf16 of both signs with magnitudes in [2**-7, 2): built from 16 random bits, so the only
    temporary is the size of the result (jax.random.normal would need a float32 copy)."""
    b = jax.random.bits(key, shape, jnp.uint16)
    sign = b & jnp.uint16(0x8000)
    exponent = (jnp.uint16(120) + ((b >> 7) & jnp.uint16(7))) << 7
    return lax.bitcast_convert_type(sign | exponent | (b & jnp.uint16(0x7F)), jnp.bfloat16)


@dataclasses.dataclass
class Shape:
    heads: str
    batch: int
    kv_len: int

    @property
    def num_q_heads(self):
        return HEADS[self.heads][0]

    @property
    def num_kv_heads(self):
        return HEADS[self.heads][1]

    @property
    def head_dim(self):
        return HEADS[self.heads][2]

    @property
    def kv_bytes(self):  # bf16 K + V
        return 2 * self.batch * self.kv_len * self.num_kv_heads * self.head_dim * 2


def copies_for(nbytes):
    return int(min(MAX_COPIES, max(1, math.ceil(ROTATE_BYTES / max(nbytes, 1)))))


def _set_limits(max_copies, unroll, touch="append"):
    global MAX_COPIES, UNROLL, TOUCH
    MAX_COPIES, UNROLL, TOUCH = max_copies, unroll, touch


def paged_table(key, shape, pages_per_seq, n_copies):
    """Shuffled page ids: copy c of sequence b's pages lives in pool slots of copy c only."""
    per_copy = shape.batch * pages_per_seq
    perm = jax.random.permutation(key, per_copy).astype(jnp.int32).reshape(shape.batch, pages_per_seq)
    return perm, per_copy * n_copies


@dataclasses.dataclass
class Prepared:
    """call(q, i, arrays) -> f32[batch, num_q_heads, head_dim]; i = call number (for rotation).
    append: names of the cache arrays a decode step's append writes (_touch with TOUCH = "append")."""
    call: object
    arrays: object
    nbytes: int
    config: str
    n_copies: int
    append: tuple = ("k", "v")


# ----------------------------------------------------------------------------- impls

def prep_bf16(shape, key, *, interpret, config_fields=None):
    from pallas_kernels.bf16_decode_attention import bf16_decode_attention, default_config
    pps = -(-shape.kv_len // PAGE_SIZE)
    nbytes = shape.kv_bytes + shape.batch * pps * 4
    n = copies_for(nbytes)
    k1, k2, k3 = jax.random.split(key, 3)
    table, num_pages = paged_table(k1, shape, pps, n)
    pool = (num_pages, shape.num_kv_heads, PAGE_SIZE, shape.head_dim)
    arrays = dict(k=rand_bf16(k2, pool), v=rand_bf16(k3, pool), table=table,
                  lens=jnp.full((shape.batch,), shape.kv_len, jnp.int32))
    per_copy = shape.batch * pps
    config = default_config(batch=shape.batch, num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                            head_dim=shape.head_dim, page_size=PAGE_SIZE, pages_per_seq=pps)
    config = dataclasses.replace(config, **(config_fields or {}))

    def call(q, i, a):
        table = a["table"] + (i % n) * per_copy
        return bf16_decode_attention(q, a["k"], a["v"], table, a["lens"], config=config, interpret=interpret)

    return Prepared(call, arrays, nbytes, f"page_size={PAGE_SIZE} {config}", n)


def _random_hack_layer(key, layer_shapes):
    """Random finite contents for every field of a hack-format LayerCache (shapes from eval_shape)."""
    fields = {}
    names = [f.name for f in dataclasses.fields(layer_shapes)  # not the arrays a format leaves out (None)
             if f.name != "config" and getattr(layer_shapes, f.name) is not None]
    for name, k in zip(names, jax.random.split(key, len(names))):
        s = getattr(layer_shapes, name)
        if name.endswith("codes"):
            fields[name] = jax.random.bits(k, s.shape, jnp.uint8)
        elif name.endswith("sums"):
            fields[name] = jax.random.randint(k, s.shape, 0, 3 * 64, jnp.int32).astype(s.dtype)
        elif name.endswith("scale"):
            fields[name] = jax.random.uniform(k, s.shape, jnp.float32, 0.01, 0.1).astype(s.dtype)
        else:  # minimum, open block, sinks
            fields[name] = rand_bf16(k, s.shape).astype(s.dtype)
    return dataclasses.replace(layer_shapes, **fields)


def _cache_bytes(layer_shapes, shape, config, pps, skip_fields=()):
    """Bytes a decode step must read for kv_len tokens of every sequence: per-page fields scale with
    the tokens they describe; open block and sinks with the rows in use; plus the page table."""
    from hack_jax import kv_cache
    ns = kv_cache.sink_tokens(config)
    in_pages = shape.kv_len - ns
    p = config.partition_size if config.kv_format == "hack" else 1
    sealed, open_rows = (in_pages // p) * p, in_pages % p
    total = 0
    for f in dataclasses.fields(layer_shapes):
        if f.name == "config" or f.name in skip_fields or getattr(layer_shapes, f.name) is None:
            continue
        s = getattr(layer_shapes, f.name)
        row = math.prod(s.shape[3:]) * jnp.dtype(s.dtype).itemsize  # one row, one kv head
        if f.name.startswith("open"):
            total += open_rows * row * shape.num_kv_heads
        elif f.name.startswith("sink"):
            total += ns * row * shape.num_kv_heads
        else:  # [num_pages, kv heads, ...]: a page's bytes per kv head cover page_size tokens (any axis order)
            per_token = math.prod(s.shape[2:]) * jnp.dtype(s.dtype).itemsize / config.page_size
            total += sealed * per_token * shape.num_kv_heads
    return int(total * shape.batch + shape.batch * pps * 4)


def _layer_prep(shape, key, kv_format, skip_fields=(), partition_size=64, bits=2, **fields):
    from hack_jax import kv_cache, paging
    from hack_jax.config import QuantConfig
    page_size = max(PAGE_SIZE, 4 * partition_size)  # one page holds at least one packing group
    config = QuantConfig(kv_format=kv_format, page_size=page_size, partition_size=partition_size, bits=bits,
                         **fields)
    pps = paging.pages_needed(shape.kv_len, page_size=page_size, num_sink_tokens=kv_cache.sink_tokens(config))
    one = jax.eval_shape(lambda: kv_cache.init_layer(config, num_kv_heads=shape.num_kv_heads,
                                                     head_dim=shape.head_dim, num_pages=2, max_seqs=1))
    nbytes = _cache_bytes(one, shape, config, pps, skip_fields)
    n = copies_for(nbytes)
    k1, k2 = jax.random.split(key)
    table, num_pages = paged_table(k1, shape, pps, n)
    # Open blocks and sinks are per sequence slot: give each copy its own slots.
    shapes = jax.eval_shape(lambda: kv_cache.init_layer(config, num_kv_heads=shape.num_kv_heads,
                                                        head_dim=shape.head_dim, num_pages=num_pages,
                                                        max_seqs=shape.batch * n))
    layer = _random_hack_layer(k2, shapes)
    return layer, table, pps, nbytes, n, config


def _slots(layer, shape, i, n):
    """The layer with its per-sequence fields (open blocks, sinks) cut to copy i % n. With TOUCH =
    "append" the layer already holds copy 0's only (_one_copy_slots): returned as is, so a call pays no
    slicing copies (open blocks and sinks are ~0.3 MiB at batch 1; the page pools still rotate)."""
    if TOUCH == "append":
        return layer
    per = {}
    for f in dataclasses.fields(layer):
        if f.name.startswith(("open", "sink")):
            a = getattr(layer, f.name)
            per[f.name] = lax.dynamic_slice_in_dim(a, (i % n) * shape.batch, shape.batch, 0) if n > 1 else a
    return dataclasses.replace(layer, **per) if per else layer


def _one_copy_slots(layer, shape):
    """With TOUCH = "append": the layer with its open blocks and sinks cut once to copy 0's slots."""
    if TOUCH != "append":
        return layer
    per = {f.name: getattr(layer, f.name)[:shape.batch] for f in dataclasses.fields(layer)
           if f.name.startswith(("open", "sink")) and getattr(layer, f.name) is not None}
    return dataclasses.replace(layer, **per)


# decode_attention.DOT_DTYPES, the operand modes, and folded_f16d / folded_f16m: folded_f16 with KernelConfig.denormal
# True / False (the codes as f16 subnormals, the default / the 1024 + 64c planes)
HACK_DOTS = ("int8", "folded_f16", "folded_bf16", "folded_f16d", "folded_f16m")
KIVI_FIELDS = ("k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums", "open_k",
               "open_v", "sink_k", "sink_v")


def hack_variants(dots=("int8", "folded_f16"), p128=False, splits=(), stages=(), warps=()):
    """The operand modes of hack_decode_attention to time, as (row name, kwargs): hack_int8dot (INT8
    transients, the paper's numerics), hack_folded_f16 / hack_folded_bf16 (scale-folded 16-bit operands),
    hack_folded_f16d / hack_folded_f16m (folded f16 with KernelConfig.denormal True / False);
    p128 adds the int8 mode on a partition_size=128 cache (page 512): half the per-token INT8
    requantization work, lower accuracy (bench/results/accuracy.md), as a speed/accuracy data point.
    splits: each mode again with num_splits forced (rows hack_<mode>_s<N>), to check default_config's
    choice against its neighbours in one run. stages: each mode (default splits, and each forced split
    count) again with the pipeline depth num_stages forced (rows hack_<mode>[_s<N>]_st<K>); warps: likewise
    with num_warps forced (rows ..._w<K>)."""
    def mode_kwargs(d):  # folded_f16d / folded_f16m: KernelConfig.denormal True / False
        flag = {"folded_f16d": True, "folded_f16m": False}.get(d)
        return {"dot_dtype": d} if flag is None else {"dot_dtype": "folded_f16", "denormal": flag}
    out = [("hack_int8dot" if d == "int8" else f"hack_{d}", mode_kwargs(d)) for d in dots]
    out += [(f"hack_{d}_s{n}", dict(mode_kwargs(d), num_splits=n)) for d in dots for n in splits]
    base = list(out)
    out += [(f"{name}_st{k}", dict(kw, num_stages=k)) for name, kw in base for k in stages]
    out += [(f"{name}_w{k}", dict(kw, num_warps=k)) for name, kw in base for k in warps]
    if p128:
        out.append(("hack_p128_int8dot", {"dot_dtype": "int8", "partition_size": 128}))
    return out


def kivi_call_args(layer):
    """A kivi LayerCache -> (its arrays in the kernels' order, their static ints) for the Pallas kernels,
    which take arrays only (hack_jax.attention unpacks a layer the same way)."""
    static = dict(partition_size=layer.config.partition_size, num_sink_tokens=layer.config.num_sink_tokens)
    if layer.config.bits != 2:
        static["bits"] = layer.config.bits
    for f in ("v_group", "window"):
        if getattr(layer.config, f):
            static[f] = getattr(layer.config, f)
    return [getattr(layer, f) for f in KIVI_FIELDS], static


def _prep_sums_free(shape, key, make):
    """A hack kivi cache whose code sums the kernel does not read (not counted in the bytes), called through
    `make(config, pages_per_seq) -> (fn(q, arrays, table, lens, static), note)`."""
    layer, table, pps, nbytes, n, config = _layer_prep(shape, key, "hack", skip_fields=("k_sums", "v_sums"))
    lens = jnp.full((shape.batch,), shape.kv_len, jnp.int32)
    per_copy = shape.batch * pps
    fn, note = make(config, pps)

    def call(q, i, a):
        arrays, static = kivi_call_args(_slots(a["layer"], shape, i, n))
        return fn(q, arrays, a["table"] + (i % n) * per_copy, a["lens"], static)

    return Prepared(call, dict(layer=_one_copy_slots(layer, shape), table=table, lens=lens), nbytes,
                    f"kivi P={config.partition_size} page_size={config.page_size} ns={config.num_sink_tokens} {note}",
                    n, append=("open_k", "open_v"))


def prep_triton(shape, key, *, interpret):
    """The scale-folded jax-triton kernel (pallas_kernels.triton_decode_attention) on the kivi cache; it
    reads no code sums (not counted in the bytes). GPU only: interpret mode raises (an error row)."""
    from pallas_kernels import triton_decode_attention as mod
    if interpret:
        raise RuntimeError("the jax-triton kernel has no interpret mode (CPU: tests/triton_interpret.py)")

    def make(config, pps):
        kc = mod.default_config(batch=shape.batch, num_kv_heads=shape.num_kv_heads, pages_per_seq=pps,
                                page_size=config.page_size, partition_size=config.partition_size)
        return (lambda q, arrays, table, lens, static:
                mod.hack_triton_decode_attention(q, *arrays, table, lens, **static, config=kc)), str(kc)
    return _prep_sums_free(shape, key, make)


def prep_gluon(shape, key, *, interpret, **options):
    """The Gluon kernel (pallas_kernels.gluon_decode_attention, `options` its launch options: maxnreg, staging,
    open_in_kernel) on the kivi cache; no code sums read. GPU only."""
    from pallas_kernels import gluon_decode_attention as mod
    if interpret:
        raise RuntimeError("the gluon kernel has no interpret mode")
    return _prep_sums_free(shape, key, lambda config, pps: (
        lambda q, arrays, table, lens, static:
        mod.hack_gluon_decode_attention(q, *arrays, table, lens, **static, **options), f"gluon {options}"))


def prep_hack(shape, key, *, interpret, variant_kwargs=None):
    from pallas_kernels import decode_attention as mod
    kwargs = dict(variant_kwargs or {})
    P = kwargs.pop("partition_size", 64)
    bits = kwargs.pop("bits", 2)
    fields = {f: kwargs.pop(f) for f in ("v_group", "window", "code_sums") if f in kwargs}
    # the folded modes read no code sums: not counted in the bytes they must read (hackw and hackwns alike)
    skip = ("k_sums", "v_sums") if kwargs.get("dot_dtype", "int8") != "int8" else ()
    layer, table, pps, nbytes, n, config = _layer_prep(shape, key, "hack", skip_fields=skip, partition_size=P,
                                                       bits=bits, **fields)
    arrays = dict(layer=_one_copy_slots(layer, shape), table=table, lens=jnp.full((shape.batch,), shape.kv_len, jnp.int32))
    per_copy = shape.batch * pps

    def call(q, i, a):
        table = a["table"] + (i % n) * per_copy
        cache, static = kivi_call_args(_slots(a["layer"], shape, i, n))
        return mod.hack_decode_attention(q, *cache, table, a["lens"], interpret=interpret, **static, **kwargs)

    return Prepared(call, arrays, nbytes, f"kivi P={P} bits={bits} {fields or ''} page_size={config.page_size} ns=4 default_config "
                    f"{kwargs}", n, append=("open_k", "open_v"))


def prep_fp8(shape, key, *, interpret):
    """kv_format="fp8" pages (random finite e4m3 codes, scales in [0.01, 0.1]), the fp8 kernel."""
    from pallas_kernels.fp8_decode_attention import fp8_decode_attention
    layer, table, pps, nbytes, n, config = _layer_prep(shape, key, "fp8")
    k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
    f8 = jnp.float8_e4m3fn  # _random_hack_layer gave u8 bits, some of them e4m3 NaNs
    layer = dataclasses.replace(layer, k_codes=rand_bf16(k1, layer.k_codes.shape).astype(f8),
                                v_codes=rand_bf16(k2, layer.v_codes.shape).astype(f8))
    arrays = dict(layer=layer, table=table, lens=jnp.full((shape.batch,), shape.kv_len, jnp.int32))
    per_copy = shape.batch * pps

    def call(q, i, a):
        x = a["layer"]
        return fp8_decode_attention(q, x.k_codes, x.k_scale, x.v_codes, x.v_scale, a["table"] + (i % n) * per_copy,
                                    a["lens"], interpret=interpret)

    return Prepared(call, arrays, nbytes, f"e4m3 + f32 scale per (token, kv head), page_size={config.page_size} "
                    "default_config", n, append=("k_codes", "v_codes"))


def prep_int8(shape, key, *, interpret):
    """kv_format="int8" pages (random int8 codes, f16 scales in [0.01, 0.1], random minima), the int8 kernel."""
    from pallas_kernels.int8_decode_attention import int8_decode_attention
    layer, table, pps, nbytes, n, config = _layer_prep(shape, key, "int8")
    i8 = lambda x: lax.bitcast_convert_type(x, jnp.int8)  # _random_hack_layer gave u8 bits
    layer = dataclasses.replace(layer, k_codes=i8(layer.k_codes), v_codes=i8(layer.v_codes))
    arrays = dict(layer=layer, table=table, lens=jnp.full((shape.batch,), shape.kv_len, jnp.int32))
    per_copy = shape.batch * pps

    def call(q, i, a):
        x = a["layer"]
        return int8_decode_attention(q, x.k_codes, x.k_scale, x.k_min, x.v_codes, x.v_scale, x.v_min,
                                     a["table"] + (i % n) * per_copy, a["lens"], interpret=interpret)

    return Prepared(call, arrays, nbytes, f"int8 + f16 scale and min per (token, kv head), page_size={config.page_size} "
                    "default_config", n, append=("k_codes", "v_codes"))


def prep_nibble(shape, key, fmt, *, interpret):
    """kv_format="int4" / "turbo3" / "turbo4" pages (random bytes as two 4-bit codes, f16 scales in [0.01, 0.1],
    int4: random minima), the nibble kernel. q is taken as already rotated: the model's q M and out M^T are
    two small XLA matmuls outside the kernel, not timed here."""
    from pallas_kernels import nibble_decode_attention as nk
    layer, table, pps, nbytes, n, config = _layer_prep(shape, key, fmt)
    arrays = dict(layer=layer, table=table, lens=jnp.full((shape.batch,), shape.kv_len, jnp.int32))
    per_copy = shape.batch * pps
    codebook = None if fmt == "int4" else jnp.asarray(layer.codebook)

    def call(q, i, a):
        x, t = a["layer"], a["table"] + (i % n) * per_copy
        if fmt == "int4":
            return nk.int4_decode_attention(q, x.k_codes, x.k_scale, x.k_min, x.v_codes, x.v_scale, x.v_min, t,
                                            a["lens"], interpret=interpret)
        return nk.turbo_decode_attention(q, x.k_codes, x.k_scale, x.v_codes, x.v_scale, codebook, t, a["lens"],
                                         interpret=interpret)

    what = "affine + f16 scale and min" if fmt == "int4" else f"{fmt[-1]}-bit codebook + f16 scale"
    return Prepared(call, arrays, nbytes, f"two 4-bit codes per byte, {what} per (token, kv head), "
                    f"page_size={config.page_size} default_config", n, append=("k_codes", "v_codes"))


def _kivi2_bytes(layer, shape, pps):
    """Bytes a kivi2 decode call reads at kv_len (hack_jax.kv_cache.kivi2's rules): K codes/metadata of
    the R nk sealed tokens, V codes/metadata of the nq quantized ones, the residual rows in use."""
    from hack_jax.kv_cache import kivi2
    L, ps = shape.kv_len, layer.config.page_size
    nk = kivi2.RESIDUAL * (max(L - 1, 0) // kivi2.RESIDUAL)
    nq = max(L - 1 - kivi2.RESIDUAL, 0)
    per_tok = lambda *names: sum(math.prod(getattr(layer, f).shape[2:]) * getattr(layer, f).dtype.itemsize
                                 for f in names) / ps
    row = lambda f: math.prod(getattr(layer, f).shape[3:]) * getattr(layer, f).dtype.itemsize
    per_head = (nk * per_tok("k_codes", "k_scale", "k_min") + nq * per_tok("v_codes", "v_scale", "v_min")
                + (L - nk) * row("open_k") + (L - nq) * row("open_v"))
    return int(per_head * shape.num_kv_heads * shape.batch + shape.batch * pps * 4)


def prep_kivi2(shape, key, *, interpret):
    """kv_format="kivi2" pages (random codes/metadata), the kivi2 kernel (dequantizes in registers)."""
    from pallas_kernels.kivi2_decode_attention import kivi2_decode_attention
    from hack_jax.kv_cache import kivi2
    layer, table, pps, _, n, config = _layer_prep(shape, key, "kivi2")
    layer = _one_copy_slots(layer, shape)
    nbytes = _kivi2_bytes(layer, shape, pps)
    arrays = dict(layer=layer, table=table, lens=jnp.full((shape.batch,), shape.kv_len, jnp.int32))
    per_copy = shape.batch * pps

    def call(q, i, a):
        x = _slots(a["layer"], shape, i, n)
        return kivi2_decode_attention(q, x.k_codes, x.k_scale, x.k_min, x.v_codes, x.v_scale, x.v_min, x.open_k,
                                      x.open_v, a["table"] + (i % n) * per_copy, a["lens"],
                                      quant_group_size=kivi2.GROUP, interpret=interpret)

    return Prepared(call, arrays, nbytes, f"KIVI-2 G={kivi2.GROUP} R={kivi2.RESIDUAL} page_size={config.page_size} "
                    "default_config", n, append=("open_k", "open_v"))


def prep_dequant(shape, key, *, interpret):
    from pallas_kernels.dequant_decode_attention import dequant_decode_attention
    layer, table, pps, nbytes, n, _ = _layer_prep(shape, key, "hack", skip_fields=("k_sums", "v_sums"))
    arrays = dict(layer=_one_copy_slots(layer, shape), table=table, lens=jnp.full((shape.batch,), shape.kv_len, jnp.int32))
    per_copy = shape.batch * pps

    def call(q, i, a):
        table = a["table"] + (i % n) * per_copy
        cache, static = kivi_call_args(_slots(a["layer"], shape, i, n))
        return dequant_decode_attention(q, *cache, table, a["lens"], interpret=interpret, **static)

    return Prepared(call, arrays, nbytes, f"kivi P=64 page_size={PAGE_SIZE} ns=4 default_config "
                    "(HACK cache, codes dequantized in registers; code sums not read)", n,
                    append=("open_k", "open_v"))


def _contiguous(shape, key):
    n = copies_for(shape.kv_bytes)
    k1, k2 = jax.random.split(key)
    kv = (n * shape.batch, shape.kv_len, shape.num_kv_heads, shape.head_dim)
    return dict(k=rand_bf16(k1, kv), v=rand_bf16(k2, kv)), n


def _pick(a, shape, i, n):
    return lax.dynamic_slice_in_dim(a, (i % n) * shape.batch, shape.batch, 0) if n > 1 else a


def prep_jax_gqa(shape, key, *, interpret, contiguous=None):
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode
    arrays, n = contiguous or _contiguous(shape, key)
    k_splits = 16
    while shape.kv_len % k_splits or shape.kv_len // k_splits < 16:
        k_splits //= 2
    block_k = min(128, shape.kv_len // k_splits)

    def call(q, i, a):
        out = jax_decode.gqa(q.astype(jnp.bfloat16), _pick(a["k"], shape, i, n), _pick(a["v"], shape, i, n),
                             k_splits=k_splits, block_k=block_k, interpret=interpret)
        return out.astype(jnp.float32)

    return Prepared(call, arrays, shape.kv_bytes, f"contiguous [b, s, kvh, d]; k_splits={k_splits} "
                    f"block_k={block_k} block_h=16 (defaults otherwise)", n)


def prep_xla(shape, key, *, interpret, contiguous=None):
    del interpret
    arrays, n = contiguous or _contiguous(shape, key)
    g = shape.num_q_heads // shape.num_kv_heads

    def call(q, i, a):
        k, v = _pick(a["k"], shape, i, n), _pick(a["v"], shape, i, n)
        qg = q.astype(jnp.bfloat16).reshape(shape.batch, shape.num_kv_heads, g, shape.head_dim)
        s = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(shape.head_dim)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bkgs,bskd->bkgd", p.astype(jnp.bfloat16), v, preferred_element_type=jnp.float32)
        return o.reshape(shape.batch, shape.num_q_heads, shape.head_dim)

    return Prepared(call, arrays, shape.kv_bytes, "jnp.einsum + jax.nn.softmax, contiguous [b, s, kvh, d]", n)


# ----------------------------------------------------------------------------- timing

def _key_name(k):
    return getattr(k, "key", None) if hasattr(k, "key") else getattr(k, "name", None)


def _touch(arrays, out, append=("k", "v")):
    """A decode step's cache append, shrunk to one element, written in place (the loop carry is donated)
    with a value of the last output. It makes the cache loop-variant, so XLA cannot hoist per-call work
    on K/V (layout transposes in a wrapper) out of the timed loop, as it could with a constant cache.
    TOUCH = "append": only the arrays named in `append` (what the format's real append writes every
    step: K/V pages or contiguous K/V for bf16; the 16-bit open block for HACK, whose pages are written
    once per P tokens); "all": every array of >= 1 MiB (before 2026-12-01: 8 page-pool arrays per HACK
    call vs 2 for bf16, ~6 more tiny kernels per call, bench/NOTES_decode.md)."""
    val = out.reshape(-1)[0]

    def touch(path, a):
        if TOUCH == "all":
            if a.size * a.dtype.itemsize < (1 << 20):
                return a
        elif not path or _key_name(path[-1]) not in append:
            return a
        return lax.dynamic_update_slice(a, jnp.full((1,) * a.ndim, val).astype(a.dtype), (0,) * a.ndim)

    names = {_key_name(path[-1]) for path, _ in jax.tree_util.tree_leaves_with_path(arrays) if path}
    if TOUCH == "append" and not set(append) & names:
        raise ValueError(f"_touch: none of {append} among the cache arrays {sorted(map(str, names))}")
    return jax.tree_util.tree_map_with_path(touch, arrays)


def time_impl(prep, shape, *, reps, target_ms, key, wall_calls):
    """Returns (us per call from the loop slope, us per call wall clock, first call s, n_iter)."""
    q = jax.random.normal(key, (shape.batch, shape.num_q_heads, shape.head_dim), jnp.float32)

    @functools.partial(jax.jit, donate_argnums=2)
    def loop(q0, n_iter, arrays):
        def body(j, carry):
            qc, arrs = carry
            for u in range(UNROLL):
                out = prep.call(qc, j * UNROLL + u, arrs).astype(jnp.float32)
                qc = q0 + 1e-3 * out
                arrs = _touch(arrs, out, prep.append)
            return qc, arrs
        return lax.fori_loop(0, n_iter, body, (q0, arrays))

    def run(n_iter):
        t0 = time.perf_counter()
        out, prep.arrays = loop(q, jnp.int32(n_iter), prep.arrays)
        out.block_until_ready()
        return time.perf_counter() - t0, out

    first_s, out = run(1)  # compile + warm up
    if not bool(jnp.all(jnp.isfinite(out))):
        raise FloatingPointError("non-finite output")
    t2 = run(2)[0]
    n_iter = int(np.clip(target_ms * 1e-3 / max(t2 / 2, 1e-7), 2, 5000))
    # Slope: loops of n and 2n iterations, so fixed costs (dispatch, sync) cancel.
    t_n = float(np.median([run(n_iter)[0] for _ in range(reps)]))
    t_2n = float(np.median([run(2 * n_iter)[0] for _ in range(reps)]))
    us = (t_2n - t_n) / (n_iter * UNROLL) * 1e6
    plain = t_2n / (2 * n_iter * UNROLL) * 1e6  # fixed costs included: an upper bound
    if not 0.5 * plain < us <= plain * 1.05:  # noise swamped the difference (CPU smoke, tiny loops)
        us = plain

    one = jax.jit(prep.call)  # no loop: one dispatch per call, GPU.md's anchor method
    one(q, 0, prep.arrays).block_until_ready()
    walls = []
    for i in range(wall_calls):
        t0 = time.perf_counter()
        one(q, i, prep.arrays).block_until_ready()
        walls.append(time.perf_counter() - t0)
    return us, float(np.median(walls)) * 1e6, first_s, n_iter


def measure_roof(nbytes, reps=10):
    """HBM roofs, each the median of `reps` calls on nbytes of int32 (per-call dispatch < 2% at 4 GiB):
    copy = bytes read + written per second, best of a device-to-device copy and an elementwise x + 1;
    read = bytes read per second of a sum (decode attention only reads)."""
    x = jnp.ones((nbytes // 4,), jnp.int32)
    found = {}
    for name, fn, moved in (("copy", jax.jit(lambda x: jnp.copy(x)), 2), ("x+1", jax.jit(lambda x: x + 1), 2),
                            ("read", jax.jit(lambda x: jnp.sum(x)), 1)):
        fn(x).block_until_ready()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(x).block_until_ready()
            ts.append(time.perf_counter() - t0)
        gbps = moved * x.nbytes / float(np.median(ts)) / 1e9
        if gbps < 20000:  # a forwarded (not copied) buffer would read as absurd bandwidth
            found[name] = round(gbps)
    del x
    return max(found.get("copy", 0), found.get("x+1", 0)), found


# ----------------------------------------------------------------------------- outputs

def _note(r):
    """L2-resident rows; for the formats whose timed write differs between harnesses (HACK's open block vs
    all its arrays) the row's --touch (rows without the field predate it: "all")."""
    notes = ["L2-resident"] if r.get("l2_resident") else []
    if r["impl"].startswith(("hack", "dequant")):
        notes.append(f"touch {r.get('touch', 'all')}")
    return ", ".join(notes)


def write_markdown(rows, path, header):
    # The copy/sum roofs are XLA kernels' rates, below what a good read-only kernel streams on the H200
    # (our bf16 kernel reads ~4.5 TB/s): "% best read" is relative to the best read rate in the table.
    best = max((r["gbps"] for r in rows if "gbps" in r and not r.get("l2_resident")), default=float("nan"))
    lines = [header + f" % best read: of {best:.0f} GB/s, the best rate any impl read from HBM in this table "
             "(L2-resident rows excluded).", "",
             "| heads | batch | kv_len | impl | us | us wall | MiB read | GB/s | % copy roof | % read roof "
             "| % best read | time / bf16 | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['heads']} | {r['batch']} | {r['kv_len']} | {r['impl']} | - | - | - | - | - | - | - | - | "
                         f"FAILED: {r['error'][:120].replace('|', '/')} |")
            continue
        ratio = f"{r['ratio_vs_bf16']:.2f}" if r.get("ratio_vs_bf16") is not None else "-"
        lines.append(f"| {r['heads']} | {r['batch']} | {r['kv_len']} | {r['impl']} | {r['us']:.1f} | "
                     f"{r.get('us_wall', float('nan')):.1f} | {r['bytes'] / 2**20:.1f} | {r['gbps']:.0f} | "
                     f"{r['pct_roof']:.1f} | {r.get('pct_read_roof', float('nan')):.1f} | "
                     f"{100 * r['gbps'] / best:.1f} | {ratio} | "
                     f"{_note(r)} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no plot: {e}")
        return
    ok = [r for r in rows if not r.get("error")]
    panels = sorted({(r["heads"], r["batch"]) for r in ok})
    if not panels:
        return
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 4 * nrows), squeeze=False)
    impls = sorted({r["impl"] for r in ok})
    colors = {impl: plt.get_cmap("tab10" if len(impls) <= 10 else "tab20")(i) for i, impl in enumerate(impls)}
    for ax, (heads, batch) in zip(axes.flat, panels):
        for impl in impls:
            pts = sorted((r["kv_len"], r["us"]) for r in ok if (r["heads"], r["batch"], r["impl"]) == (heads, batch, impl))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl, color=colors[impl])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{heads}, batch {batch}")
        ax.set_xlabel("kv_len")
        ax.set_ylabel("us per decode step (one layer)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------- main

def parse_bf16_configs(specs):
    """'block_k:num_splits:num_warps:num_stages' strings -> (name, dict); num_splits 'd' = the default
    heuristic's for each shape."""
    out = []
    for spec in specs or ():
        bk, sp, nw, ns = spec.split(":")
        fields = dict(block_k=int(bk), num_warps=int(nw), num_stages=int(ns))
        if sp != "d":
            fields["num_splits"] = int(sp)
        out.append((f"bf16[{spec}]", fields))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} shapes (GPU.md's anchors)")
    ap.add_argument("--smoke", action="store_true", help="CPU check: interpret=True, tiny shapes")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS + EXTRA_IMPLS,
                    help="hack4 / hack4p128 / hackw / hackwns (not in the default): the HACK kernel on a 4-bit "
                         "cache (P 64 / P 128) / on the K 32, V 64, window 128 cache / that cache without code sums "
                         "(EXTRA_IMPLS), each --hack-dots "
                         "mode (hackwns: the folded ones); gluon*: the Gluon kernel with GLUON_IMPLS' options "
                         "(GPU only)")
    ap.add_argument("--heads", nargs="+", choices=sorted(HEADS), help="restrict head configs")
    ap.add_argument("--batches", nargs="+", type=int)
    ap.add_argument("--kv-lens", nargs="+", type=int)
    ap.add_argument("--shapes", nargs="+", metavar="HEADS:BATCH:KV_LEN",
                    help="exact shapes, in this order (instead of the heads x batches x lengths grid)")
    ap.add_argument("--bf16-configs", nargs="*", metavar="BK:SPLITS:WARPS:STAGES",
                    help="extra runs of our bf16 kernel with these configs (a sweep; default config always runs)")
    ap.add_argument("--hack-dots", nargs="+", default=["int8", "folded_f16"], choices=HACK_DOTS,
                    help="operand modes of the hack kernel to time (rows hack_int8dot, hack_folded_f16, "
                         "hack_folded_bf16, hack_folded_f16d)")
    ap.add_argument("--hack-p128", action="store_true",
                    help="also time the hack kernel on a partition_size=128 cache (hack_p128_int8dot)")
    ap.add_argument("--hack-splits", nargs="*", type=int, default=[],
                    help="also time each --hack-dots mode with num_splits forced to these values")
    ap.add_argument("--hack-stages", nargs="*", type=int, default=[],
                    help="also time each hack row with num_stages (the pipeline depth) forced to these values")
    ap.add_argument("--hack-warps", nargs="*", type=int, default=[],
                    help="also time each hack row (default or forced splits) with num_warps forced to these values")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=60.0, help="wall time of one timed loop")
    ap.add_argument("--unroll", type=int, default=UNROLL, help="calls per loop iteration")
    ap.add_argument("--wall-calls", type=int, default=20, help="single calls timed for us_wall")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--touch", choices=("append", "all"), default="append",
                    help="cache arrays written per call: what a decode append writes (default) or every array "
                         ">= 1 MiB (the runs before 2026-12-01)")
    ap.add_argument("--append", action="store_true", help="keep the rows already in OUT/decode_attention.jsonl")
    args = ap.parse_args(argv)
    _set_limits(2 if args.smoke else MAX_COPIES, args.unroll, args.touch)

    interpret = args.smoke
    if args.smoke or args.quick:  # fixed lists, narrowed by any of --heads / --batches / --kv-lens
        shapes = SMOKE if args.smoke else QUICK
        if args.smoke:
            args.reps, args.target_ms, args.wall_calls = 2, 1.0, 3
        shapes = [s for s in shapes if (not args.heads or s[0] in args.heads)
                  and (not args.batches or s[1] in args.batches) and (not args.kv_lens or s[2] in args.kv_lens)]
    elif args.shapes:
        try:
            shapes = [(h, int(b), int(n)) for h, b, n in (x.split(":") for x in args.shapes)]
        except ValueError:
            ap.error(f"--shapes takes HEADS:BATCH:KV_LEN items, got {args.shapes}")
        if bad := sorted({h for h, _, _ in shapes} - set(HEADS)):
            ap.error(f"--shapes: unknown heads {bad}; known: {sorted(HEADS)}")
    else:  # the given lists span the grid (any heads preset, batch or length); unset ones take the defaults
        shapes = [(h, b, s) for h in (args.heads or ("llama3.1-8b", "smollm2")) for s in (args.kv_lens or KV_LENS)
                  for b in (args.batches or BATCHES)]
    shapes = [Shape(*s) for s in shapes]
    os.makedirs(args.out, exist_ok=True)

    device = jax.devices()[0]
    gpu = getattr(device, "device_kind", str(device))
    roof, roof_parts = measure_roof(64 << 20 if args.smoke else 4 << 30)
    timing = (f"us: slope of wall clock over jitted lax.fori_loops of n and 2n iterations x {UNROLL} calls "
              f"(median of {args.reps} loops each, n for ~{args.target_ms:g} ms): q_next = q + 1e-3 * out and a "
              + ("one-element in-place write into what each format's decode append writes (bf16: K and V; "
                 "HACK: the open block) " if TOUCH == "append" else
                 "one-element in-place write into every cache array of >= 1 MiB ") +
              f"are carried, so nothing is hoisted; page pools / K, V "
              f"rotated over n_copies when one call reads < {ROTATE_BYTES >> 20} MiB. us_wall: median of "
              f"{args.wall_calls} single jitted calls with block_until_ready (includes dispatch)")
    print(f"{gpu} jax {jax.__version__}  HBM roof {roof:.0f} GB/s {roof_parts}  interpret={interpret}", flush=True)

    impls = []
    for name in args.impls:
        if name == "hack":
            try:
                impls += [(v, lambda s, k, kw=kw: prep_hack(s, k, interpret=interpret, variant_kwargs=kw))
                          for v, kw in hack_variants(args.hack_dots, args.hack_p128, args.hack_splits,
                                                     args.hack_stages, args.hack_warps)]
            except Exception as e:  # the module itself is missing or broken: one row per shape says so
                err = f"{type(e).__name__}: {e}"
                impls.append(("hack", lambda s, k, err=err: (_ for _ in ()).throw(RuntimeError(err))))
        elif name == "hack4":
            impls += [("hack4" + v[len("hack"):], lambda s, k, kw=kw: prep_hack(s, k, interpret=interpret,
                                                                               variant_kwargs={**kw, "bits": 4}))
                      for v, kw in hack_variants(args.hack_dots)]
        elif name == "hack4p128":
            impls += [("hack4p128" + v[len("hack"):],
                       lambda s, k, kw=kw: prep_hack(s, k, interpret=interpret,
                                                     variant_kwargs={**kw, "bits": 4, "partition_size": 128}))
                      for v, kw in hack_variants(args.hack_dots)]
        elif name == "hackw":
            impls += [("hackw" + v[len("hack"):], lambda s, k, kw=kw: prep_hack(s, k, interpret=interpret,
                                                                               variant_kwargs={**kw, **HACKW_FIELDS}))
                      for v, kw in hack_variants(args.hack_dots)]
        elif name == "hackwns":
            impls += [("hackwns" + v[len("hack"):],
                       lambda s, k, kw=kw: prep_hack(s, k, interpret=interpret,
                                                     variant_kwargs={**kw, **HACKW_FIELDS, "code_sums": False}))
                      for v, kw in hack_variants(args.hack_dots) if kw.get("dot_dtype", "int8") != "int8"]
        elif name == "bf16":
            impls.append(("bf16", lambda s, k: prep_bf16(s, k, interpret=interpret)))
            for cname, fields in parse_bf16_configs(args.bf16_configs):
                impls.append((cname, lambda s, k, f=fields: prep_bf16(s, k, interpret=interpret, config_fields=f)))
        elif name == "dequant":
            impls.append(("dequant", lambda s, k: prep_dequant(s, k, interpret=interpret)))
        elif name == "fp8":
            impls.append(("fp8", lambda s, k: prep_fp8(s, k, interpret=interpret)))
        elif name == "int8":
            impls.append(("int8", lambda s, k: prep_int8(s, k, interpret=interpret)))
        elif name == "kivi2":
            impls.append(("kivi2", lambda s, k: prep_kivi2(s, k, interpret=interpret)))
        elif name in ("int4", "turbo3", "turbo4"):
            impls.append((name, lambda s, k, f=name: prep_nibble(s, k, f, interpret=interpret)))
        elif name == "jax_gqa":
            impls.append(("jax_gqa", lambda s, k: prep_jax_gqa(s, k, interpret=interpret)))
        elif name == "triton":  # rows named hack_triton: the hack cache's memory and touch rules apply
            impls.append(("hack_triton", lambda s, k: prep_triton(s, k, interpret=interpret)))
        elif name == "xla":
            impls.append(("xla", lambda s, k: prep_xla(s, k, interpret=interpret)))
        elif name in GLUON_IMPLS:  # rows named hack_gluon*: the hack cache's memory and touch rules
            impls.append(("hack_" + name, lambda s, k, o=GLUON_IMPLS[name]: prep_gluon(s, k, interpret=interpret, **o)))

    path = os.path.join(args.out, "decode_attention.jsonl")
    rows = []
    if args.append and os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    key = jax.random.key(0)
    for shape in shapes:
        for impl, prep_fn in impls:
            row = dict(impl=impl, heads=shape.heads, batch=shape.batch, num_q_heads=shape.num_q_heads,
                       num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, kv_len=shape.kv_len,
                       gpu=gpu, jax_version=jax.__version__, timing_method=timing, touch=TOUCH, roof_gbps=roof)
            # peak memory vs the bf16 K/V size: the 2-bit caches are ~6x smaller (never skipped), the bf16
            # pool ~1x (+ its random-bits temporary), jax gqa / XLA's contiguous K/V + transposes ~3x
            factor = (0 if impl.startswith(("hack", "dequant", "kivi2", "int4", "turbo")) else 1 if impl in ("fp8", "int8")
                      else 2 if impl.startswith("bf16") else 3)
            if factor * shape.kv_bytes > MEMORY_LIMIT:
                row["error"] = f"skipped: needs > {MEMORY_LIMIT >> 30} GiB"
            else:
                key, k_data, k_q = jax.random.split(key, 3)
                try:
                    prep = prep_fn(shape, k_data)
                    us, us_wall, compile_s, n_iter = time_impl(
                        prep, shape, reps=args.reps, target_ms=args.target_ms, key=k_q, wall_calls=args.wall_calls)
                    gbps = prep.nbytes / us / 1e3
                    row.update(us=us, us_wall=us_wall, bytes=prep.nbytes, gbps=gbps, pct_roof=100 * gbps / roof,
                               pct_read_roof=100 * gbps / roof_parts.get("read", roof),
                               config=prep.config, n_copies=prep.n_copies, n_iter=n_iter,
                               compile_s=round(compile_s, 2),
                               l2_resident=prep.n_copies * prep.nbytes < 2 * L2_BYTES)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
                    row["traceback"] = traceback.format_exc()[-3000:]
                finally:
                    prep = None
            rows.append(row)
            status = (f"{row['us']:9.1f} us {row['gbps']:7.0f} GB/s {row['pct_roof']:5.1f}% roof "
                      f"(wall {row['us_wall']:.1f} us) "
                      f"(first call {row['compile_s']:.1f} s, copies {row['n_copies']})"
                      if "us" in row else row["error"][:150].replace("\n", " "))
            print(f"{shape.heads:12s} b{shape.batch:<3d} kv{shape.kv_len:<7d} {impl:24s} {status}", flush=True)
        write_outputs(rows, args, gpu, roof, roof_parts, timing, interpret)
    failed = [r for r in rows if r.get("error") and not r["error"].startswith("skipped")]
    print(f"wrote {args.out}/decode_attention.{{jsonl,md,png}}; {len(rows)} rows, {len(failed)} failed")
    return rows


def _shape_key(r):
    return (r["heads"], r["batch"], r["kv_len"])


def write_outputs(rows, args, gpu, roof, roof_parts, timing, interpret):
    """Rewrites all three outputs from every row so far (after each shape: a timeout loses little)."""
    order = {name: i for i, name in enumerate(("bf16", "hack_int8dot", "hack_folded_f16", "hack_folded_bf16", "dequant",
                                               "jax_gqa", "xla"))}
    rows.sort(key=lambda r: (_shape_key(r), order.get(r["impl"], 99), r["impl"]))
    base = {_shape_key(r): r["us"] for r in rows if r["impl"] == "bf16" and "us" in r}
    for r in rows:
        b = base.get(_shape_key(r))
        r["ratio_vs_bf16"] = r["us"] / b if b and "us" in r else None
    with open(os.path.join(args.out, "decode_attention.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    header = (f"# Decode attention, one layer, one step ({gpu}, jax {jax.__version__})\n\n"
              f"HBM roofs measured in this run (GB/s): {roof_parts}; % copy roof uses {roof:.0f} (read + "
              f"written bytes of a device-to-device copy), % read roof the sum's read rate. Timing: {timing}. "
              f"GB/s = bytes the impl must read / us. time / bf16 < 1: faster than our paged bf16 kernel."
              + ("\n\n**SMOKE RUN (interpret mode on CPU): the numbers mean nothing.**" if interpret else ""))
    write_markdown(rows, os.path.join(args.out, "decode_attention.md"), header)
    if not args.no_plot:
        write_plot(rows, os.path.join(args.out, "decode_attention.png"))


if __name__ == "__main__":
    main()
