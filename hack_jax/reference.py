"""Pure-jnp attention references: dense float attention and HACK's homomorphic attention on codes.

This module is the twin the Pallas kernels are tested against (docs/DESIGN.md, "Homomorphic attention
semantics", implemented exactly; HACK.md §3-§5). Everything is float32 inside and jit-able.

  dense_attention_reference        float attention, GQA, causal, ragged kv_lens (tier (c) target)
  quantize_kv_reference            K/V of whole sequences -> QuantizedKV, the codes a cache holds
  dequantize_kv_reference          QuantizedKV -> float32 K/V (the same codes, dequantized)
  quantized_kv_attention_reference attention computed on the codes of a QuantizedKV
  homomorphic_attention_reference  quantize_kv_reference + quantized_kv_attention_reference
  dequantized_attention_reference  quantize_kv_reference + dequantize + dense (tier (b) / (c) baseline)

The per-segment steps are public so a paged cache can run the same math on codes read from pages:
each one is unbatched (one sequence, one kv head, one segment; vmap over the rest) and returns a
SoftmaxState relative to its own segment-local max; online_softmax_merge folds states together and
softmax_state_output normalizes.

  kivi_block_attention_step, seed_block_attention_step   one sealed block of P tokens
  seed_open_block_attention_step                          seed's open block (quantized K, 16-bit V)
  float_attention_step                                    sinks, kivi's open block (16-bit K and V)

Conventions shared by all functions here:
  - Query rows: for kv head h the rows are r = t * G + g (t = query position index, g = head in
    the GQA group, G = num_q_heads // num_kv_heads), query head h * G + g.
  - q_s = q * sm_scale (float32) is the query every step takes; sm_scale defaults to 1/sqrt(head_dim).
  - P = partition_size; Pc = min(P, head_dim) channels per channel group; NP = head_dim // Pc groups.
  - Token segments of a sequence of length n (num_sink_tokens = ns): sinks [0, ns); sealed blocks
    k = 0 .. (n - ns) // P - 1 covering [ns + k P, ns + (k + 1) P); the open block, the rest.
  - Transient operands (Q, softmax weights) are quantized to INT8 with hack_jax.quantization.quantize
    (nearest, float32 metadata, folded minimum): their codes come from that one function, so a kernel
    matches them code for code only if it repeats its arithmetic (see quantize's docstring).
  - Float32 results depend on the evaluation order at the ulp level (XLA fuses the one-call entry
    point differently from its two halves: ~1e-7 relative), so a transient INT8 code sitting at a
    rounding tie can differ by one between this reference and a kernel: compare with a tolerance.
  - sm_scale is a static Python number (None: 1/sqrt(head_dim)); causal, layout, partition_size,
    num_sink_tokens, rounding, meta_dtype are static too. Stochastic rounding with a default
    (threefry) key compiles slowly on CPU (~10 s per quantize call site); tests use "rbg" keys.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hack_jax.config import QuantConfig
from hack_jax.homomorphic import homomorphic_matmul
from hack_jax.quantization import QuantizedTensor, quantize

LAYOUTS = ("kivi", "seed")
ROUNDINGS = ("nearest", "stochastic")
RESIDUAL_DTYPE = QuantConfig.residual_dtype  # sinks and open block (bfloat16)

_HIGHEST = jax.lax.Precision.HIGHEST  # float einsums: no TF32 on GPU, the reference must be float32


# ----------------------------------------------------------------------------------------------
# Online softmax state (HACK.md §5)
# ----------------------------------------------------------------------------------------------


class SoftmaxState(NamedTuple):
    """Partial attention over some keys, relative to the max m of their logits.

    acc: f32[..., rows, head_dim]  sum_j w_j V_j with w_j = exp(logit_j - m) (or its INT8 image).
    m:   f32[..., rows]            max logit seen; -inf when no key was visible.
    l:   f32[..., rows]            sum_j w_j (the denominator that goes with acc).
    """

    acc: jax.Array
    m: jax.Array
    l: jax.Array


def empty_softmax_state(shape, head_dim):
    """The state of no keys: acc 0, m -inf, l 0; shape = the leading shape [..., rows]."""
    return SoftmaxState(jnp.zeros((*shape, head_dim), jnp.float32),
                        jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32))


def online_softmax_merge(a, b):
    """Merges two SoftmaxStates over disjoint key sets (FlashAttention / split-K combine, HACK.md §5).

    m = max(a.m, b.m); acc = a.acc exp(a.m - m) + b.acc exp(b.m - m); l likewise. States with
    m = -inf (no visible key) contribute nothing, and two of them give an empty state, without NaN.
    Shapes as in SoftmaxState, broadcast-compatible leading axes.
    """
    m = jnp.maximum(a.m, b.m)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # keeps exp(-inf - (-inf)) = NaN out
    ca, cb = jnp.exp(a.m - m_safe), jnp.exp(b.m - m_safe)
    return SoftmaxState(a.acc * ca[..., None] + b.acc * cb[..., None], m, a.l * ca + b.l * cb)


def softmax_state_output(state):
    """acc / l: f32[..., rows, head_dim]; rows with l == 0 (nothing visible) give 0."""
    denom = state.l[..., None]
    return jnp.where(denom > 0, state.acc / jnp.where(denom > 0, denom, 1.0), 0.0)


def _block_weights(logits, mask):
    """Segment-local softmax weights (DESIGN.md step 2): f32[rows, n] W in [0, 1], f32[rows] max.

    The max is over visible keys only and W = 0 for masked keys; a row with no visible key gets
    m = -inf and W = 0 (no NaN: the exp uses a finite stand-in max).
    """
    m = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, initial=-jnp.inf)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    return jnp.where(mask, jnp.exp(logits - m_safe[:, None]), 0.0), m


def _int_dot(spec, a, b):
    """Exact integer einsum of code arrays (int32 accumulate, HACK.md §3 term (1))."""
    return jnp.einsum(spec, a.astype(jnp.int32), b.astype(jnp.int32), preferred_element_type=jnp.int32)


def _f32(x):
    return jnp.asarray(x).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Per-segment steps (unbatched: one sequence, one kv head, one segment)
# ----------------------------------------------------------------------------------------------


def float_attention_step(q_s, k, v, mask):
    """Plain float32 attention over 16-bit keys (sinks; kivi's open block), DESIGN.md last paragraph.

    Args:
      q_s: f32[rows, head_dim], queries already multiplied by sm_scale.
      k, v: float[n, head_dim] (as stored: bf16 for the cache; computed in float32).
      mask: bool[rows, n], True where key j is visible to row r.

    Returns:
      SoftmaxState with acc f32[rows, head_dim], m, l f32[rows] (m = -inf, l = 0 for rows that see
      nothing).
    """
    logits = jnp.einsum("rd,jd->rj", _f32(q_s), _f32(k), precision=_HIGHEST)
    w, m = _block_weights(logits, mask)
    return SoftmaxState(jnp.einsum("rj,jd->rd", w, _f32(v), precision=_HIGHEST), m, w.sum(-1))


def kivi_block_attention_step(q_s, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums,
                              mask):
    """One sealed block of the kivi layout, on codes only (DESIGN.md steps 1-3, HACK.md §4 "kivi").

    K_jc ~ sigma_c k_jc + mu_c (per channel over the block); V_jc ~ tau_jp v_jc + nu_jp (per token
    over channel groups p of Pc channels).

    1. Qt = q_s * sigma, INT8 per (row, channel group) -> (s_p, m_p, qc);
       logit_j = sum_p [ s_p sum_{c in p} qc_c k_jc + m_p kappa_jp ] + q_s . mu.
    2. mb = max of visible logits, W_j = exp(logit_j - mb) (0 where masked).
    3. Wt_jp = W_j tau_jp, INT8 per (row, p) over the P tokens -> (s'_p, m'_p, wc);
       o_c = s'_p sum_j wc_jp v_jc + m'_p omega_c + sum_j W_j nu_jp (c in p); lb = sum_j W_j.

    Args:
      q_s: f32[rows, head_dim], queries times sm_scale.
      k_codes: u8[P, head_dim] 2-bit codes (unpacked), k_scale/k_min: float[head_dim] (sigma, mu).
      k_sums: int[P, NP], kappa_jp = sum of k_codes over channel group p.
      v_codes: u8[P, head_dim], v_scale/v_min: float[P, NP] (tau, nu).
      v_sums: int[head_dim], omega_c = sum of v_codes over the block's tokens.
      mask: bool[rows, P] visible keys (causal / length); masked keys get W = 0 but still take part
        in the INT8 quantization of Wt, as in a kernel that loads the whole block.

    Returns:
      SoftmaxState: acc f32[rows, head_dim] (unnormalized, relative to mb), m = mb f32[rows]
      (-inf when the block is invisible to the row), l = lb f32[rows].
    """
    rows, head_dim = q_s.shape
    block, num_groups = k_sums.shape
    group = head_dim // num_groups
    q_s, sigma, mu = _f32(q_s), _f32(k_scale), _f32(k_min)

    qt = quantize(q_s * sigma, bits=8, axis=1, partition_size=group, meta_dtype=jnp.float32)
    dot = _int_dot("rpc,jpc->rjp", qt.codes.reshape(rows, num_groups, group),
                   k_codes.reshape(block, num_groups, group))  # [rows, P, NP]
    logits = (qt.scale[:, None, :] * _f32(dot) + qt.minimum[:, None, :] * _f32(k_sums)[None]).sum(-1)
    logits = logits + jnp.einsum("rc,c->r", q_s, mu, precision=_HIGHEST)[:, None]  # [rows, P]

    w, mb = _block_weights(logits, mask)
    wt = quantize(w[:, :, None] * _f32(v_scale)[None], bits=8, axis=1, partition_size=block,
                  meta_dtype=jnp.float32)  # codes [rows, P, NP]; scale, minimum [rows, 1, NP]
    pv = _int_dot("rjp,jpc->rpc", wt.codes, v_codes.reshape(block, num_groups, group))  # [rows, NP, Pc]
    nu_term = jnp.einsum("rj,jp->rp", w, _f32(v_min), precision=_HIGHEST)  # float W: exact for constant V
    acc = (wt.scale[:, 0, :, None] * _f32(pv)
           + wt.minimum[:, 0, :, None] * _f32(v_sums).reshape(num_groups, group)[None]
           + nu_term[:, :, None])
    return SoftmaxState(acc.reshape(rows, head_dim), mb, w.sum(-1))


def seed_logits(q_s, k_codes, k_scale, k_min, k_sums):
    """Seed-layout logits by the four-term identity (HACK.md §3 eq. (1)-(4), §4 "seed").

    Q is quantized INT8 per (row, channel group of Pc channels), float32 metadata, nearest; K is
    2-bit per token over channel groups. Equals dequant(Q) @ dequant(K)^T up to float32 rounding.

    Args:
      q_s: f32[rows, head_dim]; k_codes: u8[n, head_dim]; k_scale, k_min: float[n, NP];
      k_sums: int[n, NP] (per token and channel group, HACK's beta).

    Returns:
      f32[rows, n].
    """
    num_groups = k_sums.shape[-1]
    group = q_s.shape[-1] // num_groups
    qq = quantize(_f32(q_s), bits=8, axis=1, partition_size=group, meta_dtype=jnp.float32)
    kt = QuantizedTensor(codes=k_codes.T, scale=k_scale.T, minimum=k_min.T, code_sums=k_sums.T,
                         bits=2, axis=0, partition_size=group)  # K^T: [head_dim, n] along axis 0
    return homomorphic_matmul(qq, kt)


def seed_block_attention_step(q_s, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums,
                              mask):
    """One sealed block of the seed layout, on codes only (DESIGN.md "layout='seed'", HACK.md §4).

    Logits by seed_logits; block-local W as in the kivi step; W quantized INT8 per row over the
    block's P tokens (float32 metadata, nearest) -> (s, m, wc, alpha = sum_j wc_j);
    o = dequant(W) @ dequant(V) by the four-term identity; lb = s alpha + P m = sum_j dequant(W)_j,
    the same quantized weights as the numerator, so constant V is returned exactly.

    Args:
      q_s: f32[rows, head_dim].
      k_codes: u8[P, head_dim]; k_scale, k_min: float[P, NP]; k_sums: int[P, NP] (per token, group).
      v_codes: u8[P, head_dim]; v_scale, v_min: float[head_dim] (per channel over the block);
      v_sums: int[head_dim] (sum of v_codes over the block's tokens).
      mask: bool[rows, P].

    Returns:
      SoftmaxState: acc f32[rows, head_dim], m f32[rows] (-inf if nothing visible), l f32[rows].
    """
    block = k_codes.shape[0]
    logits = seed_logits(q_s, k_codes, k_scale, k_min, k_sums)  # [rows, P]
    w, mb = _block_weights(logits, mask)
    wq = quantize(w, bits=8, axis=1, partition_size=block, meta_dtype=jnp.float32)  # scale [rows, 1]
    vq = QuantizedTensor(codes=v_codes, scale=v_scale[None], minimum=v_min[None], code_sums=v_sums[None],
                         bits=2, axis=0, partition_size=block)
    acc = homomorphic_matmul(wq, vq)  # [rows, head_dim]
    lb = wq.scale[:, 0] * _f32(wq.code_sums[:, 0]) + block * wq.minimum[:, 0]
    return SoftmaxState(acc, mb, lb)


def seed_open_block_attention_step(q_s, k_codes, k_scale, k_min, k_sums, v, mask):
    """Seed layout's open block: K already quantized per token (no K tail), V still 16-bit (the "V
    tail", HACK.md §4). Logits by seed_logits, then float softmax weights and a float PV.

    Args:
      q_s: f32[rows, head_dim]; k_codes: u8[n, head_dim]; k_scale, k_min, k_sums: [n, NP];
      v: float[n, head_dim] (bf16 as stored); mask: bool[rows, n].

    Returns:
      SoftmaxState (shapes as in float_attention_step).
    """
    w, m = _block_weights(seed_logits(q_s, k_codes, k_scale, k_min, k_sums), mask)
    return SoftmaxState(jnp.einsum("rj,jd->rd", w, _f32(v), precision=_HIGHEST), m, w.sum(-1))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _validate_4d_float(**arrays):
    for name, x in arrays.items():
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, len, heads, head_dim], got {name}.shape={x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating, got {name}.dtype={x.dtype}")


def _validate_kv(k, v, kv_lens):
    _validate_4d_float(k=k, v=v)
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape=}, {v.shape=}")
    if k.shape[2] == 0:
        raise ValueError(f"num_kv_heads must be positive, got {k.shape=}")
    _validate_kv_lens(kv_lens, k.shape[0])


def _validate_qkv(q, k, v, kv_lens):
    _validate_4d_float(q=q)
    _validate_kv(k, v, kv_lens)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch differs: {q.shape=}, {k.shape=}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head_dim differs: {q.shape=}, {k.shape=}")
    num_q_heads, num_kv_heads = q.shape[2], k.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads must be a multiple of num_kv_heads, got {num_q_heads=}, {num_kv_heads=}")


def _validate_kv_lens(kv_lens, batch):
    if kv_lens is None:
        return
    if kv_lens.shape != (batch,) or not jnp.issubdtype(kv_lens.dtype, jnp.integer):
        raise ValueError(f"kv_lens must be int[{batch}], got kv_lens.shape={kv_lens.shape}, "
                         f"kv_lens.dtype={kv_lens.dtype}")


def _validate_quant(layout, partition_size, num_sink_tokens, rounding, key, meta_dtype, head_dim):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout=}")
    if not _is_int(partition_size) or partition_size < 1:
        raise ValueError(f"partition_size must be a positive int, got {partition_size=}")
    if head_dim > partition_size and head_dim % partition_size:
        raise ValueError(f"partition_size must divide head_dim when head_dim > partition_size, got "
                         f"{partition_size=}, {head_dim=}")
    if not _is_int(num_sink_tokens) or num_sink_tokens < 0:
        raise ValueError(f"num_sink_tokens must be an int >= 0, got {num_sink_tokens=}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding=}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key, got key=None")
    if not jnp.issubdtype(meta_dtype, jnp.floating):
        raise ValueError(f"meta_dtype must be a floating dtype, got {meta_dtype=}")


def _validate_sm_scale(sm_scale):
    if sm_scale is not None and (not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale must be None or a finite Python number, got {sm_scale=}")


def _kv_lens_or_full(kv_lens, batch, kv_len):
    """Runtime kv_lens, clipped to [0, kv_len] (documented: keys beyond kv_len do not exist)."""
    if kv_lens is None:
        return jnp.full((batch,), kv_len, jnp.int32)
    return jnp.clip(kv_lens.astype(jnp.int32), 0, kv_len)


def _visible(kv_lens, q_len, kv_len, causal):
    """bool[batch, q_len, kv_len]: key j < kv_lens[b], and j <= kv_lens[b] - q_len + t if causal."""
    j = jnp.arange(kv_len)[None, None, :]
    vis = j < kv_lens[:, None, None]
    if causal:
        pos = kv_lens[:, None] - q_len + jnp.arange(q_len)[None, :]  # [batch, q_len]
        vis = vis & (j <= pos[:, :, None])
    return vis


# ----------------------------------------------------------------------------------------------
# Dense reference
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale"))
def dense_attention_reference(q, k, v, *, causal, kv_lens=None, sm_scale=None):
    """Float32 softmax attention with GQA, causal masking and ragged lengths (the tier (c) target).

    Args:
      q: float[batch, q_len, num_q_heads, head_dim].
      k, v: float[batch, kv_len, num_kv_heads, head_dim]; query head h uses kv head
        h // (num_q_heads // num_kv_heads).
      causal: the q_len queries are the last q_len positions of each sequence: query i sits at
        position kv_lens[b] - q_len + i and sees keys <= its position.
      kv_lens: i32[batch] valid keys per sequence (None: all kv_len); clipped to [0, kv_len].
      sm_scale: logit scale, default 1 / sqrt(head_dim).

    Returns:
      f32[batch, q_len, num_q_heads, head_dim]; rows that see no key are 0.

    Raises:
      ValueError: non-4-D or non-float q/k/v, k/v shape mismatch, batch or head_dim mismatch,
        num_q_heads % num_kv_heads != 0, kv_lens not int[batch], non-finite sm_scale.
    """
    _validate_qkv(q, k, v, kv_lens)
    _validate_sm_scale(sm_scale)
    batch, q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    kv_lens = _kv_lens_or_full(kv_lens, batch, kv_len)

    q_s = _f32(q).reshape(batch, q_len, num_kv_heads, group, head_dim) * scale
    logits = jnp.einsum("btkgd,bskd->bkgts", q_s, _f32(k), precision=_HIGHEST)
    mask = _visible(kv_lens, q_len, kv_len, causal)[:, None, None]  # [batch, 1, 1, q_len, kv_len]
    m = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True, initial=-jnp.inf)
    w = jnp.where(mask, jnp.exp(logits - jnp.where(m == -jnp.inf, 0.0, m)), 0.0)
    # Zero masked keys' values so padding that holds NaN/inf cannot leak through 0 * inf.
    v = jnp.where(jnp.arange(kv_len)[None, :, None, None] < kv_lens[:, None, None, None], _f32(v), 0.0)
    out = softmax_state_output(SoftmaxState(
        jnp.einsum("bkgts,bskd->bkgtd", w, v, precision=_HIGHEST), m[..., 0], w.sum(-1)))
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_q_heads, head_dim)


# ----------------------------------------------------------------------------------------------
# The codes a cache holds
# ----------------------------------------------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums",
                 "k_residual", "v_residual", "kv_lens"],
    meta_fields=["layout", "partition_size", "num_sink_tokens"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """K and V of whole sequences as a HACK cache holds them, unpaged (DESIGN.md "Paged cache layout").

    nb = ceil((kv_len - ns) / P) block slots per sequence (0 if kv_len <= ns); block slot k covers
    tokens [ns + k P, ns + (k + 1) P) (zero padded beyond kv_len). Slot k of sequence b is sealed iff
    k < (kv_lens[b] - ns) // P; other slots hold codes of zero-padded or open tokens that the
    attention never reads as sealed (seed reads its open block's K codes, see below).
    Codes are unpacked (one uint8 per code); all arrays are head-major like pages.

      k_codes, v_codes: u8[batch, num_kv_heads, nb, P, head_dim] in [0, 3].
      kivi: k_scale, k_min  meta[batch, num_kv_heads, nb, head_dim]       (sigma, mu per block, channel)
            v_scale, v_min  meta[batch, num_kv_heads, nb, P, NP]          (tau, nu per token, group)
      seed: k_scale, k_min  meta[batch, num_kv_heads, nb, P, NP]          (per token, channel group)
            v_scale, v_min  meta[batch, num_kv_heads, nb, head_dim]       (per block, channel)
      k_sums: i32[batch, num_kv_heads, nb, P, NP]   sum of k_codes over each channel group (kappa).
      v_sums: i32[batch, num_kv_heads, nb, head_dim] sum of v_codes over each block's tokens (omega).
      k_residual, v_residual: bf16[batch, num_kv_heads, kv_len, head_dim], the 16-bit copies the
        cache holds: sinks and the open block for kivi K and V and for seed V; sinks only for seed K
        (seed quantizes K at append). Zero at every other token.
      kv_lens: i32[batch], clipped to [0, kv_len].
      layout, partition_size (P), num_sink_tokens (ns): static.
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_min: jax.Array
    k_sums: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_min: jax.Array
    v_sums: jax.Array
    k_residual: jax.Array
    v_residual: jax.Array
    kv_lens: jax.Array
    layout: str
    partition_size: int
    num_sink_tokens: int

    @property
    def kv_len(self):
        return self.k_residual.shape[2]


def _token_kinds(kv_lens, kv_len, num_sink_tokens, partition_size):
    """(valid, sealed): bool[batch, kv_len]; sealed = inside a complete block after the sinks."""
    j = jnp.arange(kv_len)[None, :]
    valid = j < kv_lens[:, None]
    num_sealed = jnp.maximum(kv_lens - num_sink_tokens, 0) // partition_size  # [batch]
    sealed = (j >= num_sink_tokens) & ((j - num_sink_tokens) // partition_size < num_sealed[:, None])
    return valid, sealed


def _num_block_slots(kv_len, num_sink_tokens, partition_size):
    return -(-max(kv_len - num_sink_tokens, 0) // partition_size)


def _to_blocks(x, num_sink_tokens, partition_size):
    """f32[batch, heads, kv_len, d] -> f32[batch, heads, nb, P, d]: the tokens after the sinks, padded."""
    batch, heads, kv_len, d = x.shape
    nb = _num_block_slots(kv_len, num_sink_tokens, partition_size)
    region = x[:, :, num_sink_tokens:]
    region = jnp.pad(region, ((0, 0), (0, 0), (0, nb * partition_size - region.shape[2]), (0, 0)))
    return region.reshape(batch, heads, nb, partition_size, d)


def _from_blocks(x, kv_len, num_sink_tokens):
    """[batch, heads, nb, P, ...] -> [batch, heads, kv_len - ns, ...], the inverse of _to_blocks."""
    batch, heads, nb, block = x.shape[:4]
    return x.reshape(batch, heads, nb * block, *x.shape[4:])[:, :, : kv_len - num_sink_tokens]


def _quantize_2bit(x, axis, partition_size, rounding, key, meta_dtype):
    return quantize(x, bits=2, axis=axis, partition_size=partition_size, rounding=rounding, key=key,
                    meta_dtype=meta_dtype)


def _group_sums(codes, group):
    """u8[..., head_dim] -> i32[..., head_dim // group]: code sums per channel group."""
    return codes.astype(jnp.int32).reshape(*codes.shape[:-1], codes.shape[-1] // group, group).sum(-1)


@functools.partial(jax.jit, static_argnames=("layout", "partition_size", "num_sink_tokens", "rounding",
                                             "meta_dtype"))
def quantize_kv_reference(k, v, *, kv_lens=None, layout="kivi", partition_size=64, num_sink_tokens=4,
                          rounding="nearest", key=None, meta_dtype=jnp.float16):
    """Quantizes K and V to INT2 as a cache holds them after writing each whole sequence (HACK.md §2, §4).

    Sinks [0, ns) and the open block stay 16-bit (bfloat16-rounded); every complete block of P tokens
    after the sinks is quantized: kivi: K per channel over the block, V per token over channel groups
    of Pc = min(P, head_dim); seed: K per token over channel groups (all tokens after the sinks,
    the open block too), V per channel over the block. Tokens at or beyond kv_lens are zeroed first.

    Args:
      k, v: float[batch, kv_len, num_kv_heads, head_dim].
      kv_lens: i32[batch] (None: kv_len for all), clipped to [0, kv_len].
      layout: "kivi" | "seed". partition_size: P. num_sink_tokens: ns.
      rounding: "nearest" | "stochastic" (then key is required; K and V use split keys). The
        stochastic codes depend on the key and on the array shapes, so they are reproducible here
        but not equal to the codes of a cache that quantizes block by block.
      meta_dtype: dtype of scale and minimum (default float16).

    Returns:
      QuantizedKV (shapes in its docstring).

    Raises:
      ValueError: bad shapes or dtypes, unknown layout or rounding, partition_size not a positive
        int or not dividing head_dim when head_dim > partition_size, stochastic without key.
    """
    _validate_kv(k, v, kv_lens)
    batch, kv_len, _, head_dim = k.shape
    _validate_quant(layout, partition_size, num_sink_tokens, rounding, key, meta_dtype, head_dim)
    ns, block = num_sink_tokens, partition_size
    group = min(block, head_dim)
    kv_lens = _kv_lens_or_full(kv_lens, batch, kv_len)
    valid, sealed = _token_kinds(kv_lens, kv_len, ns, block)
    head_major = lambda x: jnp.where(valid[:, :, None, None], _f32(x), 0.0).transpose(0, 2, 1, 3)
    k, v = head_major(k), head_major(v)  # [batch, heads, kv_len, head_dim]
    k_key, v_key = jax.random.split(key) if rounding == "stochastic" else (None, None)

    kb, vb = _to_blocks(k, ns, block), _to_blocks(v, ns, block)  # [batch, heads, nb, P, head_dim]
    if layout == "kivi":
        kq = _quantize_2bit(kb, 3, block, rounding, k_key, meta_dtype)  # per channel over the block
        vq = _quantize_2bit(vb, 4, group, rounding, v_key, meta_dtype)  # per token over channel groups
        k_scale, k_min = kq.scale[:, :, :, 0], kq.minimum[:, :, :, 0]
        v_scale, v_min = vq.scale, vq.minimum
        k_sums = _group_sums(kq.codes, group)
        v_sums = vq.codes.astype(jnp.int32).sum(3)
        k_16bit = valid & ~sealed
    else:
        kq = _quantize_2bit(kb, 4, group, rounding, k_key, meta_dtype)  # per token over channel groups
        vq = _quantize_2bit(vb, 3, block, rounding, v_key, meta_dtype)  # per channel over the block
        k_scale, k_min, k_sums = kq.scale, kq.minimum, kq.code_sums
        v_scale, v_min, v_sums = vq.scale[:, :, :, 0], vq.minimum[:, :, :, 0], vq.code_sums[:, :, :, 0]
        k_16bit = valid & (jnp.arange(kv_len) < ns)[None]

    residual = lambda x, keep: jnp.where(keep[:, None, :, None], x, 0.0).astype(RESIDUAL_DTYPE)
    return QuantizedKV(k_codes=kq.codes, k_scale=k_scale, k_min=k_min, k_sums=k_sums,
                       v_codes=vq.codes, v_scale=v_scale, v_min=v_min, v_sums=v_sums,
                       k_residual=residual(k, k_16bit), v_residual=residual(v, valid & ~sealed),
                       kv_lens=kv_lens, layout=layout, partition_size=block, num_sink_tokens=ns)


@jax.jit
def dequantize_kv_reference(qkv):
    """QuantizedKV -> (k_hat, v_hat) f32[batch, kv_len, num_kv_heads, head_dim] (HACK.md §2).

    Quantized tokens reconstruct as scale * code + minimum, 16-bit tokens from the residual, tokens
    beyond kv_lens are 0. Attention over these equals attention on the codes up to the INT8
    quantization of the transient operands (tier (b)).
    """
    ns, kv_len = qkv.num_sink_tokens, qkv.kv_len
    codes_k, codes_v = _f32(qkv.k_codes), _f32(qkv.v_codes)
    num_groups = qkv.k_sums.shape[-1]

    def per_group(codes, scale, minimum):  # codes [..., P, d]; scale [..., P, NP]
        shape = codes.shape
        c = codes.reshape(*shape[:-1], num_groups, shape[-1] // num_groups)
        return (_f32(scale)[..., None] * c + _f32(minimum)[..., None]).reshape(shape)

    def per_block(codes, scale, minimum):  # codes [..., P, d]; scale [..., d]
        return _f32(scale)[..., None, :] * codes + _f32(minimum)[..., None, :]

    if qkv.layout == "kivi":
        kb = per_block(codes_k, qkv.k_scale, qkv.k_min)
        vb = per_group(codes_v, qkv.v_scale, qkv.v_min)
    else:
        kb = per_group(codes_k, qkv.k_scale, qkv.k_min)
        vb = per_block(codes_v, qkv.v_scale, qkv.v_min)
    valid, sealed = _token_kinds(qkv.kv_lens, kv_len, ns, qkv.partition_size)
    k_coded = sealed if qkv.layout == "kivi" else valid & (jnp.arange(kv_len) >= ns)[None]

    def assemble(blocks, residual, coded):
        quantized = jnp.pad(_from_blocks(blocks, kv_len, ns), ((0, 0), (0, 0), (min(ns, kv_len), 0), (0, 0)))
        x = jnp.where(coded[:, None, :, None], quantized, _f32(residual))
        return x.transpose(0, 2, 1, 3)

    return assemble(kb, qkv.k_residual, k_coded), assemble(vb, qkv.v_residual, sealed)


# ----------------------------------------------------------------------------------------------
# Attention on the codes
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale"))
def quantized_kv_attention_reference(q, qkv, *, causal, sm_scale=None):
    """Homomorphic attention on the codes of a QuantizedKV, DESIGN.md "Homomorphic attention semantics".

    One online softmax per query row over: the sinks (float_attention_step), the sealed blocks in
    order (kivi_/seed_block_attention_step, block-local max), and the open block
    (float_attention_step for kivi, seed_open_block_attention_step for seed). Nothing is
    dequantized: both matmuls of a sealed block are integer dots plus correction terms (HACK.md §3).

    Args:
      q: float[batch, q_len, num_q_heads, head_dim]; qkv: QuantizedKV of the same batch and head_dim.
      causal, sm_scale: as in dense_attention_reference (positions from qkv.kv_lens).

    Returns:
      f32[batch, q_len, num_q_heads, head_dim]; rows that see no key are 0.

    Raises:
      ValueError: q not 4-D float, batch / head_dim / head-count mismatch with qkv, bad sm_scale.
    """
    batch, kv_heads, kv_len, head_dim = qkv.k_residual.shape
    if q.ndim != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, q_len, num_q_heads, head_dim], got {q.shape=}, {q.dtype=}")
    if (q.shape[0], q.shape[3]) != (batch, head_dim) or q.shape[2] % kv_heads:
        raise ValueError(f"q does not match the cache: {q.shape=} vs batch={batch}, "
                         f"num_kv_heads={kv_heads}, head_dim={head_dim}")
    _validate_sm_scale(sm_scale)
    _, q_len, num_q_heads, _ = q.shape
    group = num_q_heads // kv_heads
    rows = q_len * group
    ns, block = qkv.num_sink_tokens, qkv.partition_size
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)

    # [batch, kv_heads, rows, head_dim], rows r = t * G + g.
    q_s = (_f32(q) * scale).reshape(batch, q_len, kv_heads, group, head_dim)
    q_s = q_s.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, rows, head_dim)
    visible = jnp.repeat(_visible(qkv.kv_lens, q_len, kv_len, causal), group, axis=1)  # [batch, rows, kv_len]
    _, sealed = _token_kinds(qkv.kv_lens, kv_len, ns, block)
    per_head = lambda f: jax.vmap(jax.vmap(f, in_axes=(0, 0, 0, None)), in_axes=(0, 0, 0, 0))

    state = empty_softmax_state((batch, kv_heads, rows), head_dim)
    num_sinks = min(ns, kv_len)
    if num_sinks:
        sl = slice(0, num_sinks)
        state = online_softmax_merge(state, per_head(float_attention_step)(
            q_s, qkv.k_residual[:, :, sl], qkv.v_residual[:, :, sl], visible[:, :, sl]))

    nb = qkv.k_codes.shape[2]
    if nb:
        # Sealed blocks in order; a slot that is not sealed for a sequence is invisible to all rows.
        # Rows stand in for heads in _to_blocks: [batch, rows, kv_len, 1] -> [batch, rows, nb, P, 1].
        vis_blocks = _to_blocks((visible & sealed[:, None, :]).astype(jnp.float32)[..., None], ns, block)
        vis_blocks = vis_blocks[..., 0].transpose(2, 0, 1, 3) > 0  # [nb, batch, rows, P]
        step = kivi_block_attention_step if qkv.layout == "kivi" else seed_block_attention_step
        block_step = jax.vmap(jax.vmap(step, in_axes=(0,) * 9 + (None,)), in_axes=(0,) * 10)
        leading = lambda x: jnp.moveaxis(x, 2, 0)  # [nb, batch, heads, ...]
        fields = (qkv.k_codes, qkv.k_scale, qkv.k_min, qkv.k_sums,
                  qkv.v_codes, qkv.v_scale, qkv.v_min, qkv.v_sums)

        def scan_body(carry, xs):
            mask, *block_fields = xs
            return online_softmax_merge(carry, block_step(q_s, *block_fields, mask)), None

        state, _ = jax.lax.scan(scan_body, state, (vis_blocks, *map(leading, fields)))

        open_mask = visible[:, :, ns:] & ~sealed[:, None, ns:]  # [batch, rows, kv_len - ns]
        v_open = qkv.v_residual[:, :, ns:]
        if qkv.layout == "kivi":
            open_state = per_head(float_attention_step)(q_s, qkv.k_residual[:, :, ns:], v_open, open_mask)
        else:
            k_tok = [_from_blocks(x, kv_len, ns) for x in (qkv.k_codes, qkv.k_scale, qkv.k_min, qkv.k_sums)]
            open_step = jax.vmap(jax.vmap(seed_open_block_attention_step, in_axes=(0,) * 6 + (None,)),
                                 in_axes=(0,) * 7)
            open_state = open_step(q_s, *k_tok, v_open, open_mask)
        state = online_softmax_merge(state, open_state)

    out = softmax_state_output(state).reshape(batch, kv_heads, q_len, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, num_q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=("causal", "layout", "partition_size", "num_sink_tokens",
                                             "rounding", "sm_scale", "meta_dtype"))
def homomorphic_attention_reference(q, k, v, *, causal, kv_lens=None, layout="kivi", partition_size=64,
                                    num_sink_tokens=4, rounding="nearest", key=None, sm_scale=None,
                                    meta_dtype=jnp.float16):
    """HACK attention: K/V quantized to INT2 as a cache holds them, attention computed on the codes.

    = quantized_kv_attention_reference(q, quantize_kv_reference(k, v, ...), ...). The semantics
    (DESIGN.md "Homomorphic attention semantics", HACK.md §3-§5) are in the step functions.

    Args:
      q: float[batch, q_len, num_q_heads, head_dim]; k, v: float[batch, kv_len, num_kv_heads, head_dim].
      causal, kv_lens, sm_scale: as in dense_attention_reference.
      layout, partition_size, num_sink_tokens, rounding, key, meta_dtype: as in quantize_kv_reference.

    Returns:
      f32[batch, q_len, num_q_heads, head_dim]; rows that see no key are 0.

    Raises:
      ValueError: everything dense_attention_reference and quantize_kv_reference raise.
    """
    _validate_qkv(q, k, v, kv_lens)
    qkv = quantize_kv_reference(k, v, kv_lens=kv_lens, layout=layout, partition_size=partition_size,
                                num_sink_tokens=num_sink_tokens, rounding=rounding, key=key,
                                meta_dtype=meta_dtype)
    return quantized_kv_attention_reference(q, qkv, causal=causal, sm_scale=sm_scale)


@functools.partial(jax.jit, static_argnames=("causal", "layout", "partition_size", "num_sink_tokens",
                                             "rounding", "sm_scale", "meta_dtype"))
def dequantized_attention_reference(q, k, v, *, causal, kv_lens=None, layout="kivi", partition_size=64,
                                    num_sink_tokens=4, rounding="nearest", key=None, sm_scale=None,
                                    meta_dtype=jnp.float16):
    """Dense float attention over the dequantized codes of quantize_kv_reference (same arguments and
    codes as homomorphic_attention_reference). Differs from it only by the INT8 quantization of the
    transient operands (Q, softmax weights) and float32 rounding: the tier (b) / dequant baseline.

    Returns f32[batch, q_len, num_q_heads, head_dim]; raises as homomorphic_attention_reference.
    """
    _validate_qkv(q, k, v, kv_lens)
    qkv = quantize_kv_reference(k, v, kv_lens=kv_lens, layout=layout, partition_size=partition_size,
                                num_sink_tokens=num_sink_tokens, rounding=rounding, key=key,
                                meta_dtype=meta_dtype)
    k_hat, v_hat = dequantize_kv_reference(qkv)
    return dense_attention_reference(q, k_hat, v_hat, causal=causal, kv_lens=qkv.kv_lens, sm_scale=sm_scale)
