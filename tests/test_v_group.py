"""QuantConfig.v_group: the kivi cache with the K token block (partition_size) set apart from the V
channel group (v_group, also the INT8 query group and the K code sums' group): K 32 / V 64.

The cache (written by prefill and appends, poisoned beyond each length) is decoded by the float64
twin's own NumPy reader (tests/twin.py, which takes its geometry from the config) and compared with
the library's dequantization, and the reference and Pallas kernels' attention with the twin's
homomorphic attention on the same codes, at the attention suite's tolerances; combined with
v_rotation as in tests/test_v_rotation.py.
"""

import numpy as np
import pytest

import twin
from hack_jax import attention, kv_cache
from hack_jax.config import QuantConfig
from test_attention_suite import (HEAD_DIM, LENGTHS, NUM_KV_HEADS, NUM_Q_HEADS, PREFILL_T, Q_START, check,
                                  make_q)
from test_v_rotation import rot, rotated_cache

K32V64 = QuantConfig(partition_size=32, page_size=128, v_group=64)
K32V64_R64 = QuantConfig(partition_size=32, page_size=128, v_group=64, v_rotation=64)
IMPLS = ["reference", "interpret", pytest.param("gpu", marks=pytest.mark.gpu)]


def _impl(impl):
    return dict(impl="reference") if impl == "reference" else dict(impl="pallas", interpret=impl == "interpret")


def _cache():
    return twin.build(K32V64, LENGTHS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, how="both", exact=True)


def test_layout_shapes_and_dequantization():
    cache = _cache()
    layer = cache.layer
    n, h = layer.num_pages, NUM_KV_HEADS
    # K metadata per 32-token block, V metadata per (token, 64-channel group): NP = 1
    assert layer.k_scale.shape == (n, h, 4, HEAD_DIM) and layer.v_scale.shape == (n, h, 128, 1)
    assert layer.k_sums.shape == (n, h, 128, 1) and layer.v_sums.shape == (n, h, 4, HEAD_DIM)
    assert layer.k_sums.dtype == np.uint8 and layer.open_v.shape == (len(LENGTHS), h, 32, HEAD_DIM)
    for s, (k_hat, v_hat) in enumerate(twin.dequantized(cache)):
        n_s = int(cache.lengths[s])
        k, v, k_step, v_step = twin.gather(layer, s, n_s, cache.table, return_step=True)
        np.testing.assert_allclose(k, k_hat, atol=1e-5)
        np.testing.assert_allclose(v, v_hat, atol=1e-5)
        # nearest rounding: within half a step of the written values (bf16-exact inputs)
        assert (np.abs(k - cache.k[s, :n_s]) <= k_step / 2 + 1e-5).all()
        assert (np.abs(v - cache.v[s, :n_s]) <= v_step / 2 + 1e-5).all()
        # one V step per (token, 64 channels): constant along the channels of a token
        assert (v_step == v_step[:, :, :1]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_decode(impl):
    cache = _cache()
    q = make_q((len(LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                **_impl(impl)))
    want = twin.np_cache_attention(q[:, None], cache, (cache.lengths - 1)[:, None])[:, 0]
    check(out, want, cache, impl, "kivi")


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_prefill(impl):
    cache = _cache()
    q = make_q((len(LENGTHS), PREFILL_T, NUM_Q_HEADS, HEAD_DIM), seed=6)
    q_start = np.asarray(Q_START, np.int32)
    out = np.asarray(attention.prefill_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                 q_start=q_start, **_impl(impl)))
    q_pos = q_start[:, None] + np.arange(PREFILL_T)[None, :]
    check(out, twin.np_cache_attention(q, cache, q_pos), cache, impl, "kivi")


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_decode_with_v_rotation(impl):
    cache, stored = rotated_cache(K32V64_R64)
    q = make_q((len(LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                **_impl(impl)))
    want = twin.np_cache_attention(q[:, None], stored, (cache.lengths - 1)[:, None])[:, 0] @ rot(64)
    check(out, want, stored, impl, "kivi")


@pytest.mark.parametrize("kwargs, match", [
    (dict(v_group=48), "v_group=48"), (dict(v_group=8), "v_group=8"), (dict(v_group=-64), "v_group=-64"),
    (dict(v_group=64, layout="seed"), "layout='seed'"), (dict(v_group=64, kv_format="int8"), "kv_format='int8'"),
    (dict(v_group=True), "True")])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_channel_group_defaults_to_partition_size_and_must_divide_head_dim():
    assert QuantConfig(partition_size=32).channel_group == 32
    assert K32V64.channel_group == 64 and QuantConfig(v_group=128).channel_group == 128
    with pytest.raises(ValueError, match="channel group"):
        kv_cache.init_layer(QuantConfig(partition_size=16, page_size=64, v_group=32), num_kv_heads=1, head_dim=48,
                            num_pages=2, max_seqs=1)
