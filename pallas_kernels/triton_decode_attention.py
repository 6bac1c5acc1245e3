"""HACK decode attention on the paged INT2 kivi cache as a Triton kernel (jax-triton), scale-folded.

What it computes: one query token per sequence attends over its paged cache (DESIGN.md "Homomorphic
attention semantics", layout="kivi") with the *scale-folded* transient operands instead of the
paper's INT8 requantization: for sealed block b with K ~ sigma_b * k + mu_b (per channel) and
V ~ tau_j * v + nu_j (per token and channel group),
  logit_j = dot(f16(q_s * sigma_b), k_j) + q_s . mu_b            (k_j the 2-bit codes, exact in f16)
  o       = dot(f16(W * tau), v) + sum_j W_j nu_j,  l = sum_j W_j (W the float32 softmax weights)
where q_s = q / sqrt(head_dim). Only the f16 roundings of q_s*sigma and W*tau differ from exact
dequantize-then-attend; no per-block min/max, no rounding to INT8, and the code sums (k_sums,
v_sums) are not read. Sinks and the 16-bit open block: float32 attention on their bf16 K/V. One
online softmax per stream, merged exactly (log-sum-exp). Nothing is dequantized.

Shapes (DESIGN.md "Paged cache layout"; P = partition_size, Pc = min(P, head_dim), NP = head_dim // Pc,
bpp = page_size // P, S = batch, ns = num_sink_tokens; the same arrays as
pallas_kernels.decode_attention.hack_decode_attention, whose call forms this function copies):
  q          float[S, num_q_heads, head_dim]          -> out f32[S, num_q_heads, head_dim]
  k_codes    u8[num_pages, num_kv_heads, page_size // 4, head_dim]   (planar per packing group of 4 blocks)
  k_scale, k_min  f16[num_pages, num_kv_heads, bpp, head_dim]
  v_codes    u8[num_pages, num_kv_heads, head_dim, page_size // 4]   (token-major)
  v_scale, v_min  f16[num_pages, num_kv_heads, page_size, NP]
  k_sums, v_sums  validated, not read (None: a cache without code sums)
  open_k, open_v  bf16[S, num_kv_heads, P, head_dim];  sink_k, sink_v  bf16[S, num_kv_heads, ns, head_dim]
  page_indices i32[S, pages_per_seq];  kv_lens i32[S] (sinks + sealed + open tokens)

Kernel structure (pallas_kernels/triton_decode_kernel.py). Grid (S, num_kv_heads, num_splits + 1): one
program serves all G query heads of a kv head (GQA). Programs 0..num_splits-1 take contiguous ranges of
packing groups (4 blocks: one u8[P, head_dim] K tile, one u8[head_dim, P] V tile per channel group);
program num_splits takes the sinks and the open block alone. Within a program the 4 blocks of a packing group
are the batch axis of 3-D dots (tl.dot on [4, M, K] x [4, K, N]); Triton puts one warp on each (mma
warpsPerCTA [4, 1, 1]), so every block has its own warp and its own online softmax (stream j = block j
of each group), with no cross-warp reduction in the loop; the 4 streams are merged once at the end and
the programs by a log-sum-exp in jnp (common.lse_combine). The products are transposed (tokens or
channels as M, the G query heads as N): the K codes [P, head_dim] and V codes [Pc, P] are the A
operands in their stored orientation and the softmax weights [P, G] are PV's B operand as they come.
Codes become f16 by inline PTX (AND + PRMT under the exponent byte 0x64 + sub.f16x2, 5 instructions per 4
codes, no int-to-float convert), as code * 4**j; the 4**-j goes into the FMA after the dot. The plane
j is the warp's index, so the unpack's only operand is the loaded tile (broadcast over the planes):
Triton copies each u8 tile once into shared memory, loads it from there straight into the MMA operand
layout of every warp and unpacks in registers (no 16-bit round trip through shared memory). The exp is exp2 with log2(e) folded into q; num_stages 2 double-buffers the tile
loads with cp.async.

Measured on one NVIDIA H200 (jax 0.11.2, Triton 3.6, jax-triton 0.3.1; Llama-3.1-8B heads): the gpu
tests of tests/test_triton_decode.py pass; this first version is 1.5-4x slower than the Pallas HACK
kernel with the same folded operands (pallas_kernels.decode_attention, dot_dtype="folded_f16"), so
impl="triton" stays an experiment. Timings and the offline SASS budget (registers, instructions per
block): bench/NOTES_triton.md.

Caveats: head_dim <= 2 * partition_size (NP <= 2: Llama, SmolLM2); num_warps 4 only: the inline PTX
takes the plane from the warp index, which holds because Triton lays these 3-D dots out with
warpsPerCTA [4, 1, 1] (tests/test_triton_decode.py checks the compiled TTGIR); f16 operands overflow if
|q_s * sigma| or |W * tau| exceeds 65504 (far from real caches), and lose relative precision below
6e-5 (f16 subnormals; such terms are < 6e-5 of a logit or of a weight); the inline PTX needs a CUDA
GPU (unpack_asm=False uses Triton integer ops, same values); each warp reads the whole u8 tile of
its group from shared memory (it needs one plane of it); jax-triton 0.3.1 passes no `maxnreg`, so the
register count (not shared memory) caps it at 2 programs per SM; page ids outside
[0, num_pages) read page 0 (the null page); kv_lens beyond the capacity are clipped to it, as
hack_jax.kv_cache.read_blocks does.

Reference twin: dequantize-then-attend in float64, tests/test_triton_decode.py::numpy_folded_decode
(the float64 attention over sigma*k + mu, tau*v + nu and the 16-bit tokens; the kernel differs from
it only by the two f16 roundings and float32 order). Launch needs jax_triton (the `cuda` extra) and a
CUDA GPU; the host-side functions below import neither.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import common


NUM_PLANES = 4
H200_NUM_SMS = 132
# 4 warps x 255 registers (ptxas, sm_90, Triton 3.6, offline) -> 2 programs in an SM's 64K registers
# (shared memory, 22 KiB per program, would allow 9).
RESIDENT_PROGRAMS_PER_SM = 2


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """num_splits: programs over the sealed blocks per (sequence, kv head) (+ 1 for sinks and the open
    block); num_warps: 4 (one per block of a packing group); num_stages: Triton's software
    pipelining of the tile loads (1: none, 18 KiB shared; 2: cp.async double buffer, 22 KiB; 3);
    unpack_asm: the inline-PTX unpack (False: Triton integer ops, e.g. for Triton's interpreter)."""
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    unpack_asm: bool = True


def choose_num_splits(num_pairs: int, num_packing_groups: int, slots: int) -> int:
    """Splits per (sequence, kv head) minimizing waves x (ceil(groups / splits) + 1): waves =
    ceil(num_pairs * splits / slots) over the programs that take sealed blocks (the grid launches them
    first; the sinks-and-open-block programs, about one group of work each, take the slots they free),
    + 1 on the work for a program's fixed cost. Ties go to fewer splits. H200, 8 kv heads: batch 8 /
    32K tokens (128 groups) -> 4 splits (256 programs of 32 groups, one wave); batch 1 / 32K -> 32."""
    best, best_cost = 1, None
    for s in range(1, max(1, num_packing_groups) + 1):
        cost = -(-num_pairs * s // slots) * (-(-num_packing_groups // s) + 1)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def default_config(*, batch: int, num_kv_heads: int, pages_per_seq: int, page_size: int,
                   partition_size: int, num_sms: int = H200_NUM_SMS) -> KernelConfig:
    """The config for a launch shape: num_splits by choose_num_splits over one wave of
    RESIDENT_PROGRAMS_PER_SM * num_sms programs."""
    groups = max(1, pages_per_seq * page_size // (NUM_PLANES * partition_size))
    splits = choose_num_splits(batch * num_kv_heads, groups, RESIDENT_PROGRAMS_PER_SM * num_sms)
    return KernelConfig(num_splits=splits)


def kernel_constants(*, num_q_heads: int, num_kv_heads: int, head_dim: int, partition_size: int,
                     page_size: int, pages_per_seq: int, num_pages: int, num_sink_tokens: int,
                     num_splits: int, unpack_asm: bool) -> dict:
    """The kernel's constexpr arguments (also used by the offline compile, bench/triton_offline.py)."""
    q_per_kv = num_q_heads // num_kv_heads
    pc = min(partition_size, head_dim)
    return dict(NUM_KV_HEADS=num_kv_heads, Q_PER_KV=q_per_kv, Q_PER_KV_PAD=_next_pow2(q_per_kv), HEAD_DIM=head_dim,
                P=partition_size, PC=pc, NP=head_dim // pc, PAGE_SIZE=page_size, PAGES_PER_SEQ=pages_per_seq,
                NUM_PAGES=num_pages, NS=num_sink_tokens, NS_PAD=max(16, _next_pow2(num_sink_tokens)),
                NUM_SPLITS=num_splits, QK_SCALE=math.log2(math.e) / math.sqrt(head_dim),
                USE_ASM=bool(unpack_asm))


def combine(acc, m2, l, num_q_heads: int):
    """Programs' partial states -> output: acc f32[S, H, programs, GP, D], m2 (base-2 max), l
    f32[S, H, programs, GP] -> f32[S, Hq, D] (0 where nothing was attended)."""
    batch, num_kv_heads, _, _, head_dim = acc.shape
    out = common.lse_combine(m2 * math.log(2.0), l, acc, axes=2)  # [S, H, GP, D]
    q_per_kv = num_q_heads // num_kv_heads
    return out[:, :, :q_per_kv].reshape(batch, num_q_heads, head_dim)


def out_shapes(batch: int, num_kv_heads: int, num_splits: int, q_per_kv_pad: int, head_dim: int):
    """ShapeDtypeStructs of the kernel's outputs (acc, m, l)."""
    rows = (batch, num_kv_heads, num_splits + 1, q_per_kv_pad)
    return (jax.ShapeDtypeStruct(rows + (head_dim,), jnp.float32), jax.ShapeDtypeStruct(rows, jnp.float32),
            jax.ShapeDtypeStruct(rows, jnp.float32))


@functools.partial(jax.jit, static_argnames=("partition_size", "num_sink_tokens", "config"))
def _triton_decode(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, open_k, open_v, sink_k, sink_v,
                   page_indices, kv_lens, *, partition_size, num_sink_tokens, config):
    import jax_triton  # the `cuda` extra; imported here so the module loads without it

    from pallas_kernels.triton_decode_kernel import hack_triton_decode_kernel
    batch, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, quarter, _ = k_codes.shape
    consts = kernel_constants(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              partition_size=partition_size, page_size=4 * quarter,
                              pages_per_seq=page_indices.shape[1], num_pages=num_pages,
                              num_sink_tokens=num_sink_tokens, num_splits=config.num_splits,
                              unpack_asm=config.unpack_asm)
    if num_sink_tokens == 0:  # never read (NS = 0): any bf16 buffer will do
        sink_k = sink_v = open_k
    acc, m2, l = jax_triton.triton_call(
        kv_lens, page_indices, q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, open_k, open_v, sink_k,
        sink_v, kernel=hack_triton_decode_kernel,
        out_shape=out_shapes(batch, num_kv_heads, config.num_splits, consts["Q_PER_KV_PAD"], head_dim),
        grid=(batch, num_kv_heads, config.num_splits + 1), num_warps=config.num_warps,
        num_stages=config.num_stages, name="hack_triton_decode", **consts)
    return combine(acc, m2, l, num_q_heads)


def check_supported(q, *, partition_size: int, config: KernelConfig) -> None:
    """What this kernel adds to common.check_kivi_inputs: ValueError for head_dim > 2 *
    partition_size or a bad config."""
    head_dim = q.shape[-1]
    if head_dim > 2 * partition_size:
        raise ValueError(f"the triton kernel needs head_dim <= 2 * partition_size (at most 2 channel groups), "
                         f"got head_dim={head_dim}, {partition_size=}")
    n = config.num_splits
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"num_splits must be a positive int, got num_splits={n!r}")
    if config.num_warps != NUM_PLANES:
        raise ValueError(f"num_warps must be {NUM_PLANES} (one warp per block of a packing group), got "
                         f"{config.num_warps=}")
    if config.num_stages not in (1, 2, 3):
        raise ValueError(f"num_stages must be 1, 2 or 3, got {config.num_stages=}")


def hack_triton_decode_attention(q, k_codes, k_scale=None, k_min=None, k_sums=None, v_codes=None,
                                 v_scale=None, v_min=None, v_sums=None, open_k=None, open_v=None,
                                 sink_k=None, sink_v=None, page_indices=None, kv_lens=None, *,
                                 partition_size: int | None = None, num_sink_tokens: int | None = None,
                                 num_splits: int | None = None, config: KernelConfig | None = None, bits: int = 2):
    """Scale-folded HACK decode attention over the paged INT2 kivi cache (module docstring).

    Arrays and static ints only, as pallas_kernels.decode_attention.hack_decode_attention (the one place
    that unpacks a cache layer into them is hack_jax.attention):
      hack_triton_decode_attention(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums,
                                   open_k, open_v, sink_k, sink_v, page_indices, kv_lens,
                                   partition_size=P, num_sink_tokens=ns, ...)

    Args:
      q: float[batch, num_q_heads, head_dim] (float32 / bfloat16 / float16), sm_scale 1/sqrt(d) applied
        here. Cache arrays, page_indices, kv_lens: DESIGN.md kivi layout; sink_k/sink_v may be None when
        num_sink_tokens == 0.
      partition_size: P; num_sink_tokens: ns.
      num_splits: split-K programs per (sequence, kv head); overrides the config's.
      config: KernelConfig; None picks default_config(...).
      bits: the cache's code width (QuantConfig.bits); only 2 (NotImplementedError otherwise).

    Returns:
      f32[batch, num_q_heads, head_dim]; rows with kv_lens = 0 are 0.

    Raises:
      ValueError: shapes/dtypes off the layout, unsupported sizes (head_dim > 2 * partition_size),
        bad num_splits or config.
    """
    common.require_2bit("hack_triton_decode_attention", bits)
    if partition_size is None or num_sink_tokens is None:
        raise ValueError(f"partition_size and num_sink_tokens are required, got {partition_size=}, "
                         f"{num_sink_tokens=}")
    page_indices, kv_lens = common.as_index_arrays(page_indices, kv_lens)
    common.check_kivi_inputs(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                             sink_k, sink_v, page_indices, kv_lens, partition_size=partition_size,
                             num_sink_tokens=num_sink_tokens)
    if config is None:
        config = default_config(batch=q.shape[0], num_kv_heads=k_codes.shape[1],
                                pages_per_seq=page_indices.shape[1], page_size=4 * k_codes.shape[2],
                                partition_size=partition_size)
    if num_splits is not None:
        config = dataclasses.replace(config, num_splits=num_splits)
    check_supported(q, partition_size=partition_size, config=config)
    if num_sink_tokens == 0:
        sink_k = sink_v = None
    return _triton_decode(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, open_k, open_v, sink_k, sink_v,
                          page_indices, kv_lens, partition_size=partition_size, num_sink_tokens=num_sink_tokens,
                          config=config)
