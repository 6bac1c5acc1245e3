"""hack_jax.handoff: a sequence's cache exported from one cache and imported into another at other
page ids reads back the same bytes (so attention over it is bit-identical), and every damaged or
mismatched payload is rejected with a ValueError."""
from __future__ import annotations

import dataclasses
import hashlib
import os

import jax
import numpy as np
import pytest

from hack_jax import attention, handoff, kv_cache, paging
from hack_jax.config import QuantConfig

GEOM = dict(num_layers=2, num_kv_heads=2, head_dim=32)
PAGE = dict(page_size=64, partition_size=16)
LENGTHS = np.array([150, 37], np.int32)   # off page and block boundaries; slot 1 short


def filled(config, *, num_pages=12, max_seqs=2, pages_per_seq=4, slots=(0, 1), seed=0, shift=0):
    """A cache with LENGTHS[i + shift] prefilled tokens plus 3 appended ones in each slot i of `slots`."""
    cache = kv_cache.init_cache(config, num_pages=num_pages, max_seqs=max_seqs, pages_per_seq=pages_per_seq, **GEOM)
    alloc = paging.PageAllocator.for_cache(cache)
    lengths = np.zeros(max_seqs, np.int32)
    for slot in slots:
        lengths[slot] = LENGTHS[(slot + shift) % 2]
        alloc.admit(slot, int(lengths[slot]) + 3)
    rng = np.random.default_rng(seed)
    h, d = GEOM["num_kv_heads"], GEOM["head_dim"]
    layers = []
    for layer in cache.layers:
        k, v = rng.normal(size=(2, max_seqs, 192, h, d)).astype(np.float32)
        layer = kv_cache.write_prefill(layer, k, v, lengths=lengths, page_indices=alloc.page_indices)
        lens = lengths.copy()
        for _ in range(3):
            k1, v1 = rng.normal(size=(2, max_seqs, h, d)).astype(np.float32)
            active = lens > 0
            layer = kv_cache.append(layer, k1, v1, kv_lens=lens + active, active=active,
                                    page_indices=alloc.page_indices)
            lens = lens + active
        layers.append(layer)
    kv_lens = lengths + 3 * (lengths > 0)
    return dataclasses.replace(cache, layers=tuple(layers), kv_lens=kv_lens), alloc, kv_lens


def receiver(config, payload, slot):
    """A cache whose other slot already holds a sequence, so the imported one lands on other pages."""
    cache, alloc, _ = filled(config, num_pages=14, slots=(1 - slot,), seed=7, shift=1)
    alloc.admit(slot, handoff.read_header(payload).kv_len)
    return cache, alloc


FORMATS = [QuantConfig(kv_format="hack", **PAGE), QuantConfig(kv_format="bf16", page_size=64, partition_size=16),
           QuantConfig(kv_format="int8", page_size=64, partition_size=16),
           QuantConfig(kv_format="fp8", page_size=64, partition_size=16),
           QuantConfig(kv_format="kivi2", page_size=128, partition_size=16)]


@pytest.mark.parametrize("config", FORMATS, ids=lambda c: c.kv_format)
@pytest.mark.parametrize("slot", [0, 1])
def test_round_trip_is_bit_identical(config, slot):
    src, src_alloc, kv_lens = filled(config)
    payload = handoff.export_sequence(src, slot=slot, page_indices=src_alloc.page_indices, kv_len=int(kv_lens[slot]))
    dst, dst_alloc = receiver(config, payload, slot)
    assert not np.array_equal(dst_alloc.page_indices[slot], src_alloc.page_indices[slot])
    out = handoff.import_sequence(dst, payload, slot=slot, page_indices=dst_alloc.page_indices)
    assert int(out.kv_lens[slot]) == kv_lens[slot]
    n = paging.pages_needed(int(kv_lens[slot]), page_size=config.page_size,
                            num_sink_tokens=kv_cache.sink_tokens(config))
    src_ids, dst_ids = src_alloc.page_indices[slot, :n], dst_alloc.page_indices[slot, :n]
    for a, b in zip(src.layers, out.layers):
        for f in dataclasses.fields(a):
            if f.name == "config":
                continue
            x, y = np.asarray(getattr(a, f.name)), np.asarray(getattr(b, f.name))
            if f.name in handoff.SEQUENCE_FIELDS:
                np.testing.assert_array_equal(y[slot], x[slot])
            else:
                np.testing.assert_array_equal(y[dst_ids], x[src_ids])
    # the other slot of the receiver is untouched, and attention over the imported slot is the same
    rng = np.random.default_rng(3)
    q = rng.normal(size=(2, 4, GEOM["head_dim"])).astype(np.float32)
    for a, b in zip(src.layers, out.layers):
        want = attention.decode_attention(q, a, page_indices=src_alloc.page_indices, kv_lens=kv_lens)
        lens = np.asarray(out.kv_lens)
        got = attention.decode_attention(q, b, page_indices=dst_alloc.page_indices, kv_lens=lens)
        np.testing.assert_array_equal(np.asarray(got)[slot], np.asarray(want)[slot])


def test_payload_is_the_sequences_share():
    config = FORMATS[0]
    src, alloc, kv_lens = filled(config)
    short = handoff.export_sequence(src, slot=1, page_indices=alloc.page_indices, kv_len=int(kv_lens[1]))
    long = handoff.export_sequence(src, slot=0, page_indices=alloc.page_indices, kv_len=int(kv_lens[0]))
    assert len(short) < len(long)
    per_page = sum(np.asarray(getattr(src.layers[0], f)).nbytes // src.num_pages
                   for f in ("k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums"))
    body = lambda payload: sum(a[-1] for a in handoff.read_header(payload).arrays)
    assert body(long) - body(short) == GEOM["num_layers"] * per_page * (3 - 1)  # 3 vs 1 pages


def test_damaged_or_mismatched_payloads_are_rejected():
    config = FORMATS[0]
    src, alloc, kv_lens = filled(config)
    payload = handoff.export_sequence(src, slot=0, page_indices=alloc.page_indices, kv_len=int(kv_lens[0]))
    dst, dst_alloc = receiver(config, payload, 0)
    before = jax.tree.map(np.asarray, dst)
    flipped = bytearray(payload)
    flipped[len(payload) // 2] ^= 1
    cases = {"digest": bytes(flipped), "truncated": payload[:-100], "header": payload[:20],
             "magic": b"NOTAKV" + payload[6:], "version": payload[:7] + b"\x09" + payload[8:]}
    messages = {"digest": "digest", "truncated": "truncated", "header": "truncated", "magic": "not a hack-jax",
                "version": "version"}
    for name, bad in cases.items():
        for donate in (False, True):  # every check runs before the cache is donated
            with pytest.raises(ValueError, match=messages[name]):
                handoff.import_sequence(dst, bad, slot=0, page_indices=dst_alloc.page_indices, donate=donate)
    other = kv_cache.init_cache(QuantConfig(kv_format="hack", page_size=64, partition_size=16, num_sink_tokens=2), num_pages=14,
                                max_seqs=2, pages_per_seq=4, **GEOM)
    with pytest.raises(ValueError, match="does not match the receiving cache: config"):
        handoff.import_sequence(other, payload, slot=0, page_indices=dst_alloc.page_indices)
    with pytest.raises(ValueError, match="not assigned"):
        handoff.import_sequence(dst, payload, slot=0, page_indices=np.zeros_like(dst_alloc.page_indices))
    with pytest.raises(TypeError):
        handoff.import_sequence(dst, "text", slot=0, page_indices=dst_alloc.page_indices)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, dst))):
        np.testing.assert_array_equal(a, b)


def _expected_body(cache, table, slot, kv_len, arrays):
    """The payload body, in the header's order of (layer, field), by NumPy indexing of the cache
    (not handoff's gather and copies)."""
    n = paging.pages_needed(kv_len, page_size=cache.config.page_size, num_sink_tokens=kv_cache.sink_tokens(cache.config))
    ids = np.asarray(table)[slot, :n]
    parts = []
    for layer, name, *_ in arrays:
        a = np.asarray(getattr(cache.layers[layer], name))
        parts.append((a[slot] if name in handoff.SEQUENCE_FIELDS else a[ids]).tobytes())
    return b"".join(parts)


def test_payload_layout_and_piecewise_digest(monkeypatch):
    """Version 2: body 64-byte aligned and equal to the cache's bytes; digest = SHA-256 over the
    SHA-256 of each PIECE bytes (here 1000, so pieces straddle arrays); a flipped byte in the last
    piece is caught."""
    monkeypatch.setattr(handoff, "PIECE", 1000)
    config = FORMATS[0]
    src, alloc, kv_lens = filled(config)
    payload = handoff.export_sequence(src, slot=0, page_indices=alloc.page_indices, kv_len=int(kv_lens[0]))
    data = bytes(payload)
    header = handoff.read_header(payload)
    assert data[:8] == b"HACKKV\x00\x02" and header.version == 2 and header.body_offset % 64 == 0
    names = [f.name for f in dataclasses.fields(src.layers[0]) if f.name != "config"]
    assert sorted((a[0], a[1]) for a in header.arrays) == sorted((i, n) for i in range(2) for n in names)
    assert data[header.body_offset:-32] == _expected_body(src, alloc.page_indices, 0, int(kv_lens[0]), header.arrays)
    signed = data[:-32]
    pieces = [hashlib.sha256(signed[i:i + 1000]).digest() for i in range(0, len(signed), 1000)]
    assert len(pieces) > 10 and data[-32:] == hashlib.sha256(b"".join(pieces)).digest()
    dst, dst_alloc = receiver(config, payload, 0)
    out = handoff.import_sequence(dst, payload, slot=0, page_indices=dst_alloc.page_indices)
    assert int(out.kv_lens[0]) == kv_lens[0]
    late = bytearray(data)
    late[-40] ^= 0x80
    with pytest.raises(ValueError, match="digest"):
        handoff.import_sequence(dst, late, slot=0, page_indices=dst_alloc.page_indices)


def test_version_1_payloads_are_still_read():
    """A version-1 payload (digest: SHA-256 of everything before it) imports to the same cache (and
    into a donated cache as into a kept one); one carrying a version-2 digest is rejected."""
    config = FORMATS[2]
    src, alloc, kv_lens = filled(config)
    payload = handoff.export_sequence(src, slot=0, page_indices=alloc.page_indices, kv_len=int(kv_lens[0]))
    v1 = bytearray(payload)
    v1[7] = 1
    v1[-32:] = hashlib.sha256(bytes(v1[:-32])).digest()
    dst, dst_alloc = receiver(config, payload, 0)
    want = handoff.import_sequence(dst, payload, slot=0, page_indices=dst_alloc.page_indices)
    got = handoff.import_sequence(dst, bytes(v1), slot=0, page_indices=dst_alloc.page_indices, donate=True)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    v1[-32:] = payload[-32:]
    with pytest.raises(ValueError, match="digest"):
        handoff.read_header(v1)


def test_repeated_page_ids_are_rejected():
    config = FORMATS[0]
    src, alloc, kv_lens = filled(config)
    payload = handoff.export_sequence(src, slot=0, page_indices=alloc.page_indices, kv_len=int(kv_lens[0]))
    dst, dst_alloc = receiver(config, payload, 0)
    table = dst_alloc.page_indices.copy()
    table[0, 1] = table[0, 0]
    with pytest.raises(ValueError, match="repeat"):
        handoff.import_sequence(dst, payload, slot=0, page_indices=table)


def test_send_and_recv_payload_speak_connection_framing():
    """send_payload / recv_payload interoperate with Connection.send_bytes / recv_bytes and with
    pickled messages between them; a peer that closes mid-message is an EOFError."""
    import threading
    from multiprocessing.connection import Client, Listener
    rng = np.random.default_rng(5)
    messages = [b"", b"x" * 10, rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes(),
                rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()]
    with Listener(("127.0.0.1", 0)) as listener:
        box = []
        accepting = threading.Thread(target=lambda: box.append(listener.accept()))
        accepting.start()
        a = Client(listener.address)
        accepting.join()
        b = box[0]

        def echo():  # b: reads each message both ways, sends it back both ways
            for _ in messages:
                assert b.recv() == "next"
                one = handoff.recv_payload(b)
                two = b.recv_bytes()
                b.send_bytes(bytes(one))
                handoff.send_payload(b, two)
        peer = threading.Thread(target=echo)
        peer.start()
        for m in messages:
            a.send("next")
            handoff.send_payload(a, m)
            a.send_bytes(m)
            assert a.recv_bytes() == m
            assert bytes(handoff.recv_payload(a)) == m
        peer.join()
        a.send_bytes(b"y" * 50_000)  # whole, then cut: the header promises more than arrives
        assert bytes(handoff.recv_payload(b)) == b"y" * 50_000
        os.write(a.fileno(), np.array([50_000], ">i4").tobytes() + b"z" * 100)
        a.close()
        with pytest.raises(EOFError, match="100 of 50000"):
            handoff.recv_payload(b)
        b.close()
    r, w = os.pipe()
    try:
        with pytest.raises(TypeError, match="socket"):
            handoff.send_payload(open(w, "wb", closefd=False), b"abc")
    finally:
        os.close(r)
        os.close(w)


def test_pinned_host_staging_gives_the_same_bytes():
    """host_memory="pinned_host" (copies staged in jax's pinned host memory kind) changes the route,
    not the payload or the imported cache."""
    config = FORMATS[1]
    src, alloc, kv_lens = filled(config)
    plain = handoff.export_sequence(src, slot=0, page_indices=alloc.page_indices, kv_len=int(kv_lens[0]))
    pinned = handoff.export_sequence(src, slot=0, page_indices=alloc.page_indices, kv_len=int(kv_lens[0]),
                                     host_memory="pinned_host")
    assert bytes(pinned) == bytes(plain)
    dst, dst_alloc = receiver(config, plain, 0)
    want = handoff.import_sequence(dst, plain, slot=0, page_indices=dst_alloc.page_indices)
    got = handoff.import_sequence(dst, pinned, slot=0, page_indices=dst_alloc.page_indices, host_memory="pinned_host")
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
