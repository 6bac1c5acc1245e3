"""Offline (CPU-only) compile of the Gluon decode kernel to sm_90 SASS and its loop's instruction counts.

  PYTHONPATH=.:/tmp/tri python bench/gluon_offline.py [--maxnreg N] [--async-mode 0..31]
      [--dense 0|2|3] [--out DIR]

pip Triton 3.6 (`pip install --target /tmp/tri triton==3.6.0`) compiles `pallas_kernels/gluon_decode_kernel.py`
for Llama-3.1-8B heads at 8 x 32K (32 q / 8 kv heads, d 128, P 64, page 256, 16 splits and, with DENSE 3, the
dense program), then `cuobjdump` gives the registers, stack and the SASS; the loop is the widest backward
branch's body (one packing group = 4 blocks per trip; the masked tail group is outside it). The numbers of
bench/NOTES_gluon.md's offline table come from this.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton_offline  # noqa: E402


def compile_sass(*, batch=8, kv_len=32768, splits=16, async_mode=0, maxnreg=None, dense=3,
                 out_dir="/tmp/gluon_offline"):
    """(cuobjdump -res-usage text, SASS text) of the kernel compiled for sm_90; writes DIR/k.{ttgir,ptx,cubin,sass}."""
    from pallas_kernels.gluon_decode_attention import SIGNATURE, kernel_constexprs
    from pallas_kernels.gluon_decode_kernel import hack_gluon_decode_kernel
    from pallas_kernels.gluon_launch import compile_kernel
    consts = kernel_constexprs(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=256, pages_per_seq=kv_len // 256,
                               num_pages=batch * kv_len // 256 + 1, num_sink_tokens=4, window=64, num_splits=splits,
                               async_mode=async_mode, dense=dense)
    k = compile_kernel(hack_gluon_decode_kernel, SIGNATURE, tuple(sorted(consts.items())), 1, maxnreg, 90)
    os.makedirs(out_dir, exist_ok=True)
    for ext in ("ttgir", "ptx"):
        with open(f"{out_dir}/k.{ext}", "w") as fh:
            fh.write(k.asm[ext])
    with open(f"{out_dir}/k.cubin", "wb") as fh:
        fh.write(k.asm["cubin"])
    sass, res = (subprocess.run([triton_offline._bin("cuobjdump"), flag, f"{out_dir}/k.cubin"], capture_output=True,
                                text=True, check=True).stdout for flag in ("-sass", "-res-usage"))
    with open(f"{out_dir}/k.sass", "w") as fh:
        fh.write(sass)
    return res, sass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--async-mode", type=int, default=0, choices=[0, 2, 16, 17, 18, 19, 20, 21, 22, 23],
                    help="the kernel's ASYNC (its header comment: < 16 direct loads, bit 1 page ids ahead; >= 16 "
                    "single cp.async buffers, (// 4) %% 4 = 1 metadata staged)")
    ap.add_argument("--dense", type=int, default=3, choices=(0, 2, 3),
                    help="the kernel's DENSE (3: the sinks and open region in a program of their own; 2: in the first "
                    "program, before its sealed groups; 0: left to the caller)")
    ap.add_argument("--out", default="/tmp/gluon_offline")
    a = ap.parse_args(argv)
    res, sass = compile_sass(async_mode=a.async_mode, maxnreg=a.maxnreg, dense=a.dense, out_dir=a.out)
    regs, stack = triton_offline.resources(res)
    lo, hi, n = max(triton_offline.loops(sass, innermost=False), key=lambda x: x[1] - x[0])  # the widest loop
    ops = triton_offline.op_counts(sass, lo, hi)
    print(f"registers {regs}, stack {stack} B")
    print(f"loop: {n} instructions per packing group ({n / 4:.0f} per block)")
    print(", ".join(f"{k} {v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    main()
