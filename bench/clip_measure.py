"""Issue 18 probe, step 2: relative reconstruction MSE of K and V and relative error of the attention
outputs of the captured queries (float32, causal, 4 exact sinks and an exact tail of >= 128 tokens),
min-max vs clipping grids, at hack-p64 and K32/V64 + V Hadamard(64). Run after bench/clip_capture.py:
PYTHONPATH=. python bench/clip_measure.py BITS (bench/NOTES_formats.md, clip section)."""
import sys, itertools
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from hack_jax.quantization import _quantize, dequantize
from hack_jax.rotation import hadamard

d = np.load("/tmp/clip/qkv.npz"); q, k, v = d["q"], d["k"], d["v"]  # [L,512,9,64], [L,T,3,64]
L, T, H, D = k.shape
SINKS = 4
bits = int(sys.argv[1]) if len(sys.argv) > 1 else 2

def fq(x, axis, p, grid):
    qt = _quantize(jnp.asarray(x), None, None, bits=bits, axis=axis, partition_size=p, rounding="nearest",
                   meta_dtype=jnp.float16, clip_grid=grid)
    return np.asarray(dequantize(qt))

@jax.jit
def attn(q, k, v):  # q [L,Tq,9,D] (last Tq positions), k/v [L,T,3,D]
    Tq = q.shape[1]
    qg = q.reshape(L, Tq, H, 3, D) / np.sqrt(D)
    lg = jnp.einsum("ltkgd,lskd->lkgts", qg, k, precision="highest")
    pos_q = jnp.arange(T - Tq, T); pos_k = jnp.arange(T)
    lg = jnp.where(pos_k[None, :] <= pos_q[:, None], lg, -jnp.inf)
    w = jax.nn.softmax(lg, -1)
    return jnp.einsum("lkgts,lskd->ltkgd", w, v, precision="highest")

ref = np.asarray(attn(q, k, v))

def run(cfg, kgrid, vgrid):
    p, vrot = cfg
    n = (T - SINKS - 128) // p * p  # quantized tokens (a 16-bit tail of >= 128, a rough window)
    sl = slice(SINKS, SINKS + n)
    kq, vq = k.copy(), v.copy()
    kq[:, sl] = fq(k[:, sl], 1, p, kgrid)
    vv = v[:, sl] @ hadamard(vrot) if vrot else v[:, sl]
    vd = fq(vv, 3, 64, vgrid)
    vq[:, sl] = vd @ hadamard(vrot).T if vrot else vd
    ek = ((kq[:, sl] - k[:, sl]) ** 2).sum() / (k[:, sl] ** 2).sum()
    ev = ((vq[:, sl] - v[:, sl]) ** 2).sum() / (v[:, sl] ** 2).sum()
    out = np.asarray(attn(q, jnp.asarray(kq), jnp.asarray(vq)))
    ea = np.sqrt(((out - ref) ** 2).sum() / (ref ** 2).sum())
    # per-layer relative error averaged
    el = np.mean(np.sqrt(((out - ref) ** 2).sum((1, 2, 3, 4)) / (ref ** 2).sum((1, 2, 3, 4))))
    return ek, ev, ea, el

def sym(fs): return tuple((f, f) for f in fs)
def ind(fs): return tuple((a, b) for a in fs for b in fs if (a, b) != (0, 0))
def pairs(fs):  # symmetric + one-sided
    return tuple(sorted(set([(f, f) for f in fs] + [(f, 0.0) for f in fs] + [(0.0, f) for f in fs]) - {(0.0, 0.0)}))
GRIDS = {
  "minmax": (),
  "sym.05-.3": sym(np.arange(0.05, 0.31, 0.05).round(3).tolist()),
  "ind0-.2x5": ind([0, .05, .1, .15, .2]),
  "ind0-.3x7": ind([0, .05, .1, .15, .2, .25, .3]),
  "pairs.05-.3": pairs(np.arange(0.05, 0.31, 0.05).round(3).tolist()),
  "ind0-.4x9": ind([0, .05, .1, .15, .2, .25, .3, .35, .4]),
}
which = sys.argv[2] if len(sys.argv) > 2 else "both"
for cfg, name in (((64, 0), "hack-p64"), ((32, 64), "k32v64-vhad")):
    print(f"== {name} bits={bits}")
    for g, grid in GRIDS.items():
        for side in ("K", "V", "KV"):
            if g == "minmax" and side != "KV": continue
            kg = grid if "K" in side else (); vg = grid if "V" in side else ()
            ek, ev, ea, el = run(cfg, kg, vg)
            print(f"{g:14s} {side:3s} n={len(grid):3d} relMSE K={ek:.4f} V={ev:.4f}  attn rel err={ea:.4f} (per-layer mean {el:.4f})", flush=True)
