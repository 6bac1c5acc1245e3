"""Accuracy of KV-cache formats on a real model and real text (teacher-forced decode through the cache).

  python bench/bench_accuracy.py [--formats all|variants|f1,f2] [--contexts 512,2048] [--tokens 64]
      [--windows 2] [--text sotu2026,austen:<book>,FILE] [--model GGUF|qwen2.5-coder-0.5b]
      [--out bench/results/accuracy.jsonl]

Appends one jsonl row per (format, context, text) to --out and regenerates the Markdown tables (.md
beside it) and bench/results/accuracy_gap.png. The harness lives in models/eval.py (also
`hack-jax eval`); see its docstring for the formats and the evaluation-only paths (kivi2, fake-*,
Hadamard rotations of K or V).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.eval import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main())
