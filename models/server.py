"""`hack-jax serve`: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over the Engine.

Endpoints:
  POST /v1/completions       {"prompt": str | [token ids], "max_tokens", "temperature", "top_p",
                              "top_k", "stop", "seed", "stream", "logprobs", "ignore_eos", ...}
  POST /v1/chat/completions  {"messages": [{"role", "content"}], same sampling fields}
  GET  /v1/models            the one model served
  GET  /health               {"status", "running", "waiting", "free_pages", "total_pages"}
With "stream": true the answer is server-sent events (`data: {chunk}` lines, then
`data: [DONE]`), one chunk per generated token (its text may be empty while an incomplete
character or a possible stop string is held back), the last chunk carrying finish_reason.

One background thread owns the Engine and steps it while requests are waiting or running; HTTP
handlers submit requests and read their events from an asyncio queue. A client that disconnects
mid-stream cancels its request (its pages return to the pool at the next step).

Errors: an invalid body (malformed JSON, an unknown field, a value out of range such as
max_tokens <= 0 or n > 1) or a request the engine cannot hold (prompt + max_tokens beyond
--max-len, token ids outside the vocabulary) -> 400 {"error": {"message", "type", "param"}}.
Differences from OpenAI: `n` must be 1; temperature defaults to 1.0 as there, top_k and ignore_eos
are extensions (as in vLLM); chat max_tokens defaults to what the cache still holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
import uuid
from typing import Annotated, Literal

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from models.engine import Engine, Event, Request
from models.generate import Sampling


class _Body(BaseModel):
  model_config = ConfigDict(extra="forbid")
  model: str | None = None
  max_tokens: Annotated[int, Field(ge=1)] | None = None
  temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
  top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
  top_k: Annotated[int, Field(ge=0)] = 0
  n: Annotated[int, Field(ge=1, le=1)] = 1
  stop: str | list[str] | None = None
  seed: int | None = None
  stream: bool = False
  stream_options: dict[Literal["include_usage"], bool] | None = None
  ignore_eos: bool = False
  user: str | None = None

  @field_validator("stop")
  @classmethod
  def _stop(cls, stop):
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if any(not s for s in stop):
      raise ValueError("a stop string is empty")
    return stop


class CompletionBody(_Body):
  prompt: str | list[int]
  max_tokens: Annotated[int, Field(ge=1)] | None = 16
  logprobs: Annotated[int, Field(ge=0, le=0)] | None = None  # only the sampled token's

  @field_validator("prompt")
  @classmethod
  def _prompt(cls, p):
    if len(p) == 0:
      raise ValueError("the prompt is empty")
    if isinstance(p, list) and min(p) < 0:
      raise ValueError(f"negative token id {min(p)}")
    return p


class Message(BaseModel):
  model_config = ConfigDict(extra="forbid")
  role: Literal["system", "user", "assistant"]
  content: str


class ChatBody(_Body):
  messages: Annotated[list[Message], Field(min_length=1)]
  logprobs: bool = False


class EngineLoop:
  """Runs engine.step() in a background thread; submit() returns the request's event queue.

  Events reach each request's asyncio.Queue through its event loop (call_soon_threadsafe). If a
  step raises, every open request gets the exception and the loop stops (health: "error")."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._subscribers: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._stop = False
    self.error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="hack-jax-engine", daemon=True)
    self._thread.start()

  def submit(self, request: Request) -> tuple[int, asyncio.Queue]:
    """ValueError (from Engine.check) for a request the engine cannot hold."""
    if self.error is not None:
      raise RuntimeError(f"the engine stopped after an error: {self.error!r}")
    queue: asyncio.Queue = asyncio.Queue()
    with self._lock:
      rid = self.engine.submit(request)
      self._subscribers[rid] = (asyncio.get_running_loop(), queue)
    self._wake.set()
    return rid, queue

  def cancel(self, rid: int) -> None:
    self.engine.cancel(rid)
    self._wake.set()

  def close(self) -> None:
    self._stop = True
    self._wake.set()
    self._thread.join()

  def _run(self) -> None:
    while not self._stop:
      if not self.engine.has_work:
        self._wake.wait(timeout=0.5)
        self._wake.clear()
        continue
      try:
        events = self.engine.step()
      except BaseException as e:  # noqa: BLE001 - reported to every waiting client
        self.error = e
        with self._lock:
          for loop, q in self._subscribers.values():
            loop.call_soon_threadsafe(q.put_nowait, e)
          self._subscribers.clear()
        return
      with self._lock:
        for ev in events:
          loop, q = self._subscribers[ev.request_id]
          if ev.finished:
            del self._subscribers[ev.request_id]
            self.engine.times.pop(ev.request_id, None)  # not reported: keep the dict small
          loop.call_soon_threadsafe(q.put_nowait, ev)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
  return JSONResponse(status_code=status, content=dict(
      error=dict(message=message, type="invalid_request_error", param=param, code=None)))


def create_app(engine: Engine, *, model_name: str) -> fastapi.FastAPI:
  """The FastAPI app; its EngineLoop starts now and stops at app shutdown (app.state.loop)."""
  loop = EngineLoop(engine)

  @contextlib.asynccontextmanager
  async def lifespan(_):
    yield
    loop.close()

  app = fastapi.FastAPI(title="hack-jax", lifespan=lifespan)
  app.state.loop = loop
  tok = engine.tokenizer

  @app.exception_handler(RequestValidationError)
  async def invalid(_, exc: RequestValidationError):
    errs = exc.errors()
    first = errs[0] if errs else {}
    where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    kind, msg = first.get("type"), first.get("msg", "invalid value").removeprefix("Value error, ")
    if kind == "json_invalid":
      why = first.get("ctx", {}).get("error")
      return _error(400, f"malformed JSON at character {where}: {why}")
    if kind == "extra_forbidden":
      message = f"unknown field: {where}"
    elif kind == "missing":
      message = f"{where}: field required"
    else:
      message = f"{where or 'request body'}: {msg}, got {first.get('input')!r}"
    return _error(400, message, where)

  @app.get("/health")
  async def health():
    a = engine.allocator
    return dict(status="error" if loop.error else "ok", running=engine.num_running,
                waiting=engine.num_waiting, free_pages=a.num_free_pages,
                total_pages=a.num_pages - 1)

  @app.get("/v1/models")
  async def models():
    return dict(object="list", data=[dict(id=model_name, object="model", created=0,
                                          owned_by="hack-jax", max_model_len=engine.capacity)])

  def request_of(body: _Body, prompt_ids: list[int]) -> Request:
    max_tokens = body.max_tokens if body.max_tokens is not None else max(
        1, engine.capacity - len(prompt_ids))
    seed = body.seed if body.seed is not None else time.time_ns() % (1 << 31)
    return Request(prompt_ids, max_tokens=max_tokens, stop=body.stop or (),
                   ignore_eos=body.ignore_eos, seed=seed,
                   sampling=Sampling(temperature=body.temperature, top_k=body.top_k,
                                     top_p=body.top_p))

  async def serve(body: _Body, prompt_ids: list[int], chat: bool):
    try:
      rid, queue = loop.submit(request_of(body, prompt_ids))
    except (ValueError, TypeError) as e:
      return _error(400, str(e))
    want_lp = bool(body.logprobs) if chat else body.logprobs is not None
    meta = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                model=model_name)
    if body.stream:
      usage = bool(body.stream_options and body.stream_options.get("include_usage"))
      return StreamingResponse(_sse(loop, rid, queue, meta, chat, want_lp, len(prompt_ids), usage),
                               media_type="text/event-stream")
    events = []
    try:
      while not events or not events[-1].finished:
        events.append(await _next(queue))
    finally:
      if not events or not events[-1].finished:
        loop.cancel(rid)
    return _final(meta, chat, events, want_lp, len(prompt_ids), tok)

  @app.post("/v1/completions")
  async def completions(body: CompletionBody):
    ids = tok.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    return await serve(body, ids, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatBody):
    text = tok.apply_chat_template([m.model_dump() for m in body.messages])
    return await serve(body, tok.encode(text), chat=True)

  return app


async def _next(queue: asyncio.Queue) -> Event:
  item = await queue.get()
  if isinstance(item, BaseException):
    raise RuntimeError(f"the engine failed: {item!r}")
  return item


def _usage(prompt_tokens, events):
  n = sum(e.token_id is not None for e in events)
  return dict(prompt_tokens=prompt_tokens, completion_tokens=n, total_tokens=prompt_tokens + n)


def _logprobs(chat, events, tok):
  toks = [e for e in events if e.token_id is not None]
  if chat:
    return dict(content=[dict(token=tok.decode([e.token_id]), logprob=e.logprob) for e in toks])
  return dict(tokens=[tok.decode([e.token_id]) for e in toks],
              token_logprobs=[e.logprob for e in toks])


def _final(meta, chat, events, logprobs, prompt_tokens, tok):
  text = "".join(e.text for e in events)
  choice = dict(index=0, finish_reason=events[-1].finish_reason,
                logprobs=_logprobs(chat, events, tok) if logprobs else None)
  if chat:
    choice["message"] = dict(role="assistant", content=text)
  else:
    choice["text"] = text
  return dict(meta, object="chat.completion" if chat else "text_completion", choices=[choice],
              usage=_usage(prompt_tokens, events))


async def _sse(loop: EngineLoop, rid, queue, meta, chat, logprobs, prompt_tokens, usage):
  """Server-sent events of one request; cancels it if the client goes away."""
  obj = "chat.completion.chunk" if chat else "text_completion"
  tok = loop.engine.tokenizer
  events: list[Event] = []
  try:
    if chat:
      yield _data(dict(meta, object=obj, choices=[dict(index=0, delta=dict(role="assistant"),
                                                       finish_reason=None)]))
    while not events or not events[-1].finished:
      ev = await _next(queue)
      events.append(ev)
      lp = _logprobs(chat, [ev], tok) if logprobs and ev.token_id is not None else None
      choice = dict(index=0, finish_reason=ev.finish_reason, logprobs=lp)
      if chat:
        choice["delta"] = dict(content=ev.text) if ev.text or not ev.finished else {}
      else:
        choice["text"] = ev.text
      yield _data(dict(meta, object=obj, choices=[choice]))
    if usage:
      yield _data(dict(meta, object=obj, choices=[], usage=_usage(prompt_tokens, events)))
    yield "data: [DONE]\n\n"
  finally:
    if not events or not events[-1].finished:
      loop.cancel(rid)


def _data(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def run(args, load) -> int:
  """The serve command; load(args) -> (checkpoint, model). Serves until interrupted."""
  for flag, value, ok in (("--max-seqs", args.max_seqs, args.max_seqs >= 1),
                          ("--prefill-rows", args.prefill_rows, args.prefill_rows >= 1),
                          ("--max-len", args.max_len, args.max_len >= 2),
                          ("--prefill-chunk", args.prefill_chunk,
                           args.prefill_chunk is None or args.prefill_chunk >= 1),
                          ("--port", args.port, 0 <= args.port < 65536)):
    if not ok:
      raise ValueError(f"{flag} out of range: {value}")
  import uvicorn

  from models.cli_generate import quant_config
  quant = quant_config(args)
  ckpt, model = load(args)
  max_len = min(args.max_len, ckpt.config.max_seq_len)
  engine = Engine(model, ckpt.tokenizer, quant, max_seqs=args.max_seqs, max_len=max_len,
                  prefill_rows=min(args.prefill_rows, args.max_seqs), prefill_chunk=args.prefill_chunk,
                  on_stage=lambda stage, info: stage == "compiled" and print(
                      f"compiled {info['what']} in {info['seconds']:.1f} s", file=sys.stderr))
  if args.warmup:
    engine.warmup([1 << k for k in range(max_len.bit_length()) if 1 << k <= max_len])
  name = args.model_name or os.path.basename(ckpt.path)
  print(f"serving {name} ({args.kv_format} KV cache, {args.max_seqs} slots x {max_len} tokens) "
        f"on http://{args.host}:{args.port}", file=sys.stderr)
  uvicorn.run(create_app(engine, model_name=name), host=args.host, port=args.port,
              log_level=args.log_level)
  return 0
