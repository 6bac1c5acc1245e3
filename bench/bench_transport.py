"""A payload over a loopback socket to a second process: hack_jax.handoff.send_payload / recv_payload
against multiprocessing.connection's send_bytes / recv_bytes. Per transfer: wall seconds until the
receiver has every byte (it answers with the size) and CPU seconds on each side; median of --reps.
CPU seconds per GB bound the rate a free core per side would reach (the wall clock of a shared
machine does not).

  python bench/bench_transport.py --mib 64 256
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

import numpy as np  # noqa: E402

from hack_jax import handoff  # noqa: E402

WAYS = ("connection", "handoff")


def receiver(address, way):
    with Client(address) as conn:
        while True:
            cpu = time.process_time()
            message = handoff.recv_payload(conn) if way == "handoff" else conn.recv_bytes()
            if not len(message):
                return
            conn.send((len(message), time.process_time() - cpu))
            del message


def measure(way, n, reps):
    payload = handoff._buffer(n)
    np.frombuffer(payload, np.uint8)[:] = 7
    with Listener(("127.0.0.1", 0)) as listener:
        child = mp.get_context("spawn").Process(target=receiver, args=(listener.address, way))
        child.start()
        conn = listener.accept()
    runs = []
    for _ in range(reps):
        t, cpu = time.perf_counter(), time.process_time()
        handoff.send_payload(conn, payload) if way == "handoff" else conn.send_bytes(payload)
        size, recv_cpu = conn.recv()
        assert size == n
        runs.append((time.perf_counter() - t, time.process_time() - cpu, recv_cpu))
    handoff.send_payload(conn, b"")
    child.join(30)
    wall, send_cpu, recv_cpu = (float(np.median(x)) for x in zip(*runs))
    return dict(way=way, mib=n >> 20, reps=reps, wall_s=wall, gbps=8 * n / wall / 1e9,
                best_gbps=8 * n / min(r[0] for r in runs) / 1e9, send_cpu_s_per_gb=send_cpu / n * 1e9,
                recv_cpu_s_per_gb=recv_cpu / n * 1e9, cpu_bound_gbps=8 * n / max(send_cpu, recv_cpu) / 1e9,
                load=os.getloadavg()[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    for mib in args.mib:
        for way in args.ways:
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in measure(way, mib << 20, args.reps).items()}), flush=True)


if __name__ == "__main__":
    main()
