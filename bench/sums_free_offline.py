"""Offline (CPU-only): is the sums-free launch the same GPU kernel as the launch with code sums?

QuantConfig.code_sums=False drops k_sums / v_sums from the cache; the folded decode modes never read them,
and the kernel then launches without those two operands (`common.without_operand`). This lowers
`hack_decode_attention` for CUDA (the Pallas-Triton TTIR) on issue 18's 2-bit layout (K blocks of 32, V
groups of 64, a 16-bit window of 128, 16 sinks, pages of 256) at Llama-3.1-8B heads, 8 x 32K, once with
the sums operands and once without, for each folded mode (`--bits 4 --partition-size 64`: the
configuration's 4-bit layer); compiles both with pip triton 3.6 to sm_90 and
compares the whole kernels' SASS instruction by instruction with the kernel-parameter addresses
(`c[0x0][0x...]`, which move when two pointer parameters go) masked, and registers / shared memory. (The
TTIR itself differs in the order of its prologue's per-operand index arithmetic, which the compiler
folds away: the SASS is the comparison that answers the question.)

  PYTHONPATH=.:/tmp/tri python bench/sums_free_offline.py --out DIR   (pip install --target /tmp/tri triton==3.6.0)

Prints one JSON row per mode; exits 1 if any mode differs beyond the two arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import triton_offline  # noqa: E402
from hack_jax import kv_cache, paging  # noqa: E402
from hack_jax.config import QuantConfig  # noqa: E402
from pallas_kernels import decode_attention as dec  # noqa: E402

HQ, HKV, D = 32, 8, 128
FIELDS = ("k_codes", "k_scale", "k_min", "k_sums", "v_codes", "v_scale", "v_min", "v_sums", "open_k", "open_v",
          "sink_k", "sink_v")
LAYOUT = dict(partition_size=32, v_group=64, window=128, num_sink_tokens=16, page_size=256)


def operands(batch, kv_len, code_sums, layout):
    """ShapeDtypeStructs of the kernel's positional operands for the layout (QuantConfig fields)."""
    config = QuantConfig(kv_format="hack", code_sums=code_sums, **layout)
    pps = paging.pages_needed(kv_len, page_size=config.page_size, num_sink_tokens=kv_cache.sink_tokens(config))
    layer = jax.eval_shape(lambda: kv_cache.init_layer(config, num_kv_heads=HKV, head_dim=D,
                                                       num_pages=batch * pps + 1, max_seqs=batch))
    S = jax.ShapeDtypeStruct
    arrays = [getattr(layer, f) for f in FIELDS]
    q = S((batch, HQ, D), "float32")
    return config, pps, [q, *arrays, S((batch, pps), "int32"), S((batch,), "int32")]


def masked_sass(sass: str) -> list[str]:
    """The kernel's SASS instructions with the kernel-parameter constant-bank addresses masked."""
    return [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[param]", t) for _, t in triton_offline.instructions(sass)]


def signature_args(ttir: str) -> int:
    line = next(x for x in ttir.splitlines() if x.lstrip().startswith("tt.func"))
    return len(re.findall(r"%arg\d+:", line))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-len", type=int, default=32768)
    ap.add_argument("--modes", nargs="+", default=["folded_f16", "folded_bf16"])
    ap.add_argument("--bits", type=int, default=2, choices=(2, 4))
    ap.add_argument("--partition-size", type=int, default=LAYOUT["partition_size"])
    args = ap.parse_args(argv)
    layout = dict(LAYOUT, partition_size=args.partition_size, bits=args.bits)
    same = True
    for mode in args.modes:
        kernels = {}
        for sums in (True, False):
            config, pps, xs = operands(args.batch, args.kv_len, sums, layout)
            kc = dec.default_config(batch=args.batch, num_kv_heads=HKV, pages_per_seq=pps,
                                    page_size=config.page_size, partition_size=config.partition_size,
                                    dot_dtype=mode, bits=config.bits)
            static = dict(partition_size=config.partition_size, num_sink_tokens=config.num_sink_tokens,
                          v_group=config.v_group, window=config.window, bits=config.bits, config=kc)
            with triton_offline.capture_ttir() as lowered:  # the attention kernel (+ a split merge: fewer args)
                jax.jit(lambda *a: dec.hack_decode_attention(*a, **static)).trace(*xs).lower(
                    lowering_platforms=("cuda",))
            ttir = max(lowered, key=signature_args)
            name = f"{mode}_{'sums' if sums else 'nosums'}"
            c = triton_offline.compile_sm90(ttir, args.out, name, num_warps=kc.num_warps, num_stages=kc.num_stages)
            loops = triton_offline.loops(c["sass"], innermost=False)
            lo, hi, _ = max(loops, key=lambda x: x[1] - x[0]) if loops else (0, -1, 0)  # the widest loop
            regs, stack = triton_offline.resources(c["res"])
            instr = [t for _, t in triton_offline.instructions(c["sass"])]
            kernels[sums] = dict(args=signature_args(ttir), instr=instr,
                                 masked=masked_sass(c["sass"]), regs=regs, stack=stack, shared=c["shared"],
                                 loop_instr=sum(triton_offline.op_counts(c["sass"], lo, hi).values()),
                                 config=str(kc))
        w, wo = kernels[True], kernels[False]
        sass_same = w["masked"] == wo["masked"]
        res_same = all(w[k] == wo[k] for k in ("regs", "stack", "shared", "loop_instr"))
        same &= sass_same and res_same
        both = lambda k: (w[k], wo[k])  # noqa: E731
        moved = sum(x != y for x, y in zip(w["instr"], wo["instr"]))
        print(json.dumps(dict(mode=mode, batch=args.batch, kv_len=args.kv_len, layout=layout, args=both("args"),
                              sass_same_but_param_addresses=sass_same, instructions_differing_in_param_address=moved,
                              kernel_instr=(len(w["instr"]), len(wo["instr"])), loop_instr=both("loop_instr"),
                              regs=both("regs"), shared=both("shared"), resources_same=res_same, config=w["config"])),
              flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
