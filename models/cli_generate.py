"""`hack-jax generate`: prompts -> the continuous-batching Engine (models/engine.py) -> text.

Output: the text on stdout, streamed token by token (several sequences are printed one after
another, each as soon as the ones before it are done; `--no-stream` prints them at the end);
`--json` prints one JSON object instead (completions with text, token ids, finish reason, optional
log-probs; timings; KV cache size). Stages on stderr (unless --quiet): model load, each compile,
the first prefill, then a decode bar (`--no-stream`) that closes at the real end; the rates
exclude compilation, which is compiled ahead of time and reported on its own.

Errors in user terms (the flag and its value) are raised as ValueError before the model loads
where they can be (empty prompt, unreadable prompt file, bad sampling values, a --model that is
not a GGUF file); cli.main prints them as `hack-jax generate: error: ...` (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from hack_jax import kv_cache
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import mixed
from hack_jax.layer_formats import LayerFormats, keep_layers, with_layer_formats

GGUF_MAGIC = b"GGUF"


def add_arguments(g: argparse.ArgumentParser) -> None:
  """The generate flags beyond the model/cache ones (cli._parser adds those)."""
  g.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
  g.add_argument("--prompt-file", action="append", metavar="PATH",
                 help="read a prompt from a UTF-8 file ('-' = stdin); repeatable")
  g.add_argument("--system", default=None, help="system message for the chat template "
                 "(None: the template's own)")
  g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sequence")
  g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  g.add_argument("--top-k", type=int, default=0, help="0 = off")
  g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  g.add_argument("--seed", type=int, default=0, help="sample j of prompt i uses seed + j")
  g.add_argument("-n", "--num-samples", type=int, default=1,
                 help="completions per prompt (identical under greedy decoding)")
  g.add_argument("--stop", action="append", metavar="TEXT",
                 help="stop when the text contains TEXT (not printed); repeatable")
  g.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-text token")
  g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  g.add_argument("--max-cache-len", type=int, default=None,
                 help="tokens per sequence the cache holds (None: longest prompt + new tokens)")
  g.add_argument("--max-seqs", type=int, default=None,
                 help="sequences decoded together (None: all of them, at most 16)")
  g.add_argument("--prefill-chunk", type=int, default=None,
                 help="prefill at most this many prompt tokens per step, interleaved with the "
                 "decode steps (None: a prompt in one step, padded to its length bucket)")
  g.add_argument("--no-stream", action="store_true", help="print the texts at the end")
  g.add_argument("--json", action="store_true", help="print one JSON object (no streaming)")
  g.add_argument("--logprobs", action="store_true",
                 help="with --json: the log-probability of every generated token")
  g.add_argument("--quiet", action="store_true", help="no progress or statistics, text only")


def check_args(args) -> None:
  """ValueError naming the flag and value for settings that can be judged before loading."""
  checks = [("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
            ("--temperature", args.temperature,
             math.isfinite(args.temperature) and args.temperature >= 0, ">= 0 (0 = greedy)"),
            ("--top-k", args.top_k, args.top_k >= 0, ">= 0 (0 = off)"),
            ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1] (1 = off)"),
            ("-n", args.num_samples, args.num_samples >= 1, ">= 1"),
            ("--max-cache-len", args.max_cache_len,
             args.max_cache_len is None or args.max_cache_len >= 2, ">= 2"),
            ("--max-seqs", args.max_seqs, args.max_seqs is None or args.max_seqs >= 1, ">= 1"),
            ("--prefill-chunk", args.prefill_chunk,
             args.prefill_chunk is None or args.prefill_chunk >= 1, ">= 1")]
  for flag, value, ok, rule in checks:
    if not ok:
      raise ValueError(f"{flag} must be {rule}, got {value}")
  if args.logprobs and not args.json:
    raise ValueError("--logprobs needs --json")
  if args.system is not None and args.no_chat:
    raise ValueError("--system needs the chat template: drop --no-chat")
  if any(not s for s in args.stop or ()):
    raise ValueError("--stop must not be empty")


def check_model_path(path) -> None:
  """ValueError naming the file when --model is a file that is not GGUF (a directory is left to
  the loader)."""
  if path is None or not os.path.isfile(path):
    return
  with open(path, "rb") as f:
    head = f.read(4)
  if head != GGUF_MAGIC:
    raise ValueError(f"--model {path}: not a GGUF file (starts with {head!r}, expected "
                     f"{GGUF_MAGIC!r})")


def read_prompts(args) -> list[str]:
  """--prompt values then --prompt-file contents, in that order; ValueError for none, an empty
  one (naming it) or a file that cannot be read."""
  prompts = [(f"--prompt {p!r}", p) for p in args.prompt or ()]
  for path in args.prompt_file or ():
    try:
      if path == "-":
        text = sys.stdin.read()
      else:
        with open(path, encoding="utf-8") as f:
          text = f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise ValueError(f"--prompt-file {path}: {e}") from None
    prompts.append((f"--prompt-file {path}", text))
  if not prompts:
    raise ValueError("no prompt: give --prompt TEXT or --prompt-file PATH ('-' = stdin)")
  for where, text in prompts:
    if not text.strip():
      raise ValueError(f"empty prompt: {where}")
  return [text for _, text in prompts]


def quant_config(args) -> QuantConfig | LayerFormats:
  """QuantConfig from --kv-format and the cache flags (page_size 256, or 4 partitions or the
  --window if more); with --layer-formats / --keep-layers, the LayerFormats over it. ValueError
  naming a bad flag."""
  p = args.partition_size
  no_sums = getattr(args, "no_code_sums", False)
  if no_sums and (args.kv_format, args.layout) != ("hack", "kivi"):
    raise ValueError(f"--no-code-sums applies to --kv-format hack --layout kivi only (the other formats store no "
                     f"code sums; the seed layout keeps its own), got --kv-format {args.kv_format} --layout "
                     f"{args.layout}")
  quant = QuantConfig(kv_format=args.kv_format, partition_size=p, page_size=max(256, 4 * p, args.window),
                      window=args.window,
                      num_sink_tokens=args.num_sink_tokens, rounding=args.rounding,
                      layout=args.layout, v_rotation=args.v_rotation, v_group=args.v_group,
                      rotation=getattr(args, "rotation", 0), bits=getattr(args, "bits", 2),
                      clip=getattr(args, "clip", 0), code_sums=not no_sums)
  spec, keep = getattr(args, "layer_formats", None), getattr(args, "keep_layers", None)
  if spec is not None and keep is not None:
    raise ValueError(f"give --layer-formats or --keep-layers, not both: {spec=} {keep=}")
  try:
    if keep is not None:
      return keep_layers(keep, quant)
    return with_layer_formats(quant, spec)
  except ValueError as e:
    raise ValueError(f"--{'keep-layers' if keep is not None else 'layer-formats'}: {e}") from None


def array_bits_line(stepper) -> str:
  """One line: bits per K/V element of the cache a Stepper allocates, read from its arrays."""
  import jax
  bits = mixed.array_bits(jax.eval_shape(stepper.new_cache))
  formats = ", ".join(f"{n} x {f} {b:.2f}" for (f, b), n in _runs(bits["per_layer"]))
  return (f"cache arrays: {bits['page_bits_per_element']:.3f} bits per K/V element in pages "
          f"({formats}), {bits['bits_per_element']:.3f} for the whole allocation "
          f"({bits['total_bytes']:,} B: every slot at capacity, open blocks and sinks included)")


def _runs(items):
  """[(item, count)] of consecutive equal items."""
  out = []
  for x in items:
    if out and out[-1][0] == x:
      out[-1][1] += 1
    else:
      out.append([x, 1])
  return [tuple(r) for r in out]


def encode(tokenizer, prompt: str, *, system: str | None, chat: bool) -> list[int]:
  """Prompt -> ids; through the chat template (with the system message) unless chat is False."""
  if chat and (tokenizer.chat_template is not None or system is not None):
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    prompt = tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}])
  return tokenizer.encode(prompt)


class _Printer:
  """Prints sequences in order, each streamed as soon as all before it are done."""

  def __init__(self, rids, headers, live):
    self.order, self.headers, self.live = rids, dict(zip(rids, headers)), live
    self.parts = {rid: [] for rid in rids}
    self.done, self.next, self.started = set(), 0, False

  def add(self, ev):
    self.parts[ev.request_id].append(ev.text)
    if ev.finished:
      self.done.add(ev.request_id)
    if self.live:
      self._flush()

  def _flush(self):
    while self.next < len(self.order):
      rid = self.order[self.next]
      if not self.started and self.headers[rid] is not None:
        print(self.headers[rid], flush=True)
      self.started = True
      print("".join(self.parts[rid]), end="", flush=True)
      self.parts[rid] = []
      if rid not in self.done:
        return
      print("\n", flush=True)
      self.next, self.started = self.next + 1, False

  def close(self):
    self.live = True
    self._flush()


def run(args, load) -> int:
  """The generate command; load(args) -> (checkpoint, model). Returns the exit status."""
  check_args(args)
  prompts = read_prompts(args)
  say = (lambda *a, **k: None) if args.quiet else (
      lambda *a, **k: print(*a, file=sys.stderr, flush=True, **k))
  quant = quant_config(args)
  from models.engine import Engine, Request
  from models.generate import Sampling
  sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)

  t0 = time.perf_counter()
  say("loading model ...", end=" ")
  ckpt, model = load(args)
  c = ckpt.config
  say(f"{os.path.basename(ckpt.path)}: {c.architecture}, {c.num_layers} layers, "
      f"{time.perf_counter() - t0:.1f} s")
  ids = [encode(ckpt.tokenizer, p, system=args.system, chat=not args.no_chat) for p in prompts]
  need = max(len(p) for p in ids) + args.max_new_tokens
  limit, what = ((args.max_cache_len, "--max-cache-len") if args.max_cache_len is not None
                 else (c.max_seq_len, "the model's context length"))
  for i, p in enumerate(ids):
    if len(p) + args.max_new_tokens > limit:
      raise ValueError(f"prompt {i + 1} has {len(p)} tokens; with --max-new-tokens "
                       f"{args.max_new_tokens} it needs {len(p) + args.max_new_tokens} > {what} "
                       f"{limit}")
  if args.max_cache_len is None and c.max_seq_len < 2:
    raise ValueError(f"the model's context length {c.max_seq_len} is below 2 tokens")
  jobs = [(i, j) for i in range(len(prompts)) for j in range(args.num_samples)]
  max_seqs = args.max_seqs or min(len(jobs), 16)
  engine = Engine(model, ckpt.tokenizer, quant, max_seqs=max_seqs,
                  max_len=args.max_cache_len or min(need, c.max_seq_len),
                  prefill_chunk=args.prefill_chunk, on_stage=_stage_printer(say))
  requests = [Request(ids[i], max_tokens=args.max_new_tokens, sampling=sampling,
                      stop=args.stop or (), ignore_eos=args.ignore_eos, seed=args.seed + j)
              for i, j in jobs]
  engine.warmup([len(p) for p in ids], greedy=args.temperature == 0)

  stream = not (args.no_stream or args.json)
  many = len(jobs) > 1 or not stream
  headers = [(f"### {prompts[i]}" + (f" [sample {j + 1}]" if args.num_samples > 1 else ""))
             if many else None for i, j in jobs]
  rids = [engine.submit(r) for r in requests]
  printer = _Printer(rids, headers, live=stream)
  bar = None
  events = {rid: [] for rid in rids}
  t_run = time.perf_counter()
  for ev in engine.stream():
    events[ev.request_id].append(ev)
    if not args.json:
      printer.add(ev)
    if bar is None and not stream and not args.quiet:
      from tqdm import tqdm
      bar = tqdm(total=len(jobs) * args.max_new_tokens, file=sys.stderr, desc="generating",
                 unit="tok")
    if bar is not None and ev.token_id is not None:
      bar.update(1)
  wall = time.perf_counter() - t_run
  if bar is not None:
    bar.total = bar.n  # sequences that stopped early: the bar ends where generation ended
    bar.refresh()
    bar.close()
  comps = [engine.completion(rid, r, events[rid]) for rid, r in zip(rids, requests)]
  stats = _stats(engine, comps, wall, t_run)
  if args.json:
    out = dict(model=ckpt.path, kv_format=args.kv_format, completions=[
        dict(prompt_index=i, sample=j, prompt=prompts[i], prompt_tokens=len(ids[i]),
             text=comp.text, token_ids=comp.tokens, finish_reason=comp.finish_reason,
             **(dict(logprobs=comp.logprobs) if args.logprobs else {}))
        for (i, j), comp in zip(jobs, comps)], timings=stats,
        kv_cache=_cache_report(quant, c, max(len(p) for p in ids) + max(
            len(x.tokens) for x in comps), max_seqs))
    print(json.dumps(out, ensure_ascii=False))
    return 0
  printer.close()
  if not args.quiet:
    print(f"prefill: {stats['prompt_tokens']} tokens, {stats['prefill_tok_s']:.1f} tok/s | "
          f"decode: {stats['decode_tokens']} tokens, {stats['decode_tok_s']:.1f} tok/s | first "
          f"token {stats['first_token_s']:.2f} s | compile {stats['compile_s']:.1f} s "
          "(not counted)")
    rep = _cache_report(quant, c, max(len(p) for p in ids) + max(len(x.tokens) for x in comps),
                        max_seqs)
    print(f"KV cache ({quant if isinstance(quant, LayerFormats) else args.kv_format}): "
          f"{rep['bytes_per_token']:,.0f} B/token "
          f"({rep['bits_per_element']:.3f} bits/element in pages) = "
          f"{rep['vs_bf16']:.3f} x bf16 in full pages; this run allocates {rep['total']:,} B vs "
          f"{rep['total_bf16']:,} B for bf16 ({rep['allocated_bits_per_element']:.3f} bits per held K/V "
          f"element: whole pages, open blocks and sinks over the tokens held)")
    print(array_bits_line(engine.stepper))
  return 0


def _stage_printer(say):
  def on_stage(stage, info):
    if stage == "compiling":
      say(f"compiling {info['what']} ...", end=" ")
    elif stage == "compiled":
      say(f"{info['seconds']:.1f} s")
    elif stage == "prefilling" and not on_stage.prefilled:
      say(f"prefill: {info['requests']} sequence(s), {info['tokens']:,} tokens ...", end=" ")
    elif stage == "prefilled" and not on_stage.prefilled:
      on_stage.prefilled = True
      say(f"{info['seconds']:.2f} s ({info['tokens'] / max(info['seconds'], 1e-9):.1f} tok/s)")
  on_stage.prefilled = False  # later admissions go into the final statistics only
  return on_stage


def _stats(engine, comps, wall, t_run) -> dict:
  st = dict(engine.stats)
  st["prefill_tok_s"] = st["prompt_tokens"] / max(st["prefill_s"], 1e-9)
  st["decode_tok_s"] = st["decode_tokens"] / max(st["decode_s"], 1e-9)
  st["wall_s"] = wall
  first = [x.times["first_token"] for x in comps if "first_token" in x.times]
  st["first_token_s"] = (min(first) - t_run) if first else float("nan")
  st["generated_tokens"] = sum(len(x.tokens) for x in comps)
  return st


def _cache_report(quant, c, seq_len, max_seqs) -> dict:
  bf16 = QuantConfig(kv_format="bf16")
  shape = dict(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
               seq_len=seq_len, max_seqs=max_seqs)
  per_tok = kv_cache.bytes_per_token(quant, c.num_kv_heads, c.head_dim, c.num_layers)
  full = kv_cache.cache_bytes_report(quant, **shape)
  return dict(bytes_per_token=per_tok, bits_per_element=full["page_bits_per_element"],
              allocated_bits_per_element=full["bits_per_element"],
              vs_bf16=per_tok / kv_cache.bytes_per_token(bf16, c.num_kv_heads, c.head_dim,
                                                         c.num_layers),
              total=full["total"],
              total_bf16=kv_cache.cache_bytes_report(bf16, **shape)["total"])
