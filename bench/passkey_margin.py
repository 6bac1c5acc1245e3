"""How close a passkey answer is to flipping: the probability of each answer token and of the best other
token, teacher-forced through each KV-cache format.

  python bench/passkey_margin.py --formats float32,hack-k32v64-vhad-w128-clip-s16 --length 2048 \
      --depths 0.1,0.5,0.9 --trials 4 --haystack pg --keys 37704 [--out bench/results/passkey_margin.jsonl]

The prompts are bench_passkey.py's (models/passkey.make_prompts, same seed, lengths, depths, trials and
haystack), restricted to the needles named by --keys (default: every needle). The forced tokens are the
first format's greedy answer up to the end of the key, or the key itself (" " + key) when that format
misses it. Each format scores them with models/eval.score_format (prefill, then the decode steps that
generation runs, each step's whole next-token distribution); a row per needle, format and answer token
gives p(token), the best other token and its probability, and the margin log p(token) - log p(other):
greedy decoding keeps the token while the margin is > 0. Answer token 0 is scored by the prefill's last
logits (exact 16-bit attention of the prompt in every format: `scored_by` "prefill"), the others by decode
steps over the cache.

Layer sensitivity (`--layer-scan SPEC`): the formats become float32, SPEC, and SPEC with each layer L in turn
held in bf16 (`SPEC+L:bf16`; layers SPEC's own per-layer rules set are skipped); at the end the layers are
ranked by how much of the answer's log-probability (its decode-scored tokens, summed over the needles) that
one exact layer gives back over SPEC. Calibrate on
needles the evaluation does not use (another --haystack and --seed): bench/NOTES_eval.md, session 20.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--formats", default="float32,hack-k32v64-vhad-w128-clip-s16")
  ap.add_argument("--length", type=int, default=2048)
  ap.add_argument("--depths", default="0.1,0.5,0.9")
  ap.add_argument("--trials", type=int, default=4)
  ap.add_argument("--haystack", default="pg")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--keys", default="", help="comma list of keys to score (default: all needles)")
  ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
  ap.add_argument("--out", default=None, help="append jsonl rows here")
  ap.add_argument("--layer-scan", default=None, metavar="SPEC",
                  help="rank the layers of SPEC's cache by what one bf16 layer gives back (replaces --formats)")
  args = ap.parse_args(argv)

  import jax.numpy as jnp
  from models import eval as ev
  from models import passkey
  from models.gguf_loader import load_checkpoint
  from models.llama import Llama

  ckpt = load_checkpoint(args.model, dtype=jnp.float32, scan_layers=True)
  model, tok = Llama.from_weights(ckpt.config, ckpt.weights), ckpt.tokenizer
  if args.layer_scan:
    scan = args.layer_scan.strip()
    base = ev.parse_format(scan)
    n = ckpt.config.num_layers
    # layers the SPEC's own rules already set are left as they are
    named = {i for i, c in enumerate(base.quant.configs(n)) if c != base.quant.base} if hasattr(base.quant, "configs") \
        else set()
    fmts = ev.parse_formats(",".join(["float32", scan] + [f"{scan}+{i}:bf16" for i in range(n) if i not in named]))
  else:
    fmts = ev.parse_formats(args.formats)
  for f in fmts:  # a per-layer format that does not fit this model fails now, not after the formats before it
    if hasattr(f.quant, "configs"):
      f.quant.configs(ckpt.config.num_layers)
  hay = tok.encode(ev.load_text(args.haystack)[1])
  prompts = passkey.make_prompts(tok, hay, length=args.length, depths=[float(d) for d in args.depths.split(",")],
                                 trials=args.trials, seed=args.seed)
  keys = set(args.keys.split(",")) - {""}
  unknown = keys - {p.key for p in prompts}
  if unknown:
    raise ValueError(f"--keys {sorted(unknown)} are not among this grid's keys {[p.key for p in prompts]}")
  prompts = [p for p in prompts if not keys or p.key in keys]

  # forced tokens: the first format's greedy answer through the key's last digit, else " " + key
  forced = []
  gen = ev.eval_generator(fmts[0], model, tok, max_seqs=1, max_len=max(len(p.ids) for p in prompts) + 16)
  for p in prompts:
    ids = gen.generate_ids([p.ids], 8, stop_on_eos=True).tokens[0]
    ok = passkey.answer_of(tok.decode(ids)) == p.key
    cut = next((i + 1 for i in range(len(ids)) if p.key in tok.decode(ids[:i + 1])), None)
    forced.append(list(ids[:cut]) if ok else tok.encode(" " + p.key, add_bos=False))

  rows = []
  groups = {}  # needles whose forced answers have the same length score in one batch
  for j, f in enumerate(forced):
    groups.setdefault(len(f), []).append(j)
  for fmt in fmts:
    logps = {}
    for js in groups.values():
      _, _, store, _ = ev.score_format(fmt, model, tok, [prompts[j].ids for j in js],
                                       np.asarray([forced[j] for j in js]), keep=True)
      logps.update({j: store.logp[w] for w, j in enumerate(js)})  # [len(forced[j]), V]
    first = len(rows)
    for j, (p, f) in enumerate(zip(prompts, forced)):
      logp = logps[j]
      for i, t in enumerate(f):
        lp = logp[i].astype(np.float64)
        other = int(np.argmax(np.where(np.arange(lp.size) == t, -np.inf, lp)))
        r = dict(format=fmt.name, model=os.path.basename(ckpt.path), haystack=args.haystack, seed=args.seed,
                 trials=args.trials, key=p.key, depth=p.depth, length=args.length, position=i,
                 scored_by="prefill" if i == 0 else "decode", token=tok.decode([t]), p=float(np.exp(lp[t])),
                 other=tok.decode([other]), p_other=float(np.exp(lp[other])), margin=float(lp[t] - lp[other]))
        rows.append(r)
        print(f"{fmt.name:36s} key {p.key} depth {p.depth:.1f} pos {i}: {r['token']!r:8s} p={r['p']:.3f}  "
              f"best other {r['other']!r:8s} p={r['p_other']:.3f}  margin {r['margin']:+.2f}", flush=True)
    if args.out:  # each format's rows as soon as they exist (a long scan that stops keeps what it did)
      with open(args.out, "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows[first:])
  if args.layer_scan:
    print_layer_ranking(rows, fmts[1].name)
  return 0


def print_layer_ranking(rows, base: str):
  """--layer-scan's table: per format, the decode-scored answer tokens' summed log p, its gain over `base`,
  and each needle's smallest margin; best first."""
  logp, worst = {}, {}
  for r in rows:
    if r["scored_by"] == "decode":
      logp[r["format"]] = logp.get(r["format"], 0.0) + float(np.log(r["p"]))
      w = worst.setdefault(r["format"], {})
      w[r["key"]] = min(w.get(r["key"], np.inf), r["margin"])
  print(f"\nlayer scan over {base} (sum of log p of the decode-scored answer tokens; gain over {base}):")
  for name in sorted(logp, key=logp.get, reverse=True):
    margins = " ".join(f"{k}:{m:+.2f}" for k, m in worst[name].items())
    print(f"  {name:60s} {logp[name]:8.2f}  gain {logp[name] - logp[base]:+6.2f}  smallest margins {margins}")


if __name__ == "__main__":
  sys.exit(main())
