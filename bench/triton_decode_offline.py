"""Offline (CPU-only) compile of the jax-triton decode kernel for sm_90 and its static SASS report.

pallas_kernels/triton_decode_kernel.py compiled by pip Triton (3.6.0, the H200 machine's version) from
its @triton.jit source with the constexprs and pointer types jax-triton would pass, for a model's heads;
registers / stack / shared memory and, per innermost loop, the instruction count and opcodes per warp
and packing group (bench/triton_offline.py's counter). No GPU, no jax-triton needed.

    PYTHONPATH=.:/tmp/tri python3 bench/triton_decode_offline.py [--heads llama3.1-8b] [--stages 1 2]
        [--no-asm] [--out DIR]

Prints one JSON line per config (bench/NOTES_triton.md has the numbers).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton_offline  # noqa: E402

HEADS = {"llama3.1-8b": (32, 8, 128), "smollm2-1.7b": (32, 32, 64), "qwen-g7": (28, 4, 128), "g1": (8, 8, 128)}
POINTERS = dict(kv_lens_ptr="*i32", page_indices_ptr="*i32", q_ptr="*fp32", k_codes_ptr="*u8", k_scale_ptr="*fp16",
                k_min_ptr="*fp16", v_codes_ptr="*u8", v_scale_ptr="*fp16", v_min_ptr="*fp16", open_k_ptr="*bf16",
                open_v_ptr="*bf16", sink_k_ptr="*bf16", sink_v_ptr="*bf16", acc_ptr="*fp32", m_ptr="*fp32",
                l_ptr="*fp32")


def compile_report(*, num_q_heads, num_kv_heads, head_dim, partition_size=64, page_size=256, pages_per_seq=128,
                   num_splits=6, num_warps=4, num_stages=1, unpack_asm=True, out_dir="/tmp/triton_decode_offline"):
    """Compiles the kernel for sm_90; returns dict(regs, stack, shared, sass_instr, loops=[...])."""
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pallas_kernels.triton_decode_attention import kernel_constants
    from pallas_kernels.triton_decode_kernel import hack_triton_decode_kernel as kernel
    consts = kernel_constants(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              partition_size=partition_size, page_size=page_size, pages_per_seq=pages_per_seq,
                              num_pages=1 + 8 * pages_per_seq, num_sink_tokens=4, num_splits=num_splits,
                              unpack_asm=unpack_asm)
    names = kernel.arg_names
    signature = {n: POINTERS.get(n, "constexpr") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in POINTERS}  # as jax-triton
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    os.makedirs(out_dir, exist_ok=True)
    cubin = os.path.join(out_dir, "kernel.cubin")
    with open(cubin, "wb") as fh:
        fh.write(compiled.asm["cubin"])
    for ext in ("ttgir", "ptx"):
        with open(os.path.join(out_dir, f"kernel.{ext}"), "w") as fh:
            fh.write(compiled.asm[ext])
    tool = triton_offline._bin("cuobjdump")
    res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
    regs, stack = triton_offline.resources(res)
    row = dict(regs=regs, stack=stack, shared=compiled.metadata.shared, sass_instr=len(triton_offline.instructions(sass)),
               loops=[])
    for lo, hi, n in triton_offline.loops(sass, 200):
        ops = triton_offline.op_counts(sass, lo, hi)
        row["loops"].append(dict(lo=hex(lo), instr=n, **{k: ops[k] for k in triton_offline.COUNTED if ops[k]}))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="+", default=["llama3.1-8b"], choices=sorted(HEADS))
    ap.add_argument("--stages", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--no-asm", action="store_true", help="Triton integer unpack instead of the inline PTX")
    ap.add_argument("--out", default="/tmp/triton_decode_offline")
    args = ap.parse_args()
    for heads in args.heads:
        hq, hkv, d = HEADS[heads]
        for stages in args.stages:
            row = compile_report(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, num_stages=stages,
                                 unpack_asm=not args.no_asm, out_dir=os.path.join(args.out, f"{heads}_s{stages}"))
            print(json.dumps(dict(heads=heads, num_stages=stages, unpack_asm=not args.no_asm, **row)), flush=True)


if __name__ == "__main__":
    main()
