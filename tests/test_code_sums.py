"""QuantConfig.code_sums=False: a kivi cache that stores no code sums (k_sums / v_sums None).

The same K/V written into a cache with and one without sums (tests/twin.py's writers: shuffled page
tables, poison beyond every length, a prefill then appends that seal blocks) must hold the same codes
and metadata, and what does without the sums must give bit-identical results on the two: the jnp
reference (its sums derived from the codes on read, `kv_cache.read_blocks`; also held to the float64
twin's own homomorphic attention), the folded Pallas decode kernel launched without the sums operands,
the decode step on layer i of a stack (in-place append, the kernel reading layer_index), a layer scan over
a per-layer-format stacked cache, the hand-off. The fused append + decode kernel writes the in-place
step's bytes and the prefix-mode prefill kernel attends as the decode kernel, up to float32 order. The
kernel modes that read the sums (INT8) refuse the cache with a ValueError naming dot_dtype and the fix.
Bytes: the report drops by exactly the sums' bytes; the eval candidate's page bits 2.9375 -> 2.75, and
with its 4-bit layer 18 within issue 18's 3-bit budget at Qwen2.5-Coder-0.5B's and SmolLM2's shapes.
The kernel tests run in Pallas interpret mode on the CPU and compiled on the GPU (`gpu` marker).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_stacked_decode as stacked_cases
import twin
from hack_jax import attention, handoff, kv_cache
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import mixed, stacked
from hack_jax.layer_formats import LayerFormats
from models import eval as model_eval
from pallas_kernels import common
from pallas_kernels.decode_attention import KernelConfig, hack_decode_attention
from pallas_kernels.fused_decode_attention import hack_fused_decode_attention
from pallas_kernels.prefill_attention import hack_prefill_attention
from test_attention_suite import HEAD_DIM, LENGTHS, NUM_KV_HEADS, NUM_Q_HEADS, check, make_q

# optimized_xla: its bit-for-bit checks of two programs (with and without sums) hold for users' optimized code.
pytestmark = [pytest.mark.filterwarnings(f"ignore:{common.TRITON_DEPRECATION_MESSAGE}:DeprecationWarning"),
              pytest.mark.optimized_xla]

SUMS = QuantConfig(partition_size=32, page_size=128)  # channel group 32: NP = 2 groups at head_dim 64
NO_SUMS = dataclasses.replace(SUMS, code_sums=False)
# the kernels' cases: test_stacked_decode's layer (6 slots, one token to append each) with the candidate's
# one 64-channel group (NP = 1: the interpret-mode kernels compile faster)
KERNEL = dataclasses.replace(stacked_cases.HACK, v_group=64)
MODES = ["interpret", pytest.param("gpu", marks=pytest.mark.gpu)]
CANDIDATE = "hack-k32v64-vhad-w128-clip-s16"
RULE = "+18:hack:bits=4,partition_size=64"
TIGHT = 64 * float(np.finfo(np.float32).eps)  # times max |V|, as tests/test_decode_kernels.py
# the prefix kernel vs the decode kernel on the GPU, whose exp differ (the decode kernel's ex2.approx): a
# 16-bit rounding of W tau may flip, at most 2**-11 of it per term
FOLDED_GPU = 2e-3


@functools.lru_cache(maxsize=None)
def caches():
    """(with sums, without): LENGTHS (on and off block and page boundaries) written by a prefill of half
    of each sequence, then appends that seal blocks, poisoned beyond every length."""
    return tuple(twin.build(c, LENGTHS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, how="both", exact=False)
                 for c in (SUMS, NO_SUMS))


@functools.lru_cache(maxsize=None)
def kernel_layers():
    """(with sums, without) of stacked_cases._layer: (q, k_new, v_new, layer, table), the same values."""
    return tuple(stacked_cases._layer(dataclasses.replace(KERNEL, code_sums=c), junk_id=False) for c in (True, False))


def _arrays(layer):
    return {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer) if f.name != "config"}


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32) if x.dtype.itemsize == 4 else x


def _assert_same(a, b, what=""):
    np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=what)


def _same_but_sums(with_sums, without, what=""):
    """Every array of `without` is `with_sums`'s, bit for bit; its sums are None."""
    assert without.k_sums is None and without.v_sums is None, what
    assert with_sums.k_sums is not None and with_sums.v_sums is not None, what
    for name, a in _arrays(with_sums).items():
        if not name.endswith("sums"):
            _assert_same(a, getattr(without, name), f"{what} {name}")


# ---------------------------------------------------------------------------- config, specs, bytes


@pytest.mark.parametrize("kwargs, match", [
    (dict(code_sums=1), "code_sums=1"), (dict(code_sums="false"), "code_sums='false'"),
    (dict(code_sums=False, kv_format="int8"), "kv_format='int8'"),
    (dict(code_sums=False, layout="seed"), "layout='seed'")])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


@pytest.mark.parametrize("flags", [["--kv-format", "int8"], ["--layout", "seed"]])
def test_cli_flag_rejects_other_formats(flags):
    """--no-code-sums beside a format without (kivi) code sums: the ValueError names the flags."""
    from models.cli import _parser
    from models.cli_generate import quant_config
    with pytest.raises(ValueError, match=f"--no-code-sums applies to .*got .*{flags[1]}"):
        quant_config(_parser().parse_args(["generate", "--prompt", "hi", "--no-code-sums"] + flags))


def test_specs_reach_the_config():
    """The CLI flag, the eval spellings (the FORMATS entry, a spec's FIELD=VALUE) and the per-layer rule over
    the candidate (every layer without sums, layer 18 in 4-bit codes of 64-token blocks)."""
    from models.cli import _parser
    from models.cli_generate import quant_config
    args = ["generate", "--prompt", "hi", "--partition-size", "32", "--layer-formats", "0:hack:bits=4"]
    assert quant_config(_parser().parse_args(args)).base.code_sums
    flagged = quant_config(_parser().parse_args(args + ["--no-code-sums"]))
    assert not flagged.base.code_sums and not flagged.configs(2)[0].code_sums
    ns = model_eval.parse_format(CANDIDATE + "-ns").quant
    assert ns == dataclasses.replace(model_eval.FORMATS[CANDIDATE].quant, code_sums=False)
    assert model_eval.parse_format("hack:partition_size=32,code_sums=false").quant == QuantConfig(
        partition_size=32, code_sums=False)
    assert model_eval.parse_format("hack:code_sums=true").quant == QuantConfig()
    with pytest.raises(ValueError, match="code_sums=1"):
        model_eval.parse_format("hack:code_sums=1")
    rule = model_eval.parse_format(CANDIDATE + "-ns" + RULE).quant
    assert isinstance(rule, LayerFormats) and rule.base == ns
    configs = rule.configs(24)
    assert not any(c.code_sums for c in configs)
    assert configs[18] == dataclasses.replace(ns, bits=4, partition_size=64)
    assert set(configs[:18] + configs[19:]) == {ns}


def test_bytes_drop_by_the_sums():
    """cache_bytes_report: the total drops by exactly the sums' bytes, nothing else moves. Page bits by
    hand (Qwen2.5-Coder-0.5B: 24 layers, 2 kv heads, head_dim 64; SmolLM2: 30 layers, 3 kv heads): the
    candidate (K32, V group 64: NP = 1) per token and kv head holds 2-bit K and V codes 16 + 16 bytes, K
    scale / min per 32 tokens 8, V scale / min per token 4, sums 1 (kappa, u8) + 2 (omega, u8 per 32 tokens)
    -> 47 bytes = 2.9375 bits per element, 44 = 2.75 without; the 4-bit P64 layer without sums: codes
    32 + 32, K and V metadata 4 + 4 -> 72 bytes = 4.5 bits."""
    with_sums, without = model_eval.FORMATS[CANDIDATE].quant, model_eval.FORMATS[CANDIDATE + "-ns"].quant
    geom = dict(num_layers=24, num_kv_heads=2, head_dim=64, seq_len=1000, max_seqs=2)
    a, b = (kv_cache.cache_bytes_report(c, **geom) for c in (with_sums, without))
    assert a["sums"] > 0 and b["sums"] == 0 and a["total"] - b["total"] == a["sums"]
    for key in ("codes", "metadata", "open_blocks", "sinks", "num_pages", "bf16"):
        assert a[key] == b[key], key
    assert (a["page_bits_per_element"], b["page_bits_per_element"]) == (2.9375, 2.75)
    rule = model_eval.parse_format(CANDIDATE + "-ns" + RULE).quant
    for layers, heads in ((24, 2), (30, 3)):
        shape = dict(num_layers=layers, num_kv_heads=heads, head_dim=64, seq_len=4096)
        bits = kv_cache.cache_bytes_report(rule, **shape)["page_bits_per_element"]
        assert bits == pytest.approx(((layers - 1) * 2.75 + 4.5) / layers) and bits <= 3.0
        assert kv_cache.cache_bytes_report(without, **shape)["page_bits_per_element"] == 2.75
    shapes = jax.eval_shape(lambda: kv_cache.init_cache(rule, num_layers=24, num_kv_heads=2, head_dim=64, num_pages=3,
                                                        max_seqs=1, pages_per_seq=2, stacked=True))
    assert mixed.array_bits(shapes)["page_bits_per_element"] == pytest.approx((23 * 2.75 + 4.5) / 24)


# ---------------------------------------------------------------------------- cache


def test_no_sums_allocated_and_the_same_bytes_otherwise():
    """init_layer allocates no sums; prefill, appends and seals write the same codes and metadata, and
    read_blocks derives the sums the other cache stores (zero beyond the sealed blocks, as the masked
    stored ones)."""
    layer = kv_cache.init_layer(NO_SUMS, num_kv_heads=2, head_dim=64, num_pages=3, max_seqs=2)
    assert layer.k_sums is None and layer.v_sums is None
    a, b = caches()
    _same_but_sums(a.layer, b.layer)
    got = kv_cache.read_blocks(b.layer, b.table, b.lengths)
    want = kv_cache.read_blocks(a.layer, a.table, a.lengths)
    for name, x, y in zip(want._fields, want, got):
        _assert_same(y, x, name)
    assert np.asarray(got.k_sums).any() and np.asarray(got.v_sums).any()


def test_layer_scan_over_a_mixed_stacked_cache():
    """A model's layer scan (models.llama: jax.lax.scan per run of one format's layers, the stack in
    kv_cache.stacked's flat form) writing a prefill into every layer of a per-layer-format cache ([hack,
    hack, bf16]: kv_cache.mixed.LayerGroups) without sums: each layer holds the bytes of the same scan
    over the cache with sums (the bf16 layer's none)."""
    lens = np.array([45, 7], np.int32)  # 4 sinks + 32-token blocks: one sealed, one open
    table = np.array([[1, 2], [3, 0]], np.int32)
    kv = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 2, 48, 2, 64)), jnp.float32)  # K/V, layer

    @jax.jit
    def write_all(cache):
        groups, layer_map = mixed.groups_of(cache.layers)
        for g, first, stop, offset in mixed.runs(layer_map):
            flat, n = stacked.flatten(groups[g]), stacked.pages_per_layer(groups[g])

            def body(flat, i):
                j = i - (first - offset)
                layer = kv_cache.write_prefill(stacked.layer_of(flat, j), kv[0][i], kv[1][i], lengths=lens,
                                               page_indices=stacked.layer_page_indices(table, j, n))
                return stacked.put_layer(flat, layer, j), None

            flat, _ = jax.lax.scan(body, flat, jnp.arange(first, stop))
            groups[g] = stacked.unflatten(flat, mixed.num_stacked(groups[g]))
        return mixed.layer_list(mixed.with_groups(cache.layers, groups))

    layers = []
    for base in (SUMS, NO_SUMS):
        formats = LayerFormats(base, (("-1", "bf16"),))
        cache = kv_cache.init_cache(formats, num_layers=3, num_kv_heads=2, head_dim=64, num_pages=4, max_seqs=2,
                                    pages_per_seq=2, stacked=True)
        assert isinstance(cache.layers, mixed.LayerGroups) and len(cache.layers.groups) == 2
        layers.append(write_all(cache))
    *hack, (dense_a, dense_b) = zip(*layers)
    for i, (a, b) in enumerate(hack):
        _same_but_sums(a, b, f"layer {i}")
        assert np.asarray(a.k_codes).any() and np.asarray(a.k_sums).any()
    for name, x in _arrays(dense_a).items():
        _assert_same(getattr(dense_b, name), x, f"layer 2 {name}")


def test_handoff_carries_no_sums():
    """A sequence of a cache without sums travels through the hand-off byte for byte; its payload is the
    same sequence's with sums less exactly their bytes on its pages."""
    payloads = []
    for c in caches():
        cache = kv_cache.KVCache(layers=(c.layer,), page_indices=jnp.asarray(c.table), kv_lens=jnp.asarray(c.lengths),
                                 config=c.config)
        slot, kv_len = len(LENGTHS) - 1, int(c.lengths[-1])
        payload = handoff.export_sequence(cache, slot=slot, page_indices=c.table, kv_len=kv_len)
        empty = jax.tree.map(jnp.zeros_like, cache)
        back = handoff.import_sequence(empty, payload, slot=slot, page_indices=c.table)
        assert bytes(handoff.export_sequence(back, slot=slot, page_indices=c.table, kv_len=kv_len)) == bytes(payload)
        payloads.append(payload)
    names = [{name for _, name, *_ in handoff.read_header(p).arrays} for p in payloads]
    assert names[0] - names[1] == {"k_sums", "v_sums"} and names[1] <= names[0]
    a = caches()[0].layer
    pages = kv_cache.paging.pages_needed(int(LENGTHS[-1]), page_size=128, num_sink_tokens=4)
    per_page = (a.k_sums.nbytes + a.v_sums.nbytes) // a.num_pages
    body = lambda p: sum(x[-1] for x in handoff.read_header(p).arrays)  # noqa: E731
    assert body(payloads[0]) - body(payloads[1]) == pages * per_page


# ---------------------------------------------------------------------------- attention


def test_reference_is_bit_identical_and_matches_the_twin():
    """The jnp reference decoding the cache without stored sums (prefill then appends, LENGTHS on and off
    block and page boundaries): the output over the cache with sums, bit for bit, and the float64 twin's
    (which sums the codes itself) within the attention suite's tolerances."""
    a, b = caches()
    q = make_q((len(LENGTHS), NUM_Q_HEADS, HEAD_DIM))
    idx = dict(page_indices=b.table, kv_lens=b.lengths)
    out = np.asarray(attention.decode_attention(q, b.layer, **idx))
    _assert_same(out, attention.decode_attention(q, a.layer, **idx), "decode")
    check(out, twin.np_cache_attention(q[:, None], b, (b.lengths - 1)[:, None])[:, 0], b, "reference", "kivi")


@pytest.mark.parametrize("mode", MODES)
def test_folded_kernels(mode):
    """The folded decode kernel (the model's path: default_config's subnormal f16 planes) on the cache
    without sums, launched without the sums operands: the output of the same launch on the cache with them,
    bit for bit (finite, so a mismatch cannot hide as NaN); the dequant baseline's likewise on the GPU (traced
    on the CPU). The folded prefill kernel in prefix mode (a
    chunked prefill's cached prefix; every row sees every cached token, as a decode query does): the decode
    output up to the float32 order of its sums (TIGHT; on the GPU FOLDED_GPU)."""
    (q, _, _, a, table), (_, _, _, b, _) = kernel_layers()
    kw = dict(page_indices=table, kv_lens=jnp.asarray(stacked_cases.PREV), impl="pallas",
              interpret=mode == "interpret")
    out = attention.decode_attention(q, b, dot_dtype="folded_f16", **kw)
    assert np.isfinite(np.asarray(out)).all()
    _assert_same(out, attention.decode_attention(q, a, dot_dtype="folded_f16", **kw), "decode")
    dequant = dict(kw, impl="pallas_dequant")  # the dequant baseline takes no sums operand at all
    if mode == "interpret":  # traced only (its numerics: tests/test_decode_kernels.py)
        assert jax.eval_shape(lambda: attention.decode_attention(q, b, **dequant)).shape == q.shape
    else:
        _assert_same(attention.decode_attention(q, b, **dequant), attention.decode_attention(q, a, **dequant), "dequant")
    prefix = attention.cached_prefix_state(q[:, None], b, **kw)  # PREFIX_DOT_DTYPE: folded_f16
    err = np.abs(np.asarray(prefix.acc[:, 0]) - np.asarray(out)).max()
    assert err <= (TIGHT if mode == "interpret" else FOLDED_GPU) * _v_scale(), err


def _v_scale():
    """max |V| of what kernel_layers wrote (test_stacked_decode's K/V, seed 0): outputs are convex
    combinations of V rows (their 2-bit images within a step of them)."""
    prev = stacked_cases.PREV
    _, v = twin.make_kv((len(prev), int(prev.max()) + 1, stacked_cases.H, stacked_cases.D), 0)
    return float(np.abs(v).max())


@pytest.mark.parametrize("mode", MODES)
def test_decode_steps_on_a_stacked_layer(mode):
    """decode_step on layer 1 of a 3-layer stacked cache without sums (the others poison: test_stacked_decode's
    stack), the in-place append with the kernel reading layer_index (the model's decode step): the bytes and
    output of the same step on a stack with sums, bit for bit. The fused kernel on the stack without sums:
    the in-place step's bytes, and its output up to the float32 order of the split combine (TIGHT, as
    tests/test_fused_decode.py)."""
    got = []
    for q, k_new, v_new, layer, table in kernel_layers():
        idx = dict(page_indices=table, kv_lens=jnp.asarray(stacked_cases.PREV + stacked_cases.ACTIVE),
                   active=jnp.asarray(stacked_cases.ACTIVE), impl="pallas", seal="never", dot_dtype="folded_f16",
                   interpret=mode == "interpret")
        view = stacked.StackedLayer(stacked_cases._stack(layer, 1), 1)
        got.append(attention.decode_step(q, k_new, v_new, view, **idx, fuse=False))
    (want_view, want), (view, out) = got
    assert np.isfinite(np.asarray(want)).all()
    _assert_same(out, want, "out")
    layer_of = lambda v, j: jax.tree.map(lambda x: x[j], v.stacked)  # noqa: E731
    for j in range(3):
        _same_but_sums(layer_of(want_view, j), layer_of(view, j), f"layer {j}")
    fused_view, fused = attention.decode_step(q, k_new, v_new, stacked.StackedLayer(stacked_cases._stack(layer, 1), 1),
                                              **idx, fuse=True)
    for j in range(3):
        for name, x in _arrays(layer_of(view, j)).items():
            assert (x is None) == (getattr(layer_of(fused_view, j), name) is None), name
            if x is not None:
                _assert_same(getattr(layer_of(fused_view, j), name), x, f"fused layer {j} {name}")
    err = np.abs(np.asarray(fused) - np.asarray(out)).max()
    assert err <= TIGHT * _v_scale(), err


@pytest.mark.parametrize("mode", MODES)
def test_int8_modes_refuse_a_cache_without_sums(mode):
    """dot_dtype "int8" (the decode kernels' default) and the prefill kernel's INT8 modes read kappa and
    omega: a ValueError naming dot_dtype, code_sums and the fix, from the kernels' public functions before
    anything is traced (so a decode step that donates its cache raises while tracing, before any buffer is
    given up)."""
    q, k_new, v_new, layer, table = kernel_layers()[1]
    lens, active = jnp.asarray(stacked_cases.PREV), jnp.asarray(stacked_cases.ACTIVE)
    interpret = mode == "interpret"
    kw = dict(page_indices=table, kv_lens=lens, impl="pallas", interpret=interpret)
    msg = r"dot_dtype='int8' reads the code sums .*code_sums=False.*'folded_f16'.*QuantConfig\(code_sums=True\)"
    for options in ({}, dict(dot_dtype="int8"), dict(config=KernelConfig(dot_dtype="int8"))):
        with pytest.raises(ValueError, match=msg):
            attention.decode_attention(q, layer, **kw, **options)
    with pytest.raises(ValueError, match=msg):
        attention.decode_step(q, k_new, v_new, layer, page_indices=table, kv_lens=lens + active, active=active,
                              impl="pallas", seal="never", dot_dtype="int8", interpret=interpret)
    qp = jnp.zeros((len(lens), 4, NUM_Q_HEADS, HEAD_DIM), jnp.float32)
    for dot in ("bf16", "int8"):
        with pytest.raises(ValueError, match=f"dot_dtype='{dot}' reads the code sums"):
            attention.prefill_attention(qp, layer, dot_dtype=dot, **kw)
    arrays, static = attention.kernel_args(layer)
    for call in (lambda: hack_decode_attention(q, *arrays, table, lens, **static),
                 lambda: hack_fused_decode_attention(q, k_new, v_new, *arrays, table, lens, active, **static),
                 lambda: hack_prefill_attention(qp, *arrays, table, lens, dot_dtype="bf16", **static)):
        with pytest.raises(ValueError, match="code sums"):
            jax.eval_shape(call)


@pytest.mark.parametrize("mode", MODES)
def test_prefill_kernel_defaults_to_folded_without_sums(mode):
    """The prefill kernel's default operands (dot_dtype None: "bf16", the INT8 numerics) need the sums; on a cache
    without them the default is the folded mode (what Backend's homomorphic prefill gets, passing none), bit for
    bit the folded mode on the cache with sums."""
    (_, _, _, with_sums, table), (_, _, _, without, _) = kernel_layers()
    lens = jnp.asarray(stacked_cases.PREV)
    qp = jax.random.normal(jax.random.PRNGKey(7), (len(lens), 4, NUM_Q_HEADS, HEAD_DIM), jnp.float32)
    kw = dict(page_indices=table, kv_lens=lens, impl="pallas", interpret=mode == "interpret")
    got = attention.prefill_attention(qp, without, **kw)
    want = attention.prefill_attention(qp, with_sums, dot_dtype="folded_f16", **kw)
    _assert_same(got, want)
    assert np.abs(np.asarray(got)).max() > 0

