"""Asymmetric per-partition quantization, HACK.md §2 (docs/DESIGN.md "Quantizer contract").

For a partition x_1..x_P of one tensor axis and b bits, L = 2**b - 1:

    m = round_down(min x),  s = round_up((max x - m) / L),  q = clip(round((x - m) / s), 0, L)
    x ~ s * q + m

m and s are rounded *outward* to meta_dtype (m toward -inf, s toward +inf) so that [m, m + L*s]
covers the partition, and q is computed against those stored values: codes and metadata agree, and
|x - x_hat| <= s / 2 (nearest) or < s (stochastic), up to float32 rounding of the arithmetic.

8 bits: codes are stored signed, c = q - 128 (int8, the INT8 x INT8 dot of HACK.md §3), and the
stored minimum is m_f = round_nearest(m + 128 * s), so x ~ s * c + m_f still holds. c is computed
against m_f, which adds at most |m_f - (m + 128 s)| <= half an ulp of m_f to the error bound.

Clipping (clip = n > 0, nearest rounding, bits < 8): instead of the full [min x, max x], the stored
(m, s) is the one of the n * n candidate ranges [lo + a w, hi - b w] (w = hi - lo; a, b in
{0, CLIP_STEP, ..., (n - 1) CLIP_STEP}, clip_grid(n)), each rounded outward as above, whose codes
(nearest, clamped to [0, L]) reconstruct the partition with the least float32 sum of squared errors;
ties keep the earlier candidate, the first being [lo, hi] itself, so a partition's squared error
never exceeds min-max's. Values outside the chosen range saturate at code 0 or L (no s / 2 bound).

All arithmetic is float32 whatever the input dtype.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "scale", "minimum", "code_sums"],
    meta_fields=["bits", "axis", "partition_size"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A tensor quantized per partition of `partition_size` consecutive elements along `axis`.

    With x of shape [..., n, ...] (n = x.shape[axis]) and G = n // partition_size:
      codes:     u8[..., n, ...] in [0, 2**bits - 1] for bits < 8; i8[..., n, ...] = q - 128 for bits 8.
      scale:     meta_dtype[..., G, ...], >= 0 (0 only for a constant partition).
      minimum:   meta_dtype[..., G, ...] (for bits 8 the folded minimum m + 128 * scale).
      code_sums: i32[..., G, ...], the sum of the stored codes of each partition (HACK.md §3 alpha/beta).
      bits, axis (non-negative), partition_size: static pytree metadata.
    Element k of partition g reconstructs as scale[g] * codes[k] + minimum[g].
    """

    codes: jax.Array
    scale: jax.Array
    minimum: jax.Array
    code_sums: jax.Array
    bits: int
    axis: int
    partition_size: int

    @property
    def shape(self):
        return self.codes.shape

    @property
    def ndim(self):
        return len(self.codes.shape)


def split_partitions(x, axis, partition_size):
    """[..., n, ...] -> [..., n // partition_size, partition_size, ...] (partition index first)."""
    n = x.shape[axis]
    return x.reshape(x.shape[:axis] + (n // partition_size, partition_size) + x.shape[axis + 1 :])


def saturation_bound(bits, meta_dtype):
    """Inputs are clipped to +-this before quantizing, so scale and minimum stay finite.

    finfo(meta_dtype).max, halved at 1 bit (the scale spans the whole range), and at most 2**125
    (for bf16/float32 metadata) so that hi - m, x - m and 1 / scale stay normal float32 numbers.
    """
    fmax = float(jnp.finfo(meta_dtype).max)
    return min(fmax / 2 if bits == 1 else fmax, 2.0**125)


def _round_toward(v, dtype, direction):
    """Rounds float32 v to dtype toward -inf (direction < 0) or +inf (direction > 0)."""
    y = v.astype(dtype)
    back = y.astype(jnp.float32)
    overshot = back > v if direction < 0 else back < v
    return jnp.where(overshot, jnp.nextafter(y, jnp.asarray(direction * jnp.inf, dtype)), y)


CLIP_STEP = 0.05  # the shrink step of each end of a partition's range (clip_grid)
MAX_CLIP = 8  # clip_grid(8): each end moved in by up to 0.35 of the range, 64 candidates


def clip_grid(n):
    """The candidate shrinks (a, b) of clip = n, min-max's (0, 0) left out: range [lo + a w, hi - b w]
    for a, b in {0, CLIP_STEP, ..., (n - 1) CLIP_STEP}; () for n = 0 (plain min-max)."""
    return tuple((round(a * CLIP_STEP, 6), round(b * CLIP_STEP, 6))
                 for a in range(n) for b in range(n) if a or b)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(x, bits, axis, partition_size, rounding, key, meta_dtype, noise=None, clip=0):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must have a floating dtype, got dtype={x.dtype}")
    if not _is_int(bits) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in [1, 8], got {bits=}")
    if not _is_int(axis) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis out of range for x of shape {x.shape}: {axis=}")
    if not _is_int(partition_size) or partition_size < 1:
        raise ValueError(f"partition_size must be a positive int, got {partition_size=}")
    n = x.shape[axis]
    if n % partition_size:
        raise ValueError(
            f"x.shape[axis] = {n} is not divisible by {partition_size=} (x.shape={x.shape}, {axis=})"
        )
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding=}")
    if rounding == "stochastic" and key is None and noise is None:
        raise ValueError("rounding='stochastic' needs a PRNG key, got key=None")
    if noise is not None and jnp.shape(noise) != x.shape:
        raise ValueError(f"noise must have x's shape {x.shape}, got {jnp.shape(noise)}")
    if key is not None and not (isinstance(key, jax.Array) and (
            jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or key.dtype == jnp.uint32)):
        raise TypeError(f"key must be a jax PRNG key (jax.random.key), got {key!r}")
    if not jnp.issubdtype(meta_dtype, jnp.floating):
        raise ValueError(f"meta_dtype must be a floating dtype, got {meta_dtype=}")
    if not _is_int(clip) or not (clip == 0 or 2 <= clip <= MAX_CLIP):
        raise ValueError(f"clip must be 0 (min-max) or an int in [2, {MAX_CLIP}], got {clip=}")
    if clip and (rounding != "nearest" or bits == 8):
        raise ValueError(f"clip applies to rounding='nearest' and bits < 8 only, got {clip=}, "
                         f"{rounding=}, {bits=}")


def quantize(x, *, bits, axis, partition_size, rounding="nearest", key=None, meta_dtype=jnp.float16,
             noise=None, clip=0):
    """Quantizes x asymmetrically per partition along `axis` (HACK.md §2, module docstring).

    Args:
      x: float[..., n, ...], any float dtype; n = x.shape[axis] divisible by partition_size.
      bits: code width, int in [1, 8] (HACK uses 2 for K/V and 8 for Q and softmax weights).
      axis: the partitioned axis (negative allowed; stored normalized).
      partition_size: P, consecutive elements along `axis` sharing one scale and minimum.
      rounding: "nearest" (half to even) or "stochastic": q = floor((x - m) / s + u),
        u ~ U[0, 1) drawn from `key`, which makes q unbiased (E[s q + m] = x).
      key: jax PRNG key, required for stochastic rounding (unless noise is given), ignored otherwise.
      meta_dtype: dtype of scale and minimum.
      noise: optional f32 of x's shape in [0, 1): the u of stochastic rounding, instead of drawing it
        from key (the cache draws it per (sequence, token position): kv_cache.common.token_noise).
      clip: 0 (min-max) or n in [2, MAX_CLIP]: the least-squares search over clip_grid(n)'s ranges
        (module docstring); nearest rounding and bits < 8 only.

    Returns:
      QuantizedTensor (shapes in its docstring). dequantize(result) ~ x with
      |x - x_hat| <= scale / 2 (nearest) or < scale (stochastic) per element, plus for bits 8 half
      an ulp of the stored (folded) minimum; with clip, for the elements inside the chosen range.

    Edge cases:
      - a partition whose values all equal one meta_dtype number c gets scale 0, codes 0,
        minimum c: reconstructed exactly, no division by zero. (A constant that meta_dtype cannot
        represent gets a tiny nonzero scale instead, so the error bound above still holds.)
      - a non-constant partition never gets scale 0: scale >= finfo(meta_dtype).tiny, so values
        around 1e-6 (subnormal in float16) keep a nonzero scale.
      - finite values beyond meta_dtype's range saturate: x is clipped to
        +-saturation_bound(bits, meta_dtype) (finfo(meta_dtype).max; max / 2 at 1 bit; at most
        2**125) before quantizing, so scale, minimum and codes stay finite; the bound then holds for
        the clipped x. NaN inputs raise nothing and are promised nothing.

    Raises:
      ValueError: non-float x, bits not in [1, 8], bad axis, n % partition_size != 0, unknown
        rounding, stochastic rounding without key, non-float meta_dtype, clip out of its domain.
    """
    x = jnp.asarray(x)
    meta_dtype = jnp.dtype(meta_dtype)
    _validate(x, bits, axis, partition_size, rounding, key, meta_dtype, noise, clip)
    noise = None if noise is None or rounding != "stochastic" else jnp.asarray(noise, jnp.float32)
    return _quantize(x, key, noise, bits=bits, axis=axis % x.ndim, partition_size=partition_size,
                     rounding=rounding, meta_dtype=meta_dtype, clip_grid=clip_grid(clip))


@functools.partial(jax.jit, static_argnames=("bits", "axis", "partition_size", "rounding", "meta_dtype",
                                             "clip_grid"))
def _quantize(x, key, noise, *, bits, axis, partition_size, rounding, meta_dtype, clip_grid=()):
    levels = 2**bits - 1
    bound = saturation_bound(bits, meta_dtype)
    xp = split_partitions(jnp.clip(x.astype(jnp.float32), -bound, bound), axis, partition_size)
    lo, hi = xp.min(axis=axis + 1), xp.max(axis=axis + 1)  # [..., G, ...]
    if clip_grid:
        minimum, scale = _search(xp, lo, hi, clip_grid, levels, axis, meta_dtype)
    else:
        minimum, scale = _min_max(lo, hi, levels, meta_dtype)
    m32, s32 = minimum.astype(jnp.float32), scale.astype(jnp.float32)

    if bits == 8:
        lo_code, hi_code = -128, 127
        minimum = jnp.clip(m32 + 128.0 * s32, -bound, bound).astype(meta_dtype)
        m32 = minimum.astype(jnp.float32)
    else:
        lo_code, hi_code = 0, levels

    t = (xp - jnp.expand_dims(m32, axis + 1)) / jnp.expand_dims(jnp.where(s32 > 0, s32, 1.0), axis + 1)
    if rounding == "stochastic":
        u = (jax.random.uniform(key, t.shape, jnp.float32) if noise is None
             else split_partitions(noise, axis, partition_size))
        q = jnp.floor(t + u)
    else:
        q = jnp.round(t)
    q = jnp.clip(q, lo_code, hi_code).astype(jnp.int32)

    codes = q.reshape(x.shape).astype(jnp.int8 if bits == 8 else jnp.uint8)
    return QuantizedTensor(codes=codes, scale=scale, minimum=minimum,
                           code_sums=q.sum(axis=axis + 1, dtype=jnp.int32),
                           bits=bits, axis=axis, partition_size=partition_size)


def _min_max(lo, hi, levels, meta_dtype):
    """(minimum, scale) in meta_dtype of the range [lo, hi], rounded outward (module docstring)."""
    minimum = _round_toward(lo, meta_dtype, -1)
    m32 = minimum.astype(jnp.float32)
    # Halved before subtracting, which cannot overflow; pallas_kernels/common.py repeats these
    # operations one for one so that kernel and reference agree code for code.
    raw_scale = (0.5 * hi - 0.5 * m32) * (2.0 / levels)
    tiny = jnp.asarray(jnp.finfo(meta_dtype).tiny, meta_dtype)
    scale = jnp.where(hi > m32, jnp.maximum(_round_toward(raw_scale, meta_dtype, 1), tiny),
                      jnp.zeros_like(tiny))
    return minimum, scale


def _sq_error(xp, minimum, scale, levels, axis):
    """Per partition: sum over its elements of (scale * q + minimum - x)^2, q nearest, clamped."""
    m32 = jnp.expand_dims(minimum.astype(jnp.float32), axis + 1)
    s32 = jnp.expand_dims(scale.astype(jnp.float32), axis + 1)
    q = jnp.clip(jnp.round((xp - m32) / jnp.where(s32 > 0, s32, 1.0)), 0, levels)
    return jnp.square(s32 * q + m32 - xp).sum(axis=axis + 1)


def _search(xp, lo, hi, grid, levels, axis, meta_dtype):
    """(minimum, scale) per partition of the candidate (min-max's, then grid's in order; lo + 0 w
    is lo exactly) with the least squared error, ties to the earliest. The candidates are a
    leading axis of one broadcast computation (one fused reduction; compile time does not grow
    with their number)."""
    shape = (len(grid) + 1,) + (1,) * lo.ndim
    a = jnp.asarray((0.0,) + tuple(g[0] for g in grid), jnp.float32).reshape(shape)
    b = jnp.asarray((0.0,) + tuple(g[1] for g in grid), jnp.float32).reshape(shape)
    width = hi - lo
    m_c, s_c = _min_max(lo + a * width, hi - b * width, levels, meta_dtype)  # [C, ..., G, ...]
    best = jnp.argmin(_sq_error(xp[None], m_c, s_c, levels, axis + 1), axis=0)[None]
    return (jnp.take_along_axis(m_c, best, axis=0)[0], jnp.take_along_axis(s_c, best, axis=0)[0])


def dequantize(qt):
    """x_hat = scale * codes + minimum per partition (HACK.md §2): float32, shape qt.codes.shape.

    Raises TypeError when qt is not a QuantizedTensor.
    """
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"dequantize expects a QuantizedTensor, got {type(qt).__name__}")
    return _dequantize(qt)


@jax.jit
def _dequantize(qt):
    ax = qt.axis
    codes = split_partitions(qt.codes.astype(jnp.float32), ax, qt.partition_size)
    scale = jnp.expand_dims(qt.scale.astype(jnp.float32), ax + 1)
    minimum = jnp.expand_dims(qt.minimum.astype(jnp.float32), ax + 1)
    return (scale * codes + minimum).reshape(qt.codes.shape)
