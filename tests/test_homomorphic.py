"""homomorphic_matmul == dequantize(a) @ dequantize(b), the latter in float64 NumPy (HACK.md §3)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracles import np_dequantize
from tolerances import identity_tolerance

from hack_jax.homomorphic import homomorphic_matmul
from hack_jax.quantization import quantize


def f64(a):
    return np.asarray(a, np.float64)


def np_identity_magnitude(qa, qb):
    """Sum over partitions of |each of the four terms|, float64 [..., M, N]: the scale of the float32
    rounding error (see identity_tolerance). Partition-wise sums come from the codes in int64."""
    size = qa.partition_size
    a = np.asarray(qa.codes, np.int64)
    b = np.asarray(qb.codes, np.int64)
    a = a.reshape(a.shape[:-1] + (a.shape[-1] // size, size))  # [..., M, G, P]
    b = b.reshape(b.shape[:-2] + (b.shape[-2] // size, size, b.shape[-1]))  # [..., G, P, N]
    dot = np.einsum("...mgp,...gpn->...mgn", a, b)
    alpha, beta = a.sum(-1)[..., :, None], b.sum(-2)[..., None, :, :]
    sa, ma = f64(qa.scale)[..., :, None], f64(qa.minimum)[..., :, None]
    sb, mb = f64(qb.scale)[..., None, :, :], f64(qb.minimum)[..., None, :, :]
    terms = np.abs(sa * sb * dot) + np.abs(sa * mb * alpha) + np.abs(ma * sb * beta) + size * np.abs(ma * mb)
    return terms.sum(-2)


def check_identity(qa, qb, use_cached_sums=True, out=None):
    if out is None:
        out = homomorphic_matmul(qa, qb, use_cached_sums=use_cached_sums)
    expected = np.matmul(np_dequantize(qa), np_dequantize(qb))
    assert out.dtype == jnp.float32 and out.shape == expected.shape
    num_terms = 4 * (qa.shape[-1] // qa.partition_size)
    tol = identity_tolerance(num_terms, np_identity_magnitude(qa, qb))
    err = np.abs(f64(out) - expected)
    assert np.all(err <= tol), f"worst excess {np.max(err - tol)}"


# Most tests share these shapes, so compiled programs are reused across them.
M, Z, N = 5, 256, 24


def operands(rng, batch=(), m=M, offset=2.0, spread=1.5):
    """A [*batch, m, Z] and B [Z, N] with nonzero means, so all four terms of the identity matter."""
    a = rng.normal(offset, spread, batch + (m, Z)).astype(np.float32)
    b = rng.normal(-offset, 0.7, (Z, N)).astype(np.float32)
    return a, b


def quantize_pair(a, b, bits_a=8, bits_b=2, partition_size=64, **kwargs_b):
    return (quantize(a, bits=bits_a, axis=-1, partition_size=partition_size),
            quantize(b, bits=bits_b, axis=-2, partition_size=partition_size, **kwargs_b))


@pytest.mark.parametrize("bits_a,bits_b", [(8, 2), (8, 8), (2, 2)])
@pytest.mark.parametrize("partition_size", [32, 64, 128])
@pytest.mark.parametrize("m", [1, M])
@pytest.mark.parametrize("use_cached_sums", [True, False])
def test_identity_exact(bits_a, bits_b, partition_size, m, use_cached_sums, rng):
    qa, qb = quantize_pair(*operands(rng), bits_a, bits_b, partition_size)
    if m == 1:  # a row of the shared shape, sliced from its quantization (no new compile)
        qa = dataclasses.replace(qa, **{f: np.asarray(getattr(qa, f))[:1]
                                        for f in ("codes", "scale", "minimum", "code_sums")})
    check_identity(qa, qb, use_cached_sums)


def test_identity_float32_metadata_and_stochastic(rng):
    # The attention reference quantizes Q and softmax weights with float32 metadata.
    a, b = operands(rng)
    qa = quantize(a, bits=8, axis=1, partition_size=64, meta_dtype=jnp.float32)
    qb = quantize(b, bits=2, axis=0, partition_size=64, rounding="stochastic", key=jax.random.key(0))
    check_identity(qa, qb)


def test_batched_operands(rng):
    a, b_plain = operands(rng, batch=(2, 3))
    b_batched = rng.normal(size=(3, Z, N)).astype(np.float32)
    for b in (b_batched, b_plain):  # B broadcast over A's leading axes, batched or not
        qa, qb = quantize_pair(a, b)
        check_identity(qa, qb)
        assert homomorphic_matmul(qa, qb).shape == (2, 3, M, N)


def test_cached_sums_are_used_only_when_asked(rng):
    qa, qb = quantize_pair(*operands(rng))
    bad_a = dataclasses.replace(qa, code_sums=np.asarray(qa.code_sums) + 7)
    bad_b = dataclasses.replace(qb, code_sums=np.asarray(qb.code_sums) + 7)
    check_identity(bad_a, bad_b, use_cached_sums=False)
    good = f64(homomorphic_matmul(qa, qb))
    corrupted = f64(homomorphic_matmul(bad_a, bad_b, use_cached_sums=True))
    assert np.all(np.abs(corrupted - good) > 1e-3 * np.abs(good).max())


def test_inside_jit(rng):
    a, b = operands(rng)
    step = jax.jit(lambda x, y: homomorphic_matmul(*quantize_pair(x, y)))
    # Same codes as eager quantize (deterministic); the fused float32 arithmetic may round differently.
    check_identity(*quantize_pair(a, b), out=step(a, b))


def test_rejects_mismatched_operands(rng):
    qa, qb = quantize_pair(*operands(rng))
    # Validation reads only the fields, so mismatches are built by replacing them.
    with pytest.raises(ValueError, match="partition_size=32"):
        homomorphic_matmul(qa, dataclasses.replace(qb, partition_size=32))
    with pytest.raises(ValueError, match="a.axis=0"):
        homomorphic_matmul(dataclasses.replace(qa, axis=0), qb)
    with pytest.raises(ValueError, match="b.axis=1"):
        homomorphic_matmul(qa, dataclasses.replace(qb, axis=1))
    with pytest.raises(ValueError, match="inner lengths"):
        homomorphic_matmul(qa, dataclasses.replace(qb, codes=np.asarray(qb.codes)[:64]))
    with pytest.raises(ValueError, match="ndarray"):
        homomorphic_matmul(qa, np.asarray(qb.codes))
    with pytest.raises(ValueError, match="at least 2 axes"):
        homomorphic_matmul(dataclasses.replace(qa, codes=np.asarray(qa.codes)[0], axis=0), qb)


# Shapes and partition fixed (each new one costs a compile); hypothesis explores values and bits.
@given(
    bits=st.sampled_from([(8, 2), (8, 8), (2, 2)]),
    offset=st.floats(-50, 50),
    log_spread=st.floats(-4, 3),
    seed=st.integers(0, 2**16),
)
def test_identity_property(bits, offset, log_spread, seed):
    a, b = operands(np.random.default_rng(seed), offset=offset, spread=10.0**log_spread)
    check_identity(*quantize_pair(a, b, *bits, partition_size=32))


def test_batch_axes_must_broadcast():
    rng = np.random.default_rng(0)
    a = quantize(jnp.asarray(rng.normal(size=(2, 3, 64)), jnp.float32), bits=8, axis=2, partition_size=32)
    b = quantize(jnp.asarray(rng.normal(size=(3, 64, 5)), jnp.float32), bits=2, axis=1, partition_size=32)
    with pytest.raises(ValueError, match="batch axes"):
        homomorphic_matmul(a, b)
