"""Float64 NumPy oracles for hack_jax.reference, written independently of it.

They read only the fields of a QuantizedKV (codes, scales, minimums of the sealed blocks, as a cache
holds them) and recompute everything else: which tokens are sinks / sealed / open, the bfloat16
copies of the 16-bit tokens, the INT8 images of the transient operands, and the attention itself as
plain float64 matmuls on dequantized values (no code sums, no four-term identity, no merging order
taken from the code under test).
"""

import math

import ml_dtypes
import numpy as np


def _visible(n, q_len, kv_len, causal):
    """bool[q_len, kv_len] for one sequence of n valid keys."""
    j = np.arange(kv_len)[None, :]
    vis = np.broadcast_to(j < n, (q_len, kv_len))
    if causal:
        vis = vis & (j <= (n - q_len + np.arange(q_len))[:, None])
    return vis


def np_dense_attention(q, k, v, *, causal, kv_lens=None, sm_scale=None):
    """Softmax attention in float64: q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D].

    GQA: query head h uses kv head h // (Hq // Hkv). Rows that see no key are 0.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    kv_lens = np.full(batch, kv_len) if kv_lens is None else np.clip(np.asarray(kv_lens), 0, kv_len)
    out = np.zeros_like(q)
    for b in range(batch):
        vis = _visible(kv_lens[b], q_len, kv_len, causal)
        for h in range(num_q_heads):
            kh = h // group
            logits = scale * q[b, :, h] @ k[b, :, kh].T
            logits = np.where(vis, logits, -np.inf)
            m = logits.max(-1, keepdims=True)
            w = np.where(vis, np.exp(logits - np.where(np.isfinite(m), m, 0)), 0.0)
            l = w.sum(-1, keepdims=True)
            out[b, :, h] = np.where(l > 0, (w @ np.where(np.isfinite(v[b, :, kh]), v[b, :, kh], 0))
                                    / np.where(l > 0, l, 1), 0)
    return out


def np_int8_image(x, axis, group):
    """Dequantized INT8 image of x, asymmetric per `group` consecutive elements along `axis`,
    round to nearest, exact float64 metadata (HACK.md §2 with L = 255). Constant groups are exact."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    shape = x.shape
    xg = x.reshape(*shape[:-1], shape[-1] // group, group)
    lo, hi = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    s = (hi - lo) / 255
    codes = np.where(s > 0, np.clip(np.round((xg - lo) / np.where(s > 0, s, 1)), 0, 255), 0)
    return np.moveaxis((s * codes + lo).reshape(shape), -1, axis)


def bf16(x):
    return np.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), np.float64)


class _Softmax:
    """Sequential online softmax in float64 for one (sequence, kv head)."""

    def __init__(self, rows, head_dim):
        self.acc = np.zeros((rows, head_dim))
        self.m = np.full(rows, -np.inf)
        self.l = np.zeros(rows)

    def add(self, acc, m, l):
        new = np.maximum(self.m, m)
        safe = np.where(np.isfinite(new), new, 0)
        a, b = np.exp(self.m - safe), np.exp(m - safe)
        self.acc = self.acc * a[:, None] + acc * b[:, None]
        self.l = self.l * a + l * b
        self.m = new

    def weights(self, logits, mask):
        m = np.where(mask, logits, -np.inf).max(-1, initial=-np.inf)
        w = np.where(mask, np.exp(logits - np.where(np.isfinite(m), m, 0)[:, None]), 0.0)
        return w, m

    def output(self):
        return np.where(self.l[:, None] > 0, self.acc / np.where(self.l > 0, self.l, 1)[:, None], 0)


def np_hack_attention(q, k, v, qkv, *, causal, sm_scale=None, transient_int8=True):
    """DESIGN.md "Homomorphic attention semantics" in float64 on dequantized values.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D] the unquantized inputs (only their bfloat16 copies of the
    sinks / open block are used); qkv: the QuantizedKV whose sealed-block codes are attended.
    transient_int8=True applies the INT8 quantization of Qt / Q and Wt / W as the semantics do (the
    tier (b) oracle); False uses them unquantized (plain dequantize-then-dense attention, merged
    per block).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    f = {name: np.asarray(getattr(qkv, name), np.float64) for name in
         ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min")}
    layout, P, ns = qkv.layout, qkv.partition_size, qkv.num_sink_tokens
    kv_lens = np.asarray(qkv.kv_lens)
    batch, q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    G = num_q_heads // num_kv_heads
    Pc = min(P, head_dim)
    NP = head_dim // Pc
    scale = 1 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    image = np_int8_image if transient_int8 else (lambda x, axis, group: x)
    per_group = lambda meta: np.repeat(meta, Pc, axis=-1)  # [..., NP] -> [..., head_dim]
    out = np.zeros((batch, q_len, num_q_heads, head_dim))

    for b in range(batch):
        n = int(kv_lens[b])
        num_sealed = max(n - ns, 0) // P
        vis = np.repeat(_visible(n, q_len, kv_len, causal), G, axis=0)  # rows r = t * G + g
        for h in range(num_kv_heads):
            q_s = scale * q[b, :, h * G:(h + 1) * G].reshape(q_len * G, head_dim)
            sm = _Softmax(q_len * G, head_dim)
            q_img = image(q_s, 1, Pc)  # seed: Q quantized once per (row, channel group)

            def dense(kk, vv, mask, logits=None):
                logits = q_s @ kk.T if logits is None else logits
                w, m = sm.weights(logits, mask)
                sm.add(w @ vv, m, w.sum(-1))

            sinks = slice(0, min(ns, n))
            dense(bf16(k[b, sinks, h]), bf16(v[b, sinks, h]), vis[:, sinks])

            for blk in range(num_sealed):
                toks = slice(ns + blk * P, ns + (blk + 1) * P)
                kc, vc = f["k_codes"][b, h, blk], f["v_codes"][b, h, blk]  # [P, head_dim]
                if layout == "kivi":
                    sigma, mu = f["k_scale"][b, h, blk], f["k_min"][b, h, blk]  # [head_dim]
                    tau, nu = f["v_scale"][b, h, blk], f["v_min"][b, h, blk]  # [P, NP]
                    logits = image(q_s * sigma, 1, Pc) @ kc.T + (q_s @ mu)[:, None]
                    w, m = sm.weights(logits, vis[:, toks])
                    wt = image(w[:, :, None] * tau[None], 1, P)  # [rows, P, NP], per (row, group)
                    acc = np.einsum("rjc,jc->rc", per_group(wt), vc) + w @ per_group(nu)
                    sm.add(acc, m, w.sum(-1))
                else:
                    k_hat = per_group(f["k_scale"][b, h, blk]) * kc + per_group(f["k_min"][b, h, blk])
                    v_hat = f["v_scale"][b, h, blk] * vc + f["v_min"][b, h, blk]
                    w, m = sm.weights(q_img @ k_hat.T, vis[:, toks])
                    w_img = image(w, 1, P)
                    sm.add(w_img @ v_hat, m, w_img.sum(-1))

            start = ns + num_sealed * P
            if start < n:
                toks = slice(start, n)
                if layout == "kivi":
                    dense(bf16(k[b, toks, h]), bf16(v[b, toks, h]), vis[:, toks])
                else:
                    num_open = n - start
                    kc = f["k_codes"][b, h, num_sealed, :num_open]
                    k_hat = (per_group(f["k_scale"][b, h, num_sealed, :num_open]) * kc
                             + per_group(f["k_min"][b, h, num_sealed, :num_open]))
                    dense(None, bf16(v[b, toks, h]), vis[:, toks], logits=q_img @ k_hat.T)

            out[b, :, h * G:(h + 1) * G] = sm.output().reshape(q_len, G, head_dim)
    return out
