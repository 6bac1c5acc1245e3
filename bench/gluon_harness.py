"""The Gluon decode kernel (pallas_kernels/gluon_decode_kernel.py) against the Pallas HACK kernel on the same torch
tensors, one process, no XLA: kernel time only (triton.testing.do_bench, CUDA events), and its error.

  python bench/kernel_harness.py prepare DIR --shapes b8_32k b1_128k b1_32k      (CPU or GPU: the Pallas TTIR)
  python bench/gluon_harness.py DIR OUT.jsonl --shapes b8_32k --variants s16=16:0:0 s16a=16:0:1 ... [--open N]

Per shape: the Pallas kernel's TTIR compiled by pip Triton with the register cap 168 (as XLA builds it; the row
`pallas_r168`), then each Gluon variant NAME=SPLITS:MAXNREG:ASYNC[:DENSE] (MAXNREG 0: none; ASYNC the kernel's
constexpr: < 16 direct loads, bit 1 page ids one group ahead; >= 16 single cp.async buffers, each group's V tile
copied during its QK^T and the next group's K tile during its PV, (ASYNC // 4) % 4 = 1 k_scale / v_scale / v_min
staged too; DENSE, default 3, the kernel's: the NS sinks attended in the
kernel as the Pallas kernel does, by a program of their own per sequence and kv head (3) or by the first program
before its sealed groups (2); 0 the sealed blocks only) on the harness's operands: time, registers, and the error of
its attention (splits merged) against a float64 torch reference of the dequantized cache (and the sinks, DENSE 2 /
3) for sequence 0 (all kv heads); the shapes' caches are block-exact (no open tokens: the dense part's loads of
the open region are all masked, so its cost in a real call, ~14 us at 60 open tokens on the H100 with DENSE 2, is
not seen) unless `--open N` adds N tokens to every sequence's length (the open region's first N rows, also in the
reference). The page table's row
stride is its own width (pages_per_seq + 1 here; the runs before 2026-12-05 session 26 passed pages_per_seq, so
sequences past the first read shifted rows of the same random pool: their timings stand, their outputs were not
checked). The run.sh files of bench/results before commit "Gluon kernel: the measured-slower options removed"
use the variant syntax of their time (a PAIRS field before DENSE; PAIRS, DENSE 1, the two-stage staging (odd
ASYNC below 16) and ASYNC's META 2 since removed). GPU, torch + triton only.
"""
import json
import math
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernel_harness as kh  # noqa: E402
from pallas_kernels.gluon_decode_attention import SIGNATURE, kernel_constexprs  # noqa: E402
from pallas_kernels.gluon_decode_kernel import hack_gluon_decode_kernel  # noqa: E402
from pallas_kernels.gluon_launch import compile_kernel  # noqa: E402

H, QPK, D, P, PAGE, NS = 8, 4, 128, 64, 256, 4  # kernel_harness.py's shapes (bench_hack_decode: Llama heads)


def reference_seq(args, b, sinks=None, opens=None):
    """float64 softmax(q K^T / sqrt(D)) V over sequence b's sealed blocks (all of its pages here) and, given
    (sink_k, sink_v), its NS sinks, given (open_k, open_v), its open tokens (kv_lens past the pages: --open)."""
    kv_lens, pages, q, kc, ks, km, _, vc, vs, vm = args[:10]
    n_tok = int(kv_lens[b]) - NS
    n_pages = n_tok // PAGE
    pid = pages[b, :n_pages].long()
    # K: [pages, H, PAGE // 4, D] u8, group gi rows gi P + r, plane j = block slot gi 4 + j
    k8 = kc[pid].long()  # [np, H, 64, D]
    kcode = torch.stack([(k8 >> (2 * j)) & 3 for j in range(4)], 2)  # [np, H, 4 planes, 64 rows, D]
    kcode = kcode.reshape(n_pages, H, 4, P, D)  # groups per page 1 (PAGE = 4 P): slot = j
    sig = ks[pid].double().reshape(n_pages, H, 4, 1, D)
    mu = km[pid].double().reshape(n_pages, H, 4, 1, D)
    K = (kcode.double() * sig + mu).permute(1, 0, 2, 3, 4).reshape(H, n_pages * PAGE, D)
    v8 = vc[pid].long()  # [np, H, D, 64] token-major
    vcode = torch.stack([(v8 >> (2 * j)) & 3 for j in range(4)], 2)  # [np, H, 4, D, 64]
    vcode = vcode.permute(0, 1, 2, 4, 3)  # [np, H, 4 slots, 64 tokens, D]
    tau = vs.reshape(vs.shape[0], H, PAGE, 2)[pid].double().reshape(n_pages, H, 4, P, 2)
    nu = vm.reshape(vm.shape[0], H, PAGE, 2)[pid].double().reshape(n_pages, H, 4, P, 2)
    tau = torch.repeat_interleave(tau, 64, dim=-1)  # [.., P, D] channel c -> group c // 64
    nu = torch.repeat_interleave(nu, 64, dim=-1)
    V = (vcode.double() * tau + nu).permute(1, 0, 2, 3, 4).reshape(H, n_pages * PAGE, D)
    if sinks is not None:
        K = torch.cat([K, sinks[0][b].double()], 1)
        V = torch.cat([V, sinks[1][b].double()], 1)
    if opens is not None:
        n_open = n_tok - n_pages * PAGE
        K = torch.cat([K, opens[0][b, :, :n_open].double()], 1)
        V = torch.cat([V, opens[1][b, :, :n_open].double()], 1)
    qq = q[b].double().reshape(H, QPK, D)
    s = torch.einsum("hgd,htd->hgt", qq, K) / math.sqrt(D)
    return torch.einsum("hgt,htd->hgd", torch.softmax(s, -1), V)  # [H, QPK, D]


def merge(acc, m, l, b):
    # acc [S, H, ROWS, OPAD, D], m / l [S, H, ROWS, OPAD] (ROWS: the programs, all written; m natural log
    # units) -> [H, QPK, D]
    a, mm, ll = acc[b].double(), m[b].double(), l[b].double()
    mx = mm.max(1, keepdim=True).values
    w = torch.exp(mm - mx)
    out = (a * w[..., None]).sum(1) / (ll * w).sum(1)[..., None]
    return out[:, :QPK]


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="a `bench/kernel_harness.py prepare` directory")
    ap.add_argument("out", help="append the rows (JSON lines) here")
    ap.add_argument("--shapes", nargs="+", default=None)
    ap.add_argument("--variants", nargs="+", default=["s16=16:0:0", "s16a=16:0:1"],
                    help="NAME=SPLITS:MAXNREG:ASYNC[:DENSE]")
    ap.add_argument("--open", type=int, default=0,
                    help="open tokens per sequence, 0-63: kv_lens + N for every kernel of the run, so that the dense "
                    "part reads N real rows of open_k / open_v (0: block-exact, its loads all masked)")
    a = ap.parse_args()
    if not 0 <= a.open < P:
        ap.error(f"--open must be in [0, {P}), got {a.open}")
    hdir, out_path, shapes, variants = a.dir, a.out, a.shapes, a.variants
    entries = json.load(open(os.path.join(hdir, "manifest.json")))
    rows = []
    for e in entries:
        if shapes and e["shape"] not in shapes:
            continue
        args = kh._tensors(e)
        names = [x[0] for x in e["args"]]
        if a.open:  # the same pages, N tokens more: the open region's first N rows
            # reference_seq's n_open = kv_len + N - NS - (its pages) x PAGE holds for block-exact lengths with room
            pps = args[names.index("page_indices")].shape[1]
            assert e["kv_len"] % PAGE == 0 and pps * PAGE >= e["kv_len"] + a.open, e["shape"]
            i = names.index("kv_lens")
            args[i] = args[i] + a.open
        t = dict(zip(names, args))
        batch, kv = e["batch"], e["kv_len"]
        # Pallas kernel (pip Triton, cap 168), the harness's launch
        pk = kh._compile(os.path.join(hdir, e["ttir"]), 4, 2, 168)
        grid = tuple(e["grid"])
        us_p = triton.testing.do_bench(lambda: pk[grid](*args), warmup=25, rep=200, return_mode="median") * 1e3
        row = dict(shape=e["shape"], kernel="pallas_r168", open=a.open, us=round(us_p, 2), regs=pk.n_regs,
                   bytes=e["bytes"], gbps=round(e["bytes"] / us_p / 1e3, 1), gpu=torch.cuda.get_device_name())
        print(json.dumps(row), flush=True)
        rows.append(row)
        gargs = [t["kv_lens"], t["page_indices"], t["q"], t["k_codes"], t["k_scale"], t["k_min"], t["v_codes"],
                 t["v_scale"], t["v_min"], t["open_k"], t["open_v"], t["sink_k"], t["sink_v"]]
        cache = gargs[:6] + [None] + gargs[6:9]
        dense_ref = reference_seq(cache, 0, (t["sink_k"], t["sink_v"]), (t["open_k"], t["open_v"]))
        refs = {0: reference_seq(cache, 0), 2: dense_ref, 3: dense_ref}  # DENSE 2 and 3 attend to the same tokens
        for v in variants:
            name, spec = v.split("=")
            fields = list(map(int, spec.split(":")))
            splits, maxnreg, pf, dense = fields + [0, 0, 3][len(fields) - 1:]  # defaults: no cap, ASYNC 0, DENSE 3
            ref = refs[dense]
            consts = kernel_constexprs(num_q_heads=H * QPK, num_kv_heads=H, head_dim=D, page_size=PAGE,
                                       pages_per_seq=t["page_indices"].shape[1], num_pages=t["k_codes"].shape[0],
                                       num_sink_tokens=NS, window=P, num_splits=splits, async_mode=pf, dense=dense)
            row = dict(shape=e["shape"], kernel="gluon_" + name, open=a.open, splits=splits, maxnreg=maxnreg,
                       async_mode=pf, dense=dense, bytes=e["bytes"])
            try:
                k = compile_kernel(hack_gluon_decode_kernel, SIGNATURE, tuple(sorted(consts.items())), 1,
                                   maxnreg or None, 90)
                k._init_handles()
                acc = torch.full((batch, H, consts["ROWS"], consts["OPAD"], D), float("nan"), device="cuda")
                m = torch.full((batch, H, consts["ROWS"], consts["OPAD"]), float("nan"), device="cuda")
                l_ = torch.full((batch, H, consts["ROWS"], consts["OPAD"]), float("nan"), device="cuda")
                ggrid = (batch, H, consts["ROWS"])  # DENSE 3: one program more
                launch = lambda: k[ggrid](*gargs, acc, m, l_)  # noqa: E731
                launch()
                torch.cuda.synchronize()
                got = merge(acc, m, l_, 0)
                err = float((got - ref).abs().max())
                scale = float(ref.abs().max())
                us = triton.testing.do_bench(launch, warmup=25, rep=200, return_mode="median") * 1e3
                row.update(us=round(us, 2), regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared,
                           max_abs_err=err, ref_max=scale, gbps=round(e["bytes"] / us / 1e3, 1),
                           vs_pallas=round(us_p / us, 3))
            except Exception as exc:  # noqa: BLE001
                import traceback
                row.update(error=f"{type(exc).__name__}: {str(exc)[:600]}", tb=traceback.format_exc()[-1500:])
            print(json.dumps(row), flush=True)
            rows.append(row)
        del args
        torch.cuda.empty_cache()
    with open(out_path, "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
