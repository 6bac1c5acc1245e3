"""Prefill: write a prompt (or its next chunk) into a cache layer and attend to it, causally.

`prefill(q, k, v, layer, ...) -> (layer, out)` is the one call the model makes per layer. The
fresh K/V are written once through `kv_cache.write_prefill` (2- or 4-bit codes for "hack"); the attention is
chosen by `attention`:

  "auto" | "cudnn" | "xla" | "pallas" | "reference"  (exact prefill, the default "auto"):
    the fresh tokens attend to each other on their 16-bit Q/K/V with a flash / dense causal
    attention, so the prompt's own attention is exact up to the dtype and causal by construction
    (a query never sees a later token, not even through a block's min/max). For a chunk
    (q_start given) the queries also attend to the tokens cached before it, on the cache's own
    contents, and the two halves are merged by log-sum-exp (reference.online_softmax_merge). The
    cached prefix is read by attention.cached_prefix_state: for "hack" with impl="pallas" the HACK
    prefill kernel in prefix mode on the codes, sinks and open block (scale-folded f16 operands by
    default, as the decode steps), else the jnp reference; bf16 / float32 pages with the "cudnn"
    backend are gathered and attended by cuDNN (no mask: every query follows every cached token).
    Backends of the fresh-token half:
      "cudnn": cuDNN flash attention (jax's fused_attention_stablehlo, GQA, padding-causal mask,
        float32 log-sum-exp); GPU and bf16/f16 q/k/v only, else it falls back to "xla".
      "xla": jax.nn.dot_product_attention(implementation="xla"); materializes the [T, T] logits
        (a fallback, not for long prompts); its log-sum-exp comes back in the input dtype.
      "pallas": pallas_kernels.bf16_prefill_attention on the fresh K/V as one page per sequence
        (bf16 dots, FlashAttention numerics); it returns no log-sum-exp, so not for chunks.
      "reference": jnp float32 (HIGHEST precision) softmax attention; the CPU default.
      "auto": "cudnn" on a GPU with bf16/f16 activations, "xla" on a GPU otherwise, "reference"
        elsewhere.
    The 16-bit formats (bf16 / float32 / int8 caches) take the same path, so comparisons between
    formats stay like for like.

  "homomorphic": the paper's numerics (HACK.md §3-§5): write first, then
    attention.prefill_attention over the cache (impl / kernel_options pick the reference or the
    Pallas kernel). NOT causal for "hack": a query sees its own 64-token block as codes whose
    per-block min/max include the block's later tokens (issue 17.2), so changing a future token
    moves earlier rows. Kept as an option for the paper's numbers, never the default: making it
    causal means attending the query's own block in 16 bits, i.e. exactly what the exact path
    already does for every fresh token, with a kernel measured at ~7x cuDNN's time
    (bench/NOTES_prefill.md).

Shapes: q float[max_seqs, T, num_q_heads, head_dim], k/v float[max_seqs, T, num_kv_heads,
head_dim], left-aligned: row t of slot s is position q_start[s] + t; rows t >= lengths[s] are
padding (output 0). GQA: query head h uses kv head h // (num_q_heads // num_kv_heads);
sm_scale = 1 / sqrt(head_dim).
"""

from __future__ import annotations

import functools
import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from hack_jax import attention as hack_attention
from hack_jax import kv_cache, reference
from hack_jax.kv_cache import dense

PrefillAttention = Literal["auto", "cudnn", "xla", "pallas", "reference", "homomorphic"]
PREFILL_ATTENTION = get_args(PrefillAttention)
EXACT = PREFILL_ATTENTION[:-1]  # every choice but "homomorphic": exact attention on the 16-bit K/V
_HIGHEST = jax.lax.Precision.HIGHEST
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def prefill(q, k, v, layer: kv_cache.LayerCache, *, page_indices, lengths, q_start=None, key=None,
            attention: PrefillAttention = "auto", impl: hack_attention.Impl = "reference", **kernel_options):
    """Writes k/v into `layer` and returns (new layer, causal attention of q) (module docstring).

    Args:
      q: float[max_seqs, T, num_q_heads, head_dim] (RoPE applied); k, v: float[max_seqs, T,
        num_kv_heads, head_dim], the fresh tokens.
      layer: the LayerCache (any kv_format).
      page_indices: i32[max_seqs, pages_per_seq], pages assigned for q_start + lengths tokens.
      lengths: i32[max_seqs] fresh tokens per slot (0: slot untouched, its rows 0).
      q_start: i32[max_seqs] tokens each slot already holds (the next chunk of a chunked prefill),
        or None = empty slots (one-shot prefill; no cached prefix is read).
      key: PRNG key for rounding="stochastic" (write_prefill's).
      attention: one of PREFILL_ATTENTION (module docstring).
      impl, kernel_options: hack_jax.attention's, for attention="homomorphic"; with the exact
        backends only `interpret` is used (by "pallas"), the rest is ignored.
    Returns (new LayerCache, out f32[max_seqs, T, num_q_heads, head_dim]); rows t >= lengths[s]
    are 0.
    Raises ValueError for an unknown attention, shapes that do not match (q vs k/v vs the layer),
    attention="pallas" with q_start (no log-sum-exp to merge), and whatever write_prefill and
    attention.prefill_attention raise; a rejected call changes nothing.
    """
    if attention not in PREFILL_ATTENTION:
        raise ValueError(f"attention must be one of {PREFILL_ATTENTION}, got {attention=}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 4 or k.ndim != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"prefill: q must be [max_seqs, T, num_q_heads, head_dim] matching k/v "
                         f"[max_seqs, T, num_kv_heads, head_dim]: {q.shape=} {k.shape=}")
    if attention == "pallas" and q_start is not None:
        raise ValueError("prefill: attention='pallas' returns no log-sum-exp and cannot merge a "
                         "chunk with its cached prefix; use 'cudnn', 'xla' or 'reference'")
    new_layer = kv_cache.write_prefill(layer, k, v, lengths=lengths, page_indices=page_indices,
                                       start=q_start, key=key)  # validates lengths/pages/start
    lengths = jnp.asarray(lengths, jnp.int32)
    if attention == "homomorphic":
        kv_lens = lengths if q_start is None else jnp.asarray(q_start, jnp.int32) + lengths
        return new_layer, hack_attention.prefill_attention(
            q, new_layer, page_indices=page_indices, kv_lens=kv_lens, q_start=q_start, impl=impl,
            **kernel_options)
    if q.shape[2] % k.shape[2] or k.shape[2] != layer.num_kv_heads:
        raise ValueError(f"prefill: q heads must be a multiple of the cache's kv heads "
                         f"({layer.num_kv_heads}): {q.shape=} {k.shape=}")
    backend = resolve(attention, q.dtype, k.dtype)
    interpret = bool(kernel_options.get("interpret", False))
    if q_start is None:
        out = fresh_attention(q, k, v, lengths, backend=backend, interpret=interpret)[0]
    else:
        prefix = _prefix_state(q, layer, page_indices, jnp.asarray(q_start, jnp.int32), lengths, backend,
                               impl, kernel_options)
        out = _merge(prefix, *fresh_attention(q, k, v, lengths, backend=backend, with_lse=True))
    rows = jnp.arange(q.shape[1])[None, :] < lengths[:, None]
    return new_layer, jnp.where(rows[:, :, None, None], out, 0.0)


def resolve(attention: str, q_dtype, kv_dtype) -> str:
    """The backend an exact `attention` choice runs on here: "cudnn" needs a GPU and bf16/f16
    q and k/v of one dtype (else "xla"); "auto" is "cudnn" where that holds, "xla" on other GPUs,
    "reference" on other platforms."""
    gpu = jax.default_backend() == "gpu"
    cudnn_ok = gpu and jnp.dtype(q_dtype) == jnp.dtype(kv_dtype) and jnp.dtype(q_dtype) in _CUDNN_DTYPES
    if attention == "auto":
        return "cudnn" if cudnn_ok else ("xla" if gpu else "reference")
    if attention == "cudnn" and not cudnn_ok:
        return "xla"
    return attention


@functools.partial(jax.jit, static_argnames=("backend", "with_lse", "interpret"))
def fresh_attention(q, k, v, lengths, *, backend, with_lse=False, interpret=False):
    """Causal attention of the fresh tokens among themselves, on their own q/k/v.

    q float[S, T, Hq, D], k/v float[S, T, H, D], lengths i32[S] (keys and queries t < lengths[s]).
    Returns (out f32[S, T, Hq, D], lse f32[S, T, Hq] or None): lse = log sum_j exp(logit_j), the
    natural log-sum-exp of the row's scaled logits (-inf for rows that see nothing), when with_lse.
    Rows t >= lengths[s] are unspecified (prefill zeroes them).
    """
    if backend == "reference":
        return _reference(q, k, v, lengths)
    if backend == "pallas":
        return _pallas(q, k, v, lengths, interpret), None
    if backend == "cudnn":
        return _cudnn(q, k, v, lengths, lengths, causal=True, with_lse=with_lse)
    if backend == "xla":
        got = jax.nn.dot_product_attention(
            q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True, query_seq_lengths=lengths,
            key_value_seq_lengths=lengths, implementation="xla", return_residual=with_lse)
        out, lse = got if with_lse else (got, None)
        return out.astype(jnp.float32), None if lse is None else lse.astype(jnp.float32)
    raise ValueError(f"unknown prefill backend {backend=}; one of {EXACT[1:]}")


def _reference(q, k, v, lengths):
    s, t, hq, d = q.shape
    h = k.shape[2]
    qg = q.astype(jnp.float32).reshape(s, t, h, hq // h, d) / math.sqrt(d)
    logits = jnp.einsum("stkgd,sjkd->stkgj", qg, k.astype(jnp.float32), precision=_HIGHEST)
    i = jnp.arange(t)
    visible = (i[None, :] <= i[:, None])[None] & (i < lengths[:, None])[:, None, :]  # [S, T, T]
    visible = visible[:, :, None, None, :]
    m = jnp.max(jnp.where(visible, logits, -jnp.inf), axis=-1)
    w = jnp.where(visible, jnp.exp(logits - jnp.where(m == -jnp.inf, 0.0, m)[..., None]), 0.0)
    l = w.sum(-1)
    acc = jnp.einsum("stkgj,sjkd->stkgd", w, v.astype(jnp.float32), precision=_HIGHEST)
    out = reference.softmax_state_output(reference.SoftmaxState(acc, m, l))
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))  # NaN stays NaN
    return out.reshape(s, t, hq, d), lse.reshape(s, t, hq)


def _cudnn(q, k, v, q_lens, kv_lens, *, causal, with_lse):
    """cuDNN attention of q [S, T, Hq, D] over k/v [S, C, H, D]: query rows < q_lens, keys < kv_lens
    (causal: key j <= row t as well). Returns (out f32, lse f32[S, T, Hq] or None)."""
    # jax.nn.dot_product_attention rounds cuDNN's float32 softmax statistics to the input dtype;
    # the chunk merge needs them in float32, so call the same cuDNN op one level down (its
    # signature is unchanged from jax 0.10.2 to 0.11.x).
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    got = cudnn.dot_product_attention(
        q, k.astype(q.dtype), v.astype(q.dtype), None, None, q_lens, kv_lens,
        scale=1.0 / math.sqrt(q.shape[-1]), mask_type=mask, return_residual=with_lse)
    if not with_lse:
        return (got[0] if isinstance(got, (tuple, list)) else got).astype(jnp.float32), None
    out, stats = got  # stats f32[S, Hq, T]
    return out.astype(jnp.float32), jnp.swapaxes(stats, 1, 2).astype(jnp.float32)


def _pallas(q, k, v, lengths, interpret):
    """Our bf16 Pallas prefill kernel over the fresh K/V laid out as one page per sequence."""
    from pallas_kernels.bf16_prefill_attention import bf16_prefill_attention

    s, t = k.shape[:2]
    page = max(16, 1 << (t - 1).bit_length())  # the kernel's pages are powers of two >= 16
    pages = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2).astype(jnp.bfloat16),
                              ((0, 0), (0, 0), (0, page - t), (0, 0)))  # [S, H, page, D]
    table = jnp.arange(s, dtype=jnp.int32)[:, None]
    return bf16_prefill_attention(q, pages(k), pages(v), table, lengths, interpret=interpret)


def _prefix_state(q, layer, page_indices, q_start, lengths, backend, impl, kernel_options):
    """The chunk's attention over its cached prefix (module docstring), as a SoftmaxState."""
    if backend == "cudnn" and isinstance(layer, kv_cache.DensePages):
        k, v = dense.gather(layer, page_indices, q_start)  # [S, capacity, H, D] as stored, 0 beyond
        return _cudnn_prefix(q, k, v, q_start, lengths)
    return hack_attention.cached_prefix_state(q, layer, page_indices=page_indices, kv_lens=q_start, impl=impl,
                                              **kernel_options)


@jax.jit
def _cudnn_prefix(q, k, v, kv_lens, q_lens):
    """_cudnn without a causal mask (every query follows every cached key < kv_lens), as
    SoftmaxState(out, lse, 1); empty (l = 0) for slots with no cached token."""
    held = kv_lens > 0  # cuDNN is not asked about empty rows: their state is replaced below
    out, lse = _cudnn(q, k, v, jnp.maximum(q_lens, 1), jnp.maximum(kv_lens, 1), causal=False, with_lse=True)
    lse = jnp.where(held[:, None, None], lse, -jnp.inf)
    out = jnp.where(held[:, None, None, None], out, 0.0)
    return reference.SoftmaxState(out, lse, jnp.where(held[:, None, None], 1.0, 0.0))


def _merge(prefix: reference.SoftmaxState, out, lse):
    """Chunk rows: prefix state (acc, m, l over cached keys) + the chunk's own normalized `out`
    with its log-sum-exp, i.e. the state (acc=out, m=lse, l=1)."""
    own = reference.SoftmaxState(out, lse, jnp.where(lse > -jnp.inf, 1.0, 0.0))
    return reference.softmax_state_output(reference.online_softmax_merge(prefix, own))
