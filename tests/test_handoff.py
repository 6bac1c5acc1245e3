"""hack_jax.handoff: a sequence's cache exported from one cache and imported into another at other
page ids reads back the same bytes (so attention over it is bit-identical), and every damaged or
mismatched payload is rejected with a ValueError."""
from __future__ import annotations

import dataclasses

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
        with pytest.raises(ValueError, match=messages[name]):
            handoff.import_sequence(dst, bad, slot=0, page_indices=dst_alloc.page_indices)
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
