"""Decode kernels and decode_step on layer i of a stacked cache, read and written in place.

The kernels' `layer_index` (pallas_kernels.common.stacked_view) and hack_jax.attention.decode_step on a
kv_cache.stacked.StackedLayer must read and write exactly what they read and write on layer i's own
arrays. Each test puts one poisoned twin layer (tests/twin.py: NaN / all-ones in every entry no live
token occupies, shuffled page table) at position i of a 3-layer stack whose other layers are poison
everywhere (NaN in float arrays, all-ones bytes in codes and sums, pages and per-sequence rows alike), so
a wrong page or row offset shows as NaN or a changed byte. Compared bit for bit with the same call on
the layer's own arrays (already tested against the float64 twins in test_decode_kernels.py,
test_bf16_decode_kernel.py, test_fused_decode.py), in Pallas interpret mode on the CPU and compiled
on the GPU (`gpu` marker).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twin
from hack_jax import attention, kv_cache
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import stacked
from pallas_kernels import common
from pallas_kernels.bf16_decode_attention import bf16_decode_attention
from pallas_kernels.decode_attention import KernelConfig, hack_decode_attention
from pallas_kernels.fused_decode_attention import hack_fused_decode_attention

pytestmark = pytest.mark.filterwarnings(f"ignore:{common.TRITON_DEPRECATION_MESSAGE}:DeprecationWarning")

HACK = QuantConfig(partition_size=32, page_size=128, num_sink_tokens=4)
BF16 = QuantConfig(kv_format="bf16", partition_size=16, page_size=64, num_sink_tokens=0)
# tokens held before the step: a sink, right after the sinks, a block boundary, a page boundary, mid-block,
# an inactive slot
PREV = np.array([2, 4, 36, 132, 60, 100], np.int32)
ACTIVE = np.array([1, 1, 1, 1, 1, 0], bool)
H, G, D, L = 2, 2, 64, 3
MODES = ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)]


def _layer(config, seed=0, *, junk_id=True):
    """(q, k_new, v_new, poisoned layer holding PREV tokens, table) of one layer; junk_id: a dead column
    of the table holds an out-of-range id (the kernels read the layer's null page; eager writers refuse it)."""
    table, num_pages = twin.shuffled_table(config, PREV + ACTIVE, seed=seed)
    if junk_id:
        table[0, -1] = num_pages + 3
    k, v = twin.make_kv((len(PREV), int(PREV.max()) + 1, H, D), seed)
    layer = kv_cache.init_layer(config, num_kv_heads=H, head_dim=D, num_pages=num_pages, max_seqs=len(PREV))
    layer = twin.write(layer, k, v, PREV, table)
    layer = jax.tree.map(jnp.asarray, twin.poison(twin.Cache(layer, k, v, PREV, table)).layer)
    rows = np.arange(len(PREV))
    rng = np.random.default_rng(seed + 1)
    q = jnp.asarray(rng.standard_normal((len(PREV), H * G, D)), jnp.float32)
    return q, jnp.asarray(k[rows, PREV]), jnp.asarray(v[rows, PREV]), layer, jnp.asarray(table)


def _junk(x):
    return jnp.full_like(x, jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).max)


def _stack(layer, i):
    """The layer at position i of an L-layer stacked LayerCache, every other layer poison."""
    return jax.tree.map(lambda a: jnp.stack([a if j == i else _junk(a) for j in range(L)]), layer)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32) if x.dtype.itemsize == 4 else x


def _assert_same(a, b, what):
    np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=what)


def _fields(layer):
    return [f.name for f in dataclasses.fields(layer) if f.name != "config"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dot_dtype", ["int8", "folded_f16"])
@pytest.mark.parametrize("i", [0, 2])
def test_hack_kernel_reads_layer_i_of_a_stack(dot_dtype, i, mode):
    q, _, _, layer, table = _layer(HACK)
    lens = jnp.asarray(PREV)
    arrays, static = attention.kernel_args(layer)
    stacked_arrays, _ = attention.kernel_args(_stack(layer, i))
    kw = dict(static, dot_dtype=dot_dtype, config=KernelConfig(num_splits=2, open_split=True, dot_dtype=dot_dtype),
              interpret=mode == "interpret")
    want = hack_decode_attention(q, *arrays, table, lens, **kw)
    assert np.isfinite(np.asarray(want)).all()
    _assert_same(hack_decode_attention(q, *stacked_arrays, table, lens, layer_index=i, **kw), want, "static i")
    traced = jax.jit(lambda li: hack_decode_attention(q, *stacked_arrays, table, lens, layer_index=li, **kw))
    _assert_same(traced(jnp.int32(i)), want, "traced i")


@pytest.mark.parametrize("mode", MODES)
def test_bf16_kernel_reads_layer_i_of_a_stack(mode):
    q, _, _, layer, table = _layer(BF16)
    lens = jnp.asarray(PREV)
    interp = mode == "interpret"
    want = bf16_decode_attention(q, layer.k, layer.v, table, lens, interpret=interp)
    assert np.isfinite(np.asarray(want)).all()
    for i in (0, 1, 2):
        s = _stack(layer, i)
        _assert_same(bf16_decode_attention(q, s.k, s.v, table, lens, layer_index=i, interpret=interp), want, f"{i=}")
    s = _stack(layer, 1)
    traced = jax.jit(lambda li: bf16_decode_attention(q, s.k, s.v, table, lens, layer_index=li, interpret=interp))
    _assert_same(traced(jnp.int32(1)), want, "traced")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("i", [0, 2])
def test_fused_kernel_reads_and_writes_layer_i_of_a_stack(i, mode):
    q, k_new, v_new, layer, table = _layer(HACK)
    arrays, static = attention.kernel_args(layer)
    big = _stack(layer, i)
    stacked_arrays, _ = attention.kernel_args(big)
    kw = dict(static, interpret=mode == "interpret")
    prev, active = jnp.asarray(PREV), jnp.asarray(ACTIVE)
    want = hack_fused_decode_attention(q, k_new, v_new, *arrays, table, prev, active, **kw)
    got = hack_fused_decode_attention(q, k_new, v_new, *stacked_arrays, table, prev, active, layer_index=i, **kw)
    _assert_same(got[0], want[0], "out")
    for name, w, g, before in zip(("open_k", "open_v", "sink_k", "sink_v"), want[1:], got[1:], stacked_arrays[8:]):
        assert g.shape == before.shape
        _assert_same(g[i], w, name)
        for j in set(range(L)) - {i}:  # the other layers' rows untouched
            _assert_same(g[j], before[j], f"{name} layer {j}")


def test_stacked_view_rejects_bad_layer_indices():
    _, _, _, layer, _ = _layer(BF16)
    s = _stack(layer, 0)
    with pytest.raises(ValueError, match="layer_index must be in"):
        common.stacked_view((s.k, s.v), L, batch=len(PREV))
    with pytest.raises(ValueError, match="same leading num_layers"):
        common.stacked_view((s.k, s.v[:2]), 0, batch=len(PREV))
    with pytest.raises(ValueError, match="integer scalar"):
        common.stacked_view((s.k, s.v), jnp.float32(1), batch=len(PREV))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config, fuse, seal", [
    (HACK, False, "never"), (HACK, True, "never"), (HACK, None, "always"), (BF16, None, "never"),
    (BF16, None, "always")], ids=["hack", "hack_fused", "hack_seal", "bf16", "bf16_seal"])
def test_decode_step_on_a_stacked_layer_is_the_layers_own_step(config, fuse, seal, mode):
    """decode_step(StackedLayer(stack, i)) writes layer i's bytes and returns the output of decode_step on
    the layer's own arrays (seal="never": rows written in place, the kernel reading layer i; "always": the
    layer taken out and put back); the other layers are untouched. Under jit too (static i)."""
    q, k_new, v_new, layer, table = _layer(config, junk_id=False)
    i = 1
    idx = dict(page_indices=table, kv_lens=jnp.asarray(PREV + ACTIVE), active=jnp.asarray(ACTIVE))
    kw = dict(impl="pallas", seal=seal, fuse=fuse, interpret=mode == "interpret")
    want_layer, want = attention.decode_step(q, k_new, v_new, layer, **idx, **kw)
    big = _stack(layer, i)
    step = lambda s, idx, q, k, v: attention.decode_step(q, k, v, stacked.StackedLayer(s, i), **idx, **kw)
    args = (big, idx, q, k_new, v_new)
    for how, (view, out) in (("eager", step(*args)), ("jit", jax.jit(step)(*args))):
        assert isinstance(view, stacked.StackedLayer) and view.index == i
        _assert_same(out, want, f"{how} out")
        for name in _fields(layer):
            got = getattr(view.stacked, name)
            _assert_same(got[i], getattr(want_layer, name), f"{how} {name}")
            for j in (0, 2):
                _assert_same(got[j], getattr(big, name)[j], f"{how} {name} layer {j}")


@pytest.mark.parametrize("layers,raises", [(3, True), (2, False)])
def test_kernels_refuse_byte_arrays_they_would_misaddress(layers, raises):
    """A u8 page pool of more than 2**31 and at most 2**32 bytes (a 3-layer stack of 90000 pages of one kv
    head, d 128: 2.2e9 bytes) is read past 2**31 with a sign-extended 32-bit offset by the Pallas-Triton
    lowering (measured wrong on the H200: bench/probe_offsets.py), so the HACK kernels and the fused one
    refuse it with a ValueError naming the array, before any kernel runs; 2 layers (1.5e9 bytes) trace.
    Shapes only (jax.eval_shape): nothing is allocated."""
    n, page, d, p, ns = 90000, 256, 128, 64, 4
    S = jax.ShapeDtypeStruct
    pool = lambda *shape, dt=jnp.uint8: S((layers, n, 1) + shape, dt)  # noqa: E731
    seq = lambda rows: S((layers, 1, 1, rows, d), jnp.bfloat16)  # noqa: E731
    cache = [pool(page // 4, d), pool(page // p, d, dt=jnp.float16), pool(page // p, d, dt=jnp.float16),
             pool(page, 2), pool(d, page // 4), pool(page, 2, dt=jnp.float16), pool(page, 2, dt=jnp.float16),
             pool(page // p, d), seq(p), seq(p), seq(ns), seq(ns)]
    q, table, lens = S((1, 4, d), jnp.float32), S((1, 4), jnp.int32), S((1,), jnp.int32)
    kw = dict(partition_size=p, num_sink_tokens=ns, dot_dtype="folded_f16", layer_index=layers - 1)
    tok = S((1, 1, d), jnp.float32)
    calls = [(lambda q, *c: hack_decode_attention(q, *c, **kw), (q, *cache, table, lens)),
             (lambda q, k, v, *c: hack_fused_decode_attention(q, k, v, *c, **kw),
              (q, tok, tok, *cache, table, lens, S((1,), jnp.bool_)))]
    for call, args in calls:
        if raises:
            with pytest.raises(ValueError, match=r"2\*\*31 < bytes <= 2\*\*32"):
                jax.eval_shape(call, *args)
        else:
            jax.eval_shape(call, *args)
