"""HACK decode attention (2-bit kivi cache, scale-folded f16 operands) as a Gluon kernel: one warp per program,
explicit mma_v2 layouts (pallas_kernels/gluon_decode_kernel.py), launched by pallas_kernels/gluon_launch.py.
`impl="gluon"` in hack_jax.attention.

What it computes: the folded_f16 mode of pallas_kernels.decode_attention (its docstring) over the sealed blocks,
by the codes; the sinks and the 16-bit open region (in a program of their own per sequence and kv head, beside
the splits over the sealed groups) as bf16 rows against q and the softmax weights split into two bf16 parts
(~16-bit products; open_k / sink_k of another float dtype are rounded to bf16 first); the per-program partials
merged by common.combine_splits. A full open region is read as sealed (the Pallas kernel's open_full=False). It
needs a CUDA GPU with Triton >= 3.6 (`triton.experimental.gluon`); shapes are restricted to what the kernel
covers.

Shapes (the arrays of pallas_kernels.decode_attention.hack_decode_attention, whose call form this copies):
  q f32|bf16|f16[S, Hq, 128]; k_codes u8[N, H, page_size // 4, 128]; k_scale, k_min f16[N, H, bpp, 128];
  v_codes u8[N, H, 128, page_size // 4]; v_scale, v_min f16[N, H, page_size, 2]; open_k, open_v bf16[S, H, W,
  128]; sink_k, sink_v bf16[S, H, ns, 128] (or None with ns = 0); page_indices i32[S, pps]; kv_lens i32[S].
  k_sums / v_sums: not read (None allowed). Restrictions: bits 2, partition_size 64, head_dim 128, float16
  metadata, Hq / H <= 8; with the sinks and open region in the kernel (open_in_kernel, the default) ns <= 16 and
  W 64 (None: 64); otherwise the layout's own (page_size a multiple of 4 * 64, W a power-of-two multiple of 64
  dividing page_size).
"""
from __future__ import annotations

import functools
import importlib.util
import math

import jax
import jax.numpy as jnp

from pallas_kernels import common

NUM_SMS = 132  # H100 and H200
# the kernel's pointer parameters (gluon_decode_kernel.hack_gluon_decode_kernel), in order, with q as f32 (the
# launch through JAX takes each operand's own dtype)
SIGNATURE = (("kv_lens_ptr", "*i32"), ("page_indices_ptr", "*i32"), ("q_ptr", "*fp32"), ("k_codes_ptr", "*u8"),
             ("k_scale_ptr", "*fp16"), ("k_min_ptr", "*fp16"), ("v_codes_ptr", "*u8"), ("v_scale_ptr", "*fp16"),
             ("v_min_ptr", "*fp16"), ("open_k_ptr", "*bf16"), ("open_v_ptr", "*bf16"), ("sink_k_ptr", "*bf16"),
             ("sink_v_ptr", "*bf16"), ("acc_ptr", "*fp32"), ("m_ptr", "*fp32"), ("l_ptr", "*fp32"))
# staging of each packing group's tiles -> the kernel's ASYNC (page ids always one group ahead): "direct" loads
# into registers; "operand": single cp.async buffers, the group's V tile
# and per-token metadata copied during its QK^T, the next group's K tile and K scales during its PV (the fastest
# measured, bench/NOTES_gluon.md)
STAGING = {"direct": 2, "operand": 21}
PROGRAMS_PER_SM = 8  # one warp each at 255 registers ("operand" staging's ~20 KiB of shared memory allow 11)


def _has_gluon() -> bool:
    """Whether `triton.experimental.gluon` is importable (find_spec imports the parent packages)."""
    try:
        return importlib.util.find_spec("triton.experimental.gluon") is not None
    except ImportError:  # no triton, or one without `experimental`
        return False


def default_num_splits(batch: int, num_kv_heads: int, num_groups: int) -> int:
    """Splits per (sequence, kv head): one wave of PROGRAMS_PER_SM one-warp programs per SM, at least one packing
    group each. The sinks' and open region's program comes on top (it is short: it takes a slot left free, or one
    that a short program frees); one split fewer would lengthen the longest split by a group where the groups
    divide evenly (1 x 32K: 128 groups), so none is given up for it, even where its row takes the partials past
    what common.combine_splits merges in one kernel (batch 1: 129 rows, merged by lse_combine)."""
    slots = NUM_SMS * PROGRAMS_PER_SM
    return max(1, min(num_groups, slots // max(1, batch * num_kv_heads)))


def kernel_constexprs(*, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, pages_per_seq: int,
                      num_pages: int, num_sink_tokens: int, window: int, num_splits: int, async_mode: int,
                      dense: int = 3, rows: int | None = None) -> dict:
    """The kernel's constexpr parameters (also used by bench/gluon_offline.py and bench/gluon_harness.py);
    async_mode: its ASYNC (STAGING's values; the other modes of the kernel's docstring are reached only from the
    bench tools); dense: the kernel's DENSE (3: the sinks, at most 16, and the open region in one more program per
    sequence and kv head, after the splits; 2: in the first program, before its sealed groups; 0: not at all);
    rows: the partials' rows (None: one per program)."""
    if dense not in (0, 2, 3):
        raise ValueError(f"dense must be 0, 2 or 3, got dense={dense!r}")
    if dense and num_sink_tokens > 16:
        raise ValueError(f"the kernel attends to at most 16 sink tokens itself, got {num_sink_tokens=} with {dense=}")
    programs = num_splits + (dense == 3)
    if rows is not None and rows < programs:
        raise ValueError(f"rows must hold one row per program ({programs}), got {rows=}")
    return dict(H=num_kv_heads, QPK=num_q_heads // num_kv_heads, D=head_dim, P=64, PAGE=page_size, PPS=pages_per_seq,
                NUM_PAGES=num_pages, NS=num_sink_tokens, W=window, SPLITS=num_splits,
                QK_SCALE=math.log2(math.e) / math.sqrt(head_dim), ASYNC=async_mode,
                DENSE=int(dense), ROWS=programs if rows is None else rows,
                OPAD=common.q_per_kv_pad(num_q_heads // num_kv_heads))


def _open_state(q, open_k, open_v, sink_k, sink_v, kv_lens, *, num_sink_tokens, window, pages_per_seq, page_size):
    """float32 attention of q over the sinks and the open region: (acc [S, H, pad, D], m base 2, l [S, H, pad]),
    pad = common.q_per_kv_pad(query heads per kv head), the kernel's OPAD."""
    S, Hq, D = q.shape
    H = open_k.shape[1]
    G = Hq // H
    ns, W = num_sink_tokens, window
    after = jnp.clip(kv_lens - ns, 0, pages_per_seq * page_size)
    num_open = after - (after // W) * W  # tokens in the open region
    qg = q.astype(jnp.float32).reshape(S, H, G, D) * (math.log2(math.e) / math.sqrt(D))
    ks, vs, valid = [open_k.astype(jnp.float32)], [open_v.astype(jnp.float32)], [
        jnp.arange(W)[None, :] < num_open[:, None]]
    if ns:
        ks.append(sink_k.astype(jnp.float32))
        vs.append(sink_v.astype(jnp.float32))
        valid.append(jnp.arange(ns)[None, :] < jnp.minimum(kv_lens, ns)[:, None])
    ok = jnp.concatenate(valid, 1)[:, None, None, :]  # [S, 1, 1, T]
    # rows past a sequence's sinks / open tokens may hold anything (NaN): zeroed, not only masked
    k, v = (jnp.where(ok[:, :, 0, :, None], jnp.concatenate(x, 2), 0.0) for x in (ks, vs))  # [S, H, T, D]
    s = jnp.where(ok, jnp.einsum("shgd,shtd->shgt", qg, k, precision="highest"), -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.exp2(s - jnp.where(m > -jnp.inf, m, 0.0)[..., None])
    acc = jnp.einsum("shgt,shtd->shgd", p, v, precision="highest")
    pad = common.q_per_kv_pad(G) - G
    return (jnp.pad(acc, ((0, 0), (0, 0), (0, pad), (0, 0))),
            jnp.pad(m, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf),
            jnp.pad(jnp.sum(p, axis=-1), ((0, 0), (0, 0), (0, pad))))


@functools.partial(jax.jit, static_argnames=("num_sink_tokens", "window", "num_splits", "maxnreg", "staging",
                                             "open_in_kernel", "launch"))
def _gluon_decode(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, open_k, open_v, sink_k, sink_v,
                  page_indices, kv_lens, *, num_sink_tokens, window, num_splits, maxnreg, staging,
                  open_in_kernel, launch):
    from pallas_kernels.gluon_decode_kernel import hack_gluon_decode_kernel
    from pallas_kernels.gluon_launch import gluon_call
    S, Hq, D = q.shape
    N, H, quarter, _ = k_codes.shape
    page_size, pps = 4 * quarter, page_indices.shape[1]
    opad = common.q_per_kv_pad(Hq // H)
    programs = num_splits + open_in_kernel  # the sinks and open region: a program of their own
    rows = common.split_slots(programs, opad, D) if open_in_kernel else programs
    consts = kernel_constexprs(num_q_heads=Hq, num_kv_heads=H, head_dim=D, page_size=page_size, pages_per_seq=pps,
                               num_pages=N, num_sink_tokens=num_sink_tokens, window=window, num_splits=num_splits,
                               async_mode=STAGING[staging], dense=3 if open_in_kernel else 0,
                               rows=rows)
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        q = q.astype(jnp.float32)
    sinks = (sink_k, sink_v) if num_sink_tokens else (open_k, open_v)  # ns 0: any bf16 array, not read
    dense = [x if x.dtype == jnp.bfloat16 else x.astype(jnp.bfloat16) for x in (open_k, open_v) + sinks]
    shape = (S, H, rows, opad)
    acc, m, l = gluon_call(
        hack_gluon_decode_kernel, kv_lens, page_indices, q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, *dense,
        out_shapes=[jax.ShapeDtypeStruct(shape + (D,), jnp.float32), jax.ShapeDtypeStruct(shape, jnp.float32),
                    jax.ShapeDtypeStruct(shape, jnp.float32)],
        grid=(S, H, programs), constexprs=consts, num_warps=1, maxnreg=maxnreg, name="hack_gluon_decode",
        launch=launch)
    if open_in_kernel:
        return common.combine_splits(acc, m, l, Hq, programs=programs)
    acc_o, m_o, l_o = _open_state(q, open_k, open_v, sink_k, sink_v, kv_lens, num_sink_tokens=num_sink_tokens,
                                  window=window, pages_per_seq=pps, page_size=page_size)
    acc = jnp.concatenate([acc, acc_o[:, :, None]], 2)
    m = jnp.concatenate([m, m_o[:, :, None] * math.log(2.0)], 2)
    l = jnp.concatenate([l, l_o[:, :, None]], 2)
    return common.combine_splits(acc, m, l, Hq)


def hack_gluon_decode_attention(q, k_codes, k_scale=None, k_min=None, k_sums=None, v_codes=None, v_scale=None,
                                v_min=None, v_sums=None, open_k=None, open_v=None, sink_k=None, sink_v=None,
                                page_indices=None, kv_lens=None, *, partition_size: int | None = None,
                                num_sink_tokens: int | None = None, window: int | None = None,
                                num_splits: int | None = None, maxnreg: int | None = None, staging: str = "operand",
                                open_in_kernel: bool = True, launch: str = "auto", bits: int = 2):
    """Scale-folded HACK decode attention by the Gluon kernel (module docstring); f32[S, Hq, D].

    Arrays and static ints as pallas_kernels.decode_attention.hack_decode_attention. num_splits: programs over the
    sealed groups per (sequence, kv head), beside the sinks' and open region's program (None:
    `default_num_splits`); maxnreg: a register cap for the kernel (None: none); staging: how each packing group's
    tiles reach the warp (STAGING's keys: "operand" single buffers by cp.async, "direct" loads into registers);
    open_in_kernel: the sinks (at most 16) and the open region (window 64) attended by the kernel (False: by
    float32 jnp here, any ns and window, for comparison); launch: the custom call (gluon_launch.gluon_call:
    "auto", "ffi", "legacy").

    Raises:
      ValueError: shapes or dtypes off the kivi layout, outside the kernel's coverage (module docstring: more
        than 16 sinks or a window other than 64 with open_in_kernel among them), or bad num_splits / maxnreg /
        staging / open_in_kernel / launch.
      NotImplementedError: bits other than 2; no `triton.experimental.gluon` (Triton < 3.6 or none).
      RuntimeError: no CUDA GPU (the kernel has no interpret mode).
    """
    common.require_2bit("hack_gluon_decode_attention", bits)
    if partition_size != 64:
        raise ValueError(f"the gluon kernel needs partition_size=64, got {partition_size=}")
    page_indices, kv_lens = common.as_index_arrays(page_indices, kv_lens)
    common.check_kivi_inputs(q, k_codes, k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v,
                             sink_k, sink_v, page_indices, kv_lens, partition_size=partition_size,
                             num_sink_tokens=num_sink_tokens, window=window)
    S, Hq, D = q.shape
    H, page_size = k_codes.shape[1], 4 * k_codes.shape[2]
    if D != 128 or Hq // H > 8:
        raise ValueError(f"the gluon kernel covers head_dim 128 and at most 8 query heads per kv head, got "
                         f"head_dim={D}, {Hq // H} query heads per kv head")
    bad = [f"{n}={a.dtype}" for n, a in (("k_scale", k_scale), ("k_min", k_min), ("v_scale", v_scale),
                                         ("v_min", v_min)) if a.dtype != jnp.float16]
    if bad:
        raise ValueError(f"the gluon kernel needs float16 block metadata, got {', '.join(bad)}")
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got num_splits={num_splits!r}")
    common.check_maxnreg(maxnreg)
    if not isinstance(staging, str) or staging not in STAGING:
        raise ValueError(f"staging must be one of {sorted(STAGING)}, got staging={staging!r}")
    if not isinstance(open_in_kernel, bool):
        raise ValueError(f"open_in_kernel must be a bool, got open_in_kernel={open_in_kernel!r}")
    if open_in_kernel and (num_sink_tokens or 0) > 16:
        raise ValueError(f"the gluon kernel attends to at most 16 sink tokens itself, got num_sink_tokens="
                         f"{num_sink_tokens}: pass open_in_kernel=False (the sinks and open region in jnp)")
    if open_in_kernel and window not in (None, partition_size):
        raise ValueError(f"the gluon kernel attends to an open region of {partition_size} tokens itself, got "
                         f"window={window}: pass open_in_kernel=False (the sinks and open region in jnp)")
    if launch not in ("auto", "ffi", "legacy"):
        raise ValueError(f"launch must be 'auto', 'ffi' or 'legacy', got launch={launch!r}")
    if jax.default_backend() != "gpu":
        raise RuntimeError(f"the gluon kernel runs only on a CUDA GPU (backend: {jax.default_backend()!r})")
    if not _has_gluon():
        raise NotImplementedError("the gluon kernel needs Triton >= 3.6 (triton.experimental.gluon), not installed")
    window = window or partition_size
    groups = page_indices.shape[1] * page_size // 256
    splits = num_splits or default_num_splits(S, H, groups)
    return _gluon_decode(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, open_k, open_v,
                         sink_k if num_sink_tokens else None, sink_v if num_sink_tokens else None, page_indices,
                         kv_lens, num_sink_tokens=num_sink_tokens, window=window, num_splits=splits, maxnreg=maxnreg,
                         staging=staging, open_in_kernel=open_in_kernel, launch=launch)
