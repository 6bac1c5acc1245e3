"""One sequence's KV cache as bytes: the prefill -> decode hand-off of disaggregated serving.

HACK's case (HACK.md §1, §7) is a cache sent from a prefill instance to a decode instance in 2 bits.
`export_sequence` packs everything one sequence holds in a KVCache (its pages of every layer: codes,
metadata and code sums; its open block and sinks; its length) into a self-describing payload;
`import_sequence` writes it into another cache, usually in another process, at the page ids that
cache's own `paging.PageAllocator` assigned. Decoding then continues bit-identically: the payload
is the cache's bytes, nothing is re-quantized.

Payload (version 1), all integers little-endian:
  magic   8 bytes  b"HACKKV\\x00\\x01"
  n       u32      length of the header
  header  n bytes  UTF-8 JSON: version, the QuantConfig fields, num_layers, num_kv_heads, head_dim,
                   kv_len, num_pages (pages carried) and per array: layer, field, dtype, shape, nbytes;
                   a cache with per-layer formats (hack_jax.layer_formats) adds layer_configs, the
                   QuantConfig fields of every layer (config: layer 0's)
  body             the arrays' raw bytes, in header order (C order)
  digest  32 bytes SHA-256 of everything before it
Only a sequence's live pages travel (paging.pages_needed(kv_len)), so the payload's size is the
sequence's share of the cache, not the pool's.

Errors: ValueError naming the problem for a payload that is truncated, corrupted (digest), of another
version, or whose format / shapes do not match the receiving cache; for a slot or page ids the
receiving cache cannot take. The receiving cache is a value: a rejected import returns nothing, so the
caller's cache is untouched.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import struct

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import kv_cache, paging
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import mixed
from hack_jax.layer_formats import LayerFormats

MAGIC = b"HACKKV\x00\x01"
VERSION = 1
_DIGEST = 32
# Fields of a LayerCache indexed by sequence slot; every other array field is indexed by page.
SEQUENCE_FIELDS = ("open_k", "open_v", "sink_k", "sink_v")


@dataclasses.dataclass(frozen=True)
class Header:
    """What a payload holds (read_header). arrays: ((layer, field, dtype, shape, nbytes), ...);
    layer_configs: None, or one QuantConfig per layer (a cache with per-layer formats)."""
    config: QuantConfig
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_len: int
    num_pages: int
    arrays: tuple
    layer_configs: tuple | None = None


def _config_dict(config: QuantConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _layer_configs(cache):
    """One QuantConfig per layer for a cache with per-layer formats, else None."""
    return cache.config.configs(cache.num_layers) if isinstance(cache.config, LayerFormats) else None


def _array_fields(layer):
    return [f.name for f in dataclasses.fields(layer) if f.name != "config"]


def _live_pages(cache, slot, page_indices, kv_len):
    pages = np.asarray(page_indices)
    if pages.shape != (cache.max_seqs, cache.pages_per_seq):
        raise ValueError(f"page_indices must be [{cache.max_seqs}, {cache.pages_per_seq}], got {pages.shape}")
    slot = paging.require_int("slot", slot)
    if not 0 <= slot < cache.max_seqs:
        raise ValueError(f"slot {slot} outside [0, max_seqs={cache.max_seqs})")
    n = paging.pages_needed(kv_len, page_size=cache.config.page_size,
                            num_sink_tokens=kv_cache.sink_tokens(cache.config))
    if n > cache.pages_per_seq:
        raise ValueError(f"kv_len={kv_len} needs {n} pages, more than pages_per_seq={cache.pages_per_seq}")
    ids = pages[slot, :n].astype(np.int64)
    bad = (ids <= paging.NULL_PAGE) | (ids >= cache.num_pages)
    if bad.any():
        raise ValueError(f"slot {slot}: page ids {ids[bad].tolist()} are not assigned pages of a pool of "
                         f"{cache.num_pages} (null page {paging.NULL_PAGE} excluded)")
    return slot, ids


def export_sequence(cache: kv_cache.KVCache, *, slot: int, page_indices, kv_len: int) -> bytes:
    """The payload of slot `slot` (module docstring) holding `kv_len` tokens.

    page_indices: the int[max_seqs, pages_per_seq] table the cache was written with (host copy).
    Raises ValueError for a slot or length the cache cannot hold, or unassigned live page ids.
    """
    kv_len = paging.require_int("kv_len", kv_len)
    if not 0 <= kv_len <= cache.capacity:
        raise ValueError(f"kv_len={kv_len} outside [0, capacity={cache.capacity}]")
    slot, ids = _live_pages(cache, slot, page_indices, kv_len)
    chunks, arrays = [], []
    ids_dev = jnp.asarray(ids, jnp.int32)
    if cache.stacked:  # one gather over all layers (of each format), split per layer here
        groups, layer_map = mixed.groups_of(cache.layers)
        taken = [{name: np.asarray(x) for name, x in _take_sequence(g, ids_dev, slot, 1).items()} for g in groups]
        per_layer = [{name: a[j] for name, a in taken[g].items()} for g, j in layer_map]
    else:
        per_layer = [_take_sequence(layer, ids_dev, slot, 0) for layer in cache.layers]
    for i, fields in enumerate(per_layer):
        for name, x in fields.items():
            a = np.ascontiguousarray(np.asarray(x))
            chunks.append(a.tobytes())
            arrays.append([i, name, a.dtype.name, list(a.shape), a.nbytes])
    first = _layers(cache)[0]
    configs = _layer_configs(cache)
    extra = {} if configs is None else dict(layer_configs=[_config_dict(c) for c in configs])
    header = json.dumps(dict(version=VERSION, config=_config_dict(first.config), num_layers=cache.num_layers,
                             num_kv_heads=first.num_kv_heads, head_dim=first.head_dim, kv_len=kv_len,
                             num_pages=int(ids.size), arrays=arrays, **extra)).encode()
    out = b"".join([MAGIC, struct.pack("<I", len(header)), header, *chunks])
    return out + hashlib.sha256(out).digest()


def read_header(payload: bytes) -> Header:
    """The payload's Header, after checking magic, version, length and digest (ValueError)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    if payload[:len(MAGIC) - 1] != MAGIC[:-1]:
        raise ValueError(f"not a hack-jax KV payload ({len(payload)} bytes, magic {payload[:8]!r})")
    if len(payload) < len(MAGIC) + 4 + _DIGEST:
        raise ValueError(f"KV payload truncated: {len(payload)} bytes")
    if payload[len(MAGIC) - 1] != VERSION:
        raise ValueError(f"KV payload version {payload[len(MAGIC) - 1]} is not supported (this reader: {VERSION})")
    (n,) = struct.unpack_from("<I", payload, len(MAGIC))
    start = len(MAGIC) + 4
    if start + n + _DIGEST > len(payload):
        raise ValueError(f"KV payload truncated: {len(payload)} bytes, its header alone needs {start + n + _DIGEST}")
    try:
        h = json.loads(payload[start:start + n])
        arrays = tuple((int(a[0]), str(a[1]), str(a[2]), tuple(int(s) for s in a[3]), int(a[4]))
                       for a in h["arrays"])
        config = QuantConfig(**h["config"])
        layer_configs = (None if "layer_configs" not in h else
                         tuple(QuantConfig(**c) for c in h["layer_configs"]))
        header = Header(config=config, num_layers=int(h["num_layers"]), num_kv_heads=int(h["num_kv_heads"]),
                        head_dim=int(h["head_dim"]), kv_len=int(h["kv_len"]), num_pages=int(h["num_pages"]),
                        arrays=arrays, layer_configs=layer_configs)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"KV payload header is corrupted: {type(e).__name__}: {e}") from None
    body = sum(a[4] for a in arrays)
    if len(payload) != start + n + body + _DIGEST:
        raise ValueError(f"KV payload truncated or padded: {len(payload)} bytes, the header describes "
                         f"{start + n + body + _DIGEST}")
    if hashlib.sha256(payload[:-_DIGEST]).digest() != payload[-_DIGEST:]:
        raise ValueError("KV payload corrupted: SHA-256 digest mismatch")
    return header


def import_sequence(cache: kv_cache.KVCache, payload: bytes, *, slot: int, page_indices) -> kv_cache.KVCache:
    """A new KVCache with the payload's sequence in slot `slot`, at that slot's page ids in
    `page_indices` (the receiving allocator's table, after `admit(slot, header.kv_len)`).

    Returns the new cache (kv_lens[slot] = header.kv_len); `cache` itself is not modified.
    Raises ValueError (read_header's, and) when the payload's format, layer count, heads, head_dim or
    array shapes differ from the cache's, or the slot's pages are not assigned.
    """
    header = read_header(payload)
    payload = bytes(payload)
    layers = _layers(cache)
    first = layers[0]
    want = dict(layer_configs=_layer_configs(cache), config=first.config, num_layers=cache.num_layers,
                num_kv_heads=first.num_kv_heads, head_dim=first.head_dim)
    got = dict(layer_configs=header.layer_configs, config=header.config, num_layers=header.num_layers,
               num_kv_heads=header.num_kv_heads, head_dim=header.head_dim)
    for key in want:
        if want[key] != got[key]:
            raise ValueError(f"KV payload does not match the receiving cache: {key} {got[key]} != {want[key]}")
    slot, ids = _live_pages(cache, slot, page_indices, header.kv_len)
    if ids.size != header.num_pages:
        raise ValueError(f"slot {slot} has {ids.size} pages for kv_len={header.kv_len}, payload {header.num_pages}")
    offset = len(MAGIC) + 4 + struct.unpack_from("<I", payload, len(MAGIC))[0]
    per_layer = [dict() for _ in range(cache.num_layers)]
    for layer_i, name, dtype, shape, nbytes in header.arrays:
        layer = layers[layer_i] if 0 <= layer_i < cache.num_layers else None
        if layer is None or name not in _array_fields(layer):
            raise ValueError(f"KV payload array {name!r} of layer {layer_i} does not exist in the receiving cache")
        dst = getattr(layer, name)
        expect = dst.shape[1:] if name in SEQUENCE_FIELDS else (ids.size,) + dst.shape[1:]
        if tuple(shape) != tuple(expect) or np.dtype(dst.dtype).name != dtype:
            raise ValueError(f"KV payload array {name} of layer {layer_i}: {dtype}{list(shape)} does not fit "
                             f"the receiving cache's {np.dtype(dst.dtype).name}{list(expect)}")
        per_layer[layer_i][name] = np.frombuffer(payload, dtype=dst.dtype, count=int(np.prod(shape)),
                                                 offset=offset).reshape(shape)
        offset += nbytes
    for i, fields in enumerate(per_layer):
        if set(fields) != set(_array_fields(layers[i])):
            raise ValueError(f"KV payload lacks arrays of layer {i}: "
                             f"{sorted(set(_array_fields(layers[i])) - set(fields))}")
    ids_dev = jnp.asarray(ids, jnp.int32)
    if cache.stacked:
        groups, layer_map = mixed.groups_of(cache.layers)
        for g in range(len(groups)):
            members = [per_layer[i] for i, (gg, _) in enumerate(layer_map) if gg == g]  # in index order
            stacked = {name: np.stack([f[name] for f in members]) for name in members[0]}
            groups[g] = _put_sequence(groups[g], stacked, ids_dev, slot, 1)
        layers = mixed.with_groups(cache.layers, groups)
    else:
        layers = tuple(_put_sequence(layer, fields, ids_dev, slot, 0)
                       for layer, fields in zip(cache.layers, per_layer))
    return dataclasses.replace(cache, layers=layers, kv_lens=jnp.asarray(cache.kv_lens, jnp.int32).at[slot].set(header.kv_len),
                               page_indices=jnp.asarray(page_indices, jnp.int32))


def _layers(cache):
    """The layers of a KVCache; of a stacked cache their shapes only (LayerCaches of ShapeDtypeStructs)."""
    if cache.stacked:
        return jax.eval_shape(mixed.layer_list, cache.layers)
    return list(cache.layers)


def _index(name, ids, slot, axis):  # the sequence's rows: its slot, or its pages, behind `axis` layer axes
    return (slice(None),) * axis + ((slot,) if name in SEQUENCE_FIELDS else (ids,))


@functools.partial(jax.jit, static_argnums=3)
def _take_sequence(layer, ids, slot, axis):
    return {name: getattr(layer, name)[_index(name, ids, slot, axis)] for name in _array_fields(layer)}


@functools.partial(jax.jit, static_argnums=4)
def _put_sequence(layer, fields, ids, slot, axis):
    return dataclasses.replace(layer, **{name: getattr(layer, name).at[_index(name, ids, slot, axis)].set(x)
                                         for name, x in fields.items()})
