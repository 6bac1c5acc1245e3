"""Tensor-parallel checks on 4 CPU devices (models/sharding.py). Not collected by the suite (the name
has no test_ prefix): tests/test_sharding.py runs this file with pytest in a subprocess whose
XLA_FLAGS=--xla_force_host_platform_device_count=4 is set before jax is imported.

Tiny qwen2-shaped decoder (q/k/v biases, GQA 8 q heads over 4 kv heads, untied head), two prompts
prefilled then 40 teacher-forced decode steps (blocks of 32 sealing, a page of 128 crossed)."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hack_jax.config import QuantConfig
from models import sharding
from models.config import ModelConfig
from models.engine import Engine, Request
from models.generate import Generator
from models.llama import Llama
from model_oracle import _decoder
from test_models import _Tok, _tiny_weights

TP = 4
assert len(jax.devices()) == TP, f"run with --xla_force_host_platform_device_count={TP}: {jax.devices()}"

IDS = np.random.default_rng(1).integers(0, 64, size=(2, 100))
PROMPTS = [list(IDS[0, :30]), list(IDS[1, :55])]
FORCED = np.stack([IDS[0, 30:70], IDS[1, 55:95]])


def _model(num_layers, scan):
  cfg = ModelConfig(architecture="qwen2", vocab_size=64, num_layers=num_layers, embed_dim=32,
                    hidden_dim=48, num_q_heads=8, num_kv_heads=4, head_dim=16, rms_norm_eps=1e-6,
                    rope_theta=1e4, max_seq_len=256, tied_embeddings=False, qkv_bias=True,
                    scan_layers=scan)
  w = _tiny_weights(cfg)
  w["lm_head"] = (np.random.default_rng(5).standard_normal((32, 64)) / 6).astype(np.float32)
  return cfg, w, Llama.from_weights(cfg, w)


def _oracle_logprobs(cfg, w):
  """Float64 NumPy forward (tests/model_oracle.py, no hack_jax code) -> the forced log-probs."""
  d, hd = cfg.embed_dim, cfg.head_dim
  mat = dict(q=lambda a: a.reshape(d, -1).T, k=lambda a: a.reshape(d, -1).T,
             v=lambda a: a.reshape(d, -1).T, o=lambda a: a.reshape(-1, d).T,
             q_bias=lambda a: a.reshape(-1), k_bias=lambda a: a.reshape(-1),
             v_bias=lambda a: a.reshape(-1), gate=lambda a: a.T, up=lambda a: a.T, down=lambda a: a.T)

  def get(name, i):
    if i is None:
      return np.float64({"embed": w["embed"], "norm": w["final_norm"], "head": w["lm_head"].T}[name])
    a = np.asarray(w["layers"][i][name], np.float64)
    return mat.get(name, lambda x: x)(a)

  inv = cfg.rope_theta ** (-np.arange(hd // 2, dtype=np.float64) * 2 / hd)
  out = []
  for s, (p, f) in enumerate(zip(PROMPTS, FORCED)):
    seq = np.concatenate([p, f])
    logits = _decoder(seq, get, n_layers=cfg.num_layers, n_head=cfg.num_q_heads,
                      n_kv=cfg.num_kv_heads, hd=hd, eps=cfg.rms_norm_eps, inv=inv, adjacent=False)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    rows = len(p) - 1 + np.arange(len(f))
    out.append(logp[rows, f])
  return np.stack(out)


def _compiles(fn):
  """(fn's result, XLA backend compiles during it), from jax's compile-duration monitoring event."""
  count = [0]

  def listener(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      count[0] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    return fn(), count[0]
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _collectives(executable):
  """[(op, result shape)] of the cross-device ops in a compiled step's HLO text."""
  ops = re.findall(r"= \w+\[([\d,]*)\]\S* (all-reduce|all-gather|reduce-scatter|all-to-all|"
                   r"collective-permute)(?:-start)?\(", executable.as_text())
  return [(op, tuple(int(d) for d in dims.split(",") if d)) for dims, op in ops]


def _sharded_on_heads(array, axis):
  spec = tuple(array.sharding.spec) + (None,) * array.ndim
  return (spec[axis] == sharding.AXIS and all(s is None for i, s in enumerate(spec[:array.ndim]) if i != axis)
          and all(s.data.shape[axis] == array.shape[axis] // TP for s in array.addressable_shards))


def test_float32_cache_unrolled_matches_float64_oracle():
  """Sharded prefill + decode on the float32 cache (unrolled layers) = the float64 NumPy forward
  (1e-4: float32 arithmetic; sharding only reorders the sums of o_proj and down_proj), and = the
  one-device Generator to 1e-5 (the same float32 math, the two all-reduces reassociated)."""
  cfg, w, model = _model(2, scan=False)
  quant = QuantConfig(kv_format="float32")
  got = {tp: np.asarray(Generator(model, _Tok(), quant, max_seqs=2, max_len=100,
                                  mesh=sharding.make_mesh(tp) if tp > 1 else None)
                        .generate_ids(PROMPTS, 40, forced=FORCED).forced_logprobs)
         for tp in (1, TP)}
  np.testing.assert_allclose(got[TP], _oracle_logprobs(cfg, w), atol=1e-4)
  np.testing.assert_allclose(got[TP], got[1], atol=1e-5)


def test_hack_cache_scanned_matches_one_device_compiles_once_and_stays_sharded():
  """hack cache, stacked layers (lax.scan): sharded log-probs = one-device ones. One layer, so the
  cached K/V are computed with no cross-device sum (bit-identical codes, bf16 open block and sinks)
  and only o_proj / down_proj's all-reduce reassociates: 5e-5 (2.4e-5 measured in 1 of 80 log-probs on
  one CPU, < 1e-5 on another: XLA's CPU kernels, hence the summation order, follow the host). (With
  more layers a later layer's K/V input differs by ~1e-7 and can flip an isolated 2-bit or bf16
  rounding: ~1e-4.) One compile
  per step kind (prefill, decode, and the seal after the decode steps that fill a block: deferred
  sealing, per shard), none on a second call; weights, cache
  and the compiled steps' cache outputs sharded on the kv-head axis; the only collectives on
  activations are the two all-reduces per layer (o_proj, down_proj)."""
  cfg, w, model = _model(1, scan=True)
  quant = QuantConfig(kv_format="hack", partition_size=32, page_size=128)
  one = Generator(model, _Tok(), quant, max_seqs=2, max_len=100)
  want = np.asarray(one.generate_ids(PROMPTS, 40, forced=FORCED).forced_logprobs)
  gen = Generator(model, _Tok(), quant, max_seqs=2, max_len=100, mesh=sharding.make_mesh(TP))
  first, compiles = _compiles(lambda: gen.generate_ids(PROMPTS, 40, forced=FORCED))
  assert compiles >= 3  # the three steps (and eager helpers): the listener does count compiles
  np.testing.assert_allclose(np.asarray(first.forced_logprobs), want, atol=5e-5)

  kinds = collections.Counter(key[0] for key in gen.stepper._executables)  # Step kind / seal
  assert sorted(kinds.values()) == [1, 1, 1], kinds  # prefill, decode seal="after", the seal
  again, compiles = _compiles(lambda: gen.generate_ids(PROMPTS, 40, forced=FORCED))
  assert compiles == 0 and again.stats["compile_s"] == 0 and gen.stepper.num_executables == 3
  np.testing.assert_array_equal(np.asarray(again.forced_logprobs), np.asarray(first.forced_logprobs))

  cache = gen.new_cache()
  for a in jax.tree.leaves(cache.layers):  # stacked: [num_layers, pages or slots, kv heads, ...]
    assert _sharded_on_heads(a, 2), (a.shape, a.sharding)
  assert cache.kv_lens.sharding.is_fully_replicated and cache.page_indices.sharding.is_fully_replicated
  for exe in gen.stepper._executables.values():
    out_cache = exe.output_shardings[0]
    for a, s in zip(jax.tree.leaves(cache.layers), jax.tree.leaves(out_cache.layers)):
      assert s.is_equivalent_to(a.sharding, a.ndim), (s, a.sharding)
  for key, exe in gen.stepper._executables.items():  # Megatron: o_proj's and down_proj's all-reduce, [S, T, D]
    ops = _collectives(exe)
    if key[0] == "seal":  # the seal runs on each device's kv heads alone
      assert not ops, ops
      continue
    activations = [o for o in ops if o[1][-1:] == (cfg.embed_dim,)]
    assert [o[0] for o in activations] == ["all-reduce"] * 2 * cfg.num_layers, (key[0], ops)
    # the rest: the vocabulary-sharded head's per-slot max / sum / argmax, never K/V or the cache
    assert all(np.prod(o[1]) <= 2 * 2 * TP for o in ops if o not in activations), ops
  q = gen.state["layers"]["attn"]["q"][...]
  assert _sharded_on_heads(q, 2), q.sharding  # [L, D, N, H]


def test_engine_sharded_matches_one_device():
  """The continuous-batching Engine with a mesh (bf16 cache, unrolled layers; prefill of 2 rows
  into a 3-slot cache, greedy decode): the same tokens and log-probs as on one device (1e-5: one
  layer, bit-identical cached K/V, reassociated all-reduces), cache sharded, compiled steps reused."""
  _, _, model = _model(1, scan=False)
  quant = QuantConfig(kv_format="bf16")
  reqs = [Request(p, max_tokens=12, ignore_eos=True) for p in PROMPTS]
  out = {}
  for tp in (1, TP):
    m = sharding.shard_model(model, sharding.make_mesh(tp)) if tp > 1 else model  # as the CLI's --tp
    eng = Engine(m, _Tok(), quant, max_seqs=3, max_len=100, prefill_rows=2)
    out[tp] = eng.generate(reqs)
    if tp > 1:
      assert all(_sharded_on_heads(a, 1) for a in jax.tree.leaves(eng.cache.layers))
      n = eng.stepper.num_executables
      again = eng.generate(reqs)
      assert eng.stepper.num_executables == n and [c.tokens for c in again] == [c.tokens for c in out[tp]]
  for a, b in zip(out[1], out[TP]):
    assert a.tokens == b.tokens
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=5e-5)


def test_bad_tp_is_rejected():
  _, _, model = _model(1, scan=True)
  with pytest.raises(ValueError, match="tp=5 must be in"):
    sharding.make_mesh(5)
  with pytest.raises(ValueError, match="num_kv_heads=4 is not divisible by tp=3"):
    Generator(model, _Tok(), QuantConfig(), max_seqs=1, max_len=64, mesh=sharding.make_mesh(3))
