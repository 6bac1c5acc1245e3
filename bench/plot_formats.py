"""Every KV format on two panels: perplexity gap vs bits per element, and decode-kernel time vs bits.

    python bench/plot_formats.py [--accuracy A.jsonl ...] [--decode bench/results/decode_attention.jsonl]
        [--out bench/results/formats_gap_speed.png]

Left: the perplexity gap (ratio to float32 - 1) of each format's rows in the accuracy files (one marker per
model, text and context; bench_accuracy.py rows), against bits per element. Right: the one-layer decode-kernel
time at Llama-3.1-8B heads, 8 x 32K (bench_decode_attention.py rows of one run), against the bits each kernel
reads per element (its bytes over bf16's, x 16). Both axes of the right panel are from the decode rows alone.
"""
from __future__ import annotations

import argparse
import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# decode rows -> the accuracy format they time (the formats' decode kernels; hack: the folded operands the
# model decodes with)
DECODE_IMPLS = {"bf16": "bf16", "fp8": "fp8", "int8": "int8", "kivi2": "kivi2-cache", "int4": "int4",
                "turbo3": "turbo3", "turbo4": "turbo4", "hack_folded_f16": "hack-p64",
                "hack4_folded_f16": "hack4-p64", "hackw_folded_f16": "hack-k32v64-vhad-w128"}


def read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--accuracy", nargs="+", default=[os.path.join(RESULTS, "accuracy_grid.jsonl")])
    ap.add_argument("--decode", default=os.path.join(RESULTS, "decode_attention.jsonl"))
    ap.add_argument("--shape", default="llama3.1-8b:8:32768", help="heads:batch:kv_len of the decode panel")
    ap.add_argument("--out", default=os.path.join(RESULTS, "formats_gap_speed.png"))
    args = ap.parse_args(argv)
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    markers = "os^vD<>p*hx+"
    for path in args.accuracy:
        rows = [r for r in read(path) if r["format"] != "float32" and "ratio" in r]
        for i, fmt in enumerate(sorted({r["format"] for r in rows})):
            mine = [r for r in rows if r["format"] == fmt]
            left.scatter([r["bits_per_element"] for r in mine], [r["ratio"] - 1 for r in mine], s=18,
                         marker=markers[i % len(markers)], label=f"{fmt} ({mine[0]['model'][:12]})")
    left.set_xlabel("bits per element (cache arrays)")
    left.set_ylabel("perplexity ratio to float32 - 1")
    left.set_yscale("symlog", linthresh=0.01)
    left.set_title("accuracy: every (model, text, context) cell")
    left.legend(fontsize=6, ncol=2)

    heads, batch, kv_len = args.shape.split(":")
    dec = {r["impl"]: r for r in read(args.decode) if r["heads"] == heads and r["batch"] == int(batch)
           and r["kv_len"] == int(kv_len) and "us" in r}
    bf16 = dec.get("bf16")
    for impl, fmt in DECODE_IMPLS.items():
        if impl in dec and bf16 is not None:
            r = dec[impl]
            bits = 16 * r["bytes"] / bf16["bytes"]
            right.scatter([bits], [r["us"]], s=30)
            right.annotate(fmt, (bits, r["us"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    right.set_xlabel("bits per element read by the kernel")
    right.set_ylabel("us per call (one layer)")
    right.set_yscale("log")
    right.set_title(f"decode kernel, {heads} heads, {batch} x {kv_len} ({(bf16 or {}).get('gpu', '')})")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
