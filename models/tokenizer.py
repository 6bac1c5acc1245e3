"""Byte-level BPE tokenizer rebuilt from GGUF metadata with the `tokenizers` library.

Vocabulary and merges come from `tokenizer.ggml.tokens` / `tokenizer.ggml.merges`; the pre-tokenizer
follows `tokenizer.ggml.pre` as llama.cpp does:
  "smollm" (and other GPT-2-style vocabularies): digits split one by one, then GPT-2's byte-level regex.
  "qwen2": Qwen2's split regex (single digits, letters with one leading non-letter, ...), NFC.
Control and user-defined tokens (token_type 3/4, e.g. <|im_start|>) are special tokens: matched whole
in the input text and dropped by decode(..., skip_special_tokens=True).
The chat template stored in the file (Jinja) is rendered with jinja2; ChatML when the file has none.
"""

from __future__ import annotations

from typing import Any, Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                   "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str) -> tuple[Any, Any]:
  """(normalizer, pre_tokenizer) for a `tokenizer.ggml.pre` name."""
  if pre == "qwen2":
    split = pre_tokenizers.Split(tokenizers.Regex(QWEN2_REGEX), behavior="isolated")
    return normalizers.NFC(), pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  if pre in ("smollm", "starcoder", "refact", "codeshell"):
    return None, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  if pre in ("gpt-2", "gpt2", "default"):
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} (supported: smollm, qwen2, gpt-2)")


class Tokenizer:
  """Text <-> token ids for one GGUF checkpoint.

  Attributes:
    bos_id, eos_id: special ids (bos may be None). add_bos: whether encode prepends BOS by default.
    stop_ids: frozenset of ids that end generation (eos, plus eot / <|im_end|> when present).
    chat_template: Jinja source or None (then ChatML is used by apply_chat_template).
  """

  def __init__(self, *, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
               pre: str, bos_id: int | None, eos_id: int, add_bos: bool,
               chat_template: str | None, extra_stop_ids: Sequence[int] = ()):
    vocab = {tok: i for i, tok in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                       fuse_unk=False, byte_fallback=False)
    tk = tokenizers.Tokenizer(model)
    normalizer, pre_tokenizer = _pre_tokenizer(pre)
    if normalizer is not None:
      tk.normalizer = normalizer
    tk.pre_tokenizer = pre_tokenizer
    tk.decoder = decoders.ByteLevel()
    special = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(token_types) if t in (_CONTROL, _USER_DEFINED)]
    tk.add_special_tokens(special)
    self._tk = tk
    self.vocab_size = len(tokens)
    self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
    self.chat_template = chat_template
    self.stop_ids = frozenset([eos_id, *extra_stop_ids])

  @classmethod
  def from_gguf_metadata(cls, md: dict[str, Any]) -> "Tokenizer":
    """Builds the tokenizer from decoded GGUF metadata (see gguf_loader.read_metadata).

    Raises:
      ValueError: a tokenizer model other than "gpt2" (byte-level BPE) or an unknown pre-tokenizer.
    """
    if md.get("tokenizer.ggml.model") != "gpt2":
      raise ValueError(f"unsupported tokenizer.ggml.model {md.get('tokenizer.ggml.model')!r}: "
                       "only byte-level BPE ('gpt2') is supported")
    tokens = md["tokenizer.ggml.tokens"]
    extra = [md[k] for k in ("tokenizer.ggml.eot_token_id",) if k in md]
    if "<|im_end|>" in tokens:
      extra.append(tokens.index("<|im_end|>"))
    return cls(tokens=tokens, merges=md["tokenizer.ggml.merges"],
               token_types=md.get("tokenizer.ggml.token_type", [1] * len(tokens)),
               pre=md.get("tokenizer.ggml.pre", "gpt-2"),
               bos_id=md.get("tokenizer.ggml.bos_token_id"),
               eos_id=md["tokenizer.ggml.eos_token_id"],
               add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)),
               chat_template=md.get("tokenizer.chat_template"), extra_stop_ids=extra)

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text` (special-token strings such as <|im_start|> map to their ids).
    add_bos: None = the model's default (tokenizer.ggml.add_bos_token)."""
    ids = self._tk.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id, *ids]
    return ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict[str, str]], *,
                          add_generation_prompt: bool = True) -> str:
    """Renders messages [{"role": ..., "content": ...}] with the file's chat template (ChatML if
    none), as text to pass to encode().

    Raises:
      ModuleNotFoundError: jinja2 is not installed.
    """
    import jinja2.sandbox  # only chat prompts need jinja2

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(self.chat_template or CHATML_TEMPLATE)
    return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                           bos_token="", eos_token="")
