"""Disaggregated serving on one machine: a prefill worker and a decode worker in two processes,
one sequence's KV cache handed from the first to the second as a hack_jax.handoff payload.

  router --request--> prefill worker --hand-off--> decode worker --result--> router

Each worker is a spawned process holding the model and one models.engine.Engine per cache format
(made on first use). It listens on 127.0.0.1 (multiprocessing.connection, with an authkey) for one
upstream connection and connects to one downstream address, so the chain is configurable: a test
can sit between the two workers and damage a payload on its way.
  prefill: Engine.submit + one step (the prompt prefilled, the first token sampled), then
           Engine.hand_off (payload of the prompt's cache; its pages freed here) -> downstream.
           A request that ends at its first token (a stop id, max_tokens 1) goes down as a result.
  decode:  Engine.adopt (the payload imported at pages its own allocator assigns), then
           continuous batching: hand-offs that arrive are adopted between decode steps.
           A payload it cannot take (damaged, truncated, other format / shapes / version) is
           answered with an "error" message; its cache is untouched and it keeps serving.
With greedy sampling the tokens and log-probs equal a single-process Engine of the same
max_seqs / max_len (tests/test_disagg.py), for rounding="nearest"; stochastic rounding draws
per engine step, so there it is not bit-identical.

Messages (pickled tuples; the payload follows its "handoff" tuple as one bytes message,
hack_jax.handoff.send_payload / recv_payload: Connection.send_bytes' framing without its copies):
  ("request", rid, kv_format, Request)
  ("handoff", rid, kv_format, Request, first_token, first_logprob, info)  + payload
  ("result",  rid, kv_format, result)   result: tokens, logprobs, text, finish_reason, info
  ("error",   rid, message)             ("stop",) ends each worker in turn (after its work)
info: time.monotonic() stamps (one clock for the processes of a machine) and sizes: prefill_start,
prefilled, exported, received, imported, finished; payload_bytes, prefill_pages,
decode_pages (live page ids on each side), compile_s, device.

  python -m models.disagg --prompt "Tell me about the sea." [--kv-format hack] [--check]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import sys
import threading
import time
from multiprocessing.connection import Client, Listener
from typing import Any

from hack_jax import handoff
from hack_jax.config import QuantConfig
from models.config import ModelConfig
from models.engine import Request

HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
  """What a worker loads (picklable: it crosses into the spawned process).

  Attributes:
    model: GGUF file or Hugging Face directory (models.gguf_loader.load_checkpoint; None = the
      default SmolLM2-135M-Instruct); ignored when `random` is set.
    random: a ModelConfig: random weights of that shape instead (nnx.Rngs(seed)), for tests and
      benchmarks; tokenizer then comes from `tokenizer` (a GGUF path; None = IdTokenizer).
    dtype: "float32" | "bfloat16" for a checkpoint. impl: hack_jax.attention's implementation.
    quant: the cache config; a request's kv_format replaces its kv_format.
    max_seqs, max_len: each Engine's slots and tokens per slot (equal on both workers for
      bit-identical decoding: the executables' shapes).
  """
  model: str | None = None
  random: ModelConfig | None = None
  seed: int = 0
  tokenizer: str | None = None
  dtype: str = "float32"
  impl: str = "reference"
  quant: QuantConfig = QuantConfig()
  max_seqs: int = 4
  max_len: int = 2048


class IdTokenizer:
  """Stand-in tokenizer of a random-weight model without one: text is the ids, no stop ids."""
  stop_ids = frozenset()
  chat_template = None

  def decode(self, ids) -> str:
    return " ".join(str(int(i)) for i in ids)


def load(spec: WorkerSpec):
  """(model, tokenizer) of a WorkerSpec."""
  import jax.numpy as jnp
  from flax import nnx

  from models.llama import Llama
  if spec.random is not None:
    tokenizer = IdTokenizer()
    if spec.tokenizer is not None:

      from models.gguf_loader import open_gguf, read_metadata
      from models.tokenizer import Tokenizer
      tokenizer = Tokenizer.from_gguf_metadata(read_metadata(open_gguf(spec.tokenizer)))
    return Llama(spec.random, rngs=nnx.Rngs(spec.seed)), tokenizer
  from models.gguf_loader import load_checkpoint
  from hack_jax.backend import Backend
  ckpt = load_checkpoint(spec.model, dtype=jnp.dtype(spec.dtype), attention=Backend(spec.impl))
  return Llama.from_weights(ckpt.config, ckpt.weights), ckpt.tokenizer


class _Engines(dict):
  """kv_format -> Engine, made on first use."""

  def __init__(self, spec: WorkerSpec):
    super().__init__()
    self.spec = spec
    self.model, self.tokenizer = load(spec)

  def __missing__(self, kv_format):
    from models.engine import Engine
    quant = dataclasses.replace(self.spec.quant, kv_format=kv_format)
    self[kv_format] = Engine(self.model, self.tokenizer, quant, max_seqs=self.spec.max_seqs,
                             max_len=self.spec.max_len)
    return self[kv_format]


def _device() -> str:
  import jax
  return jax.devices()[0].device_kind


def _result(completion, info) -> dict:
  return dict(tokens=completion.tokens, logprobs=completion.logprobs, text=completion.text,
              finish_reason=completion.finish_reason, info=info)


def serve_prefill(spec: WorkerSpec, up, down) -> None:
  """Prefill worker loop (module docstring): one request at a time, until ("stop",)."""
  engines = _Engines(spec)
  while True:
    msg = up.recv()
    if msg[0] == "stop":
      down.send(msg)
      return
    _, rid, fmt, req = msg
    info = dict(prefill_start=time.monotonic(), device=_device())
    try:
      engine = engines[fmt]
      compile0 = engine.stats["compile_s"]
      local = engine.submit(req)
      events = [e for e in engine.step() if e.request_id == local]
      info.update(prefilled=time.monotonic(), compile_s=engine.stats["compile_s"] - compile0)
      if events[-1].finished:
        done = engine.completion(local, req, events)
        down.send(("result", rid, fmt, _result(done, info)))
        continue
      payload, pages = engine.hand_off(local)
    except (ValueError, TypeError) as e:
      down.send(("error", rid, f"prefill: {e}"))
      continue
    info.update(exported=time.monotonic(), payload_bytes=len(payload), prefill_pages=pages)
    down.send(("handoff", rid, fmt, req, events[0].token_id, events[0].logprob, info))
    handoff.send_payload(down, payload)


def serve_decode(spec: WorkerSpec, up, down) -> None:
  """Decode worker loop (module docstring): adopts hand-offs between decode steps, until
  ("stop",) has arrived and every running request has finished."""
  engines = _Engines(spec)
  running: dict[tuple[str, int], tuple[int, Request, list, dict]] = {}
  stopping = False
  while True:
    busy = any(e.has_work for e in engines.values())
    if stopping and not busy:
      down.send(("stop",))
      return
    while not stopping and up.poll(0 if busy else None):
      msg = up.recv()
      if msg[0] == "stop":
        stopping = True
      elif msg[0] == "handoff":
        _adopt(engines, running, msg, handoff.recv_payload(up), down)
      else:  # results and errors from upstream pass through
        down.send(msg)
      busy = any(e.has_work for e in engines.values())
    for fmt, engine in list(engines.items()):
      for ev in engine.step() if engine.has_work else ():
        _on_event(engine, fmt, running, ev, down)


def _adopt(engines, running, msg, payload, down) -> None:
  _, rid, fmt, req, first, logprob, info = msg
  info["received"] = time.monotonic()
  try:
    engine = engines[fmt]
    local, events, pages = engine.adopt(req, payload, first, logprob)
  except (ValueError, TypeError) as e:
    down.send(("error", rid, f"decode: hand-off rejected: {e}"))
    return
  info.update(imported=time.monotonic(), decode_pages=pages)
  running[fmt, local] = (rid, req, [], info)
  for ev in events:
    _on_event(engine, fmt, running, ev, down)


def _on_event(engine, fmt, running, ev, down) -> None:
  rid, req, events, info = running[fmt, ev.request_id]
  events.append(ev)
  if ev.finished:
    del running[fmt, ev.request_id]
    info["finished"] = time.monotonic()
    down.send(("result", rid, fmt, _result(engine.completion(ev.request_id, req, events), info)))


def _worker_main(kind, spec, downstream, authkey, ready) -> None:
  serve = {"prefill": serve_prefill, "decode": serve_decode}[kind]
  with Listener((HOST, 0), authkey=authkey) as listener:
    ready.send(listener.address)
    with Client(downstream, authkey=authkey) as down:
      with listener.accept() as up:
        serve(spec, up, down)


def start_worker(kind: str, spec: WorkerSpec, downstream, authkey: bytes):
  """Spawns a "prefill" or "decode" worker that will connect to `downstream` (a Listener's address
  on this machine, accepted by the caller) and accept one connection on the address returned.
  Returns (process, address). The caller accepts the worker's downstream connection (accept below)."""
  if kind not in ("prefill", "decode"):
    raise ValueError(f"worker kind must be 'prefill' or 'decode', got {kind!r}")
  ctx = mp.get_context("spawn")
  mine, theirs = ctx.Pipe()
  proc = ctx.Process(target=_worker_main, args=(kind, spec, downstream, authkey, theirs),
                     name=f"hack-jax-{kind}", daemon=True)
  proc.start()
  if not mine.poll(120):
    proc.kill()
    raise RuntimeError(f"{kind} worker did not start (exit code {proc.exitcode})")
  return proc, mine.recv()


def accept(listener: Listener, proc, timeout: float = 600.0):
  """listener.accept(), raising RuntimeError if `proc` dies or `timeout` s pass first."""
  box: list[Any] = []
  thread = threading.Thread(target=lambda: box.append(listener.accept()), daemon=True)
  thread.start()
  t0 = time.monotonic()
  while thread.is_alive() and proc.is_alive() and time.monotonic() - t0 < timeout:
    thread.join(0.1)
  if not box:
    raise RuntimeError(f"{proc.name} did not connect (alive {proc.is_alive()}, exit code {proc.exitcode})")
  return box[0]


class Pipeline:
  """The router's side of a prefill worker and a decode worker (context manager).

  submit(rid, kv_format, request) sends a request in; recv() returns the next message out of
  the decode worker: ("result", rid, kv_format, result) or ("error", rid, message).
  """

  def __init__(self, spec: WorkerSpec, *, authkey: bytes | None = None):
    authkey = os.urandom(16) if authkey is None else authkey
    self._results_listener = Listener((HOST, 0), authkey=authkey)
    self.decode, decode_address = start_worker("decode", spec, self._results_listener.address, authkey)
    self.results = accept(self._results_listener, self.decode)
    self.prefill, prefill_address = start_worker("prefill", spec, decode_address, authkey)
    self.requests = Client(prefill_address, authkey=authkey)

  def submit(self, rid: int, kv_format: str, request: Request) -> None:
    self.requests.send(("request", rid, kv_format, request))

  def recv(self, timeout: float = 600.0):
    if not self.results.poll(timeout):
      raise RuntimeError(f"no result in {timeout} s (prefill alive {self.prefill.is_alive()}, "
                         f"decode alive {self.decode.is_alive()})")
    return self.results.recv()

  def close(self) -> None:
    try:
      self.requests.send(("stop",))
      while self.results.poll(60) and self.results.recv()[0] != "stop":
        pass
    finally:
      for c in (self.requests, self.results, self._results_listener):
        c.close()
      for p in (self.prefill, self.decode):
        p.join(30)
        if p.is_alive():
          p.kill()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m models.disagg", description=__doc__.split("\n")[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--model", default=None, help="GGUF file (None: SmolLM2-135M-Instruct)")
  ap.add_argument("--prompt", required=True)
  ap.add_argument("--kv-format", default="hack", choices=("hack", "int8", "bf16", "float32"))
  ap.add_argument("--max-new-tokens", type=int, default=32)
  ap.add_argument("--max-len", type=int, default=1024)
  ap.add_argument("--check", action="store_true",
                  help="also run the request in this process alone and compare tokens and log-probs")
  args = ap.parse_args(argv)
  spec = WorkerSpec(model=args.model, max_seqs=1, max_len=args.max_len)
  model, tokenizer = load(spec)
  from models.generate import encode_prompt
  req = Request(encode_prompt(tokenizer, args.prompt), max_tokens=args.max_new_tokens)
  if len(req.prompt_ids) + req.max_tokens > args.max_len:
    ap.error(f"--prompt of {len(req.prompt_ids)} tokens + --max-new-tokens {req.max_tokens} exceeds --max-len {args.max_len}")
  t0 = time.monotonic()
  with Pipeline(spec) as pipe:
    print(f"workers up in {time.monotonic() - t0:.1f} s (pids {pipe.prefill.pid}, {pipe.decode.pid})", file=sys.stderr)
    t0 = time.monotonic()
    pipe.submit(0, args.kv_format, req)
    msg = pipe.recv()
  if msg[0] == "error":
    print(f"python -m models.disagg: error: {msg[2]}", file=sys.stderr)
    return 1
  result, info = msg[3], msg[3]["info"]
  print(result["text"])
  if "received" in info:
    print(f"prefill {info['prefilled'] - info['prefill_start']:.2f} s (compile {info['compile_s']:.1f} s), "
          f"export {info['exported'] - info['prefilled']:.3f} s, {info['payload_bytes'] / 2**20:.2f} MiB sent in "
          f"{info['received'] - info['exported']:.3f} s, import {info['imported'] - info['received']:.3f} s, "
          f"decode {info['finished'] - info['imported']:.2f} s; job {time.monotonic() - t0:.2f} s; "
          f"pages {info['prefill_pages']} -> {info['decode_pages']}", file=sys.stderr)
  if args.check:
    from models.engine import Engine
    quant = dataclasses.replace(spec.quant, kv_format=args.kv_format)
    alone = Engine(model, tokenizer, quant, max_seqs=spec.max_seqs, max_len=spec.max_len).generate([req])[0]
    same = alone.tokens == result["tokens"] and alone.logprobs == result["logprobs"]
    print(f"single-process run: tokens and log-probs {'identical' if same else 'DIFFER'}", file=sys.stderr)
    return 0 if same else 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
