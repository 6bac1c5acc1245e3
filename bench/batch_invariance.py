"""Does a sequence's cache (and its forced log-probs) depend on its batch mates? (issue 17.3)

SmolLM2-135M, float32 weights, a 70-token prompt A decoded 4 forced steps alone (max_seqs 1) and
beside a 150-token prompt (max_seqs 2), for the hack and float32 caches: prints the largest
log-prob difference of A and, per cache array, whether A's bytes (its pages, its open block and
sinks) are identical; then the CPU matmul's own batch dependence. ~3 min on 2 CPU cores.

  PYTHONPATH=. python bench/batch_invariance.py
"""

import dataclasses

import jax
import numpy as np

from hack_jax.config import QuantConfig
from models.generate import Generator
from models.gguf_loader import load_checkpoint
from models.llama import Llama


def main():
  ckpt = load_checkpoint(None)
  model = Llama.from_weights(ckpt.config, ckpt.weights)
  rng = np.random.default_rng(0)
  a, b = rng.integers(0, 40000, 70).tolist(), rng.integers(0, 40000, 150).tolist()
  forced = rng.integers(0, 40000, (1, 4))
  for fmt in ("hack", "float32"):
    runs = []
    for max_seqs, prompts in ((1, [a]), (2, [a, b])):
      gen = Generator(model, ckpt.tokenizer, QuantConfig(kv_format=fmt), max_seqs=max_seqs, max_len=300)
      last, run = {}, gen._run

      def spy(fn, args, stats, **kw):  # keeps the cache and page table of the latest step
        out = run(fn, args, stats, **kw)
        last.update(cache=out[0], table=np.asarray(args[2].page_indices))
        return out

      gen._run = spy
      res = gen.generate_ids(prompts, 4, forced=np.concatenate([forced] * len(prompts)))
      runs.append((np.array(res.forced_logprobs[0]), jax.tree.map(np.asarray, last["cache"].layers),
                   last["table"][0, 0]))
    (lp1, l1, p1), (lp2, l2, p2) = runs
    print(f"{fmt}: max |delta log p| of A = {np.abs(lp1 - lp2).max():.3g}")
    for f in dataclasses.fields(l1):
      if f.name == "config":
        continue
      x, y = getattr(l1, f.name), getattr(l2, f.name)
      x, y = (x[:, 0], y[:, 0]) if f.name.startswith(("open", "sink")) else (x[:, p1], y[:, p2])
      same = np.array_equal(x, y)
      print(f"  {f.name:8s} " + ("identical" if same else f"differ in {np.mean(x != y):.2%} of elements, "
                                 f"max {np.abs(x.astype(np.float64) - y.astype(np.float64)).max():.3g}"))
  x = rng.standard_normal((2, 576)).astype(np.float32)
  w = (rng.standard_normal((576, 192)) * 0.05).astype(np.float32)
  f = jax.jit(lambda u: u @ w)
  one, two = np.asarray(f(x[:1]))[0], np.asarray(f(x))[0]
  print(f"matmul x[:1] @ w vs (x @ w)[0]: {np.mean(one != two):.0%} of outputs differ, "
        f"max {np.abs(one - two).max():.3g}")


if __name__ == "__main__":
  main()
