"""kv_format="fp8", "int8" and "kivi2" (the vLLM fp8, per-token int8 and KIVI-2 baselines): cache contents, write paths, the
reference attention and the Pallas decode kernels against the independent float64 NumPy twin
(tests/twin_baselines.py) on shuffled page tables with every unread entry NaN-poisoned.
CPU: kernels in interpret mode, and lowered to Triton IR for CUDA; the `gpu`-marked tests compile them (and
fp8's float8 loads) for the GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twin
import twin_baselines
from hack_jax import attention, kv_cache
from hack_jax.config import QuantConfig
from pallas_kernels import fp8_decode_attention as fp8k, int8_decode_attention as int8k, kivi2_decode_attention as kivi2k

LENGTHS = {"fp8": (1, 255, 256, 300, 0), "int8": (1, 255, 257, 300, 700, 0),
           "kivi2": (1, 128, 129, 130, 257, 300, 0)}
FORMATS = ("fp8", "int8", "kivi2")
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
_CACHES = {}


def cache_of(fmt, how, page_size=256):
    if (fmt, how, page_size) not in _CACHES:
        c = twin.build(QuantConfig(kv_format=fmt, page_size=page_size), LENGTHS[fmt], how=how, poison_unused=False,
                       seed=3)
        _CACHES[fmt, how, page_size] = twin_baselines.poison(c)
    return _CACHES[fmt, how, page_size]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("how", ["prefill", "append", "both"])
def test_contents_match_twin_and_bounds(fmt, how):
    cache = cache_of(fmt, how)
    k, v, ks, vs = (np.asarray(x, np.float64) for x in kv_cache.dequantize_cache(
        cache.layer, cache.table, cache.lengths, return_step=True))
    for s, (k_hat, v_hat, k_step, v_step) in enumerate(twin_baselines.decode(cache)):
        n = int(cache.lengths[s])
        for got, want in ((k[s, :n], k_hat), (v[s, :n], v_hat)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(ks[s, :n], k_step, rtol=1e-6)
        np.testing.assert_allclose(vs[s, :n], v_step, rtol=1e-6)
        assert not k[s, n:].any() and not v[s, n:].any()
        for hat, step, raw in ((k_hat, k_step, cache.k[s, :n]), (v_hat, v_step, cache.v[s, :n])):
            x = twin.bf16(raw)
            err = np.abs(hat - x)
            assert np.all(err <= step / 2 * (1 + 1e-3) + 1e-6), float((err - step / 2).max())
            assert np.all(err[step == 0] == 0)  # the 16-bit parts are the bf16 inputs
        if fmt == "kivi2" and n > 1:  # scales come from the right groups: K over 32 tokens, V over 32 channels
            nk, nq = twin_baselines.kivi_ranges(n)
            xk = twin.bf16(cache.k[s, :nk]).reshape(nk // 32, 32, *k_hat.shape[1:])
            rk = xk.max(1) - xk.min(1)  # [groups, H, D]
            sk = k_step[:nk].reshape(xk.shape)[:, 0]
            assert np.all(sk <= (rk + 2 ** -9 * np.abs(xk).max(1)) / 3 * (1 + 2 ** -9) + 1e-7)
            xv = twin.bf16(cache.v[s, :nq]).reshape(nq, v_hat.shape[1], v_hat.shape[2] // 32, 32)
            sv = v_step[:nq].reshape(xv.shape)[..., 0]
            assert np.all(sv <= (np.ptp(xv, -1) + 2 ** -9 * np.abs(xv).max(-1)) / 3 * (1 + 2 ** -9) + 1e-7)


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_paths_store_the_same(fmt):
    ref = twin_baselines.decode(cache_of(fmt, "prefill"))
    for how in ("append", "both"):
        for a, b in zip(ref, twin_baselines.decode(cache_of(fmt, how))):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    # chunked prefill: 100 tokens, then the rest in one write_prefill with start
    base = cache_of(fmt, "prefill")
    layer = kv_cache.init_layer(base.config, num_kv_heads=2, head_dim=64, num_pages=base.layer.num_pages,
                                max_seqs=len(base.lengths))
    first = np.minimum(base.lengths, 100)
    layer = kv_cache.write_prefill(layer, base.k, base.v, lengths=first, page_indices=base.table)
    rest_k = np.zeros_like(base.k)
    rest_v = np.zeros_like(base.v)
    for s, (a, n) in enumerate(zip(first, base.lengths)):
        rest_k[s, :n - a], rest_v[s, :n - a] = base.k[s, a:n], base.v[s, a:n]
    layer = kv_cache.write_prefill(layer, rest_k, rest_v, lengths=base.lengths - first, page_indices=base.table,
                                   start=first)
    chunked = twin_baselines.poison(twin.Cache(layer, base.k, base.v, base.lengths, base.table))
    for a, b in zip(ref, twin_baselines.decode(chunked)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def _naive_error(q, k_hat, v_hat):
    """Error vs float64 of a same-precision computation: q and K/V in bf16, weights rounded to bf16."""
    qb = twin.bf16(q)
    kb, vb = twin.bf16(k_hat), twin.bf16(v_hat)
    group = q.shape[0] // k_hat.shape[1]
    kb, vb = np.repeat(kb, group, 1), np.repeat(vb, group, 1)
    s = np.einsum("hd,nhd->hn", qb, kb) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    naive = np.einsum("hn,nhd->hd", twin.bf16(w), vb) / w.sum(-1, keepdims=True)
    exact = twin.np_attention(q[None], k_hat, v_hat)[0]
    return np.abs(naive - exact).max()


def _check_attention(fmt, how, impl, page_size=256, **options):
    cache = cache_of(fmt, how, page_size)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((len(cache.lengths), 6, 64)).astype(np.float32)
    out = np.asarray(attention.decode_attention(q, cache.layer, page_indices=cache.table, kv_lens=cache.lengths,
                                                impl=impl, **options), np.float64)
    assert np.isfinite(out).all()
    for s, (k_hat, v_hat, _, _) in enumerate(twin_baselines.decode(cache)):
        if cache.lengths[s] == 0:
            assert not out[s].any()
            continue
        want = twin.np_attention(q[s][None], k_hat, v_hat)[0]
        tol = 1e-5 if impl == "reference" else 2 * _naive_error(q[s], k_hat, v_hat) + 1e-5
        np.testing.assert_allclose(out[s], want, atol=tol, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("how", ["prefill", "append"])
def test_reference_attention_vs_twin(fmt, how):
    _check_attention(fmt, how, "reference")


@pytest.mark.parametrize("fmt,options", [
    ("fp8", {}), ("fp8", dict(config=fp8k.KernelConfig(block_k=512, num_splits=3))),
    ("int8", {}), ("int8", dict(config=int8k.KernelConfig(block_k=512, num_splits=3))),
    ("int8", dict(config=int8k.KernelConfig(block_k=64, num_splits=2))),
    ("kivi2", {}), ("kivi2", dict(config=kivi2k.KernelConfig(num_splits=3)))])
def test_kernel_interpret_vs_twin(fmt, options):
    _check_attention(fmt, "both", "pallas", interpret=True, **options)


@pytest.mark.parametrize("fmt", FORMATS)
def test_larger_pages(fmt):  # 512-token pages: 4 KIVI chunks per page, 2 fp8 tiles per page
    for impl, options in (("reference", {}), ("pallas", {"interpret": True})):
        _check_attention(fmt, "prefill", impl, page_size=512, **options)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_gpu_vs_twin(fmt):
    _check_attention(fmt, "both", "pallas")
    _check_attention(fmt, "prefill", "pallas", config=(kivi2k.KernelConfig(num_splits=3) if fmt == "kivi2"
                                                       else fp8k.KernelConfig(block_k=512, num_splits=3)))
    if fmt == "int8":
        _check_attention(fmt, "append", "pallas", config=int8k.KernelConfig(block_k=64, num_splits=2))


@pytest.mark.parametrize("config", [None, int8k.KernelConfig(block_k=512, num_splits=3),
                                    int8k.KernelConfig(block_k=32, num_splits=2, num_warps=8)])
def test_int8_kernel_lowers_to_triton_for_cuda(config):
    """The int8 kernel's ops (int8 tile loads, f16 metadata loads, the folded scale / minimum) all have a
    Pallas-Triton lowering; what can be checked without a GPU (XLA compiles the Triton IR on the device)."""
    layer = jax.eval_shape(lambda: kv_cache.init_layer(QuantConfig(kv_format="int8", page_size=256), num_kv_heads=8,
                                                       head_dim=128, num_pages=9, max_seqs=2))
    q = jax.ShapeDtypeStruct((2, 32, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = lambda q, layer, table, lens: attention.decode_attention(q, layer, page_indices=table, kv_lens=lens,
                                                                  impl="pallas", config=config)
    text = jax.jit(fn).trace(q, layer, table, lens).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_bad_inputs():
    with pytest.raises(ValueError, match="head_dim"):
        kv_cache.init_layer(QuantConfig(kv_format="kivi2"), num_kv_heads=1, head_dim=48, num_pages=2, max_seqs=1)
    cache = cache_of("fp8", "prefill")
    bad = dict(k_codes=cache.layer.k_codes.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="k_codes"):
        fp8k.fp8_decode_attention(jnp.zeros((5, 6, 64)), bad["k_codes"], cache.layer.k_scale, cache.layer.v_codes,
                                  cache.layer.v_scale, jnp.asarray(cache.table), jnp.asarray(cache.lengths))
    cache = cache_of("int8", "prefill")
    x = cache.layer
    args = [x.k_codes, x.k_scale, x.k_min, x.v_codes, x.v_scale, x.v_min]
    q, table, lens = jnp.zeros((6, 6, 64)), jnp.asarray(cache.table), jnp.asarray(cache.lengths)
    for i, name, bad in ((0, "k_codes", x.k_codes.astype(jnp.uint8)), (3, "v_codes", x.v_codes[..., :32]),
                         (2, "k_min", x.k_min.astype(jnp.int32)), (4, "v_scale", x.v_scale[:, :, :8])):
        with pytest.raises(ValueError, match=name):
            int8k.int8_decode_attention(q, *args[:i], bad, *args[i + 1:], table, lens)
    with pytest.raises(ValueError, match="kv_lens"):
        int8k.int8_decode_attention(q, *args, table, lens[:3])
    cache = cache_of("kivi2", "prefill")
    k = np.zeros((len(LENGTHS["kivi2"]), 2, 64), np.float32)
    k[0, 0, 0] = np.nan
    active = np.eye(len(k), dtype=bool)[0]
    with pytest.raises(ValueError, match="NaN"):
        kv_cache.append(cache.layer, k, k, kv_lens=cache.lengths + active, active=active, page_indices=cache.table)


@pytest.mark.parametrize("fmt", ["kivi2"])  # fp8 takes the same dispatch (and costs another ~20 s)
def test_generator_decodes_through_the_format(fmt):
    """The Generator over the format: the Pallas kernel (interpret) and the reference give the same
    teacher-forced log-probs, at a length where kivi2 holds 2-bit K and V (143 tokens)."""
    import tiny_llama
    from hack_jax.backend import Backend
    from models.generate import Generator
    ckpt, model = tiny_llama.checkpoint_and_model()
    rng = np.random.default_rng(0)
    prompt = [rng.integers(1, ckpt.config.vocab_size, 140).tolist()]
    forced = rng.integers(1, ckpt.config.vocab_size, (1, 4)).astype(np.int32)
    out = {}
    for impl, options in (("reference", {}), ("pallas", {"interpret": True})):
        gen = Generator(model, ckpt.tokenizer, QuantConfig(kv_format=fmt), max_seqs=1, max_len=160,
                        attention=Backend(impl, options))
        out[impl] = np.asarray(gen.generate_ids(prompt, 4, forced=forced, stop_on_eos=False).forced_logprobs)
    assert np.isfinite(out["reference"]).all()
    np.testing.assert_allclose(out["pallas"], out["reference"], atol=2e-2)
