"""The HACK.md §4 variants of models/eval.py: FakeHack's quantizer against a float64 NumPy oracle,
its byte arithmetic against HACK's real cache sizes, per-layer settings, and V rotation on the real
cache (exact with an unquantized cache)."""

import dataclasses

import numpy as np
import pytest
import jax.numpy as jnp
from flax import nnx

from hack_jax import kv_cache
from hack_jax.config import QuantConfig
from models import eval as ev
from models.config import ModelConfig
from models.llama import Llama


def _q64(x, axis):  # float64 asymmetric 2-bit, fp16-rounded metadata, nearest
  lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
  m = lo.astype(np.float16).astype(np.float64)
  s = ((hi - lo) / 3).astype(np.float16).astype(np.float64)
  q = np.where(s > 0, np.clip(np.round((x - m) / np.where(s > 0, s, 1)), 0, 3), 0)
  return s * q + m, np.broadcast_to(s, x.shape)


def _had(n):
  h = np.array([[1.0]])
  while len(h) < n:
    h = np.block([[h, h], [h, -h]])
  return h / np.sqrt(n)


def _oracle(k, v, kv_len, kb, vg, ns, window, vh):
  """k, v f64[C, H, D] -> dequantized (k, v) and per-element steps (0 where kept 16-bit)."""
  c, h, d = k.shape
  nq = max(kv_len - ns - window, 0) // kb * kb
  to_bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(
      jnp.float32), np.float64)
  kq, vq = to_bf16(k), to_bf16(v)
  ks, vs = np.zeros_like(k), np.zeros_like(v)
  for b in range(ns, ns + nq, kb):
    kq[b:b + kb], ks[b:b + kb] = _q64(k[b:b + kb], axis=0)
  rot = np.kron(np.eye(d // vh), _had(vh)) if vh else np.eye(d)
  for t in range(ns, ns + nq):
    for hh in range(h):
      vr = (v[t, hh] @ rot).reshape(d // vg, vg)
      deq, step = _q64(vr, axis=1)
      vq[t, hh] = deq.reshape(d) @ rot.T
      vs[t, hh] = step.reshape(d)
  return kq, vq, ks, vs


@pytest.mark.parametrize("spec,kv_len", [
    (ev.FakeHack(64, 64), 300), (ev.FakeHack(32, 64), 131), (ev.FakeHack(64, 64, window=128), 300),
    (ev.FakeHack(32, 32, sinks=0, v_hadamard=64), 250), (ev.FakeHack(64, 64, window=128), 150)])
def test_fake_hack_matches_float64_oracle(rng, spec, kv_len):
  c, h, d = 320, 2, 64
  k = rng.standard_normal((c, h, d)) * rng.uniform(0.1, 4, size=(1, h, d))
  v = rng.standard_normal((c, h, d))
  k, v = k.astype(np.float32).astype(np.float64), v.astype(np.float32).astype(np.float64)
  got_k, got_v = ev.fake_hack_quant(jnp.asarray(k[None], jnp.float32),
                                    jnp.asarray(v[None], jnp.float32),
                                    jnp.array([kv_len], jnp.int32), spec)
  want_k, want_v, ks, vs = _oracle(k, v, kv_len, spec.k_block, spec.v_group, spec.sinks,
                                   spec.window, spec.v_hadamard)
  for got, want, step in ((got_k, want_k, ks), (got_v, want_v, vs)):
    got = np.asarray(got[0], np.float64)[:kv_len]
    want, step = want[:kv_len], step[:kv_len]
    err = np.abs(got - want)
    close = err <= 1e-5 * (1 + np.abs(want))
    # Equal up to float32 arithmetic, except rare ties at a rounding boundary (V rotated: the
    # tie's one-step error is spread over the group by R^T, bounded by the group's step).
    assert close.mean() > 0.995
    if not spec.v_hadamard:
      assert np.all(close | (np.abs(err - step) <= 1e-4 * (1 + step)))
  nq = int(ev.hack_quantized_range(np.int32(kv_len), k_block=spec.k_block, sinks=spec.sinks,
                                   window=spec.window))
  assert nq == max(kv_len - spec.sinks - spec.window, 0) // spec.k_block * spec.k_block


def test_fake_hack_bits_match_real_cache_bytes():
  # The hand arithmetic of FakeHack(P, P) reproduces kv_cache.bytes_per_token of the real cache.
  for p in (32, 64, 128):
    cfg = QuantConfig(kv_format="hack", partition_size=p, page_size=max(256, 4 * p))
    real = kv_cache.bytes_per_token(cfg, 3, 64, 30)
    assert ev.fake_hack_bytes(ev.FakeHack(p, p), 3, 64, 30) == pytest.approx(real)
  # Per-layer: two int8 edge layers at each end of 30.
  spec = ev.FakeHack(64, 64, edge_layers=2, edge="int8")
  per = 3 * 2 * 64 / 8
  assert ev.fake_hack_bytes(spec, 3, 64, 30) == pytest.approx(per * (26 * 2.625 + 4 * 8.5))
  # Effective bytes at a length: 2-bit tokens + bf16 sinks / window.
  eff = ev.fake_hack_bytes(ev.FakeHack(64, 64, window=128), 3, 64, 1, seq_len=580)
  nq = (580 - 4 - 128) // 64 * 64
  assert eff * 580 == pytest.approx(nq * per * 2.625 + (580 - nq) * 3 * 2 * 64 * 2)


def test_fake_hack_validation():
  with pytest.raises(ValueError, match="k_block"):
    ev.FakeHack(0, 64)
  with pytest.raises(ValueError, match="window"):
    ev.FakeHack(64, 64, window=-1)
  with pytest.raises(ValueError, match="edge"):
    ev.FakeHack(64, 64, edge_layers=2)
  with pytest.raises(ValueError, match="v_group"):
    ev.fake_hack_quant(jnp.zeros((1, 8, 1, 48)), jnp.zeros((1, 8, 1, 48)), jnp.array([8]),
                       ev.FakeHack(64, 64))
  with pytest.raises(ValueError, match="unknown formats"):
    ev.format_names("all,nope")
  assert ev.format_names("all")[0] == "float32" and "hack-p64-vhad" in ev.format_names("variants")


@pytest.fixture(scope="module")
def tiny():
  cfg = ModelConfig("llama", vocab_size=97, num_layers=3, embed_dim=64, hidden_dim=96,
                    num_q_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                    rope_theta=1e4, max_seq_len=512, tied_embeddings=True, qkv_bias=False)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  ids = np.random.default_rng(1).integers(0, 97, size=2 * (150 + 6)).tolist()
  return model, ev.windows_of(ids, 150, 6, 2)


class _Tok:
  stop_ids = frozenset()

  def decode(self, ids):
    return ""


def test_variants_on_tiny_model(tiny):
  model, (prompts, forced) = tiny
  run = lambda fmt: ev.evaluate_format(fmt, model, _Tok(), prompts, forced)
  ref = run(ev.FORMATS["float32"])
  # V rotated in an unquantized cache (QuantConfig.v_rotation), the output rotated back: the same model.
  rot = run(ev.EvalFormat("f32-vrot", QuantConfig(kv_format="float32", v_rotation=32)))
  assert abs(rot["nll"] - ref["nll"]) < 1e-4
  # A FakeHack whose every layer is int8 is the int8 fake path; the edge rule picks layers.
  spec = ev.FakeHack(32, 32, edge_layers=2, edge="int8")
  assert [spec.for_layer(i, 3) for i in range(3)] == ["int8"] * 3
  all_int8 = run(ev.EvalFormat("fake-int8", QuantConfig(kv_format="float32"), fake=spec))
  assert abs(all_int8["nll"] - ref["nll"]) < 0.05
  # 2-bit rows do change the scores (the path is active).
  fake = run(ev.EvalFormat("fake", QuantConfig(kv_format="float32"), fake=ev.FakeHack(32, 32)))
  assert fake["nll"] != ref["nll"]


def test_per_layer_fake_settings_follow_the_layer_index(tiny):
  """FakeHack's edge rule sees the layer index the model passes to the backend: a traced i32 in the
  scanned layer loop (lax.cond), a Python int when unrolled. Both forms of the same weights give the
  same scores, and the mixed setting (int8 first/last layer, 2-bit middle) differs from both the
  all-int8 and the all-2-bit one (the index really selects per layer)."""
  model, (prompts, forced) = tiny
  unrolled = Llama(dataclasses.replace(model.config, scan_layers=False), rngs=nnx.Rngs(0))
  fmt = lambda spec: ev.EvalFormat("f", QuantConfig(kv_format="float32"), fake=spec)
  mixed = fmt(ev.FakeHack(32, 32, edge_layers=1, edge="int8"))
  nll = lambda m, f: ev.evaluate_format(f, m, _Tok(), prompts, forced)["nll"]
  scanned = nll(model, mixed)
  assert abs(scanned - nll(unrolled, mixed)) < 1e-5
  int8 = nll(model, fmt(ev.FakeHack(32, 32, edge_layers=2, edge="int8")))
  two_bit = nll(model, fmt(ev.FakeHack(32, 32)))
  assert abs(scanned - int8) > 1e-4 and abs(scanned - two_bit) > 1e-4
