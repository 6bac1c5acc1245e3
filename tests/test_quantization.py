"""hack_jax.quantization: error bounds, metadata, edge cases, checked in float64 NumPy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracles import np_dequantize, np_partition_sums, per_element
from tolerances import quantizer_slack

from hack_jax.quantization import QuantizedTensor, dequantize, quantize

# It asserts the bits of the optimized CPU code: dequantize's multiply-add fused (rounded once).
pytestmark = pytest.mark.optimized_xla


def f64(a):
    return np.asarray(a, np.float64)


def error_bound(x, qt, rounding):
    """Per-element bound on |x - x_hat| from the stored metadata (module docstring of quantization).

    nearest: scale / 2; stochastic: scale (strict, the float slack aside). 8 bits: plus half an ulp
    of the stored folded minimum, in meta_dtype.
    """
    levels = 2**qt.bits - 1
    scale = per_element(qt.scale, qt.axis, qt.partition_size)
    minimum = per_element(qt.minimum, qt.axis, qt.partition_size)
    bound = scale / 2 if rounding == "nearest" else scale
    if qt.bits == 8:
        m = np.abs(np.asarray(qt.minimum))
        with np.errstate(over="ignore"):
            above = np.nextafter(m, np.array(np.inf, m.dtype)).astype(np.float64) - m
        # At finfo.max the gap above is inf; rounding there saturates, so the gap below bounds it.
        below = m - np.nextafter(m, np.zeros((), m.dtype)).astype(np.float64)
        ulp = np.where(np.isfinite(above), above, below)
        bound = bound + per_element(ulp, qt.axis, qt.partition_size) / 2
    return bound + quantizer_slack(x, minimum, scale, levels)


def check_structure(x, qt, bits, axis, partition_size, meta_dtype):
    axis %= x.ndim
    n = x.shape[axis]
    meta_shape = x.shape[:axis] + (n // partition_size,) + x.shape[axis + 1 :]
    assert (qt.bits, qt.axis, qt.partition_size) == (bits, axis, partition_size)
    assert qt.codes.shape == x.shape
    assert qt.scale.shape == qt.minimum.shape == qt.code_sums.shape == meta_shape
    assert qt.scale.dtype == qt.minimum.dtype == jnp.dtype(meta_dtype)
    assert qt.code_sums.dtype == jnp.int32
    codes = np.asarray(qt.codes)
    if bits == 8:
        assert codes.dtype == np.int8
    else:
        assert codes.dtype == np.uint8 and codes.max() <= 2**bits - 1
    np.testing.assert_array_equal(np.asarray(qt.code_sums), np_partition_sums(codes, qt.axis, partition_size))
    assert np.all(np.isfinite(f64(qt.scale))) and np.all(f64(qt.scale) >= 0)
    assert np.all(np.isfinite(f64(qt.minimum)))


CASES = [  # shape, axis, partition_size, bits, meta_dtype
    ((4, 128), -1, 64, 2, jnp.float16),
    ((4, 128), 1, 32, 8, jnp.float16),
    ((128, 6), 0, 16, 2, jnp.float16),
    ((2, 3, 64, 5), 2, 64, 8, jnp.float32),
    ((2, 256), 1, 128, 1, jnp.float16),
    ((3, 64), 1, 16, 4, jnp.float32),
    ((2, 64, 3), 1, 32, 3, jnp.bfloat16),
]


def sample(rng, shape, axis):
    """Gaussian data whose offset and spread change across the slices of `axis`, so minima and
    scales vary from partition to partition's neighbours."""
    meta_shape = list(shape)
    meta_shape[axis] = 1
    offsets, spread = rng.normal(0, 4, meta_shape), rng.uniform(0.1, 3, meta_shape)
    return (offsets + spread * rng.normal(size=shape)).astype(np.float32)


# Stochastic rounding on a subset: each new shape costs a ~1 s compile of the PRNG on CPU.
@pytest.mark.parametrize(
    "shape,axis,partition_size,bits,meta_dtype,rounding",
    [case + ("nearest",) for case in CASES] + [case + ("stochastic",) for case in CASES[:2]],
)
def test_error_bound(shape, axis, partition_size, bits, meta_dtype, rounding, rng):
    x = sample(rng, shape, axis)
    qt = quantize(x, bits=bits, axis=axis, partition_size=partition_size, rounding=rounding,
                  key=jax.random.key(1), meta_dtype=meta_dtype)
    check_structure(x, qt, bits, axis, partition_size, meta_dtype)
    x_hat = np_dequantize(qt)
    np.testing.assert_array_equal(np.asarray(dequantize(qt)), x_hat.astype(np.float32))
    err = np.abs(f64(x) - x_hat)
    bound = error_bound(f64(x), qt, rounding)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound)}"


# The edge-case tests share one shape (that of CASES[0]), so compiled programs are reused.
ROWS, COLS, SIZE = 4, 128, 64


def edge_quantize(x, bits=2, meta_dtype=jnp.float16, **kwargs):
    return quantize(x, bits=bits, axis=1, partition_size=SIZE, meta_dtype=meta_dtype, **kwargs)


@pytest.mark.parametrize("bits", [1, 2])
def test_metadata_rounded_outward(bits, rng):
    # (8 bits stores the folded minimum, rounded to nearest: covered by the error bound instead.)
    x = sample(rng, (ROWS, COLS), 1)
    qt = edge_quantize(x, bits)
    parts = f64(x).reshape(ROWS, COLS // SIZE, SIZE)
    assert np.all(f64(qt.minimum) <= parts.min(-1))
    assert np.all(f64(qt.minimum) + (2**bits - 1) * f64(qt.scale) >= parts.max(-1))


def test_int8_codes_span_signed_range(rng):
    x = sample(rng, (ROWS, COLS), 1)
    codes = np.asarray(edge_quantize(x, 8, jnp.float32).codes).reshape(ROWS, COLS // SIZE, SIZE)
    # Each partition's minimum maps to code -128 and its maximum to 127 after the +128*scale fold.
    np.testing.assert_array_equal(codes.min(-1), -128)
    np.testing.assert_array_equal(codes.max(-1), 127)


def test_stochastic_reproducible_and_key_dependent(rng):
    x = sample(rng, (ROWS, COLS), 1)
    run = lambda key: edge_quantize(x, rounding="stochastic", key=key)
    a, b, c = run(jax.random.key(3)), run(jax.random.key(3)), run(jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
    assert np.any(np.asarray(a.codes) != np.asarray(c.codes))


def test_stochastic_unbiased(rng):
    x = sample(rng, (ROWS, COLS), 1)
    num_keys = 4000
    keys = jax.random.split(jax.random.key(7), num_keys)
    draws = jax.vmap(lambda key: dequantize(edge_quantize(x, rounding="stochastic", key=key)))(keys)
    mean = f64(draws).mean(0)
    scale = per_element(edge_quantize(x).scale, 1, SIZE)
    # Each draw has error < scale, so its std is <= scale / 2; the mean of num_keys draws has std
    # <= scale / (2 sqrt(num_keys)). 6 sigma on fixed keys: no flakiness, while a biased rounding
    # fails (nearest rounding's bias reaches scale / 2, i.e. 63 sigma here).
    assert np.all(np.abs(mean - f64(x)) <= 6 * scale / (2 * np.sqrt(num_keys)))


@pytest.mark.parametrize("bits", [1, 2, 8])
@pytest.mark.parametrize("meta_dtype", [jnp.float16, jnp.float32])
def test_constant_partitions_exact(bits, meta_dtype, rng):
    constants = np.array([[3.0, 0.0], [-2.5, 0.0], [1e4, -7.0]])  # partitions of rows 0-2
    x = np.concatenate([np.repeat(constants, SIZE, axis=1), rng.normal(size=(1, COLS))]).astype(np.float32)
    qt = edge_quantize(x, bits, meta_dtype)
    np.testing.assert_array_equal(f64(qt.scale)[:3], 0.0)
    np.testing.assert_array_equal(np.asarray(qt.codes)[:3], 0)
    np.testing.assert_array_equal(np.asarray(qt.code_sums)[:3], 0)
    x_hat = np.asarray(dequantize(qt))
    np.testing.assert_array_equal(x_hat[:3], x[:3])
    assert np.all(np.isfinite(x_hat)) and np.all(f64(qt.scale)[3] > 0)


def test_unrepresentable_constant_keeps_bound():
    x = np.full((ROWS, COLS), 0.1, np.float32)  # 0.1 is not a float16 number
    qt = edge_quantize(x)
    assert np.all(np.abs(f64(x) - np_dequantize(qt)) <= error_bound(f64(x), qt, "nearest"))


@pytest.mark.parametrize("meta_dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_tiny_values_keep_nonzero_scale(meta_dtype, rng):
    x = (1e-6 * rng.normal(size=(ROWS, COLS))).astype(np.float32)
    qt = edge_quantize(x, meta_dtype=meta_dtype)
    assert np.all(f64(qt.scale) >= float(jnp.finfo(meta_dtype).tiny))
    assert np.all(np.abs(f64(x) - np_dequantize(qt)) <= error_bound(f64(x), qt, "nearest"))


@pytest.mark.parametrize("bits", [1, 2, 8])
@pytest.mark.parametrize(
    "meta_dtype,big", [(jnp.float16, 1.2e5), (jnp.bfloat16, 3.3e38), (jnp.float32, 3.3e38)]
)
def test_out_of_range_saturates(bits, meta_dtype, big, rng):
    x = rng.normal(size=(ROWS, COLS)).astype(np.float32)
    x[0, 5], x[1, 7], x[2, 0], x[2, 1], x[3, :] = big, -big, big, -big, big
    qt = edge_quantize(x, bits, meta_dtype)
    assert np.all(np.isfinite(f64(qt.scale))) and np.all(np.isfinite(f64(qt.minimum)))
    x_hat = np_dequantize(qt)
    assert np.all(np.isfinite(x_hat))
    # Documented saturation: x is clipped to +-finfo.max (max / 2 at 1 bit, at most 2**125),
    # then the usual bound holds.
    fmax = min(float(jnp.finfo(meta_dtype).max) / (2 if bits == 1 else 1), 2.0**125)
    clipped = np.clip(f64(x), -fmax, fmax)
    assert np.all(np.abs(clipped - x_hat) <= error_bound(clipped, qt, "nearest"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_input_dtypes(dtype, rng):
    x = jnp.asarray(sample(rng, (ROWS, COLS), 1), dtype)
    qt = quantize(x, bits=2, axis=-1, partition_size=SIZE)
    assert qt.axis == 1
    xf = f64(x.astype(jnp.float32))
    assert np.all(np.abs(xf - np_dequantize(qt)) <= error_bound(xf, qt, "nearest"))


def test_pytree_and_jit(rng):
    x = sample(rng, (ROWS, COLS), 1)
    qt = edge_quantize(x)
    leaves, treedef = jax.tree_util.tree_flatten(qt)
    assert len(leaves) == 4
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, QuantizedTensor)
    assert (again.bits, again.axis, again.partition_size) == (2, 1, SIZE)
    jitted = jax.jit(lambda v: dequantize(edge_quantize(v)))(x)
    np.testing.assert_array_equal(np.asarray(jitted), np_dequantize(qt).astype(np.float32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        qt.bits = 8


@pytest.mark.parametrize(
    "x,kwargs,match",
    [
        (np.zeros((4, 64), np.int32), {}, "dtype=int32"),
        (np.zeros((4, 64), np.float32), {"bits": 0}, "bits=0"),
        (np.zeros((4, 64), np.float32), {"bits": 9}, "bits=9"),
        (np.zeros((4, 64), np.float32), {"bits": 2.0}, "bits=2.0"),
        (np.zeros((4, 60), np.float32), {}, "60"),
        (np.zeros((4, 64), np.float32), {"axis": 2}, "axis=2"),
        (np.zeros((4, 64), np.float32), {"partition_size": 0}, "partition_size=0"),
        (np.zeros((4, 64), np.float32), {"rounding": "up"}, "rounding='up'"),
        (np.zeros((4, 64), np.float32), {"rounding": "stochastic"}, "key=None"),
        (np.zeros((4, 64), np.float32), {"meta_dtype": jnp.int8}, "meta_dtype"),
    ],
)
def test_rejects_bad_arguments(x, kwargs, match):
    args = {"bits": 2, "axis": 1, "partition_size": 32, **kwargs}
    with pytest.raises(ValueError, match=match):
        quantize(x, **args)


# Shape fixed (each new shape costs a compile); hypothesis explores the values.
@given(
    bits=st.sampled_from([1, 2, 8]),
    log_spread=st.floats(-8, 4),
    offset=st.floats(-100, 100),
    seed=st.integers(0, 2**16),
)
def test_error_bound_property(bits, log_spread, offset, seed):
    rng = np.random.default_rng(seed)
    x = (offset + 10.0**log_spread * rng.normal(size=(ROWS, COLS))).astype(np.float32)
    qt = edge_quantize(x, bits)
    err = np.abs(f64(x) - np_dequantize(qt))
    assert np.all(err <= error_bound(f64(x), qt, "nearest"))


def test_type_errors_name_the_value(rng):
    x = jnp.asarray(rng.normal(size=(4, 64)), jnp.float32)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        dequantize(x)
    with pytest.raises(TypeError, match="PRNG key"):
        quantize(x, bits=2, axis=1, partition_size=64, rounding="stochastic", key=3)
