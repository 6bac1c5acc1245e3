"""Loads a local Hugging Face checkpoint directory: config.json + *.safetensors + tokenizer.json.

Architectures (config.json `model_type`): "llama" and "mistral" (both run as ModelConfig
architecture "llama") and "qwen2" (q/k/v biases). Tied or untied embeddings (tie_word_embeddings,
or no lm_head.weight); rope_scaling rope_type "llama3" (Llama-3.1) or "linear" as
ModelConfig.rope_freq_factors; other rope types, attention_bias / mlp_bias on llama, activations
other than silu, and partial RoPE are ValueErrors. A sliding window (mistral, or qwen2 with
use_sliding_window) caps max_seq_len at the window, the longest context where full attention, which
this runtime computes, equals the model's.

Weights are read with `safetensors` (NumPy, bf16 through ml_dtypes), PyTorch order [out, in], and
laid out as models/gguf_loader.py documents. Hugging Face stores Q/K rows in rotate-half order
already, the order models/llama.py uses, so nothing is permuted. The tokenizer is
models.tokenizer.Tokenizer.from_hf_dir.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np
from safetensors import safe_open

from models.config import ModelConfig, llama3_rope_freq_factors
from models.checkpoint import Checkpoint
from models.tokenizer import Tokenizer

MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def hf_rope_freq_factors(cfg: dict[str, Any], head_dim: int) -> tuple[float, ...] | None:
  """ModelConfig.rope_freq_factors for config.json's rope_scaling (None when unscaled).

  Raises ValueError for a rope type other than default / linear / llama3."""
  rs = cfg.get("rope_scaling") or {}
  kind = rs.get("rope_type", rs.get("type", "default"))
  theta = float(cfg.get("rope_theta", 10000.0))
  if kind == "default":
    return None
  if kind == "linear":
    return (float(rs["factor"]),) * (head_dim // 2)
  if kind == "llama3":
    return llama3_rope_freq_factors(
        head_dim, theta, factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
  raise ValueError(f"unsupported rope_scaling rope_type {kind!r} in config.json (supported: "
                   "default, linear, llama3)")


def config_from_hf(cfg: dict[str, Any], *, tied_embeddings: bool, **overrides) -> ModelConfig:
  """ModelConfig from a parsed config.json.

  Raises:
    ValueError: an unsupported model_type, activation, bias, partial RoPE or rope_scaling.
  """
  model_type = cfg.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ValueError(f"unsupported Hugging Face model_type {model_type!r} in config.json; this "
                     f"runtime loads {sorted(MODEL_TYPES)}")
  if (act := cfg.get("hidden_act", "silu")) != "silu":
    raise ValueError(f"unsupported hidden_act {act!r} in config.json (only silu / SwiGLU)")
  for key in ("attention_bias", "mlp_bias"):
    if model_type != "qwen2" and cfg.get(key):
      raise ValueError(f"config.json sets {key}=true: biases are supported only as qwen2's q/k/v")
  if cfg.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"partial_rotary_factor={cfg['partial_rotary_factor']}: partial RoPE is not "
                     "supported")
  heads = int(cfg["num_attention_heads"])
  head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
  max_len = int(cfg.get("max_position_embeddings", 4096))
  window = cfg.get("sliding_window")
  if window and (model_type == "mistral" or cfg.get("use_sliding_window", False)):
    max_len = min(max_len, int(window))
  kwargs = dict(
      architecture=MODEL_TYPES[model_type], vocab_size=int(cfg["vocab_size"]),
      num_layers=int(cfg["num_hidden_layers"]), embed_dim=int(cfg["hidden_size"]),
      hidden_dim=int(cfg["intermediate_size"]), num_q_heads=heads,
      num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
      rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      rope_theta=float(cfg.get("rope_theta", 10000.0)), max_seq_len=max_len,
      tied_embeddings=tied_embeddings, qkv_bias=model_type == "qwen2",
      rope_freq_factors=hf_rope_freq_factors(cfg, head_dim))
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


def load_hf_checkpoint(path: str, *, dtype: Any = np.float32, **config_overrides) -> Checkpoint:
  """Loads a Hugging Face llama / mistral / qwen2 directory (module docstring).

  Args:
    path: directory holding config.json, one or more *.safetensors and tokenizer.json.
    dtype: dtype of the returned weights (float32 or bfloat16); also becomes ModelConfig.dtype.
    **config_overrides: extra ModelConfig fields (e.g. attention=Backend("pallas"), scan_layers).

  Raises:
    FileNotFoundError: no config.json, no *.safetensors or no tokenizer.json in `path`.
    ValueError: unsupported architecture or settings (config_from_hf), a missing tensor, or
      tie_word_embeddings false without lm_head.weight.
  """
  cfg_file = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_file):
    raise FileNotFoundError(f"{cfg_file} not found: --model DIR must be a Hugging Face checkpoint "
                            "directory (config.json, *.safetensors, tokenizer.json)")
  with open(cfg_file, encoding="utf-8") as f:
    cfg = json.load(f)
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors file in {path}")
  where = {}
  for file in files:
    with safe_open(file, framework="numpy") as f:
      where.update((name, file) for name in f.keys())
  has_head = "lm_head.weight" in where
  if cfg.get("tie_word_embeddings") is False and not has_head:
    raise ValueError(f"{path}: tie_word_embeddings is false but there is no lm_head.weight")
  tied = bool(cfg.get("tie_word_embeddings")) or not has_head
  config = config_from_hf(cfg, tied_embeddings=tied, dtype=np.dtype(dtype), **config_overrides)
  weights = _convert_weights(where, config, np.dtype(dtype))
  return Checkpoint(path=path, config=config, weights=weights,
                    tokenizer=Tokenizer.from_hf_dir(path), metadata=cfg)


def _convert_weights(where: dict[str, str], config: ModelConfig, dtype: np.dtype
                     ) -> dict[str, Any]:
  handles = {}

  def get(name):
    if name not in where:
      raise ValueError(f"safetensors files lack tensor {name!r}")
    file = where[name]
    if file not in handles:
      handles[file] = safe_open(file, framework="numpy")
    return handles[file].get_tensor(name).astype(np.float32)

  d, n, k, h = config.embed_dim, config.num_q_heads, config.num_kv_heads, config.head_dim
  cast = lambda x: np.ascontiguousarray(x).astype(dtype)
  layers = []
  for i in range(config.num_layers):
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    layer = {
        "attn_norm": cast(get(p + "input_layernorm.weight")),
        "ffn_norm": cast(get(p + "post_attention_layernorm.weight")),
        "q": cast(get(a + "q_proj.weight").T.reshape(d, n, h)),
        "k": cast(get(a + "k_proj.weight").T.reshape(d, k, h)),
        "v": cast(get(a + "v_proj.weight").T.reshape(d, k, h)),
        "o": cast(get(a + "o_proj.weight").T.reshape(n, h, d)),
        "gate": cast(get(m + "gate_proj.weight").T),
        "up": cast(get(m + "up_proj.weight").T),
        "down": cast(get(m + "down_proj.weight").T),
    }
    if config.qkv_bias:
      layer["q_bias"] = cast(get(a + "q_proj.bias").reshape(n, h))
      layer["k_bias"] = cast(get(a + "k_proj.bias").reshape(k, h))
      layer["v_bias"] = cast(get(a + "v_proj.bias").reshape(k, h))
    layers.append(layer)
  weights = {"embed": cast(get("model.embed_tokens.weight")),
             "final_norm": cast(get("model.norm.weight")), "layers": layers}
  if not config.tied_embeddings:
    weights["lm_head"] = cast(get("lm_head.weight").T)
  return weights
