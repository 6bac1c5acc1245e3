"""models/disagg.py: a prefill worker and a decode worker in two spawned processes, the test sitting
on the socket between them. Greedy tokens and log-probs equal a single-process Engine's for hack,
int8 and bf16 caches; the decode worker imports at pages other than the prefill worker's; damaged,
truncated and mismatched payloads are answered with an error and the worker keeps serving.

A tiny random Llama (tests/tiny_llama.py's shape and seed, rebuilt in each worker) with the real
SmolLM2 tokenizer; loopback only.
"""

import os
from multiprocessing.connection import Client, Listener

import numpy as np
import pytest

import tiny_llama
from hack_jax.config import QuantConfig
from models.disagg import HOST, WorkerSpec, accept, start_worker
from models.engine import Engine, Request
from models.gguf_loader import default_model_path

QUANT = QuantConfig(partition_size=16, page_size=64)
MAX_SEQS, MAX_LEN = 3, 128
FORMATS = ("hack", "int8", "bf16")
# (prompt tokens, max_tokens), one length bucket (64): A runs long so that B and C are adopted
# while it decodes (their pages follow A's there, while the prefill worker frees each one's);
# A crosses a page (4 sinks + 64) and seals blocks of 16.
SHAPES = {"A": (60, 40), "B": (5, 12), "C": (30, 9)}


@pytest.fixture(scope="module")
def requests():
  tok = tiny_llama.tokenizer()
  rng = np.random.default_rng(1)
  return {k: Request(rng.integers(0, tok.vocab_size, n).tolist(), max_tokens=m, ignore_eos=True)
          for k, (n, m) in SHAPES.items()}


@pytest.fixture(scope="module")
def workers():
  """(requests conn, payload-in conn from the prefill worker, payload-out conn to the decode
  worker, results conn) of two live workers."""
  authkey = os.urandom(16)
  spec = WorkerSpec(random=tiny_llama.checkpoint_and_model()[0].config, tokenizer=default_model_path(),
                    quant=QUANT, max_seqs=MAX_SEQS, max_len=MAX_LEN)
  with Listener((HOST, 0), authkey=authkey) as out_l, Listener((HOST, 0), authkey=authkey) as mid_l:
    decode, decode_address = start_worker("decode", spec, out_l.address, authkey)
    results = accept(out_l, decode)
    prefill, prefill_address = start_worker("prefill", spec, mid_l.address, authkey)
    mid_in = accept(mid_l, prefill)
    mid_out = Client(decode_address, authkey=authkey)
    req = Client(prefill_address, authkey=authkey)
    yield req, mid_in, mid_out, results
    req.send(("stop",))
    msg = mid_in.recv()
    mid_out.send(msg)
    assert msg == ("stop",) and results.poll(60) and results.recv() == ("stop",)
    for p in (prefill, decode):
      p.join(30)
      assert p.exitcode == 0


def _recv(conn, timeout=300):
  assert conn.poll(timeout), "no message from the worker"
  return conn.recv()


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_worker_continues_like_one_process(fmt, workers, requests):
  req, mid_in, mid_out, results = workers
  handoffs = {}
  for name, r in requests.items():
    req.send(("request", name, fmt, r))
    msg = _recv(mid_in)
    assert msg[:2] == ("handoff", name), msg
    handoffs[name] = (msg, mid_in.recv_bytes())

  def forward(name, payload=None, kv_format=fmt):
    msg, good = handoffs[name]
    mid_out.send(msg[:2] + (kv_format,) + msg[3:])
    mid_out.send_bytes(good if payload is None else payload)

  forward("A")
  forward("B")
  good = handoffs["C"][1]
  flipped = bytearray(good)
  flipped[len(good) // 2] ^= 0x10
  other = "int8" if fmt != "int8" else "bf16"
  bad = {"SHA-256 digest": bytes(flipped), "truncated": good[:-7], "not a hack-jax": b"x" * 64}
  for payload in bad.values():
    forward("C", payload)
  forward("C", kv_format=other)  # a payload of another cache format
  forward("C")
  got, errors = {}, []
  while len(got) < 3:
    msg = _recv(results)
    if msg[0] == "error":
      errors.append(msg[2])
    else:
      assert msg[0] == "result" and msg[2] in (fmt, other), msg
      got[msg[1]] = msg[3]
  assert len(errors) == 4
  for want, message in zip([*bad, "does not match the receiving cache: config"], errors):
    assert want in message, (want, message)

  model, tok = tiny_llama.checkpoint_and_model()[1], tiny_llama.tokenizer()
  alone = Engine(model, tok, QuantConfig(kv_format=fmt, partition_size=16, page_size=64),
                 max_seqs=MAX_SEQS, max_len=MAX_LEN)
  for name, r in requests.items():
    ref = alone.generate([r])[0]
    out = got[name]
    assert out["tokens"] == ref.tokens and out["text"] == ref.text and out["finish_reason"] == "length"
    assert out["logprobs"] == ref.logprobs  # bit-identical floats, not close
    info = out["info"]
    assert info["payload_bytes"] == len(handoffs[name][1])
    if name != "A":  # adopted while A decodes: other page ids than the prefill worker's
      assert info["decode_pages"] != info["prefill_pages"], info
      assert not set(info["decode_pages"]) & set(got["A"]["info"]["decode_pages"])
