"""pallas_kernels.bf16_decode_attention vs an independent float64 NumPy reference.

The reference here reads the cache token by token through the page table (page t // page_size,
slot t % page_size) and does the softmax in float64; it shares nothing with the kernel. The library's
own twin of this kernel is hack_jax.attention.decode_attention(impl="reference") for kv_format="bf16";
one test checks the kernel against it through the dispatch (impl="pallas").

Tolerance (STYLE.md): the kernel's error against float64 must stay within 2x the error of a naive
same-precision computation (bf16 K/V and q, unnormalized weights rounded to bf16 before the PV
product, float32-exact sums), plus 1e-6. Sequences of length 1 must come out exact (weight 1).

Every case fills unused pages, the slots past kv_len in a sequence's last page, and the spare pool
pages with NaN, and puts garbage ids (negative, huge, or NaN pages) in page table entries past a
sequence's last page. CPU: interpret=True; `gpu`-marked variants compile for the GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.bf16_decode_attention import KernelConfig, bf16_decode_attention, default_config

MIXED_LENGTHS = (1, 63, 64, 65, 1000, 0)
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)


def make_case(*, lengths, num_q_heads, num_kv_heads, head_dim, page_size, pages_per_seq=None, spare_pages=5,
              seed=0):
    """A shuffled paged bf16 cache holding `lengths` tokens per sequence; NaN wherever nothing is stored."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    used = [-(-n // page_size) for n in lengths]
    pages_per_seq = pages_per_seq or max(max(used), 1)
    num_pages = sum(used) + spare_pages
    k = np.full((num_pages, num_kv_heads, page_size, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    perm = rng.permutation(num_pages)
    spare = perm[sum(used):]
    page_indices = np.zeros((batch, pages_per_seq), np.int32)
    k_seq, v_seq = [], []
    nxt = 0
    for b, n in enumerate(lengths):
        ks = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        vs = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        k_seq.append(_bf16(ks)), v_seq.append(_bf16(vs))
        for slot in range(pages_per_seq):
            if slot < used[b]:
                page_indices[b, slot] = perm[nxt]
                nxt += 1
            else:
                page_indices[b, slot] = rng.choice([-7, 10**6, *spare[:2]])
        for t in range(n):
            page, off = page_indices[b, t // page_size], t % page_size
            k[page, :, off], v[page, :, off] = ks[t], vs[t]
    q = rng.standard_normal((batch, num_q_heads, head_dim)).astype(np.float32)
    return dict(q=q, k=k, v=v, page_indices=page_indices, kv_lens=np.asarray(lengths, np.int32),
                k_seq=k_seq, v_seq=v_seq)


def reference(case, *, naive_bf16=False):
    """float64 attention per (sequence, q head) on the stored tokens; optionally with the bf16 rounding
    of the weights a same-precision implementation would do."""
    q = _bf16(case["q"])
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // case["k"].shape[1]
    out = np.zeros((batch, num_q_heads, head_dim))
    for b, n in enumerate(case["kv_lens"]):
        if n == 0:
            continue
        for h in range(num_q_heads):
            kk, vv = case["k_seq"][b][:, h // group], case["v_seq"][b][:, h // group]  # [n, d]
            s = kk @ q[b, h] / np.sqrt(head_dim)
            w = np.exp(s - s.max())
            wv = _bf16(w) if naive_bf16 else w
            out[b, h] = (wv @ vv) / w.sum()
    return out


def run_kernel(case, *, config=None, interpret=True, q_dtype=jnp.float32):
    out = bf16_decode_attention(
        jnp.asarray(case["q"], q_dtype), jnp.asarray(case["k"], jnp.bfloat16), jnp.asarray(case["v"], jnp.bfloat16),
        jnp.asarray(case["page_indices"]), jnp.asarray(case["kv_lens"]), config=config, interpret=interpret)
    assert out.dtype == jnp.float32 and out.shape == case["q"].shape
    return np.asarray(out, np.float64)


def check(case, out):
    assert np.all(np.isfinite(out)), "NaN/inf leaked from unused pages or empty sequences"
    ref, naive = reference(case), reference(case, naive_bf16=True)
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    naive_err = np.linalg.norm(naive - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= 2 * naive_err + 1e-6, f"{err=} {naive_err=}"
    for b, n in enumerate(case["kv_lens"]):
        if n == 0:
            np.testing.assert_array_equal(out[b], 0.0)
        if n == 1:  # softmax weight exactly 1: the stored v row, bit for bit
            group = out.shape[1] // case["k"].shape[1]
            np.testing.assert_array_equal(out[b], np.repeat(case["v_seq"][b][0], group, axis=0))


# ------------------------------------------------------------------------------------------ CPU

@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_groups_and_head_dims(group, head_dim):
    case = make_case(lengths=MIXED_LENGTHS, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     page_size=64, seed=group * head_dim)
    check(case, run_kernel(case, config=KernelConfig(block_k=64, num_splits=3)))


@pytest.mark.parametrize("config", [
    KernelConfig(block_k=16, num_splits=1),   # slices of a page
    KernelConfig(block_k=32, num_splits=7),
    KernelConfig(block_k=64, num_splits=1),   # one page per tile
    KernelConfig(block_k=128, num_splits=2),  # two pages gathered per tile
    KernelConfig(block_k=256, num_splits=5),  # four pages, page table padded to whole tiles
    None,                                     # default_config
], ids=str)
def test_tiles_and_splits(config):
    case = make_case(lengths=MIXED_LENGTHS, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=64,
                     pages_per_seq=17, seed=1)
    check(case, run_kernel(case, config=config))


@pytest.mark.parametrize("length", MIXED_LENGTHS)
def test_single_lengths(length):
    case = make_case(lengths=(length,), num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=64,
                     pages_per_seq=16, seed=length)
    check(case, run_kernel(case, config=KernelConfig(block_k=64, num_splits=4)))


def test_all_empty_and_bf16_query():
    case = make_case(lengths=(0, 0), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                     pages_per_seq=3, seed=3)
    np.testing.assert_array_equal(run_kernel(case, q_dtype=jnp.bfloat16), 0.0)


def test_lengths_beyond_capacity_are_clipped():
    case = make_case(lengths=(128,), num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=64, seed=4)
    want = run_kernel(case)
    case["kv_lens"] = np.array([10**6], np.int32)
    np.testing.assert_array_equal(run_kernel(case), want)


def test_default_config_fills_the_gpu():
    c = default_config(batch=8, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=256, pages_per_seq=128)
    assert c.block_k * 128 * 2 == 32768 and 8 * 8 * c.num_splits >= 132
    small = default_config(batch=1, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, pages_per_seq=1)
    assert small.block_k == 16 and small.num_splits == 1


@pytest.mark.parametrize("bad", ["k_dtype", "heads", "page_table", "kv_lens", "head_dim", "block_k"])
def test_validation(bad):
    case = make_case(lengths=(5,), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, seed=5)
    q, k, v = jnp.asarray(case["q"]), jnp.asarray(case["k"], jnp.bfloat16), jnp.asarray(case["v"], jnp.bfloat16)
    pi, lens, config = jnp.asarray(case["page_indices"]), jnp.asarray(case["kv_lens"]), None
    if bad == "k_dtype":
        k = k.astype(jnp.float32)
    elif bad == "heads":
        q = jnp.zeros((1, 3, 64))
    elif bad == "page_table":
        pi = pi.astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.float32)
    elif bad == "kv_lens":
        lens = jnp.zeros((2,), jnp.int32)
    elif bad == "head_dim":
        q = jnp.zeros((1, 4, 32))
    else:
        config = KernelConfig(block_k=48)
    with pytest.raises(ValueError):
        bf16_decode_attention(q, k, v, pi, lens, config=config, interpret=True)


def test_matches_the_library_twin_through_the_dispatch():
    """hack_jax.attention's impl="pallas" reaches this kernel for kv_format="bf16"; impl="reference" is
    its twin (float32 attention over the gathered pages). Bound: bf16 operands (METHOD.md: 1e-3..1e-2)."""
    from hack_jax import attention, kv_cache, paging
    from hack_jax.config import QuantConfig

    cache = kv_cache.init_cache(QuantConfig(kv_format="bf16", page_size=64, partition_size=16), num_layers=1,
                                num_kv_heads=2, head_dim=64, num_pages=8, max_seqs=3, pages_per_seq=2)
    alloc = paging.PageAllocator.for_cache(cache)
    lens = np.array([5, 0, 100], np.int32)
    for slot, n in enumerate(lens):
        if n:
            alloc.admit(slot, int(n))
    pi, kv_lens = jnp.asarray(alloc.page_indices), jnp.asarray(lens)
    rng = np.random.default_rng(8)
    k, v = (jnp.asarray(rng.standard_normal((3, 100, 2, 64)), jnp.float32) for _ in range(2))
    layer = kv_cache.write_prefill(cache.layers[0], k, v, lengths=kv_lens, page_indices=pi)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    got = attention.decode_attention(q, layer, page_indices=pi, kv_lens=kv_lens, impl="pallas", interpret=True)
    want = attention.decode_attention(q, layer, page_indices=pi, kv_lens=kv_lens, impl="reference")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
    np.testing.assert_array_equal(np.asarray(got)[1], 0.0)


# ------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gqa_groups_and_head_dims(group, head_dim):
    case = make_case(lengths=MIXED_LENGTHS, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     page_size=64, seed=group * head_dim)
    for config in (KernelConfig(block_k=64, num_splits=3), KernelConfig(block_k=128, num_splits=2), None):
        check(case, run_kernel(case, config=config, interpret=False))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("config", [None, KernelConfig(block_k=128, num_splits=4, num_warps=8, num_stages=3),
                                    KernelConfig(block_k=64, num_splits=5, num_warps=4, num_stages=4)], ids=str)
def test_gpu_llama_heads_page_256(config):
    case = make_case(lengths=(1, 255, 256, 257, 3000, 0, 8192, 77), num_q_heads=32, num_kv_heads=8,
                     head_dim=128, page_size=256, seed=7)
    check(case, run_kernel(case, config=config, interpret=False))
