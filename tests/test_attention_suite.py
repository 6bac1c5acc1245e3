"""One attention suite for every implementation behind hack_jax.attention (STYLE.md rule 3).

Each implementation (impl="reference"; impl="pallas" in Pallas interpret mode on the CPU; impl="pallas"
compiled, `gpu` marker, auto-skipped without a GPU) runs decode_attention and prefill_attention over
caches from tests/twin.py's builder (written through the public kv_cache API: shuffled page tables,
NaN / all-ones poison in everything no live token occupies, lengths on and off block and page
boundaries: P = 32, pages of 4P, 4 sinks for kivi, none for seed) and is compared with the float64
twin (twin.np_cache_attention): on the 2-bit formats the homomorphic semantics on the pages' codes,
on the others float attention over the dequantized pages. Pallas runs the formats it has kernels for.

Tolerances, relative to max|V| (outputs are convex combinations of V rows):
  TIGHT (64 eps32): float32 / int8 everywhere, and the 2-bit formats' query rows in reference and
    interpret mode. The twin repeats the float32 INT8 quantizer of the transient operands and is
    float64 elsewhere, so only float32 rounding and summation order differ (measured <= 7e-7).
  A transient INT8 code sitting at a rounding tie can still round the other way in the twin (its
    operand is computed in a different float order). One flip moves one query row by at most one
    code step of W tau, <= 3 * max tau / 255 <= 2 / 255 of max|V| (FLIP); measured 5e-4, in 2 of the
    440 prefill rows. So at most FLIP_ROWS of the 2-bit rows may exceed TIGHT, none by more than
    FLIP; on the GPU (float32 division and exp not correctly rounded, as tests/test_decode_kernels.py
    argues) FLIP_GPU and FLIP_ROWS_GPU. A masking or indexing bug moves many rows by O(max|V|).
  BF16_BOUND: bf16 pages and bf16 kernels, whose dots take bf16 operands (q and the softmax
    weights rounded, relative 2**-9 each): 8 * 2**-8 of max|V| is far above the ~2**-8 they cost and
    far below a masking or indexing bug.
"""

import functools

import numpy as np
import pytest

import twin
from hack_jax import attention
from hack_jax.config import QuantConfig

EPS32 = float(np.finfo(np.float32).eps)
TIGHT = 64 * EPS32
FLIP, FLIP_ROWS = 2 / 255, 0.01
FLIP_GPU, FLIP_ROWS_GPU = 2e-2, 0.05
BF16_BOUND = 8 * 2.0**-8

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64  # GQA group of 2
P, PAGE = 32, 128
# With 4 sinks a block ends at 36, 68, ..., a page at 132, 260; seed (no sinks) at 32 / 128.
LENGTHS = (0, 1, 4, 5, 35, 36, 37, 131, 132, 133, 300)
FORMATS = {
    "kivi": QuantConfig(partition_size=P, page_size=PAGE),
    "seed": QuantConfig(layout="seed", partition_size=P, page_size=PAGE, num_sink_tokens=0),
    "bf16": QuantConfig(kv_format="bf16", partition_size=P, page_size=PAGE),
    "float32": QuantConfig(kv_format="float32", partition_size=P, page_size=PAGE),
    "int8": QuantConfig(kv_format="int8", partition_size=P, page_size=PAGE),
}
# How each format's cache is written: prefill with bf16-exact K/V, or half prefill then appends of
# unrounded K/V (blocks sealed by append from the bf16 open block).
WRITES = {"kivi": "both", "seed": "both", "bf16": "prefill", "float32": "both", "int8": "both"}
PALLAS = {"decode": ("kivi", "bf16"), "prefill": ("kivi", "bf16")}
IMPLS = ("reference", "interpret", "gpu")


def cases(kind):
    """(fmt, impl) pairs: the reference on every format, Pallas on those it has kernels for."""
    return [pytest.param(fmt, impl, id=f"{fmt}-{impl}", marks=[pytest.mark.gpu] if impl == "gpu" else [])
            for fmt in FORMATS for impl in IMPLS if impl == "reference" or fmt in PALLAS[kind]]


# Prefill chunks: T = 40 query rows at positions q_start + t: whole short prompts (rows past the
# length return 0), chunks ending inside, at and past block and page boundaries.
PREFILL_T = 40
Q_START = (0, 0, 0, 0, 0, 10, 0, 100, 92, 93, 270)


@functools.lru_cache(maxsize=None)
def cache_of(fmt):
    how = WRITES[fmt]
    return twin.build(FORMATS[fmt], LENGTHS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, how=how,
                      exact=how == "prefill")


def make_q(shape, seed=5):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run(kind, impl, fmt, q, cache, **kw):
    options = dict(impl="reference") if impl == "reference" else dict(impl="pallas", interpret=impl == "interpret")
    fn = attention.decode_attention if kind == "decode" else attention.prefill_attention
    return np.asarray(fn(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths, **kw, **options))


def check(out, want, cache, impl, fmt):
    err = np.abs(out - want) / np.abs(cache.v).max()
    assert np.isfinite(out).all()
    if fmt == "bf16":
        assert err.max() <= BF16_BOUND, err.max()
    elif fmt in ("kivi", "seed"):
        flip, rows = (FLIP_GPU, FLIP_ROWS_GPU) if impl == "gpu" else (FLIP, FLIP_ROWS)
        row_err = err.reshape(-1, err.shape[-1]).max(-1)
        assert err.max() <= flip and np.mean(row_err > TIGHT) <= rows, (err.max(), np.mean(row_err > TIGHT))
    else:
        assert err.max() <= TIGHT, err.max()


@pytest.mark.parametrize("fmt, impl", cases("decode"))
def test_decode(fmt, impl):
    """One query per sequence at position kv_lens - 1; a sequence of length 0 returns 0."""
    cache = cache_of(fmt)
    q = make_q((len(LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    out = run("decode", impl, fmt, q, cache)
    want = twin.np_cache_attention(q[:, None], cache, (cache.lengths - 1)[:, None])[:, 0]
    check(out, want, cache, impl, fmt)
    assert (out[cache.lengths == 0] == 0).all()


@pytest.mark.parametrize("fmt, impl", cases("prefill"))
def test_prefill(fmt, impl):
    """Causal prefill chunks (q_start): row t sees positions <= q_start + t; rows at or past the
    sequence's length return exactly 0."""
    cache = cache_of(fmt)
    q = make_q((len(LENGTHS), PREFILL_T, NUM_Q_HEADS, HEAD_DIM), seed=6)
    q_start = np.asarray(Q_START, np.int32)
    out = run("prefill", impl, fmt, q, cache, q_start=q_start)
    q_pos = q_start[:, None] + np.arange(PREFILL_T)[None, :]
    check(out, twin.np_cache_attention(q, cache, q_pos), cache, impl, fmt)
    assert (out[q_pos >= cache.lengths[:, None]] == 0).all()


@pytest.mark.parametrize("fmt", ["kivi", "seed"])
def test_quantization_error_tiers(fmt):
    """Not a correctness bound but the quantization error, printed (pytest -s) and bounded loosely:
    tier (b) the codes vs float64 attention over the same dequantized cache (only the INT8
    transients differ), tier (c) vs float attention on the unquantized K/V (HACK.md §4: seed is
    the inaccurate layout)."""
    cache = cache_of(fmt)
    q = make_q((len(LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    out = run("decode", "reference", fmt, q, cache)
    live = cache.lengths > 0
    q_pos = (cache.lengths - 1)[:, None]
    plain = twin.np_cache_attention(q[:, None], cache, q_pos, transient_int8=False)[:, 0]
    exact = np.stack([twin.np_attention(q[s][None], cache.k[s, :n], cache.v[s, :n])[0]
                      for s, n in enumerate(cache.lengths)])
    rel = lambda a, b: float(np.linalg.norm(a[live] - b[live]) / np.linalg.norm(b[live]))
    tier_b, tier_c = rel(out, plain), rel(out, exact)
    print(f"\n{fmt}: relative Frobenius error, tier (b) vs dequantized {tier_b:.2e}, "
          f"tier (c) vs float K/V {tier_c:.2e}")
    assert tier_b < 2e-2
    assert tier_c < (0.5 if fmt == "kivi" else 1.0)
