"""Passkey retrieval through each KV-cache format (greedy decode, exact match).

  python bench/bench_passkey.py [--formats float32,int8,kivi2,hack-p64] [--lengths 1024,2048,4096]
      [--depths 0.1,0.5,0.9] [--trials 3] [--haystack austen:emma] [--out bench/results/passkey.jsonl]

Appends one jsonl row per trial to --out and regenerates the Markdown table beside it. The harness
lives in models/passkey.py (also `hack-jax passkey`); see its docstring for the prompt.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.passkey import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main())
