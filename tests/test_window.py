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
    twin.assert_same_layers(*(_cache(config, how).layer for how in ("prefill", "append", "both")))


def test_chunked_prefill_equals_one_prefill():
    """Chunk edges (37, 50, 300 tokens) inside windows and blocks."""
    twin.assert_chunked_prefill_matches(_cache(W64, "prefill", poison_unused=False))


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


@pytest.mark.parametrize("dot_dtype, bound", [("folded_f16", 4e-3), ("folded_bf16", 3e-2)])
def test_decode_folded_modes(dot_dtype, bound):
    """The scale-folded operand modes on a window cache vs the exact float64 homomorphic attention (no
    INT8 transients): they round Q*sigma and W*tau to 16 bits on purpose, so the bound is that
    rounding's (a wrong block count or open region would be off by O(max|V|))."""
    cache = _cache(W64)
    q = make_q((len(LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                impl="pallas", interpret=True, dot_dtype=dot_dtype))
    want = twin.np_cache_attention(q[:, None], cache, (cache.lengths - 1)[:, None], transient_int8=False)[:, 0]
    err = np.abs(out - want).max() / np.abs(cache.v).max()
    assert np.isfinite(out).all() and err <= bound, err


# tokens held before one non-sealing step (ns 4, P 32, W 64): sink 0, open row 0, row 31 (last of the
# window's first block), row 32 (its second block), row 0 after a window + page boundary (4 + 128), row 62
FUSED_PREV = np.array([0, 4, 35, 36, 132, 194], np.int32)


@pytest.mark.parametrize("fuse", [False, True], ids=["append_in_place", "fused"])
def test_stacked_and_fused_step(fuse):
    """decode_step on layer 1 of a stacked window cache (seal="never": the stacked in-place append, or
    the fused kernel) writes the bytes kv_cache.append writes and attends like the float64 twin."""
    import jax
    import jax.numpy as jnp
    from hack_jax.kv_cache import stacked

    after = FUSED_PREV + 1
    assert not kv_cache.seals_block(W64, after, np.ones_like(after, bool))
    table, num_pages = twin.shuffled_table(W64, after, seed=3)
    k, v = twin.make_kv((len(after), int(after.max()), NUM_KV_HEADS, HEAD_DIM), 3)
    layer = kv_cache.init_layer(W64, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, num_pages=num_pages,
                                max_seqs=len(after))
    layer = twin.poison(twin.Cache(twin.write(layer, k, v, FUSED_PREV, table), k, v, FUSED_PREV, table)).layer
    rows = np.arange(len(after))
    k_new, v_new = (jnp.asarray(x[rows, FUSED_PREV]) for x in (k, v))
    active = np.ones(len(after), bool)
    want = kv_cache.append(layer, k_new, v_new, kv_lens=after, active=active, page_indices=table, seal="never")
    stack = jax.tree.map(lambda a: jnp.stack([jnp.zeros_like(a), a]), layer)
    q = jnp.asarray(make_q((len(after), NUM_Q_HEADS, HEAD_DIM), seed=9))
    view, out = attention.decode_step(q, k_new, v_new, stacked.StackedLayer(stack, 1), page_indices=jnp.asarray(table),
                                      kv_lens=jnp.asarray(after), active=jnp.asarray(active), impl="pallas",
                                      interpret=True, seal="never", fuse=fuse)
    got = jax.tree.map(lambda a: a[1], view.stacked)
    f32 = lambda x: np.asarray(x).astype(np.float32) if np.asarray(x).dtype.kind == "V" or x.dtype in (
        jnp.bfloat16, jnp.float16) else np.asarray(x)
    for f in dataclasses.fields(want):
        if f.name != "config":
            np.testing.assert_array_equal(f32(getattr(got, f.name)), f32(getattr(want, f.name)), err_msg=f.name)
    oracle = twin.np_cache_attention(np.asarray(q)[:, None], twin.Cache(want, k, v, after, table),
                                     (after - 1)[:, None])[:, 0]
    check(np.asarray(out), oracle, twin.Cache(want, k, v, after, table), "interpret", "kivi")


@pytest.mark.parametrize("impl, kind", [("triton", "decode"), ("pallas_dequant", "decode"), ("pallas", "prefill")])
def test_kernels_without_window_say_so(impl, kind):
    cache = _cache(W64, "prefill", lengths=(70,))
    fn = attention.decode_attention if kind == "decode" else attention.prefill_attention
    q = make_q((1, NUM_Q_HEADS, HEAD_DIM) if kind == "decode" else (1, 4, NUM_Q_HEADS, HEAD_DIM))
    extra = {} if kind == "decode" else dict(q_start=np.asarray([66], np.int32))
    with pytest.raises(NotImplementedError, match="window=64"):
        fn(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths, impl=impl, interpret=True, **extra)


def test_kernel_rejects_a_window_off_the_arrays():
    from pallas_kernels.decode_attention import hack_decode_attention
    cache = _cache(W64, "prefill", lengths=(70,))
    arrays, static = attention.kernel_args(cache.layer)
    assert static["window"] == 64
    q = make_q((1, NUM_Q_HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match="open_k must have shape"):
        hack_decode_attention(q, *arrays, cache.table, cache.lengths, **dict(static, window=128), interpret=True)
    with pytest.raises(ValueError, match="window=96"):
        hack_decode_attention(q, *arrays, cache.table, cache.lengths, **dict(static, window=96), interpret=True)


def test_handoff_round_trip():
    from hack_jax import handoff
    lengths = np.asarray([133, 0], np.int32)
    src = _cache(W64, "both", lengths=lengths, poison_unused=False)
    cache = kv_cache.KVCache(layers=(src.layer,), page_indices=np.asarray(src.table), kv_lens=lengths, config=W64)
    payload = handoff.export_sequence(cache, slot=0, page_indices=src.table, kv_len=133)
    assert handoff.read_header(payload).config == W64
    dst = kv_cache.init_cache(W64, num_layers=1, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                              num_pages=src.layer.num_pages, max_seqs=2, pages_per_seq=src.table.shape[1])
    table = np.zeros_like(src.table)
    table[1, :2] = src.table[0, :2][::-1]  # other pages of the same pool
    got = handoff.import_sequence(dst, payload, slot=1, page_indices=table)
    a = kv_cache.dequantize_cache(src.layer, src.table[:1], lengths[:1])
    b = kv_cache.dequantize_cache(got.layers[0], table, np.asarray([0, 133], np.int32))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(y)[1])
    with pytest.raises(ValueError, match="config"):
        handoff.import_sequence(kv_cache.init_cache(QuantConfig(partition_size=P, page_size=PAGE), num_layers=1,
                                                    num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                                                    num_pages=src.layer.num_pages, max_seqs=2,
                                                    pages_per_seq=src.table.shape[1]),
                                payload, slot=1, page_indices=table)


def test_surfaces_build_the_window_config():
    """`hack-jax generate/perplexity --window`, eval specs `hack:window=128` and the named variants."""
    import argparse
    from models import eval as ev
    from models.cli_generate import quant_config

    assert ev.parse_format("hack:window=128").quant == QuantConfig(window=128)
    assert ev.parse_format("hack:window=512").quant.page_size % 512 == 0
    assert ev.FORMATS["hack-p64-w128"].quant.window == 128
    with pytest.raises(ValueError, match="window=96"):
        ev.parse_format("hack:window=96")
    args = argparse.Namespace(kv_format="hack", partition_size=64, num_sink_tokens=4, rounding="nearest",
                              layout="kivi", v_rotation=0, v_group=0, window=128)
    assert quant_config(args) == QuantConfig(window=128)
    assert quant_config(argparse.Namespace(**dict(vars(args), window=512))).page_size == 512
    # eval's bits per element count the window's 16-bit tokens: (n - ns) // W * W tokens are 2-bit
    row = dict(bf16_bytes_per_token=4096.0, bytes_per_token=700.0, context=300, tokens=0, fake=None,
               quant=dict(kv_format="hack", layout="kivi", partition_size=64, num_sink_tokens=4, window=128))
    assert ev.eff_bits(row) == pytest.approx(8 * (256 * 700 + 44 * 4096) / 300 / 2048)
    assert ev.eff_bits(dict(row, quant=dict(row["quant"], window=0))) == pytest.approx(
        8 * (256 * 700 + 44 * 4096) / 300 / 2048)  # 296 = 4 * 64 + 40 as well
    assert ev.eff_bits(dict(row, context=400)) == pytest.approx(8 * (384 * 700 + 16 * 4096) / 400 / 2048)
