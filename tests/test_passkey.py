"""models/passkey.py: prompt construction (length, needle placement, chat template), answer
parsing, argument errors, the report, and one end-to-end batch on a tiny random model."""

import json

import numpy as np
import pytest
from flax import nnx
from gguf import GGUFReader

from models import eval as ev
from models import passkey as pk
from models.config import ModelConfig
from models.gguf_loader import default_model_path, read_metadata
from models.llama import Llama
from models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.from_gguf_metadata(read_metadata(GGUFReader(default_model_path())))


@pytest.fixture(scope="module")
def hay(tok):
  return tok.encode(ev.load_text("sotu2024")[1])


@pytest.mark.parametrize("length,depth", [(512, 0.1), (512, 0.5), (1024, 0.9), (1024, 0.0)])
def test_prompt_length_and_needle(tok, hay, length, depth):
  p = pk.build_prompt(tok, hay, length=length, depth=depth, key="68241")
  assert abs(len(p.ids) - length) <= 8  # re-tokenizing the joins moves it by a few tokens
  text = tok.decode(p.ids, skip_special_tokens=False)
  assert text.count("68241") == 2 and text.count(pk.NEEDLE.format(key="68241")) == 1
  assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n"
                                                            + pk.ANSWER_PREFIX)
  # The needle sits near the requested depth of the haystack (sentence-snapped).
  intro = len(tok.encode(pk._render(tok, "", True).split(pk.INTRO)[0] + pk.INTRO))
  frac = (p.needle_token - intro) / (len(p.ids) - intro)
  assert abs(frac - depth) < 0.1
  assert pk.answer_of(tok.decode(tok.encode(text[text.index("68241"):]))) == "68241"


def test_make_prompts_keys_and_passages(tok, hay):
  ps = pk.make_prompts(tok, hay, length=256, depths=[0.1, 0.9], trials=2, seed=3)
  assert [p.depth for p in ps] == [0.1, 0.9, 0.1, 0.9]
  assert len({p.key for p in ps}) == 4 and all(len(p.key) == 5 for p in ps)
  assert ps[0].ids[-40:] != ps[2].ids[-40:]  # trials read different passages
  again = pk.make_prompts(tok, hay, length=256, depths=[0.1, 0.9], trials=2, seed=3)
  assert [p.key for p in again] == [p.key for p in ps]


def test_answer_parsing():
  assert pk.answer_of(" 68241. Remember") == "68241"
  assert pk.answer_of(" unknown") is None
  assert pk.answer_of("6824") == "6824"


def test_errors(tok, hay):
  with pytest.raises(ValueError, match="depth"):
    pk.build_prompt(tok, hay, length=512, depth=1.5, key="1")
  with pytest.raises(ValueError, match="digits"):
    pk.build_prompt(tok, hay, length=512, depth=0.5, key="12a")
  with pytest.raises(ValueError, match="haystack tokens"):
    pk.build_prompt(tok, hay, length=90, depth=0.5, key="1")
  with pytest.raises(ValueError, match="haystack has"):
    pk.build_prompt(tok, hay[:300], length=1024, depth=0.5, key="1")
  with pytest.raises(SystemExit):
    pk.main(["--formats", "nope", "--report-only", "--out", "/nonexistent/x.jsonl"])


def test_end_to_end_on_tiny_model_and_report(tok, hay, tmp_path):
  cfg = ModelConfig("llama", vocab_size=tok.vocab_size, num_layers=2, embed_dim=64, hidden_dim=96,
                    num_q_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                    rope_theta=1e4, max_seq_len=512, tied_embeddings=True, qkv_bias=False)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  prompts = pk.make_prompts(tok, hay, length=200, depths=[0.5], trials=2)
  r = pk.evaluate(ev.FORMATS["hack-p32"], model, tok, prompts, max_new_tokens=3)
  assert len(r["correct"]) == 2 and len(r["answers"]) == 2
  assert r["correct"] == [pk.answer_of(a) == p.key for a, p in zip(r["answers"], prompts)]
  # one prompt at a time through one generator: the same greedy answers, in prompt order
  one = pk.evaluate(ev.FORMATS["hack-p32"], model, tok, prompts, max_new_tokens=3, batch=1)
  assert one["answers"] == r["answers"] and one["correct"] == r["correct"]
  with pytest.raises(ValueError, match="batch"):
    pk.evaluate(ev.FORMATS["hack-p32"], model, tok, prompts, max_new_tokens=3, batch=0)
  out = tmp_path / "pk.jsonl"
  rows = [dict(format=f, model="m", haystack="h", length=200, depth=0.5, key=k, chat=True,
               correct=c, command="cmd") for f, k, c in
          [("float32", "1", True), ("float32", "2", False), ("hack-p64", "1", False)]]
  out.write_text("\n".join(json.dumps(x) for x in rows))
  pk.write_report(str(out))
  md = (tmp_path / "pk.md").read_text()
  assert "| float32 | 1/2 \\| **1/2** |" in md and "| hack-p64 | 0/1 \\| **0/1** |" in md
