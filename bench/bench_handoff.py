"""The prefill -> decode hand-off of one sequence's cache, measured: bytes, serialize, send, restore.

For each cache format (hack, int8, bf16) and context, a KVCache at real model shapes (random
weights are not needed: the cache is filled synthetically as in bench_generate.py) holds one
sequence of C tokens; then
  serialize  hack_jax.handoff.export_sequence (device -> host copy of the live pages of every layer,
             packing, SHA-256), seconds;
  send       the payload through a local socket to a second process, which reads it and checks its
             header and digest (hack_jax.handoff.read_header) before it acknowledges; seconds from
             the first byte sent to the acknowledgement;
  restore    hack_jax.handoff.import_sequence into another cache whose slot got other page ids
             (host parse, host -> device copy, scatter into the pool), seconds;
and the payload's bytes. Rows: --out/handoff.{jsonl,md}, rewritten after every row (a run cut
short by a time limit keeps what it measured). Contexts run in the outer loop, formats inside, so
every format gets its short contexts before the long ones (bf16 at 64K moves ~8.6 GiB per round:
about a minute and a half on the H200 host path; --reps 1 halves a run).

  python bench/bench_handoff.py                               # GPU: Llama-3.1-8B shapes, 4K 16K 64K
  python bench/bench_handoff.py --formats bf16 int8 --reps 1  # the rows a 200 s stage did not reach
  python bench/bench_handoff.py --model toy --contexts 512    # CPU check of the script
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Client, Listener

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_generate as bg  # noqa: E402
from hack_jax import handoff, kv_cache, paging  # noqa: E402
from hack_jax.config import QuantConfig  # noqa: E402

FORMATS = {"hack": "hack", "int8": "int8", "bf16": "bf16"}


def receiver(address, authkey, ready):
    """Child process: accepts payloads, checks each one's header and digest, acknowledges its size."""
    with Listener(address, authkey=authkey) as listener:
        ready.set()
        with listener.accept() as conn:
            while True:
                payload = conn.recv_bytes()
                if not payload:
                    return
                header = handoff.read_header(payload)
                conn.send((len(payload), header.kv_len))


def receiving_cache(cache, kv_len):
    """An empty cache like `cache` with 2 slots whose slot 1 gets pages after a slot-0 sequence."""
    alloc = paging.PageAllocator(cache.num_pages + cache.pages_per_seq, 2, cache.pages_per_seq,
                                 cache.config.page_size, kv_cache.sink_tokens(cache.config))
    alloc.admit(0, kv_len)
    alloc.admit(1, kv_len)
    first = cache.layers[0]
    dst = kv_cache.init_cache(cache.config, num_layers=cache.num_layers, num_kv_heads=first.num_kv_heads,
                              head_dim=first.head_dim, num_pages=alloc.num_pages, max_seqs=2,
                              pages_per_seq=cache.pages_per_seq)
    return dst, alloc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096, 16384, 65536])
    ap.add_argument("--reps", type=int, default=3, help="timed rounds per row (median), after --warmup")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds per row (the first compiles "
                    "the gather and the scatter of that page count)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    ctx = mp.get_context("spawn")
    ready, authkey = ctx.Event(), os.urandom(16)
    listener_address = ("127.0.0.1", 0)
    with Listener(listener_address) as probe:  # an ephemeral port that is free right now
        address = probe.address
    child = ctx.Process(target=receiver, args=(address, authkey, ready), daemon=True)
    child.start()
    ready.wait(60)
    conn = Client(address, authkey=authkey)

    rows = []
    device = jax.devices()[0].device_kind
    cfg = bg.model_config(args.model, "hack", "reference", False, scan_layers=False,
                          stack_cache=False)  # a tuple of layers, as receiving_cache builds
    for context in args.contexts:
        for fmt in args.formats:
            quant = QuantConfig(kv_format=FORMATS[fmt])
            cache, pps = bg.filled_cache(cfg, quant, 1, context + 1)
            table = np.asarray(cache.page_indices)
            times = dict(serialize=[], send=[], restore=[])
            for rep in range(args.warmup + args.reps):  # the first compiles gather and scatter: untimed
                t = time.perf_counter()
                payload = handoff.export_sequence(cache, slot=0, page_indices=table, kv_len=context)
                times["serialize"].append(time.perf_counter() - t)
                t = time.perf_counter()
                conn.send_bytes(payload)
                size, kv_len = conn.recv()
                times["send"].append(time.perf_counter() - t)
                assert size == len(payload) and kv_len == context
                dst, alloc = receiving_cache(cache, context)
                t = time.perf_counter()
                out = handoff.import_sequence(dst, payload, slot=1, page_indices=alloc.page_indices)
                jax.block_until_ready(out)
                times["restore"].append(time.perf_counter() - t)
                del out, dst
                if rep < args.warmup:
                    times = {k: [] for k in times}
            row = dict(model=args.model, format=fmt, context=context, bytes=len(payload), device=device,
                       jax=jax.__version__, reps=args.reps,
                       **{f"{k}_s": float(np.median(v)) for k, v in times.items()})
            row["send_gbps"] = 8 * row["bytes"] / row["send_s"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(rows, args, argv, device)
            del cache, payload
    conn.send_bytes(b"")
    conn.close()
    child.join(30)
    print("\n".join(write(rows, args, argv, device)))


def write(rows, args, argv, device):
    """--out/handoff.{jsonl,md} of the rows so far; returns the markdown lines."""
    with open(os.path.join(args.out, "handoff.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    lines = [f"# Hand-off of one sequence's cache ({args.model} shapes, {device}, jax {jax.__version__})", "",
             "`python bench/bench_handoff.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`; "
             f"median of {args.reps} after {args.warmup} untimed (the first compiles). send = a local socket to a second process that checks the digest.", "",
             "| format | context | payload MiB | vs bf16 | serialize s | send s (Gb/s) | restore s |",
             "|---|---|---|---|---|---|---|"]
    bf16 = {r["context"]: r["bytes"] for r in rows if r["format"] == "bf16"}
    for r in rows:
        ratio = f"{r['bytes'] / bf16[r['context']]:.3f}" if r["context"] in bf16 else "-"
        lines.append(f"| {r['format']} | {r['context']} | {r['bytes'] / 2**20:.1f} | {ratio} | {r['serialize_s']:.3f} "
                     f"| {r['send_s']:.3f} ({r['send_gbps']:.1f}) | {r['restore_s']:.3f} |")
    with open(os.path.join(args.out, "handoff.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
