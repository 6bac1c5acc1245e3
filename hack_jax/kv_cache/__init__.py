"""The paged KV cache: functional pytrees holding 2-bit (or baseline) K/V, HACK.md §4 and §6.

One module per format family, each a small frozen pytree dataclass plus its writers and readers,
behind one registry (`FORMATS`, keyed by `format_of(config)`), so models and benchmarks switch
formats with the config alone:

    kivi.py  kv_format="hack", layout="kivi": the 2-bit HACK format (default)
    seed.py  kv_format="hack", layout="seed": the paper's 2-bit layout, reference path only
    dense.py kv_format="bf16" | "float32"       int8.py  kv_format="int8"
    fp8.py   kv_format="fp8" (e4m3, vLLM's fp8)  kivi2.py kv_format="kivi2" (the KIVI-2 baseline)
    int4.py  kv_format="int4" (SAW-INT4: Hadamard-rotated K/V, asymmetric 4-bit per token)
    turbo.py kv_format="turbo3" | "turbo4" (TurboQuant: rotated K/V, Lloyd-Max codebook per coordinate)
    hack.py  what the two 2-bit layouts share   common.py  page helpers, checks, the registry record

    init_cache / init_layer -> write_prefill -> append (every decode step) -> hack_jax.attention.

Page layout (DESIGN.md "Paged cache layout"; axes [num_pages, num_kv_heads, ...]):
- A page holds page_size tokens of every kv head; one (page, kv head) tile is contiguous (8 KiB of
  K codes at the defaults: 256 tokens / 4 per byte x head_dim 128). page_size defaults to
  256 = 4 * partition_size, so one page is one packing group (4 blocks of P = 64 tokens packed 4
  codes per byte along tokens, DESIGN.md "2-bit packing") and a kernel's [P, head_dim] u8 tile
  holds 4 full blocks (GPU.md: paged streaming needs >= 8 KiB tiles to approach peak bandwidth).
- kivi V codes are stored token-major, [.., head_dim, page_size // 4]: the same bytes as the
  channel-major [.., page_size // 4, head_dim] of K, transposed, so 4 consecutive tokens of a
  channel are one 32-bit word, the int8 MMA's B operand layout for the PV dot.
- 2-bit formats: token t < num_sink_tokens is a 16-bit sink (per sequence); token t >= it has block
  position u = t - num_sink_tokens, page column u // page_size, row u % page_size. The newest
  incomplete block is the 16-bit open block, sealed (quantized into its page slot with its code
  sums) when it holds P tokens; with QuantConfig.window = W (kivi), the open region holds the newest
  u % W tokens and its W // P blocks are sealed together when it holds W.
- bf16 / float32 / int8 / fp8 / kivi2 / int4 / turbo have no sinks and no open block: token t is in
  page column t // page_size
  (kivi2 keeps its own 16-bit residual per sequence, kivi2.py)
  (`sink_tokens(config)` is 0 for them).
- Unassigned page_indices entries hold the null page 0 (hack_jax.paging), never handed out. Reads
  of ids outside [0, num_pages) read the null page, writes to them are dropped, and everything read
  beyond a sequence's kv_len is masked (metadata zeroed before use), so NaN or stale bytes in
  unused or reused pages cannot leak. Page ids are validated on the host by `paging` (and eagerly
  here for concrete inputs).

KVCache.layers is a tuple of one LayerCache per layer (each layer's update a separate buffer that a
donated step updates in place; the unrolled layer loop, the GPU default), or one stacked LayerCache
whose arrays carry a leading num_layers axis (init_cache(stacked=True): a model that scans over its
layers, the CPU default; models.config.ModelConfig.scan_layers).

The writers are jit-able, vectorized over sequences and blocks (no Python loop over tokens or pages
at run time) and contain no host round trip; callers donate the cache, which the GPU then updates
in place. `append(seal="always")` computes every slot's sealed block and drops the writes of the
slots that do not seal, so it is correct at every step; `seal="never"` is a second, cheaper compile
for the steps where the host knows no block fills (`seals_block`); `seal="after"` writes the rows
only and leaves the sealing to one `seal_filled` call after every layer has attended (a model step
then seals all its layers at once, vectorized over a stacked cache's layer axis, instead of
compiling the seal into every layer: docs/DESIGN.md "Deferred sealing"). Likewise `sinks=False`
leaves the sink rows' scatters out of the steps where the host knows no token is a sink
(`writes_sink`: every sequence past its first num_sink_tokens tokens, the common case).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Union, get_args

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import paging
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import dense, fp8, int4, int8, kivi, kivi2, mixed, seed, turbo
from hack_jax.layer_formats import LayerFormats
from hack_jax.rotation import rotate_v
from hack_jax.kv_cache.common import (STATIC, Format, FormatOps, Seal, array_fields, check_finite, check_kv,
                                      format_of, is_traced, pytree_dataclass)
from hack_jax.kv_cache.dense import DensePages
from hack_jax.kv_cache.hack import HackBlocks
from hack_jax.kv_cache.fp8 import Fp8Pages
from hack_jax.kv_cache.int4 import Int4Pages
from hack_jax.kv_cache.int8 import Int8Pages
from hack_jax.kv_cache.kivi import KiviPages
from hack_jax.kv_cache.kivi2 import Kivi2Pages
from hack_jax.kv_cache.mixed import LayerGroups
from hack_jax.kv_cache.seed import SeedPages
from hack_jax.kv_cache.turbo import TurboPages

FORMATS: dict[Format, FormatOps] = {
    "kivi": kivi.OPS, "seed": seed.OPS, "bf16": dense.OPS, "float32": dense.OPS, "int8": int8.OPS,
    "fp8": fp8.OPS, "kivi2": kivi2.OPS, "int4": int4.OPS, "turbo3": turbo.OPS, "turbo4": turbo.OPS}
SEAL_MODES = get_args(Seal)

LayerCache = Union[KiviPages, SeedPages, DensePages, Int8Pages, Fp8Pages, Kivi2Pages, Int4Pages, TurboPages]

__all__ = [
    "FORMATS", "SEAL_MODES", "DensePages", "Format", "FormatOps", "Fp8Pages", "HackBlocks",
    "Int4Pages", "Int8Pages", "KVCache", "Kivi2Pages", "KiviPages", "LayerCache", "LayerFormats", "LayerGroups",
    "Seal", "SeedPages", "TurboPages", "append", "bytes_per_token",
    "cache_bytes_report", "dequantize_cache", "format_of", "init_cache", "init_layer",
    "kv_rotation", "read_blocks", "seal_filled", "seals_block", "sink_tokens", "write_prefill", "writes_sink",
]


def _ops(layer) -> FormatOps:
    ops = FORMATS.get(format_of(layer.config)) if hasattr(layer, "config") else None
    if ops is None or not isinstance(layer, ops.pages):
        hint = (" (the writers and readers take one layer: cache.layers[i], or for a stacked cache "
                "jax.tree.map(lambda a: a[i], cache.layers))" if isinstance(layer, KVCache) else "")
        raise ValueError(f"layer must be a kv_cache LayerCache, got {type(layer).__name__}{hint}")
    return ops


@pytree_dataclass
class KVCache:
    """The whole cache: the layers' pages, the page table and the lengths.

      layers: tuple[LayerCache, ...], one per layer; or (init_cache(stacked=True)) ONE LayerCache
        whose every array has a leading num_layers axis, for a model that scans over its layers.
        A stacked LayerCache is a container only: hand write_prefill / append / the attention
        layer i's slice (jax.tree.map(lambda a: a[i], ...)), or its in-place view over all layers'
        pages with the page table mapped into layer i (hack_jax.kv_cache.stacked). Or
        kv_cache.mixed.LayerGroups: stacks of consecutive layers (per-layer formats, or
        init_cache(group_layers=n)); kv_cache.mixed.layer_list gives any form as one LayerCache per layer.
      page_indices: i32[max_seqs, pages_per_seq], from paging.PageAllocator (0 = null page).
      kv_lens: i32[max_seqs], tokens held per sequence (sinks + sealed + open).
      config: QuantConfig (static); or a hack_jax.layer_formats.LayerFormats, the layers' formats
        differing (kv_cache.mixed: `layers` a tuple of per-layer LayerCaches or LayerGroups).
    Sizes are properties read from the array shapes (static under jit, never out of sync).
    """

    layers: tuple
    page_indices: jax.Array
    kv_lens: jax.Array
    config: QuantConfig = dataclasses.field(metadata=STATIC)

    @property
    def stacked(self) -> bool:
        return not isinstance(self.layers, tuple)

    @property
    def num_layers(self) -> int:
        if isinstance(self.layers, LayerGroups):
            return self.layers.num_layers
        return jax.tree.leaves(self.layers)[0].shape[0] if self.stacked else len(self.layers)

    @property
    def max_seqs(self) -> int:
        return self.page_indices.shape[0]

    @property
    def pages_per_seq(self) -> int:
        return self.page_indices.shape[1]

    @property
    def num_pages(self) -> int:
        return jax.tree.leaves(self.layers)[0].shape[1] if self.stacked else self.layers[0].num_pages

    @property
    def num_sink_tokens(self) -> int:
        """Tokens per sequence kept outside pages (`sink_tokens(config)`)."""
        return sink_tokens(self.config)

    @property
    def capacity(self) -> int:
        """Most tokens one sequence can hold."""
        return self.num_sink_tokens + self.pages_per_seq * self.config.page_size


def kv_rotation(layer) -> np.ndarray | None:
    """The orthogonal f32[head_dim, head_dim] M whose product x M the layer stores for every K and V
    row (int4 / turbo: hack_jax.rotation.kv_rotation), or None for the formats that store x itself.
    Attention over such a layer multiplies q by M and its output by M^T (hack_jax.attention)."""
    ops = _ops(layer)
    return None if ops.rotation is None else ops.rotation(layer.config, layer.head_dim)


# ----------------------------------------------------------------------------- sizes and init


def sink_tokens(config: QuantConfig | LayerFormats) -> int:
    """Tokens per sequence kept outside pages: num_sink_tokens for "hack", 0 for the baselines (per-layer
    formats: the fewest of theirs, what one page table for every layer must count)."""
    if isinstance(config, LayerFormats):
        return min(sink_tokens(c) for c in config.distinct)
    return config.num_sink_tokens if FORMATS[format_of(config)].blocked else 0


def init_layer(config: QuantConfig, *, num_kv_heads: int, head_dim: int, num_pages: int,
               max_seqs: int) -> LayerCache:
    """An all-zero LayerCache of the format config.kv_format / config.layout (shapes: class docs).

    Raises ValueError for a config that is not a QuantConfig, num_pages < 2 (page 0 is the null
    page), non-positive sizes, (hack) head_dim not a multiple of min(config.channel_group, head_dim), or
    head_dim not a multiple of config.v_rotation; TypeError for a non-integer size.
    """
    if not isinstance(config, QuantConfig):
        raise ValueError(f"config must be a QuantConfig, got {type(config).__name__}")
    for name, value in dict(num_kv_heads=num_kv_heads, head_dim=head_dim, num_pages=num_pages,
                            max_seqs=max_seqs).items():
        paging.require_int(name, value)
    if num_pages < 2:
        raise ValueError(f"need the null page plus at least one page: {num_pages=}")
    if min(num_kv_heads, head_dim, max_seqs) < 1:
        raise ValueError(f"sizes must be positive: {num_kv_heads=} {head_dim=} {max_seqs=}")
    ops = FORMATS[format_of(config)]
    pc = min(config.channel_group, head_dim)
    if ops.blocked and head_dim % pc:
        raise ValueError(f"head_dim must be a multiple of the channel group min(v_group or partition_size, "
                         f"head_dim)={pc}: {head_dim=}")
    if config.v_rotation and head_dim % config.v_rotation:
        raise ValueError(f"head_dim must be a multiple of v_rotation={config.v_rotation}: {head_dim=}")
    return ops.init(config, num_pages, num_kv_heads, head_dim, max_seqs)


def init_cache(config: QuantConfig | LayerFormats, *, num_layers: int, num_kv_heads: int, head_dim: int,
               num_pages: int, max_seqs: int, pages_per_seq: int, stacked: bool = False,
               group_layers: int | None = None) -> KVCache:
    """An empty KVCache: num_layers zero LayerCaches (a tuple; stacked=True: one LayerCache with a
    leading num_layers axis), page_indices all null (0), kv_lens 0. A LayerFormats config whose
    layers resolve to more than one format gives kv_cache.mixed's cache (a tuple of per-layer
    LayerCaches; stacked: LayerGroups); to one format, that format's cache. group_layers (stacked
    only): at most this many consecutive layers of a format per stacked array, the layers then held
    as kv_cache.mixed.LayerGroups (e.g. to keep each stack addressable by the kernels:
    models.llama.cache_layout).

    num_pages counts the reserved null page. Raises ValueError as init_layer, and for
    num_layers < 1, pages_per_seq < 1 or group_layers < 1.
    """
    paging.require_int("num_layers", num_layers)
    paging.require_int("pages_per_seq", pages_per_seq)
    if num_layers < 1 or pages_per_seq < 1:
        raise ValueError(f"sizes must be positive: {num_layers=} {pages_per_seq=}")
    if group_layers is not None:
        paging.require_int("group_layers", group_layers)
        if group_layers < 1:
            raise ValueError(f"group_layers must be positive (or None): {group_layers=}")
    if isinstance(config, LayerFormats):
        configs = config.configs(num_layers)
        config = configs[0] if len(set(configs)) == 1 else config
        counts = [(c, configs.count(c)) for c in dict.fromkeys(configs)]
    else:
        configs, counts = (config,) * num_layers, [(config, num_layers)]
    sizes = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, num_pages=num_pages, max_seqs=max_seqs)
    for c, n in counts:
        _check_size(c, n, **sizes)
    if stacked and (isinstance(config, LayerFormats) or (group_layers or num_layers) < num_layers):
        group_configs, layer_map = mixed.group_map(configs, group_layers)
        layers = LayerGroups(groups=tuple(
            jax.tree.map(lambda a, n=[g for g, _ in layer_map].count(g): jnp.zeros((n,) + a.shape, a.dtype),
                         init_layer(c, **sizes)) for g, c in enumerate(group_configs)), layer_map=layer_map)
    elif stacked:
        layers = jax.tree.map(lambda a: jnp.zeros((num_layers,) + a.shape, a.dtype), init_layer(config, **sizes))
    elif isinstance(config, LayerFormats):
        layers = tuple(init_layer(c, **sizes) for c in configs)
    else:
        layer = init_layer(config, **sizes)
        layers = (layer,) + tuple(jax.tree.map(jnp.copy, layer) for _ in range(num_layers - 1))
    return KVCache(layers=layers, page_indices=jnp.zeros((max_seqs, pages_per_seq), jnp.int32),
                   kv_lens=jnp.zeros((max_seqs,), jnp.int32), config=config)


def _check_size(config, num_layers, num_kv_heads, head_dim, num_pages, max_seqs):
    """Up-front checks of init_cache's sizes, before anything is allocated: page ids are i32, and the
    cache must fit the default device's memory (its bytes_limit where jax reports one, else the
    host's physical memory: CPU). ValueError naming the sizes otherwise."""
    for name, value in dict(num_kv_heads=num_kv_heads, head_dim=head_dim, num_pages=num_pages,
                            max_seqs=max_seqs).items():
        paging.require_int(name, value)
    if num_pages > paging.INT32_MAX:
        raise ValueError(f"num_pages must fit the i32 page ids (<= {paging.INT32_MAX}): {num_pages=}")
    if min(num_layers, num_kv_heads, head_dim, num_pages, max_seqs) < 1:
        return  # init_layer names the bad size
    shapes = _layer_shapes(config, num_kv_heads, head_dim, num_pages, max_seqs)
    need = num_layers * sum(_nbytes(x) for x in jax.tree.leaves(shapes))
    limit = _memory_limit()
    if limit and need > limit:
        raise ValueError(f"the cache needs {need / 2**30:.1f} GiB ({num_layers=} {num_pages=} "
                         f"{num_kv_heads=} {head_dim=} {max_seqs=}), more than the "
                         f"{limit / 2**30:.1f} GiB of {jax.devices()[0].platform} memory")


def _memory_limit() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@functools.cache
def _compiled(fn, *static):
    """fn under jax.jit: an eager (validated, concrete) call runs as one compiled program instead of
    a few hundred dispatched ops; inside an outer jit it is inlined."""
    return jax.jit(fn, static_argnames=static)


def _validate_pages(layer, page_indices, kv_lens):
    """Host check of concrete (non-traced) inputs; inside jit the allocator is the check."""
    if is_traced(page_indices, kv_lens):
        return
    paging.validate_page_indices(page_indices, kv_lens, num_pages=layer.num_pages,
                                 page_size=layer.config.page_size,
                                 num_sink_tokens=sink_tokens(layer.config))


# ----------------------------------------------------------------------------- writing


def write_prefill(layer: LayerCache, k, v, *, lengths, page_indices, start=None,
                  key=None) -> LayerCache:
    """Writes prompts, or the next chunk of prompts, into sequence slots (ragged batch).

    Args:
      layer: the LayerCache.
      k, v: float[S, T, num_kv_heads, head_dim], S = max_seqs; row t of slot s is token
        start[s] + t, rows t < lengths[s] are written (left-aligned; rows beyond are ignored).
        T is static (a length bucket). With config.v_rotation, V is stored rotated
        (hack_jax.rotation; append does the same).
      lengths: i32[S] tokens to write per slot; 0 leaves the slot untouched.
      page_indices: i32[S, pages_per_seq]; pages must be assigned for start + lengths tokens.
      start: i32[S] tokens the slot already holds (chunked prefill), or None = all 0 (the slot
        must then be empty). The new tokens continue the sequence: they fill the remaining sinks,
        then the open block (sealing it, with its earlier 16-bit tokens, once it holds P), then
        whole blocks, then a new open block; the packing-group planes of blocks sealed before are
        kept. With bf16-exact K/V (what the open block stores anyway) and nearest rounding, any
        split into chunks stores the same bytes as one write_prefill (and as appends).
      key: PRNG key, required for rounding="stochastic" (ValueError otherwise), ignored for nearest:
        one key for every slot or a key array [S] (one per sequence). The noise of the token at
        position t is drawn from (the slot's key, t) alone (common.token_noise): the same
        sequence gets the same codes in any slot and beside any batch mates, and, given the same
        key, any split into chunks and appends stores the same bytes.
    Returns the new LayerCache. 2-bit formats: complete blocks quantized (all at once, scattered
    into their page slots with code sums), the remainder into the open block, sinks in 16 bits;
    baselines: every token into its page row.
    Raises ValueError on shape mismatch, a length beyond T, a negative start, or (concrete inputs
    only) negative lengths, bad page ids / over capacity, NaN or inf in k / v, or (kv_format "hack" /
    "int8" / "kivi2") |k|, |v| > 65504, beyond the float16 metadata (under jit they saturate there);
    TypeError for
    non-integer lengths / page_indices / start; under jit, tokens beyond capacity or bound for
    unassigned pages are dropped.
    """
    ops = _ops(layer)
    k, v = jnp.asarray(k), jnp.asarray(v)
    check_kv(layer, k, v, 4, "write_prefill")
    paging.check_index_dtype("write_prefill", lengths=lengths, page_indices=page_indices, start=start)
    lengths = jnp.asarray(lengths, jnp.int32)
    page_indices = jnp.asarray(page_indices, jnp.int32)
    if lengths.shape != (k.shape[0],) or page_indices.shape[0] != k.shape[0]:
        raise ValueError(f"write_prefill: batch mismatch: {k.shape=} {lengths.shape=} "
                         f"{page_indices.shape=}")
    if not is_traced(lengths) and lengths.size and int(lengths.max()) > k.shape[1]:
        raise ValueError(f"write_prefill: a length exceeds the prompt axis T={k.shape[1]}: "
                         f"lengths={np.asarray(lengths).tolist()}")
    if start is not None:
        start = jnp.asarray(start, jnp.int32)
        if start.shape != lengths.shape:
            raise ValueError(f"write_prefill: {start.shape=} must be {lengths.shape}")
        if not is_traced(start) and start.size and int(start.min()) < 0:
            raise ValueError(f"write_prefill: start must be >= 0: start={np.asarray(start).tolist()}")
    if not is_traced(lengths) and lengths.size and int(lengths.min()) < 0:
        raise ValueError(f"write_prefill: lengths must be >= 0: lengths={np.asarray(lengths).tolist()}")
    _validate_pages(layer, page_indices, lengths if start is None else start + lengths)
    if not is_traced(lengths):  # rows t >= lengths[s] are ignored: not checked
        rows = np.arange(k.shape[1])[None, :] < np.asarray(lengths)[:, None]
        check_finite(k, v, "write_prefill", layer.config, rows=rows)
    v = rotate_v(v, layer.config.v_rotation)
    return _compiled(ops.write_prefill)(layer, k, v, lengths, page_indices, start, key)


def _host_lengths(name: str, kv_lens, active):
    """(kv_lens, active) as NumPy arrays, checked for seals_block / writes_sink: [max_seqs] each, integer
    lengths, bool active (ValueError / TypeError naming `name` otherwise)."""
    lens, act = np.asarray(kv_lens), np.asarray(active)
    if lens.ndim != 1 or act.shape != lens.shape:
        raise ValueError(f"{name}: kv_lens and active must be [max_seqs] of one shape, got "
                         f"{lens.shape=} {act.shape=}")
    paging.check_index_dtype(name, kv_lens=lens)
    if act.size and act.dtype != bool:
        raise TypeError(f"{name}: active must be bool, got dtype {act.dtype}")
    return lens, act


def seals_block(config: QuantConfig, kv_lens, active) -> bool:
    """Host-side: does an `append` after which the slots hold kv_lens (int[S], as append's kv_lens:
    the new token included) fill some active slot's open region, so that its blocks must be sealed
    this step? True iff the format is 2-bit and some active slot s has kv_lens[s] >
    num_sink_tokens and (kv_lens[s] - num_sink_tokens) % W == 0, W = config.open_window
    (partition_size, or the kivi window). A decode loop that knows its lengths on the host
    (models.generate.Generator) passes seal="never" to `append` on the other steps (W - 1 of every
    W tokens at batch 1). NumPy only (no device sync)."""
    if isinstance(config, LayerFormats):  # a step seals if some layer's format seals
        return any(seals_block(c, kv_lens, active) for c in config.distinct)
    lens, act = _host_lengths("seals_block", kv_lens, active)
    if not FORMATS[format_of(config)].blocked:
        return False
    lens = lens.astype(np.int64)
    on = act & (lens > config.num_sink_tokens)
    return bool(np.any(on & ((lens - config.num_sink_tokens) % config.open_window == 0)))


def writes_sink(config: QuantConfig, kv_lens, active) -> bool:
    """Host-side: does an `append` after which the slots hold kv_lens (int[S], the new token included)
    write some active slot's token into its sinks? True iff the format keeps sinks (2-bit) and some
    active slot s has 1 <= kv_lens[s] <= num_sink_tokens (its new token's position kv_lens[s] - 1 <
    num_sink_tokens); per-layer formats: some layer's format does. A decode loop that knows its
    lengths on the host passes sinks=False to `append` on the other steps (every step once each
    sequence holds num_sink_tokens tokens: always after a prompt of that many). NumPy only."""
    if isinstance(config, LayerFormats):
        return any(writes_sink(c, kv_lens, active) for c in config.distinct)
    lens, act = _host_lengths("writes_sink", kv_lens, active)
    ns = sink_tokens(config)
    return bool(np.any(act & (lens >= 1) & (lens <= ns)))


def append(layer: LayerCache, k, v, *, kv_lens, active, page_indices, key=None,
           seal: Seal = "always", sinks: bool = True) -> LayerCache:
    """Writes one token per active sequence: token number kv_lens[s] - 1 of slot s.

    Args:
      layer: the LayerCache.
      k, v: float[S, num_kv_heads, head_dim], S = max_seqs (rows of inactive slots ignored).
      kv_lens: i32[S] tokens each slot holds *after* this append, the new token included (the
        meaning of kv_lens everywhere: hack_jax.step, decode_attention); an active slot's new token
        sits at position kv_lens[s] - 1, an inactive slot is left as it is.
      active: bool[S] which slots take a token this step.
      page_indices: i32[S, pages_per_seq]; the new token's page must be assigned.
      key: PRNG key for rounding="stochastic" (ValueError if None then), as write_prefill's: a
        sealed block's noise is drawn per (key, token position), not per slot.
      seal: (2-bit formats; ignored by the others) whether the sealing of full open blocks is
        compiled in. "always" (default): every slot's sealed block is computed and the writes of
        the slots that do not seal are dropped (correct at every step; ~10 page-pool scatters per
        layer and step). "after" (kivi only): the rows only; the caller seals with `seal_filled`
        (same arguments) before anything reads the cache as a whole again: until then a filled
        region's blocks are counted as sealed but are not (attention over them must read the
        region's 16-bit rows: hack_jax.attention.decode_step does). "never": the caller promises
        that no active slot fills its open block this step (`seals_block(config, kv_lens, active)`
        is False): the seal path is left out.
        Concrete inputs: a broken promise raises ValueError; under jit it cannot be checked, and a
        slot that fills its block anyway keeps it unsealed while kv_lens count it as sealed
        (attention then reads a stale page slot), so pass "never" only from host-side knowledge of
        the lengths, as models.generate.Generator does.
      sinks: (2-bit formats; ignored by the others) whether the sink rows' writes are compiled in.
        True (default): a token at a position < num_sink_tokens goes into its sink rows (two masked
        row scatters per layer and step, whatever the positions). False: the caller promises that no
        active slot's token is a sink (`writes_sink(config, kv_lens, active)` is False): sink_k /
        sink_v are returned as they are, nothing is scattered. Concrete inputs: a broken promise
        raises ValueError; under jit such a token would be dropped while kv_lens count it, so pass
        False only from host-side knowledge of the lengths.
    Returns the new LayerCache. 2-bit formats: the token goes into its sink or open-block row (row
    (kv_len - 1 - ns) % W of the open region, W = config.open_window); a slot whose open region
    becomes full has its W // P blocks sealed (each quantized into its page slot with code sums: the
    block's packing-group plane is cleared, then OR-ed, since pages are reused) and its open block
    zeroed; seed: K quantized per token at once into the page, only V goes through the open block.
    Raises ValueError on shape mismatch, an unknown `seal`, or (concrete inputs only) a negative
    kv_len or an active slot with kv_len 0 (no room for its new token), bad page ids / over capacity, NaN or
    inf in an active slot's k / v (or, "hack" / "int8" / "kivi2", |value| > 65504: write_prefill), seal="never" with a
    slot that seals, sinks=False with a slot whose token is a sink; TypeError for non-integer kv_lens /
    page_indices. Under jit nothing can raise:
    a token at a negative position or beyond capacity, or bound for the null page or an id outside
    [0, num_pages), is dropped (never written elsewhere).
    """
    if seal not in SEAL_MODES:
        raise ValueError(f"append: seal must be one of {SEAL_MODES}, got {seal!r}")
    ops = _ops(layer)
    if seal == "after" and ops.blocked and ops.seal is None:
        raise ValueError(f"append: seal='after' needs a format that seals apart from the append (layout "
                         f"'kivi'), got {format_of(layer.config)!r}; use seal='always'")
    k, v = jnp.asarray(k), jnp.asarray(v)
    check_kv(layer, k, v, 3, "append")
    paging.check_index_dtype("append", kv_lens=kv_lens, page_indices=page_indices)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    active = jnp.asarray(active, bool)
    page_indices = jnp.asarray(page_indices, jnp.int32)
    if kv_lens.shape != (k.shape[0],) or active.shape != kv_lens.shape or (
            page_indices.shape[0] != k.shape[0]):
        raise ValueError(f"append: batch mismatch: {k.shape=} {kv_lens.shape=} {active.shape=} "
                         f"{page_indices.shape=}")
    if not is_traced(kv_lens) and kv_lens.size and int(kv_lens.min()) < 0:
        raise ValueError(f"append: kv_lens must be >= 0: kv_lens={np.asarray(kv_lens).tolist()}")
    if not is_traced(kv_lens, active) and np.any(np.asarray(active) & (np.asarray(kv_lens) < 1)):
        raise ValueError(f"append: an active slot must hold >= 1 token after the append (its new "
                         f"one): kv_lens={np.asarray(kv_lens).tolist()} "
                         f"active={np.asarray(active).tolist()}")
    if not is_traced(active):
        _validate_pages(layer, page_indices, kv_lens)
        rows = np.asarray(active)
        check_finite(k, v, "append", layer.config, rows=rows)
    else:
        check_finite(k, v, "append", layer.config)
    if seal == "never" and not is_traced(kv_lens, active) and seals_block(layer.config, kv_lens, active):
        raise ValueError(f"append: seal='never' but an active slot fills its open block at this step "
                         f"(kv_lens={np.asarray(kv_lens).tolist()}, "
                         f"open_window={layer.config.open_window}, "
                         f"num_sink_tokens={layer.config.num_sink_tokens}); use seal='always'")
    if not sinks and not is_traced(kv_lens, active) and writes_sink(layer.config, kv_lens, active):
        slots = np.nonzero(np.asarray(active) & (np.asarray(kv_lens) <= sink_tokens(layer.config)))[0]
        raise ValueError(f"append: sinks=False but active slot(s) {slots.tolist()} write a sink token at this "
                         f"step (kv_lens={np.asarray(kv_lens).tolist()}, "
                         f"num_sink_tokens={layer.config.num_sink_tokens}); use sinks=True")
    position = kv_lens - active.astype(jnp.int32)  # of the new token
    active = active & (position >= 0)  # under jit: a negative position is dropped, never wrapped
    v = rotate_v(v, layer.config.v_rotation)
    sinks = bool(sinks) or not ops.blocked  # one compile for the formats without sinks
    return _compiled(ops.append, "seal", "sinks")(layer, k, v, position, active, page_indices, key, seal=seal,
                                                  sinks=sinks)


def seal_filled(layer: LayerCache, *, kv_lens, active, page_indices, key=None) -> LayerCache:
    """Seals what an append(seal="after") with the same arguments left open: each active slot whose
    open region that append filled (`seals_block`'s condition) has its W // P blocks quantized into
    their page slots with code sums and its open region zeroed, the same bytes as append(seal="always")
    (key: the same one). Other slots, and formats without an open region, are left as they are.
    jit-able; jax.vmap over a stacked cache's layer axis seals every layer at once.
    Raises ValueError for a blocked format that cannot seal apart from the append (seed) and as
    append for shapes; TypeError for non-integer kv_lens / page_indices."""
    ops = _ops(layer)
    if not ops.blocked:
        return layer
    if ops.seal is None:
        raise ValueError(f"seal_filled: layout {format_of(layer.config)!r} seals inside append only "
                         f"(seal='always')")
    paging.check_index_dtype("seal_filled", kv_lens=kv_lens, page_indices=page_indices)
    kv_lens, active = jnp.asarray(kv_lens, jnp.int32), jnp.asarray(active, bool)
    page_indices = jnp.asarray(page_indices, jnp.int32)
    if kv_lens.ndim != 1 or active.shape != kv_lens.shape or page_indices.shape[:1] != kv_lens.shape:
        raise ValueError(f"seal_filled: batch mismatch: {kv_lens.shape=} {active.shape=} {page_indices.shape=}")
    position = kv_lens - active.astype(jnp.int32)
    return _compiled(ops.seal)(layer, position, active & (position >= 0), page_indices, key)


# ----------------------------------------------------------------------------- reading


def read_blocks(layer: KiviPages | SeedPages, page_indices, kv_lens) -> HackBlocks:
    """Gathers a 2-bit layer's pages for all sequences (shapes in HackBlocks). jit-able.

    page_indices i32[S, pages_per_seq]; kv_lens i32[S], clipped to the capacity. Ids outside
    [0, num_pages) read the null page (and whatever they hold is masked). ValueError for a layer
    of a format without blocks.
    """
    ops = _ops(layer)
    if ops.read_blocks is None:
        raise ValueError(f"read_blocks needs a 2-bit layer (KiviPages / SeedPages), got "
                         f"{type(layer).__name__}")
    return ops.read_blocks(layer, page_indices, kv_lens)


def dequantize_cache(layer: LayerCache, page_indices, kv_lens, *, return_step: bool = False):
    """All sequences' cache contents as float32, in token order. jit-able.

    Args:
      page_indices: i32[S, pages_per_seq]; kv_lens: i32[S].
    Returns (k, v) f32[S, capacity, num_kv_heads, head_dim], zero at positions >= kv_lens;
    with return_step, also (k_step, v_step) of the same shape: the quantization scale of each
    element (|x - x_hat| <= step / 2 for nearest rounding), 0 for elements stored in 16 bits or
    unquantized. With config.v_rotation, v (and v_step) are in the rotated basis, as stored:
    hack_jax.rotation.rotate_v(v, config.v_rotation) gives V back; int4 / turbo: k and v are the
    stored x M (M = kv_rotation(layer)), times M^T gives K / V back.
    """
    ops = _ops(layer)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    if kv_lens.shape != (jnp.shape(page_indices)[0],):
        raise ValueError(f"dequantize_cache: kv_lens must be i32[{jnp.shape(page_indices)[0]}] (one per "
                         f"page-table row), got {kv_lens.shape=}")
    k, v, ks, vs = ops.dequantize(layer, page_indices, kv_lens)
    valid = (jnp.arange(k.shape[1])[None, :] < kv_lens[:, None])[:, :, None, None]
    k, v, ks, vs = (jnp.where(valid, x, 0.0) for x in (k, v, ks, vs))
    return (k, v, ks, vs) if return_step else (k, v)


# ----------------------------------------------------------------------------- memory


def _check_sizes(**sizes):
    for name, value in sizes.items():
        if paging.require_int(name, value) < 1:
            raise ValueError(f"{name} must be >= 1: {name}={value}")


def _layer_shapes(config, num_kv_heads, head_dim, num_pages, max_seqs):
    return jax.eval_shape(lambda: init_layer(config, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                             num_pages=num_pages, max_seqs=max_seqs))


def _nbytes(x) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def _category(name: str) -> str:
    if name.startswith(("open", "sink")):
        return "open_blocks" if name.startswith("open") else "sinks"
    if name.endswith("sums"):
        return "sums"
    if name.endswith(("scale", "min")):
        return "metadata"
    return "codes"  # codes, or the K/V values themselves for bf16/float32


def bytes_per_token(config: QuantConfig, num_kv_heads: int, head_dim: int, num_layers: int) -> float:
    """Page bytes per cached token over all layers (codes + metadata + sums, full pages); the
    per-sequence open blocks and sinks are not per-token and are counted by cache_bytes_report.
    Per-layer formats (LayerFormats): the sum over the layers. ValueError for a size < 1, TypeError
    for a non-int size."""
    _check_sizes(num_kv_heads=num_kv_heads, head_dim=head_dim, num_layers=num_layers)
    if isinstance(config, LayerFormats):
        return sum(bytes_per_token(c, num_kv_heads, head_dim, 1) for c in config.configs(num_layers))
    shapes = _layer_shapes(config, num_kv_heads, head_dim, 2, 1)
    page = sum(_nbytes(getattr(shapes, n)) for n in array_fields(shapes)
               if _category(n) not in ("open_blocks", "sinks")) / 2
    return num_layers * page / config.page_size


def cache_bytes_report(config: QuantConfig, *, num_layers: int, num_kv_heads: int, head_dim: int,
                       seq_len: int, max_seqs: int = 1) -> dict:
    """Device bytes of a cache holding max_seqs sequences of seq_len tokens, vs bf16.

    Pages are counted whole (pages_needed per sequence, plus the null page), and per-sequence open
    blocks and sinks are included: this is what init_cache would allocate for exactly this load.
    Returns a dict of ints: codes, metadata, sums, open_blocks, sinks, total, num_pages, and
    bf16 (a dense bf16 cache of exactly max_seqs * seq_len tokens), plus floats ratio = total /
    bf16, bits_per_element = 8 * total / (K and V elements of max_seqs * seq_len tokens) and
    page_bits_per_element (full pages only, the long-sequence limit: 8 * bytes_per_token / elements
    per token). Per-layer formats (LayerFormats): each layer counted in its format with the pages of
    the shared table (the fewest sinks). All are read from the shapes and dtypes of the arrays init_layer allocates
    (v_rotation adds none); ratio and bits_per_element are inf for seq_len 0. A load held entirely
    in sinks (seq_len <= num_sink_tokens) still counts the one usable page init_cache needs besides
    the null page. ValueError for sizes < 1 or seq_len < 0, TypeError for non-int sizes.
    """
    _check_sizes(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 max_seqs=max_seqs)
    if paging.require_int("seq_len", seq_len) < 0:
        raise ValueError(f"seq_len must be >= 0: {seq_len=}")
    per_seq = paging.pages_needed(seq_len, page_size=config.page_size,
                                  num_sink_tokens=sink_tokens(config))
    num_pages = max(max_seqs * per_seq, 1) + 1
    configs = config.configs(num_layers) if isinstance(config, LayerFormats) else (config,) * num_layers
    report = dict(codes=0, metadata=0, sums=0, open_blocks=0, sinks=0)
    for c in set(configs):
        shapes = _layer_shapes(c, num_kv_heads, head_dim, num_pages, max_seqs)
        for name in array_fields(shapes):
            report[_category(name)] += configs.count(c) * _nbytes(getattr(shapes, name))
    report["total"] = sum(report.values())
    report["num_pages"] = num_pages
    report["bf16"] = num_layers * 2 * max_seqs * seq_len * num_kv_heads * head_dim * 2
    report["ratio"] = report["total"] / report["bf16"] if report["bf16"] else math.inf  # seq_len 0
    elements_per_token = num_layers * 2 * num_kv_heads * head_dim
    report["bits_per_element"] = (8 * report["total"] / (max_seqs * seq_len * elements_per_token)
                                  if seq_len else math.inf)
    report["page_bits_per_element"] = 8 * bytes_per_token(config, num_kv_heads, head_dim,
                                                          num_layers) / elements_per_token
    return report
