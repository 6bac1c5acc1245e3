"""Hypothesis fuzz of the public boundary (issue 17): quantize, init_cache / write_prefill / append /
decode_attention / prefill_attention, PageAllocator, Generator.generate_ids on a tiny random model.

Random shapes, dtypes, lengths and page tables, valid and invalid. Each test decides validity with
its own rules (written here, not taken from the code under test), then: a valid call returns finite
results equal to a float64 NumPy reference (quantize: the input itself within the quantizer's bound;
attention: tests/twin.py's float64 twin on the cache's codes; generate_ids: tests/model_oracle.py's
float64 decoder on the model's weights); an invalid one raises ValueError or TypeError and leaves the
cache bit-identical. Bounded: few fixed cache geometries (so compiles are shared), modest
max_examples, deadline=None.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

import tiny_llama
import twin
from hack_jax import attention, kv_cache, paging
from hack_jax.config import QuantConfig
from hack_jax.quantization import dequantize, quantize
from model_oracle import _decoder
from models.generate import Generator
from tolerances import quantizer_slack

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
F16_MAX = 65504.0
FLIP = 2 / 255  # test_attention_suite.py: one INT8 tie flip of a transient, relative to max|V|
BF16_BOUND = 8 * 2.0**-8


# ----------------------------------------------------------------------------- quantize


@settings(max_examples=40, **SETTINGS)
@given(rows=st.integers(1, 3), n=st.sampled_from([16, 32, 48, 64]),
       bits=st.one_of(st.integers(1, 8), st.integers(1, 8), st.sampled_from([0, 9])),
       partition=st.sampled_from([8, 16, 16, 32, 64]), axis=st.sampled_from([-2, -1, 0, 1, 1, 2, -3]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16", "float32", "int32"]),
       magnitude=st.sampled_from([1e-3, 1.0, 1e3]), rounding=st.sampled_from(["nearest", "stochastic"]),
       with_key=st.sampled_from([True, True, False]), seed=st.integers(0, 2**16))
def test_quantize(rows, n, bits, partition, axis, dtype, magnitude, rounding, with_key, seed):
    rng = np.random.default_rng(seed)
    shape = (n, rows) if axis in (0, -2) else (rows, n)  # the partitioned axis holds n elements
    x64 = rng.standard_normal(shape) * magnitude + rng.standard_normal(shape[1]) * magnitude
    x = jnp.asarray(x64.astype(np.float32)).astype(dtype) if dtype != "int32" else jnp.asarray(x64 * 0, jnp.int32)
    key = jax.random.key(seed) if with_key else None
    size = x.shape[axis % 2] if -2 <= axis < 2 else None
    valid = (dtype != "int32" and 1 <= bits <= 8 and -2 <= axis < 2 and size % partition == 0
             and (rounding == "nearest" or with_key))
    kwargs = dict(bits=bits, axis=axis, partition_size=partition, rounding=rounding, key=key)
    event(f"valid={valid}")
    if not valid:
        with pytest.raises((ValueError, TypeError)):
            quantize(x, **kwargs)
        return
    qt = quantize(x, **kwargs)
    ref = np.asarray(x.astype(jnp.float32), np.float64)  # the input, exactly, in float64
    x_hat = np.asarray(dequantize(qt), np.float64)
    assert np.isfinite(x_hat).all()
    codes = np.asarray(qt.codes, np.int64)
    lo, hi = (-128, 127) if bits == 8 else (0, 2**bits - 1)
    assert codes.min() >= lo and codes.max() <= hi
    ax = axis % 2
    rep = lambda m: np.repeat(np.asarray(m, np.float64), partition, axis=ax)  # per element
    scale, minimum = rep(qt.scale), rep(qt.minimum)
    bound = (scale / 2 if rounding == "nearest" else scale) + quantizer_slack(ref, minimum, scale, 2**bits - 1)
    if bits == 8:  # plus half an ulp of the folded f16 minimum
        bound = bound + np.abs(minimum) * 2.0**-11
    assert (np.abs(ref - x_hat) <= bound).all()


# ----------------------------------------------------------------------------- the cache


P, PAGE, PPS, NUM_PAGES, S, T = 16, 64, 3, 8, 2, 200
NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM = 1, 2, 32
# kivi (the default 2-bit layout, 4 sinks) and bf16; seed is left to test_attention_suite.py (each
# format costs its own compiles, the file's main cost)
CONFIGS = {"kivi": QuantConfig(partition_size=P, page_size=PAGE),
           "bf16": QuantConfig(kv_format="bf16", partition_size=P, page_size=PAGE)}
FAULTS = ["none"] * 8 + ["null", "dup", "oob", "wide", "float_table", "float_len", "nan", "big", "int_dtype"]


@functools.cache
def empty(fmt):
    return kv_cache.init_cache(CONFIGS[fmt], num_layers=1, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                               num_pages=NUM_PAGES, max_seqs=S, pages_per_seq=PPS).layers[0]


def snapshot(layer):
    return [np.asarray(a).copy() for a in jax.tree.leaves(layer)]


def assert_unchanged(layer, snap):
    for a, b in zip(jax.tree.leaves(layer), snap):
        np.testing.assert_array_equal(np.asarray(a), b)


def as_input(x, dtype):
    return x.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else x.astype(dtype)


def check_attention(layer, fmt, k, v, lengths, table, rng):
    """decode_attention and prefill_attention (3 rows ending at each length) vs the float64 twin."""
    cache = twin.Cache(layer, k, v, lengths, table)
    v_max = max(float(np.abs(v).max()), 1e-6)
    tol = BF16_BOUND if fmt == "bf16" else FLIP
    q = rng.standard_normal((S, NUM_Q_HEADS, HEAD_DIM)).astype(np.float32)
    out = np.asarray(attention.decode_attention(q, layer, page_indices=table, kv_lens=lengths))
    want = twin.np_cache_attention(q[:, None], cache, (lengths - 1)[:, None])[:, 0]
    assert np.isfinite(out).all() and np.abs(out - want).max() / v_max <= tol
    q_start = np.maximum(lengths - 3, 0).astype(np.int32)
    q3 = rng.standard_normal((S, 3, NUM_Q_HEADS, HEAD_DIM)).astype(np.float32)
    out = np.asarray(attention.prefill_attention(q3, layer, page_indices=table, kv_lens=lengths,
                                                 q_start=q_start))
    want = twin.np_cache_attention(q3, cache, q_start[:, None] + np.arange(3)[None])
    assert np.isfinite(out).all() and np.abs(out - want).max() / v_max <= tol


@settings(max_examples=20, **SETTINGS)
@given(fmt=st.sampled_from(list(CONFIGS)), lengths=st.lists(st.integers(0, 200), min_size=S, max_size=S),
       fault=st.sampled_from(FAULTS), bf16_input=st.booleans(),
       active=st.lists(st.booleans(), min_size=S, max_size=S), seed=st.integers(0, 2**16))
@example(fmt="kivi", lengths=[70, 9], fault="wide", bf16_input=False, active=[True, True], seed=0)
@example(fmt="kivi", lengths=[70, 9], fault="big", bf16_input=False, active=[True, False], seed=1)
def test_write_append_attend(fmt, lengths, fault, bf16_input, active, seed):
    mutation = fault if fault in ("null", "dup", "oob", "wide", "float_table", "float_len") else "none"
    poison = fault if fault in ("nan", "big") else "none"
    dtype = "int32" if fault == "int_dtype" else ("bfloat16" if bf16_input else "float32")
    config, layer = CONFIGS[fmt], empty(fmt)
    ns = kv_cache.sink_tokens(config)
    cap = ns + PPS * PAGE
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    need = lambda n: paging.pages_needed(int(n), page_size=PAGE, num_sink_tokens=ns)
    # pages for one token more than each length (the append), from a shuffled pool
    cols = [need(min(n + 1, cap)) for n in lengths]
    pool = list(rng.permutation(np.arange(1, NUM_PAGES)))
    table = np.zeros((S, PPS), np.int32)
    valid = bool((lengths <= cap).all()) and sum(cols) <= NUM_PAGES - 1
    if sum(cols) <= NUM_PAGES - 1:
        for s, c in enumerate(cols):
            table[s, :c] = [pool.pop() for _ in range(c)]
    live = [s for s in range(S) if need(min(lengths[s], cap)) > 0]
    table_in, lengths_in = table, lengths
    if mutation != "none" and live:
        s = live[0]
        if mutation == "null":
            table_in = table.copy(); table_in[s, 0] = 0
        elif mutation == "dup" and len(live) > 1:
            table_in = table.copy(); table_in[s, 0] = table[live[1], 0]
        elif mutation == "oob":
            table_in = table.copy(); table_in[s, 0] = NUM_PAGES
        elif mutation == "wide":
            table_in = table.astype(np.int64); table_in[s, 0] += 2**32
        elif mutation == "float_table":
            table_in = table.astype(np.float32)
        elif mutation == "float_len":
            lengths_in = lengths.astype(np.float32)
        valid = valid and mutation == "dup" and len(live) < 2
    k = rng.standard_normal((S, T, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) + rng.standard_normal(HEAD_DIM).astype(np.float32)
    v = rng.standard_normal((S, T, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    if poison != "none" and live:
        s = live[-1]
        k[s, int(rng.integers(0, min(lengths[s], T)))] = np.nan if poison == "nan" else 7.0e4
        # NaN never; 70000 only where no float16 metadata holds it (bf16 pages hold it)
        valid = valid and poison == "big" and fmt == "bf16"
    valid = valid and dtype != "int32"
    kin, vin = as_input(k, dtype), as_input(v, dtype)
    snap = snapshot(layer)
    event(f"{fmt} valid={valid}")
    if not valid:
        with pytest.raises((ValueError, TypeError)):
            kv_cache.write_prefill(layer, kin, vin, lengths=lengths_in, page_indices=table_in)
        assert_unchanged(layer, snap)
        return
    layer = kv_cache.write_prefill(layer, kin, vin, lengths=lengths, page_indices=table)
    assert_unchanged(empty(fmt), snap)  # functional: the input layer is untouched
    k64, v64 = (np.asarray(jnp.asarray(x).astype(jnp.float32), np.float32) for x in (kin, vin))
    check_attention(layer, fmt, k64, v64, lengths, table, rng)

    active = np.asarray(active, bool)
    kv_lens = (lengths + active).astype(np.int32)
    k_new = rng.standard_normal((S, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    snap = snapshot(layer)
    if (kv_lens > cap).any():
        with pytest.raises(ValueError):
            kv_cache.append(layer, k_new, k_new, kv_lens=kv_lens, active=active, page_indices=table)
        assert_unchanged(layer, snap)
        return
    layer = kv_cache.append(layer, k_new, k_new, kv_lens=kv_lens, active=active, page_indices=table)
    k2, v2 = (np.concatenate([x, np.zeros_like(x[:, :1])], axis=1) for x in (k64, v64))
    for s in np.flatnonzero(active):
        k2[s, lengths[s]], v2[s, lengths[s]] = k_new[s], k_new[s]
    check_attention(layer, fmt, k2, v2, kv_lens, table, rng)


@settings(max_examples=15, **SETTINGS)
@given(num_pages=st.sampled_from([1, 2, 8, 2**40, -3, 8.0]), num_layers=st.sampled_from([0, 1, 2]),
       head_dim=st.sampled_from([24, 32]), max_seqs=st.sampled_from([0, 1, 2]))
def test_init_cache(num_pages, num_layers, head_dim, max_seqs):
    valid = (isinstance(num_pages, int) and 2 <= num_pages <= 8 and num_layers >= 1 and head_dim % 16 == 0
             and max_seqs >= 1)
    kwargs = dict(num_layers=num_layers, num_kv_heads=1, head_dim=head_dim, num_pages=num_pages,
                  max_seqs=max_seqs, pages_per_seq=2)
    if not valid:
        with pytest.raises((ValueError, TypeError)):
            kv_cache.init_cache(CONFIGS["kivi"], **kwargs)
        return
    cache = kv_cache.init_cache(CONFIGS["kivi"], **kwargs)
    assert cache.num_pages == num_pages and cache.num_layers == num_layers
    assert not any(np.asarray(a).any() for a in jax.tree.leaves(cache))


# ----------------------------------------------------------------------------- PageAllocator


OPS = st.tuples(st.sampled_from(["admit", "reserve", "release"]),
                st.sampled_from([0, 1, 2, 3, -1, True, 1.0]),
                st.sampled_from([0, 1, 4, 5, 260, 517, 518, -1, 3.5]))


@settings(max_examples=30, **SETTINGS)
@given(ops=st.lists(OPS, max_size=12))
@example(ops=[("admit", True, 10), ("admit", 1, 4)])  # issue 17.6: True ran as slot 1
def test_page_allocator(ops):
    """An independent model of the allocator: slot -> tokens reserved; every rejected op changes
    nothing, every accepted one leaves each row with exactly pages_needed distinct non-null pages."""
    alloc = paging.PageAllocator(num_pages=6, max_seqs=3, pages_per_seq=2, page_size=256, num_sink_tokens=4)
    held = {}  # slot -> pages held
    need = lambda n: max(n - 4 + 255, 0) // 256
    for op, slot, n in ops:
        before, free = alloc.page_indices, alloc.num_free_pages
        ok_slot = type(slot) is int and 0 <= slot < 3
        ok_n = type(n) is int and 0 <= n <= 4 + 512
        if op == "admit":
            valid = ok_slot and slot not in held and ok_n and need(n) <= free
        elif op == "reserve":
            valid = ok_slot and slot in held and ok_n and need(n) - held[slot] <= free
        else:
            valid = ok_slot and slot in held
        call = {"admit": lambda: alloc.admit(slot, n), "reserve": lambda: alloc.reserve(slot, n),
                "release": lambda: alloc.release(slot)}[op]
        event(f"{op} valid={valid}")
        if not valid:
            with pytest.raises((ValueError, TypeError)):
                call()
            np.testing.assert_array_equal(alloc.page_indices, before)
            assert alloc.num_free_pages == free
            continue
        call()
        if op == "release":
            del held[slot]
        else:
            held[slot] = max(held.get(slot, 0), need(n))
        table = alloc.page_indices
        for s in range(3):
            assert (table[s, :held.get(s, 0)] > 0).all() and (table[s, held.get(s, 0):] == 0).all()
        assigned = table[table > 0]
        assert len(set(assigned.tolist())) == assigned.size == 5 - alloc.num_free_pages


# ----------------------------------------------------------------------------- generate_ids


@functools.cache
def generator():
    ckpt, model = tiny_llama.checkpoint_and_model()
    return Generator(model, ckpt.tokenizer, QuantConfig(kv_format="float32"), max_seqs=2, max_len=48)


@functools.cache
def oracle_weights():
    """w(name, layer) for model_oracle._decoder: the tiny model's weights as float64 [out, in]."""
    model = generator()  # noqa: F841  (built first: the same model object)
    _, m = tiny_llama.checkpoint_and_model()
    state = nnx.state(m)
    c = m.config
    f64 = lambda a: np.asarray(a, np.float64)
    layer = lambda i, path: f64(functools.reduce(lambda x, p: x[p], path, state["layers"])[...])[i] \
        if c.scan_layers else f64(functools.reduce(lambda x, p: x[p], path, state["layers"][i])[...])
    d = c.embed_dim

    def w(name, i):
        if name == "embed":
            return f64(state["embed"][...])
        if name == "norm":
            return f64(state["final_norm"]["scale"][...])
        if name == "head" or name.endswith("_bias"):
            return None
        if name in ("attn_norm", "ffn_norm"):
            return layer(i, (name, "scale"))
        if name in "qkv":
            return layer(i, ("attn", name)).reshape(d, -1).T
        if name == "o":
            return layer(i, ("attn", "o")).reshape(-1, d).T
        return layer(i, ("mlp", name)).T
    return w


def oracle_logprobs(prompt, forced):
    c = generator().config
    ids = list(prompt) + list(forced)
    logits = _decoder(ids, oracle_weights(), n_layers=c.num_layers, n_head=c.num_q_heads, n_kv=c.num_kv_heads,
                      hd=c.head_dim, eps=c.rms_norm_eps, adjacent=False,
                      inv=c.rope_theta ** (-np.arange(0, c.head_dim, 2) / c.head_dim))
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    n = len(prompt)
    return np.array([logp[n - 1 + i, forced[i]] for i in range(len(forced))])


@settings(max_examples=10, **SETTINGS)
@given(lens=st.lists(st.integers(1, 30), min_size=1, max_size=3),
       max_new=st.sampled_from([1, 3, 1, 3, 0, 30, True]),
       bad=st.sampled_from(["none"] * 6 + ["empty", "vocab", "float_ids", "forced_shape", "forced_float"]),
       seed=st.integers(0, 2**16))
@example(lens=[3], max_new=2, bad="forced_float", seed=0)  # issue 17.6: 1.5 ran as 1
def test_generate_ids(lens, max_new, bad, seed):
    gen = generator()
    rng = np.random.default_rng(seed)
    vocab = gen.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in lens]
    n_new = max_new if type(max_new) is int else 0
    forced = rng.integers(0, vocab, (len(prompts), max(n_new, 1)))
    valid = (type(max_new) is int and max_new >= 1 and min(lens) >= 1
             and max(lens) + max_new <= gen.capacity)
    if bad == "empty":
        prompts[-1] = []
        valid = False
    elif bad == "vocab" and min(lens) >= 1:
        prompts[0][0] = vocab
        valid = False
    elif bad == "float_ids" and min(lens) >= 1:
        prompts[0] = [float(t) + 0.5 for t in prompts[0]]
        valid = False
    elif bad == "forced_shape":
        forced = forced[:, :-1] if forced.shape[1] > 1 else forced[:1, :0]
        valid = False
    elif bad == "forced_float":
        forced = forced + 0.5
        valid = False
    event(f"valid={valid}")
    if not valid:
        with pytest.raises((ValueError, TypeError)):
            gen.generate_ids(prompts, max_new, forced=forced)
        return
    out = gen.generate_ids(prompts, max_new, forced=forced)
    for p, f, got in zip(prompts, forced, out.forced_logprobs):
        got = np.asarray(got)
        assert got.shape == (max_new,) and np.isfinite(got).all()
        np.testing.assert_allclose(got, oracle_logprobs(p, f), atol=2e-3)
