"""Tests of models/server.py with a real HTTP client (httpx) against a uvicorn server this module
starts on 127.0.0.1 (an ephemeral port) over the Engine: a tiny random Llama, the real SmolLM2
tokenizer, the hack cache with small pages. Every request is bounded (timeouts; at most a few
dozen tokens), and the server is shut down at the end.
"""

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

import tiny_llama
from hack_jax.config import QuantConfig
from models.engine import Engine, Request
from models.server import create_app

QUANT = QuantConfig(partition_size=16, page_size=64)
TIMEOUT = httpx.Timeout(120.0)  # a first request may wait for compiles on a loaded 2-core machine
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3,", "Hello", "Rivers of Europe:"]


@pytest.fixture(scope="module")
def engine():
  ckpt, model = tiny_llama.checkpoint_and_model()
  return Engine(model, ckpt.tokenizer, QUANT, max_seqs=3, max_len=128)


@pytest.fixture(scope="module")
def url(engine, expected):  # expected first: the engine has one driver at a time
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  server = uvicorn.Server(uvicorn.Config(create_app(engine, model_name="tiny"), log_level="warning"))
  thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
  thread.start()
  deadline = time.monotonic() + 30
  while not server.started:
    assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
    time.sleep(0.05)
  yield f"http://127.0.0.1:{sock.getsockname()[1]}"
  server.should_exit = True
  thread.join(timeout=30)
  sock.close()


MESSAGES = [dict(role="system", content="Be brief."), dict(role="user", content="Hi")]


@pytest.fixture(scope="module")
def expected(engine):
  """Greedy text of each prompt (12 tokens) and of the chat MESSAGES (8 tokens), each run alone
  on the engine before the server starts."""
  tok = engine.tokenizer
  texts = [engine.generate([Request(tok.encode(p), max_tokens=12, ignore_eos=True)])[0].text
           for p in PROMPTS]
  chat_ids = tok.encode(tok.apply_chat_template(MESSAGES))
  return texts, engine.generate([Request(chat_ids, max_tokens=8, ignore_eos=True)])[0].text


def _stream(url, body):
  """POSTs a streaming request; returns the decoded chunks (without [DONE]) and whether it ended
  with [DONE]."""
  chunks, done = [], False
  with httpx.Client(timeout=TIMEOUT) as client:
    with client.stream("POST", url, json=body) as r:
      assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
      for line in r.iter_lines():
        if not line:
          continue
        assert line.startswith("data: ")
        if line == "data: [DONE]":
          done = True
        else:
          chunks.append(json.loads(line[len("data: "):]))
  return chunks, done


def _health(url):
  return httpx.get(f"{url}/health", timeout=TIMEOUT).json()


def test_health_and_models(url, engine):
  h = _health(url)
  assert h["status"] == "ok" and h["running"] == 0 and h["free_pages"] == h["total_pages"]
  assert h["total_pages"] == engine.allocator.num_pages - 1
  models = httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()
  assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 128


def test_concurrent_streams_deliver_every_token_once_in_order(url, expected):
  body = lambda p: dict(prompt=p, max_tokens=12, temperature=0, ignore_eos=True, stream=True,
                        logprobs=0, stream_options=dict(include_usage=True))
  with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # 5 requests, 3 slots
    results = list(pool.map(lambda p: _stream(f"{url}/v1/completions", body(p)), PROMPTS))
  for (chunks, done), want in zip(results, expected[0]):
    assert done
    tokens = [c for c in chunks if c["choices"]]
    assert len(tokens) == 12  # one chunk per token
    assert all(len(c["choices"][0]["logprobs"]["tokens"]) == 1 for c in tokens)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 11 + ["length"]
    assert "".join(c["choices"][0]["text"] for c in tokens) == want
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and not chunks[-1]["choices"]
    assert len({c["id"] for c in chunks}) == 1
  assert len({r[0][0]["id"] for r in results}) == len(PROMPTS)


def test_non_streaming_completion_and_chat(url, engine, expected):
  r = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT, json=dict(
      prompt=PROMPTS[0], max_tokens=12, temperature=0, ignore_eos=True))
  assert r.status_code == 200
  out = r.json()
  assert out["object"] == "text_completion" and out["choices"][0]["text"] == expected[0][0]
  assert out["usage"] == dict(prompt_tokens=len(engine.tokenizer.encode(PROMPTS[0])),
                              completion_tokens=12, total_tokens=out["usage"]["total_tokens"])
  want = expected[1]
  body = dict(messages=MESSAGES, max_tokens=8, temperature=0, ignore_eos=True)
  r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT)
  assert r.status_code == 200 and r.json()["choices"][0]["message"] == dict(role="assistant",
                                                                           content=want)
  chunks, done = _stream(f"{url}/v1/chat/completions", dict(body, stream=True))
  assert done and chunks[0]["choices"][0]["delta"] == dict(role="assistant")
  assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:]) == want
  assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("content,param,message", [
    ('{"prompt": "hi", "max_tokens": ', None, "malformed JSON at character 31"),
    ('[1]', None, "request body: Input should be a valid dictionary"),
    ('{"prompt": "hi", "best_of": 2}', "best_of", "unknown field: best_of"),
    ('{"prompt": "hi", "max_tokens": 0}', "max_tokens",
     "max_tokens: Input should be greater than or equal to 1, got 0"),
    ('{"prompt": "hi", "max_tokens": -3}', "max_tokens", "got -3"),
    ('{"prompt": "hi", "temperature": -1}', "temperature", "temperature"),
    ('{"prompt": "hi", "n": 2}', "n", "n: Input should be less than or equal to 1, got 2"),
    ('{"prompt": ""}', "prompt", "prompt: the prompt is empty"),
    ('{"prompt": [3, -1]}', "prompt", "prompt: negative token id -1"),
    ('{"max_tokens": 4}', "prompt", "prompt: field required"),
    ('{"prompt": "hi", "stop": ["a", ""]}', "stop", "stop: a stop string is empty"),
    ('{"prompt": "hi", "max_tokens": 200}', None,
     "+ max_tokens 200 = 201 tokens exceeds the engine's max_len 128"),
    ('{"prompt": [1, 99999999]}', None, "outside [0, vocab_size=49152)"),
])
def test_bad_requests_get_a_clear_400(url, content, param, message):
  r = httpx.post(f"{url}/v1/completions", content=content, timeout=TIMEOUT,
                 headers={"content-type": "application/json"})
  assert r.status_code == 400, r.text
  err = r.json()["error"]
  assert message in err["message"] and err["type"] == "invalid_request_error"
  if param is not None:
    assert err["param"] == param


def test_bad_chat_request_and_the_server_keeps_serving(url, expected):
  r = httpx.post(f"{url}/v1/chat/completions", timeout=TIMEOUT,
                 json=dict(messages=[dict(role="robot", content="hi")]))
  assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"]
  r = httpx.post(f"{url}/v1/chat/completions", timeout=TIMEOUT, json=dict(messages=[]))
  assert r.status_code == 400
  r = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT, json=dict(
      prompt=PROMPTS[2], max_tokens=12, temperature=0, ignore_eos=True))
  assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[0][2]


def test_client_disconnect_cancels_and_frees_pages(url, engine, expected):
  start, cancelled = _health(url)["free_pages"], engine.stats["cancelled"]
  with httpx.Client(timeout=TIMEOUT) as client:
    body = dict(prompt=PROMPTS[1], max_tokens=100, temperature=0, ignore_eos=True, stream=True)
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
      lines = r.iter_lines()
      got = [line for line, _ in zip((x for x in lines if x), range(3))]
      assert len(got) == 3  # three tokens arrived, then the client hangs up
  deadline = time.monotonic() + 60
  while True:
    h = _health(url)
    if h["running"] == 0 and h["waiting"] == 0 and not engine.times:
      break
    assert time.monotonic() < deadline, h
    time.sleep(0.1)
  # (the loop above also waited for engine.times to empty: no per-request state left behind)
  assert h["free_pages"] == start == h["total_pages"] and h["status"] == "ok"
  assert engine.stats["cancelled"] == cancelled + 1  # ended by the hang-up, not by max_tokens
  r = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT, json=dict(
      prompt=PROMPTS[4], max_tokens=12, temperature=0, ignore_eos=True))
  assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[0][4]
