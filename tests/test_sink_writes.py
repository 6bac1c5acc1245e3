"""Sink writes out of the decode step (Step.sinks, kv_cache.writes_sink, append(sinks=False)).

A token is a sink only at a position < num_sink_tokens, so once every active slot holds its sinks the
host knows no decode step writes one, and the step runs without the sink rows' scatters (as Step.seal
"never" runs without the seal). Checked here:
- bytes: append(sinks=False) leaves sink_k / sink_v bit-identical and writes the open-region row that a
  NumPy expectation (the bf16 bits of the new k / v at row (position - ns) % W) says, as sinks=True does
  (kivi with and without the seal path, seed; the stacked in-place append; the fused kernel);
- the flag has an effect: under jit (nothing checked) a sink token with sinks=False is not written;
- the promise is checked on concrete inputs (ValueError naming the slot, the caller's cache untouched)
  in append, decode_step (every path) and the Stepper (before the step runs);
- the host predicate, per-layer formats included, and the Generator picking sinks=True for a prompt
  shorter than the sinks (the same log-probabilities as sinks=True on every step) and no extra compile
  for prompts that hold their sinks;
- the lowered step has 2 fewer scatters per layer with sinks=False.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import twin
from hack_jax import attention, kv_cache
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import stacked
from hack_jax.layer_formats import parse_layer_formats
from hack_jax.step import Step
from pallas_kernels import common
from pallas_kernels.fused_decode_attention import hack_fused_decode_attention

pytestmark = pytest.mark.filterwarnings(f"ignore:{common.TRITON_DEPRECATION_MESSAGE}:DeprecationWarning")

KIVI = QuantConfig(partition_size=32, page_size=128, num_sink_tokens=4)
SEED = QuantConfig(layout="seed", partition_size=32, page_size=128, num_sink_tokens=4)
# tokens held before the step, all past the 4 sinks: right after them, mid-block, a block boundary, a page
# boundary, mid-block, an inactive slot; no slot fills its block (4 + 32 j) with its new token
PREV = np.array([4, 5, 36, 132, 60, 100], np.int32)
ACTIVE = np.array([1, 1, 1, 1, 1, 0], bool)
# a step with sink tokens: slot 0 writes sink 0, slot 1 sink 3, the others as above
PREV_SINK = np.array([0, 3, 36, 132, 60, 100], np.int32)
H, G, D = 2, 2, 64


def _setup(config, prev=PREV, seed=0):
    """(q, k, v of each slot's token at position prev[s], poisoned layer holding prev, table)."""
    after = prev + ACTIVE
    table, num_pages = twin.shuffled_table(config, after, seed=seed)
    k, v = twin.make_kv((len(prev), int(after.max()), H, D), seed)
    layer = kv_cache.init_layer(config, num_kv_heads=H, head_dim=D, num_pages=num_pages, max_seqs=len(prev))
    layer = twin.write(layer, k, v, prev, table)
    layer = jax.tree.map(jnp.asarray, twin.poison(twin.Cache(layer, k, v, prev, table)).layer)
    rows = np.arange(len(prev))
    q = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((len(prev), H * G, D)), jnp.float32)
    return q, k[rows, prev], v[rows, prev], layer, table


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32) if x.dtype.itemsize == 4 else x


def _same(a, b, what):
    np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=what)


def _fields(layer):
    return [f.name for f in dataclasses.fields(layer) if f.name != "config"]


def _expected_open(before, x, prev, config):
    """NumPy: open region bf16[S, H, W, D] `before` with row (prev[s] - ns) % W of each active slot set to
    x[s] rounded to bf16 (bits), nothing else changed."""
    out = _bits(before).copy()
    for s in np.nonzero(ACTIVE)[0]:
        row = (prev[s] - config.num_sink_tokens) % config.open_window
        out[s, :, row] = np.asarray(x[s], np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return out


def _append(layer, k, v, table, prev=PREV, **kw):
    return kv_cache.append(layer, k, v, kv_lens=prev + ACTIVE, active=ACTIVE, page_indices=table, **kw)


@pytest.mark.parametrize("config, seal", [(KIVI, "never"), (KIVI, "always"), (SEED, "always")],
                         ids=["kivi", "kivi_seal_path", "seed"])
def test_no_sink_append_leaves_sinks_and_writes_the_open_row(config, seal):
    _, k, v, layer, table = _setup(config)
    got = _append(layer, k, v, table, seal=seal, sinks=False)
    want = _append(layer, k, v, table, seal=seal, sinks=True)
    for name in ("sink_k", "sink_v"):
        _same(getattr(got, name), getattr(layer, name), name)
    if config.layout == "kivi":
        _same(got.open_k, _expected_open(layer.open_k, k, PREV, config), "open_k")
    _same(got.open_v, _expected_open(layer.open_v, v, PREV, config), "open_v")
    for name in _fields(layer):  # and everything else as the step with the sink writes
        _same(getattr(got, name), getattr(want, name), name)


def test_under_jit_a_sink_token_is_written_only_with_sinks():
    """The flag takes effect: with sinks=False (a broken promise, unchecked under jit) the sink rows are
    left as they were; sinks=True writes the tokens at sinks 0 and 3 of slots 0 and 1."""
    _, k, v, layer, table = _setup(KIVI, PREV_SINK)
    step = jax.jit(lambda layer, sinks: _append(layer, k, v, table, PREV_SINK, seal="never", sinks=sinks),
                   static_argnums=1)
    off, on = step(layer, False), step(layer, True)
    for name, x in (("sink_k", k), ("sink_v", v)):
        _same(getattr(off, name), getattr(layer, name), name)
        want = _bits(getattr(layer, name)).copy()
        for s in (0, 1):
            want[s, :, PREV_SINK[s]] = np.asarray(x[s]).astype(ml_dtypes.bfloat16).view(np.uint16)
        _same(getattr(on, name), want, name)


def test_stacked_in_place_append_without_sinks():
    """kv_cache.stacked.append_in_place (the unrolled model's in-place path) on layer 1 of a 3-layer stack:
    sinks=False leaves every layer's sink arrays as they were, layer 1's open rows as NumPy says."""
    _, k, v, layer, table = _setup(KIVI)
    other = _setup(KIVI, seed=5)[3]
    stack = jax.tree.map(lambda *a: jnp.stack(a), other, layer, other)
    position = jnp.asarray(PREV)
    view = stacked.append_in_place(stacked.StackedLayer(stack, 1), jnp.asarray(k), jnp.asarray(v), position,
                                   jnp.asarray(ACTIVE), jnp.asarray(table), sinks=False)
    for name in ("sink_k", "sink_v"):
        _same(getattr(view.stacked, name), getattr(stack, name), name)
    _same(view.stacked.open_k[1], _expected_open(layer.open_k, k, PREV, KIVI), "open_k")
    _same(view.stacked.open_v[1], _expected_open(layer.open_v, v, PREV, KIVI), "open_v")
    for name in ("open_k", "open_v"):
        for j in (0, 2):
            _same(getattr(view.stacked, name)[j], getattr(other, name), f"{name} layer {j}")


@pytest.mark.parametrize("fuse", [False, True], ids=["in_place", "fused"])
def test_decode_step_on_a_stacked_layer_without_sinks(fuse):
    """attention.decode_step(impl="pallas", interpret) on a StackedLayer (in place, or the fused kernel):
    sinks=False gives the bytes and output of sinks=True (no slot writes a sink), its sinks untouched."""
    q, k, v, layer, table = _setup(KIVI)
    stack = jax.tree.map(lambda *a: jnp.stack(a), layer, layer)
    kw = dict(page_indices=table, kv_lens=PREV + ACTIVE, active=ACTIVE, impl="pallas", seal="never", fuse=fuse,
              interpret=True)
    view_off, out_off = attention.decode_step(q, k, v, stacked.StackedLayer(stack, 1), sinks=False, **kw)
    view_on, out_on = attention.decode_step(q, k, v, stacked.StackedLayer(stack, 1), sinks=True, **kw)
    _same(out_off, out_on, "out")
    for name in _fields(layer):
        _same(getattr(view_off.stacked, name), getattr(view_on.stacked, name), name)
    for name in ("sink_k", "sink_v"):
        _same(getattr(view_off.stacked, name), getattr(stack, name), name)
    _same(view_off.stacked.open_k[1], _expected_open(layer.open_k, k, PREV, KIVI), "open_k")


def test_fused_kernel_without_sink_writes():
    """pallas_kernels.fused_decode_attention with write_sinks=False (interpret): sink_k / sink_v come back
    as given (even where a token would be a sink: dropped), the open rows as write_sinks=True writes them."""
    q, k, v, layer, table = _setup(KIVI, PREV_SINK)
    arrays, static = attention.kernel_args(layer)
    args = (q, jnp.asarray(k), jnp.asarray(v), *arrays, jnp.asarray(table), jnp.asarray(PREV_SINK),
            jnp.asarray(ACTIVE))
    _, *off = hack_fused_decode_attention(*args, **static, write_sinks=False, interpret=True)
    _, *on = hack_fused_decode_attention(*args, **static, write_sinks=True, interpret=True)
    _same(off[0], on[0], "open_k")
    _same(off[1], on[1], "open_v")
    _same(off[2], layer.sink_k, "sink_k")
    _same(off[3], layer.sink_v, "sink_v")
    assert not np.array_equal(_bits(on[2]), _bits(layer.sink_k))  # with the writes: slots 0 and 1 written


def test_writes_sink_on_the_host():
    on = np.ones(3, bool)
    assert kv_cache.writes_sink(KIVI, np.array([1, 9, 9]), on)  # position 0
    assert kv_cache.writes_sink(KIVI, np.array([9, 4, 9]), on)  # position 3, the last sink
    assert not kv_cache.writes_sink(KIVI, np.array([5, 9, 9]), on)  # position 4: past the sinks
    assert not kv_cache.writes_sink(KIVI, np.array([2, 9, 9]), np.array([False, True, True]))  # inactive
    assert not kv_cache.writes_sink(KIVI, np.array([0, 9, 9]), on)  # no token (kv_len 0)
    assert not kv_cache.writes_sink(QuantConfig(kv_format="bf16"), np.array([1, 2, 3]), on)  # no sinks
    assert not kv_cache.writes_sink(QuantConfig(kv_format="int8"), np.array([1, 2, 3]), on)
    assert not kv_cache.writes_sink(QuantConfig(kv_format="kivi2"), np.array([1, 2, 3]), on)
    mixed = parse_layer_formats("0:int8", KIVI)  # layer 0 int8, the others hack: some layer has sinks
    assert kv_cache.writes_sink(mixed, np.array([2, 9, 9]), on)
    assert not kv_cache.writes_sink(mixed, np.array([5, 9, 9]), on)
    with pytest.raises(TypeError, match="bool"):
        kv_cache.writes_sink(KIVI, np.array([1]), np.array([1]))
    from models.stepper import check_sinks  # the Stepper's check of a Step, per-layer formats included
    step = lambda lens, sinks: Step.decode(np.zeros((3, 1)), lens, on, jax.random.key(0), "never", sinks)
    with pytest.raises(ValueError, match=r"active slot\(s\) \[0\] write a sink"):
        check_sinks(mixed, step([2, 9, 9], False))
    check_sinks(mixed, step([2, 9, 9], True))
    check_sinks(mixed, step([5, 9, 9], False))
    check_sinks(parse_layer_formats("0:int8", QuantConfig(kv_format="bf16")), step([1, 1, 1], False))  # no sinks


def test_a_broken_promise_raises_and_leaves_the_cache():
    q, k, v, layer, table = _setup(KIVI, PREV_SINK)
    before = jax.tree.map(np.array, layer)
    with pytest.raises(ValueError, match=r"sinks=False but active slot\(s\) \[0, 1\]"):
        _append(layer, k, v, table, PREV_SINK, seal="never", sinks=False)
    kw = dict(page_indices=table, kv_lens=PREV_SINK + ACTIVE, active=ACTIVE, seal="never", sinks=False)
    for impl in (dict(impl="reference"), dict(impl="pallas", interpret=True, fuse=True)):
        with pytest.raises(ValueError, match=r"sinks=False"):
            attention.decode_step(q, k, v, layer, **kw, **impl)
        with pytest.raises(ValueError, match=r"sinks=False"):
            attention.decode_step(q, k, v, stacked.StackedLayer(jax.tree.map(lambda a: a[None], layer), 0),
                                  **kw, **impl)
    for name in _fields(layer):
        _same(getattr(layer, name), getattr(before, name), name)
    # formats without sinks: the flag is harmless (same bytes either way, nothing raised)
    bf16 = QuantConfig(kv_format="bf16", partition_size=32, page_size=128, num_sink_tokens=0)
    _, k, v, dense, table = _setup(bf16, PREV_SINK)
    off = _append(dense, k, v, table, PREV_SINK, sinks=False)
    for name in _fields(dense):
        _same(getattr(off, name), getattr(_append(dense, k, v, table, PREV_SINK, sinks=True), name), name)


def _writes(text):
    """Scatter / dynamic-update-slice ops in a lowered module (each jitted callee's body appears once)."""
    return len(re.findall(r'= "?stablehlo\.(?:scatter|dynamic_update_slice)\b', text))


def test_lowered_decode_without_sinks_has_two_fewer_scatters():
    """The launch saving, checked on the CPU: append's lowering (kivi, seal "never") has 2 scatters fewer
    with sinks=False (sink_k, sink_v), and so has the stacked in-place append."""
    _, k, v, layer, table = _setup(KIVI)
    lens, act = jnp.asarray(PREV + ACTIVE), jnp.asarray(ACTIVE)

    def lowered(sinks):
        fn = lambda layer, k, v, lens, act: kv_cache.append(layer, k, v, kv_lens=lens, active=act,
                                                            page_indices=table, seal="never", sinks=sinks)
        return _writes(jax.jit(fn).lower(layer, k, v, lens, act).as_text())

    assert lowered(False) == lowered(True) - 2 and lowered(False) == 2  # open_k, open_v only
    stack = jax.tree.map(lambda a: jnp.stack([a, a]), layer)

    def in_place(sinks):
        fn = lambda s, k, v, p, a: stacked.append_in_place(stacked.StackedLayer(s, 1), k, v, p, a, table, sinks)
        return _writes(jax.jit(fn).lower(stack, k, v, jnp.asarray(PREV), act).as_text())

    assert in_place(False) == in_place(True) - 2 == 2


# ----------------------------------------------------------------------------- the model (tiny Llama)


def _tiny_generator(**kw):
    import tiny_llama
    from models.generate import Generator
    ckpt, model = tiny_llama.checkpoint_and_model()
    return Generator(model, ckpt.tokenizer, QuantConfig(**kw), max_seqs=2, max_len=64)


def _record_decode_steps(monkeypatch):
    """The Step.sinks of every decode step the Stepper runs, in order."""
    from models.stepper import Stepper
    seen, call = [], Stepper.__call__

    def spy(self, tokens, step, *a, **kw):
        if step.mode == "decode":
            seen.append(step.sinks)
        return call(self, tokens, step, *a, **kw)

    monkeypatch.setattr(Stepper, "__call__", spy)
    return seen


PROMPTS = [[5, 6], [7, 8, 9, 10, 11, 12]]  # slot 0 shorter than the 4 sinks: its tokens 2 and 3 are sinks
FORCED = np.array([[20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35]])


def test_generator_writes_the_sinks_of_a_short_prompt(monkeypatch):
    """The Generator's decode steps pick sinks=True exactly while slot 0 writes its sinks 2 and 3, and give
    the log-probabilities of the same run with the sink writes on every step, bit for bit; with them left
    out where slot 0 needs them (a wrong promise), the Stepper refuses the step before it runs."""
    gen = _tiny_generator()
    seen = _record_decode_steps(monkeypatch)
    host = gen.generate_ids(PROMPTS, 6, forced=FORCED)
    assert seen == [True, True, False, False, False]
    monkeypatch.setattr(kv_cache, "writes_sink", lambda *a, **k: True)
    always = gen.generate_ids(PROMPTS, 6, forced=FORCED)
    np.testing.assert_array_equal(np.array(host.forced_logprobs), np.array(always.forced_logprobs))
    monkeypatch.undo()

    cache = gen.stepper.new_cache()
    table = np.zeros((2, gen.stepper.pages_per_seq), np.int32)
    table[:, 0] = [1, 2]
    step = Step.decode(table, [3, 9], [True, True], jax.random.key(0), "never", sinks=False)
    with pytest.raises(ValueError, match=r"sinks=False, but active slot\(s\) \[0\]"):
        gen.stepper(np.zeros(2, np.int32), step, cache, None)
    assert not any(a.is_deleted() for a in jax.tree.leaves(cache))  # not donated: the caller's cache stands


def test_no_extra_compile_for_prompts_that_hold_their_sinks(monkeypatch):
    """Prompts of >= 4 tokens: every decode step runs without the sink writes, and the Generator compiles as
    many executables as with the sink writes on every step (the behaviour before Step.sinks)."""
    prompts = [[5, 6, 7, 8], [7, 8, 9, 10, 11, 12]]
    seen = _record_decode_steps(monkeypatch)
    gen = _tiny_generator()
    gen.generate_ids(prompts, 6, forced=FORCED)
    assert seen and not any(seen)
    n = gen.stepper.num_executables
    monkeypatch.setattr(kv_cache, "writes_sink", lambda *a, **k: True)
    before = _tiny_generator()
    before.generate_ids(prompts, 6, forced=FORCED)
    assert before.stepper.num_executables == n


def test_lowered_model_step_without_sinks_has_fewer_writes():
    """models.stepper.forward_step of the tiny model (hack, its CPU layer form): sinks=False lowers to 2
    scatters fewer per layer body than sinks=True."""
    from models import stepper
    from models.generate import Sampling
    gen = _tiny_generator()
    st, cache = gen.stepper, gen.stepper.new_cache()
    table = np.zeros((2, st.pages_per_seq), np.int32)

    def lowered(sinks):
        step = Step.decode(table, [9, 9], [True, True], jax.random.key(0), "never", sinks=sinks)
        text = stepper.forward_step.lower(st.state, np.zeros(2, np.int32), step, cache, None, np.zeros(2, np.int32),
                                          graphdef=st.graphdef, attention=st.attention,
                                          head=stepper.SampleHead(Sampling())).as_text()
        return _writes(text)

    layer_bodies = 1 if gen.config.scan_layers else gen.config.num_layers
    assert lowered(False) == lowered(True) - 2 * layer_bodies
