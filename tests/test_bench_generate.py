"""Smoke test of bench/bench_generate.py at toy shapes on the CPU (impl="reference").

Runs the script's main() in-process on a 2-layer toy model (one bf16 decode config in both layer
forms, --scan-layers on off; no prefill, so it stays well under a minute), then checks the JSON rows' fields and that every reported KV byte
count equals bytes-per-token x tokens computed here, independently, in float64 NumPy from the
layout formulas of docs/DESIGN.md ("Paged cache layout"), not by calling hack_jax.kv_cache.
"""

import importlib.util
import json
import os

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "bench_generate.py")
TOY = dict(num_layers=2, num_kv_heads=2, head_dim=64)  # bench_generate.TOY["toy"]


def bytes_per_token_oracle(kv_format, *, num_layers, num_kv_heads, head_dim, partition_size=64,
                           page_size=256):
    """DESIGN.md layouts, float64: page bytes per token, all layers (no open block, no sinks)."""
    d, p, ps = np.float64(head_dim), np.float64(partition_size), np.float64(page_size)
    if kv_format == "bf16":
        per_head = 2 * d * 2                                   # k, v bf16[..., page_size, D]
    elif kv_format == "int8":
        per_head = 2 * (d + 2 + 2)                             # i8 codes + f16 scale + f16 min
    elif kv_format == "hack":
        pc = min(partition_size, head_dim)
        n_groups = np.float64(head_dim // pc)
        k_sum_bytes = 1 if 3 * pc <= 255 else 2                # per (token, channel group), Pc codes
        v_sum_bytes = 1 if 3 * partition_size <= 255 else 2    # per (block, channel), P codes
        page = ((ps / 4) * d                                   # k_codes u8[ps/4, D]
                + 2 * (ps / p) * d * 2                         # k_scale, k_min f16[ps/P, D]
                + ps * n_groups * k_sum_bytes                  # k_sums [ps, NP]
                + (ps / 4) * d                                 # v_codes u8[D, ps/4] (token-major)
                + 2 * ps * n_groups * 2                        # v_scale, v_min f16[ps, NP]
                + (ps / p) * d * v_sum_bytes)                  # v_sums [ps/P, D]
        per_head = page / ps
    else:
        raise ValueError(kv_format)
    return np.float64(num_layers) * np.float64(num_kv_heads) * per_head


def test_oracle_matches_readme_numbers():
    # README: 84 B per token per kv head per layer at head_dim 128, 42 B at 64 (hack, P=64).
    assert bytes_per_token_oracle("hack", num_layers=1, num_kv_heads=1, head_dim=128) == 84.0
    assert bytes_per_token_oracle("hack", num_layers=1, num_kv_heads=1, head_dim=64) == 42.0
    # Llama-3.1-8B (32 layers, 8 kv heads): hack 21,504 B vs bf16 131,072 B per token.
    assert bytes_per_token_oracle("hack", num_layers=32, num_kv_heads=8, head_dim=128) == 21504.0
    assert bytes_per_token_oracle("bf16", num_layers=32, num_kv_heads=8, head_dim=128) == 131072.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("bench_generate", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path_factory.mktemp("bench_generate")
    bench.main(["--models", "toy", "--contexts", "256", "--batches", "1", "--formats", "bf16",
                "--prefill-contexts", "--impl", "reference", "--init", "hash", "--steps", "2", "--reps", "2",
                "--warmup", "1", "--output-tokens", "16", "--max-seconds", "120", "--scan-layers", "on", "off",
                "--out", str(out)])
    with open(out / "generate.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return out, rows


def test_outputs_and_fields(run):
    out, rows = run
    assert (out / "generate.md").read_text().startswith("# End-to-end generation")
    assert (out / "generate_decode.png").exists() and (out / "generate_capacity.png").exists()
    kinds = {r["kind"] for r in rows}
    assert {"model", "capacity", "decode", "jct", "run"} <= kinds
    for r in rows:
        assert r["jax_version"] and r["gpu"] and r["platform"] == "cpu", r
    decs = [r for r in rows if r["kind"] == "decode"]
    assert sorted(r["scan_layers"] for r in decs) == [False, True]  # --scan-layers on off
    assert all("error" not in r for r in decs), [r.get("error") for r in decs]
    dec = decs[0]
    for field in ("model", "format", "kv_format", "batch", "context", "num_layers", "embed_dim",
                  "num_q_heads", "num_kv_heads", "head_dim", "vocab_size", "tpot_ms",
                  "tokens_per_s", "compile_s", "kv_bytes", "bytes_per_token", "cache_alloc_bytes"):
        assert field in dec, field
    assert (dec["model"], dec["format"], dec["batch"], dec["context"]) == ("toy", "bf16", 1, 256)
    assert (dec["num_layers"], dec["num_kv_heads"], dec["head_dim"]) == (2, 2, 64)
    assert dec["tpot_ms"] > 0 and dec["compile_s"] > 0
    np.testing.assert_allclose(dec["tokens_per_s"], dec["batch"] / (dec["tpot_ms"] / 1e3), rtol=1e-9)
    # The allocated cache holds at least the reported tokens' pages.
    assert dec["cache_alloc_bytes"] >= dec["kv_bytes"]


def test_kv_bytes_match_independent_layout_arithmetic(run):
    _, rows = run
    checked = set()
    for r in rows:
        if r["kind"] not in ("decode", "jct", "capacity"):
            continue
        fmt = r.get("kv_format", r["format"])
        oracle = bytes_per_token_oracle(fmt, **TOY)
        assert r["bytes_per_token"] == oracle, (r["kind"], fmt)
        if r["kind"] == "decode":
            assert r["kv_bytes"] == oracle * np.float64(r["batch"]) * np.float64(r["context"])
        elif r["kind"] == "jct":
            assert r["kv_bytes"] == oracle * np.float64(r["context"])
            assert r["transfer_bytes"] >= r["kv_bytes"]
            for gbps in ("10", "25", "100"):
                np.testing.assert_allclose(r["transfer_s"][gbps],
                                           r["transfer_bytes"] * 8.0 / (float(gbps) * 1e9), rtol=1e-12)
        checked.add((r["kind"], fmt))
    assert {("jct", "hack"), ("jct", "int8"), ("jct", "bf16"), ("decode", "bf16"),
            ("capacity", "hack")} <= checked
    # hack at head_dim 64: 42 B per token per kv head per layer = 16.4% of bf16's 256 B.
    jct = {r["format"]: r for r in rows if r["kind"] == "jct"}
    assert jct["hack"]["kv_bytes"] / jct["bf16"]["kv_bytes"] == 42.0 / 256.0
    # bf16 and int8 have no per-sequence 16-bit residue; hack has its open block and sinks.
    assert jct["bf16"]["residual_bytes"] == 0 and jct["int8"]["residual_bytes"] == 0
    assert jct["hack"]["residual_bytes"] == 2 * 2 * 2 * (64 + 4) * 64 * 2  # L k/v H (P+ns) D bf16


def test_capacity_is_monotone_and_marks_fit(run):
    _, rows = run
    cap = [r for r in rows if r["kind"] == "capacity"]
    assert all(r["computed_not_allocated"] for r in cap)
    by = {(r["format"], r["context"]): r["max_batch"] for r in cap}
    for ctx in {c for _, c in by}:
        assert by["hack", ctx] >= by["int8", ctx] >= by["bf16", ctx]


def test_xla_adapter_matches_reference_attention():
    """The bf16_xla format's decode adapter == hack_jax's reference decode attention on a paged bf16
    cache with a shuffled page table, ragged lengths (one empty slot) and chunks smaller than a
    sequence (bf16 operands, float32 accumulation: ~1e-2 relative)."""
    import jax
    import jax.numpy as jnp
    from hack_jax import attention, kv_cache
    from hack_jax.config import QuantConfig

    spec = importlib.util.spec_from_file_location("bench_generate_adapter", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = QuantConfig(kv_format="bf16")  # pages of 256 tokens
    s, pps, h, d, hq = 3, 3, 2, 32, 6
    layer = kv_cache.init_layer(config, num_kv_heads=h, head_dim=d, num_pages=1 + s * pps, max_seqs=s)
    table = (1 + np.random.default_rng(0).permutation(s * pps)).reshape(s, pps).astype(np.int32)
    lengths = np.array([700, 37, 0], np.int32)
    k, v = jax.random.normal(jax.random.key(0), (2, s, 768, h, d))
    layer = kv_cache.write_prefill(layer, k, v, lengths=lengths, page_indices=table)
    q = jax.random.normal(jax.random.key(1), (s, hq, d))
    want = attention.decode_attention(q, layer, page_indices=table, kv_lens=lengths, impl="reference")
    got = jax.jit(lambda q, layer, t, n: bench.xla_paged_decode(q, layer, t, n, chunk_pages=1))(
        q, layer, jnp.asarray(table), jnp.asarray(lengths))
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2 * scale)
    assert np.all(np.asarray(got)[2] == 0)


def test_kernel_kinds_splits_a_profile_by_name():
    """bench_generate.kernel_kinds: a profiled row's GPU time per step by kind, each kernel name counted once
    (our decode kernels, XLA's scatters / dynamic-update-slices, GEMM fusions), the rest of
    gpu_us_per_step (kernels beyond the profile's top N included) as other; None without a profile."""
    spec = importlib.util.spec_from_file_location("bench_generate_kinds", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = dict(gpu_us_per_step=1000.0, gpu_kernels=[
        ["hack_decode_attention", 400.0, 28], ["gemm_fusion_dot_4", 300.0, 56], ["cublas_gemm", 50.0, 1],
        ["loop_dynamic_update_slice_fusion_3", 20.0, 2], ["input_scatter_fusion_7", 5.0, 1],
        ["input_concatenate_fusion", 40.0, 28], ["loop_exponential_fusion_27", 35.0, 28]])
    kinds = bench.kernel_kinds(row)
    assert kinds == dict(attention=400.0, append=25.0, matmul=350.0, other=225.0)
    assert bench.kernel_kinds(dict(gpu_us_per_step=5.0)) is None and bench.kernel_kinds({}) is None
