"""A stream of requests: continuous batching vs fixed batching (models/engine.py, the Generator).

Workload: --requests requests, all arriving at t = 0 (offline throughput, as vLLM's
benchmark_throughput), with prompt lengths drawn uniformly from --prompt-len LO HI and output
lengths uniformly from --output-len LO HI (seeded; random token ids; ignore_eos, so every request
produces exactly its output length). Modes, each with --max-seqs slots:
  continuous  Engine: a request joins as soon as a slot is free and leaves at its own length.
  fixed       the same Engine (the same compiled steps) fed waves of max_seqs requests in arrival
              order: a wave starts when the previous one is done, so slots freed by its shorter
              requests idle until its longest one ends (static batching).
  generator   Generator.generate_ids on the same waves: one prefill call of max_seqs rows, then
              decode until the wave's longest request is done (one max_new_tokens per call); only
              each request's own tokens are counted. Its own compiled steps (CPU comparisons).
Timing: each mode first runs an untimed pass over the first --warm requests (default all: the
first-use costs of eager ops; the Engine's steps are compiled before, by Engine.warmup, in
parallel), then the timed pass over all; compile time is reported on its own and excluded.
Reported: requests/s, output tokens/s, total (prompt + output) tokens/s, mean time to first token,
mean and p90 latency (Engine modes; from the pass's start, t = 0 for every request), and whether
each mode produced the first mode's greedy tokens.

Models: smollm2 (the real SmolLM2-135M-Instruct GGUF, its tokenizer; CPU default), a preset from
models.config.PRESETS (e.g. llama-3.1-8b: random bf16 weights, token ids in, no detokenization
beyond a null tokenizer; GPU with --impl pallas), or toy (2 layers, for tests).

Usage:
  python bench/bench_serving.py                                   # CPU, SmolLM2, hack and bf16
  python bench/bench_serving.py --model llama-3.1-8b --impl pallas --requests 64 --max-seqs 16 \\
      --prompt-len 512 8192 --output-len 32 512 --modes continuous fixed --warm 2
                                                                  # GPU, Llama-3.1-8B shapes
Outputs: JSON lines appended to --out (default bench/results/serving.jsonl) and a Markdown table
(serving.md beside it) rebuilt from all rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hack_jax.backend import Backend  # noqa: E402
from hack_jax.config import QuantConfig  # noqa: E402
from models.config import PRESETS, ModelConfig, preset  # noqa: E402
from models.engine import Engine, Request  # noqa: E402
from models.generate import Generator  # noqa: E402
from models.llama import Llama  # noqa: E402

TOY = dict(architecture="llama", vocab_size=512, num_layers=2, embed_dim=128, hidden_dim=256,
           num_q_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
           max_seq_len=4096, tied_embeddings=False, qkv_bias=False)


class NullTokenizer:
  """For random-weight models: no text, no stop ids (ignore_eos runs anyway)."""
  stop_ids = frozenset()
  chat_template = None

  def decode(self, ids, skip_special_tokens=True):
    return ""


def load(args):
  """-> (model, tokenizer, label)."""
  backend = Backend(args.impl, {"interpret": True} if args.interpret else {})
  if args.model == "smollm2":
    from models.gguf_loader import load_checkpoint
    ckpt = load_checkpoint(attention=backend)
    return Llama.from_weights(ckpt.config, ckpt.weights), ckpt.tokenizer, "SmolLM2-135M (Q4_1)"
  if args.model == "toy":
    cfg = ModelConfig(**TOY, attention=backend)
  else:
    cfg = preset(args.model, dtype=jnp.bfloat16, attention=backend)
  return Llama(cfg, rngs=nnx.Rngs(0)), NullTokenizer(), f"{args.model} (random bf16 weights)"


def workload(args, vocab):
  rng = np.random.default_rng(args.seed)
  plen = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, args.requests)
  olen = rng.integers(args.output_len[0], args.output_len[1] + 1, args.requests)
  # ids from the lower half of the vocabulary: real text tokens for SmolLM2, any id for the rest
  return [Request(rng.integers(0, vocab // 2, int(p)).tolist(), max_tokens=int(o), ignore_eos=True)
          for p, o in zip(plen, olen)]


def run_engine(eng, reqs, mode, warm):
  """continuous: every request submitted at t = 0; fixed: waves of max_seqs requests on the same
  Engine (a wave starts when the previous one is done). One untimed pass over reqs[:warm] first."""
  def stream(batch):
    before, t0 = dict(eng.stats), time.perf_counter()
    waves = [batch] if mode == "continuous" else [
        batch[lo:lo + eng.max_seqs] for lo in range(0, len(batch), eng.max_seqs)]
    out = [c for wave in waves for c in eng.generate(wave)]
    wall = time.perf_counter() - t0 - (eng.stats["compile_s"] - before["compile_s"])
    return wall, out, before, t0

  if warm:
    stream(reqs[:warm])
  wall, out, before, t0 = stream(reqs)
  ttft = [c.times["first_token"] - t0 for c in out]
  lat = [c.times["finished"] - t0 for c in out]
  return wall, eng.stats["compile_s"], [c.tokens for c in out], dict(
      mean_ttft_s=float(np.mean(ttft)), mean_latency_s=float(np.mean(lat)),
      p90_latency_s=float(np.percentile(lat, 90)),
      decode_steps=eng.stats["decode_steps"] - before["decode_steps"],
      prefill_calls=eng.stats["prefill_calls"] - before["prefill_calls"],
      compile_in_run_s=eng.stats["compile_s"] - before["compile_s"])


def run_generator(model, tok, quant, reqs, args):
  gen = Generator(model, tok, quant, max_seqs=args.max_seqs, max_len=args.max_len,
                  prefill_chunk=args.prefill_chunk)

  def stream(batch):
    tokens, compile_s, t0 = [], 0.0, time.perf_counter()
    for lo in range(0, len(batch), args.max_seqs):
      chunk = batch[lo:lo + args.max_seqs]
      res = gen.generate_ids([list(r.prompt_ids) for r in chunk], max(r.max_tokens for r in chunk),
                             stop_on_eos=False)
      compile_s += res.stats["compile_s"]
      tokens += [t[:r.max_tokens] for t, r in zip(res.tokens, chunk)]
    return time.perf_counter() - t0 - compile_s, compile_s, tokens

  _, compile_s, _ = stream(reqs if args.warm is None else reqs[:args.warm])  # compiles, first use
  wall, more, tokens = stream(reqs)
  return wall, compile_s + more, tokens, dict(compile_in_run_s=more)


def write_markdown(path_jsonl):
  rows = [json.loads(x) for x in open(path_jsonl, encoding="utf-8") if x.strip()]
  lines = ["# Serving: a stream of requests, continuous vs fixed batching", "",
           "Written by `bench/bench_serving.py` (its docstring: workload and timing). All requests "
           "arrive at t = 0; compile time excluded; tokens/s counts each request's own output "
           "tokens. load: the machine's 1-minute load average when the row was written (a CPU "
           "shared with other jobs: rows at high load are slower for reasons outside the run).",
           "",
           "| date | device | model | kv | slots | prefill chunk | requests | prompt | output | mode | "
           "wall s | req/s | out tok/s | total tok/s | mean TTFT s | mean latency s | same tokens | load |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    f = lambda k, d=2: "-" if r.get(k) is None else f"{r[k]:.{d}f}"
    lines.append(f"| {r['date']} | {r['device']} | {r['model']} | {r['kv_format']} | "
                 f"{r['max_seqs']} | {r.get('prefill_chunk') or '-'} | {r['requests']} | "
                 f"{r['prompt_len']} | {r['output_len']} | "
                 f"{r['mode']} | {f('wall_s', 1)} | {f('requests_per_s', 3)} | "
                 f"{f('output_tok_per_s', 1)} | {f('total_tok_per_s', 1)} | {f('mean_ttft_s')} | "
                 f"{f('mean_latency_s')} | {r.get('same_tokens', '-')} | {f('load_avg_1min', 1)} |")
  with open(path_jsonl[:-len(".jsonl")] + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--model", default="smollm2", choices=["smollm2", "toy", *sorted(PRESETS)])
  ap.add_argument("--formats", nargs="+", default=["hack", "bf16"], choices=["hack", "bf16"])
  ap.add_argument("--modes", nargs="+", default=["continuous", "fixed", "generator"],
                  choices=["continuous", "fixed", "generator"])
  ap.add_argument("--requests", type=int, default=8)
  ap.add_argument("--max-seqs", type=int, default=4)
  ap.add_argument("--prompt-len", nargs=2, type=int, default=[16, 64], metavar=("LO", "HI"))
  ap.add_argument("--output-len", nargs=2, type=int, default=[4, 40], metavar=("LO", "HI"))
  ap.add_argument("--max-len", type=int, default=None, help="None: longest prompt + output")
  ap.add_argument("--prefill-rows", type=int, default=1, help="Engine: prompts per prefill call")
  ap.add_argument("--prefill-chunk", type=int, default=None,
                  help="prompt tokens per prefill step (None: a prompt in one step)")
  ap.add_argument("--warm", type=int, default=None,
                  help="requests in the untimed first pass of each mode (None: all)")
  ap.add_argument("--impl", default="reference", choices=["reference", "pallas"])
  ap.add_argument("--interpret", action="store_true")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results", "serving.jsonl"))
  args = ap.parse_args(argv)
  args.max_len = args.max_len or args.prompt_len[1] + args.output_len[1]
  model, tok, label = load(args)
  reqs = workload(args, model.config.vocab_size)
  n_prompt = sum(len(r.prompt_ids) for r in reqs)
  n_out = sum(r.max_tokens for r in reqs)
  device = f"{jax.devices()[0].device_kind} ({platform.processor() or platform.machine()})"
  warm = len(reqs) if args.warm is None else args.warm
  for fmt in args.formats:
    quant = QuantConfig(kv_format=fmt)
    tokens, eng = {}, None
    for mode in args.modes:
      if mode == "generator":
        wall, compile_s, tokens[mode], extra = run_generator(model, tok, quant, reqs, args)
      else:
        if eng is None:  # one Engine (one set of executables) for both policies
          eng = Engine(model, tok, quant, max_seqs=args.max_seqs, max_len=args.max_len,
                       prefill_rows=args.prefill_rows, prefill_chunk=args.prefill_chunk)
          eng.warmup([len(r.prompt_ids) for r in reqs])
          print(f"{fmt}: compiled {eng.stepper.num_executables} steps in "
                f"{eng.stats['compile_s']:.1f} s", flush=True)
        wall, compile_s, tokens[mode], extra = run_engine(eng, reqs, mode, warm)
      row = dict(date=time.strftime("%Y-%m-%d"), device=device, jax=jax.__version__, model=label,
                 impl=args.impl, kv_format=fmt, mode=mode, max_seqs=args.max_seqs,
                 prefill_rows=args.prefill_rows, prefill_chunk=args.prefill_chunk,
                 requests=len(reqs), prompt_len=f"{args.prompt_len[0]}-{args.prompt_len[1]}",
                 output_len=f"{args.output_len[0]}-{args.output_len[1]}",
                 prompt_tokens=n_prompt, output_tokens=n_out, wall_s=wall, compile_s=compile_s,
                 requests_per_s=len(reqs) / wall, output_tok_per_s=n_out / wall,
                 total_tok_per_s=(n_prompt + n_out) / wall,
                 load_avg_1min=os.getloadavg()[0],  # a shared machine: other work skews the wall
                 **extra)
      if mode != args.modes[0]:
        row["same_tokens"] = tokens[mode] == tokens[args.modes[0]]
      print(json.dumps(row), flush=True)
      os.makedirs(os.path.dirname(args.out), exist_ok=True)
      with open(args.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
      write_markdown(args.out)  # after every row: a run cut short by a time limit keeps its table
    del eng  # its cache, before the next format's


if __name__ == "__main__":
  main()
