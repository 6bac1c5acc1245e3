"""Offline (CPU-only): is the sums-free launch the same GPU kernel as the launch with code sums?

QuantConfig.code_sums=False drops k_sums / v_sums from the cache; the folded decode modes never read them,
and the kernel then launches without those two operands (`common.without_operand`). This lowers
`hack_decode_attention` for CUDA (the Pallas-Triton TTIR) on issue 18's 2-bit layout (K blocks of 32, V
groups of 64, a 16-bit window of 128, 16 sinks, pages of 256) at Llama-3.1-8B heads, 8 x 32K, once with
the sums operands and once without, for each folded mode (`--bits 4 --partition-size 64`: the
configuration's 4-bit layer); compiles both with pip triton 3.6 to sm_90 and
compares the whole kernels' SASS instruction by instruction, exactly, after moving each kernel-parameter address
(`c[0x0][0x...]`) of the launch with sums to where that parameter lies without them (8 bytes less per dropped
pointer before it; the dropped ones are the with-sums kernel's unused arguments), so an instruction that read
another parameter would differ; and registers / shared memory / the main loop's length. (The TTIR itself differs
in the order of its prologue's per-operand index arithmetic, which the compiler folds away: the SASS is the
comparison that answers the question.) Compiled by pip triton, not jaxlib's bundled copy, which may differ a little.

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


PARAM_BASE = 0x210  # sm_90: the kernel parameters' first byte in constant bank 0 (all of them 8-byte pointers here)


def unused_args(ttir: str) -> list[int]:
    """Indices of the kernel function's arguments that its body never uses (the sums, in the folded modes)."""
    lines = ttir.splitlines()
    head = next(i for i, x in enumerate(lines) if x.lstrip().startswith("tt.func"))
    names = re.findall(r"(%arg\d+):", lines[head])
    body = "\n".join(lines[head + 1:])
    return [i for i, a in enumerate(names) if not re.search(re.escape(a) + r"\b", body)]


def mapped_sass(sass: str, dropped: list[int]) -> list[str]:
    """The kernel's SASS instructions with each kernel-parameter address moved to where it lies once the
    `dropped` pointer parameters are gone (8 bytes less per dropped parameter before it); an instruction
    that reads a dropped parameter keeps a marker that matches nothing."""
    def move(m):
        off = int(m.group(1), 16)
        if off < PARAM_BASE:
            return m.group(0)
        i = (off - PARAM_BASE) // 8
        if i in dropped:
            return "c[0x0][DROPPED]"
        return f"c[0x0][{hex(off - 8 * sum(d < i for d in dropped))}]"
    return [re.sub(r"c\[0x0\]\[(0x[0-9a-f]+)\]", move, t) for _, t in triton_offline.instructions(sass)]


def signature_args(ttir: str) -> int:
    line = next(x for x in ttir.splitlines() if x.lstrip().startswith("tt.func"))
    return len(re.findall(r"%arg\d+:", line))


def pointer_args_only(ttir: str) -> bool:
    line = next(x for x in ttir.splitlines() if x.lstrip().startswith("tt.func"))
    return all(t.startswith("!tt.ptr") for t in re.findall(r"%arg\d+: (\S+)", line))


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
            ttir = triton_offline.lower_ttir(lambda *a: dec.hack_decode_attention(*a, **static), *xs,
                                             kernel="hack_decode_attention")  # not the split merge's kernel
            name = f"{mode}_{'sums' if sums else 'nosums'}"
            c = triton_offline.compile_sm90(ttir, args.out, name, num_warps=kc.num_warps, num_stages=kc.num_stages)
            loops = triton_offline.loops(c["sass"], innermost=False)
            lo, hi, _ = max(loops, key=lambda x: x[1] - x[0]) if loops else (0, -1, 0)  # the widest loop
            regs, stack = triton_offline.resources(c["res"])
            instr = [t for _, t in triton_offline.instructions(c["sass"])]
            kernels[sums] = dict(args=signature_args(ttir), unused=unused_args(ttir), ttir=ttir, sass=c["sass"],
                                 instr=instr, regs=regs, stack=stack, shared=c["shared"],
                                 loop_instr=sum(triton_offline.op_counts(c["sass"], lo, hi).values()),
                                 config=str(kc))
        w, wo = kernels[True], kernels[False]
        dropped = w["unused"]  # the sums: in the launch with them, never read
        exact = (w["args"] - wo["args"] == len(dropped) == 2 and not wo["unused"] and pointer_args_only(w["ttir"])
                 and mapped_sass(w["sass"], dropped) == wo["instr"])
        res_same = all(w[k] == wo[k] for k in ("regs", "stack", "shared", "loop_instr"))
        same &= exact and res_same
        both = lambda k: (w[k], wo[k])  # noqa: E731
        moved = sum(x != y for x, y in zip(w["instr"], wo["instr"]))
        print(json.dumps(dict(mode=mode, batch=args.batch, kv_len=args.kv_len, layout=layout, args=both("args"),
                              unused_args_with_sums=dropped,
                              same_sass_with_params_moved=exact, instructions_differing_in_param_address=moved,
                              kernel_instr=(len(w["instr"]), len(wo["instr"])), loop_instr=both("loop_instr"),
                              regs=both("regs"), shared=both("shared"), resources_same=res_same, config=w["config"])),
              flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
