"""Decode-attention calls for a profiler: each config's jitted call (bench_decode_attention.py's operands, copy 0)
run 6 times, nothing timed here; under `ncu --metrics gpu__time_duration.sum --csv` every kernel of a call gets its
duration (bench/NOTES_gluon.md, session 27).

  ncu --clock-control none --metrics gpu__time_duration.sum --csv python bench/ncu_call.py IMPL:BATCH:KV_LEN[:OPT] ...

IMPL: hack (the Pallas kernel, folded_f16) or gluon; OPT (gluon): jnp (open_in_kernel=False), direct (staging
"direct"). Llama-3.1-8B heads. GPU only (the gluon kernel has no interpret mode).
"""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode_attention as b  # noqa: E402

GLUON_OPTIONS = {"": {}, "jnp": {"open_in_kernel": False}, "direct": {"staging": "direct"}}


def main(specs):
    for spec in specs:
        impl, batch, kv, *opt = spec.split(":")
        if impl not in ("hack", "gluon") or (opt and opt[0] not in GLUON_OPTIONS):
            raise ValueError(f"a config is IMPL:BATCH:KV_LEN[:OPT] (IMPL hack | gluon, OPT jnp | direct), got {spec!r}")
        shape = b.Shape("llama3.1-8b", int(batch), int(kv))
        key = jax.random.PRNGKey(0)
        prep = (b.prep_gluon(shape, key, interpret=False, **GLUON_OPTIONS[opt[0] if opt else ""]) if impl == "gluon"
                else b.prep_hack(shape, key, interpret=False, variant_kwargs={"dot_dtype": "folded_f16"}))
        q = jax.random.normal(key, (shape.batch, shape.num_q_heads, shape.head_dim), jnp.float32)
        f = jax.jit(lambda q, a, prep=prep: prep.call(q, 0, a))
        for _ in range(6):
            f(q, prep.arrays).block_until_ready()
        print("done", spec, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
