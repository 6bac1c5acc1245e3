"""QuantConfig.window: the kivi cache with a 16-bit recent window W longer than the open block (KIVI's
residual): the newest u % W tokens after the sinks stay 16-bit, and the window's W // P blocks are
sealed together when it fills (sealed blocks = (u // W) * (W // P)).

The cache (written by prefill, appends or both, shuffled page table, poisoned beyond each length) is
decoded by the float64 twin's own NumPy reader (tests/twin.py) and compared with the library's
dequantization; the reference and the Pallas decode kernel (interpret mode) against the twin's
homomorphic attention on the same codes, at the attention suite's tolerances.
"""

import dataclasses

import numpy as np
import pytest

import twin
from hack_jax import attention, kv_cache
from hack_jax.config import QuantConfig
from test_attention_suite import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, check, make_q

P, PAGE, NS = 32, 128, 4
W64 = QuantConfig(partition_size=P, page_size=PAGE, window=64)  # 2 blocks per window
W128 = QuantConfig(partition_size=P, page_size=PAGE, window=128)  # a whole page
# u = n - 4: window boundaries at n = 4 + 64 j (68, 132, ...), off by one on both sides; 300: 4 windows + 40
LENGTHS = (0, 1, 4, 5, 67, 68, 69, 131, 132, 133, 300)
IMPLS = ["reference", "interpret", pytest.param("gpu", marks=pytest.mark.gpu)]


def _impl(impl):
    return dict(impl="reference") if impl == "reference" else dict(impl="pallas", interpret=impl == "interpret")


def _cache(config, how="both", lengths=LENGTHS, **kw):
    return twin.build(config, lengths, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, how=how, exact=True, **kw)


@pytest.mark.parametrize("config", [W64, W128], ids=["w64", "w128"])
def test_layout_and_dequantization(config):
    cache = _cache(config)
    layer = cache.layer
    assert layer.open_k.shape == layer.open_v.shape == (len(LENGTHS), NUM_KV_HEADS, config.window, HEAD_DIM)
    blocks = kv_cache.read_blocks(layer, cache.table, cache.lengths)
    u = np.maximum(cache.lengths - NS, 0)
    w = config.window
    np.testing.assert_array_equal(blocks.num_sealed, (u // w) * (w // P))
    np.testing.assert_array_equal(blocks.num_open, u % w)
    for s, (k_hat, v_hat) in enumerate(twin.dequantized(cache)):
        n = int(cache.lengths[s])
        k, v, k_step, v_step = twin.gather(layer, s, n, cache.table, return_step=True)
        np.testing.assert_allclose(k, k_hat, atol=1e-5)
        np.testing.assert_allclose(v, v_hat, atol=1e-5)
        # the newest u % W tokens (and the sinks) are held exactly: step 0, the written bf16 values
        exact = np.arange(n) >= n - u[s] % w
        exact[:NS] = True
        assert (k_step[exact] == 0).all() and (v_step[exact] == 0).all()
        np.testing.assert_array_equal(k[exact], cache.k[s, :n][exact])
        assert (k_step[~exact] > 0).any() or not (~exact).any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", [W64, W128], ids=["w64", "w128"])
def test_decode(config, impl):
    cache = _cache(config)
    q = make_q((len(LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                **_impl(impl)))
    want = twin.np_cache_attention(q[:, None], cache, (cache.lengths - 1)[:, None])[:, 0]
    check(out, want, cache, impl, "kivi")


@pytest.mark.parametrize("config", [W64, W128], ids=["w64", "w128"])
def test_prefill_equals_appends(config):
    """Prefill, appends, and half-and-half store the same bytes in every live entry (the poison
    equalizes the rest)."""
    ways = [_cache(config, how) for how in ("prefill", "append", "both")]
    for other in ways[1:]:
        for f in dataclasses.fields(other.layer):
            if f.name != "config":
                np.testing.assert_array_equal(np.asarray(getattr(ways[0].layer, f.name)),
                                              np.asarray(getattr(other.layer, f.name)), err_msg=f.name)


def test_chunked_prefill_equals_one_prefill():
    lengths = np.asarray(LENGTHS, np.int32)
    whole = _cache(W64, "prefill", poison_unused=False)
    layer = kv_cache.init_layer(W64, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, num_pages=whole.layer.num_pages,
                                max_seqs=len(lengths))
    start = np.zeros_like(lengths)
    for chunk in (37, 50, 300):  # chunk edges inside windows and blocks
        n = np.minimum(lengths - start, chunk)
        rows = np.clip(start[:, None] + np.arange(chunk)[None, :], 0, whole.k.shape[1] - 1)
        take = lambda x: np.take_along_axis(x, rows[:, :, None, None], axis=1)
        layer = kv_cache.write_prefill(layer, take(whole.k), take(whole.v), lengths=n, page_indices=whole.table,
                                       start=start)
        start = start + n
    chunked = twin.poison(dataclasses.replace(whole, layer=layer))
    for f in dataclasses.fields(layer):
        if f.name != "config":
            np.testing.assert_array_equal(np.asarray(getattr(twin.poison(whole).layer, f.name)),
                                          np.asarray(getattr(chunked.layer, f.name)), err_msg=f.name)


def test_seals_block_cadence():
    steps = np.arange(1, 400)
    sealing = [n for n in steps if kv_cache.seals_block(W64, np.asarray([n], np.int32), np.asarray([True]))]
    assert sealing == [NS + 64 * j for j in range(1, 7)]  # 68, 132, ..., 388
    assert not kv_cache.seals_block(W64, np.asarray([68], np.int32), np.asarray([False]))
    # the default (window 0) seals every P tokens
    default = QuantConfig(partition_size=P, page_size=PAGE)
    assert [n for n in steps[:100] if kv_cache.seals_block(default, np.asarray([n], np.int32),
                                                           np.asarray([True]))] == [36, 68, 100]


def test_append_never_refuses_a_window_seal():
    cache = _cache(W64, lengths=(67,), poison_unused=False)
    k = np.zeros((1, NUM_KV_HEADS, HEAD_DIM), np.float32)
    with pytest.raises(ValueError, match="seal='never'"):
        kv_cache.append(cache.layer, k, k, kv_lens=np.asarray([68], np.int32), active=np.asarray([True]),
                        page_indices=cache.table, seal="never")


def test_bytes_report_counts_the_window():
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=64, seq_len=1000)
    base = kv_cache.cache_bytes_report(QuantConfig(), **kw)
    wide = kv_cache.cache_bytes_report(QuantConfig(window=128), **kw)
    assert wide["open_blocks"] == 2 * base["open_blocks"] == 2 * 2 * 2 * 128 * 64 * 2  # layers, K+V, heads, W, D, bf16
    assert wide["page_bits_per_element"] == base["page_bits_per_element"]
    assert wide["bits_per_element"] > base["bits_per_element"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=96), "window=96"), (dict(window=512), "window=512"), (dict(window=32), "window=32"),
    (dict(window=-64), "window=-64"), (dict(window=128, layout="seed"), "layout='seed'"),
    (dict(window=128, kv_format="int8"), "kv_format='int8'"), (dict(window=True), "True")])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_open_window_default():
    assert QuantConfig().open_window == 64 and QuantConfig(window=128).open_window == 128
    assert QuantConfig(window=64).sealed_blocks(127) == 1 and QuantConfig(window=128).sealed_blocks(127) == 0
