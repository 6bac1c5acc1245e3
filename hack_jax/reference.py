"""Pure-jnp attention steps on HACK codes: the math hack_jax.attention's paged reference runs.

DESIGN.md "Homomorphic attention semantics", implemented exactly (HACK.md §3-§5); everything is
float32 inside and jit-able. Each step is unbatched (one sequence, one kv head, one segment; vmap
over the rest) and returns a SoftmaxState relative to its own segment-local max;
online_softmax_merge folds states together and softmax_state_output normalizes.

  kivi_block_attention_step, seed_block_attention_step   one sealed block of P tokens
  seed_open_block_attention_step                          seed's open block (quantized K, 16-bit V)
  float_attention_step                                    sinks, kivi's open block (16-bit K and V)
  seed_logits                                             seed's logits by the four-term identity

Conventions:
  - q_s = q * sm_scale (float32) is the query every step takes; rows are r = t * G + g for the G
    query heads of one kv head (G = num_q_heads // num_kv_heads).
  - P = partition_size; Pc = min(P, head_dim) channels per channel group; NP = head_dim // Pc groups.
  - Transient operands (Q, softmax weights) are quantized to INT8 with hack_jax.quantization.quantize
    (nearest, float32 metadata, folded minimum): their codes come from that one function, so a kernel
    matches them code for code only if it repeats its arithmetic (see quantize's docstring).
  - Float32 results depend on the evaluation order at the ulp level, so a transient INT8 code sitting
    at a rounding tie can differ by one between this reference and a kernel: compare with a tolerance.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hack_jax.homomorphic import homomorphic_matmul
from hack_jax.quantization import QuantizedTensor, quantize

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
    """acc / l: f32[..., rows, head_dim]; rows with l == 0 (nothing visible) give 0, and a NaN in
    the inputs (l or acc NaN) stays NaN: a NaN query or key never becomes a plausible 0."""
    denom = state.l[..., None]
    return jnp.where(denom == 0, 0.0, state.acc / jnp.where(denom == 0, 1.0, denom))


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
    block, np_ = k_sums.shape  # NP channel groups of Pc channels
    pc = head_dim // np_
    q_s, sigma, mu = _f32(q_s), _f32(k_scale), _f32(k_min)

    qt = quantize(q_s * sigma, bits=8, axis=1, partition_size=pc, meta_dtype=jnp.float32)
    dot = _int_dot("rpc,jpc->rjp", qt.codes.reshape(rows, np_, pc),
                   k_codes.reshape(block, np_, pc))  # [rows, P, NP]
    logits = (qt.scale[:, None, :] * _f32(dot) + qt.minimum[:, None, :] * _f32(k_sums)[None]).sum(-1)
    logits = logits + jnp.einsum("rc,c->r", q_s, mu, precision=_HIGHEST)[:, None]  # [rows, P]

    w, mb = _block_weights(logits, mask)
    wt = quantize(w[:, :, None] * _f32(v_scale)[None], bits=8, axis=1, partition_size=block,
                  meta_dtype=jnp.float32)  # codes [rows, P, NP]; scale, minimum [rows, 1, NP]
    pv = _int_dot("rjp,jpc->rpc", wt.codes, v_codes.reshape(block, np_, pc))  # [rows, NP, Pc]
    nu_term = jnp.einsum("rj,jp->rp", w, _f32(v_min), precision=_HIGHEST)  # float W: exact for constant V
    acc = (wt.scale[:, 0, :, None] * _f32(pv)
           + wt.minimum[:, 0, :, None] * _f32(v_sums).reshape(np_, pc)[None]
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
    np_ = k_sums.shape[-1]
    pc = q_s.shape[-1] // np_
    qq = quantize(_f32(q_s), bits=8, axis=1, partition_size=pc, meta_dtype=jnp.float32)
    kt = QuantizedTensor(codes=k_codes.T, scale=k_scale.T, minimum=k_min.T, code_sums=k_sums.T,
                         bits=2, axis=0, partition_size=pc)  # K^T: [head_dim, n] along axis 0
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
    """Seed layout's open block: K already quantized per token, V still in the 16-bit open block
    (HACK.md §4). Logits by seed_logits, then float softmax weights and a float PV.

    Args:
      q_s: f32[rows, head_dim]; k_codes: u8[n, head_dim]; k_scale, k_min, k_sums: [n, NP];
      v: float[n, head_dim] (bf16 as stored); mask: bool[rows, n].

    Returns:
      SoftmaxState (shapes as in float_attention_step).
    """
    w, m = _block_weights(seed_logits(q_s, k_codes, k_scale, k_min, k_sums), mask)
    return SoftmaxState(jnp.einsum("rj,jd->rd", w, _f32(v), precision=_HIGHEST), m, w.sum(-1))
