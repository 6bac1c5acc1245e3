"""Independent float64 NumPy forwards of llama/qwen2 checkpoints (test oracles).

Written from the GGUF / safetensors formats and the Llama equations, sharing no code with models/.
oracle_logits reads a GGUF file itself, keeps llama.cpp's row order for Q/K and therefore applies
RoPE to *adjacent* pairs (x[2i], x[2i+1]) for llama files (the model un-permutes and uses
rotate-half), rotate-half for qwen2; Llama-3.1 scaling comes from the `rope_freqs` tensor, as
llama.cpp applies it. oracle_logits_hf reads a Hugging Face directory (config.json, safetensors),
rotate-half, with transformers' rope_type "llama3" inverse frequencies written in transformers' own
form. Weights are read one layer at a time, in float64.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import load_file


def _rms_norm(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, inv, adjacent):
  """x [T, heads, hd] float64, inverse frequencies inv [hd/2], position of row t = t."""
  t, _, hd = x.shape
  ang = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]      # [T, hd/2]
  c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  if adjacent:
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out
  a, b = x[..., : hd // 2], x[..., hd // 2:]
  return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def _attend(q, k, v, causal):
  """q [T, heads, hd], k, v [T, heads, hd] -> [T, heads * hd], causal softmax attention."""
  s = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])
  s = np.where(causal[None], s, -np.inf)
  s = np.exp(s - s.max(-1, keepdims=True))
  s /= s.sum(-1, keepdims=True)
  return np.einsum("hts,shd->thd", s, v).reshape(q.shape[0], -1)


def _decoder(tokens, w, *, n_layers, n_head, n_kv, hd, eps, inv, adjacent, cached=None):
  """w(name, layer) -> float64 [out, in] matrix / vector, or None for an absent bias. Names: embed,
  norm, head (None = tied), and per layer attn_norm, q, k, v, o, q_bias, k_bias, v_bias, ffn_norm,
  gate, up, down. cached: None, or (first, stored): rows t >= first (decode steps) attend to
  stored(layer, k, v) -> (k, v) [T, n_kv, hd] (the K/V as a cache holds them: every position, the
  row's own included), rows t < first (the prefill) to the exact K/V."""
  emb = w("embed", None)                                              # [V, D]
  x = emb[np.asarray(tokens)]                                         # [T, D]
  t_len, d = x.shape
  causal = np.tril(np.ones((t_len, t_len), bool))
  for i in range(n_layers):
    h = _rms_norm(x, w("attn_norm", i), eps)
    q, k, v = (h @ w(n, i).T for n in "qkv")
    if w("q_bias", i) is not None:
      q, k, v = (a + w(n + "_bias", i) for a, n in zip((q, k, v), "qkv"))
    q = _rope(q.reshape(t_len, n_head, hd), inv, adjacent)
    k = _rope(k.reshape(t_len, n_kv, hd), inv, adjacent)
    v = v.reshape(t_len, n_kv, hd)
    rep = n_head // n_kv
    o = _attend(q, np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1), causal)   # [T, heads * hd]
    if cached is not None:
      first, stored = cached
      ks, vs = stored(i, k, v)
      o[first:] = _attend(q, np.repeat(ks, rep, axis=1), np.repeat(vs, rep, axis=1), causal)[first:]
    x = x + o @ w("o", i).T
    h = _rms_norm(x, w("ffn_norm", i), eps)
    g, u = h @ w("gate", i).T, h @ w("up", i).T
    x = x + (g / (1 + np.exp(-g)) * u) @ w("down", i).T
  x = _rms_norm(x, w("norm", None), eps)
  head = w("head", None)
  return x @ (emb if head is None else head).T


_GGUF_NAMES = {"embed": "token_embd.weight", "norm": "output_norm.weight", "head": "output.weight",
               "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
               "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
               "o": "attn_output.weight", "q_bias": "attn_q.bias", "k_bias": "attn_k.bias",
               "v_bias": "attn_v.bias", "gate": "ffn_gate.weight", "up": "ffn_up.weight",
               "down": "ffn_down.weight"}


def oracle_logits(path: str, tokens) -> np.ndarray:
  """float64 logits [T, vocab] of the token list `tokens` (one sequence, positions 0..T-1)."""
  reader = GGUFReader(path)
  meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
  arch = meta["general.architecture"]
  tensors = {t.name: t for t in reader.tensors}

  def w(name, layer):
    full = _GGUF_NAMES[name] if layer is None else f"blk.{layer}.{_GGUF_NAMES[name]}"
    if full not in tensors:
      return None
    t = tensors[full]
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)

  n_head = meta[f"{arch}.attention.head_count"]
  hd = meta[f"{arch}.embedding_length"] // n_head
  inv = meta[f"{arch}.rope.freq_base"] ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
  if "rope_freqs.weight" in tensors:  # llama.cpp: theta = pos * base^(-2i/d) / rope_freqs[i]
    t = tensors["rope_freqs.weight"]
    inv = inv / np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)
  return _decoder(tokens, w, n_layers=meta[f"{arch}.block_count"], n_head=n_head,
                  n_kv=meta[f"{arch}.attention.head_count_kv"], hd=hd,
                  eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"], inv=inv,
                  adjacent=arch == "llama")


def oracle_logits_weights(w, tokens, *, n_layers, n_head, n_kv, hd, eps, theta, cached=None) -> np.ndarray:
  """float64 logits [T, vocab] of a rotate-half decoder whose weights w(name, layer) are given
  (_decoder's names, [out, in]); cached: _decoder's (decode rows over a cache's stored K/V)."""
  inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
  return _decoder(tokens, w, n_layers=n_layers, n_head=n_head, n_kv=n_kv, hd=hd, eps=eps, inv=inv,
                  adjacent=False, cached=cached)


def _hf_inv_freq(cfg, hd):
  """transformers' default / llama3 RoPE inverse frequencies (modeling_rope_utils), float64."""
  inv = 1.0 / (cfg.get("rope_theta", 10000.0) ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
  rs = cfg.get("rope_scaling") or {}
  if rs.get("rope_type", rs.get("type")) != "llama3":
    return inv
  factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
  old = rs["original_max_position_embeddings"]
  low_wavelen, high_wavelen = old / low, old / high
  wavelen = 2 * np.pi / inv
  inv_llama = np.where(wavelen > low_wavelen, inv / factor, inv)
  smooth = (old / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
  is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(is_medium, smoothed, inv_llama)


_HF_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
             "head": "lm_head.weight", "attn_norm": "input_layernorm.weight",
             "ffn_norm": "post_attention_layernorm.weight", "q": "self_attn.q_proj.weight",
             "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
             "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias",
             "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
             "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
             "down": "mlp.down_proj.weight"}


def oracle_logits_hf(path: str, tokens) -> np.ndarray:
  """float64 logits [T, vocab] of a Hugging Face llama / mistral / qwen2 directory."""
  with open(os.path.join(path, "config.json")) as f:
    cfg = json.load(f)
  tensors = {}
  for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
    tensors.update(load_file(file))
  tied = cfg.get("tie_word_embeddings", False)

  def w(name, layer):
    if name == "head" and tied:
      return None
    full = _HF_NAMES[name] if layer is None else f"model.layers.{layer}.{_HF_NAMES[name]}"
    return tensors[full].astype(np.float64) if full in tensors else None

  n_head = cfg["num_attention_heads"]
  hd = cfg.get("head_dim") or cfg["hidden_size"] // n_head
  return _decoder(tokens, w, n_layers=cfg["num_hidden_layers"], n_head=n_head,
                  n_kv=cfg.get("num_key_value_heads", n_head), hd=hd, eps=cfg["rms_norm_eps"],
                  inv=_hf_inv_freq(cfg, hd), adjacent=False)
