"""Independent float64 NumPy forward of a llama/qwen2 GGUF checkpoint (test oracle).

Written from the GGUF format and the Llama equations, sharing no code with models/: it reads the
file itself, keeps llama.cpp's row order for Q/K and therefore applies RoPE to *adjacent* pairs
(x[2i], x[2i+1]) for llama files (the model un-permutes and uses rotate-half), rotate-half for qwen2.
Weights are dequantized one layer at a time, in float64.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def _rms_norm(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, theta, adjacent):
  """x [T, heads, hd] float64, position of row t = t."""
  t, _, hd = x.shape
  inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)      # [hd/2]
  ang = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]      # [T, hd/2]
  c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  if adjacent:
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out
  a, b = x[..., : hd // 2], x[..., hd // 2:]
  return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def oracle_logits(path: str, tokens) -> np.ndarray:
  """float64 logits [T, vocab] of the token list `tokens` (one sequence, positions 0..T-1)."""
  reader = GGUFReader(path)
  meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
  arch = meta["general.architecture"]
  tensors = {t.name: t for t in reader.tensors}

  def w(name):
    t = tensors[name]
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)

  n_head = meta[f"{arch}.attention.head_count"]
  n_kv = meta[f"{arch}.attention.head_count_kv"]
  eps = meta[f"{arch}.attention.layer_norm_rms_epsilon"]
  theta = meta[f"{arch}.rope.freq_base"]
  adjacent = arch == "llama"
  emb = w("token_embd.weight")                                        # [V, D]
  x = emb[np.asarray(tokens)]                                         # [T, D]
  t_len, d = x.shape
  hd = d // n_head
  causal = np.tril(np.ones((t_len, t_len), bool))
  for i in range(meta[f"{arch}.block_count"]):
    p = f"blk.{i}."
    h = _rms_norm(x, w(p + "attn_norm.weight"), eps)
    q, k, v = (h @ w(p + f"attn_{n}.weight").T for n in "qkv")
    if f"{p}attn_q.bias" in tensors:
      q, k, v = (a + w(p + f"attn_{n}.bias") for a, n in zip((q, k, v), "qkv"))
    q = _rope(q.reshape(t_len, n_head, hd), theta, adjacent)
    k = _rope(k.reshape(t_len, n_kv, hd), theta, adjacent)
    v = v.reshape(t_len, n_kv, hd)
    rep = n_head // n_kv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)     # [T, heads, hd]
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    s = np.where(causal[None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", s, v).reshape(t_len, d)
    x = x + o @ w(p + "attn_output.weight").T
    h = _rms_norm(x, w(p + "ffn_norm.weight"), eps)
    g, u = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
    x = x + (g / (1 + np.exp(-g)) * u) @ w(p + "ffn_down.weight").T
  x = _rms_norm(x, w("output_norm.weight"), eps)
  head = w("output.weight") if "output.weight" in tensors else emb
  return x @ head.T
