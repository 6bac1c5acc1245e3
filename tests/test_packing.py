"""hack_jax.packing against an independent NumPy oracle of the planar bit order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hack_jax.packing import (
    BITS_PER_CODE,
    CODE_MASK,
    CODES_PER_BYTE,
    pack_2bit,
    plane_mask,
    plane_scale,
    plane_shift,
    unpack_2bit,
    unpack_plane,
)


def oracle_pack(codes, axis):
    """byte i = sum_j code[i + j * n/4] << 2j, one element at a time."""
    c = np.moveaxis(np.asarray(codes), axis, 0)
    quarter = c.shape[0] // 4
    out = np.zeros((quarter,) + c.shape[1:], np.int64)
    for i in range(quarter):
        for j in range(4):
            out[i] += c[i + j * quarter].astype(np.int64) * 4**j
    return np.moveaxis(out.astype(np.uint8), 0, axis)


def oracle_unpack(packed, axis):
    p = np.moveaxis(np.asarray(packed), axis, 0).astype(np.int64)
    quarter = p.shape[0]
    out = np.zeros((4 * quarter,) + p.shape[1:], np.int64)
    for i in range(quarter):
        for j in range(4):
            out[i + j * quarter] = (p[i] // 4**j) % 4
    return np.moveaxis(out.astype(np.uint8), 0, axis)


SHAPES_AXES = [((4,), 0), ((8,), -1), ((3, 16), 1), ((16, 5), 0), ((2, 8, 3), 1), ((2, 3, 256), -1)]


@pytest.mark.parametrize("shape,axis", SHAPES_AXES)
def test_pack_matches_oracle(shape, axis, rng):
    codes = rng.integers(0, 4, shape, dtype=np.uint8)
    packed = pack_2bit(codes, axis)
    expected_shape = list(shape)
    expected_shape[axis] //= 4
    assert packed.dtype == jnp.uint8 and packed.shape == tuple(expected_shape)
    np.testing.assert_array_equal(np.asarray(packed), oracle_pack(codes, axis))
    np.testing.assert_array_equal(np.asarray(unpack_2bit(packed, axis)), codes)


@pytest.mark.parametrize("shape,axis", SHAPES_AXES)
def test_unpack_matches_oracle(shape, axis, rng):
    packed_shape = list(shape)
    packed_shape[axis] //= 4
    packed = rng.integers(0, 256, packed_shape, dtype=np.uint8)
    codes = unpack_2bit(packed, axis)
    np.testing.assert_array_equal(np.asarray(codes), oracle_unpack(packed, axis))
    np.testing.assert_array_equal(np.asarray(pack_2bit(codes, axis)), packed)


def test_bit_order_by_hand():
    # n = 8, quarter = 2: byte 0 holds positions 0, 2, 4, 6; byte 1 holds 1, 3, 5, 7.
    codes = np.array([1, 2, 3, 0, 2, 1, 0, 3], np.uint8)
    byte0 = 1 | (3 << 2) | (2 << 4) | (0 << 6)
    byte1 = 2 | (0 << 2) | (1 << 4) | (3 << 6)
    np.testing.assert_array_equal(np.asarray(pack_2bit(codes, 0)), [byte0, byte1])


def test_all_bytes_round_trip():
    packed = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(pack_2bit(unpack_2bit(packed, 0), 0)), packed)


def test_plane_helpers(rng):
    assert (BITS_PER_CODE, CODES_PER_BYTE, CODE_MASK) == (2, 4, 3)
    codes = rng.integers(0, 4, (3, 64), dtype=np.uint8)
    packed = pack_2bit(codes, 1)
    bytes_ = np.asarray(packed).astype(np.int64)
    for j in range(4):
        assert plane_shift(j) == 2 * j and plane_scale(j) == 4**j and plane_mask(j) == 3 * 4**j
        quarter = codes[:, 16 * j : 16 * (j + 1)]
        np.testing.assert_array_equal(np.asarray(unpack_plane(packed, j)), quarter)
        np.testing.assert_array_equal(bytes_ & plane_mask(j), quarter.astype(np.int64) * plane_scale(j))


def test_pack_under_jit(rng):
    codes = rng.integers(0, 4, (4, 32), dtype=np.uint8)
    packed = jax.jit(pack_2bit, static_argnums=1)(codes, 1)
    np.testing.assert_array_equal(np.asarray(packed), oracle_pack(codes, 1))


@pytest.mark.parametrize(
    "codes,axis,match",
    [
        (np.zeros((6,), np.uint8), 0, "multiple of 4"),
        (np.zeros((4, 6), np.uint8), 1, "n=6"),
        (np.zeros((8,), np.int8), 0, "dtype=int8"),
        (np.zeros((8,), np.int32), 0, "dtype=int32"),
        (np.array([0, 1, 2, 4], np.uint8), 0, "code of 4"),
        (np.zeros((8,), np.uint8), 1, "axis=1"),
    ],
)
def test_pack_rejects(codes, axis, match):
    with pytest.raises(ValueError, match=match):
        pack_2bit(codes, axis)


def test_unpack_rejects():
    with pytest.raises(ValueError, match="dtype=int32"):
        unpack_2bit(np.zeros((2,), np.int32), 0)
    with pytest.raises(ValueError, match="axis=-2"):
        unpack_2bit(np.zeros((2,), np.uint8), -2)


@settings(max_examples=10)  # every example is a new shape, hence a new compile
@given(
    lead=st.integers(1, 3),
    quarter=st.integers(1, 9),
    trail=st.integers(1, 3),
    axis=st.sampled_from([0, 1, 2, -1]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(lead, quarter, trail, axis, seed):
    shape = [lead, trail, trail]
    shape[axis] = 4 * quarter
    codes = np.random.default_rng(seed).integers(0, 4, shape, dtype=np.uint8)
    packed = pack_2bit(codes, axis)
    np.testing.assert_array_equal(np.asarray(packed), oracle_pack(codes, axis))
    np.testing.assert_array_equal(np.asarray(unpack_2bit(packed, axis)), codes)
