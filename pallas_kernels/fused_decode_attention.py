"""HACK decode step in one Pallas kernel: append the new token to the kivi cache and attend, Triton lowering.

Computes what hack_jax.kv_cache.append(..., seal="never") followed by decode_attention.hack_decode_attention
computes, in one kernel launch (plus the split combine, as the plain kernel) instead of the append's four
row scatters (sink_k, sink_v, open_k, open_v) and the attention kernel: the new
token's k / v rows are written into their open-block (or sink) row of the slot through
`input_output_aliases` (the cache arrays are updated in place when the caller donates them), and the
attention over sinks + sealed blocks + open block uses the new rows from registers (the kernel never
reads back what it writes). Everything else is decode_attention.py's kernel, unchanged
(`_hack_decode_kernel`, every dot_dtype and KernelConfig): q is read in its natural
[S, num_q_heads, head_dim] layout with sm_scale applied in-kernel; the split-K partials are merged
by common.combine_splits, as for the plain kernel.

Non-sealing steps only: the caller promises that no active slot fills its open block with this token
(hack_jax.kv_cache.seals_block is False); a slot that does anyway keeps the block unsealed, exactly as
append(seal="never") under jit does. The sealing steps take append(seal="always") + the plain kernel.

Shapes (decode_attention.py's, plus):
  k, v       float[S, num_kv_heads, head_dim]  the new token of each slot (rows of inactive slots ignored)
  kv_lens    i32[S] tokens held *before* this token (this kernel's own convention: the Step's kv_lens
             minus active, as hack_jax.attention.decode_step passes it); active bool[S]
Returns (out f32[S, num_q_heads, head_dim], open_k, open_v, sink_k, sink_v) with the token written:
slot s takes token kv_lens[s] when active[s] and kv_lens[s] >= 0: into sink row kv_lens[s] if
< num_sink_tokens, else open-block row (kv_lens[s] - ns) % P if within the capacity, else nowhere
(dropped, as append does); the attention sees kv_lens + active tokens. write_sinks=False (the caller
promises no token is a sink: kv_cache.writes_sink is False) leaves the sink rows out: sink_k / sink_v
are read, not written, not aliased, and come back as given (append(sinks=False)).

Reference twin: hack_jax.kv_cache.append(seal="never") then decode_attention.hack_decode_attention
(bit-identical cache; the output equal up to the float32 order), reached via
hack_jax.attention.decode_step(..., impl="reference"); tests/test_fused_decode.py also checks the
output against the float64 twin (tests/twin.py).

Stacked caches: with `layer_index` i every cache array carries a leading num_layers axis; the kernel
reads layer i and writes the token into layer i's rows of the stacked open_k ... sink_v (aliased: in
place when donated), decode_attention.py's offsets operand.

Tested: interpret mode on the CPU (jax 0.10.2) passes, the stacked form too (tests/test_stacked_decode.py).
On one NVIDIA H200 (jax 0.11.2, Triton 3.6) the gpu tests of tests/test_fused_decode.py pass since
their NaN comparison was fixed (an earlier failure was the test's, bench/NOTES_generate.md), and so do
the stacked form's (tests/test_stacked_decode.py). In a model (Qwen2.5-7B heads, batch 1) its former
split-combine Pallas kernel (one program per (sequence, kv head) looping over every split) took 27 us per
layer, more than the attention; the combine is XLA's now (not re-measured), and
hack_jax.attention.decode_step fuses only with fuse=True. Caveat: the in-kernel row writes cost registers (ptxas, sm_90: 2 resident programs per SM
instead of the plain kernel's 3, RESIDENT_PROGRAMS_PER_SM); numbers in bench/NOTES_generate.md.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.decode_attention import (DOT_DTYPES, H200_NUM_SMS, DotDtype, KernelConfig, _hack_decode_kernel,
                                             choose_num_splits, resolve_config)
from pallas_kernels import decode_attention

# Programs resident per SM (4 warps): the row writes raise the "int8" kernel from 168 to 182 registers
# (ptxas, sm_90, Triton 3.6, offline: bench/NOTES_generate.md), 2 programs in an SM's 64K registers instead
# of 3; the folded modes were at 2 already.
RESIDENT_PROGRAMS_PER_SM = {"int8": 2, "folded_f16": 2, "folded_bf16": 2}


def _fused_kernel(kv_lens_ref, prev_lens_ref, page_indices_ref, offsets_ref, q_ref, k_ref, v_ref, *refs,
                  num_sink_tokens, partition_size, max_blocks, num_splits, open_split, write_sinks, **kernel_kwargs):
    # kv_lens_ref   i32[S] after this token; prev_lens_ref i32[S] before it
    # offsets_ref   i32[2] (first page, first sequence row) of the layer, or None: _hack_decode_kernel's
    # k_ref, v_ref  float[S, H, D] the new token
    # refs = 8 page-pool refs (k_sums, v_sums None without code sums), open_k, open_v bf16[S, H, W, D],
    #        (sink_k, sink_v bf16[S, H, ns, D] if ns)
    #        + outputs acc, m, l (as _hack_decode_kernel's) + open_k, open_v (, sink_k, sink_v if ns and
    #        write_sinks): aliased
    ns, P = num_sink_tokens, partition_size
    n_cache = 10 + 2 * bool(ns)
    cache_in, (acc_ref, m_ref, l_ref), cache_out = refs[:n_cache], refs[n_cache:n_cache + 3], refs[n_cache + 3:]
    b, h = pl.program_id(0), pl.program_id(1)
    row = b if offsets_ref is None else offsets_ref[1] + b  # the slot's row in the per-sequence arrays
    prev, kv_len = prev_lens_ref[b], kv_lens_ref[b]
    written = (kv_len > prev) & (prev >= 0)  # active; a negative position is dropped, as append does
    to_sink = written & (prev < ns) & write_sinks  # write_sinks=False: a sink token is dropped, as append's
    to_open = written & (prev >= ns) & (prev < ns + max_blocks * P)
    open_row = jnp.where(to_open, (prev - ns) % cache_in[8].shape[2], -1)  # mod W, the open region's length
    sink_row = jnp.where(to_sink, prev, -1)
    dtype = cache_in[8].dtype
    D = k_ref.shape[-1]

    num_channel_groups = kernel_kwargs["num_channel_groups"]
    Pc = D // num_channel_groups

    def open_state(*args):  # runs in the one program of (b, h) that reads the open block and sinks
        rows = lambda ref: [ref[b, h, pl.ds(p * Pc, Pc)].astype(dtype) for p in range(num_channel_groups)]
        new_k, new_v = rows(k_ref), rows(v_ref)

        def write(at, k_out, v_out):  # nothing reads the row back: the attention takes it from registers
            for p in range(num_channel_groups):
                k_out[row, h, at, pl.ds(p * Pc, Pc)] = new_k[p]
                v_out[row, h, at, pl.ds(p * Pc, Pc)] = new_v[p]

        pl.when(to_open)(lambda: write(open_row, cache_out[0], cache_out[1]))
        if ns and write_sinks:
            pl.when(to_sink)(lambda: write(sink_row, cache_out[2], cache_out[3]))
        return common.sinks_and_open_block_state(*args, new_token=(new_k, new_v, open_row, sink_row))

    _hack_decode_kernel(kv_lens_ref, page_indices_ref, offsets_ref, q_ref, *cache_in, acc_ref, m_ref, l_ref,
                        num_sink_tokens=ns, partition_size=P, max_blocks=max_blocks, num_splits=num_splits,
                        open_split=open_split, open_state=open_state, **kernel_kwargs)


@functools.partial(jax.jit, static_argnames=("partition_size", "num_sink_tokens", "num_layers", "config",
                                             "interpret", "bits", "write_sinks"))
def _fused_decode(q, k, v, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                  sink_k, sink_v, page_indices, kv_lens, active, offsets, *, partition_size, num_sink_tokens,
                  num_layers, config, interpret, bits, write_sinks):
    # the arrays of num_layers layers seen flat, offsets picking the layer (decode_attention._hack_decode)
    q = common.kernel_q(q, config)
    batch, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, _, _ = k_codes.shape  # of all the layers
    page_size, num_channel_groups = v_scale.shape[2], v_scale.shape[3]  # [N, H, page_size, NP], as k_sums
    pad = common.q_per_kv_pad(num_q_heads // num_kv_heads,
                              at_least=16 // common.blocks_per_trip(bits, page_size, partition_size))
    programs = config.num_splits + config.open_split
    # the partials' rows (a power of two where combine_splits' kernel merges them); it reads the first `programs`
    out_rows = common.split_slots(programs, pad, head_dim)
    prev = kv_lens.astype(jnp.int32)
    after = prev + active.astype(jnp.int32)  # what the attention sees: append's kv_lens + active
    k_sums, v_scale, v_min = (None if x is None else
                              x.reshape(num_pages, num_kv_heads, page_size // partition_size,
                                        partition_size * num_channel_groups) for x in (k_sums, v_scale, v_min))
    # the page pools (absent code sums: no operand, decode_attention._hack_decode), then the per-sequence rows
    pools = [x for x in (k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums) if x is not None]
    cache = pools + [open_k, open_v]
    writes_sinks = bool(num_sink_tokens) and write_sinks
    written = [open_k, open_v] + ([sink_k, sink_v] if writes_sinks else [])
    if num_sink_tokens:
        cache += [sink_k, sink_v]
    inputs = [after, prev, page_indices.astype(jnp.int32)] + ([] if offsets is None else [offsets])
    inputs += [q, k, v] + cache
    first = len(inputs) - len(cache) + len(pools)  # index of open_k among the inputs
    aliases = {first + i: 3 + i for i in range(len(written))}
    kernel = functools.partial(
        _fused_kernel, partition_size=partition_size, num_channel_groups=num_channel_groups,
        q_per_kv=num_q_heads // num_kv_heads,
        q_per_kv_pad=pad, sm_scale=1.0 / math.sqrt(head_dim),
        num_sink_tokens=num_sink_tokens, num_pages=num_pages // num_layers,
        max_blocks=page_indices.shape[1] * (page_size // partition_size),
        num_splits=config.num_splits, open_split=config.open_split, dot_dtype=config.dot_dtype,
        interpret=interpret, bits=bits, write_sinks=write_sinks, interleaved=config.interleaved,
        denormal=config.denormal)
    # ref positions of v_sums, k_sums (behind the 7 refs before the cache) and offsets, highest first
    kernel = common.without_operand(kernel, 14, v_sums is not None)
    kernel = common.without_operand(kernel, 10, k_sums is not None)
    kernel = common.without_operand(kernel, 3, offsets is not None)
    out_shape = [jax.ShapeDtypeStruct((batch, num_kv_heads, out_rows, pad, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, num_kv_heads, out_rows, pad), jnp.float32),
                 jax.ShapeDtypeStruct((batch, num_kv_heads, out_rows, pad), jnp.float32)]
    out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in written]
    out_specs = [pl.BlockSpec((None, None, None, pad, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, pad), lambda b, h, s: (b, h, s, 0)),
                 pl.BlockSpec((None, None, None, pad), lambda b, h, s: (b, h, s, 0))]
    out_specs += [common.full_spec(x) for x in written]
    acc, m, l, *new = common.pallas_call(
        kernel, out_shape=out_shape, grid=(batch, num_kv_heads, programs),
        in_specs=[common.full_spec(x) for x in inputs], out_specs=out_specs,
        num_warps=config.num_warps, num_stages=config.num_stages, interpret=interpret,
        input_output_aliases=aliases, name="hack_fused_decode_attention",
        maxnreg=config.maxnreg)(*inputs)
    sinks = tuple(new[2:]) if writes_sinks else (sink_k, sink_v)
    out = common.combine_splits(acc, m, l, num_q_heads, programs=programs, interpret=interpret)
    return (out, new[0], new[1]) + sinks


def default_config(*, batch: int, num_kv_heads: int, pages_per_seq: int, page_size: int, partition_size: int,
                   dot_dtype: DotDtype = "int8", num_sms: int = H200_NUM_SMS, bits: int = 2) -> KernelConfig:
    """decode_attention.default_config's split choice with this kernel's RESIDENT_PROGRAMS_PER_SM."""
    if dot_dtype not in DOT_DTYPES:
        raise ValueError(f"dot_dtype must be one of {DOT_DTYPES}, got {dot_dtype=}")
    trips = max(1, pages_per_seq * page_size // (common.blocks_per_trip(bits, page_size, partition_size)
                                                 * partition_size))
    splits, open_split = choose_num_splits(batch * num_kv_heads, trips, RESIDENT_PROGRAMS_PER_SM[dot_dtype] * num_sms)
    return KernelConfig(num_splits=splits, open_split=open_split, dot_dtype=dot_dtype,
                        denormal=dot_dtype == "folded_f16" and bits == 2)


@common.quiet
def hack_fused_decode_attention(q, k, v, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums,
                                open_k, open_v, sink_k, sink_v, page_indices, kv_lens, active, *,
                                partition_size: int, num_sink_tokens: int, v_group: int | None = None,
                                window: int | None = None, bits: int = 2, dot_dtype: DotDtype = "int8",
                                num_splits: int | None = None, num_stages: int | None = None,
                                num_warps: int | None = None, config: KernelConfig | None = None,
                                layer_index=None, write_sinks: bool = True, interleaved: bool = False,
                                denormal: bool | None = None, maxnreg: int | None = None,
                                interpret: bool = False):
    """Append one token per active slot and attend (module docstring; shapes there).

    Args:
      q: float[batch, num_q_heads, head_dim]; k, v: float[batch, num_kv_heads, head_dim], the new token.
      k_codes ... sink_v: the cache arrays of one layer (decode_attention.py); sink_k / sink_v may be None
        when num_sink_tokens == 0; k_sums / v_sums may be None with a folded dot_dtype (no code sums).
      page_indices: i32[batch, pages_per_seq]; kv_lens: i32[batch] tokens held before this token;
        active: bool[batch].
      partition_size, num_sink_tokens, v_group, window, bits, dot_dtype, num_splits, num_stages, num_warps,
        config, layer_index, interleaved, denormal, maxnreg, interpret: as decode_attention.hack_decode_attention;
        config None:
        `default_config` (this kernel's occupancy).
        With layer_index i (a stacked cache) the token is written into layer i's rows of the stacked
        open_k ... sink_v, in place when the caller donates them.
      write_sinks: False: the caller promises no active slot's token is a sink (module docstring); sink_k /
        sink_v are only read and come back as given.

    Returns:
      (out f32[batch, num_q_heads, head_dim], open_k, open_v, sink_k, sink_v), the last four in their
      input dtypes and shapes with the token written (sink_k / sink_v as given when num_sink_tokens == 0 or
      not write_sinks).

    Raises:
      ValueError: shapes/dtypes off the layout (as hack_decode_attention), k / v not
        float[batch, num_kv_heads, head_dim], active not bool[batch]; dot_dtype "int8" without code sums.
    """
    page_indices, kv_lens, active = common.as_index_arrays(page_indices, kv_lens, active)
    cache = (k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v, sink_k, sink_v)
    view = common.stacked_view(cache, layer_index, batch=q.shape[0])
    common.check_kivi_inputs(q, *view.layer, page_indices, kv_lens, partition_size=partition_size,
                             num_sink_tokens=num_sink_tokens, v_group=v_group, window=window, bits=bits)
    k_codes, per_token = view.layer[0], view.layer[5]  # per_token: v_scale [N, H, page_size, NP]
    want = (q.shape[0], k_codes.shape[1], q.shape[2])
    for name, x in (("k", k), ("v", v)):
        if not hasattr(x, "shape") or tuple(x.shape) != want or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be float{list(want)} (the new token per slot), got "
                             f"{getattr(x, 'shape', type(x).__name__)} {getattr(x, 'dtype', '')}")
    if active.shape != (q.shape[0],) or active.dtype != jnp.bool_:
        raise ValueError(f"active must be bool[{q.shape[0]}], got {active.shape=} {active.dtype=}")
    if config is None:
        config = default_config(batch=q.shape[0], num_kv_heads=k_codes.shape[1], pages_per_seq=page_indices.shape[1],
                                page_size=per_token.shape[2], partition_size=partition_size, dot_dtype=dot_dtype,
                                bits=bits)
    config = resolve_config(q, k_codes, per_token, page_indices, partition_size=partition_size, num_splits=num_splits,
                            config=config, bits=bits, interleaved=interleaved, num_stages=num_stages,
                            num_warps=num_warps, denormal=denormal, maxnreg=maxnreg)
    if config.dot_dtype == "int8":
        common.require_code_sums("hack_fused_decode_attention", config.dot_dtype, k_sums, v_sums)
    out, *written = _fused_decode(q, k, v, *view.flat, page_indices, kv_lens, active, view.offsets,
                                  partition_size=partition_size, num_sink_tokens=num_sink_tokens,
                                  num_layers=view.num_layers, config=config, interpret=interpret, bits=bits,
                                  write_sinks=bool(write_sinks))
    return (out,) + tuple(x if x is None or x.shape == y.shape else x.reshape(y.shape)
                          for x, y in zip(written, cache[8:]))
