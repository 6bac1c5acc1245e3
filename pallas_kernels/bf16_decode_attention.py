"""Paged bf16 decode attention (the unquantized baseline of the HACK decode kernel).

Computes, for every sequence b and query head h (GQA: kv head h // (num_q_heads // num_kv_heads)),

    out[b, h] = softmax(q[b, h] . K_b^T / sqrt(head_dim)) V_b

over the first kv_lens[b] tokens of sequence b, whose K/V live in the pages
page_indices[b, 0], page_indices[b, 1], ... of a paged cache (DESIGN.md, kv_format="bf16").

Structure (the same as pallas_kernels/decode_attention.py, so the two time the same machinery):
grid (batch, num_kv_heads, num_splits); one program serves all q heads of one kv head, padded to
block_h >= 16 rows (a dot needs M >= 16); it walks its share of the sequence in tiles of block_k
tokens (several pages gathered per iteration when block_k > page_size, a slice of one page when
block_k < page_size), page ids read from the int32 page table inside the kernel (Triton has no scalar
prefetch). Online softmax in float32; only the one tile that straddles kv_len is masked. Each split
writes unnormalized (acc, m, l); the splits are merged outside the kernel with a log-sum-exp merge
(common.lse_combine). kv_lens = 0 gives 0.

Reference twin: `hack_jax.attention.decode_attention(..., impl="reference")` for kv_format="bf16"
(the library's dense attention over the gathered pages); tests/test_bf16_decode_kernel.py also checks
against an independent float64 NumPy reference.

Supported: q any float dtype (cast to bf16 for the QK^T dot, like the cache), K/V bf16, head_dim and
page_size powers of two >= 16, any GQA group (padded to a power of two >= 16 rows). Output float32.
Runtime values: kv_lens are clipped to [0, pages_per_seq * page_size]; page ids outside [0, num_pages)
read page 0 (the null page, hack_jax.kv_cache), so table entries past a sequence's last page may hold
anything; whatever is read past kv_len is masked (NaN cannot leak).
Tested: interpret mode on the CPU (jax 0.10.2); one NVIDIA H200 (jax 0.11.2, Triton 3.6): the gpu tests
pass, and at Llama-3.1-8B heads it streams K+V near the HBM roof at batch 8 (timings:
bench/NOTES_decode.md "bf16 paged decode kernel", bench/results/decode_attention.md).
Caveats: q is rounded to bf16 before the QK^T dot (the softmax scale is applied in float32 after it);
keep num_stages >= 2 (unpipelined loads were measured 1.5x slower; tiles and warps matter little).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common

NUM_SMS_H200 = 132


def _bf16_decode_kernel(
    page_indices_ref,  # i32[pages_per_seq_padded]  (this sequence's row)
    kv_lens_ref,  # i32[1]
    first_page_ref,  # i32[1]  the layer's first page in the pools (i * num_pages: layer i of a stack); None: 0
    q_ref,  # bf16[block_h, head_dim]
    k_ref,  # bf16[num_layers * num_pages, page_size, head_dim]  (the pool of this kv head)
    v_ref,  # bf16[num_layers * num_pages, page_size, head_dim]
    acc_ref,  # f32[block_h, head_dim]  unnormalized output of this split
    m_ref,  # f32[block_h]  running max of the logits (natural log units)
    l_ref,  # f32[block_h]  sum of exp(logit - m)
    *,
    block_k: int,
    num_splits: int,
    num_pages: int,  # of one layer
    sm_scale: float,
):
    _, page_size, head_dim = k_ref.shape
    block_h = q_ref.shape[0]
    split = pl.program_id(2)
    kv_len = kv_lens_ref[0]
    first_page = 0 if first_page_ref is None else first_page_ref[0]

    # This sequence's tiles are shared out evenly between the splits (by its own length, not capacity).
    num_blocks = pl.cdiv(kv_len, block_k)
    per_split = pl.cdiv(num_blocks, num_splits)
    start = jnp.minimum(split * per_split, num_blocks)
    end = jnp.minimum(start + per_split, num_blocks)
    full_end = jnp.clip(kv_len // block_k, start, end)  # tiles before this one need no mask

    q = q_ref[...]  # bf16[block_h, head_dim]

    def load_tile(ref, i):
        """Tile i of this sequence: bf16[block_k, head_dim]."""
        if block_k > page_size:
            pages_per_block = block_k // page_size
            ids = page_indices_ref[pl.ds(i * pages_per_block, pages_per_block)]  # i32[pages_per_block]
            ids = first_page + jnp.where((ids >= 0) & (ids < num_pages), ids, 0)  # outside: the null page
            return ref[ids].reshape(block_k, head_dim)
        tok0 = i * block_k
        page = page_indices_ref[tok0 // page_size]
        page = first_page + jnp.where((page >= 0) & (page < num_pages), page, 0)
        offset = pl.multiple_of(tok0 % page_size, block_k)
        return ref[page, pl.ds(offset, block_k), :]

    def step(masked, i, carry):
        acc, m, l = carry  # f32[block_h, head_dim], f32[block_h], f32[block_h]
        k = load_tile(k_ref, i)
        v = load_tile(v_ref, i)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * sm_scale  # f32[block_h, block_k]
        if masked:
            valid = i * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0) < kv_len  # bool[block_k]
            s = jnp.where(valid[None, :], s, -jnp.inf)
            # Unused slots may hold anything (NaN included): 0 * NaN would poison the PV dot.
            v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        # Every processed tile holds >= 1 valid token, so m_new is finite: no exp(-inf - -inf).
        m_new = jnp.maximum(m, s.max(axis=1))  # f32[block_h]
        alpha = jnp.exp(m - m_new)  # f32[block_h]
        p = jnp.exp(s - m_new[:, None])  # f32[block_h, block_k]
        l = alpha * l + p.sum(axis=1)
        acc = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, m_new, l

    carry = (
        jnp.zeros((block_h, head_dim), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    carry = lax.fori_loop(start, full_end, functools.partial(step, False), carry)
    acc, m, l = lax.fori_loop(full_end, end, functools.partial(step, True), carry)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiles and launch parameters of `bf16_decode_attention`.

    block_k: tokens per loop iteration (power of two >= 16); > page_size gathers several pages.
    num_splits: split-K programs per (sequence, kv head); each takes an equal share of the sequence.
    num_warps, num_stages: Triton launch parameters (num_stages pipelines the K/V tile loads).
    """

    block_k: int = 128
    num_splits: int = 8
    num_warps: int = 4
    num_stages: int = 2


def default_config(*, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                   pages_per_seq: int) -> KernelConfig:
    """Heuristic: ~32 KiB K tiles (and as many for V) per iteration; enough programs for the H200's
    132 SMs (~8 per SM) while each split keeps >= 4 tiles of a full-capacity sequence."""
    del num_q_heads
    capacity = page_size * pages_per_seq
    block_k = max(16, min(32768 // (2 * head_dim), pl.next_power_of_2(capacity)))
    max_blocks = pl.cdiv(capacity, block_k)
    target_programs = 8 * NUM_SMS_H200
    num_splits = max(1, min(pl.cdiv(target_programs, batch * num_kv_heads), pl.cdiv(max_blocks, 4)))
    return KernelConfig(block_k=block_k, num_splits=num_splits, num_warps=4, num_stages=2)


def _launch(q, k, v, page_indices, kv_lens, first_page, *, num_layers: int, config: KernelConfig, sm_scale: float,
            interpret: bool):
    """q bf16[batch, num_kv_heads, block_h, head_dim], k, v the pools of num_layers layers seen flat,
    first_page i32[1] (None: 0, no operand) -> (acc, m, l) per split."""
    batch, num_kv_heads, block_h, head_dim = q.shape
    num_pages, _, page_size, _ = k.shape  # of all the layers
    pages_per_seq = page_indices.shape[1]
    splits = config.num_splits
    kernel = functools.partial(_bf16_decode_kernel, block_k=config.block_k, num_splits=splits,
                               num_pages=num_pages // num_layers, sm_scale=sm_scale)
    kernel = common.without_operand(kernel, 2, first_page is not None)
    page_table_spec = pl.BlockSpec((None, pages_per_seq), lambda b, h, s: (b, 0))
    kv_lens_spec = pl.BlockSpec((1,), lambda b, h, s: (b,))
    first_page_spec = pl.BlockSpec((1,), lambda b, h, s: (0,))
    q_spec = pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0))
    # The whole pool of kv head h: on Triton a block is a base pointer, not a copy.
    pool_spec = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda b, h, s: (0, h, 0, 0))
    acc_spec = pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, s: (b, h, s, 0, 0))
    row_spec = pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0))
    return common.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, splits),
        in_specs=[page_table_spec, kv_lens_spec] + [first_page_spec] * (first_page is not None)
                 + [q_spec, pool_spec, pool_spec],
        out_specs=[acc_spec, row_spec, row_spec],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, block_h, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, block_h), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, block_h), jnp.float32),
        ],
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        name="bf16_decode_attention",
    )(page_indices, kv_lens, *([] if first_page is None else [first_page]), q, k, v)


@common.quiet
def bf16_decode_attention(q, k, v, page_indices, kv_lens, *, config: KernelConfig | None = None, layer_index=None,
                          interpret: bool = False):
    """Decode attention over a paged bf16 cache.

    Args:
      q: float[batch, num_q_heads, head_dim], one query token per sequence.
      k, v: bf16[num_pages, num_kv_heads, page_size, head_dim] (DESIGN.md kv_format="bf16").
      page_indices: i32[batch, pages_per_seq]; token t of sequence b is in page
        page_indices[b, t // page_size], slot t % page_size.
      kv_lens: i32[batch], valid tokens per sequence (0 -> output 0).
      config: tiles and launch parameters; None -> `default_config(...)` for these shapes.
      layer_index: None, or an int / i32 scalar i: then k, v carry a leading num_layers axis
        (bf16[L, num_pages, ...], a stacked cache) and the kernel reads layer i's pages in place
        (common.stacked_view); page ids stay layer-local.
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      f32[batch, num_q_heads, head_dim].

    Raises:
      ValueError on inconsistent shapes or dtypes, or a config that does not fit them.
    """
    if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float[batch, num_q_heads, head_dim], got {q.shape=} {q.dtype=}")
    batch, num_q_heads, head_dim = q.shape
    view = common.stacked_view((k, v), layer_index, batch=batch)
    num_pages, num_kv_heads, page_size, _ = common.check_paged_bf16(head_dim, num_q_heads, batch, *view.layer,
                                                                    page_indices)
    if kv_lens.shape != (batch,) or kv_lens.dtype != jnp.int32:
        raise ValueError(f"kv_lens must be i32[batch], got {kv_lens.shape=} {kv_lens.dtype=} ({batch=})")
    pages_per_seq = page_indices.shape[1]
    if config is None:
        config = default_config(batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq)
    if not common.is_pow2(config.block_k) or config.block_k < 16 or config.num_splits < 1:
        raise ValueError(f"config.block_k must be a power of two >= 16 and num_splits >= 1, got {config=}")
    first_page = None if view.offsets is None else view.offsets[:1]
    return _bf16_decode(q, *view.flat, page_indices, kv_lens, first_page, num_layers=view.num_layers,
                        config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_layers", "config", "interpret"))
def _bf16_decode(q, k, v, page_indices, kv_lens, first_page, *, num_layers, config, interpret):
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k.shape
    pages_per_seq = page_indices.shape[1]
    group = num_q_heads // num_kv_heads
    block_h = max(16, pl.next_power_of_2(group))
    q_g = q.astype(jnp.bfloat16).reshape(batch, num_kv_heads, group, head_dim)
    q_g = jnp.pad(q_g, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))  # bf16[batch, kvh, block_h, d]
    capacity = pages_per_seq * page_size
    kv_lens = jnp.clip(kv_lens, 0, capacity)
    if config.block_k > page_size:  # whole tiles of page ids, also past the last page
        pages_per_block = config.block_k // page_size
        page_indices = jnp.pad(page_indices, ((0, 0), (0, -pages_per_seq % pages_per_block)))

    acc, m, l = _launch(q_g, k, v, page_indices, kv_lens, first_page, num_layers=num_layers, config=config,
                        sm_scale=1.0 / math.sqrt(head_dim), interpret=interpret)
    out = common.lse_combine(m[..., :group], l[..., :group], acc[..., :group, :], 2)  # [b, kvh, g, d]
    return out.reshape(batch, num_q_heads, head_dim)
