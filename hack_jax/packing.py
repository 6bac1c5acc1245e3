"""b-bit codes <-> uint8 bytes: THE bit order of the project, defined here and only here.

Planar packing (docs/DESIGN.md "2-bit packing", HACK.md §5), for code widths b in {2, 4}
(QuantConfig.bits; c = 8 // b codes per byte). Along the packed axis of length n (n % c == 0) the
packed array has n // c bytes, and

    byte[i] = sum_j code[i + j * (n // c)] << (b * j),    j = 0..c-1

i.e. bits [b j, b j + b - 1] of byte i hold position i of plane j, and plane j is the j-th
contiguous c-th of the axis (2 bits: 4 planes, quarters; 4 bits: 2 planes, the low and high
nibble). Unpacking plane j is `(byte >> plane_shift(j, b)) & code_mask(b)`; without the shift,
`byte & plane_mask(j, b)` equals `code * plane_scale(j, b)` (exact in bf16 and int32), so a kernel
may dot the masked bytes and divide the result by plane_scale(j, b).

Why planar: Pallas' Triton lowering cannot slice or interleave values inside a kernel, so each
unpacked plane must be a whole operand that produces a contiguous slice of the output.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

CODE_BITS = (2, 4)  # widths whose codes fill a byte exactly (QuantConfig.bits)
BITS_PER_CODE = 2  # the default width (the 2-bit names below)
CODES_PER_BYTE = 8 // BITS_PER_CODE
CODE_MASK = (1 << BITS_PER_CODE) - 1


def codes_per_byte(bits=BITS_PER_CODE) -> int:
    """Codes (planes) per byte: 8 // bits."""
    return 8 // bits


def code_mask(bits=BITS_PER_CODE) -> int:
    """The largest code, 2**bits - 1 (also the mask of plane 0)."""
    return (1 << bits) - 1


def plane_shift(j, bits=BITS_PER_CODE):
    """Bit offset of plane j (an int or an int array) inside a byte: bits * j."""
    return bits * j


def plane_mask(j, bits=BITS_PER_CODE):
    """Mask selecting plane j's bits inside a byte: code_mask << bits j (int or int array, like j)."""
    return code_mask(bits) << plane_shift(j, bits)


def plane_scale(j, bits=BITS_PER_CODE):
    """`byte & plane_mask(j, bits)` == code * plane_scale(j, bits) == code * 2**(bits j)."""
    return 1 << plane_shift(j, bits)


def unpack_plane(packed, j, bits=BITS_PER_CODE):
    """Codes of plane j: u8[...] -> u8[...] in [0, 2**bits - 1]. Works on jnp arrays and in-kernel values."""
    return (packed >> plane_shift(j, bits)) & code_mask(bits)


def _check_axis(x, axis, what):
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis out of range for {what} of shape {x.shape}: {axis=}")
    return axis % x.ndim


def _check_bits(bits):
    if bits not in CODE_BITS:
        raise ValueError(f"bits must be one of {CODE_BITS}, got {bits=}")


def pack_codes(codes, axis, bits=BITS_PER_CODE):
    """Packs b-bit codes 8 // b per byte, planar along `axis` (bit order: module docstring).

    Args:
      codes: u8[..., n, ...] with values in [0, 2**bits - 1], n = codes.shape[axis], n % (8 // bits) == 0.
      axis: the axis to pack (negative allowed).
      bits: the code width, 2 or 4.

    Returns:
      u8[..., n // (8 // bits), ...].

    Raises:
      ValueError: bits not 2 or 4, dtype not uint8, n not a multiple of 8 // bits, bad axis, or (for
        concrete, non-traced inputs only; inside jit the check would cost a device sync) a code above
        2**bits - 1.
    """
    _check_bits(bits)
    codes = jnp.asarray(codes)
    if codes.dtype != jnp.uint8:
        raise ValueError(f"codes must be uint8, got dtype={codes.dtype}")
    axis = _check_axis(codes, axis, "codes")
    n, c = codes.shape[axis], codes_per_byte(bits)
    if n % c:
        raise ValueError(f"packed axis length must be a multiple of {c} ({bits}-bit codes), got {n=} ({axis=})")
    if not isinstance(codes, jax.core.Tracer) and codes.size:
        top = int(np.asarray(codes).max())
        if top > code_mask(bits):
            raise ValueError(f"{bits}-bit codes must be in [0, {code_mask(bits)}], got a code of {top}")
    return _pack(codes, axis, bits)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _pack(codes, axis, bits):
    planes = jnp.split(codes, codes_per_byte(bits), axis=axis)
    packed = planes[0]
    for j in range(1, len(planes)):
        packed = packed | (planes[j] << plane_shift(j, bits))
    return packed


def unpack_codes(packed, axis, bits=BITS_PER_CODE):
    """Inverse of pack_codes: u8[..., m, ...] -> u8[..., (8 // bits) m, ...] codes in [0, 2**bits - 1].

    Raises:
      ValueError: bits not 2 or 4, dtype not uint8 or bad axis.
    """
    _check_bits(bits)
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed must be uint8, got dtype={packed.dtype}")
    return _unpack(packed, _check_axis(packed, axis, "packed"), bits)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _unpack(packed, axis, bits):
    return jnp.concatenate([unpack_plane(packed, j, bits) for j in range(codes_per_byte(bits))], axis=axis)


def pack_2bit(codes, axis):
    """pack_codes(codes, axis, bits=2): 2-bit codes 4 per byte."""
    return pack_codes(codes, axis, 2)


def unpack_2bit(packed, axis):
    """unpack_codes(packed, axis, bits=2)."""
    return unpack_codes(packed, axis, 2)
