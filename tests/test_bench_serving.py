"""Smoke test of bench/bench_serving.py on the toy model: every mode runs, rows and the Markdown
table are written, and continuous batching, fixed batches on the same Engine and the Generator
produce the same greedy tokens."""

import importlib.util
import json
import os

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench", "bench_serving.py")


def test_bench_serving_toy(tmp_path):
  spec = importlib.util.spec_from_file_location("bench_serving", BENCH)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = tmp_path / "serving.jsonl"
  bench.main(["--model", "toy", "--requests", "5", "--max-seqs", "2", "--prompt-len", "8", "30",
              "--output-len", "2", "12", "--formats", "bf16", "--modes", "continuous", "fixed", "generator",
              "--out", str(out)])
  rows = [json.loads(x) for x in out.read_text().splitlines()]
  assert [r["mode"] for r in rows] == ["continuous", "fixed", "generator"]
  assert rows[1]["same_tokens"] is True and rows[2]["same_tokens"] is True
  assert rows[0]["output_tokens"] == rows[1]["output_tokens"] and rows[0]["requests"] == 5
  assert rows[0]["decode_steps"] + rows[0]["prefill_calls"] >= 12  # the longest request's steps
  md = (tmp_path / "serving.md").read_text()
  assert md.count("| toy (random bf16 weights) | bf16 | 2 | - | 5 |") == 3
