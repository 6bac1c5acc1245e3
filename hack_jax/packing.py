"""2-bit codes <-> uint8 bytes: THE bit order of the project, defined here and only here.

Planar packing (docs/DESIGN.md "2-bit packing", HACK.md §5). Along the packed axis of length n
(n % 4 == 0) the packed array has n // 4 bytes, and

    byte[i] = sum_j code[i + j * (n // 4)] << (2 * j),    j = 0..3

i.e. bits [2j, 2j+1] of byte i hold position i of plane j, and plane j is the j-th contiguous
quarter of the axis. Unpacking plane j is `(byte >> plane_shift(j)) & CODE_MASK`; without the
shift, `byte & plane_mask(j)` equals `code * plane_scale(j)` (exact in bf16 and int32), so a kernel
may dot the masked bytes and divide the result by plane_scale(j).

Why planar: Pallas' Triton lowering cannot slice or interleave values inside a kernel, so each
unpacked plane must be a whole operand that produces a contiguous slice of the output.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

BITS_PER_CODE = 2
CODES_PER_BYTE = 8 // BITS_PER_CODE
CODE_MASK = (1 << BITS_PER_CODE) - 1


def plane_shift(j):
    """Bit offset of plane j (0..3; an int or an int array) inside a byte: 2 * j."""
    return BITS_PER_CODE * j


def plane_mask(j):
    """Mask selecting plane j's two bits inside a byte: 3 << 2j (int or int array, like j)."""
    return CODE_MASK << plane_shift(j)


def plane_scale(j):
    """`byte & plane_mask(j)` == code * plane_scale(j) == code * 4**j."""
    return 1 << plane_shift(j)


def unpack_plane(packed, j):
    """Codes of plane j: u8[...] -> u8[...] in [0, 3]. Works on jnp arrays and in-kernel values."""
    return (packed >> plane_shift(j)) & CODE_MASK


def _check_axis(x, axis, what):
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis out of range for {what} of shape {x.shape}: {axis=}")
    return axis % x.ndim


def pack_2bit(codes, axis):
    """Packs 2-bit codes 4 per byte, planar along `axis` (bit order: module docstring).

    Args:
      codes: u8[..., n, ...] with values in [0, 3], n = codes.shape[axis], n % 4 == 0.
      axis: the axis to pack (negative allowed).

    Returns:
      u8[..., n // 4, ...].

    Raises:
      ValueError: dtype not uint8, n % 4 != 0, bad axis, or (for concrete, non-traced inputs
        only; inside jit the check would cost a device sync) a value above 3.
    """
    codes = jnp.asarray(codes)
    if codes.dtype != jnp.uint8:
        raise ValueError(f"codes must be uint8, got dtype={codes.dtype}")
    axis = _check_axis(codes, axis, "codes")
    n = codes.shape[axis]
    if n % CODES_PER_BYTE:
        raise ValueError(f"packed axis length must be a multiple of 4, got {n=} ({axis=})")
    if not isinstance(codes, jax.core.Tracer) and codes.size:
        top = int(np.asarray(codes).max())
        if top > CODE_MASK:
            raise ValueError(f"2-bit codes must be in [0, 3], got a code of {top}")
    return _pack(codes, axis)


@functools.partial(jax.jit, static_argnums=1)
def _pack(codes, axis):
    planes = jnp.split(codes, CODES_PER_BYTE, axis=axis)
    packed = planes[0]
    for j in range(1, CODES_PER_BYTE):
        packed = packed | (planes[j] << plane_shift(j))
    return packed


def unpack_2bit(packed, axis):
    """Inverse of pack_2bit: u8[..., m, ...] -> u8[..., 4 * m, ...] codes in [0, 3].

    Raises:
      ValueError: dtype not uint8 or bad axis.
    """
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed must be uint8, got dtype={packed.dtype}")
    return _unpack(packed, _check_axis(packed, axis, "packed"))


@functools.partial(jax.jit, static_argnums=1)
def _unpack(packed, axis):
    return jnp.concatenate([unpack_plane(packed, j) for j in range(CODES_PER_BYTE)], axis=axis)
