"""QuantConfig: how the KV cache is stored (docs/DESIGN.md, "Cache and attention API")."""

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import jax.numpy as jnp

from hack_jax.quantization import MAX_CLIP

KVFormat = Literal["hack", "bf16", "float32", "int8", "fp8", "kivi2", "int4", "turbo3", "turbo4"]
ROTATED_FORMATS = ("int4", "turbo3", "turbo4")  # K and V rotated by QuantConfig.rotation
Layout = Literal["kivi", "seed"]
Rounding = Literal["nearest", "stochastic"]
CODE_BITS = (2, 4)  # QuantConfig.bits: code widths whose codes fill a byte exactly


@dataclass(frozen=True)
class QuantConfig:
    """Frozen, hashable (usable as a static jit argument) description of the KV cache format.

    Attributes:
      kv_format: "hack" (2-bit codes, or `bits`-bit, HACK.md), "bf16" / "float32" (unquantized), "int8" (per
        (token, kv head) asymmetric baseline, HACK.md §8), "fp8" (float8 e4m3 with a float32 scale
        per (token, kv head), vLLM's fp8), "kivi2" (KIVI-2: 2-bit K per channel over 32-token
        groups, V per token over 32-channel groups, a 16-bit residual of the newest tokens;
        hack_jax.kv_cache.kivi2; partition_size, num_sink_tokens and rounding do not apply),
        "int4" (SAW-INT4 style: K and V Hadamard-rotated, then asymmetric 4-bit per (token, kv head),
        hack_jax.kv_cache.int4), "turbo3" / "turbo4" (TurboQuant style: K and V rotated with random
        signs, then a 3- / 4-bit Lloyd-Max codebook per coordinate and one 16-bit scale per (token,
        kv head), hack_jax.kv_cache.turbo). These three: round to nearest, no sinks, no v_rotation.
      layout: "kivi" (K per channel, V per token; default, HACK.md §4) or "seed" (K per token,
        V per channel, as the paper describes).
      partition_size: P, tokens or channels per quantization partition; a power of two >= 16.
        kivi: the K token block (and the INT8 softmax-weight group); also the V channel group
        unless v_group is set.
      v_group: kivi only: channels per V quantization group (also the INT8 query group and the K
        code sums' channel group), min(v_group, head_dim) in effect; 0 = partition_size (the
        coupled default); else a power of two >= 16. `channel_group` is the value in effect.
      bits: kv_format="hack": the code width b of K and V, 2 (default) or 4; codes in [0, 2**b - 1],
        scale = (max - min) / (2**b - 1). A byte holds 8 // b codes, one per block of a packing
        group ("planes", hack_jax.packing). 3 is refused: 3-bit codes pack 2 per byte (the
        planar layout keeps whole codes of one block per plane, and 8 is no multiple of 3), so
        they would cost 4-bit bytes for 3-bit precision. `codes_per_byte` = 8 // bits.
      clip: kv_format="hack" only: 0 (default) = min-max scale and minimum; n in [2, 8] = per
        partition, of the n * n ranges [min + a w, max - b w] (w = max - min, a and b in {0, 0.05,
        ..., 0.05 (n - 1)}, min-max included) the one whose nearest codes reconstruct it with the
        least squared error (hack_jax.quantization.clip_grid), for K and V (rotated V with
        v_rotation), at every write (prefill, seal). Only (scale, min) change, so every reader and
        kernel is unchanged. Nearest rounding only. 5 is the measured choice (bench/NOTES_formats.md).
      page_size: tokens per cache page; a multiple of codes_per_byte * partition_size (one packing
        group: 4 blocks at 2 bits, 2 at 4 bits).
      num_sink_tokens: leading tokens kept in residual_dtype (>= 0).
      rounding: "nearest" or "stochastic" (HACK.md §2).
      v_rotation: 0 (off) or B, a power of two >= 2 dividing head_dim: V is multiplied by the
        block-diagonal normalized Hadamard(B) matrix before it is stored (every format, 16-bit
        parts included; no extra bytes) and the attention output by it again (hack_jax.rotation).
      window: kivi only: the 16-bit recent window W (KIVI's residual), tokens the open region holds;
        0 = partition_size (one open block, the default); else a multiple of partition_size that
        divides page_size. The newest u % W tokens after the sinks stay in residual_dtype; when the
        window fills, its W // P blocks are sealed at once (same P-token blocks in the pages).
        `open_window` is the value in effect.
      rotation: int4 / turbo only: block size B of the block-diagonal normalized Hadamard matrix
        both K and V are multiplied by before they are quantized (q by the same matrix, the output
        by its transpose: hack_jax.rotation); 0 = one block over the whole head_dim (a power of
        two), 1 = no Hadamard (turbo keeps its random signs); else a power of two dividing head_dim.
      code_sums: kv_format="hack", layout="kivi": True (default) stores the code sums of every sealed block
        (k_sums, kappa: per token and channel group; v_sums, omega: per block and channel), which only the
        INT8 numerics read (the Pallas decode kernel's dot_dtype "int8", the prefill kernel's "int8" /
        "bf16"); False stores none (KiviPages.k_sums / v_sums are None): the jnp reference derives them
        from the codes on read (exact integers, so its output is bit-identical), the folded dot dtypes
        (the model's decode path, hack_jax.backend.DECODE_DOT_DTYPE) never read them, and a kernel mode
        that needs them raises ValueError. Saves 8 * (sum bytes) / (K and V elements) bits per element
        (0.19 of 2.94 at K32 / V64, head_dim 64). layout="seed" keeps its sums (the paper's four-term
        identity on stored sums; no kernel reads that layout, so dropping them would save nothing run).
      meta_dtype: dtype of scale and minimum (class constant).
      residual_dtype: dtype of the open block and the sinks (class constant).

    Raises:
      ValueError naming the offending value when a field is out of its domain.
    """

    kv_format: KVFormat = "hack"
    layout: Layout = "kivi"
    partition_size: int = 64
    page_size: int = 256
    num_sink_tokens: int = 4
    rounding: Rounding = "nearest"
    v_rotation: int = 0
    v_group: int = 0
    window: int = 0
    rotation: int = 0
    bits: int = 2
    clip: int = 0
    code_sums: bool = True

    meta_dtype: ClassVar = jnp.float16
    residual_dtype: ClassVar = jnp.bfloat16

    def __post_init__(self):
        for name, literal in (("kv_format", KVFormat), ("layout", Layout), ("rounding", Rounding)):
            value = getattr(self, name)
            if value not in get_args(literal):
                raise ValueError(f"{name} must be one of {get_args(literal)}, got {value!r}")
        for name in ("partition_size", "page_size", "num_sink_tokens", "v_rotation", "v_group", "window",
                     "rotation", "bits", "clip"):
            value = getattr(self, name)
            # bool is an int subclass; True as a size is always a bug.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.bits not in CODE_BITS:
            why = " (3-bit codes would pack 2 per byte: 4-bit bytes for 3-bit precision)" if self.bits == 3 else ""
            raise ValueError(f"bits must be one of {CODE_BITS}, got bits={self.bits}{why}")
        if self.bits != 2 and self.kv_format != "hack":
            raise ValueError(f"bits applies to kv_format='hack' only, got kv_format={self.kv_format!r}, "
                             f"bits={self.bits}")
        if not isinstance(self.code_sums, bool):
            raise ValueError(f"code_sums must be a bool, got code_sums={self.code_sums!r}")
        if not self.code_sums and (self.kv_format, self.layout) != ("hack", "kivi"):
            raise ValueError(f"code_sums=False applies to kv_format='hack', layout='kivi' only (the other formats "
                             f"store no code sums; layout='seed' keeps its own), got kv_format={self.kv_format!r}, "
                             f"layout={self.layout!r}, code_sums=False")
        c = self.clip
        if c and not 2 <= c <= MAX_CLIP:
            raise ValueError(f"clip must be 0 (min-max) or an int in [2, {MAX_CLIP}], got clip={c}")
        if c and (self.kv_format != "hack" or self.rounding != "nearest"):
            raise ValueError(f"clip applies to kv_format='hack' with rounding='nearest' only, got "
                             f"kv_format={self.kv_format!r}, rounding={self.rounding!r}, clip={c}")
        p = self.partition_size
        if p < 16 or p & (p - 1):
            raise ValueError(f"partition_size must be a power of two >= 16, got {p=}")
        group = self.codes_per_byte * p
        if self.page_size <= 0 or self.page_size % group:
            raise ValueError(
                f"page_size must be a positive multiple of codes_per_byte * partition_size = {group} "
                f"(bits={self.bits}), got page_size={self.page_size}"
            )
        if self.num_sink_tokens < 0:
            raise ValueError(f"num_sink_tokens must be >= 0, got {self.num_sink_tokens}")
        g = self.v_group
        if g and (g < 16 or g & (g - 1)):
            raise ValueError(f"v_group must be 0 (= partition_size) or a power of two >= 16, got v_group={g}")
        if g and (self.kv_format, self.layout) != ("hack", "kivi"):
            raise ValueError(f"v_group applies to kv_format='hack', layout='kivi' only, got "
                             f"kv_format={self.kv_format!r}, layout={self.layout!r}, v_group={g}")
        w = self.window
        if w < 0 or (w and (w % p or self.page_size % w)):
            raise ValueError(f"window must be 0 (= partition_size) or a positive multiple of partition_size={p} "
                             f"that divides page_size={self.page_size}, got window={w}")
        if w and (self.kv_format, self.layout) != ("hack", "kivi"):
            raise ValueError(f"window applies to kv_format='hack', layout='kivi' only, got "
                             f"kv_format={self.kv_format!r}, layout={self.layout!r}, window={w}")
        b = self.v_rotation
        if b and (b < 2 or b & (b - 1)):
            raise ValueError(f"v_rotation must be 0 (off) or a power of two >= 2, got v_rotation={b}")
        r = self.rotation
        if r < 0 or r & (r - 1):
            raise ValueError(f"rotation must be 0 (= head_dim) or a power of two >= 1, got rotation={r}")
        if r and self.kv_format not in ROTATED_FORMATS:
            raise ValueError(f"rotation applies to kv_format in {ROTATED_FORMATS} only, got "
                             f"kv_format={self.kv_format!r}, rotation={r}")
        if self.kv_format in ROTATED_FORMATS and (b or self.rounding != "nearest"):
            raise ValueError(f"kv_format={self.kv_format!r} rotates K and V itself (rotation=) and rounds to "
                             f"nearest: got v_rotation={b}, rounding={self.rounding!r}")

    @property
    def codes_per_byte(self) -> int:
        """Codes per packed byte = blocks per packing group: 8 // bits (4 at 2 bits, 2 at 4 bits)."""
        return 8 // self.bits

    @property
    def channel_group(self) -> int:
        """Channels per channel group before the head_dim clamp: v_group, or partition_size when 0."""
        return self.v_group or self.partition_size

    @property
    def open_window(self) -> int:
        """Tokens the 16-bit open region holds (2-bit formats): window, or partition_size when 0."""
        return self.window or self.partition_size

    def sealed_blocks(self, u):
        """Sealed P-token blocks of a sequence holding u tokens after its sinks (int or array):
        (u // W) * (W // P), W = open_window; the other u % W tokens are open (16-bit)."""
        w = self.open_window
        return (u // w) * (w // self.partition_size)
