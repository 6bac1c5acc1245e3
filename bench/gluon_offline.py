"""Offline (CPU-only) compile of the Gluon decode kernel to sm_90 SASS and its loop's instruction counts.

  PYTHONPATH=.:/tmp/tri python bench/gluon_offline.py [--maxnreg N] [--async-mode 0..3] [--out DIR]

pip Triton 3.6 (`pip install --target /tmp/tri triton==3.6.0`) compiles `pallas_kernels/gluon_decode_kernel.py`
for Llama-3.1-8B heads at 8 x 32K (32 q / 8 kv heads, d 128, P 64, page 256, 16 splits), then `cuobjdump` gives the
registers, stack and the SASS; the loop is the widest backward branch's body (one packing group = 4 blocks per
trip; the masked tail group is outside it). The numbers of bench/NOTES_gluon.md's offline table come from this.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIG = [("kv_lens_ptr", "*i32"), ("page_indices_ptr", "*i32"), ("q_ptr", "*fp32"), ("k_codes_ptr", "*u8"),
       ("k_scale_ptr", "*fp16"), ("k_min_ptr", "*fp16"), ("v_codes_ptr", "*u8"), ("v_scale_ptr", "*fp16"),
       ("v_min_ptr", "*fp16"), ("acc_ptr", "*fp32"), ("m_ptr", "*fp32"), ("l_ptr", "*fp32")]
_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)")


def compile_sass(*, batch=8, kv_len=32768, splits=16, async_mode=0, maxnreg=None, out_dir="/tmp/gluon_offline"):
    """(resource line, SASS text) of the kernel compiled for sm_90; writes DIR/k.{ttgir,ptx,cubin,sass}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from pallas_kernels.gluon_decode_kernel import hack_gluon_decode_kernel
    consts = dict(H=8, QPK=4, D=128, P=64, PAGE=256, PPS=kv_len // 256, NUM_PAGES=batch * kv_len // 256 + 1, NS=4,
                  W=64, SPLITS=splits, QK_SCALE=math.log2(math.e) / math.sqrt(128), ASYNC=async_mode)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(SIG))}
    src = GluonASTSource(hack_gluon_decode_kernel, signature=dict(SIG), constexprs=consts, attrs=attrs)
    opts = {"num_warps": 1, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    os.makedirs(out_dir, exist_ok=True)
    for ext in ("ttgir", "ptx"):
        with open(f"{out_dir}/k.{ext}", "w") as fh:
            fh.write(k.asm[ext])
    with open(f"{out_dir}/k.cubin", "wb") as fh:
        fh.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([tool, "-sass", f"{out_dir}/k.cubin"], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([tool, "-res-usage", f"{out_dir}/k.cubin"], capture_output=True, text=True, check=True).stdout
    with open(f"{out_dir}/k.sass", "w") as fh:
        fh.write(sass)
    return next(line.strip() for line in res.splitlines() if "REG:" in line), sass


def widest_loop(sass: str) -> collections.Counter:
    """Opcode counts of the body of the widest backward branch."""
    lines = [m.groups() for m in map(_INSTR.match, sass.splitlines()) if m]
    addr = [int(a, 16) for a, _ in lines]
    best = []
    for i, (_, text) in enumerate(lines):
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr[i] and int(target.group(1), 16) in addr:
            body = lines[addr.index(int(target.group(1), 16)):i + 1]
            best = max(best, body, key=len)
    return collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9]+)", t).group(1) for _, t in best)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--async-mode", type=int, default=0, choices=(0, 1, 2, 3),
                    help="the kernel's ASYNC: bit 0 cp.async staging, bit 1 page ids one group ahead")
    ap.add_argument("--out", default="/tmp/gluon_offline")
    a = ap.parse_args(argv)
    res, sass = compile_sass(async_mode=a.async_mode, maxnreg=a.maxnreg, out_dir=a.out)
    ops = widest_loop(sass)
    print(res)
    print(f"loop: {sum(ops.values())} instructions per packing group ({sum(ops.values()) / 4:.0f} per block)")
    print(", ".join(f"{k} {v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    main()
