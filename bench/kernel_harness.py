"""The HACK decode kernel's own Triton code, launched without JAX: register caps and profiler counters.

The Pallas-Triton lowering of `pallas_kernels.decode_attention` (Llama-3.1-8B heads, P 64, page 256) is
captured here as TTIR, as `bench_hack_decode.py --stages sass` does; on the GPU machine pip Triton
compiles it (the options a Pallas CompilerParams cannot pass: `maxnreg`) and launches it on torch tensors
of the kernel's operands, so that Nsight Compute can profile one launch of exactly that build in a process
that holds no XLA client.

  prepare (CPU or GPU, jax only):             python bench/kernel_harness.py prepare DIR [--bits 2 4] [--make-ttir]
      writes DIR/manifest.json and one TTIR per (shape, bits): the kernel operands in order (dtype,
      shape, how to fill), its grid, its default_config (without its register cap), the bytes it must read.
  run (GPU, torch + triton only):              python bench/kernel_harness.py run DIR [--variants ...]
      per shape and variant NAME=WARPS:STAGES:MAXNREG (MAXNREG 0 = none): registers, spills, us per launch
      (triton.testing.do_bench: CUDA events, the L2 flushed before each launch), % of the read roof, and
      the largest difference of the outputs from the first variant's (a register cap reorders nothing in
      the arithmetic, so it should be 0). `--only SHAPE:NAME --launches N` launches one variant N times
      for a profiler attached from outside (bench/gpu_check.sh HARNESS=1 runs it under ncu).

The launch times differ from XLA's own compile of the same TTIR (another Triton build, no XLA runtime
around the launch): compare variants within one run, not with bench_decode_attention's rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

DEFAULT_VARIANTS = ["w4s2=4:2:0", "w4s2r168=4:2:168", "w4s3r168=4:3:168", "w8s2=8:2:0"]


def make_ttir(ttir: str) -> str:
    """The TTIR after the passes XLA's Triton pipeline runs on it before TTGIR (xla/backends/gpu/codegen/triton/
    compilation_pipeline_cuda.cc MakeTTIR: inliner, rewrite_tensor_pointer, canonicalize, combine,
    reorder_broadcast, cse, symbol_dce, loop_unroll). triton.compile of a .ttir file skips its own make_ttir
    stage, so without this the harness compiles a TTIR XLA never sees: e.g. no `dot(a, b, 0) + c ->
    dot(a, b, c)` (combine). Needs pip triton."""
    import tempfile
    from triton._C.libtriton import ir, passes
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    ctx = ir.context()
    ir.load_dialects(ctx)
    CUDABackend(GPUTarget("cuda", 90, 32)).load_dialects(ctx)
    with tempfile.NamedTemporaryFile("w", suffix=".ttir") as fh:
        fh.write(ttir)
        fh.flush()
        mod = ir.parse_mlir_module(fh.name, ctx)
    pm = ir.pass_manager(ctx)
    passes.common.add_inliner(pm)
    passes.ttir.add_rewrite_tensor_pointer(pm)
    passes.common.add_canonicalizer(pm)
    passes.ttir.add_combine(pm)
    passes.ttir.add_reorder_broadcast(pm)
    passes.common.add_cse(pm)
    passes.common.add_symbol_dce(pm)
    passes.ttir.add_loop_unroll(pm)
    pm.run(mod, "make_ttir")
    return str(mod)


def prepare(out_dir, shapes, bits_list, xla_passes=False):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_hack_decode as bh
    import triton_offline
    from bench_hack_decode import D, HKV, HQ, NS, P, PAGE, SHAPES
    from pallas_kernels import common
    from pallas_kernels.decode_attention import default_config, hack_decode_attention
    os.makedirs(out_dir, exist_ok=True)
    fills = dict(q="normal", k_codes="u8:256", v_codes="u8:256", k_scale="uniform:0.01:0.3", v_scale="uniform:0.01:0.3",
                 k_min="uniform:-1:0", v_min="uniform:-1:0", k_sums="u8:193", v_sums="u8:193", open_k="normal",
                 open_v="normal", sink_k="normal", sink_v="normal", page_indices="table")
    entries = []
    for bits in bits_list:
        for shape in shapes:
            if shape not in SHAPES:
                raise ValueError(f"unknown shape {shape!r}: one of {sorted(SHAPES)}")
            batch, kv_len = SHAPES[shape]
            layer = bh.layer_specs(batch, kv_len, bits)  # q, bh.FIELDS..., page_indices, kv_lens
            # no register cap in the module (default_config's would ride along as `ttg.maxnreg`): the
            # variants below set their own
            cfg = dataclasses.replace(default_config(batch=batch, num_kv_heads=HKV, pages_per_seq=kv_len // PAGE,
                                                     page_size=PAGE, partition_size=P, dot_dtype="folded_f16",
                                                     bits=bits), maxnreg=None)
            ttir = triton_offline.lower_ttir(
                lambda *xs: hack_decode_attention(*xs, partition_size=P, num_sink_tokens=NS, config=cfg, bits=bits),
                *layer, kernel="hack_decode_attention")
            if xla_passes:
                ttir = make_ttir(ttir)
            name = f"{shape}_hack{bits}"
            with open(os.path.join(out_dir, name + ".ttir"), "w") as fh:
                fh.write(ttir)
            pad = common.q_per_kv_pad(HQ // HKV, at_least=16 // common.blocks_per_trip(bits, PAGE, P))
            programs = cfg.num_splits + cfg.open_split
            # the kernel's operands in its order (decode_attention._hack_decode): k_sums, v_scale, v_min as
            # [N, H, bpp, P, NP] (a free reshape), then the outputs acc, m, l
            spec = dict(zip(("q",) + bh.FIELDS + ("page_indices", "kv_lens"), layer))
            N, NP = spec["k_sums"].shape[0], spec["k_sums"].shape[3]
            per_meta = (N, HKV, PAGE // P, P, NP)
            operand = lambda f: (f, spec[f].dtype.name, per_meta if f in ("k_sums", "v_scale", "v_min")  # noqa: E731
                                 else tuple(spec[f].shape), fills[f])
            # (one layer's own arrays: no layer-offsets operand, common.stacked_view's offsets None)
            args = ([("kv_lens", "int32", (batch,), f"const:{kv_len + NS}"), operand("page_indices"),
                     operand("q")] + [operand(f) for f in bh.FIELDS]
                    + [("acc", "float32", (batch, HKV, programs, pad, D), "out"),
                       ("m", "float32", (batch, HKV, programs, pad), "out"),
                       ("l", "float32", (batch, HKV, programs, pad), "out")])
            entries.append(dict(name=name, shape=shape, bits=bits, batch=batch, kv_len=kv_len, grid=[batch, HKV, programs],
                                make_ttir=xla_passes,
                                config=str(cfg), ttir=name + ".ttir", args=args,
                                bytes=bh.cache_bytes(batch, kv_len, bits, sums=False)))
            print(name, cfg, flush=True)
    with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
        json.dump(entries, fh, indent=1)


def _tensors(entry, seed=0):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for name, dtype, shape, fill in entry["args"]:
        dt = getattr(torch, dtype)
        if fill.startswith("const:"):
            t = torch.full(shape, int(fill.split(":")[1]), dtype=dt, device="cuda")
        elif fill == "table":  # every sequence its own pages, shuffled; page 0 is the null page
            b, pps = shape
            t = (torch.randperm(b * pps, generator=g, device="cuda") + 1).to(dt).reshape(shape)
        elif fill == "normal":
            t = torch.randn(shape, generator=g, device="cuda").to(dt)
        elif fill.startswith("u8:"):
            t = torch.randint(0, int(fill.split(":")[1]), shape, generator=g, device="cuda", dtype=torch.int32).to(dt)
        elif fill.startswith("uniform:"):
            lo, hi = map(float, fill.split(":")[1:])
            t = (lo + (hi - lo) * torch.rand(shape, generator=g, device="cuda")).to(dt)
        elif fill == "out":
            t = torch.full(shape, float("nan"), dtype=dt, device="cuda")
        else:
            raise ValueError(f"unknown fill {fill!r} of operand {name}")
        out.append(t)
    return out


def _compile(path, warps, stages, maxnreg):
    import triton
    opts = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(path, options=opts)
    k._init_handles()
    return k


def run(in_dir, variants, out_path, only=None, launches=5, shapes=None):
    import torch
    import triton
    import triton.testing
    entries = json.load(open(os.path.join(in_dir, "manifest.json")))
    specs = [(v.split("=")[0], *map(int, v.split("=")[1].split(":"))) for v in variants]
    rows = []
    for e in entries:
        if shapes and e["shape"] not in shapes:
            continue
        if only and not only.startswith(e["name"] + ":"):
            continue
        args = _tensors(e)
        outs = [i for i, a in enumerate(e["args"]) if a[3] == "out"]
        grid = tuple(e["grid"])
        first = None
        for name, warps, stages, maxnreg in specs:
            if only and only != f"{e['name']}:{name}":
                continue
            row = dict(kernel=e["name"], variant=name, warps=warps, stages=stages, maxnreg=maxnreg, grid=grid,
                       config=e["config"], bytes=e["bytes"], gpu=torch.cuda.get_device_name(), triton=triton.__version__)
            try:
                k = _compile(os.path.join(in_dir, e["ttir"]), warps, stages, maxnreg)
                row.update(regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared)
                launch = lambda: k[grid](*args)  # noqa: E731
                if only:
                    for _ in range(launches):
                        launch()
                    torch.cuda.synchronize()
                    row.update(launches=launches)
                else:
                    launch()
                    torch.cuda.synchronize()
                    res = [args[i].clone() for i in outs]
                    if first is None:
                        first = res
                    fin = [(torch.isfinite(a) & torch.isfinite(b), a, b) for a, b in zip(res, first)]
                    diff = max(float(((a - b).abs() * f).nan_to_num(0.0).max()) for f, a, b in fin)
                    finite_mismatch = sum(int((torch.isfinite(a) != torch.isfinite(b)).sum()) for a, b in zip(res, first))
                    us = triton.testing.do_bench(launch, warmup=25, rep=200, return_mode="median") * 1e3
                    row.update(us=round(us, 2), gbps=round(e["bytes"] / us / 1e3, 1), max_diff_vs_first=diff,
                               finite_mismatch_vs_first=finite_mismatch)
            except Exception as exc:  # noqa: BLE001 - a failing variant is a result too
                row.update(error=f"{type(exc).__name__}: {str(exc)[:400]}")
            print(json.dumps(row), flush=True)
            rows.append(row)
        del args
        torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dir")
    p.add_argument("--shapes", nargs="+", default=["b8_32k", "b1_32k", "b1_128k", "b8_128k", "b8_1k"],
                   help="bench_hack_decode.SHAPES names")
    p.add_argument("--bits", nargs="+", type=int, default=[2], choices=(2, 4))
    p.add_argument("--make-ttir", action="store_true",
                   help="run XLA's MakeTTIR passes (combine etc.) on the TTIR first (`make_ttir`; needs pip triton)")
    r = sub.add_parser("run")
    r.add_argument("dir")
    r.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="NAME=WARPS:STAGES:MAXNREG (0: none)")
    r.add_argument("--shapes", nargs="+", default=None)
    r.add_argument("--out", default=None, help="append the rows (JSON lines) here")
    r.add_argument("--only", default=None, help="KERNEL:VARIANT, e.g. b8_32k_hack2:w4s2: launches only")
    r.add_argument("--launches", type=int, default=5)
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.dir, a.shapes, a.bits, a.make_ttir)
    else:
        run(a.dir, a.variants, a.out, a.only, a.launches, a.shapes)


if __name__ == "__main__":
    main()
