"""One sequence's KV cache as bytes: the prefill -> decode hand-off of disaggregated serving.

HACK's case (HACK.md §1, §7) is a cache sent from a prefill instance to a decode instance in 2 bits.
`export_sequence` packs everything one sequence holds in a KVCache (its pages of every layer: codes,
metadata and code sums, where stored; its open block and sinks; its length) into a self-describing payload;
`import_sequence` writes it into another cache, usually in another process, at the page ids that
cache's own `paging.PageAllocator` assigned. Decoding then continues bit-identically: the payload
is the cache's bytes, nothing is re-quantized. `send_payload` / `recv_payload` move a payload over a
socket (a multiprocessing.connection Connection's, whose bytes-message framing they speak).

Payload (version 2), all integers little-endian:
  magic   8 bytes  b"HACKKV\\x00" + the version byte
  n       u32      length of the header
  header  n bytes  UTF-8 JSON: version, the QuantConfig fields, num_layers, num_kv_heads, head_dim,
                   kv_len, num_pages (pages carried) and per array: layer, field, dtype, shape, nbytes;
                   padded with spaces so that the body starts at a multiple of 64 bytes
  body             the arrays' raw bytes, in header order (C order)
  digest  32 bytes SHA-256 of the SHA-256 digests of the consecutive PIECE-byte pieces (8 MiB, the
                   last one shorter) of everything before it: a hash list, so that the pieces are
                   hashed on every core at once
Version 1 (read, not written) differs only in the digest, SHA-256 of everything before it, and the
unpadded header. Only a sequence's live pages travel (paging.pages_needed(kv_len)), so the payload's
size is the sequence's share of the cache, not the pool's.

A payload is built in, and received into, an anonymous memory map that asks for transparent huge
pages: at GiB sizes the page faults of fresh 4 KiB pages cost more than the copies themselves
(bench/NOTES_serving.md). It is bytes-like (len, slices as bytes, the buffer protocol).

Errors: ValueError naming the problem for a payload that is truncated, corrupted (digest), of another
version, or whose format / shapes do not match the receiving cache; for a slot or page ids the
receiving cache cannot take. The receiving cache is a value: a rejected import returns nothing, so the
caller's cache is untouched (the digest is checked before anything reaches the device).
"""
from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import mmap
import os
import socket
import struct
import time

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import kv_cache, paging
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import mixed
from hack_jax.kv_cache.common import array_fields
from hack_jax.layer_formats import LayerFormats

VERSION = 2
READS = (1, 2)  # versions read_header accepts
MAGIC = b"HACKKV\x00" + bytes([VERSION])
PIECE = 8 << 20
_PREFIX = len(MAGIC) + 4
_ALIGN = 64
_DIGEST = 32
# Fields of a LayerCache indexed by sequence slot; every other array field is indexed by page.
SEQUENCE_FIELDS = ("open_k", "open_v", "sink_k", "sink_v")


@dataclasses.dataclass(frozen=True)
class Header:
    """What a payload holds (read_header). arrays: ((layer, field, dtype, shape, nbytes), ...);
    body_offset: where the first array's bytes start; layer_configs: None, or one QuantConfig per
    layer (a cache with per-layer formats, hack_jax.layer_formats; config is then layer 0's)."""
    config: QuantConfig
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_len: int
    num_pages: int
    arrays: tuple
    version: int = VERSION
    body_offset: int = 0
    layer_configs: tuple | None = None


def _config_dict(config: QuantConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


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
                         f"{cache.num_pages} (null page {paging.NULL_PAGE} excluded); kv_len={kv_len} needs {n} "
                         f"pages in the slot's row of page_indices (PageAllocator.admit(slot, kv_len) first)")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"slot {slot}: page ids {ids.tolist()} repeat")
    return slot, ids


def _threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _parallel(fn, n: int) -> list:
    """[fn(0), ..., fn(n - 1)] on a thread per core: hashlib and numpy copies release the GIL."""
    workers = min(n, _threads())
    if workers <= 1:
        return [fn(i) for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, range(n)))


def _buffer(n: int):
    """A writable, zeroed n-byte buffer backed by huge pages where the kernel grants them (module
    docstring); a bytearray where anonymous private maps do not exist."""
    if n == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return bytearray(n)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def _sha256(data) -> bytes:
    return hashlib.sha256(data).digest()


def _digest(data: np.ndarray, version: int) -> bytes:
    """The digest of u8 `data` (everything before it) as payload `version` defines it."""
    if version == 1:
        return _sha256(data)
    return _sha256(b"".join(_parallel(lambda i: _sha256(data[i * PIECE:(i + 1) * PIECE]),
                                      max(1, -(-data.size // PIECE)))))


def _tick(timings, name, t0):
    if timings is not None:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
    return time.perf_counter()


def export_sequence(cache: kv_cache.KVCache, *, slot: int, page_indices, kv_len: int,
                    host_memory: str | None = None, timings: dict | None = None):
    """The payload of slot `slot` (module docstring) holding `kv_len` tokens, a bytes-like buffer.

    page_indices: the int[max_seqs, pages_per_seq] table the cache was written with (host copy).
    host_memory: None, or the memory kind the device -> host copy goes through first
      ("pinned_host": page-locked memory the GPU's copy engines write at link speed).
    timings: a dict that receives the seconds of each phase (gather on the device, device_to_host,
      pack_digest: the copies into the payload and the digest, one piece per core), or None.
    Raises ValueError for a slot or length the cache cannot hold, or unassigned live page ids.
    """
    kv_len = paging.require_int("kv_len", kv_len)
    if not 0 <= kv_len <= cache.capacity:
        raise ValueError(f"kv_len={kv_len} outside [0, capacity={cache.capacity}]")
    slot, ids = _live_pages(cache, slot, page_indices, kv_len)
    t = time.perf_counter()
    ids_dev = jnp.asarray(ids, jnp.int32)
    if cache.stacked:  # one gather over all layers (of each format), split per layer on the host (views)
        groups, layer_map = mixed.groups_of(cache.layers)
        taken = [_take_sequence(g, ids_dev, slot, 1) for g in groups]
    else:
        taken = [_take_sequence(layer, ids_dev, slot, 0) for layer in cache.layers]
    if timings is not None:
        jax.block_until_ready(taken)
    t = _tick(timings, "gather", t)
    if host_memory is not None:
        taken = jax.device_put(taken, jax.tree.map(lambda a: a.sharding.with_memory_kind(host_memory), taken))
    taken = jax.device_get(taken)  # every array's copy starts before the first is waited for
    t = _tick(timings, "device_to_host", t)
    if cache.stacked:
        taken = [{name: a[j] for name, a in taken[g].items()} for g, j in layer_map]
    sources, arrays = [], []
    for i, fields in enumerate(taken):
        for name, a in fields.items():
            a = np.ascontiguousarray(a)
            sources.append(a.reshape(-1).view(np.uint8))
            arrays.append([i, name, a.dtype.name, list(a.shape), a.nbytes])
    first = _layers(cache)[0]
    configs = _layer_configs(cache)
    extra = {} if configs is None else dict(layer_configs=[_config_dict(c) for c in configs])
    header = json.dumps(dict(version=VERSION, config=_config_dict(first.config), num_layers=cache.num_layers,
                             num_kv_heads=first.num_kv_heads, head_dim=first.head_dim, kv_len=kv_len,
                             num_pages=int(ids.size), arrays=arrays, **extra)).encode()
    header += b" " * (-(_PREFIX + len(header)) % _ALIGN)
    prefix = np.frombuffer(MAGIC + struct.pack("<I", len(header)) + header, np.uint8)
    sources.insert(0, prefix)
    starts = np.cumsum([0] + [s.size for s in sources]).tolist()
    size = starts[-1]
    out = _buffer(size + _DIGEST)
    view = np.frombuffer(out, np.uint8)

    def piece(k):  # copy what lands in bytes [lo, hi), then hash them while they are in cache
        lo, hi = k * PIECE, min(size, (k + 1) * PIECE)
        j = bisect.bisect_right(starts, lo) - 1
        while j < len(sources) and starts[j] < hi:
            a, b = max(lo, starts[j]), min(hi, starts[j + 1])
            view[a:b] = sources[j][a - starts[j]:b - starts[j]]
            j += 1
        return _sha256(view[lo:hi])

    view[size:] = np.frombuffer(_sha256(b"".join(_parallel(piece, -(-size // PIECE)))), np.uint8)
    _tick(timings, "pack_digest", t)
    return out


def _bytes_view(payload) -> np.ndarray:
    """payload's bytes as a u8 array (writable if the payload is), without a copy; TypeError if the
    payload is not bytes-like."""
    if isinstance(payload, str):
        raise TypeError("payload must be bytes-like (bytes, bytearray, memoryview, mmap), got str")
    try:
        mv = memoryview(payload)
    except TypeError:
        raise TypeError(f"payload must be bytes-like (bytes, bytearray, memoryview, mmap), got "
                        f"{type(payload).__name__}") from None
    return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, np.uint8)


def read_header(payload, *, check_digest: bool = True) -> Header:
    """The payload's Header, after checking magic, version, length and (check_digest) the digest:
    ValueError naming what is wrong. check_digest=False only to peek at a payload that
    import_sequence will check before it is used."""
    data = _bytes_view(payload)
    if bytes(data[:len(MAGIC) - 1]) != MAGIC[:-1]:
        raise ValueError(f"not a hack-jax KV payload ({data.size} bytes, magic {bytes(data[:8])!r})")
    if data.size < _PREFIX + _DIGEST:
        raise ValueError(f"KV payload truncated: {data.size} bytes")
    version = int(data[len(MAGIC) - 1])
    if version not in READS:
        raise ValueError(f"KV payload version {version} is not supported (this reader: {list(READS)})")
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    if _PREFIX + n + _DIGEST > data.size:
        raise ValueError(f"KV payload truncated: {data.size} bytes, its header alone needs {_PREFIX + n + _DIGEST}")
    try:
        h = json.loads(bytes(data[_PREFIX:_PREFIX + n]))
        arrays = tuple((int(a[0]), str(a[1]), str(a[2]), tuple(int(s) for s in a[3]), int(a[4]))
                       for a in h["arrays"])
        config = QuantConfig(**h["config"])
        layer_configs = (None if "layer_configs" not in h else
                         tuple(QuantConfig(**c) for c in h["layer_configs"]))
        header = Header(config=config, num_layers=int(h["num_layers"]), num_kv_heads=int(h["num_kv_heads"]),
                        head_dim=int(h["head_dim"]), kv_len=int(h["kv_len"]), num_pages=int(h["num_pages"]),
                        arrays=arrays, version=version, body_offset=_PREFIX + n, layer_configs=layer_configs)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"KV payload header is corrupted: {type(e).__name__}: {e}") from None
    body = sum(a[4] for a in arrays)
    if data.size != _PREFIX + n + body + _DIGEST:
        raise ValueError(f"KV payload truncated or padded: {data.size} bytes, the header describes "
                         f"{_PREFIX + n + body + _DIGEST}")
    if check_digest and _digest(data[:-_DIGEST], version) != bytes(data[-_DIGEST:]):
        raise ValueError("KV payload corrupted: SHA-256 digest mismatch")
    return header


def import_sequence(cache: kv_cache.KVCache, payload, *, slot: int, page_indices, donate: bool = False,
                    host_memory: str | None = None, timings: dict | None = None) -> kv_cache.KVCache:
    """A new KVCache with the payload's sequence in slot `slot`, at that slot's page ids in
    `page_indices` (the receiving allocator's table, after `admit(slot, header.kv_len)`).

    Returns the new cache (kv_lens[slot] = header.kv_len); `cache` itself is not modified, unless
    donate=True: then its layers' buffers become the result's (no second pool on the device; `cache`
    must not be used afterwards). Every check runs before that, so a rejected payload leaves `cache`
    as it was either way.
    host_memory: None, or the memory kind the host -> device copy goes through first
      ("pinned_host": see export_sequence).
    timings: a dict that receives the seconds of each phase (check: header and digest,
      host_to_device, scatter), or None.
    Raises ValueError (read_header's, and) when the payload's format, layer count, heads, head_dim or
    array shapes differ from the cache's, or the slot's pages are not assigned.
    """
    t = time.perf_counter()
    header = read_header(payload)
    data = _bytes_view(payload)
    layers = _layers(cache)
    first = layers[0]
    want = dict(layer_configs=_layer_configs(cache), config=first.config, num_layers=cache.num_layers,
                num_kv_heads=first.num_kv_heads, head_dim=first.head_dim)
    got = dict(layer_configs=header.layer_configs, config=header.config, num_layers=header.num_layers,
               num_kv_heads=header.num_kv_heads, head_dim=header.head_dim)
    for key in want:
        if want[key] != got[key]:
            if isinstance(want[key], QuantConfig) and isinstance(got[key], QuantConfig):
                fields = [f.name for f in dataclasses.fields(QuantConfig)
                          if getattr(got[key], f.name) != getattr(want[key], f.name)]
                differ = ", ".join(f"{f} {getattr(got[key], f)!r} != {getattr(want[key], f)!r}" for f in fields)
                raise ValueError(f"KV payload does not match the receiving cache: {key}: {differ} "
                                 f"(payload {got[key]}, cache {want[key]})")
            raise ValueError(f"KV payload does not match the receiving cache: {key} {got[key]} != {want[key]}")
    slot, ids = _live_pages(cache, slot, page_indices, header.kv_len)
    if ids.size != header.num_pages:
        raise ValueError(f"slot {slot} has {ids.size} pages for kv_len={header.kv_len}, payload {header.num_pages}")
    offset = header.body_offset
    per_layer = [dict() for _ in range(cache.num_layers)]
    for layer_i, name, dtype, shape, nbytes in header.arrays:
        if not 0 <= layer_i < cache.num_layers or name not in array_fields(layers[layer_i]):
            raise ValueError(f"KV payload array {name!r} of layer {layer_i} does not exist in the receiving cache")
        dst = getattr(layers[layer_i], name)
        expect = dst.shape[1:] if name in SEQUENCE_FIELDS else (ids.size,) + dst.shape[1:]
        if (tuple(shape) != tuple(expect) or np.dtype(dst.dtype).name != dtype
                or nbytes != np.dtype(dst.dtype).itemsize * int(np.prod(shape))):
            raise ValueError(f"KV payload array {name} of layer {layer_i}: {dtype}{list(shape)} does not fit "
                             f"the receiving cache's {np.dtype(dst.dtype).name}{list(expect)}")
        per_layer[layer_i][name] = data[offset:offset + nbytes].view(dst.dtype).reshape(shape)
        offset += nbytes
    for i, fields in enumerate(per_layer):
        names = array_fields(layers[i])
        if set(fields) != set(names):
            raise ValueError(f"KV payload lacks arrays of layer {i}: {sorted(set(names) - set(fields))}")
    t = _tick(timings, "check", t)
    devices = getattr(jax.tree.leaves(cache.layers)[0], "devices", lambda: ())()
    device = next(iter(devices)) if len(devices) == 1 else None  # None: jax's default placement
    if host_memory is not None:
        device = device or jax.devices()[0]
        per_layer = jax.device_put(per_layer, jax.sharding.SingleDeviceSharding(device, memory_kind=host_memory))
        device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")  # a bare Device keeps the kind
    per_layer = jax.block_until_ready(jax.device_put(per_layer, device))
    t = _tick(timings, "host_to_device", t)
    ids_dev = jax.device_put(np.asarray(ids, np.int32), device)
    # every argument committed to the device: a fresh (uncommitted) cache and one a compiled step
    # returned (committed) would otherwise compile the write twice
    src = cache.layers if device is None else jax.device_put(cache.layers, device)
    put = _put_sequence_donated if donate else _put_sequence
    if cache.stacked:  # per format group: its layers' arrays stacked in index order
        groups, layer_map = mixed.groups_of(src)
        for g in range(len(groups)):
            members = [per_layer[i] for i, (gg, _) in enumerate(layer_map) if gg == g]
            stacked = {name: tuple(f[name] for f in members) for name in members[0]}
            groups[g] = put(groups[g], stacked, ids_dev, slot, 1)
        layers = mixed.with_groups(src, groups)
    else:
        layers = tuple(put(layer, fields, ids_dev, slot, 0) for layer, fields in zip(src, per_layer))
    kv_lens = np.array(cache.kv_lens, np.int32)  # on the host: an eager update would compile per placement
    kv_lens[slot] = header.kv_len
    out = dataclasses.replace(cache, layers=layers, kv_lens=jax.device_put(kv_lens, device),
                              page_indices=jax.device_put(np.asarray(page_indices, np.int32), device))
    if timings is not None:
        jax.block_until_ready(out)
    _tick(timings, "scatter", t)
    return out


def _layers(cache):
    """The layers of a KVCache; of a stacked cache their shapes only (LayerCaches of ShapeDtypeStructs)."""
    if cache.stacked:
        return jax.eval_shape(mixed.layer_list, cache.layers)
    return list(cache.layers)


def _layer_configs(cache):
    """One QuantConfig per layer for a cache with per-layer formats, else None."""
    return cache.config.configs(cache.num_layers) if isinstance(cache.config, LayerFormats) else None


def _index(name, ids, slot, axis):  # the sequence's rows: its slot, or its pages, behind `axis` layer axes
    return (slice(None),) * axis + ((slot,) if name in SEQUENCE_FIELDS else (ids,))


@functools.partial(jax.jit, static_argnums=3)
def _take_sequence(layer, ids, slot, axis):
    return {name: getattr(layer, name)[_index(name, ids, slot, axis)] for name in array_fields(layer)}


def _put_sequence(layer, fields, ids, slot, axis):
    """The layer with `fields` written at pages `ids` (distinct) / at `slot`. Pages as a gather from
    the payload's pages under a mask, not a scatter: XLA's CPU scatter runs ~3x slower, and on a GPU
    both are one pass over the pool."""
    out = {}
    for name, x in fields.items():
        pool = getattr(layer, name)
        x = jnp.stack(x) if isinstance(x, tuple) else x
        if name in SEQUENCE_FIELDS:
            out[name] = pool.at[_index(name, ids, slot, axis)].set(x)
            continue
        src = jnp.full(pool.shape[axis], -1, jnp.int32).at[ids].set(jnp.arange(ids.size, dtype=jnp.int32))
        hit = (src >= 0).reshape((1,) * axis + (-1,) + (1,) * (pool.ndim - axis - 1))
        out[name] = jnp.where(hit, jnp.take(x, jnp.maximum(src, 0), axis=axis), pool)
    return dataclasses.replace(layer, **out)


_put_sequence_donated = jax.jit(_put_sequence, static_argnums=4, donate_argnums=0)
_put_sequence = jax.jit(_put_sequence, static_argnums=4)


# ------------------------------------------------------------------------------ transport

@contextlib.contextmanager
def _socket_of(conn):
    """A blocking socket.socket over `conn` (a socket, or a Connection's duplicated fd)."""
    if isinstance(conn, socket.socket):
        yield conn
        return
    fd = os.dup(conn.fileno()) if hasattr(conn, "fileno") else None
    try:
        sock = socket.socket(fileno=fd)
    except (TypeError, OSError) as e:
        if fd is not None:
            os.close(fd)
        raise TypeError(f"conn must be a socket or a socket-backed Connection, got "
                        f"{type(conn).__name__}: {e}") from None
    with sock:
        sock.settimeout(None)  # the Connection expects a blocking fd (the flag is shared with the dup)
        yield sock


def send_payload(conn, payload) -> None:
    """Sends `payload` (bytes-like) on `conn` as one message in multiprocessing.connection's framing
    (what Connection.send_bytes writes, so the other end may read it with recv_bytes), from the
    payload's own memory in one sendall."""
    view = _bytes_view(payload)
    n = view.size
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    with _socket_of(conn) as sock:
        if n <= 16384:  # small: one segment, as Connection does (Nagle)
            sock.sendall(head + view.tobytes())
        else:
            sock.sendall(head)
            sock.sendall(view)


def _recv_exact(sock, view) -> None:
    got = 0
    while got < view.nbytes:
        k = sock.recv_into(view[got:], min(view.nbytes - got, 1 << 30), socket.MSG_WAITALL)
        if k == 0:
            raise EOFError(f"connection closed after {got} of {view.nbytes} bytes of a message")
        got += k


def recv_payload(conn):
    """Receives one bytes message (send_payload's, or Connection.send_bytes') from `conn` into a
    fresh buffer (module docstring), read straight into place; EOFError if the peer closes first."""
    with _socket_of(conn) as sock:
        head = bytearray(4)
        _recv_exact(sock, memoryview(head))
        (n,) = struct.unpack("!i", head)
        if n == -1:
            head = bytearray(8)
            _recv_exact(sock, memoryview(head))
            (n,) = struct.unpack("!Q", head)
        out = _buffer(n)
        if n:
            _recv_exact(sock, memoryview(out))
    return out
