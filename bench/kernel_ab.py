"""Source variants of the HACK decode kernel timed through XLA side by side, in one process.

Each NAME=PATH is a copy of `pallas_kernels/decode_attention.py` (edited: the candidate); it is imported as a
module of its own beside the others and timed with its own default_config (dot mode folded_f16: the model's)
by `bench_hack_decode.time_variant` (a jitted loop of --calls-per-iter calls per trip, default 8; inputs
rotated over copies so the L2 does not serve them), per shape in the order given and then reversed (drift between
the two passes shows as a spread), followed by our bf16 paged kernel on a bf16 cache of the same length. Rows go
to OUT (JSON lines).

  python bench/kernel_ab.py OUT ship=pallas_kernels/decode_attention.py cand=/tmp/da_cand.py [--shapes b8_32k b1_128k]

A candidate's TTIR and offline SASS: `bench/kernel_harness.py prepare` and `bench/triton_offline.py` on a tree
that holds it. Run its gpu tests in a copy of the tree with the file in place (bench/results/h200_2026-12-04c/run5.sh).
"""
import argparse
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_hack_decode as bh  # noqa: E402


def load(name, path):
    """The module at `path` as pallas_kernels.ab_<name> (registered before it runs: dataclasses need it)."""
    spec = importlib.util.spec_from_file_location(f"pallas_kernels.ab_{name}", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="JSON-lines file the rows are appended to")
    ap.add_argument("sources", nargs="+", help="NAME=PATH of a decode_attention.py variant")
    ap.add_argument("--shapes", nargs="+", default=["b8_32k", "b1_32k", "b1_128k", "b8_128k"],
                    choices=sorted(bh.SHAPES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--target-ms", type=float, default=40.0)
    ap.add_argument("--calls-per-iter", type=int, default=8,
                    help="kernel calls per loop trip (1: each call pays the trip and any per-call setup kernel)")
    args = ap.parse_args(argv)
    mods = {}
    for item in args.sources:
        name, sep, path = item.partition("=")
        if not sep or not name or not os.path.isfile(path):
            raise SystemExit(f"expected NAME=PATH of an existing file, got {item!r}")
        mods[name] = load(name, path)
    with open(args.out, "a") as out:
        def log(row):
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()

        for shape in args.shapes:
            batch, kv_len = bh.SHAPES[shape]
            nbytes = bh.cache_bytes(batch, kv_len, sums=False)
            n_copies = bh.copies(nbytes)
            c, table, lens, ppc = bh.make_inputs(batch, kv_len, n_copies)
            for name in list(mods) + list(mods)[::-1]:
                m = mods[name]
                cfg = m.default_config(batch=batch, num_kv_heads=bh.HKV, pages_per_seq=kv_len // bh.PAGE,
                                       page_size=bh.PAGE, partition_size=bh.P, dot_dtype="folded_f16")
                us, _, _ = bh.time_variant(m.hack_decode_attention, cfg, c, table, lens, ppc, n_copies, batch,
                                           args.reps, args.target_ms,
                                           calls_per_iter=args.calls_per_iter)
                log(dict(shape=shape, variant=name, calls_per_iter=args.calls_per_iter, us=round(us, 2),
                         gbps=round(nbytes / us / 1e3, 1), config=str(cfg)))
            del c
            us, _, _, nb, _ = bh.time_bf16(batch, kv_len, args.reps, args.target_ms,
                                          calls_per_iter=args.calls_per_iter)
            log(dict(shape=shape, variant="bf16", calls_per_iter=args.calls_per_iter, us=round(us, 2),
                     gbps=round(nb / us / 1e3, 1)))


if __name__ == "__main__":
    main()
