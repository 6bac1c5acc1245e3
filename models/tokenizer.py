"""Text <-> token ids with the `tokenizers` library, rebuilt from GGUF metadata or read from a
Hugging Face tokenizer.json.

GGUF files follow llama.cpp (src/llama-vocab.cpp):
  tokenizer.ggml.model "gpt2": byte-level BPE from `tokens` / `merges`, split first by the regex of
    `tokenizer.ggml.pre`: "smollm" (and other GPT-2-style vocabularies): digits one by one, then
    GPT-2's regex; "qwen2": Qwen2's regex, NFC; "llama-bpe" (Llama 3.x): Llama 3's regex (digits in
    runs of up to 3) with ignore_merges (a pre-token that is itself in the vocabulary is one token
    even where the merges would not build it) and a BOS added by default.
  tokenizer.ggml.model "llama": SentencePiece (Llama-2, Mistral, TinyLlama): a space prefixed to the
    text and to every run after a special token, spaces written as U+2581, then pieces merged
    pairwise by descending score (llama_tokenizer_spm), characters outside the vocabulary as <0xXX>
    byte tokens; BOS added by default. Here: a BPE whose merges are every split of a normal (or
    unused) piece into two pieces, ranked by the merged piece's score (llama.cpp's order whenever
    no two overlapping candidate merges have the same score, true of real vocabularies, whose
    scores are distinct).
  Control, user-defined and unknown tokens (token_type 3/4/2, e.g. <|eot_id|>, <s>) are special:
  matched whole in the input text, dropped by decode(..., skip_special_tokens=True).
  BOS: tokenizer.ggml.add_bos_token when present, else the defaults above. Generation stops at
  llama.cpp's end-of-generation set: the eos, eot, eom, fim_pad, fim_rep and fim_sep ids of the
  metadata and every token named in EOG_TEXTS.
Hugging Face directories (Tokenizer.from_hf_dir) keep tokenizer.json as it is; BOS/EOS come from
tokenizer_config.json (else config.json), the stop set from generation_config.json's eos_token_id.
The chat template (Jinja) is rendered with jinja2; ChatML when the checkpoint has none.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")
SMOLLM_PRE = ("smollm", "starcoder", "refact", "codeshell")
GPT2_PRE = ("gpt-2", "gpt2", "default")
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                   "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# llama.cpp's end-of-generation token texts (they include every text it detects eot / eom by).
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>",
             "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
             "<end_of_utterance>", "<eos>", "<｜end▁of▁sentence｜>")
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"


def _bpe_pre_tokenizer(pre: str) -> tuple[Any, Any]:
  """(normalizer, pre_tokenizer) for a byte-level BPE `tokenizer.ggml.pre` name."""
  if pre in QWEN2_PRE or pre in LLAMA3_PRE:
    regex = QWEN2_REGEX if pre in QWEN2_PRE else LLAMA3_REGEX
    split = pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated")
    return (normalizers.NFC() if pre in QWEN2_PRE else None), pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  if pre in SMOLLM_PRE:
    return None, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  if pre in GPT2_PRE:
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} (supported: "
                   f"{', '.join(LLAMA3_PRE + QWEN2_PRE + SMOLLM_PRE + GPT2_PRE)})")


def _byte_level_bpe(md: dict[str, Any], tokens: Sequence[str]) -> tokenizers.Tokenizer:
  pre = md.get("tokenizer.ggml.pre", "gpt-2")
  normalizer, pre_tokenizer = _bpe_pre_tokenizer(pre)
  merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
  tk = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                       fuse_unk=False, byte_fallback=False,
                                       ignore_merges=pre in LLAMA3_PRE))
  if normalizer is not None:
    tk.normalizer = normalizer
  tk.pre_tokenizer = pre_tokenizer
  tk.decoder = decoders.ByteLevel()
  return tk


def _sentencepiece(md: dict[str, Any], tokens: Sequence[str], types: Sequence[int]
                   ) -> tokenizers.Tokenizer:
  scores = md.get("tokenizer.ggml.scores")
  if scores is None:
    raise ValueError("SentencePiece GGUF (tokenizer.ggml.model 'llama') lacks "
                     "tokenizer.ggml.scores")
  vocab = {t: i for i, t in enumerate(tokens)}
  # llama.cpp merges into any vocabulary text; control / user-defined / unknown ones are matched
  # whole before (special tokens) and byte tokens never arise from merging characters.
  pieces = {t for t, ty in zip(tokens, types) if ty in (_NORMAL, _UNUSED)}
  ranked = []
  for piece in pieces:
    for k in range(1, len(piece)):
      if piece[:k] in pieces and piece[k:] in pieces:
        ranked.append((-scores[vocab[piece]], vocab[piece], piece[:k], piece[k:]))
  ranked.sort()
  unk = int(md.get("tokenizer.ggml.unknown_token_id", 0))
  tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked],
                                       unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
  space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
  tk.normalizer = normalizers.Sequence(
      ([normalizers.Prepend(_SPACE)] if space_prefix else []) + [normalizers.Replace(" ", _SPACE)])
  tk.decoder = decoders.Sequence(
      [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
      + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
  return tk


def _gguf_stop_ids(md: dict[str, Any], tokens: Sequence[str], eos_id: int) -> set[int]:
  ids = {eos_id}
  for key in ("eot", "eom", "fim_pad", "fim_rep", "fim_sep"):
    if f"tokenizer.ggml.{key}_token_id" in md:
      ids.add(int(md[f"tokenizer.ggml.{key}_token_id"]))
  index = {t: i for i, t in enumerate(tokens)}
  ids.update(index[t] for t in EOG_TEXTS if t in index)
  return ids


class Tokenizer:
  """Text <-> token ids for one checkpoint (build it with from_gguf_metadata or from_hf_dir).

  Attributes:
    bos_id, eos_id: special ids (bos may be None). add_bos: whether encode prepends BOS by default.
    stop_ids: frozenset of ids that end generation (eos and the checkpoint's other end tokens).
    chat_template: Jinja source or None (then ChatML is used by apply_chat_template).
    vocab_size: number of token ids the tokenizer can produce.
  """

  def __init__(self, tk: tokenizers.Tokenizer, *, bos_id: int | None, eos_id: int, add_bos: bool,
               chat_template: str | None, stop_ids: Sequence[int] = ()):
    self._tk = tk
    self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
    self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
    self.chat_template = chat_template
    self.stop_ids = frozenset([eos_id, *stop_ids])

  @classmethod
  def from_gguf_metadata(cls, md: dict[str, Any]) -> "Tokenizer":
    """Builds the tokenizer from decoded GGUF metadata (see gguf_loader.read_metadata).

    Raises:
      ValueError: a tokenizer.ggml.model other than "gpt2" / "llama", an unknown pre-tokenizer, a
        SentencePiece vocabulary without scores, or a BPE one without an eos id.
    """
    model = md.get("tokenizer.ggml.model")
    tokens = md["tokenizer.ggml.tokens"]
    types = md.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    if model == "gpt2":
      tk = _byte_level_bpe(md, tokens)
      add_bos, bos, eos = md.get("tokenizer.ggml.pre") in LLAMA3_PRE, None, None
    elif model == "llama":
      tk = _sentencepiece(md, tokens, types)
      add_bos, bos, eos = True, 1, 2  # llama.cpp's SentencePiece defaults
    else:
      raise ValueError(f"unsupported tokenizer.ggml.model {model!r}: supported are 'gpt2' "
                       "(byte-level BPE) and 'llama' (SentencePiece)")
    index = {t: i for i, t in enumerate(tokens)}
    special = {i for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED, _UNKNOWN)}
    special.update(index[t] for t in EOG_TEXTS if t in index)  # llama.cpp makes them control
    tk.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                           for i in sorted(special)])
    eos = md.get("tokenizer.ggml.eos_token_id", eos)
    if eos is None:
      raise ValueError("GGUF byte-level BPE vocabulary without tokenizer.ggml.eos_token_id")
    return cls(tk, bos_id=md.get("tokenizer.ggml.bos_token_id", bos), eos_id=eos,
               add_bos=bool(md.get("tokenizer.ggml.add_bos_token", add_bos)),
               chat_template=md.get("tokenizer.chat_template"),
               stop_ids=_gguf_stop_ids(md, tokens, eos))

  @classmethod
  def from_hf_dir(cls, path: str) -> "Tokenizer":
    """Reads `path`/tokenizer.json, with tokenizer_config.json, generation_config.json, config.json
    and chat_template.jinja where present.

    Raises:
      FileNotFoundError: no tokenizer.json. ValueError: no eos token can be found.
    """
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
      raise FileNotFoundError(f"{file} not found: a Hugging Face checkpoint directory needs the "
                              "fast tokenizer's tokenizer.json")
    tk = tokenizers.Tokenizer.from_file(file)
    tk.no_padding()
    tk.no_truncation()
    tcfg, gcfg, mcfg = (_read_json(os.path.join(path, f)) for f in
                        ("tokenizer_config.json", "generation_config.json", "config.json"))

    def token_id(name):
      tok = tcfg.get(f"{name}_token")
      tok = tok.get("content") if isinstance(tok, dict) else tok
      if tok is not None and tk.token_to_id(tok) is not None:
        return tk.token_to_id(tok)
      ids = [i for c in (gcfg, mcfg) for i in _as_list(c.get(f"{name}_token_id"))]
      return ids[0] if ids else None

    bos, eos = token_id("bos"), token_id("eos")
    if eos is None:
      raise ValueError(f"no eos token in {path} (tokenizer_config.json eos_token or "
                       "generation_config.json / config.json eos_token_id)")
    # Without add_bos_token, tokenizer.json's post-processor decides, as in transformers.
    plain, processed = (tk.encode("a", add_special_tokens=s).ids for s in (False, True))
    prefix = processed[0] if processed[1:len(plain) + 1] == plain else None
    bos = prefix if bos is None else bos
    add_bos = bos is not None and bool(tcfg.get("add_bos_token", prefix == bos))
    stops = [i for c in (gcfg, mcfg) for i in _as_list(c.get("eos_token_id"))]
    return cls(tk, bos_id=bos, eos_id=eos, add_bos=add_bos, stop_ids=stops,
               chat_template=_hf_chat_template(path, tcfg))

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text` (special-token strings such as <|im_start|> map to their ids).
    add_bos: None = the model's default (add_bos attribute)."""
    ids = self._tk.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id, *ids]
    return ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict[str, str]], *,
                          add_generation_prompt: bool = True) -> str:
    """Renders messages [{"role": ..., "content": ...}] with the checkpoint's chat template (ChatML
    if none), as text to pass to encode() (which adds the BOS, so the template's bos_token is "").

    Raises:
      ModuleNotFoundError: jinja2 is not installed.
    """
    import jinja2.sandbox  # only chat prompts need jinja2

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(self.chat_template or CHATML_TEMPLATE)
    return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                           bos_token="", eos_token=self._tk.id_to_token(self.eos_id) or "")


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _as_list(x) -> list[int]:
  return [] if x is None else [int(i) for i in (x if isinstance(x, list) else [x])]


def _hf_chat_template(path: str, tcfg: dict[str, Any]) -> str | None:
  jinja = os.path.join(path, "chat_template.jinja")
  if os.path.isfile(jinja):
    with open(jinja, encoding="utf-8") as f:
      return f.read()
  template = tcfg.get("chat_template")
  if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
    named = {t["name"]: t["template"] for t in template}
    template = named.get("default", next(iter(named.values()), None))
  return template
