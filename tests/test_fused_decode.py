"""Tier (a) tests of the fused append + decode attention kernel (pallas_kernels.fused_decode_attention),
reached through hack_jax.attention.decode_step(impl="pallas", seal="never", fuse=True).

One non-sealing step on a poisoned cache (tests/twin.py: NaN in every stale open-block / sink row and
unused page, shuffled page table) whose slots put the new token into a sink (first token, middle
sink), the first open row (right after the sinks, at a block boundary, at a page boundary), a middle
open row, and two inactive slots (one full to its capacity). Checked against:
  - kv_cache.append(seal="never"): the written layer bit-identical (every array);
  - append then the existing Pallas kernel (decode_attention(impl="pallas")): the same output up to the
    float32 order of the split combine (TIGHT);
  - the float64 twin (twin.np_cache_attention on the K/V that were written), within the HACK kernel's
    tolerance of tests/test_decode_kernels.py (TIGHT interpret, FLIP_BOUND gpu).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import twin
from hack_jax import attention, kv_cache
from hack_jax.config import QuantConfig
from pallas_kernels import common
from pallas_kernels.decode_attention import KernelConfig

pytestmark = pytest.mark.filterwarnings(f"ignore:{common.TRITON_DEPRECATION_MESSAGE}:DeprecationWarning")

EPS32 = float(np.finfo(np.float32).eps)
TIGHT = 64 * EPS32  # as tests/test_decode_kernels.py, times max|V|
FLIP_BOUND = 2e-2
MODES = ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)]
CONFIG = QuantConfig(partition_size=32, page_size=128, num_sink_tokens=4)
# tokens held before the step (ns 4, P 32, page 128): sink 0, sink 2, open row 0 after the sinks, row 0
# after a block boundary (4 + 32), row 0 after a page boundary (4 + 128), row 24, inactive, inactive at
# the capacity of the table (4 + 2 * 128 + the extra null column: 388 - 128)
PREV = np.array([0, 2, 4, 36, 132, 60, 100, 260], np.int32)
ACTIVE = np.array([1, 1, 1, 1, 1, 1, 0, 0], bool)
H, G, D = 2, 2, 64


def step_inputs(seed=0):
    after = PREV + ACTIVE
    table, num_pages = twin.shuffled_table(CONFIG, after, seed=seed)
    k, v = twin.make_kv((len(PREV), int(after.max()), H, D), seed)
    layer = kv_cache.init_layer(CONFIG, num_kv_heads=H, head_dim=D, num_pages=num_pages, max_seqs=len(PREV))
    layer = twin.write(layer, k, v, PREV, table)
    layer = jax.tree.map(jnp.asarray, twin.poison(twin.Cache(layer, k, v, PREV, table)).layer)
    rows = np.arange(len(PREV))
    new = lambda x: jnp.asarray(x[rows, np.minimum(PREV, x.shape[1] - 1)])  # the token at position PREV
    q = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((len(PREV), H * G, D)), jnp.float32)
    return q, new(k), new(v), layer, table, (k, v)


def _comparable(x):
    """16-bit floats widened to float32 (exact), so NaN-poisoned rows compare equal when both are NaN:
    numpy's NaN-aware equality does not cover ml_dtypes' bfloat16 on every platform."""
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype in (jnp.bfloat16, np.float16) else x


def _assert_writes_what_append_writes(fused_layer, layer, k_new, v_new, table):
    """Every array of the fused step's layer equals kv_cache.append's (seal="never"); returns append's layer."""
    want = kv_cache.append(layer, k_new, v_new, kv_lens=PREV + ACTIVE, active=ACTIVE, page_indices=table,
                           seal="never")
    for f in dataclasses.fields(want):
        if f.name != "config":
            np.testing.assert_array_equal(_comparable(getattr(fused_layer, f.name)),
                                          _comparable(getattr(want, f.name)), err_msg=f.name)
    return want


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", [None, KernelConfig(num_splits=16, open_split=True)],
                         ids=["default", "splits16_open"])  # 17 programs: combine_splits' kernel
def test_fused_step_matches_append_then_attention(config, mode):
    q, k_new, v_new, layer, table, (k, v) = step_inputs()
    kw = dict(page_indices=jnp.asarray(table), kv_lens=jnp.asarray(PREV + ACTIVE), active=jnp.asarray(ACTIVE),
              impl="pallas", interpret=mode == "interpret", config=config)
    fused_layer, out = attention.decode_step(q, k_new, v_new, layer, seal="never", fuse=True, **kw)
    ref_layer, ref = attention.decode_step(q, k_new, v_new, layer, seal="always", **kw)  # append + kernel
    want = _assert_writes_what_append_writes(fused_layer, layer, k_new, v_new, table)
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.isfinite(out).all()
    scale = float(np.abs(v).max())
    assert np.abs(out - ref).max() <= TIGHT * scale, (np.abs(out - ref).max(), scale)
    after = PREV + ACTIVE
    cache = twin.Cache(want, k, v, after, table)
    oracle = twin.np_cache_attention(np.asarray(q)[:, None], cache, (after - 1)[:, None])[:, 0]
    err = np.abs(out - oracle).max()
    assert err <= (TIGHT if mode == "interpret" else FLIP_BOUND) * scale, (err, scale)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("flag", ["interleaved", "denormal"])
def test_fused_plane_variants_match_folded(flag, mode):
    """The fused kernel with KernelConfig.interleaved (folded f16 codes unpacked without byte permutes) or
    .denormal (the codes as f16 subnormals) writes what append writes and attends as the unfused
    folded_f16 kernel does, up to float32 sums (interleaved: of its smaller plane offsets)."""
    q, k_new, v_new, layer, table, (k, v) = step_inputs()
    kw = dict(page_indices=jnp.asarray(table), kv_lens=jnp.asarray(PREV + ACTIVE), active=jnp.asarray(ACTIVE),
              impl="pallas", interpret=mode == "interpret")
    inter = KernelConfig(num_splits=2, dot_dtype="folded_f16", **{flag: True})
    fused_layer, out = attention.decode_step(q, k_new, v_new, layer, seal="never", fuse=True, config=inter, **kw)
    # the reference: the unfused kernel with the 1024 + 64c planes (interleaved) / with the same planes
    # (denormal: unlike the magic planes' float32 sums of 1024-offset products, nothing cancels there)
    plain = KernelConfig(num_splits=2, dot_dtype="folded_f16", denormal=flag == "denormal")
    _, ref = attention.decode_step(q, k_new, v_new, layer, seal="always", config=plain, **kw)
    want = _assert_writes_what_append_writes(fused_layer, layer, k_new, v_new, table)
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.isfinite(out).all()
    scale = float(np.abs(v).max())
    # interleaved: measured 1.8e-5 * max|V| (the planes at bits 4-5 keep ~2 fewer bits of the float32 sums, and
    # the MMA sums run in another order); a plane, row or token order off gives errors of order max|V|
    assert np.abs(out - ref).max() <= 1e-4 * scale
    # and vs float64 attention over the dequantized cache: within 2x of the same f16 rounding done naively
    after = PREV + ACTIVE
    cache = twin.Cache(want, k, v, after, table)
    q64, q_pos = np.asarray(q)[:, None], (after - 1)[:, None]
    exact = twin.np_cache_attention(q64, cache, q_pos, transient_int8=False)[:, 0]
    naive = twin.np_cache_attention(q64, cache, q_pos, round_to=np.float16)[:, 0]
    err, naive_err = np.abs(out - exact).max(), np.abs(naive - exact).max()
    assert err <= 2 * naive_err + TIGHT * scale, (err, naive_err, np.abs(ref - exact).max())


def test_fused_step_rejects_what_append_rejects():
    """The fused path runs append's checks first: a broken seal="never" promise and a bad `active` raise
    ValueError naming the value, before any kernel runs (the layer is a value: nothing to roll back)."""
    q, k_new, v_new, layer, table, _ = step_inputs()
    kw = dict(page_indices=jnp.asarray(table), impl="pallas", seal="never", interpret=True)
    fills = PREV + ACTIVE
    fills[5] = CONFIG.num_sink_tokens + CONFIG.partition_size  # this token fills slot 5's open block
    with pytest.raises(ValueError, match="seal='never'"):
        attention.decode_step(q, k_new, v_new, layer, kv_lens=jnp.asarray(fills), active=jnp.asarray(ACTIVE),
                              fuse=True, **kw)
    with pytest.raises(ValueError, match="active.shape"):
        attention.decode_step(q, k_new, v_new, layer, kv_lens=jnp.asarray(PREV + ACTIVE), active=jnp.asarray(ACTIVE[:3]),
                              fuse=True, **kw)
    with pytest.raises(ValueError, match="fuse=True needs"):
        attention.decode_step(q, k_new, v_new, layer, kv_lens=jnp.asarray(PREV + ACTIVE), active=jnp.asarray(ACTIVE),
                              fuse=True, **dict(kw, seal="always"))
