"""bench/bench_decode_attention.py's per-call cache write (`_touch`): which arrays each mode writes.

The timing loop writes one element per call into the cache arrays a decode step's append writes
(--touch append: K/V for bf16, the open block for HACK) or into every array of >= 1 MiB (--touch all,
the runs before 2026-12-01). A wrong selection silently changes what the benchmark charges each format
(bench/NOTES_decode.md "Harness"), so this checks it on plain arrays, no kernels: the written arrays
differ from the input exactly at element 0, all others are bit-identical.
"""

import dataclasses
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "bench_decode_attention.py")


@pytest.fixture()
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode_attention_touch", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    mod._set_limits(mod.MAX_COPIES, mod.UNROLL, "append")
    del sys.modules[spec.name]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:  # stand-in for hack_jax.kv_cache.KiviPages: pytree keys are attribute names
    k_codes: jax.Array
    open_k: jax.Array
    open_v: jax.Array


def _written(before, after):
    """{keystr: bool} whether each leaf changed; asserts a changed leaf changed at element 0 only."""
    out = {}
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after)):
        a, b = np.asarray(a), np.asarray(b)
        diff = a.reshape(-1) != b.reshape(-1)
        out[jax.tree_util.keystr(path)] = bool(diff.any())
        if diff.any():
            assert np.flatnonzero(diff).tolist() == [0], path
    return out


def make_arrays():
    big = np.zeros((1 << 18,), np.float32)  # 1 MiB
    layer = Layer(k_codes=jnp.asarray(big), open_k=jnp.zeros((2, 3), jnp.bfloat16),
                  open_v=jnp.zeros((2, 3), jnp.bfloat16))
    return dict(layer=layer, k=jnp.asarray(big), v=jnp.zeros((4,), jnp.float32),
                table=jnp.asarray(big.astype(np.int32)))


def test_touch_append_writes_only_the_named_arrays(bench):
    arrays, out = make_arrays(), jnp.full((2, 2), 5.0)
    got = _written(arrays, bench._touch(arrays, out, ("open_k", "open_v")))
    assert got == {"['k']": False, "['layer'].k_codes": False, "['layer'].open_k": True,
                   "['layer'].open_v": True, "['table']": False, "['v']": False}
    got = _written(arrays, bench._touch(arrays, out, ("k", "v")))
    assert got == {"['k']": True, "['layer'].k_codes": False, "['layer'].open_k": False,
                   "['layer'].open_v": False, "['table']": False, "['v']": True}


def test_touch_all_writes_every_array_of_a_mebibyte(bench):
    bench._set_limits(bench.MAX_COPIES, bench.UNROLL, "all")
    arrays, out = make_arrays(), jnp.full((2, 2), 5.0)
    got = _written(arrays, bench._touch(arrays, out, ("open_k", "open_v")))
    assert got == {"['k']": True, "['layer'].k_codes": True, "['layer'].open_k": False,
                   "['layer'].open_v": False, "['table']": True, "['v']": False}


def test_touch_append_rejects_names_that_match_nothing(bench):
    with pytest.raises(ValueError, match="none of"):
        bench._touch(make_arrays(), jnp.ones((1,)), ("open_x",))


MERGE = os.path.join(os.path.dirname(BENCH), "merge_results.py")


def test_merge_results_replaces_by_key():
    """bench/merge_results.py: a new row replaces every kept row of its key (duplicates too), a row a
    time budget skipped never replaces a measured one, other keys and run records are kept."""
    spec = importlib.util.spec_from_file_location("merge_results_test", MERGE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    key = ("impl", "kv_len")
    kept = [dict(impl="hack", kv_len=1, us=5.0), dict(impl="hack", kv_len=1, us=6.0),
            dict(impl="bf16", kv_len=1, us=9.0), dict(impl="hack", kv_len=2, us=7.0),
            dict(kind="run", command="a")]
    new = [dict(impl="hack", kv_len=1, us=4.0), dict(impl="hack", kv_len=2, error="skipped: budget"),
           dict(impl="xla", kv_len=1, error="skipped: budget"), dict(kind="run", command="b")]
    got = mod.merge(kept, new, key)
    assert sorted((r.get("impl"), r.get("kv_len"), r.get("us"), r.get("error")) for r in got if "impl" in r) == [
        ("bf16", 1, 9.0, None), ("hack", 1, 4.0, None), ("hack", 2, 7.0, None), ("xla", 1, None, "skipped: budget")]
    assert [r["command"] for r in got if r.get("kind") == "run"] == ["a", "b"]
