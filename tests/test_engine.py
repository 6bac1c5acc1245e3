"""Tests of models/engine.py: continuous batching vs each request run alone through the Generator,
per-request sampling, stop strings / ids, streamed text, cancellation and page accounting.

A tiny random Llama (2 layers) with the real SmolLM2 tokenizer; hack cache with small pages
(partition 16, page 64) so requests span several pages and pages are reused.
"""

import jax
import numpy as np
import pytest

import tiny_llama
from hack_jax.config import QuantConfig
from models.engine import Engine, Request, sample_rows
from models.generate import Generator, Sampling, sample

QUANT = QuantConfig(partition_size=16, page_size=64)
MAX_SEQS, MAX_LEN = 3, 256
# (prompt tokens, max_tokens): prompts off page and bucket boundaries, one finishing at prefill;
# all <= 128 tokens, so two length buckets (64, 128) and few compiles
SHAPES = [(5, 9), (70, 3), (120, 12), (20, 1), (64, 17), (3, 5), (100, 8)]


@pytest.fixture(scope="module")
def tok():
  return tiny_llama.tokenizer()


@pytest.fixture(scope="module")
def model():
  return tiny_llama.checkpoint_and_model()[1]


@pytest.fixture(scope="module")
def engine(model, tok):
  # 2 prompts per prefill call: a call of 1 pads a row with a slot that another request holds
  return Engine(model, tok, QUANT, max_seqs=MAX_SEQS, max_len=MAX_LEN, prefill_rows=2)


@pytest.fixture(scope="module")
def requests(tok):
  rng = np.random.default_rng(0)
  return [Request(rng.integers(0, tok.vocab_size, n).tolist(), max_tokens=m, ignore_eos=True)
          for n, m in SHAPES]


@pytest.fixture(scope="module")
def alone(model, tok, requests):
  """Each request through the (fixed-batch) Generator by itself: tokens and text."""
  gen = Generator(model, tok, QUANT, max_seqs=MAX_SEQS, max_len=MAX_LEN)
  out = [gen.generate_ids([list(r.prompt_ids)], r.max_tokens, stop_on_eos=False) for r in requests]
  return [(o.tokens[0], o.texts[0]) for o in out]


def test_sample_rows_matches_sample_per_row():
  logits = jax.random.normal(jax.random.key(1), (4, 50)) * 3
  keys = jax.random.split(jax.random.key(5), 4)
  counters = np.array([0, 3, 7, 1], np.int32)
  settings = [Sampling(1.0), Sampling(0.7, top_k=5), Sampling(1.3, top_p=0.6), Sampling(0.0)]
  temp = np.array([s.temperature for s in settings], np.float32)
  top_k = np.array([s.top_k for s in settings], np.int32)
  top_p = np.array([s.top_p for s in settings], np.float32)
  for trial in range(5):
    trial_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, trial)
    got = sample_rows(logits, jax.random.key_data(trial_keys), counters, temp, top_k, top_p)
    want = [int(sample(logits[i:i + 1], jax.random.fold_in(trial_keys[i], counters[i]), s)[0])
            for i, s in enumerate(settings)]
    assert np.asarray(got).tolist() == want
  # Independent float64 check of the filters: over many keys, draws stay inside top-k / nucleus.
  lg = np.asarray(logits, np.float64)
  many = jax.random.key_data(jax.random.split(jax.random.key(9), 400))
  fn = jax.jit(sample_rows)
  draws = np.stack([np.asarray(fn(
      logits, many[i * 4:(i + 1) * 4], counters, temp, top_k, top_p)) for i in range(100)])
  assert set(draws[:, 1]) <= set(np.argsort(-lg[1])[:5])
  z = lg[2] / 1.3
  order = np.argsort(-z)
  p = np.exp(z[order] - z.max())
  p /= p.sum()
  nucleus = order[:int(np.searchsorted(np.cumsum(p), 0.6) + 1)]
  assert set(draws[:, 2]) <= set(nucleus) and len(set(draws[:, 2])) > 1
  assert set(draws[:, 3]) == {int(np.argmax(lg[3]))}


def test_greedy_tokens_equal_each_request_alone(engine, requests, alone, tok):
  free0 = engine.allocator.num_free_pages
  out = engine.generate(requests)
  for r, c, (tokens, text) in zip(requests, out, alone):
    assert c.tokens == tokens and c.text == text and c.finish_reason == "length"
    assert len(c.logprobs) == r.max_tokens and all(lp <= 0 for lp in c.logprobs)
  assert engine.allocator.num_free_pages == free0 and engine.num_running == 0
  assert engine.stats["prefill_calls"] >= 3  # requests joined while others were decoding
  # A second wave in another order reuses the executables: nothing recompiles per admission.
  compiled = engine.stepper.num_executables
  again = engine.generate(requests[::-1])
  assert [c.tokens for c in again[::-1]] == [t for t, _ in alone]
  assert engine.stepper.num_executables == compiled and engine.allocator.num_free_pages == free0


def test_sampled_tokens_do_not_depend_on_batch_mates(engine, requests):
  # short prompts and outputs: one prefill bucket and no block sealed, so two extra compiles
  sampled = Request(requests[0].prompt_ids, max_tokens=10, ignore_eos=True, seed=7,
                    sampling=Sampling(temperature=0.9, top_k=40))
  solo = engine.generate([sampled])[0]
  mixed = engine.generate([requests[5], sampled, requests[3], requests[0]])[1]
  assert solo.tokens == mixed.tokens
  other_seed = engine.generate([Request(sampled.prompt_ids, max_tokens=10, ignore_eos=True,
                                        seed=8, sampling=sampled.sampling)])[0]
  assert other_seed.tokens != solo.tokens


def test_stop_strings_stop_ids_and_streamed_text(engine, requests, alone):
  tokens, text = alone[4]  # 17 tokens
  stop = text[len(text) // 2:len(text) // 2 + 3]
  req = Request(requests[4].prompt_ids, max_tokens=17, ignore_eos=True, stop=[stop, "\x00never"])
  events = list(engine.stream([req]))
  assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
  assert events[-1].finish_reason == "stop"
  streamed = "".join(e.text for e in events)
  assert streamed == text[:text.find(stop)]
  assert all(stop not in e.text for e in events)
  stop_id = tokens[6]
  c = engine.generate([Request(requests[4].prompt_ids, max_tokens=17, stop_ids=[stop_id])])[0]
  assert c.tokens == tokens[:tokens.index(stop_id)] and c.finish_reason == "stop"
  assert c.text == engine.tokenizer.decode(c.tokens)


def test_cancel_running_and_waiting(engine, requests, alone):
  free0 = engine.allocator.num_free_pages
  rids = [engine.submit(r) for r in requests[:5]]  # 3 run, 2 wait
  events = engine.step() + engine.step()
  engine.cancel(rids[2])  # running (120-token prompt, 12 tokens)
  engine.cancel(rids[4])  # still waiting
  engine.cancel(12345)  # unknown: ignored
  events += list(engine.stream())
  final = {e.request_id: e for e in events if e.finished}
  assert final[rids[2]].finish_reason == "cancelled" and final[rids[4]].finish_reason == "cancelled"
  assert not any(e.request_id == rids[4] and e.token_id is not None for e in events)
  for i in (0, 1, 3):
    got = [e.token_id for e in events if e.request_id == rids[i] and e.token_id is not None]
    assert got == alone[i][0] and final[rids[i]].finish_reason == "length"
  assert engine.allocator.num_free_pages == free0 and not engine.has_work


def test_request_and_capacity_errors(engine, tok):
  with pytest.raises(ValueError, match="non-empty"):
    Request([])
  with pytest.raises(ValueError, match="max_tokens must be >= 1"):
    Request([1, 2], max_tokens=0)
  with pytest.raises(TypeError, match="max_tokens must be an int"):
    Request([1, 2], max_tokens=2.0)
  with pytest.raises(TypeError, match="stop must be a list"):
    Request([1, 2], stop="abc")
  with pytest.raises(TypeError, match="integers"):
    Request([1.5, 2.0])
  with pytest.raises(ValueError, match="exceeds the engine's max_len 256"):
    engine.submit(Request([1] * 250, max_tokens=7))
  with pytest.raises(ValueError, match=r"token id 49152 outside \[0, vocab_size=49152\)"):
    engine.submit(Request([1, tok.vocab_size]))
  assert not engine.has_work


CHUNK = 40  # chunk boundaries at 40, 80, 120: inside a 16-token partition and a 64-token page


def test_chunked_prefill_tokens_equal_each_request_alone(model, tok, requests):
  """prefill_chunk: prompts up to 120 tokens prefilled 40 per step, interleaved with the others'
  decode steps; each request's greedy tokens equal the Generator's chunked prefill of it alone."""
  requests = [requests[i] for i in (0, 1, 2, 5, 6)]  # 5, 70, 120, 3, 100 prompt tokens
  gen = Generator(model, tok, QUANT, max_seqs=MAX_SEQS, max_len=MAX_LEN, prefill_chunk=CHUNK)
  alone = [gen.generate_ids([list(r.prompt_ids)], r.max_tokens, stop_on_eos=False).tokens[0]
           for r in requests]
  eng = Engine(model, tok, QUANT, max_seqs=MAX_SEQS, max_len=MAX_LEN, prefill_rows=2,
               prefill_chunk=CHUNK)
  free0 = eng.allocator.num_free_pages
  eng.warmup([len(r.prompt_ids) for r in requests])
  # one prefill (40 tokens), one chunk, the decode step with and without the sink writes (a 3-token
  # prompt writes sinks 3 in its first decode step: kv_cache.writes_sink) and one seal shared by both
  compiled = eng.stepper.num_executables
  assert compiled == 5
  out = eng.generate(requests)
  assert [c.tokens for c in out] == alone
  assert all(c.finish_reason == "length" for c in out)
  assert eng.stepper.num_executables == compiled and eng.allocator.num_free_pages == free0
  assert eng.stats["prompt_tokens"] == sum(len(r.prompt_ids) for r in requests)

  # Interleaving: a 120-token prompt admitted beside a decoding request takes 3 steps to its first
  # token, and the running request gets a token in each of them.
  short, long = requests[3], requests[2]
  a = eng.submit(short)
  assert [e.request_id for e in eng.step()] == [a]  # a's prefill and first token
  b = eng.submit(long)
  for i in range(3):
    got = eng.step()
    assert [e.request_id for e in got if e.token_id is not None] == ([a] if i < 2 else [b, a])
  rest = list(eng.stream())
  tokens = lambda rid: [e.token_id for e in rest if e.request_id == rid and e.token_id is not None]
  assert tokens(b) == alone[2][1:]
  assert eng.allocator.num_free_pages == free0 and eng.stepper.num_executables == compiled


def test_prefill_chunk_errors(model, tok):
  for bad in (0, -64, 1.5, True):
    with pytest.raises(ValueError, match="prefill_chunk must be None or an int >= 1"):
      Engine(model, tok, QUANT, max_seqs=2, max_len=MAX_LEN, prefill_chunk=bad)
