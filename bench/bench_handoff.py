"""The prefill -> decode hand-off of one sequence's cache, measured: bytes, serialize, send, restore.

For each cache format (hack, int8, bf16) and context, a KVCache at real model shapes (random
weights are not needed: the cache is filled synthetically as in bench_generate.py) holds one
sequence of C tokens; then
  serialize  hack_jax.handoff.export_sequence: gather of the live pages of every layer on the
             device, device -> host copy, copies into the payload + its digest (one piece per core);
  send       the payload through a local socket to a second process (handoff.send_payload /
             recv_payload), seconds until it has every byte; it then checks the header and digest
             (handoff.read_header) and reports that time (peer check);
  restore    hack_jax.handoff.import_sequence into another cache whose slot got other page ids
             (header and digest check, host -> device copy, write into the pool);
with each phase's seconds (export / import `timings`) and the payload's bytes; the host's own
reference rates (memcpy into fresh memory, SHA-256, the digest on every core) head the table.
Rows: --out/handoff.{jsonl,md}, rewritten after every row (a run cut short by a time limit keeps
what it measured). Contexts run in the outer loop, formats inside, so every format gets its short
contexts before the long ones (bf16 at 64K is 8 GiB per round at Llama-3.1-8B shapes).

  python bench/bench_handoff.py                               # GPU: Llama-3.1-8B shapes, 4K 16K 64K
  python bench/bench_handoff.py --formats bf16 --host-memory pinned_host   # staged in pinned memory
  python bench/bench_handoff.py --model toy --contexts 512    # CPU check of the script
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
import zlib
from multiprocessing.connection import Client, Listener

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_generate as bg  # noqa: E402
from hack_jax import handoff, kv_cache, paging  # noqa: E402
from hack_jax.config import QuantConfig  # noqa: E402

FORMATS = {"hack": "hack", "int8": "int8", "bf16": "bf16"}


def receiver(address, authkey, ready):
    """Child process: receives payloads (handoff.recv_payload), acknowledges each one's arrival, then
    checks its header and digest and answers (bytes, kv_len, seconds of the check)."""
    with Listener(address, authkey=authkey) as listener:
        ready.set()
        with listener.accept() as conn:
            while True:
                payload = handoff.recv_payload(conn)
                if not len(payload):
                    return
                conn.send("received")
                t = time.perf_counter()
                header = handoff.read_header(payload)
                conn.send((len(payload), header.kv_len, time.perf_counter() - t))
                del payload


def host_rates(mib):
    """This host's reference rates in GB/s over `mib` MiB: a copy into a fresh payload buffer
    (handoff._buffer: huge pages) and into a fresh bytes object (4 KiB pages), SHA-256 on one
    thread, the payload's digest (a hash list, every core), and two other checksums. Best of 3,
    by the wall clock and (keys *_cpu) per CPU second (steadier on a shared machine)."""
    n = mib << 20
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)

    def copy_fresh():
        np.frombuffer(handoff._buffer(n), np.uint8)[:] = src

    tests = dict(memcpy_fresh=copy_fresh, bytes_fresh=src.tobytes,
                 sha256=lambda: hashlib.sha256(src).digest(), digest_v2=lambda: handoff._digest(src, 2),
                 crc32=lambda: zlib.crc32(src), blake2b=lambda: hashlib.blake2b(src).digest())
    rates = {}
    for name, fn in tests.items():
        best, best_cpu = float("inf"), float("inf")
        for _ in range(3):
            t, c = time.perf_counter(), time.process_time()
            fn()
            best, best_cpu = min(best, time.perf_counter() - t), min(best_cpu, time.process_time() - c)
        rates[name] = round(n / best / 1e9, 2)
        rates[f"{name}_cpu"] = round(n / max(best_cpu, 1e-9) / 1e9, 2)
    return rates


def host_memory_setup():
    """The host settings that decide what a fresh page costs: transparent huge pages, glibc's."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "?"
    return dict(thp=thp, glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""))


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
    ap.add_argument("--host-memory", default=None, choices=("pinned_host",),
                    help="memory kind the device <-> host copies go through (default: jax's)")
    ap.add_argument("--rates-mib", type=int, default=256,
                    help="buffer size of this host's reference rates (memcpy, checksums); 0: skip")
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
    rates = host_rates(args.rates_mib) if args.rates_mib else {}
    print(f"host rates GB/s ({args.rates_mib} MiB, {handoff._threads()} threads): {rates}", flush=True)
    cfg = bg.model_config(args.model, "hack", "reference", False, scan_layers=False,
                          stack_cache=False)  # a tuple of layers, as receiving_cache builds
    for context in args.contexts:
        for fmt in args.formats:
            quant = QuantConfig(kv_format=FORMATS[fmt])
            cache, pps = bg.filled_cache(cfg, quant, 1, context + 1)
            table = np.asarray(cache.page_indices)
            times = collections.defaultdict(list)
            for rep in range(args.warmup + args.reps):  # the first compiles gather and scatter: untimed
                phases, payload = {}, None
                t, c = time.perf_counter(), time.process_time()  # CPU seconds: every thread's
                payload = handoff.export_sequence(cache, slot=0, page_indices=table, kv_len=context,
                                                  host_memory=args.host_memory, timings=phases)
                times["serialize"].append(time.perf_counter() - t)
                times["serialize_cpu"].append(time.process_time() - c)
                t = time.perf_counter()
                handoff.send_payload(conn, payload)
                assert conn.recv() == "received"
                times["send"].append(time.perf_counter() - t)
                size, kv_len, check_s = conn.recv()
                times["peer_check"].append(check_s)
                assert size == len(payload) and kv_len == context
                dst, alloc = receiving_cache(cache, context)
                t, c = time.perf_counter(), time.process_time()
                out = handoff.import_sequence(dst, payload, slot=1, page_indices=alloc.page_indices, donate=True,
                                              host_memory=args.host_memory, timings=phases)
                jax.block_until_ready(out)
                times["restore"].append(time.perf_counter() - t)
                times["restore_cpu"].append(time.process_time() - c)
                for k, v in phases.items():
                    times[k].append(v)
                size = len(payload)
                del out, dst, payload
                if rep < args.warmup:
                    times.clear()
            row = dict(model=args.model, format=fmt, context=context, bytes=size, device=device,
                       jax=jax.__version__, reps=args.reps, host_memory=args.host_memory, threads=handoff._threads(),
                       host_rates=rates, **host_memory_setup(),
                       **{f"{k}_s": float(np.median(v)) for k, v in times.items()})
            row["send_gbps"] = 8 * row["bytes"] / row["send_s"] / 1e9
            for k in ("serialize", "send", "restore"):
                row[f"{k}_mbps"] = row["bytes"] / row[f"{k}_s"] / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(rows, args, argv, device)
            del cache
    handoff.send_payload(conn, b"")
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
             f"median of {args.reps} after {args.warmup} untimed (the first compiles); host memory "
             f"{args.host_memory or 'default'}. send = a local socket to a second process (handoff.send_payload / "
             f"recv_payload), until it has the bytes; peer check = its digest check after that.", "",
             f"Host reference rates, GB/s ({args.rates_mib} MiB, {rows[0]['threads'] if rows else '?'} threads): "
             + ", ".join(f"{k} {v}" for k, v in (rows[0]["host_rates"] if rows else {}).items()
                         if not k.endswith("_cpu"))
             + f"; THP {host_memory_setup()['thp']}, GLIBC_TUNABLES={host_memory_setup()['glibc_tunables'] or '-'}", "",
             "| format | context | payload MiB | vs bf16 | serialize s (GB/s) | gather / d2h / pack+digest s "
             "| send s (Gb/s) | peer check s | restore s (GB/s) | check / h2d / scatter s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    bf16 = {r["context"]: r["bytes"] for r in rows if r["format"] == "bf16"}
    for r in rows:
        ratio = f"{r['bytes'] / bf16[r['context']]:.3f}" if r["context"] in bf16 else "-"
        split = lambda *ks: " / ".join(f"{r[k + '_s']:.3f}" for k in ks)
        lines.append(f"| {r['format']} | {r['context']} | {r['bytes'] / 2**20:.1f} | {ratio} "
                     f"| {r['serialize_s']:.3f} ({r['serialize_mbps'] / 1e3:.2f}) "
                     f"| {split('gather', 'device_to_host', 'pack_digest')} "
                     f"| {r['send_s']:.3f} ({r['send_gbps']:.1f}) | {r['peer_check_s']:.3f} "
                     f"| {r['restore_s']:.3f} ({r['restore_mbps'] / 1e3:.2f}) "
                     f"| {split('check', 'host_to_device', 'scatter')} |")
    with open(os.path.join(args.out, "handoff.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
