"""Offline (CPU-only) compile of a Pallas-Triton kernel to an sm_90 cubin, and a static SASS report.

bench/NOTES_decode.md "v3": the Pallas-Triton lowering (TTIR, from
`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`) compiled with pip `triton` (3.6.0, the
device's version; XLA's bundled Triton may differ a little) to TTGIR, PTX and an sm_90 cubin;
`cuobjdump -res-usage` gives registers / stack, `cuobjdump -sass` the loops. No GPU needed; pip triton
must be importable (`pip install --target /tmp/tri triton==3.6.0`, then /tmp/tri in PYTHONPATH).

Used by bench/bench_hack_decode.py and bench/bench_prefill_attention.py (`--stages sass`).
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess

COUNTED = ("BAR", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "SHFL", "IMMA", "HMMA", "HGMMA", "IGMMA", "MUFU", "F2F",
           "F2FP", "I2F", "F2I", "I2FP", "FRND", "FMNMX", "FFMA", "FMUL", "FADD", "FSETP", "FSEL", "SEL", "LOP3",
           "SHF", "IMAD", "IADD3", "PRMT", "WARPGROUP", "SYNCS", "LDL", "STL", "BSSY", "BRA")


@contextlib.contextmanager
def capture_ttir():
    """Within the block, every Pallas-Triton lowering appends its TTIR text to the yielded list."""
    from jax._src.pallas.triton import lowering as tl
    captured = []
    orig = tl.lower_jaxpr_to_triton_module

    def keep(*a, **k):
        r = orig(*a, **k)
        captured.append(r.module.operation.get_asm(enable_debug_info=False))
        return r
    tl.lower_jaxpr_to_triton_module = keep
    try:
        yield captured
    finally:
        tl.lower_jaxpr_to_triton_module = orig


def lower_ttir(fn, *args, kernel: str | None = None) -> str:
    """TTIR of the (last) Pallas-Triton kernel in jax.jit(fn) lowered for CUDA at `args` (arrays or
    ShapeDtypeStructs); `kernel`: the last one whose function is named so (a decode call with many splits
    lowers its split merge, `combine_splits`, after the attention kernel)."""
    import jax
    with capture_ttir() as captured:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    if kernel is not None:
        captured = [t for t in captured if f"tt.func public @{kernel}" in t]
    if not captured:
        raise RuntimeError(f"no Pallas-Triton kernel {kernel or ''} was lowered")
    return captured[-1]


def _bin(tool):
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", tool)


def compile_sm90(ttir: str, out_dir: str, name: str, *, num_warps: int, num_stages: int):
    """Compiles TTIR text with pip triton for sm_90; writes NAME.{ttir,ttgir,ptx,cubin,sass} in out_dir.
    Returns dict(cubin=path, res=cuobjdump -res-usage text, sass=cuobjdump -sass text, shared=bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.ttir")
    with open(path, "w") as fh:
        fh.write(ttir)
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                            num_stages=num_stages))
    cubin = os.path.join(out_dir, f"{name}.cubin")
    with open(cubin, "wb") as fh:
        fh.write(k.asm["cubin"])
    for ext in ("ttgir", "ptx"):
        if ext in k.asm:
            with open(os.path.join(out_dir, f"{name}.{ext}"), "w") as fh:
                fh.write(k.asm[ext])
    res = subprocess.run([_bin("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
    sass = subprocess.run([_bin("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    with open(os.path.join(out_dir, f"{name}.sass"), "w") as fh:
        fh.write(sass)
    shared = getattr(k.metadata, "shared", None)
    return dict(cubin=cubin, res=res, sass=sass, shared=shared)


def _opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def instructions(sass: str):
    """[(address, instruction text)] of a cuobjdump -sass listing."""
    return [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]


def loops(sass: str, min_instr: int = 0, *, innermost: bool = True):
    """The backward-branch loops [(lo, hi, n_instr)] sorted by address; innermost: loops that contain
    another loop are dropped (the per-iteration bodies)."""
    ins = instructions(sass)
    spans = sorted({(int(m.group(1), 16), a) for a, t in ins
                    if (m := re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", t)) and int(m.group(1), 16) < a})
    inner = [s for s in spans if not innermost or not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    out = []
    for lo, hi in inner:
        n = sum(1 for a, _ in ins if lo <= a <= hi)
        if n >= min_instr:
            out.append((lo, hi, n))
    return out


def op_counts(sass: str, lo: int, hi: int) -> collections.Counter:
    return collections.Counter(_opcode(t) for a, t in instructions(sass) if lo <= a <= hi)


def resources(res: str):
    """(registers, stack bytes) from cuobjdump -res-usage."""
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def report(ttir: str, out_dir: str, name: str, *, num_warps: int, num_stages: int, min_loop_instr: int = 200):
    """compile_sm90 + a summary dict: regs, stack, shared, and per big innermost loop (by address) its
    instruction count and COUNTED opcodes (per warp and iteration)."""
    c = compile_sm90(ttir, out_dir, name, num_warps=num_warps, num_stages=num_stages)
    regs, stack = resources(c["res"])
    total = len(instructions(c["sass"]))
    row = dict(regs=regs, stack=stack, shared=c["shared"], sass_instr=total, loops=[])
    for lo, hi, n in loops(c["sass"], min_loop_instr):
        ops = op_counts(c["sass"], lo, hi)
        row["loops"].append(dict(lo=hex(lo), instr=n, **{k: ops[k] for k in COUNTED if ops[k]}))
    return row
