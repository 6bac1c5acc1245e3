"""Job completion time of disaggregated serving, measured: prefill worker -> cache hand-off -> decode worker.

Per cache format (hack, int8, bf16) and prompt length C: one request of C random prompt tokens and
--output-tokens greedy tokens (no stop) through models.disagg.Pipeline: a prefill worker and a
decode worker, two spawned processes holding the same random-weight model at real shapes
(Llama-3.1-8B by default), both on this machine's first device (each process limited to
--mem-fraction of it: XLA_PYTHON_CLIENT_MEM_FRACTION), the cache handed over as a hack_jax.handoff
payload on a loopback socket. Per (format, C): --warmup untimed requests first (they compile the
prefill bucket, the decode steps, the hand-off's gather / scatter for that page count), then --reps
timed ones. From the workers' time.monotonic() stamps (one clock for the processes of a machine):
  prefill  the prompt prefilled and the first token sampled (Engine.step on the prefill worker);
  export   Engine.hand_off: the live pages of every layer copied to the host, packed, digest;
  send     the payload on the socket (handoff.send_payload / recv_payload) until the decode worker
           has read it;
  import   Engine.adopt: parsed, digest checked, copied to the device, written at the decode
           worker's pages;
  decode   output_tokens - 1 decode steps on the decode worker (batch 1);
  jct      prefill start to the last token (the sum), and router_s: the router's submit -> result.
Rows: --out/disagg.{jsonl,md}, rewritten after every row (a run cut short keeps what it measured).

  python bench/bench_disagg.py                                      # GPU: hack, int8, bf16 at 16K, 64K
  python bench/bench_disagg.py --model toy --impl reference --contexts 256 --output-tokens 8 --reps 1
                                                                    # CPU check of the script
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import bench_generate as bg  # noqa: E402  (model shapes; sets a 0.92 memory fraction: overridden below)
from hack_jax.config import QuantConfig  # noqa: E402
from models.disagg import Pipeline, WorkerSpec  # noqa: E402
from models.engine import Request  # noqa: E402

PHASES = (("prefill", "prefill_start", "prefilled"), ("export", "prefilled", "exported"),
          ("send", "exported", "received"), ("import", "received", "imported"),
          ("decode", "imported", "finished"))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(bg.PRESETS) + sorted(bg.TOY))
    ap.add_argument("--formats", nargs="+", default=["hack", "int8", "bf16"], choices=("hack", "int8", "bf16"))
    ap.add_argument("--contexts", nargs="+", type=int, default=[16384, 65536], help="prompt tokens")
    ap.add_argument("--output-tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--reps", type=int, default=2, help="timed requests per row (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests per row first (compiles)")
    ap.add_argument("--impl", default="pallas", choices=("pallas", "reference"))
    ap.add_argument("--mem-fraction", type=float, default=0.45,
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION of each worker (two share the device)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    return ap.parse_args(argv)


def row_of(base, info, router_s):
    row = dict(base, **{f"{name}_s": info[b] - info[a] for name, a, b in PHASES})
    row.update(jct_s=info["finished"] - info["prefill_start"], router_s=router_s,
               payload_bytes=info["payload_bytes"], device=info.get("device"))
    out = base["output_tokens"]
    row["tpot_ms"] = 1e3 * row["decode_s"] / max(out - 1, 1)
    return row


def write(rows, args, argv):
    """--out/disagg.{jsonl,md} of the rows so far; returns the markdown lines."""
    with open(os.path.join(args.out, "disagg.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    device = next((r["device"] for r in rows if r.get("device")), "?")
    lines = [f"# Disaggregated prefill -> hand-off -> decode, one request ({args.model} shapes, random "
             f"weights, {device})", "",
             "`python bench/bench_disagg.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`; "
             f"both workers on one device; median of {args.reps} after {args.warmup} untimed; "
             f"{args.output_tokens} output tokens; seconds.", "",
             "| format | prompt | payload MiB | prefill | export | send | import | decode (TPOT ms) | JCT | router |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['format']} | {r['context']} | error: {r['error'][:200]} |||||||")
            continue
        lines.append(f"| {r['format']} | {r['context']} | {r['payload_bytes'] / 2**20:.1f} | {r['prefill_s']:.3f} "
                     f"| {r['export_s']:.3f} | {r['send_s']:.3f} | {r['import_s']:.3f} | {r['decode_s']:.3f} "
                     f"({r['tpot_ms']:.2f}) | {r['jct_s']:.3f} | {r['router_s']:.3f} |")
    with open(os.path.join(args.out, "disagg.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    # The workers are spawned: they read these at their jax import. This process never touches a device.
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
    cfg = bg.model_config(args.model, "hack", args.impl, False, scan_layers=False)  # bf16, unrolled
    max_len = max(args.contexts) + args.output_tokens + 64
    spec = WorkerSpec(random=cfg, quant=QuantConfig(), max_seqs=1, max_len=max_len)
    rng = np.random.default_rng(0)
    rows, rid = [], 0
    t0 = time.monotonic()
    with Pipeline(spec) as pipe:
        print(f"workers up in {time.monotonic() - t0:.1f} s (model init included)", flush=True)
        for context, fmt in [(c, f) for c in args.contexts for f in args.formats]:
            base = dict(model=args.model, format=fmt, context=context, output_tokens=args.output_tokens,
                        reps=args.reps, impl=args.impl, max_len=max_len,
                        glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""))
            timed, compile_s = [], 0.0
            try:
                for rep in range(args.warmup + args.reps):
                    ids = rng.integers(0, cfg.vocab_size, context).tolist()
                    t = time.monotonic()
                    pipe.submit(rid, fmt, Request(ids, max_tokens=args.output_tokens, ignore_eos=True))
                    msg = pipe.recv(timeout=900)
                    rid += 1
                    if msg[0] == "error":
                        raise RuntimeError(msg[2])
                    info = msg[3]["info"]
                    if "received" not in info:
                        raise RuntimeError(f"request ended at the prefill: {msg[3]['finish_reason']}")
                    if rep < args.warmup:
                        compile_s += info.get("compile_s", 0.0)
                        continue
                    timed.append(row_of(base, info, time.monotonic() - t))
            except RuntimeError as e:
                rows.append(dict(base, error=f"{type(e).__name__}: {e}"))
                print(json.dumps(rows[-1]), flush=True)
                write(rows, args, argv)
                if not (pipe.prefill.is_alive() and pipe.decode.is_alive()):
                    break  # a worker died (out of memory?): nothing more can run
                continue
            row = {k: (float(np.median([r[k] for r in timed])) if isinstance(v, float) else v)
                   for k, v in timed[0].items()}
            row.update(warmup_prefill_compile_s=compile_s, jct_each_s=[r["jct_s"] for r in timed])
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(rows, args, argv)
    print("\n".join(write(rows, args, argv)))
    return rows


if __name__ == "__main__":
    main()
