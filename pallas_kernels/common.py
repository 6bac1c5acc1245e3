"""Shared pieces of the Pallas kernels and most of their Triton-specific calls.

- `compiler_params(num_warps, num_stages)`: `pltriton.CompilerParams`; passing it to `pl.pallas_call`
  is what selects the Triton lowering on GPU (without it Pallas lowers through Mosaic GPU).
- `pallas_call(kernel, ...)`: `pl.pallas_call` with the Triton compiler params, `interpret=` passed
  through, and exactly the Pallas-Triton DeprecationWarning ("The Pallas Triton backend is deprecated",
  jax >= 0.11, emitted while lowering) filtered. The warning is raised when the enclosing jit is lowered,
  which can happen outside any call of ours, so the same single filter is also installed once at import.
- `quiet(fn)`: decorator for public entry points (same filter around eager calls).
- In-kernel plane unpacking for DESIGN.md's planar packing (b-bit codes, b = 2 or 4: plane j = bits
  bj..bj+b-1): `plane` (u8 codes), `plane_int8_masked` (int8 dot operands code * 2**e, inline PTX on
  the GPU), `folded_plane` (exact 16-bit float operands, inline PTX on the GPU); `select_rows`; exact integer
  dots `int_dot`; float32-accurate dots on bf16 tensor cores `f32_bf16_dot`.
- The INT8 quantizer of the transient operands (`quantize_rows_int8`, `round_half_even`), repeating
  hack_jax.quantization.quantize's float32 arithmetic; `quantize_rows_int8_codes` gives int8 dot
  operands, on the GPU optionally rounded + clamped by one PTX cvt and divided by one reciprocal per row.
- `exp`: jnp.exp or the flash-attention form exp2(x log2 e).
- Online softmax: `merge_state` or its two halves `merge_weights` + `merge_acc`, `merge_streams` (row
  blocks of one program), `lse_combine` (split-K partials, plain jnp).
- The paged-kivi decode kernels' shared launch pieces (HACK and fused-dequant): `check_kivi_inputs`
  and `q_per_kv_pad` (prefill's too), `blocks_per_trip` / `trip_plane` (a loop trip's 4 blocks: one 2-bit
  packing group or two 4-bit ones), `split_range`, `load_q_rows`, `empty_state`,
  `sinks_and_open_block_state`,
  `split_slots` / `combine_splits` (the split-K merge: a small Pallas kernel from PALLAS_COMBINE_MIN_PROGRAMS
  programs, `lse_combine` below), `full_spec`.
- The per-token decode kernels' (fp8, int8, int4 / turbo) tile walk `per_token_tiles` and launch
  `per_token_paged_decode`.

- The prefill kernel's in-kernel pieces: `dynamic_plane` (a traced plane index, inline PTX on the GPU)
  and `quantize_rows_int8_ffma` (one reciprocal per row, rounded by the FFMA).

triton_decode_kernel.py is a Triton kernel outright; a port of the Pallas kernels to another backend
touches this file and the launch wrappers.
"""
from __future__ import annotations

import functools
import math
import re
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

TRITON_DEPRECATION_MESSAGE = "The Pallas Triton backend is deprecated"


def _ignore_triton_deprecation() -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning, message=TRITON_DEPRECATION_MESSAGE)


_ignore_triton_deprecation()


def compiler_params(num_warps: int = 4, num_stages: int = 2) -> pltriton.CompilerParams:
    """Triton launch parameters; passing them selects the Pallas-Triton lowering."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, out_shape, grid=(), in_specs=None, out_specs=None, num_warps: int = 4,
                num_stages: int = 2, interpret: bool = False, name: str | None = None,
                maxnreg: int | None = None, **kwargs):
    """`pl.pallas_call` on the Triton backend, with the deprecation warning filtered.

    maxnreg: a cap on the registers per thread (Triton's `maxnreg`, PTX `.maxnreg`), which Pallas'
    CompilerParams cannot pass: the kernel's name gets the suffix `_maxnreg{N}` and `_install_register_cap`'s
    hook has the lowering put `ttg.maxnreg = N` on the kernel's Triton module (XLA's Triton compile honours it
    on the H200, pip Triton's offline compile too: bench/NOTES_decode.md, session 17). Returns a callable like
    `pl.pallas_call` does. `kwargs` go to `pl.pallas_call` unchanged.
    """
    if maxnreg is not None:
        check_maxnreg(maxnreg)
        if name is None:
            raise ValueError("a register cap (maxnreg) needs a kernel name")
        name = f"{name}{CAP_SUFFIX}{maxnreg}"
        if not interpret and not CAP_HOOKED:
            _warn_uncapped()
    call = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                          out_specs=out_specs, interpret=interpret, name=name,
                          compiler_params=compiler_params(num_warps, num_stages), **kwargs)

    @functools.wraps(kernel)
    def run(*args):
        with warnings.catch_warnings():
            _ignore_triton_deprecation()
            return call(*args)

    return run


CAP_SUFFIX = "_maxnreg"
MAXNREG_RANGE = (24, 255)  # registers per thread a cap may ask for (ptxas' .maxnreg bounds on sm_90)


def check_maxnreg(value, what: str = "maxnreg", *, zero: bool = False) -> None:
    """ValueError naming `what` unless value is None, an int in MAXNREG_RANGE, or (zero=True) 0 for "no cap"."""
    lo, hi = MAXNREG_RANGE
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool)
                           and (lo <= value <= hi or (zero and value == 0)))
    if not ok:
        raise ValueError(f"{what} must be None{', 0 (no register cap)' if zero else ''} or an int in [{lo}, {hi}], "
                         f"got {what}={value!r}")


def _install_register_cap() -> bool:
    """Wraps the Pallas-Triton lowering (once, at import, so that tools which wrap and restore it later
    keep this wrapper; a tool that wrapped it before this import and restores it afterwards removes it)
    so that a kernel named `..._maxnreg{N}`, N in MAXNREG_RANGE, is lowered to a Triton module carrying
    `ttg.maxnreg = N`, the module attribute that Triton's own `maxnreg` option sets; other kernels are
    untouched. jax has no public route for it. Returns whether the hook is installed."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering as triton_lowering
        lower = triton_lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError):
        return False
    if getattr(lower, "_hack_register_cap", False):  # a reload of this module: already wrapped
        return True

    @functools.wraps(lower)
    def capped(jaxpr, *args, **kwargs):
        result = lower(jaxpr, *args, **kwargs)
        name = getattr(getattr(jaxpr, "debug_info", None), "func_name", "") or ""
        match = re.search(re.escape(CAP_SUFFIX) + r"(\d+)$", name)
        if match and MAXNREG_RANGE[0] <= int(match.group(1)) <= MAXNREG_RANGE[1]:
            op = result.module.operation
            with op.context:
                op.attributes["ttg.maxnreg"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32),
                                                                  int(match.group(1)))
        return result

    capped._hack_register_cap = True
    triton_lowering.lower_jaxpr_to_triton_module = capped
    return True


CAP_HOOKED = _install_register_cap()


@functools.cache
def _warn_uncapped():
    warnings.warn("this jax's Pallas-Triton lowering is not where the register cap (KernelConfig.maxnreg) hooks "
                  "in: the kernels run uncapped (the same results, slower)", RuntimeWarning, stacklevel=3)


def quiet(fn):
    """Decorator for public entry points: runs `fn` (and the lowering it triggers) with the warning off."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            _ignore_triton_deprecation()
            return fn(*args, **kwargs)

    return wrapper


# ----------------------------------------------------------------------------- 2-bit unpacking
# DESIGN.md packing (hack_jax.packing): byte i of a packing group holds 4 codes, plane j in bits
# [2j, 2j+1] = position i of the group's block j.

def plane(tile: jax.Array, j: int) -> jax.Array:
    """Plane j of a u8 code tile as u8 codes 0..3: `(byte >> 2j) & 3`."""
    x = tile >> jnp.uint8(2 * j) if j else tile
    return x & jnp.uint8(3)


def num_planes(bits: int) -> int:
    """Code planes per byte = blocks per packing group: 8 // bits (NUM_PLANES at 2 bits)."""
    return 8 // bits


# "int8" masked planes, per code width: plane j as code_j * 2**MASKED_PLANE_EXP[bits][j] (int8-safe), the
# weight 2**-e undone on the dot result (`masked_plane_weights`). 2 bits: values <= 48, plane 3 needs one
# shift (code * 64 = 192 > 127); 4 bits: the low nibble masked, the high one shifted down (code * 16 > 127).
_MASKED_PLANE = {2: {0: (0, 0x03), 1: (0, 0x0C), 2: (0, 0x30), 3: (2, 0x30)},  # j -> (right shift, byte mask)
                 4: {0: (0, 0x0F), 1: (4, 0x0F)}}
MASKED_PLANE_EXP = {2: (0, 2, 4, 4), 4: (0, 0)}  # plane j holds code_j * 2**MASKED_PLANE_EXP[bits][j]


def plane_int8_masked(tile: jax.Array, j: int, *, asm: bool, bits: int = 2) -> jax.Array:
    """"int8" plane j of a u8 code tile as code_j * 2**MASKED_PLANE_EXP[bits][j]. 2 bits (values <= 48):
    planes 0-2 are `byte & (3 << 2j)` (one AND per 4 codes with inline PTX, no shift), plane 3
    `(byte >> 2) & 0x30`; 4 bits (values <= 15): `byte & 0x0F`, `(byte >> 4) & 0x0F`. The dot results
    are exact integers (|dot| <= 127 * 48 * inner dim < 2**24) and the caller multiplies them by
    2**-MASKED_PLANE_EXP[bits][j] (`masked_plane_weights`, exact). asm (GPU only): on 4 packed bytes per
    32-bit register by `elementwise_inline_asm`, else jnp (interpret mode; same bits)."""
    shift, mask = _MASKED_PLANE[bits][j]
    if not asm:
        x = tile >> jnp.uint8(shift) if shift else tile
        return (x & jnp.uint8(mask)).astype(jnp.int8)
    mask4 = f"0x{mask:02X}{mask:02X}{mask:02X}{mask:02X}"
    body = (f"shr.b32 t, $1, {shift}; and.b32 $0, t, {mask4};" if shift else f"and.b32 $0, $1, {mask4};")
    [out] = pltriton.elementwise_inline_asm(
        "{ .reg .b32 t; " + body + " }", args=[tile], constraints="=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(tile.shape, jnp.int8)])
    return out


# Scale-folded 16-bit planes: dtype, magic exponent bits, magic value, END = the bit above the code field.
# Plane j of a byte, moved to bits TOP..END-1 (TOP = END - bits) and OR-ed into the magic's mantissa, reads
# as MAGIC + code * 2**TOP exactly (2 bits: f16 1024 + 64 c, ulp 1 there, bf16 128 + 32 c; 4 bits: f16
# 1024 + 16 c, bf16 128 + 8 c): no integer-to-float convert. END keeps the field in the low byte (the
# PRMT below) and in the mantissa (bf16: 7 bits). The offset is only MAGIC / (2**TOP * mean code) ~ 11
# (f16) / 2.7 (bf16) times the mean code at 2 bits, ~8.5 / 2.1 at 4 bits, so the float32 sums of the dot
# keep all but ~3.5 / 1.5 bits (a 1024 + code operand would lose ~9.4).
FOLDED_PLANES = {"folded_f16": (jnp.float16, 0x6400, 1024.0, 8), "folded_bf16": (jnp.bfloat16, 0x4300, 128.0, 7)}


def folded_plane_constants(dot_dtype: str, bits: int = 2):
    """(weight, offset) of `folded_plane`: dot(a, plane) * weight - offset * sum(a) = dot(a, codes)."""
    _, _, value, end = FOLDED_PLANES[dot_dtype]
    top = end - bits
    return 2.0 ** -top, value * 2.0 ** -top


def _byte_word_to_halves(body: str, tile: jax.Array, dtype) -> jax.Array:
    """The inline-PTX form shared by the 16-bit plane unpackers: `body` maps each 32-bit word of 4 code bytes
    ($2) to two registers ($0, $1) of two 16-bit `dtype` values each (element order: the body's)."""
    [out] = pltriton.elementwise_inline_asm(
        body, args=[tile], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(tile.shape, dtype)])
    return out


def folded_plane(tile: jax.Array, j: int, dot_dtype: str, *, asm: bool, bits: int = 2) -> jax.Array:
    """Plane j of a u8 code tile of `bits`-bit codes as 16-bit floats MAGIC + code_j * 2**TOP
    (FOLDED_PLANES, TOP = END - bits), exact.

    jnp (interpret mode): shift the byte so the code lands at bits TOP..END-1, mask, widen, OR the magic
    exponent, bitcast. asm (GPU only): the same bits on 4 packed bytes per 32-bit register, one shift
    (none for f16 plane 3 at 2 bits, plane 1 at 4 bits) + one AND per 4 codes and two PRMTs that interleave
    the bytes with the magic's high byte into two f16x2 / bf16x2 registers."""
    dtype, magic, _, end = FOLDED_PLANES[dot_dtype]
    top = end - bits
    shift = top - bits * j  # > 0: left
    mask = ((1 << bits) - 1) << top
    if not asm:
        x = tile << jnp.uint8(shift) if shift > 0 else tile >> jnp.uint8(-shift) if shift < 0 else tile
        bits = (x & jnp.uint8(mask)).astype(jnp.uint16) | jnp.uint16(magic)
        return jax.lax.bitcast_convert_type(bits, dtype)
    move = (f"shl.b32 t, $2, {shift}; " if shift > 0 else f"shr.b32 t, $2, {-shift}; " if shift < 0
            else "mov.b32 t, $2; ")
    hi = f"{magic >> 8:02X}" * 4
    mask4 = f"{mask:02X}" * 4
    # prmt selectors: result bytes (lo..hi) = (t.b0, m.b0, t.b1, m.b1) and (t.b2, m.b3, t.b3, m.b3)
    body = (f"{{ .reg .b32 t, m; {move}and.b32 t, t, 0x{mask4}; mov.b32 m, 0x{hi}; "
            f"prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x7372; }}")
    return _byte_word_to_halves(body, tile, dtype)


# Subnormal f16 planes (KernelConfig.denormal): plane j's bits masked in place in a byte that is widened to a
# 16-bit lane with a zero high byte make the f16 subnormal code_j * 2**(bits j) * 2**-24, exactly: no magic
# exponent, so no offset term after the dot (no float32 cancellation: the plane's position in the byte costs
# nothing) and no per-plane shift. Per 32-bit word of 4 code bytes: two PRMTs that widen the bytes (the same
# for a word's planes: ptxas keeps one of each) and one AND per 2 codes, 10 instructions per 16 codes
# where `folded_plane` takes 15. The tensor cores multiply f16 subnormals exactly (the gpu tests check it).
DENORMAL_PRMT = (0x4140, 0x4342)  # bytes (0, 1) / (2, 3) of a word, each under a zero byte (prmt b = 0)


def denormal_plane_weight(j: int, bits: int = 2) -> float:
    """dot(a, denormal_plane(tile, j)) * denormal_plane_weight(j) = dot(a, codes_j)."""
    return 2.0 ** (24 - bits * j)


def denormal_plane(tile: jax.Array, j: int, *, asm: bool, bits: int = 2) -> jax.Array:
    """Plane j of a u8 code tile as f16 subnormals code_j * 2**(bits j - 24), exact (comment above).
    jnp (interpret mode): mask, widen, bitcast. asm (GPU only): per 4 packed bytes, 2 PRMTs (bytes
    interleaved with zero bytes into two 32-bit registers) and one AND each."""
    mask = ((1 << bits) - 1) << (bits * j)
    if not asm:
        return jax.lax.bitcast_convert_type((tile & jnp.uint8(mask)).astype(jnp.uint16), jnp.float16)
    mask2 = mask | mask << 16
    lo, hi = DENORMAL_PRMT
    body = (f"{{ .reg .b32 z, lo, hi; mov.b32 z, 0; prmt.b32 lo, $2, z, 0x{lo:04X}; prmt.b32 hi, $2, z, 0x{hi:04X}; "
            f"and.b32 $0, lo, 0x{mask2:08X}; and.b32 $1, hi, 0x{mask2:08X}; }}")
    return _byte_word_to_halves(body, tile, jnp.float16)


# Interleaved f16 planes (KernelConfig.interleaved): a 32-bit word of 4 code bytes k..k+3 unpacks without
# byte permutes, bytes 0 and 2 into one f16x2 register, bytes 1 and 3 into the other, so a plane's
# elements along the packed (contiguous) axis come in the order INTERLEAVE within each aligned group of
# 4; the kernel reads the dot's other operand in the same order, which leaves the dot unchanged (the
# asm assumes Triton hands each call 4 consecutive, 4-aligned elements of a tile row). Plane
# j's field sits at bits INTERLEAVED_TOPS[bits][j] (value 1024 + code * 2**top): 2 bits 4 or 6, so the
# 4 planes of a word need 3 shifts (<< 4, >> 4, >> 8) and one LOP3 (and + or) per 2 codes; the offset
# is ~43x the mean code at top 4 (float32 sums keep all but ~5.4 bits; `folded_plane`'s top 6: ~3.5).
INTERLEAVE = (0, 2, 1, 3)
INTERLEAVED_TOPS = {2: (4, 6, 4, 6), 4: (4, 4)}


def interleaved_plane_constants(bits: int = 2):
    """Per plane j: (weight, offset) of `interleaved_plane`: dot(a, plane_j) * weight_j - offset_j * sum(a)
    = dot(a, codes_j) (f16: magic 1024)."""
    return tuple((2.0 ** -t, 1024.0 * 2.0 ** -t) for t in INTERLEAVED_TOPS[bits])


def interleave(x: jax.Array, axis: int = -1) -> jax.Array:
    """x with each aligned group of 4 along `axis` taken in INTERLEAVE order (its own inverse)."""
    axis = axis % x.ndim
    n = x.shape[axis]
    g = x.reshape(*x.shape[:axis], n // 4, 4, *x.shape[axis + 1:])
    parts = [jax.lax.index_in_dim(g, i, axis + 1, keepdims=False) for i in INTERLEAVE]
    return jnp.stack(parts, axis=axis + 1).reshape(x.shape)


def interleaved_index(n: int) -> jax.Array:
    """i32[n]: position i of an interleaved axis reads element interleaved_index(n)[i] (INTERLEAVE within
    aligned groups of 4), for loads of the operand that meets an `interleaved_plane` in a dot."""
    i = jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
    low = i % 4
    assert INTERLEAVE == (0, 2, 1, 3)  # the swap below (no array constant: kernels may not capture one)
    return i - low + jnp.where((low == 1) | (low == 2), 3 - low, low)


def interleaved_word_ops(j: int, bits: int = 2):
    """Plane j's two f16x2 results of a 32-bit word w as ((shift_lo, shift_hi), mask): lo = (w <<< shift_lo)
    & mask | 0x64006400 holds bytes 0 and 2, hi = (w <<< shift_hi) & mask | 0x64006400 bytes 1 and 3
    (<<< a left shift, negative: right)."""
    top = INTERLEAVED_TOPS[bits][j]
    lo = top - bits * j
    mask = ((1 << bits) - 1) << top
    return (lo, lo - 8), mask | (mask << 16)


def interleaved_plane(tile: jax.Array, j: int, *, asm: bool, bits: int = 2) -> jax.Array:
    """Plane j of a u8 code tile as f16 1024 + code_j * 2**INTERLEAVED_TOPS[bits][j], exact, its last axis
    in INTERLEAVE order within aligned groups of 4 (`interleave`). asm (GPU only): per 32-bit word of 4
    bytes, `interleaved_word_ops`' two shifts (shared by a word's planes: ptxas keeps one of each) and
    two and+or (one LOP3 each); jnp (interpret mode): the same values, permuted by `interleave`."""
    top = INTERLEAVED_TOPS[bits][j]
    if not asm:
        code = (tile >> jnp.uint8(bits * j)) & jnp.uint8((1 << bits) - 1) if j else tile & jnp.uint8((1 << bits) - 1)
        value = (code.astype(jnp.uint16) << jnp.uint16(top)) | jnp.uint16(0x6400)
        return interleave(jax.lax.bitcast_convert_type(value, jnp.float16))
    (lo, hi), mask = interleaved_word_ops(j, bits)

    def move(dst, shift):
        return (f"shl.b32 {dst}, $2, {shift}; " if shift > 0 else f"shr.b32 {dst}, $2, {-shift}; " if shift < 0
                else f"mov.b32 {dst}, $2; ")
    # lop3 0xEA = (a & b) | c, the magic in a register (SASS LOP3 takes one immediate)
    body = (f"{{ .reg .b32 t, u, m; mov.b32 m, 0x64006400; {move('t', lo)}{move('u', hi)}"
            f"lop3.b32 $0, t, 0x{mask:08X}, m, 0xEA; lop3.b32 $1, u, 0x{mask:08X}, m, 0xEA; }}")
    return _byte_word_to_halves(body, tile, jnp.float16)


def int_dot(a: jax.Array, b: jax.Array, dot_dtype: str, *, trans_b: bool = False) -> jax.Array:
    """Exact dot of integer-valued operands (2-D, same dtype), returned as float32.

    "int8": int8 x int8 -> int32 (the method as written). "bf16": bf16 operands holding the same
    integers, float32 accumulation: exact while partial sums stay below 2**24 (128 x 192 x 128 = 3.1e6).
    """
    acc = jnp.int32 if dot_dtype == "int8" else jnp.float32
    return jnp.dot(a, b.T if trans_b else b, preferred_element_type=acc).astype(jnp.float32)


def split_bf16(a: jax.Array):
    """float32 a -> (hi, mid, lo) bf16 with hi + mid + lo == a exactly (8 + 8 + 8 significant bits;
    barring underflow of the smallest part)."""
    hi = a.astype(jnp.bfloat16)
    r = a - hi.astype(jnp.float32)
    mid = r.astype(jnp.bfloat16)
    return hi, mid, (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)


def f32_bf16_dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """float32 a times bf16 b at float32 accuracy on bf16 tensor cores: a is split into three bf16
    parts (exact), each product with b is exact in float32, sums accumulate in float32 (smallest
    part first). 3 MMAs instead of Triton's IEEE float32 dot, which runs on FMA units."""
    b = b.T if trans_b else b
    hi, mid, lo = split_bf16(a)
    acc = jnp.dot(lo, b, preferred_element_type=jnp.float32)
    acc = acc + jnp.dot(mid, b, preferred_element_type=jnp.float32)
    return acc + jnp.dot(hi, b, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- INT8 transients

_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: (x + M) - M rounds float32 x to nearest-even for |x| < 2**22


def round_half_even(x: jax.Array, *, interpret: bool) -> jax.Array:
    """jnp.round (ties to even) for |x| < 2**22, as the reference quantizer rounds.

    Triton has no lowering for lax.round, so on GPU this is the two-add magic-number trick (no
    fast-math there: the adds are not reassociated). XLA's algebraic simplifier folds that trick
    away, so interpret mode uses lax.round itself. Both give the same result.
    """
    if interpret:
        return jax.lax.round(x, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
    return (x + _ROUND_MAGIC) - _ROUND_MAGIC


def round_saturate_int8_asm(t: jax.Array) -> jax.Array:
    """int32 codes clip(round_half_even(t), -128, 127) of float32 t in one PTX instruction,
    `cvt.rni.s8.f32` (round to nearest even; float-to-integer cvt clamps to the destination range;
    the 8-bit result sits in a 32-bit register, PTX's wide-register rule). GPU only; NaN -> 0."""
    [out] = pltriton.elementwise_inline_asm(
        "cvt.rni.s8.f32 $0, $1;", args=[t], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(t.shape, jnp.int32)])
    return out


def reciprocal_approx_asm(d: jax.Array) -> jax.Array:
    """f32 1/d by one `rcp.approx.ftz.f32` (MUFU.RCP) per element. GPU only.

    Why: Triton lowers float32 `x / d` to PTX `div.full.f32`, which ptxas compiles (sm_90, checked in
    the SASS of the decode kernel) to MUFU.RCP of d (hoisted per distinct d) and, per element, one
    FMUL by it plus two predicated range FMULs (x, d scaled by 0.25 when |d| > 2**126, by 2**24
    when |d| < 2**-126). For d in [2**-126, 2**126] that is exactly x * rcp.approx.ftz(d), so
    `x * reciprocal_approx_asm(d)` with the reciprocal taken once per row gives the same bits as
    `x / d` on the GPU at 1 instead of 3 instructions per element (`quantize_rows_int8_codes`,
    fast_div). d: f32[...], any shape; returns f32 of the same shape."""
    [out] = pltriton.elementwise_inline_asm(
        "rcp.approx.ftz.f32 $0, $1;", args=[d], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(d.shape, jnp.float32)])
    return out


LOG2E = 1.4426950408889634


def exp(x: jax.Array, *, fast: bool = False) -> jax.Array:
    """f32 exp(x): jnp.exp (libdevice __nv_expf on the GPU: ~9 instructions per element, range
    reduction with two FFMAs and an exponent fix-up around one MUFU.EX2), or with fast=True
    exp2(x * log2(e)), the form flash attention uses: on the GPU one FMUL + one MUFU.EX2
    (Triton lowers f32 exp2 to ex2.approx.ftz.f32; checked in the decode kernel's PTX/SASS), in
    interpret mode XLA's exp2. Error of the fast form: ex2.approx's 2**-22 relative (PTX ISA) plus
    the rounding of x * log2(e), relative |x| 2**-24 in the result; for softmax weights w = exp(x),
    x <= 0, the absolute error is <= |x| e**x 2**-24 <= 2**-24 / e. exp(-inf) = 0 in both."""
    return jnp.exp2(x * LOG2E) if fast else jnp.exp(x)


def _int8_row_transform(x: jax.Array, *, fast_div: bool = False):
    """The float32 part of `quantize_rows_int8`: (t = (x - mf) / s unrounded, s, mf).

    fast_div (GPU only; the callers pass False in interpret mode): the division as a multiply by the
    row's `reciprocal_approx_asm` (the same bits as Triton's div.full.f32 division: s is 0 -> 1 or
    >= 2**-126 (tiny), and s <= (2**128 / 2) * (2 / 255) < 2**126 for finite float32 x)."""
    lo = jnp.min(x, axis=1)
    hi = jnp.max(x, axis=1)
    raw = (0.5 * hi - 0.5 * lo) * (2.0 / 255)
    s = jnp.where(hi > lo, jnp.maximum(raw, jnp.finfo(jnp.float32).tiny), 0.0)
    mf = lo + 128.0 * s
    d = jnp.where(s > 0, s, 1.0)
    if fast_div:
        return (x - mf[:, None]) * reciprocal_approx_asm(d)[:, None], s, mf
    return (x - mf[:, None]) / d[:, None], s, mf


def as_index_arrays(*xs):
    """Python lists / tuples / NumPy arrays of ints as jax arrays (dtype kept: validation then names
    a float dtype); jax arrays and tracers pass through."""
    return tuple(x if isinstance(x, jax.Array) or x is None else jnp.asarray(np.asarray(x)) for x in xs)


def quantize_rows_int8(x: jax.Array, *, interpret: bool):
    """INT8 per row of f32[rows, n], nearest, float32 metadata, folded minimum.

    Repeats hack_jax.quantization.quantize(x, bits=8, axis=1, partition_size=n,
    meta_dtype=float32) operation for operation, so the codes agree with the reference code for
    code (up to the GPU's float32 division): scale s = (hi/2 - lo/2) * (2/255) (0 for a constant
    row, else >= tiny), minimum mf = lo + 128 s, codes c = round((x - mf) / s) in [-128, 127],
    x ~ s * c + mf.

    Returns (codes f32[rows, n] holding integers, s f32[rows], mf f32[rows]).
    """
    t, s, mf = _int8_row_transform(x)
    return jnp.clip(round_half_even(t, interpret=interpret), -128.0, 127.0), s, mf


def quantize_rows_int8_codes(x: jax.Array, *, interpret: bool, fast: bool, fast_div: bool = False):
    """`quantize_rows_int8` with the codes as int8 dot operands: (codes i8[rows, n], s, mf).

    fast (GPU only; ignored in interpret mode): round + clip + convert by one `cvt.rni.s8.f32` per
    element (`round_saturate_int8_asm`) instead of two adds, two min/max and two converts; the
    same codes (both round half to even, then clamp to [-128, 127]).
    fast_div (GPU only; ignored in interpret mode): (x - mf) / s as (x - mf) * rcp(s) with one
    reciprocal per row (`_int8_row_transform`): the same bits as the GPU's division."""
    fast_div = fast_div and not interpret
    if not fast or interpret:
        t, s, mf = _int8_row_transform(x, fast_div=fast_div)
        codes = jnp.clip(round_half_even(t, interpret=interpret), -128.0, 127.0)
        return codes.astype(jnp.int8), s, mf
    t, s, mf = _int8_row_transform(x, fast_div=fast_div)
    return round_saturate_int8_asm(t).astype(jnp.int8), s, mf


def select_rows(row_plane: jax.Array, parts) -> jax.Array:
    """out[r] = parts[row_plane[r]][r]: picks, per row, the part of the row's own plane."""
    out = parts[-1]
    for j in range(len(parts) - 2, -1, -1):
        out = jnp.where((row_plane == j)[:, None], parts[j], out)
    return out


def masked_plane_weights(row_plane: jax.Array, bits: int = 2, planes: int | None = None) -> jax.Array:
    """f32[rows]: 2**-MASKED_PLANE_EXP[bits][row_plane], undoing `plane_int8_masked`'s scaling on the dot.
    planes: the (virtual) planes of a loop trip, `trip_plane`'s j (None: num_planes(bits))."""
    C = num_planes(bits)
    w = jnp.full(row_plane.shape, 1.0, jnp.float32)
    for j, e in enumerate(MASKED_PLANE_EXP[bits][j % C] for j in range(planes or C)):
        if e:
            w = jnp.where(row_plane == j, 2.0 ** -e, w)
    return w


# ----------------------------------------------------------------------------- online softmax

def merge_state(m, l, accs, m_b, l_b, o_bs, valid):
    """Online-softmax merge of a part (m_b, l_b, o_bs) into (m, l, accs), per row; rows where
    `valid` is False take nothing from the part (its values may be NaN: selected away, never
    multiplied by 0). m, l, m_b, l_b, valid: [rows]; accs, o_bs: tuples of [rows, n].
    """
    m_b = jnp.where(valid, m_b, -jnp.inf)
    m_new = jnp.maximum(m, m_b)
    base = jnp.where(m_new > -jnp.inf, m_new, 0.0)  # keeps exp(-inf - -inf) out
    alpha = jnp.exp(m - base)
    beta = jnp.exp(m_b - base)
    l_new = l * alpha + jnp.where(valid, l_b, 0.0) * beta
    accs = tuple(a * alpha[:, None] + jnp.where(valid[:, None], o, 0.0) * beta[:, None]
                 for a, o in zip(accs, o_bs))
    return m_new, l_new, accs


def merge_weights(m, l, m_b, l_b, valid, *, exp=jnp.exp):
    """`merge_state` in two steps, so each accumulator can be updated as soon as its part is ready:
    returns (m_new, l_new, alpha, beta) with acc_new = acc * alpha[:, None] + o_b * beta[:, None]
    (`merge_acc`); the same arithmetic as merge_state (exp: jnp.exp or `exp` with fast=True)."""
    m_b = jnp.where(valid, m_b, -jnp.inf)
    m_new = jnp.maximum(m, m_b)
    base = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    alpha = exp(m - base)
    beta = exp(m_b - base)
    return m_new, l * alpha + jnp.where(valid, l_b, 0.0) * beta, alpha, beta


def merge_acc(acc, o_b, alpha, beta, valid):
    """One accumulator of `merge_weights`: acc * alpha + o_b * beta, rows not `valid` take nothing
    (o_b may be NaN there)."""
    return acc * alpha[:, None] + jnp.where(valid[:, None], o_b, 0.0) * beta[:, None]


def merge_streams(m, l, accs, num_streams: int):
    """In-kernel merge of `num_streams` row blocks: rows r = i * n + g (i < num_streams) hold
    independent softmax states of row g. m, l [num_streams * n]; accs: tuple of [num_streams * n, w].
    Returns (m, l, accs) with n rows."""
    n = m.shape[0] // num_streams
    m3, l3 = m.reshape(num_streams, n), l.reshape(num_streams, n)
    m_all = jnp.max(m3, axis=0)
    base = jnp.where(m_all > -jnp.inf, m_all, 0.0)
    w = jnp.exp(m3 - base[None, :])  # [streams, n]; 0 for empty streams
    accs = tuple(jnp.sum(a.reshape(num_streams, n, a.shape[-1]) * w[:, :, None], axis=0) for a in accs)
    return m_all, jnp.sum(l3 * w, axis=0), accs


def lse_combine(m, l, acc, axes):
    """Combine partial softmax states along `axes` (outside kernels, plain jnp).

    m, l: [..., rows]; acc: [..., rows, d], the combined axes among the leading ones. Returns
    acc_total / l_total, 0 where nothing was attended (l_total == 0).
    """
    m_max = jnp.max(m, axis=axes, keepdims=True)
    base = jnp.where(m_max > -jnp.inf, m_max, 0.0)
    w = jnp.exp(m - base)
    l_tot = jnp.sum(l * w, axis=axes)
    acc_tot = jnp.sum(acc * w[..., None], axis=axes)
    safe = jnp.where(l_tot == 0, 1.0, l_tot)  # == 0, not > 0: a NaN total stays NaN
    return jnp.where((l_tot == 0)[..., None], 0.0, acc_tot / safe[..., None])


# ----------------------------------------------------------------------------- prefill: in-kernel pieces
# Used by prefill_attention.py, which walks one quantization block per loop iteration, so the block's
# plane is a traced shift and the INT8 transients are its own per-block quantizations.


def dynamic_plane(tile: jax.Array, shift: jax.Array, dtype, *, asm: bool, bits: int = 2) -> jax.Array:
    """Plane `shift // bits` of a packed u8 code tile as dot operands of `dtype` (bf16, f16 or int8),
    same shape, for a traced i32 `shift` in {0, 2, 4, 6} (2-bit codes) or {0, 4} (4-bit):
    `(byte >> shift) & (2**bits - 1)`.

    asm (GPU only) works on 4 bytes per 32-bit register by inline PTX: `t = (word >> shift) &
    0x03030303` (4 bits: 0x0F0F0F0F; the shift moves other bytes' bits only into the bits above the
    code, which the mask drops), then
      int8: t itself (4 codes);
      bf16 / f16: two PRMTs put 0x43 / 0x64 above each code byte (bf16 0x43cc = 128 + c, f16 0x64cc =
        1024 + c, exact) and one 16-bit x2 FMA per pair subtracts 128 / 1024 (exact): no
        integer-to-float converts (I2F.BF16 runs at a quarter of the ALU rate).
    2 + 1.5 instructions per 4 codes (16-bit) instead of ~6 per code. Without asm: jnp shifts and
    converts (interpret mode), the same values."""
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits=}")
    if not asm:
        return ((tile >> shift.astype(jnp.uint8)) & jnp.uint8(2**bits - 1)).astype(dtype)
    mask = "0x03030303" if bits == 2 else "0x0F0F0F0F"
    shifts = jnp.broadcast_to(jnp.asarray(shift, jnp.int32), tile.shape)
    if dtype == jnp.int8:
        [out] = pltriton.elementwise_inline_asm(
            f"{{ .reg .b32 t; shr.b32 t, $1, $2; and.b32 $0, t, {mask}; }}", args=[tile, shifts],
            constraints="=r,r,r,r,r,r", pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(tile.shape, jnp.int8)])
        return out
    # (magic byte, 1.0 x2, -magic x2, FMA type) of the 16-bit planes
    hi, one, off, fma = ((0x64646464, 0x3C003C00, 0xE400E400, "f16x2") if dtype == jnp.float16
                         else (0x43434343, 0x3F803F80, 0xC300C300, "bf16x2"))
    [out] = pltriton.elementwise_inline_asm(
        f"{{ .reg .b32 t, hi, one, off; shr.b32 t, $2, $3; and.b32 t, t, {mask}; "
        f"mov.b32 hi, {hi:#010x}; mov.b32 one, {one:#010x}; mov.b32 off, {off:#010x}; "
        "prmt.b32 $0, t, hi, 0x5140; prmt.b32 $1, t, hi, 0x7362; "
        f"fma.rn.{fma} $0, $0, one, off; fma.rn.{fma} $1, $1, one, off; }}",
        args=[tile, shifts], constraints="=r,=r,r,r,r,r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(tile.shape, jnp.dtype(dtype))])
    return out


def quantize_rows_int8_ffma(x: jax.Array, dtype, *, interpret: bool):
    """INT8 per row of f32[R, n] as dot operands of `dtype` (bf16 or int8): (codes, s f32[R], mf f32[R]),
    with `quantize_rows_int8`'s scale s = (hi/2 - lo/2) * (2/255) and folded minimum mf = lo + 128 s,
    and codes round((x - mf) * (1/s)): one reciprocal per row instead of a division per element.

    GPU: the rounding is done by the FFMA itself, u = (x - mf) * r + 1.5 * 2**23 (exact product, one
    rounding to a float whose ulp is 1 = round half to even of the code, |code| <= 128.5 < 2**22), then
    the clip to [M - 128, M + 127] and either u - M (bf16 operands: exact) or, for int8 operands, the
    low byte of u's bits (M's low byte is 0, so it is the code's two's complement: no float-to-int
    convert). Per element: sub, fma, min, max (+ sub for bf16). Both clips stay: they bind only where
    x - mf loses bits to cancellation (a near-constant row far from 0), and there they must, as in the
    reference. interpret: the same reciprocal product rounded by lax.round (XLA folds the magic-number
    trick away). Codes differ from the reference's (which divides) only where x / s is within float32
    rounding of a half-integer."""
    lo = jnp.min(x, axis=1)
    hi = jnp.max(x, axis=1)
    raw = (0.5 * hi - 0.5 * lo) * np.float32(2.0 / 255)
    s = jnp.where(hi > lo, jnp.maximum(raw, jnp.finfo(jnp.float32).tiny), 0.0)
    mf = lo + 128.0 * s
    r = 1.0 / jnp.where(s > 0, s, 1.0)  # [R]
    d = x - mf[:, None]
    if interpret:
        c = jnp.clip(jax.lax.round(d * r[:, None], jax.lax.RoundingMethod.TO_NEAREST_EVEN), -128.0, 127.0)
        return c.astype(dtype), s, mf
    magic = np.float32(_ROUND_MAGIC)
    u = jnp.clip(d * r[:, None] + magic, magic - np.float32(128), magic + np.float32(127))
    if dtype == jnp.int8:
        return jax.lax.bitcast_convert_type(u, jnp.int32).astype(jnp.int8), s, mf
    return (u - magic).astype(dtype), s, mf


# ----------------------------------------------------------------------------- validation


def is_pow2(n) -> bool:
    """True for a positive power of two (Triton tile sizes)."""
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def check_paged_bf16(head_dim: int, num_q_heads: int, batch: int, k, v, page_indices):
    """Validates a paged bf16 cache against q's sizes (both bf16 kernels); returns k's shape.

    Raises ValueError naming the offending value: k/v not bf16[num_pages, num_kv_heads, page_size,
    head_dim] of one shape, head_dim or page_size not a power of two >= 16, num_q_heads not a
    multiple of num_kv_heads, page_indices not i32[batch, pages_per_seq].
    """
    if k.ndim != 4 or k.shape != v.shape or k.dtype != jnp.bfloat16 or v.dtype != jnp.bfloat16:
        raise ValueError(f"k, v must be bf16[num_pages, num_kv_heads, page_size, head_dim] of one shape, "
                         f"got {k.shape=} {k.dtype=} {v.shape=} {v.dtype=}")
    _, num_kv_heads, page_size, head_dim_kv = k.shape
    if head_dim_kv != head_dim or not is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must match between q and k/v and be a power of two >= 16, "
                         f"got {head_dim=} {k.shape=}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads must be a multiple of num_kv_heads, got {num_q_heads=} {num_kv_heads=}")
    if not is_pow2(page_size) or page_size < 16:
        raise ValueError(f"page_size must be a power of two >= 16, got {page_size=}")
    if page_indices.ndim != 2 or page_indices.shape[0] != batch or page_indices.dtype != jnp.int32:
        raise ValueError(f"page_indices must be i32[batch, pages_per_seq], got {page_indices.shape=} "
                         f"{page_indices.dtype=} ({batch=})")
    return k.shape


def check_kivi_geometry(partition_size: int, head_dim: int, page_size: int, planes: int = 4) -> None:
    """Validates the kivi page geometry the HACK kernels support (DESIGN.md packing).

    Raises ValueError naming the value: partition_size or head_dim not a power of two >= 32 (the int8
    dot's inner dim), page_size not a multiple of planes * partition_size (one packing group: 4 blocks
    of 2-bit codes, 2 of 4-bit codes).
    """
    if not is_pow2(partition_size) or partition_size < 32:
        raise ValueError(f"partition_size must be a power of two >= 32, got {partition_size=}")
    if not is_pow2(head_dim) or head_dim < 32:
        raise ValueError(f"head_dim must be a power of two >= 32, got {head_dim=}")
    if page_size % (planes * partition_size):
        raise ValueError(f"page_size must be a multiple of {planes} * partition_size, got {page_size=}, "
                         f"{partition_size=}")


def require_2bit(kernel: str, bits) -> None:
    """NotImplementedError for a kernel that reads 2-bit codes only, given bits != 2 (QuantConfig.bits)."""
    if bits != 2:
        raise NotImplementedError(f"{kernel} reads 2-bit codes only, got {bits=}; decode a {bits}-bit cache with "
                                  f"decode_attention.hack_decode_attention (hack_jax.attention impl='pallas')")


def check_channel_group(v_group) -> None:
    """v_group (channels per V / query group) None, or a power of two >= 32 (the int8 dot's inner dim)."""
    if v_group is not None and (not isinstance(v_group, int) or not is_pow2(v_group) or v_group < 32):
        raise ValueError(f"v_group must be None or a power of two >= 32, got {v_group=}")


# ----------------------------------------------------------------------------- paged-kivi decode launch pieces
# Shared by decode_attention.py (HACK) and dequant_decode_attention.py (fused dequant): the same grid,
# rows, sinks / open-block handling and validation (decode_attention.py's header describes them).

NUM_PLANES = 4  # 2-bit codes per byte = blocks per packing group (DESIGN.md "2-bit packing")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def blocks_per_trip(bits: int, page_size: int, partition_size: int) -> int:
    """Blocks one loop trip of the paged-kivi decode kernels covers = its row streams (R = trip x
    q_per_kv_pad rows): NUM_PLANES = 4, one 2-bit packing group, or at 4 bits two consecutive packing
    groups of one page as 4 virtual planes (`trip_plane`), so a 4-bit trip carries a 2-bit trip's work
    per block; a page of an odd number of 4-bit packing groups (page_size not a multiple of
    4 * partition_size; QuantConfig allows 2 * partition_size multiples) keeps one packing group per trip."""
    return NUM_PLANES if page_size % (NUM_PLANES * partition_size) == 0 else num_planes(bits)


def trip_plane(tiles, j: int, plane_fn, *args, bits: int = 2, **kwargs) -> jax.Array:
    """Virtual plane j of a loop trip's code tiles (`blocks_per_trip`): plane j % C of tiles[j // C]
    (C = num_planes(bits)), i.e. block j of the trip. tiles: the trip's packing-group tiles in page order
    (one at 2 bits; two at 4 bits: rows [0, P) and [P, 2P) of the trip's K rows / V columns); plane_fn:
    `plane_int8_masked`, `folded_plane`, `interleaved_plane` or `denormal_plane`, called as
    plane_fn(tile, plane, *args, bits=bits, **kwargs)."""
    C = num_planes(bits)
    return plane_fn(tiles[j // C], j % C, *args, bits=bits, **kwargs)


def q_per_kv_pad(q_per_kv: int, *, at_least: int = 1) -> int:
    """Query heads per kv head rounded up to a power of two, at least `at_least` (decode: 4, so one
    program's R = 4 q_per_kv_pad rows >= 16; prefill: 1, rows are positions x padded heads)."""
    return max(at_least, _next_pow2(q_per_kv))


# Split-K programs per (sequence, kv head) from which combine_splits merges with its Pallas kernel. On the H200
# (bench/NOTES_decode.md, session 19, call 5: one process, means of two rows) it was faster than XLA's fusions of
# lse_combine with 43-47 programs (Llama batch 1 at 32K-128K: 21.2 vs 23.6 us a call at 1 x 32K) and slower with 6
# or fewer (batch 8: 98.8 vs 97.5 us at 8 x 32K, 12.3 vs 11.6 at 8 x 1K); 16 is a value between the two, not
# measured itself. COMBINE_MAX_PARTIALS caps the rows x query heads a program merges (the measured 64 x 4 = 256,
# in 32-channel blocks): more fall back to lse_combine, not measured.
PALLAS_COMBINE_MIN_PROGRAMS = 16
COMBINE_MAX_PARTIALS = 512


def _merge_in_kernel(programs: int, pad: int, head_dim: int) -> bool:
    """Whether combine_splits merges `programs` partials of q_per_kv_pad `pad` rows with its Pallas kernel."""
    return (programs >= PALLAS_COMBINE_MIN_PROGRAMS and head_dim == _next_pow2(head_dim)
            and _next_pow2(programs) * pad <= COMBINE_MAX_PARTIALS)


def split_slots(programs: int, pad: int, head_dim: int) -> int:
    """Rows along the programs axis of a split-K kernel's partial outputs (acc f32[S, H, rows, pad, head_dim]):
    `programs`, or where combine_splits merges them with its kernel `programs` rounded up to a power of two
    (Triton's block shapes), read as one block; rows past `programs` are never written (the kernel loads them
    with the rest and selects them away, never multiplying them)."""
    return _next_pow2(programs) if _merge_in_kernel(programs, pad, head_dim) else programs


def _combine_kernel(m_ref, l_ref, acc_ref, o_ref, *, programs):
    # m_ref, l_ref f32[SP, pad]; acc_ref f32[SP, pad, DC] (one (sequence, kv head), DC channels); rows >= programs
    # were never written: loaded, then selected away (not multiplied: they may hold NaN)
    valid = jax.lax.broadcasted_iota(jnp.int32, m_ref.shape, 0) < programs  # [SP, pad]
    m = jnp.where(valid, m_ref[...], -jnp.inf)
    l = jnp.where(valid, l_ref[...], 0.0)
    acc = jnp.where(valid[:, :, None], acc_ref[...], 0.0)
    m_max = jnp.max(m, axis=0)  # [pad]
    w = jnp.exp(m - jnp.where(m_max > -jnp.inf, m_max, 0.0)[None, :])  # [SP, pad]; 0 for empty states
    l_tot = jnp.sum(l * w, axis=0)
    acc_tot = jnp.sum(acc * w[:, :, None], axis=0)  # [pad, DC]
    safe = jnp.where(l_tot == 0, 1.0, l_tot)  # == 0, not > 0: a NaN total stays NaN
    o_ref[...] = jnp.where((l_tot == 0)[:, None], 0.0, acc_tot / safe[:, None])


def combine_splits(acc, m, l, num_q_heads: int, *, programs: int | None = None, interpret: bool = False):
    """Merge the split-K partials: acc f32[S, H, SP, q_per_kv_pad, D], m, l f32[S, H, SP, q_per_kv_pad], of
    which the first `programs` rows along SP hold states (None: all; SP = split_slots(...) lets the rest be
    unwritten) -> f32[S, Hq, D] (0 for rows that attended to nothing). Where `_merge_in_kernel` holds
    (PALLAS_COMBINE_MIN_PROGRAMS or more programs, D a power of two, SP * q_per_kv_pad <= COMBINE_MAX_PARTIALS)
    and SP is the programs rounded up to a power of two, one small Pallas kernel merges them (XLA ran
    `lse_combine` as four small kernels at Llama batch 1); otherwise `lse_combine`. ValueError if `programs`
    is outside [1, SP]."""
    batch, num_kv_heads, slots, pad, head_dim = acc.shape
    q_per_kv = num_q_heads // num_kv_heads
    programs = slots if programs is None else programs
    if not 1 <= programs <= slots:
        raise ValueError(f"programs must be in [1, {slots}] (the partials' rows), got {programs=}")
    if slots != _next_pow2(programs) or not _merge_in_kernel(programs, pad, head_dim):
        out = lse_combine(m[:, :, :programs], l[:, :, :programs], acc[:, :, :programs], axes=2)
    else:
        dc = min(head_dim, _next_pow2(8192 // (slots * pad) + 1) // 2)  # <= 8K partials a program, >= 16 channels
        out = pallas_call(
            functools.partial(_combine_kernel, programs=programs),
            out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, pad, head_dim), jnp.float32),
            grid=(batch, num_kv_heads, head_dim // dc),
            in_specs=[pl.BlockSpec((None, None, slots, pad), lambda b, h, c: (b, h, 0, 0)),
                      pl.BlockSpec((None, None, slots, pad), lambda b, h, c: (b, h, 0, 0)),
                      pl.BlockSpec((None, None, slots, pad, dc), lambda b, h, c: (b, h, 0, 0, c))],
            out_specs=pl.BlockSpec((None, None, pad, dc), lambda b, h, c: (b, h, 0, c)),
            num_warps=4, num_stages=1, interpret=interpret, name="combine_splits")(m, l, acc)
    return out[:, :, :q_per_kv].reshape(batch, num_q_heads, head_dim)


def full_spec(x):
    """BlockSpec of the whole array as one block (the kernels index the page pools themselves)."""
    # The whole array is one block: on Triton a pointer base, so whole page pools cost nothing (in
    # interpret mode every program copies them: keep CPU test pools tiny).
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


class StackedView(NamedTuple):
    """A layer's cache arrays as a kernel launch takes them (`stacked_view`)."""
    layer: tuple  # one layer's arrays (or ShapeDtypeStructs of their shapes): what the checks see
    flat: tuple  # the arrays the kernel gets: [num_layers * X, ...] (a free reshape of a stacked array)
    offsets: Any  # i32[2]: (first page, first sequence row) of the layer in `flat`; None: (0, 0)
    num_layers: int


def without_operand(kernel, index: int, present: bool):
    """`kernel` as a launch passes its refs when the operand at ref position `index` may be left out
    (`present` False): the kernel then gets None there (e.g. a StackedView's offsets of None, known zeros
    that would otherwise cost a launch of their own to materialize)."""
    if present:
        return kernel
    return lambda *refs: kernel(*refs[:index], None, *refs[index:])


def misaddressed(dtype, size: int) -> bool:
    """Whether the Pallas-Triton lowering would read a kernel operand of `size` elements of `dtype` at
    wrong addresses: it indexes operands of at most 2**32 bytes with 32-bit element offsets, which
    Triton's pointer arithmetic sign-extends, so a 1-byte array of more than 2**31 elements goes wrong
    past 2**31 (wider dtypes reach 2**32 bytes first, where 64-bit offsets start)."""
    return jnp.dtype(dtype).itemsize == 1 and 2**31 < size <= 2**32


def stacked_view(arrays, layer_index, *, batch: int) -> StackedView:
    """The kernel operands of layer `layer_index` of a stacked cache, read in place.

    arrays: a layer's cache arrays, the first a page pool (None entries, e.g. absent sinks, kept).
    layer_index None: they are one layer's own ([num_pages, ...], [batch, ...]); offsets None: the
    kernels then take no offsets operand and read zeros (a constant zeros operand would cost a launch of
    its own to materialize).
    Else an int or i32 scalar i: every array carries a leading num_layers axis L; each is viewed flat
    ([L * num_pages, ...], [L * batch, ...]: page p of layer i is flat page i * num_pages + p) and
    offsets = (i * num_pages, i * batch). A Python int gives constant offsets (no kernel; layer 0 keeps
    its zeros operand so that every layer of a stack runs one compiled kernel); an int
    outside [0, L) or arrays of different L raise ValueError, as does a 1-byte operand (u8 codes) of more
    than 2**31 and at most 2**32 bytes: Pallas-Triton indexes it with 32-bit offsets that Triton's pointer
    arithmetic sign-extends, so it would read the wrong bytes past 2**31 (measured on the H200:
    bench/probe_offsets.py; models.llama.cache_layout cuts such stacks into layer groups)."""
    for x in arrays:  # (non-arrays are left to the callers' own checks, which name them)
        if hasattr(x, "dtype") and hasattr(x, "size") and misaddressed(x.dtype, x.size):
            raise ValueError(f"a 1-byte cache array of {x.size} bytes ({tuple(x.shape)} {x.dtype}) is beyond "
                             f"what the Pallas-Triton kernels address correctly (2**31 < bytes <= 2**32): use "
                             f"fewer layers per stack (kv_cache.init_cache(group_layers=...)) or fewer pages")
    if layer_index is None:
        return StackedView(tuple(arrays), tuple(arrays), None, 1)
    present = [x for x in arrays if x is not None]
    if any(x.ndim < 2 or x.shape[0] != present[0].shape[0] for x in present):
        raise ValueError(f"with layer_index, every cache array needs the same leading num_layers axis, got "
                         f"{[tuple(x.shape) for x in present]}")
    num_layers, num_pages = present[0].shape[:2]
    if isinstance(layer_index, (int, np.integer)):
        if not 0 <= layer_index < num_layers:
            raise ValueError(f"layer_index must be in [0, {num_layers}), got {layer_index=}")
        offsets = np.array([layer_index * num_pages, layer_index * batch], np.int32)
    else:
        layer_index = jnp.asarray(layer_index)
        if layer_index.shape or not jnp.issubdtype(layer_index.dtype, jnp.integer):
            raise ValueError(f"layer_index must be an int or an integer scalar, got {layer_index.shape=} "
                             f"{layer_index.dtype=}")
        offsets = layer_index.astype(jnp.int32) * jnp.array([num_pages, batch], jnp.int32)
    per_layer = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[2:])
    return StackedView(tuple(map(per_layer, arrays)), tuple(map(flat, arrays)), offsets, num_layers)


def split_range(split, num_packing_groups, num_splits):
    """Packing groups [g_lo, g_hi) of program `split` out of a sequence's `num_packing_groups` (traced):
    split s takes [s n // S, (s + 1) n // S), so every split gets floor(n / S) or one more, whatever
    the sequence's length (a short sequence of a ragged batch is spread over all splits too), and
    split 0, which also takes the sinks and the open block, gets the fewest."""
    return split * num_packing_groups // num_splits, (split + 1) * num_packing_groups // num_splits


def kernel_q(q, config):
    """q as the HACK decode kernels take it: float32 for the subnormal planes (config.denormal). With a 16-bit
    q their code ran 35-50% slower on the H200 at pools under 4 GiB, with float32 8-15% faster than the magic
    planes (bench/NOTES_decode.md); outside the kernel the cast fuses into q's producer."""
    return q.astype(jnp.float32) if config.denormal else q


def load_q_rows(q_ref, b, h, *, q_per_kv, q_per_kv_pad, num_channel_groups, sm_scale, planes=NUM_PLANES,
                interleaved=False):
    """NP x f32[R, Pc]: q * sm_scale in the (plane j, head g) row layout, R = planes * q_per_kv_pad rows,
    gathered from q_ref float[S, Hq, D] (row (j, g) = query head h * q_per_kv + g; rows g >= q_per_kv are 0).
    interleaved: each channel group's channels in `interleave` order (to meet `interleaved_plane` K codes)."""
    R = planes * q_per_kv_pad
    Pc = q_ref.shape[-1] // num_channel_groups
    g = jax.lax.broadcasted_iota(jnp.int32, (R,), 0) % q_per_kv_pad
    head = h * q_per_kv + jnp.minimum(g, q_per_kv - 1)  # [R]

    def load(p):
        if not interleaved:
            return q_ref[b, head, pl.ds(p * Pc, Pc)]
        return q_ref[b, head[:, None], (p * Pc + interleaved_index(Pc))[None, :]]
    return [jnp.where((g < q_per_kv)[:, None], load(p).astype(jnp.float32) * sm_scale, 0.0)
            for p in range(num_channel_groups)]


def empty_state(rows, width, num_channel_groups):
    """(m, l, accs) of no keys: -inf, 0, num_channel_groups x zeros[rows, width]."""
    return (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(num_channel_groups)))


def sinks_and_open_block_state(q, open_k_ref, open_v_ref, sink_refs, b, h, kv_len, num_open, row_plane,
                               new_token=None):
    """Float32 attention over the sinks and the open block's num_open tokens (DESIGN.md: plain
    float attention on their 16-bit K/V), as one softmax part on the stream-0 rows (row_plane == 0);
    other rows get the empty state. Rows/tokens beyond the lengths are selected away (NaN-safe).

    q: NP x f32[R, Pc] (q * sm_scale); open_k_ref, open_v_ref: [S, H, W, D] (W: P or the window); sink_refs:
    (sink_k_ref, sink_v_ref) [S, H, ns, D] or (). new_token: None, or (k_row, v_row, open_row,
    sink_row): a token being written this step, NP x [Pc] each in the cache dtype, used in place of
    open-block row open_row / sink row sink_row (i32 scalars, -1: none), so the kernel that writes it
    never reads it back from memory. Returns (m [R], l [R], NP x acc [R, Pc]).
    """
    NP = len(q)
    R, Pc = q[0].shape
    P = open_k_ref.shape[2]
    ns = sink_refs[0].shape[2] if sink_refs else 0
    token = jax.lax.broadcasted_iota(jnp.int32, (P,), 0)
    open_ok = token < num_open  # [P]
    zero = jnp.zeros((), jnp.bfloat16)

    def open_rows(ref, new_rows, p):  # [P, Pc] of the open block, the new token in its row
        x = ref[b, h, :, pl.ds(p * Pc, Pc)]
        if new_token is not None:
            x = jnp.where((token == new_token[2])[:, None], new_rows[p][None, :], x)
        return jnp.where(open_ok[:, None], x.astype(jnp.bfloat16), zero)

    def sink_row(ref, new_rows, t, p):  # f32[Pc] of sink t, the new token if it is row t
        x = ref[b, h, t, pl.ds(p * Pc, Pc)]
        if new_token is not None:
            x = jnp.where(new_token[3] == t, new_rows[p], x)
        return jnp.where(t < kv_len, x.astype(jnp.float32), 0.0)

    new_k, new_v = (None, None) if new_token is None else new_token[:2]
    k_open = [open_rows(open_k_ref, new_k, p) for p in range(NP)]  # NP x bf16[P, Pc]
    logits = sum(f32_bf16_dot(q[p], k_open[p], trans_b=True) for p in range(NP))  # [R, P]
    logits = jnp.where(open_ok[None, :], logits, -jnp.inf)
    sink_logits, sink_v = [], []
    for t in range(ns):
        k_t = [sink_row(sink_refs[0], new_k, t, p) for p in range(NP)]  # NP x [Pc]
        sink_logits.append(jnp.where(t < kv_len, sum(jnp.sum(q[p] * k_t[p][None, :], axis=1) for p in range(NP)),
                                     -jnp.inf))  # [R]
        sink_v.append([sink_row(sink_refs[1], new_v, t, p) for p in range(NP)])  # NP x [Pc]
    m = jnp.max(logits, axis=1)
    for s_t in sink_logits:
        m = jnp.maximum(m, s_t)
    stream0 = row_plane == 0
    m = jnp.where(stream0, m, -jnp.inf)
    base = jnp.where(m > -jnp.inf, m, 0.0)
    w = jnp.where(stream0[:, None] & open_ok[None, :], jnp.exp(logits - base[:, None]), 0.0)  # [R, P]
    w_sinks = [jnp.where(stream0, jnp.exp(s_t - base), 0.0) for s_t in sink_logits]  # ns x [R]
    l = jnp.sum(w, axis=1) + sum(w_sinks, jnp.zeros((R,), jnp.float32))
    accs = []
    for p in range(NP):
        acc = f32_bf16_dot(w, open_rows(open_v_ref, new_v, p))  # [R, Pc]
        for w_t, v_t in zip(w_sinks, sink_v):
            acc = acc + w_t[:, None] * v_t[p][None, :]
        accs.append(acc)
    return m, l, tuple(accs)


def check_kivi_inputs(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                      sink_k, sink_v, page_indices, kv_lens, *, partition_size, num_sink_tokens, v_group=None,
                      window=None, bits=2):
    """Trace-time checks of shapes and dtypes against DESIGN.md's kivi layout; raises ValueError.
    v_group: channels per V / query group (None: partition_size), clamped to head_dim. window: the open
    region's tokens W (None: partition_size), a power-of-two multiple of it dividing page_size. bits: the
    code width (QuantConfig.bits, 2 or 4): k_codes has page_size // (8 // bits) rows per page, page_size
    read from v_scale. k_sums / v_sums may be None (a cache without code sums, QuantConfig.code_sums
    False): whether the kernel's mode may do without them is `require_code_sums`'s question."""
    P, ns = partition_size, num_sink_tokens
    for name, x in (("q", q), ("k_codes", k_codes), ("page_indices", page_indices), ("kv_lens", kv_lens)):
        if not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array (the kernels take a layer's arrays; hack_jax.attention "
                            f"unpacks a cache layer into them), got {type(x).__name__}")
    if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, num_q_heads, head_dim], got {q.shape=}, {q.dtype=}")
    batch, num_q_heads, head_dim = q.shape
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4 (QuantConfig.bits), got {bits=}")
    C = num_planes(bits)
    if k_codes.ndim != 4:
        raise ValueError(f"k_codes must be u8[num_pages, num_kv_heads, page_size // {C}, head_dim], got {k_codes.shape=}")
    num_pages, num_kv_heads, code_rows, _ = k_codes.shape
    page_size = C * code_rows
    rows = v_scale if k_sums is None else k_sums  # [num_pages, H, page_size, NP] both
    if getattr(rows, "ndim", 0) == 4 and rows.shape[2] != page_size and rows.shape[2] % code_rows == 0:
        held = 8 // (rows.shape[2] // code_rows)
        raise ValueError(f"k_codes has {code_rows} rows per page of page_size={rows.shape[2]} "
                         f"({'v_scale' if k_sums is None else 'k_sums'}): a {held}-bit cache "
                         f"(QuantConfig.bits={held}), but {bits=} was given")
    check_kivi_geometry(P, head_dim, page_size, planes=C)
    if not isinstance(ns, int) or ns < 0:
        raise ValueError(f"num_sink_tokens must be an int >= 0, got {num_sink_tokens=}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads must be a multiple of num_kv_heads, got {num_q_heads=}, {num_kv_heads=}")
    check_channel_group(v_group)
    W = window or P
    if (not isinstance(W, int) or isinstance(W, bool) or not is_pow2(W) or W % P or page_size % W):
        raise ValueError(f"window must be None or a power-of-two multiple of partition_size={P} dividing "
                         f"page_size={page_size}, got {window=}")
    bpp, Pc = page_size // P, min(v_group or P, head_dim)
    NP = head_dim // Pc
    expect = {
        "k_codes": ((num_pages, num_kv_heads, page_size // C, head_dim), (jnp.uint8,)),
        "v_codes": ((num_pages, num_kv_heads, head_dim, page_size // C), (jnp.uint8,)),  # token-major
        "k_scale": ((num_pages, num_kv_heads, bpp, head_dim), None),
        "k_min": ((num_pages, num_kv_heads, bpp, head_dim), None),
        "k_sums": ((num_pages, num_kv_heads, page_size, NP), (jnp.uint8, jnp.uint16)),
        "v_scale": ((num_pages, num_kv_heads, page_size, NP), None),
        "v_min": ((num_pages, num_kv_heads, page_size, NP), None),
        "v_sums": ((num_pages, num_kv_heads, bpp, head_dim), (jnp.uint8, jnp.uint16)),
        "open_k": ((batch, num_kv_heads, W, head_dim), None),
        "open_v": ((batch, num_kv_heads, W, head_dim), None),
        "sink_k": ((batch, num_kv_heads, ns, head_dim), None),
        "sink_v": ((batch, num_kv_heads, ns, head_dim), None),
    }
    arrays = dict(k_codes=k_codes, v_codes=v_codes, k_scale=k_scale, k_min=k_min, k_sums=k_sums,
                  v_scale=v_scale, v_min=v_min, v_sums=v_sums, open_k=open_k, open_v=open_v,
                  sink_k=sink_k, sink_v=sink_v)
    for name, (shape, dtypes) in expect.items():
        x = arrays[name]
        if x is None and (name.startswith("sink") and ns == 0 or name.endswith("sums")):
            continue
        if x is None or tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (DESIGN.md kivi layout), got "
                             f"{None if x is None else x.shape}")
        ok = (x.dtype in dtypes) if dtypes else jnp.issubdtype(x.dtype, jnp.floating)
        if not ok:
            raise ValueError(f"{name} has dtype {x.dtype}, expected {dtypes or 'a float dtype'}")
    if page_indices.ndim != 2 or page_indices.shape[0] != batch or page_indices.dtype != jnp.int32:
        raise ValueError(f"page_indices must be i32[{batch}, pages_per_seq], got {page_indices.shape=}, "
                         f"{page_indices.dtype=}")
    if kv_lens.shape != (batch,) or kv_lens.dtype != jnp.int32:
        raise ValueError(f"kv_lens must be i32[{batch}], got {kv_lens.shape=}, {kv_lens.dtype=}")


def require_code_sums(kernel: str, dot_dtype: str, k_sums, v_sums) -> None:
    """ValueError when `kernel`'s operand mode `dot_dtype` reads the code sums (the INT8 numerics' kappa and
    omega terms) and the cache holds none (k_sums / v_sums None: QuantConfig.code_sums False)."""
    if k_sums is None or v_sums is None:
        raise ValueError(f"{kernel}: dot_dtype={dot_dtype!r} reads the code sums (k_sums, v_sums), which this "
                         f"cache does not store (QuantConfig(code_sums=False)); use a folded dot dtype "
                         f"(dot_dtype='folded_f16' or 'folded_bf16') or a cache with QuantConfig(code_sums=True)")


def per_token_tiles(page_indices_ref, kv_lens_ref, pool_shape, *, block_k, num_splits):
    """The per-token decode kernels' (fp8, int8, int4 / turbo) walk over this program's share of its
    sequence: the sequence's block_k-token tiles shared out evenly between the splits (by its own
    length). pool_shape: (num_pages, page_size, ...) of the kv head's pools. Returns (kv_len, load, loop):
      load(ref, i): tile i of a pool [num_pages, page_size, W] -> [block_k, W], or of per-token
        metadata [num_pages, page_size] -> [block_k]; page ids outside [0, num_pages) read page 0.
      loop(step, carry): carry through step(masked, i, carry) over this split's tiles; masked is
        False for the tiles wholly before kv_len, True for the rest (whose tail must be masked).
    """
    num_pages, page_size = pool_shape[:2]
    kv_len = kv_lens_ref[0]
    num_blocks = pl.cdiv(kv_len, block_k)
    per_split = pl.cdiv(num_blocks, num_splits)
    start = jnp.minimum(pl.program_id(2) * per_split, num_blocks)
    end = jnp.minimum(start + per_split, num_blocks)
    full_end = jnp.clip(kv_len // block_k, start, end)

    def load(ref, i):
        if block_k > page_size:
            n = block_k // page_size
            ids = page_indices_ref[pl.ds(i * n, n)]
            ids = jnp.where((ids >= 0) & (ids < num_pages), ids, 0)
            return ref[ids].reshape((block_k,) + tuple(ref.shape[2:]))
        tok0 = i * block_k
        page = page_indices_ref[tok0 // page_size]
        page = jnp.where((page >= 0) & (page < num_pages), page, 0)
        offset = pl.multiple_of(tok0 % page_size, block_k)
        return ref[page, pl.ds(offset, block_k), :] if len(ref.shape) == 3 else ref[page, pl.ds(offset, block_k)]

    def loop(step, carry):
        carry = jax.lax.fori_loop(start, full_end, functools.partial(step, False), carry)
        return jax.lax.fori_loop(full_end, end, functools.partial(step, True), carry)

    return kv_len, load, loop


def per_token_paged_decode(kernel, q, arrays, page_indices, kv_lens, *, config, default_config, name, interpret,
                           codes_per_element: int = 1):
    """Launch of a decode kernel over per-(token, kv head) quantized pages (fp8, int8, int4, turbo): the shared shape
    checks, query grouping and page-table padding, one program per (sequence, kv head, split), and the
    split combine.

    kernel: the Pallas kernel taking (page_indices, kv_lens, q, *arrays, acc, m, l refs) with keywords
    block_k, num_splits, sm_scale. arrays: the cache arrays in the kernel's order, each
    [num_pages, num_kv_heads, page_size, head_dim // codes_per_element] (codes; int4 / turbo pack 2
    per byte), [num_pages, num_kv_heads, page_size] (per-token metadata) or 1-D (a table every
    program reads whole: turbo's codebook). config: bf16_decode_attention.KernelConfig (block_k,
    num_splits, warps, stages), or None for default_config(batch=, num_q_heads=, num_kv_heads=, head_dim=, page_size=, pages_per_seq=).
    q float[batch, num_q_heads, head_dim] -> f32[batch, num_q_heads, head_dim]. Raises ValueError on
    inconsistent shapes (head_dim, page_size, heads, page table, kv_lens)."""
    batch, num_q_heads, head_dim = q.shape
    codes_shape = arrays[0].shape[:3] + (arrays[0].shape[3] * codes_per_element,)
    stand_in = jax.ShapeDtypeStruct(codes_shape, jnp.bfloat16)  # the bf16 kernel's shape checks
    num_pages, num_kv_heads, page_size, _ = check_paged_bf16(head_dim, num_q_heads, batch, stand_in, stand_in,
                                                             page_indices)
    if kv_lens.shape != (batch,) or kv_lens.dtype != jnp.int32:
        raise ValueError(f"kv_lens must be i32[batch], got {kv_lens.shape=} {kv_lens.dtype=} ({batch=})")
    pages_per_seq = page_indices.shape[1]
    if config is None:
        config = default_config(batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq)
    group = num_q_heads // num_kv_heads
    block_h = max(16, pl.next_power_of_2(group))
    q_g = q.astype(jnp.bfloat16).reshape(batch, num_kv_heads, group, head_dim)
    q_g = jnp.pad(q_g, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
    kv_lens = jnp.clip(kv_lens, 0, pages_per_seq * page_size)
    if config.block_k > page_size:
        n = config.block_k // page_size
        page_indices = jnp.pad(page_indices, ((0, 0), (0, -pages_per_seq % n)))
    splits = config.num_splits
    pool = lambda x: pl.BlockSpec((num_pages, None, page_size, x.shape[3]), lambda b, h, s: (0, h, 0, 0))
    per_token = pl.BlockSpec((num_pages, None, page_size), lambda b, h, s: (0, h, 0))
    spec = lambda x: pool(x) if x.ndim == 4 else per_token if x.ndim == 3 else full_spec(x)
    acc_spec = pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, s: (b, h, s, 0, 0))
    row_spec = pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0))
    acc, m, l = pallas_call(
        functools.partial(kernel, block_k=config.block_k, num_splits=splits, sm_scale=1.0 / math.sqrt(head_dim)),
        grid=(batch, num_kv_heads, splits),
        in_specs=[pl.BlockSpec((None, page_indices.shape[1]), lambda b, h, s: (b, 0)),
                  pl.BlockSpec((1,), lambda b, h, s: (b,)),
                  pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0))]
                 + [spec(x) for x in arrays],
        out_specs=[acc_spec, row_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, num_kv_heads, splits, block_h, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, splits, block_h), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, splits, block_h), jnp.float32)],
        num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret, name=name,
    )(page_indices, kv_lens, q_g, *arrays)
    out = lse_combine(m[..., :group], l[..., :group], acc[..., :group, :], 2)
    return out.reshape(batch, num_q_heads, head_dim)
