"""Tests of `hack-jax generate` (models/cli.py, models/cli_generate.py): error paths before any
model loads (fast), --help / --version, prompt sources, the ordered streaming printer, the chat
prompt with --system, and one run end to end on a tiny random model (--json, -n, --stop)."""

import io
import json
import sys

import pytest

import tiny_llama
from models import cli, cli_generate
from models.engine import Event


def _error(capsys, argv):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  assert exit_info.value.code == 2
  return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,message", [
    (["--prompt", " "], "empty prompt: --prompt ' '"),
    ([], "no prompt: give --prompt TEXT or --prompt-file PATH"),
    (["--prompt", "hi", "--temperature", "-1"], "--temperature must be >= 0 (0 = greedy), got -1.0"),
    (["--prompt", "hi", "--temperature", "nan"], "--temperature must be >= 0 (0 = greedy), got nan"),
    (["--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1] (1 = off), got 0.0"),
    (["--prompt", "hi", "--top-k", "-2"], "--top-k must be >= 0 (0 = off), got -2"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--prompt", "hi", "-n", "0"], "-n must be >= 1, got 0"),
    (["--prompt", "hi", "--max-cache-len", "1"], "--max-cache-len must be >= 2, got 1"),
    (["--prompt", "hi", "--logprobs"], "--logprobs needs --json"),
    (["--prompt", "hi", "--system", "be brief", "--no-chat"], "--system needs the chat template"),
    (["--prompt", "hi", "--stop", ""], "--stop must not be empty"),
    (["--prompt-file", "/nonexistent/p.txt"], "--prompt-file /nonexistent/p.txt: [Errno 2]"),
])
def test_errors_name_the_subcommand_and_value(capsys, argv, message):
  line = _error(capsys, ["generate", *argv])
  assert line.startswith("hack-jax generate: error: ") and message in line, line


def test_serve_errors_before_loading(capsys):
  assert _error(capsys, ["serve", "--max-seqs", "0"]) == (
      "hack-jax serve: error: --max-seqs out of range: 0")
  assert _error(capsys, ["serve", "--port", "70000"]).endswith("--port out of range: 70000")


def test_non_gguf_model_and_bad_cache_option(capsys, tmp_path):
  bogus = tmp_path / "model.safetensors"
  bogus.write_bytes(b"\x08\x00\x00\x00{}")
  line = _error(capsys, ["generate", "--prompt", "hi", "--model", str(bogus)])
  assert f"--model {bogus}: not a GGUF file" in line
  line = _error(capsys, ["perplexity", "--text", str(bogus), "--model", str(bogus)])
  assert line.startswith("hack-jax perplexity: error: --model")
  line = _error(capsys, ["generate", "--prompt", "hi", "--kv-format", "fp4"])
  assert line.startswith("hack-jax generate: error: argument --kv-format")
  line = _error(capsys, ["generate", "--prompt", "hi", "--v-group", "48"])
  assert line.startswith("hack-jax generate: error: ") and "v_group=48" in line, line
  line = _error(capsys, ["generate", "--prompt", "hi", "--v-rotation", "48"])
  assert line.startswith("hack-jax generate: error: ") and "v_rotation=48" in line, line
  line = _error(capsys, ["generate", "--prompt", "hi", "--clip", "9"])
  assert line.startswith("hack-jax generate: error: ") and "clip=9" in line, line


def test_help_shows_defaults_and_version(capsys):
  with pytest.raises(SystemExit):
    cli.main(["generate", "--help"])
  out = " ".join(capsys.readouterr().out.split())
  for text in ("--max-new-tokens MAX_NEW_TOKENS tokens to generate per sequence (default: 64)",
               "--kv-format {hack,bf16,float32,int8,fp8,kivi2,int4,turbo3,turbo4}", "(default: hack)", "--no-stream",
               "--partition-size", "(default: 64)"):
    assert text in out, text
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--version"])
  assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("hack-jax ")


def test_prompts_from_flags_files_and_stdin(tmp_path, monkeypatch):
  f = tmp_path / "p.txt"
  f.write_text("from a file\nline two\n", encoding="utf-8")
  monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
  args = cli._parser().parse_args(["generate", "--prompt", "a", "--prompt-file", str(f),
                                   "--prompt-file", "-"])
  assert cli_generate.read_prompts(args) == ["a", "from a file\nline two\n", "from stdin"]


def test_system_message_in_chat_prompt():
  tok = tiny_llama.tokenizer()
  ids = cli_generate.encode(tok, "hi", system="Be brief.", chat=True)
  assert tok.decode(ids, skip_special_tokens=False) == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
      "<|im_start|>assistant\n")
  assert cli_generate.encode(tok, "hi", system=None, chat=False) == tok.encode("hi")


def test_printer_streams_sequences_in_order(capsys):
  p = cli_generate._Printer([0, 1], ["### a", "### b"], live=True)
  p.add(Event(1, 5, "B1", False))  # sequence 1 is held until 0 is done
  assert capsys.readouterr().out == "### a\n"
  p.add(Event(0, 5, "A1", False))
  p.add(Event(0, None, "A2", True, "stop"))
  p.add(Event(1, 6, "B2", True, "length"))
  p.close()
  assert capsys.readouterr().out == "A1A2\n\n### b\nB1B2\n\n"


def test_generate_json_end_to_end_on_tiny_model(capsys, monkeypatch):
  ckpt, model = tiny_llama.checkpoint_and_model()
  args = cli._parser().parse_args([
      "generate", "--prompt", "hello there", "--prompt", "2+2=", "-n", "2", "--temperature",
      "0.8", "--max-new-tokens", "6", "--json", "--logprobs", "--quiet", "--kv-format", "bf16",
      "--stop", "\x00none", "--ignore-eos", "--seed", "3"])
  assert cli_generate.run(args, lambda a: (ckpt, model)) == 0
  captured = capsys.readouterr()
  out = json.loads(captured.out)
  assert captured.err == ""  # --quiet
  comps = out["completions"]
  assert [(c["prompt_index"], c["sample"]) for c in comps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  tok = ckpt.tokenizer
  for c in comps:
    assert c["finish_reason"] == "length" and len(c["token_ids"]) == 6 == len(c["logprobs"])
    assert c["text"] == tok.decode(c["token_ids"]) and all(lp <= 0 for lp in c["logprobs"])
  assert comps[0]["token_ids"] != comps[1]["token_ids"]  # samples of one prompt: seeds 3 and 4
  t = out["timings"]
  assert t["prompt_tokens"] == sum(c["prompt_tokens"] for c in comps)
  assert t["generated_tokens"] == 24 and t["compile_s"] > 0 and t["decode_tok_s"] > 0


def test_perplexity_of_an_empty_or_one_token_text(capsys, tmp_path, monkeypatch):
  """issue 17 unclear errors: an empty or one-word --text gave 'need max_seqs >= 1 and max_len >= 2:
  max_seqs=1 max_len=0' from the Generator."""
  empty = tmp_path / "empty.txt"
  empty.write_text("  \n", encoding="utf-8")
  line = _error(capsys, ["perplexity", "--text", str(empty)])
  assert line.startswith("hack-jax perplexity: error: --text") and "is empty" in line, line
  one = tmp_path / "one.txt"
  one.write_text("Hello", encoding="utf-8")
  monkeypatch.setattr(cli, "_load", lambda args: tiny_llama.checkpoint_and_model())
  line = _error(capsys, ["perplexity", "--text", str(one)])
  assert "holds 1 token(s): perplexity needs at least 2" in line, line


def test_rotation_flag_reaches_the_config(capsys):
  from models.cli import _parser
  from models.cli_generate import quant_config
  args = _parser().parse_args(["generate", "--prompt", "hi", "--kv-format", "turbo3", "--rotation", "32"])
  assert quant_config(args).rotation == 32 and quant_config(args).kv_format == "turbo3"
  line = _error(capsys, ["generate", "--prompt", "hi", "--kv-format", "int8", "--rotation", "32"])
  assert line.startswith("hack-jax generate: error: ") and "rotation=32" in line, line
