"""THE attention dispatch point: decode and prefill attention over a paged cache layer.

Models hold a hack_jax.backend.Backend and call its `prefill` / `decode` once per layer; it writes the
fresh K/V and attends through this module's `prefill_attention` / `decode_step` (append + decode
attention, fused into one kernel call on request) (STYLE.md rule 11). `impl` picks:
  "reference": pure jnp, jit-able, vectorized over sequences and blocks.
    kv_format="hack": the paged homomorphic reference. Codes, metadata and sums are read from the
      pages through page_indices (`kv_cache.read_blocks`, which zeroes everything beyond a
      sequence's length and derives the sums from the codes where the cache stores none), then
      hack_jax.reference's per-segment steps run the exact DESIGN.md
      "Homomorphic attention semantics" (HACK.md §3-§5): sinks, the sealed blocks in order
      (`lax.scan`, each step vmapped over sequences and kv heads), the open block, one online
      softmax. This is the twin the Pallas kernels are tested against, code for code.
    "bf16" / "float32" / "int8" / "fp8" / "kivi2" / "int4" / "turbo*": dequantize the pages
      (`kv_cache.dequantize_cache`), then dense float32 attention.
  "pallas": the GPU kernels, imported lazily from `pallas_kernels` (models never import them);
    NotImplementedError names the missing kernel when a format has none.
  "pallas_dequant": the fused-dequantization baseline kernel on the same hack cache (HACK.md §7:
    same bytes read, codes dequantized in registers, float math), for benchmarks and comparisons.
  "triton": decode on the hack kivi cache with scale-folded f16 operands, a jax-triton kernel
    (pallas_kernels.triton_decode_attention; needs the `cuda` extra).
  "gluon": the same decode as a Gluon kernel (one warp per program, explicit layouts, cp.async staging;
    pallas_kernels.gluon_decode_attention; needs Triton >= 3.6 on a CUDA GPU): 2-bit codes, partition_size 64,
    head_dim 128, no window beyond the open block, no V channel group of its own.

Query positions. decode: one query per sequence at position kv_lens[s] - 1 (kv_lens include the
token just appended). prefill: q is left-aligned like write_prefill's k/v: row t of sequence s is
the query at position q_start[s] + t (q_start default 0: a whole prompt; > 0: the next chunk of a
chunked prefill, whose earlier tokens are already cached) and sees keys at positions <= its own;
rows with q_start[s] + t >= kv_lens[s] see nothing and return 0 (right padding of a ragged batch).
Sequences with kv_lens 0 return 0.

V rotation (QuantConfig.v_rotation, hack_jax.rotation): the cache holds V R; every function here
returns the output rotated back (out R, R its own inverse), once per call outside the kernels, and
cached_prefix_state's accumulator likewise, so callers never see the rotated basis.
K and V rotation (kv_format "int4" / "turbo*", QuantConfig.rotation): the cache holds K M and V M
(M = kv_cache.kv_rotation(layer), orthogonal); q is multiplied by M before the reference or the
kernel sees it (qM . kM = q . k) and the output (accumulator) by M^T, outside the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import kv_cache, paging, reference, rotation
from hack_jax.kv_cache import stacked
from hack_jax.rotation import rotate_v
from hack_jax.step import Step

Impl = Literal["reference", "pallas", "pallas_dequant", "triton", "gluon"]
IMPLS = get_args(Impl)
_HIGHEST = jax.lax.Precision.HIGHEST

# (module, function) of the Pallas kernel per (impl, kind, kv_format); called as fn(q, *arrays,
# page_indices, kv_lens, **static, **kernel_options) with (arrays, static) = kernel_args(layer);
# prefill kernels also get q_start=i32[max_seqs] (keyword).
_PALLAS = {
    ("pallas", "decode", "hack"): ("pallas_kernels.decode_attention", "hack_decode_attention"),
    ("pallas", "decode", "bf16"): ("pallas_kernels.bf16_decode_attention", "bf16_decode_attention"),
    ("pallas", "decode", "fp8"): ("pallas_kernels.fp8_decode_attention", "fp8_decode_attention"),
    ("pallas", "decode", "int8"): ("pallas_kernels.int8_decode_attention", "int8_decode_attention"),
    ("pallas", "decode", "kivi2"): ("pallas_kernels.kivi2_decode_attention", "kivi2_decode_attention"),
    ("pallas", "decode", "int4"): ("pallas_kernels.nibble_decode_attention", "int4_decode_attention"),
    ("pallas", "decode", "turbo3"): ("pallas_kernels.nibble_decode_attention", "turbo_decode_attention"),
    ("pallas", "decode", "turbo4"): ("pallas_kernels.nibble_decode_attention", "turbo_decode_attention"),
    ("pallas", "prefill", "hack"): ("pallas_kernels.prefill_attention", "hack_prefill_attention"),
    ("pallas", "prefill", "bf16"): ("pallas_kernels.bf16_prefill_attention", "bf16_prefill_attention"),
    ("pallas_dequant", "decode", "hack"): ("pallas_kernels.dequant_decode_attention",
                                           "dequant_decode_attention"),
    # scale-folded operands, jax-triton (the `cuda` extra); kv_format="hack" kivi decode only
    ("triton", "decode", "hack"): ("pallas_kernels.triton_decode_attention", "hack_triton_decode_attention"),
    # the same as a Gluon kernel (Triton >= 3.6, CUDA); kv_format="hack" kivi decode only
    ("gluon", "decode", "hack"): ("pallas_kernels.gluon_decode_attention", "hack_gluon_decode_attention"),
}
_WINDOW_KERNELS = {("pallas", "decode")}  # the (impl, kind) whose kivi kernels take QuantConfig.window
# ... and 4-bit codes (QuantConfig.bits); the fused decode kernel too
_BITS_KERNELS = {("pallas", "decode"), ("pallas", "prefill")}


def decode_attention(q, layer: kv_cache.LayerCache, *, page_indices, kv_lens, impl="reference",
                     **kernel_options):
    """Attention of one new query token per sequence over its cached keys.

    Args:
      q: float[max_seqs, num_q_heads, head_dim]; query head h uses kv head
        h // (num_q_heads // num_kv_heads). sm_scale = 1 / sqrt(head_dim).
      layer: a LayerCache (any kv_format) holding the sequences, new token included.
      page_indices: i32[max_seqs, pages_per_seq]; kv_lens: i32[max_seqs] (the new token included).
      impl: "reference" | "pallas" | "pallas_dequant" | "triton" | "gluon".
      kernel_options: passed to the Pallas kernel (e.g. interpret=True); only with a Pallas impl.
    Returns f32[max_seqs, num_q_heads, head_dim] (0 for kv_lens 0).
    Raises ValueError on an unknown impl or inconsistent shapes, and (concrete, non-traced inputs
    only: inside jit the allocator is the check) on kv_lens outside [0, capacity], or a live
    page-table column (one holding tokens < kv_len) at an id outside [0, num_pages), at the null page
    or shared with another live column (paging.validate_page_indices; dead columns are never read);
    TypeError for non-integer page_indices / kv_lens; NotImplementedError when a Pallas impl has no
    kernel for the layer's format; ValueError for impl="pallas" / "pallas_dequant" off a GPU without
    interpret=True. A NaN in q (or, under jit, in the cached K/V) gives NaN rows, never 0.
    """
    q = jnp.asarray(q)
    if q.ndim != 3:
        raise ValueError(f"decode q must be [max_seqs, num_q_heads, head_dim], got {q.shape=}")
    page_indices, kv_lens = _check(q[:, None], layer, page_indices, kv_lens, impl, kernel_options)
    q = _rotate_q(q, layer)
    if impl != "reference":
        kernel = _pallas(impl, "decode", layer)  # NotImplementedError first for a layout without kernels
        arrays, static = kernel_args(layer)
        out = _run_kernel(impl, kernel, q, *arrays, page_indices, kv_lens, **static, **kernel_options)
    else:
        out = _reference(q[:, None], layer, page_indices, kv_lens, None, decode=True)[:, 0]
    return _unrotate(out, layer)


def prefill_attention(q, layer: kv_cache.LayerCache, *, page_indices, kv_lens, q_start=None,
                      impl="reference", **kernel_options):
    """Attention of prompts (or prompt chunks) over the cache contents (write_prefill): the
    "homomorphic" prefill of hack_jax.prefill, the paper's numerics.

    NOT causal for kv_format="hack": a query reads its own sealed P-token block as 2-bit codes whose
    per-channel min/max over the block (kivi: K's; seed: V's) include the block's later tokens, so
    changing a later token of the block moves earlier rows (issue 17.2). The position mask is causal; the quantization is not. The
    default model prefill (hack_jax.prefill, attention="auto") is exact and causal: it attends the
    fresh tokens on their 16-bit K/V. The baseline formats (bf16 / float32 / int8: per token) are
    causal here.

    Args:
      q: float[max_seqs, T, num_q_heads, head_dim], left-aligned: row t is the query at position
        q_start[s] + t (module docstring).
      layer, page_indices, impl, kernel_options: as in decode_attention.
      kv_lens: i32[max_seqs] tokens held per sequence, this chunk included (the prompt lengths for
        a fresh prefill; q_start + chunk lengths for a chunk).
      q_start: i32[max_seqs] position of query row 0 (the tokens cached before this chunk, the
        `start` given to write_prefill), or None = 0.
    Returns f32[max_seqs, T, num_q_heads, head_dim]; rows with q_start[s] + t >= kv_lens[s] are 0.
    Raises as decode_attention (and ValueError for a q_start that is not [max_seqs] or, when
    concrete, negative; TypeError for a non-integer q_start).
    """
    q = jnp.asarray(q)
    if q.ndim != 4:
        raise ValueError(f"prefill q must be [max_seqs, T, num_q_heads, head_dim], got {q.shape=}")
    page_indices, kv_lens = _check(q, layer, page_indices, kv_lens, impl, kernel_options)
    paging.check_index_dtype("prefill_attention", q_start=q_start)
    q_start = jnp.zeros_like(kv_lens) if q_start is None else jnp.asarray(q_start, jnp.int32)
    if q_start.shape != kv_lens.shape:
        raise ValueError(f"q_start must be i32[{kv_lens.shape[0]}], got {q_start.shape=}")
    if not isinstance(q_start, jax.core.Tracer) and q_start.size and int(q_start.min()) < 0:
        raise ValueError(f"q_start must be >= 0: q_start={np.asarray(q_start).tolist()}")
    q = _rotate_q(q, layer)
    if impl != "reference":
        kernel = _pallas(impl, "prefill", layer)  # NotImplementedError first for a layout without kernels
        arrays, static = kernel_args(layer)
        out = _run_kernel(impl, kernel, q, *arrays, page_indices, kv_lens, q_start=q_start, **static,
                          **kernel_options)
    else:
        out = _reference(q, layer, page_indices, kv_lens, q_start, decode=False)
    return _unrotate(out, layer)


def _unrotate(out, layer):
    """The attention output (or an unnormalized accumulator) of a layer with config.v_rotation, or of
    an int4 / turbo layer, back in V's own basis (module docstring); unchanged without rotation."""
    m = _kv_matrix(layer)
    return rotate_v(out, layer.config.v_rotation) if m is None else rotation.apply(out, m.T)


def _kv_matrix(layer):
    """M of an int4 / turbo layer (kv_cache.kv_rotation), else None."""
    return kv_cache.kv_rotation(layer) if isinstance(layer, (kv_cache.Int4Pages, kv_cache.TurboPages)) else None


def _rotate_q(q, layer):
    """q [..., head_dim] in the basis of an int4 / turbo layer's keys (q M); unchanged otherwise."""
    m = _kv_matrix(layer)
    return q if m is None else rotation.apply(q, m)


def _check(q, layer, page_indices, kv_lens, impl, kernel_options):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl=}")
    if kernel_options and impl == "reference":
        raise ValueError(f"kernel options only apply to the Pallas impls: {sorted(kernel_options)}")
    if not isinstance(layer, get_args(kv_cache.LayerCache)):
        raise ValueError(f"layer must be a kv_cache LayerCache, got {type(layer).__name__}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating, got {q.dtype=}")
    s, _, num_q_heads, head_dim = q.shape
    if head_dim != layer.head_dim or num_q_heads % layer.num_kv_heads:
        raise ValueError(f"q does not match the cache (num_kv_heads={layer.num_kv_heads}, "
                         f"head_dim={layer.head_dim}): {q.shape=}")
    paging.check_index_dtype("attention", page_indices=page_indices, kv_lens=kv_lens)
    page_indices = jnp.asarray(page_indices, jnp.int32)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    if page_indices.ndim != 2 or page_indices.shape[0] != s or kv_lens.shape != (s,):
        raise ValueError(f"batch mismatch: {q.shape=} {page_indices.shape=} {kv_lens.shape=}")
    if not isinstance(kv_lens, jax.core.Tracer):  # concrete lengths: check them here, eagerly
        capacity = kv_cache.sink_tokens(layer.config) + page_indices.shape[1] * layer.config.page_size
        bad = np.flatnonzero((np.asarray(kv_lens) < 0) | (np.asarray(kv_lens) > capacity))
        if bad.size:
            raise ValueError(f"kv_lens outside [0, capacity={capacity}] at slots {bad.tolist()}: "
                             f"kv_lens={np.asarray(kv_lens).tolist()}")
        if not isinstance(page_indices, jax.core.Tracer):  # live columns: ids in range, not the null page
            paging.validate_page_indices(page_indices, kv_lens, num_pages=layer.num_pages,
                                         page_size=layer.config.page_size,
                                         num_sink_tokens=kv_cache.sink_tokens(layer.config), live_only=True)
    return page_indices, kv_lens


_KIVI_FIELDS = ("k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums", "open_k",
                "open_v", "sink_k", "sink_v")
_FP8_FIELDS = ("k_codes", "k_scale", "v_codes", "v_scale")
_INT8_FIELDS = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")
_KIVI2_FIELDS = ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min", "open_k", "open_v")
_TURBO_FIELDS = ("k_codes", "k_scale", "v_codes", "v_scale")


def kernel_args(layer: kv_cache.LayerCache) -> tuple[tuple, dict]:
    """(arrays, static ints) a kernel takes for a cache layer, decode and prefill alike: the ONE place
    that unpacks a layer (the kernels take arrays and static ints only). bf16 pages: (k, v); fp8 /
    int8 / int4 / kivi2: their arrays (kivi2 with quant_group_size); turbo: its four arrays and the
    codebook f32[16 or 8]; kivi: the 12 arrays in the kernels' order (k_codes,
    k_scale, k_min, k_sums, v_codes, v_scale, v_min, v_sums, open_k, open_v, sink_k, sink_v; k_sums and
    v_sums None without code sums, QuantConfig.code_sums False: the kernels then launch without them, and
    the operand modes that read them raise ValueError naming dot_dtype and the fix) with
    partition_size and num_sink_tokens, and v_group / window / bits when the config sets them (bits when
    not 2). Kernels are called as
    fn(q, *arrays, page_indices, kv_lens, **static, **kernel_options) (prefill: also q_start=)."""
    if isinstance(layer, kv_cache.DensePages):
        return (layer.k, layer.v), {}
    if isinstance(layer, kv_cache.Fp8Pages):
        return tuple(getattr(layer, f) for f in _FP8_FIELDS), {}
    if isinstance(layer, (kv_cache.Int8Pages, kv_cache.Int4Pages)):
        return tuple(getattr(layer, f) for f in _INT8_FIELDS), {}
    if isinstance(layer, kv_cache.TurboPages):
        return tuple(getattr(layer, f) for f in _TURBO_FIELDS) + (jnp.asarray(layer.codebook),), {}
    if isinstance(layer, kv_cache.Kivi2Pages):
        return tuple(getattr(layer, f) for f in _KIVI2_FIELDS), dict(quant_group_size=kv_cache.kivi2.GROUP)
    if not isinstance(layer, kv_cache.KiviPages):
        raise NotImplementedError(f"no kernel takes a {type(layer).__name__} layer")
    static = dict(partition_size=layer.config.partition_size, num_sink_tokens=layer.config.num_sink_tokens)
    if layer.config.v_group:
        static["v_group"] = layer.config.v_group
    if layer.config.window:
        static["window"] = layer.config.window
    if layer.config.bits != 2:
        static["bits"] = layer.config.bits
    return tuple(getattr(layer, f) for f in _KIVI_FIELDS), static


def _fused_decode_module():
    module = "pallas_kernels.fused_decode_attention"
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise NotImplementedError(f"the fused decode kernel {module} is unavailable ({type(e).__name__}: {e})") from e


def _pallas(impl, kind, layer):
    fmt = layer.config.kv_format
    if isinstance(layer, kv_cache.SeedPages):
        raise NotImplementedError(f"impl={impl!r} has no kernel for layout='seed' (HACK.md §4: it "
                                  "needs none unless it becomes accurate); use impl='reference'")
    if (impl, kind, fmt) not in _PALLAS:
        raise NotImplementedError(f"impl={impl!r} has no {kind} kernel for kv_format={fmt!r}")
    if impl in ("triton", "gluon") and layer.config.v_group:
        raise NotImplementedError(f"impl={impl!r} has no kernel for a V channel group set apart from the "
                                  f"K block (v_group={layer.config.v_group}); use impl='pallas'")
    if layer.config.window and (impl, kind) not in _WINDOW_KERNELS:
        raise NotImplementedError(f"impl={impl!r} has no {kind} kernel for a 16-bit window longer than the open "
                                  f"block (window={layer.config.window}); decode with impl='pallas', prefill "
                                  f"with impl='reference'")
    if layer.config.bits != 2 and (impl, kind) not in _BITS_KERNELS:
        raise NotImplementedError(f"impl={impl!r} has no {kind} kernel for {layer.config.bits}-bit codes "
                                  f"(bits={layer.config.bits}); use impl='pallas'")
    module, name = _PALLAS[impl, kind, fmt]
    try:
        kernel = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(
            f"impl={impl!r} {kind} kernel for kv_format={fmt!r} is unavailable: "
            f"{module}.{name} ({type(e).__name__}: {e})") from e
    return kernel


def _run_kernel(impl, kernel, *args, **kwargs):
    """kernel(*args, **kwargs), with jax's "Only interpret mode is supported on CPU backend." (a
    Pallas-Triton kernel run eagerly off the GPU, raised from inside jax) replaced by a ValueError
    that names the fix. The kernels' own validation and lowering for another platform (jit(...).lower(
    lowering_platforms=("cuda",)) on a CPU host) are untouched."""
    try:
        return kernel(*args, **kwargs)
    except ValueError as e:
        if "interpret mode" not in str(e) or kwargs.get("interpret", False):
            raise
        raise ValueError(f"impl={impl!r} runs GPU (Triton) kernels; jax's backend here is "
                         f"{jax.default_backend()!r}: pass interpret=True (slow, for tests) or use "
                         f"impl='reference'") from e


@functools.partial(jax.jit, static_argnames="decode")
def _reference(q, layer, page_indices, kv_lens, q_start, *, decode):
    """q f32[S, T, Hq, D] -> f32[S, T, Hq, D]; positions as in the module docstring."""
    t = q.shape[1]
    if decode:
        q_pos = kv_lens[:, None] - 1  # [S, 1]
    else:
        steps = q_start[:, None] + jnp.arange(t)[None, :]
        q_pos = jnp.where(steps < kv_lens[:, None], steps, -1)  # [S, T]; -1 sees nothing
    return reference.softmax_state_output(_state(q, layer, page_indices, kv_lens, q_pos))


def cached_prefix_state(q, layer: kv_cache.LayerCache, *, page_indices, kv_lens, impl: Impl = "reference",
                        **kernel_options) -> reference.SoftmaxState:
    """Attention of queries over EVERY cached token (positions < kv_lens), as a softmax state.

    The cached-prefix half of a chunked prefill (hack_jax.prefill): the queries all sit after the
    cached tokens, so none is masked; the caller merges the state with the chunk's own attention
    (reference.online_softmax_merge).
      impl="reference" (and every layer without a prefix kernel): the jnp reference, the numerics
        of prefill_attention(impl="reference"); state (acc unnormalized, m, l).
      impl="pallas" with a hack kivi layer of 2- or 4-bit codes (no window beyond the open block): the
        HACK prefill kernel in prefix mode (pallas_kernels.prefill_attention, prefix=True) on the codes; state
        (normalized out, lse, 1), the same softmax. kernel_options: `interpret`, and `dot_dtype`
        (one of the prefill kernel's; default: its PREFIX_DOT_DTYPE, the scale-folded f16 operands of
        the model's decode steps); others (the decode kernel's launch settings) are ignored.
    Args: q float[max_seqs, T, num_q_heads, head_dim]; layer, page_indices, kv_lens as in
    prefill_attention (kv_lens = the tokens cached before the chunk; 0 gives an empty state).
    Returns SoftmaxState with acc f32[max_seqs, T, num_q_heads, head_dim], m, l f32[max_seqs, T,
    num_q_heads] (l = 0 where nothing is cached). Raises as prefill_attention.
    """
    q = jnp.asarray(q)
    if q.ndim != 4:
        raise ValueError(f"prefill q must be [max_seqs, T, num_q_heads, head_dim], got {q.shape=}")
    page_indices, kv_lens = _check(q, layer, page_indices, kv_lens, impl, {})
    if not _has_prefix_kernel(impl, layer):
        state = _prefix_reference(_rotate_q(q, layer), layer, page_indices, kv_lens)
        return state._replace(acc=_unrotate(state.acc, layer))
    arrays, static = kernel_args(layer)
    # the kernel validates dot_dtype (the decode kernel's dot dtypes are all the prefill kernel's too)
    options = {name: kernel_options[name] for name in ("interpret", "dot_dtype") if name in kernel_options}
    out, lse = _run_kernel(impl, _pallas(impl, "prefill", layer), _rotate_q(q, layer), *arrays, page_indices,
                           kv_lens, prefix=True, **static, **options)
    return reference.SoftmaxState(_unrotate(out, layer), lse, jnp.where(lse > -jnp.inf, 1.0, 0.0))


def _has_prefix_kernel(impl, layer) -> bool:
    """Whether cached_prefix_state runs a kernel: impl="pallas" on a kivi hack layer that the prefill
    kernel reads (no window beyond the open block, 2- or 4-bit codes: `_pallas`'s rules)."""
    if impl != "pallas" or not isinstance(layer, kv_cache.KiviPages):
        return False
    return ((not layer.config.window or (impl, "prefill") in _WINDOW_KERNELS)
            and (layer.config.bits == 2 or (impl, "prefill") in _BITS_KERNELS))


@jax.jit
def _prefix_reference(q, layer, page_indices, kv_lens):
    q_pos = jnp.broadcast_to(kv_lens[:, None] - 1, q.shape[:2])  # every row sees every cached key
    return _state(q, layer, page_indices, kv_lens, q_pos)


def _state(q, layer, page_indices, kv_lens, q_pos):
    """SoftmaxState of q [S, T, Hq, D] at positions q_pos i32[S, T]: acc [S, T, Hq, D], m, l [S, T, Hq]."""
    if isinstance(layer, (kv_cache.KiviPages, kv_cache.SeedPages)):
        return _homomorphic(q, layer, page_indices, kv_lens, q_pos)
    return _dense(q, layer, page_indices, kv_lens, q_pos)


# _dense materializes its [S, Hq, T, keys] logits in one piece up to this many elements (1 GiB of
# float32); beyond, it walks the keys in tiles with an online softmax, so a long chunk over a long
# cached prefix (a chunked prefill's reference path) stays within memory.
DENSE_LOGITS_LIMIT = 1 << 28


def _dense(q, layer, page_indices, kv_lens, q_pos, *, limit=DENSE_LOGITS_LIMIT):
    """Dequantize-then-attend: the float32 softmax state over the gathered pages (as _state)."""
    k, v = kv_cache.dequantize_cache(layer, page_indices, kv_lens)  # f32[S, C, H, D], 0 beyond kv_lens
    s, t, hq, d = q.shape
    h, c = k.shape[2], k.shape[1]
    qg = q.astype(jnp.float32).reshape(s, t, h, hq // h, d) / math.sqrt(d)
    tile = c if s * hq * t * c <= limit else max(1, limit // (s * hq * t))
    n = -(-c // tile)
    if n * tile != c:
        k, v = (jnp.pad(x, ((0, 0), (0, n * tile - c), (0, 0), (0, 0))) for x in (k, v))

    def part(i):  # the state over keys [i * tile, (i + 1) * tile): [S, K, G, T, ...]
        kt, vt = (jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=1) for x in (k, v))
        logits = jnp.einsum("stkgd,sckd->skgtc", qg, kt, precision=_HIGHEST)
        j = i * tile + jnp.arange(tile)
        mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_lens[:, None, None])
        mask = mask[:, None, None]  # [S, 1, 1, T, tile]
        m = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
        w = jnp.where(mask, jnp.exp(logits - jnp.where(m == -jnp.inf, 0.0, m)), 0.0)
        acc = jnp.einsum("skgtc,sckd->skgtd", w, vt, precision=_HIGHEST)
        return reference.SoftmaxState(acc, m[..., 0], w.sum(-1))

    if n == 1:
        state = part(0)
    else:
        state = jax.lax.fori_loop(0, n, lambda i, st: reference.online_softmax_merge(st, part(i)),
                                  reference.empty_softmax_state((s, h, hq // h, t), d))
    rows = lambda x: jnp.moveaxis(x, 3, 1).reshape((s, t, hq) + x.shape[4:])  # [S, K, G, T, ...]
    return reference.SoftmaxState(*map(rows, state))


def _homomorphic(q, layer, page_indices, kv_lens, q_pos):
    """The paged homomorphic reference (module docstring): its softmax state (as _state). Query rows
    per kv head are r = t * G + g inside, as in hack_jax.reference."""
    cfg = layer.config
    p, ns = cfg.partition_size, cfg.num_sink_tokens
    blocks = kv_cache.read_blocks(layer, page_indices, kv_lens)
    s, nb, h, _, d = blocks.k_codes.shape
    t, hq = q.shape[1], q.shape[2]
    g = hq // h
    rows = t * g
    q_s = (q.astype(jnp.float32) / math.sqrt(d)).reshape(s, t, h, g, d)
    q_s = q_s.transpose(0, 2, 1, 3, 4).reshape(s, h, rows, d)  # [S, H, rows, D]
    r_pos = jnp.repeat(q_pos, g, axis=1)  # [S, rows]

    def visible(key_pos, key_ok):  # int/bool[S, n] -> bool[S, rows, n]
        return key_ok[:, None, :] & (key_pos[:, None, :] <= r_pos[:, :, None])

    def per_head(step, num_args):  # vmap over kv heads (mask shared), then sequences
        return jax.vmap(jax.vmap(step, in_axes=(0,) * num_args + (None,)), in_axes=(0,) * (num_args + 1))

    def rows_below(x, n):  # zero the 16-bit rows [n, ...) of x [S, H, R, D]: stale rows must not leak
        keep = jnp.arange(x.shape[2])[None, None, :, None] < n[:, None, None, None]
        return jnp.where(keep, x, 0).astype(x.dtype)

    state = reference.empty_softmax_state((s, h, rows), d)
    if ns:
        j = jnp.broadcast_to(jnp.arange(ns), (s, ns))
        sink_k, sink_v = (rows_below(x, blocks.num_sinks) for x in (layer.sink_k, layer.sink_v))
        state = reference.online_softmax_merge(state, per_head(reference.float_attention_step, 3)(
            q_s, sink_k, sink_v, visible(j, j < blocks.num_sinks[:, None])))

    # Sealed blocks, in order: block b holds positions ns + b P + i (each block's mask built in its
    # step: [S, rows, P], not [S, NB, rows, P] up front).
    i = jnp.arange(p)
    step = (reference.seed_block_attention_step if isinstance(layer, kv_cache.SeedPages)
            else reference.kivi_block_attention_step)
    block_step = per_head(step, 9)

    def body(carry, xs):
        b, *fields = xs
        key_pos = ns + b * p + i  # [P]
        mask = (b < blocks.num_sealed)[:, None, None] & (key_pos[None, None, :] <= r_pos[:, :, None])
        return reference.online_softmax_merge(carry, block_step(q_s, *fields, mask)), None

    leading = lambda x: jnp.moveaxis(x, 1, 0)  # [NB, S, ...]
    state, _ = jax.lax.scan(body, state, (jnp.arange(nb), *map(leading, blocks[:8])))

    # The open region: positions ns + num_sealed P + i, i < num_open (< W = config.open_window).
    iw = jnp.arange(layer.open_v.shape[2])
    open_pos = ns + blocks.num_sealed[:, None] * p + iw[None, :]  # [S, W]
    open_vis = visible(open_pos, iw[None, :] < blocks.num_open[:, None])
    open_v = rows_below(layer.open_v, blocks.num_open)
    if isinstance(layer, kv_cache.SeedPages):
        # K of the open tokens was quantized on arrival: it is block num_sealed's first rows.
        at = jnp.minimum(blocks.num_sealed, nb - 1)
        pick = lambda x: jnp.take_along_axis(x, at.reshape((s, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]
        open_state = per_head(reference.seed_open_block_attention_step, 6)(
            q_s, pick(blocks.k_codes), pick(blocks.k_scale), pick(blocks.k_min), pick(blocks.k_sums),
            open_v, open_vis)
    else:
        open_state = per_head(reference.float_attention_step, 3)(
            q_s, rows_below(layer.open_k, blocks.num_open), open_v, open_vis)
    state = reference.online_softmax_merge(state, open_state)

    rows = lambda x: jnp.swapaxes(x.reshape((s, h, t, g) + x.shape[3:]), 1, 2).reshape(
        (s, t, hq) + x.shape[3:])  # [S, H, T * G, ...] -> [S, T, Hq, ...]
    return reference.SoftmaxState(*map(rows, state))


def decode_step(q, k, v, layer: kv_cache.LayerCache | stacked.StackedLayer, *, page_indices, kv_lens, active,
                impl="reference", seal="always", sinks=True, key=None, fuse=None, **kernel_options):
    """One decode step of a layer: append each active slot's new token, then attend over the cache.

    The same as `layer = kv_cache.append(layer, k, v, kv_lens=kv_lens, active=active,
    page_indices=page_indices, key=key, seal=seal, sinks=sinks)` followed by `decode_attention(q, layer,
    page_indices=page_indices, kv_lens=kv_lens, impl=impl, **kernel_options)`, which is what
    runs, except for impl="pallas" with seal="never" on a kivi layer when `fuse`: one fused Pallas call
    (pallas_kernels.fused_decode_attention) writes the token's sink / open-block rows in place and
    attends, plus the split combine, so no XLA scatter runs around the kernel (the
    same cache bytes, the same output up to float32 order). The fused kernel holds 2 programs per SM
    instead of 3 (more registers). fuse=True forces it (ValueError where it cannot apply); None / False do
    not fuse: where the model used it on the H200 (Qwen2.5-7B heads, batch 1, 4K and 32K) its split-combine
    kernel took 27 us per layer, more than the attention itself, and the step ran 13% slower than bf16's
    (bench/NOTES_generate.md, session 6).

    `layer` may be a kv_cache.stacked.StackedLayer (layer i of a stacked cache, what the unrolled model
    passes): with impl="pallas", seal="never" and a kivi or bf16 cache, the token's rows are written into
    the stacked arrays in place (one scatter per array, or inside the fused kernel) and the kernel reads
    layer i through its layer_index, with the page table as given (layer-local ids): no per-layer slice,
    write-back or table mapping. Otherwise the layer is taken out in the flat form and put back
    (kv_cache.stacked.take / give). Either way the bytes and the output are those of the layer's own
    arrays. Returns a StackedLayer then.

    Args:
      q: float[max_seqs, num_q_heads, head_dim]; k, v: float[max_seqs, num_kv_heads, head_dim].
      layer: a LayerCache or a StackedLayer; page_indices: i32[max_seqs, pages_per_seq].
      kv_lens: i32[max_seqs] tokens held after this step (the new token at kv_lens - 1 of each active
        slot: hack_jax.step's one meaning); active: bool[max_seqs].
      impl, kernel_options: as decode_attention. seal, sinks, key: as kv_cache.append (sinks=False: no sink
        row is written on any path, the fused kernel's included). seal="after" (kivi, impl
        "reference" / "pallas"; NotImplementedError otherwise): the rows only, and a slot whose token fills its
        open region attends over the region's W 16-bit rows (the Pallas kernel's open_full); the caller seals
        with kv_cache.seal_filled afterwards (hack_jax.backend.Backend.finish; docs/DESIGN.md "Deferred sealing").
    Returns (new layer, out f32[max_seqs, num_q_heads, head_dim]).
    Raises what kv_cache.append and decode_attention raise (the same checks, before anything runs).
    """
    if isinstance(layer, stacked.StackedLayer):
        return _stacked_decode_step(q, k, v, layer, page_indices=page_indices, kv_lens=kv_lens, active=active,
                                    impl=impl, seal=seal, sinks=sinks, key=key, fuse=fuse, **kernel_options)
    can_fuse = impl == "pallas" and seal == "never" and isinstance(layer, kv_cache.KiviPages)
    if fuse and not can_fuse:
        raise ValueError(f"fuse=True needs impl='pallas', seal='never' and a kivi layer, got {impl=} {seal=} "
                         f"{type(layer).__name__}")
    if seal == "after" and isinstance(layer, kv_cache.KiviPages):
        q = jnp.asarray(q)
        if q.ndim != 3:
            raise ValueError(f"decode q must be [max_seqs, num_q_heads, head_dim], got {q.shape=}")
        _check_after(impl)
        layer = kv_cache.append(layer, k, v, kv_lens=kv_lens, active=active, page_indices=page_indices,
                                key=key, seal="after", sinks=sinks)
        page_indices, kv_lens = _check(q[:, None], layer, page_indices, kv_lens, impl, kernel_options)
        return layer, _attend_after(q, k, v, layer, page_indices, kv_lens, jnp.asarray(active, bool), impl,
                                    None, kernel_options)
    if not (can_fuse and fuse):
        layer = kv_cache.append(layer, k, v, kv_lens=kv_lens, active=active, page_indices=page_indices,
                                key=key, seal=seal, sinks=sinks)
        return layer, decode_attention(q, layer, page_indices=page_indices, kv_lens=kv_lens, impl=impl,
                                       **kernel_options)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 3:
        raise ValueError(f"decode q must be [max_seqs, num_q_heads, head_dim], got {q.shape=}")
    page_indices, kv_lens, active = _check_append(layer, k, v, page_indices, kv_lens, active, sinks=sinks)
    _check(q[:, None], layer, page_indices, kv_lens, impl, kernel_options)
    out, written = _fused_step(q, k, v, layer, page_indices, kv_lens, active, impl, None, kernel_options, sinks)
    layer = dataclasses.replace(layer, **written)
    return layer, _unrotate(out, layer)


def _fused_step(q, k, v, layer, page_indices, kv_lens, active, impl, layer_index, kernel_options, sinks):
    """The fused kernel's call on a checked kivi layer (stacked with layer_index): (out, written arrays);
    sinks=False: the kernel writes no sink row and the sink arrays are not among the written ones."""
    fn = functools.partial(_run_kernel, impl, _fused_decode_module().hack_fused_decode_attention)
    arrays, static = kernel_args(layer)
    before = kv_lens - active.astype(jnp.int32)  # the fused kernel's position of the new token
    v = rotate_v(v, layer.config.v_rotation)  # what kv_cache.append stores
    if layer_index is not None:
        static["layer_index"] = layer_index
    out, open_k, open_v, sink_k, sink_v = fn(q, k, v, *arrays, page_indices, before, active, **static,
                                             write_sinks=sinks, **kernel_options)
    written = dict(open_k=open_k, open_v=open_v)
    return out, dict(written, sink_k=sink_k, sink_v=sink_v) if sinks else written


def _stacked_decode_step(q, k, v, view, *, page_indices, kv_lens, active, impl, seal, sinks, key, fuse,
                         **kernel_options):
    """decode_step on layer view.index of a stacked cache (decode_step's docstring)."""
    kivi = isinstance(view.stacked, kv_cache.KiviPages)
    in_place = impl == "pallas" and (seal == "never" or seal == "after" and kivi and not fuse) and (
        stacked.reads_in_place(view) and (kivi or view.config.kv_format == "bf16"))
    if not in_place:
        layer, table = stacked.take(view, page_indices)
        layer, out = decode_step(q, k, v, layer, page_indices=table, kv_lens=kv_lens, active=active, impl=impl,
                                 seal=seal, sinks=sinks, key=key, fuse=fuse, **kernel_options)
        return stacked.give(view, layer), out
    if fuse and not kivi:
        raise ValueError(f"fuse=True needs impl='pallas', seal='never' and a kivi layer, got {impl=} {seal=} "
                         f"{type(view.stacked).__name__}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 3:
        raise ValueError(f"decode q must be [max_seqs, num_q_heads, head_dim], got {q.shape=}")
    page_indices, kv_lens, active = _check_stacked(view, q, k, v, page_indices, kv_lens, active, impl,
                                                   kernel_options, seal, sinks)
    if kivi and fuse:
        out, written = _fused_step(q, k, v, view.stacked, page_indices, kv_lens, active, impl, view.index,
                                   kernel_options, sinks)
        view = stacked.StackedLayer(dataclasses.replace(view.stacked, **written), view.index)
        return view, _unrotate(out, view)
    position = kv_lens - active.astype(jnp.int32)  # of the new token, as kv_cache.append
    view = stacked.append_in_place(view, k, rotate_v(v, view.config.v_rotation), position,
                                   active & (position >= 0), page_indices, sinks=sinks)
    if seal == "after":
        return view, _attend_after(q, k, v, view.stacked, page_indices, kv_lens, active, impl, view.index,
                                   kernel_options)
    arrays, static = kernel_args(view.stacked)
    out = _run_kernel(impl, _pallas(impl, "decode", view.stacked), q, *arrays, page_indices, kv_lens,
                      layer_index=view.index, **static, **kernel_options)
    return view, _unrotate(out, view)


AFTER_IMPLS = ("reference", "pallas")  # decode_step(seal="after") attends with these


def _check_after(impl):
    if impl not in AFTER_IMPLS:
        raise NotImplementedError(f"decode_step(seal='after') attends with impl in {AFTER_IMPLS}, got {impl=}; "
                                  f"use seal='always'")


def _attend_after(q, k, v, layer, page_indices, kv_lens, active, impl, layer_index, kernel_options):
    """decode_step(seal="after")'s attention, the token's rows already written: a slot whose token filled its
    open region reads the region's W 16-bit rows (its blocks are not sealed yet); every other slot reads as
    usual. layer: a kivi LayerCache, or the stacked one with layer_index. Pallas: the kernel with
    open_full=True (the region's count, not the sealed blocks, when it is full). Reference: for the
    filling slots, the state over the kv_lens - 1 cached tokens merged with the new token as the open
    row holds it (k, v [S, H, D]); the others the usual reference. Returns f32[S, Hq, D] in V's basis."""
    cfg = layer.config
    if impl == "reference":
        q = jnp.asarray(q)
        k_new = jnp.asarray(k).astype(cfg.residual_dtype).astype(jnp.float32)
        v_new = rotate_v(jnp.asarray(v), cfg.v_rotation).astype(cfg.residual_dtype).astype(jnp.float32)
        u = kv_lens - cfg.num_sink_tokens
        fills = active & (u > 0) & (u % cfg.open_window == 0)
        out = _reference_after(q, layer, page_indices, kv_lens, fills, k_new, v_new)
    else:
        arrays, static = kernel_args(layer)
        if layer_index is not None:
            static["layer_index"] = layer_index
        out = _run_kernel(impl, _pallas(impl, "decode", layer), q, *arrays, page_indices, kv_lens,
                          open_full=True, **static, **kernel_options)
    return rotate_v(out, cfg.v_rotation)


@jax.jit
def _reference_after(q, layer, page_indices, kv_lens, fills, k_new, v_new):
    """_attend_after's reference (rotated basis): the usual reference, and for the `fills` slots the state
    over their kv_lens - 1 cached tokens merged with the new key's (q [S, Hq, D], k_new, v_new f32[S, H, D])."""
    usual = _reference(q[:, None], layer, page_indices, kv_lens, None, decode=True)[:, 0]
    before = kv_lens - fills.astype(jnp.int32)
    state = _prefix_reference(q[:, None], layer, page_indices, before)  # acc [S, 1, Hq, D], m, l [S, 1, Hq]
    group = q.shape[1] // k_new.shape[1]
    k_rep, v_rep = (jnp.repeat(x, group, axis=1) for x in (k_new, v_new))  # [S, Hq, D]
    logit = jnp.einsum("shd,shd->sh", q.astype(jnp.float32), k_rep,
                       precision=jax.lax.Precision.HIGHEST) / math.sqrt(q.shape[-1])
    new = reference.SoftmaxState(v_rep[:, None], logit[:, None], jnp.ones_like(logit)[:, None])
    merged = reference.softmax_state_output(reference.online_softmax_merge(state, new))[:, 0]
    return jnp.where(fills[:, None, None], merged, usual)


def _check_stacked(view, q, k, v, page_indices, kv_lens, active, impl, kernel_options, seal="never", sinks=True):
    """decode_step's checks for layer view.index of a stacked cache: those of the layer taken out
    (kv_cache.stacked.take), run abstractly (jax.eval_shape) when anything is traced. Returns
    (page_indices, kv_lens, active) as arrays."""
    paging.check_index_dtype("append", kv_lens=kv_lens, page_indices=page_indices)
    page_indices, kv_lens = jnp.asarray(page_indices, jnp.int32), jnp.asarray(kv_lens, jnp.int32)
    active = jnp.asarray(active, bool)

    def checks(view, q, k, v, page_indices, kv_lens, active):
        layer, table = stacked.take(view, page_indices)
        _check_append(layer, k, v, table, kv_lens, active, seal, sinks)
        _check(q[:, None], layer, table, kv_lens, impl, kernel_options)

    args = (view, q, k, v, page_indices, kv_lens, active)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
        jax.eval_shape(checks, *args)
    else:
        checks(*args)
    return page_indices, kv_lens, active


def _check_append(layer, k, v, page_indices, kv_lens, active, seal="never", sinks=True):
    """kv_cache.append's checks of a seal="never" (or "after") step, with its messages: traced lengths get the shape
    checks (an abstract append), concrete ones all of them (an eager append whose result is dropped: the
    eager path is for tests and tools). Returns (page_indices, kv_lens, active) as arrays."""
    paging.check_index_dtype("append", kv_lens=kv_lens, page_indices=page_indices)
    page_indices, kv_lens = jnp.asarray(page_indices, jnp.int32), jnp.asarray(kv_lens, jnp.int32)
    active = jnp.asarray(active, bool)
    probe = functools.partial(kv_cache.append, layer, k, v, kv_lens=kv_lens, active=active,
                              page_indices=page_indices, seal=seal, sinks=sinks)
    if any(isinstance(x, jax.core.Tracer) for x in (page_indices, kv_lens, active, k, v)):
        jax.eval_shape(probe)
    else:
        probe()
    return page_indices, kv_lens, active
