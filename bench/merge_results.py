"""Merge the rows of a new GPU run into a kept results table and rewrite its Markdown and plots.

    python bench/merge_results.py decode   bench/results/decode_attention.jsonl NEW.jsonl [NEW2.jsonl ...]
    python bench/merge_results.py generate bench/results/generate.jsonl NEW.jsonl

A new row replaces the kept row of the same key (decode: impl, heads, batch, kv_len; generate: model,
kind, format, batch, context), except that a row a time budget skipped never replaces a measured one;
generate's JCT rows are recomputed from the merged prefill and batch-1 decode rows.
Rows of other keys are kept, so a table can hold shapes measured by different runs: each row carries
its own gpu, jax_version, timing fields (decode rows: `touch`, absent for runs before 2026-12-01 = "all").
The Markdown header names the merged files; the rendering is the benchmarks' own (write_markdown, plots).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DECODE_KEY = ("impl", "heads", "batch", "kv_len")
GENERATE_KEY = ("model", "kind", "format", "batch", "context")
GENERATE_OPTIONAL = ("chunk", "pow2_bucket")  # part of a row's key where present (prefill rows)


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _skipped(row):
    return str(row.get("error", "")).startswith("skipped")


def merge(kept, new, key, optional=()):
    """kept rows updated by new rows: every kept row of a new row's key is dropped (duplicates too)
    unless the new row was skipped and a kept one measured; rows without every key field (run records)
    are appended. `optional` fields join the key where present (absent = None)."""
    def k(r):
        return tuple(r.get(f) for f in key + optional) if all(f in r for f in key) else None

    measured = {k(r) for r in kept if k(r) is not None and "error" not in r}
    take = [r for r in new if k(r) is None or not (_skipped(r) and k(r) in measured)]
    replaced = {k(r) for r in take} - {None}
    return [r for r in kept if k(r) is None or k(r) not in replaced] + take


def merge_decode(target, news):
    import bench_decode_attention as bda
    rows = read_rows(target)
    for path in news:
        rows = merge(rows, read_rows(path), DECODE_KEY)
    order = {n: i for i, n in enumerate(("bf16", "hack_bf16dot", "hack_int8dot", "hack", "dequant", "jax_gqa", "xla"))}
    rows.sort(key=lambda r: (bda._shape_key(r), order.get(r["impl"], 99), r["impl"]))
    base = {bda._shape_key(r): r["us"] for r in rows if r["impl"] == "bf16" and "us" in r}
    for r in rows:
        b = base.get(bda._shape_key(r))
        r["ratio_vs_bf16"] = r["us"] / b if b and "us" in r else None
    with open(target, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    gpus = sorted({r.get("gpu", "?") for r in rows})
    jaxes = sorted({r.get("jax_version", "?") for r in rows})
    methods = sorted({r.get("timing_method", "") for r in rows} - {""})
    header = (f"# Decode attention, one layer, one step ({', '.join(gpus)}, jax {', '.join(jaxes)})\n\n"
              f"Rows merged from several runs by `python bench/merge_results.py decode` (raw runs: "
              f"bench/results/h200_*/README.md; each row keeps its own run's fields in the .jsonl: roof_gbps, "
              f"timing_method, touch, config). Timing methods in this table:\n\n"
              + "\n".join(f"- {m}" for m in methods) +
              "\n\nGB/s = bytes the impl must read / us; % copy roof against the roof its run measured. "
              "time / bf16 < 1: faster than our paged bf16 kernel.")
    bda.write_markdown(rows, target[:-len(".jsonl")] + ".md", header)
    bda.write_plot(rows, target[:-len(".jsonl")] + ".png")
    return rows


def merge_generate(target, news):
    import bench_generate as bg
    rows = read_rows(target)
    for path in news:
        rows = merge(rows, read_rows(path), GENERATE_KEY, GENERATE_OPTIONAL)
    # capacity rows (computed, no batch field) of every run: the newest per (model, format, context), its
    # `fits` marks joined with the older rows' (each run marks only its own batches)
    newest, fits = {}, {}
    for i, r in enumerate(rows):
        if r.get("kind") == "capacity":
            key = (r["model"], r["format"], r["context"])
            newest[key] = i
            fits[key] = {**fits.get(key, {}), **r.get("fits", {})}
    rows = [dict(r, fits=dict(sorted(fits[r["model"], r["format"], r["context"]].items(), key=lambda kv: int(kv[0]))))
            if r.get("kind") == "capacity" else r
            for i, r in enumerate(rows) if r.get("kind") != "capacity" or newest[r["model"], r["format"], r["context"]] == i]
    # JCT rows are derived (prefill + batch-1 decode rows of a model): recomputed from the merged rows,
    # so a run that measured only some of them cannot replace complete ones with partial ones
    old_jct = [r for r in rows if r.get("kind") == "jct"]
    output_tokens = old_jct[0].get("output_tokens", 256) if old_jct else 256
    rows = [r for r in rows if r.get("kind") != "jct"]
    for name in sorted({r["model"] for r in rows if r.get("kind") in ("prefill", "decode")}):
        first = next(r for r in rows if r.get("model") == name and r.get("kind") in ("prefill", "decode"))
        common = {k: first[k] for k in ("gpu", "platform", "jax_version", "python") if k in first}
        rows += bg.jct_rows(rows, bg.model_config(name, "bf16", "pallas", False), name, output_tokens, common)
    runs = [r for r in rows if r.get("kind") == "run"]
    gpus = sorted({r.get("gpu", "?") for r in rows if r.get("gpu")})
    jaxes = sorted({r.get("jax_version", "?") for r in rows if r.get("jax_version")})
    header = (f"# End-to-end generation, random weights, real shapes ({', '.join(gpus)}, jax {', '.join(jaxes)})\n\n"
              f"Rows merged from {len(runs)} runs by `python bench/merge_results.py generate` (raw runs: "
              f"bench/results/h200_*/README.md; a row skipped by one run's time budget is replaced by another run's "
              f"measurement; rows still marked skipped were not measured). Commands:\n\n"
              + "\n".join(f"- `{r.get('command', '?')}`" for r in runs)
              + (f"\n\nTiming: {runs[-1].get('timing')}. Cache: {runs[-1].get('fill')}." if runs else "")
              + " Formats: hack = 2-bit kivi cache + our Pallas kernels (impl=pallas); bf16 = paged bf16 + "
              "our Pallas bf16 kernels; bf16_xla = paged bf16, decode attention in plain jnp/XLA (chunked "
              "gather + einsum + online softmax, bench adapter).")
    with open(target, "w") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
    bg.write_markdown(rows, target[:-len(".jsonl")] + ".md", header)
    bg.write_plots(rows, os.path.dirname(target))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", choices=("decode", "generate"))
    ap.add_argument("target", help="the kept .jsonl (rewritten, with its .md and plots)")
    ap.add_argument("new", nargs="+", help=".jsonl files of new runs, merged in this order")
    args = ap.parse_args(argv)
    for p in [args.target] + args.new:
        if not p.endswith(".jsonl") or not os.path.isfile(p):
            raise SystemExit(f"merge_results: {p!r} is not an existing .jsonl file")
    rows = (merge_decode if args.table == "decode" else merge_generate)(args.target, args.new)
    print(f"{args.target}: {len(rows)} rows")


if __name__ == "__main__":
    main()
