"""A tiny random Llama with the real SmolLM2 tokenizer, shared by the engine / CLI / server tests
(built once per process: compiles dominate these tests, the model itself is cheap)."""

import functools

from flax import nnx
from gguf import GGUFReader

from models.config import ModelConfig
from models.gguf_loader import Checkpoint, default_model_path, read_metadata
from models.llama import Llama
from models.tokenizer import Tokenizer


@functools.cache
def tokenizer() -> Tokenizer:
  return Tokenizer.from_gguf_metadata(read_metadata(GGUFReader(default_model_path())))


@functools.cache
def checkpoint_and_model() -> tuple[Checkpoint, Llama]:
  """(a Checkpoint without weights, the model): what models.cli._load returns."""
  tok = tokenizer()
  cfg = ModelConfig("llama", vocab_size=tok.vocab_size, num_layers=2, embed_dim=64, hidden_dim=96,
                    num_q_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                    rope_theta=1e4, max_seq_len=512, tied_embeddings=True, qkv_bias=False)
  return (Checkpoint(path="tiny-random-llama", config=cfg, weights={}, tokenizer=tok, metadata={}),
          Llama(cfg, rngs=nnx.Rngs(0)))
