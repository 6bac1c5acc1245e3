"""Deferred sealing (Step.seal "after", docs/DESIGN.md "Deferred sealing"): a decode step whose token fills
an open region writes the rows only, attends over the region's 16-bit rows, and the backend seals every
layer after the last one.

- Bytes: append(seal="after") then seal_filled == append(seal="always"), nearest and stochastic rounding,
  W = P and W = 2P, V channel groups apart from the K block; a stacked cache sealed in one call vectorized
  over its layers (Backend.finish) == each layer sealed alone; per-layer formats (LayerGroups) one seal per
  format's stack, the bytes of seal="always".
- Attention: decode_step(seal="after") (reference, Pallas in interpret mode, and on a stacked cache in
  place) against the float64 twin's homomorphic attention over the cache before the step plus the new
  token in 16 bits (appended to the sinks or the open region, where the cache keeps it).
- The model: generation with the deferred seal stores the same cache bytes as with seal="always".
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twin
from hack_jax import attention, kv_cache
from hack_jax.backend import Backend, write as backend_write
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import mixed, stacked
from hack_jax.layer_formats import LayerFormats, parse_layer_formats
from hack_jax.step import Step
from models.stepper import defers_seal
from test_attention_suite import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, check, make_q

P, PAGE = 32, 128
CONFIGS = {
    "p32": QuantConfig(partition_size=P, page_size=PAGE),  # fills at n = 4 + 32 j
    "w64": QuantConfig(partition_size=P, page_size=PAGE, window=64),  # fills at n = 4 + 64 j
    "k64v32": QuantConfig(partition_size=64, page_size=256, v_group=32),  # fills at n = 4 + 64 j
}
# lengths before the step: empty, in the sinks, a fill at every config's boundary (35 -> 36 for p32,
# 67 -> 68 for every config), off by one, past a page; the last slot sits the step out
BEFORE = np.array([0, 3, 35, 34, 63, 67, 66, 131, 127, 40], np.int32)
ACTIVE = np.array([True] * 9 + [False])


def _fields(layer):
    return [f.name for f in dataclasses.fields(layer) if f.name != "config"]


def _assert_same_bytes(a, b):
    for name in _fields(a):
        x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), name


def _setup(config, seed=3):
    """(cache holding BEFORE, k, v of each slot's next token); the cache is written with nearest rounding
    and carries `config` (the step's rounding)."""
    kv = twin.make_kv((len(BEFORE), int(BEFORE.max()) + 1, NUM_KV_HEADS, HEAD_DIM), seed)
    cache = twin.build(dataclasses.replace(config, rounding="nearest"), BEFORE, num_kv_heads=NUM_KV_HEADS,
                       head_dim=HEAD_DIM, how="both", kv=kv)
    cache = dataclasses.replace(cache, layer=dataclasses.replace(cache.layer, config=config))
    rows = np.arange(len(BEFORE))
    return cache, kv[0][rows, BEFORE], kv[1][rows, BEFORE]


def _some_slot_fills(config):
    assert kv_cache.seals_block(config, BEFORE + ACTIVE, ACTIVE)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_seal_after_stores_the_bytes_of_seal_always(name, rounding):
    config = dataclasses.replace(CONFIGS[name], rounding=rounding)
    _some_slot_fills(config)
    cache, k, v = _setup(config)
    key = jax.random.key(7)
    args = dict(kv_lens=BEFORE + ACTIVE, active=ACTIVE, page_indices=cache.table)
    inline = kv_cache.append(cache.layer, k, v, **args, key=key, seal="always")
    rows_only = kv_cache.append(cache.layer, k, v, **args, key=key, seal="after")
    deferred = kv_cache.seal_filled(rows_only, **args, key=key)
    _assert_same_bytes(deferred, inline)
    # nothing fills: seal_filled leaves the layer as it is
    quiet = np.array([False, True, False, True] + [False] * 6)
    rows_only = kv_cache.append(cache.layer, k, v, kv_lens=BEFORE + quiet, active=quiet,
                                page_indices=cache.table, key=key, seal="after")
    _assert_same_bytes(kv_cache.seal_filled(rows_only, kv_lens=BEFORE + quiet, active=quiet,
                                            page_indices=cache.table, key=key), rows_only)


def test_backend_finish_seals_a_stacked_cache_in_one_call():
    """Backend.finish on a stacked 3-layer cache (vmap over the layers) == each layer's seal_filled with
    its own key fold_in(step.key, i); the tuple form and one format in two groups of layers the same."""
    config = dataclasses.replace(CONFIGS["w64"], rounding="stochastic")
    layers = []
    for i in range(3):
        cache, k, v = _setup(config, seed=10 + i)
        layers.append(kv_cache.append(cache.layer, k, v, kv_lens=BEFORE + ACTIVE, active=ACTIVE,
                                      page_indices=cache.table, key=jax.random.key(i), seal="after"))
    step = Step.decode(cache.table, BEFORE + ACTIVE, ACTIVE, jax.random.key(5), seal="after")
    want = [kv_cache.seal_filled(layer, kv_lens=step.kv_lens, active=step.active, page_indices=step.page_indices,
                                 key=jax.random.fold_in(step.key, i)) for i, layer in enumerate(layers)]
    tables, lens = jnp.asarray(cache.table), jnp.asarray(BEFORE)
    stacked_cache = kv_cache.KVCache(jax.tree.map(lambda *a: jnp.stack(a), *layers), tables, lens, config)
    got = Backend().finish(stacked_cache, step)
    for i in range(3):
        _assert_same_bytes(jax.tree.map(lambda a: a[i], got.layers), want[i])
    tuple_cache = dataclasses.replace(stacked_cache, layers=tuple(layers))
    for got_i, want_i in zip(Backend().finish(tuple_cache, step).layers, want):
        _assert_same_bytes(got_i, want_i)
    # one format in groups of consecutive layers (init_cache(group_layers=2)): one seal per group, the
    # same keys by model layer
    stack = lambda ls: jax.tree.map(lambda *a: jnp.stack(a), *ls)
    grouped = dataclasses.replace(stacked_cache, layers=kv_cache.LayerGroups(
        groups=(stack(layers[:2]), stack(layers[2:])), layer_map=((0, 0), (0, 1), (1, 0))))
    for got_i, want_i in zip(mixed.layer_list(Backend().finish(grouped, step).layers), want):
        _assert_same_bytes(got_i, want_i)
    # any other step: the cache as it is
    never = dataclasses.replace(step, seal="never")
    assert Backend().finish(stacked_cache, never) is stacked_cache


def test_backend_finish_seals_per_layer_formats():
    """A stacked cache of per-layer formats [kivi, int8, kivi, bf16] (kv_cache.mixed.LayerGroups; kivi with
    stochastic rounding): a decode step through Backend.decode with seal="after" on every layer, then
    Backend.finish (one vmapped seal per format's stack), stores the bytes of the same step with
    seal="always"; before the finish the kivi layers differ from them (their filled regions still open).
    models.stepper.defers_seal takes such formats, not with a seed layer or with no layer that seals."""
    base = dataclasses.replace(CONFIGS["w64"], rounding="stochastic")
    lf = parse_layer_formats("1:int8;-1:bf16", base)
    formats = [c.kv_format for c in lf.configs(4)]
    assert formats == ["hack", "int8", "hack", "bf16"]
    _some_slot_fills(base)
    kv_lens = BEFORE + ACTIVE
    table, num_pages = twin.shuffled_table(lf.configs(4)[1], kv_lens)  # int8: no sinks, the most pages
    cache = kv_cache.init_cache(lf, num_layers=4, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, num_pages=num_pages,
                                max_seqs=len(BEFORE), pages_per_seq=table.shape[1], stacked=True)
    assert isinstance(cache.layers, kv_cache.LayerGroups) and len(cache.layers.groups) == 3
    kvs = [twin.make_kv((len(BEFORE), int(BEFORE.max()) + 1, NUM_KV_HEADS, HEAD_DIM), 20 + i) for i in range(4)]
    q = make_q((len(BEFORE), NUM_Q_HEADS, HEAD_DIM))
    rows = np.arange(len(BEFORE))

    def each_layer(layers, fn):  # fn(i, StackedLayer of layer i, k, v) -> StackedLayer
        groups = list(layers.groups)
        for i, (g, j) in enumerate(layers.layer_map):
            groups[g] = fn(i, stacked.StackedLayer(groups[g], j), *kvs[i]).stacked
        return dataclasses.replace(layers, groups=tuple(groups))

    backend = Backend()
    prefill = Step.prefill(table, BEFORE, jax.random.key(1))
    cache = dataclasses.replace(cache, layers=each_layer(
        cache.layers, lambda i, view, k, v: backend_write(view, k, v, prefill, layer_index=i)))

    def decode(seal):
        step = Step.decode(table, kv_lens, ACTIVE, jax.random.key(5), seal=seal)
        layers = each_layer(cache.layers, lambda i, view, k, v: backend.decode(
            q, k[rows, BEFORE], v[rows, BEFORE], view, step, layer_index=i)[0])
        return dataclasses.replace(cache, layers=layers, kv_lens=jnp.asarray(kv_lens)), step

    always, _ = decode("always")
    rows_only, step = decode("after")
    deferred = backend.finish(rows_only, step)
    for i, (got, want, before) in enumerate(zip(*(mixed.layer_list(c.layers) for c in (deferred, always, rows_only)))):
        _assert_same_bytes(got, want)
        assert (formats[i] == "hack") == any(  # the finish sealed something in the kivi layers, nothing else
            not np.array_equal(np.asarray(getattr(before, n)), np.asarray(getattr(want, n))) for n in _fields(want))
    assert defers_seal(backend, lf) and defers_seal(backend, base)
    seed = QuantConfig(layout="seed", partition_size=P, page_size=PAGE)
    assert not defers_seal(backend, LayerFormats(base, ((("1",), seed),)))
    assert not defers_seal(backend, parse_layer_formats("0:int8", QuantConfig(kv_format="bf16", partition_size=P, page_size=PAGE)))
    assert not defers_seal(Backend(impl="pallas_dequant"), lf)


def _oracle(cache, q, k, v):
    """float64 twin attention of each active slot's query at position BEFORE[s] over the cache before the
    step plus its new token, kept where the cache keeps it (a sink, else the 16-bit open region)."""
    want = np.zeros(q.shape)
    ns = cache.config.num_sink_tokens
    for s, seg in enumerate(twin.read(cache)):
        if not ACTIVE[s]:
            continue
        part = ("sink_k", "sink_v") if BEFORE[s] < ns else ("open_k", "open_v")
        for name, x in zip(part, (k, v)):
            setattr(seg, name, np.concatenate([getattr(seg, name), twin.bf16(x[s])[:, None]], axis=1))
        want[s] = twin.np_hack_attention(q[s][None], seg, cache.config, [BEFORE[s]])[0]
    return want


IMPLS = ["reference", "interpret", pytest.param("gpu", marks=pytest.mark.gpu)]


def _impl(impl):
    return dict(impl="reference") if impl == "reference" else dict(impl="pallas", interpret=impl == "interpret")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["p32", "w64", "k64v32"])
def test_decode_step_after_attends_the_filled_region_in_16_bits(name, impl):
    config = CONFIGS[name]
    cache, k, v = _setup(config)
    q = make_q((len(BEFORE), NUM_Q_HEADS, HEAD_DIM))
    layer, out = attention.decode_step(q, k, v, cache.layer, page_indices=cache.table, kv_lens=BEFORE + ACTIVE,
                                       active=ACTIVE, seal="after", **_impl(impl))
    want = _oracle(cache, q, k, v)
    check(np.asarray(out)[ACTIVE], want[ACTIVE], cache, impl, "kivi")
    rows_only = kv_cache.append(cache.layer, k, v, kv_lens=BEFORE + ACTIVE, active=ACTIVE,
                                page_indices=cache.table, seal="after")
    _assert_same_bytes(layer, rows_only)


@pytest.mark.parametrize("impl", ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_decode_step_after_in_place_on_a_stacked_cache(impl):
    """Layer 1 of a stacked 2-layer cache, read and written in place (the unrolled model's path): the
    same output and bytes as the layer on its own arrays."""
    config = CONFIGS["w64"]
    cache, k, v = _setup(config)
    other, _, _ = _setup(config, seed=4)
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), other.layer, cache.layer)
    q = make_q((len(BEFORE), NUM_Q_HEADS, HEAD_DIM))
    kw = dict(page_indices=cache.table, kv_lens=BEFORE + ACTIVE, active=ACTIVE, seal="after", **_impl(impl))
    view, out = attention.decode_step(q, k, v, stacked.StackedLayer(both, 1), **kw)
    layer, want = attention.decode_step(q, k, v, cache.layer, **kw)
    np.testing.assert_allclose(np.asarray(out)[ACTIVE], np.asarray(want)[ACTIVE], rtol=0, atol=1e-6)
    _assert_same_bytes(jax.tree.map(lambda a: a[1], view.stacked), layer)
    _assert_same_bytes(jax.tree.map(lambda a: a[0], view.stacked), other.layer)


def test_after_is_refused_where_it_cannot_apply():
    seed_cfg = QuantConfig(layout="seed", partition_size=P, page_size=PAGE)
    cache, k, v = _setup(seed_cfg)
    with pytest.raises(ValueError, match="seal='after'"):
        kv_cache.append(cache.layer, k, v, kv_lens=BEFORE + ACTIVE, active=ACTIVE, page_indices=cache.table,
                        seal="after")
    cache, k, v = _setup(CONFIGS["p32"])
    q = make_q((len(BEFORE), NUM_Q_HEADS, HEAD_DIM))
    with pytest.raises(NotImplementedError, match="seal='after'"):
        attention.decode_step(q, k, v, cache.layer, page_indices=cache.table, kv_lens=BEFORE + ACTIVE,
                              active=ACTIVE, seal="after", impl="pallas_dequant", interpret=True)
    assert not Backend(impl="pallas_dequant").defers_seal and Backend().defers_seal
