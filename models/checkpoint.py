"""Checkpoint: what every loader returns (models.gguf_loader for GGUF files, models.hf_loader for
Hugging Face directories), in a module of its own so the two loaders import neither each other."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.config import ModelConfig
from models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """A loaded checkpoint: config, dense weights (NumPy, compute dtype), tokenizer, raw metadata
  (GGUF key/values, or a Hugging Face directory's config.json)."""
  path: str
  config: ModelConfig
  weights: dict[str, Any]
  tokenizer: Tokenizer
  metadata: dict[str, Any]
