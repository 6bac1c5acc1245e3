"""models/eval_stats (KL, bootstrap intervals over windows) against independent float64 NumPy
computations, and the grid's format-spec parsing (models/eval.py parse_format / split_specs)."""

import numpy as np
import pytest

from hack_jax.config import QuantConfig
from models import eval as ev
from models import eval_stats as st


def _softmax(x):  # float64, written out: exp then normalize
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def test_kl_matches_definition():
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(3, 5, 40)) * 3, rng.normal(size=(3, 5, 40)) * 3
  p, q = _softmax(a), _softmax(b)
  want = np.array([[sum(pi * np.log(pi / qi) for pi, qi in zip(p[i, j], q[i, j]))
                    for j in range(5)] for i in range(3)])
  logp = lambda x: np.log(_softmax(x)).astype(np.float32)
  got = st.kl_divergence(logp(a), logp(b))
  assert got.shape == (3, 5) and np.allclose(got, want, rtol=1e-4, atol=1e-6)
  assert np.all(st.kl_divergence(logp(a), logp(a)) == 0)


def test_kl_zero_probability_terms():
  with np.errstate(divide="ignore"):
    ref = np.log(np.array([0.5, 0.5, 0.0]))
  q = np.log(np.array([0.25, 0.25, 0.5]))
  assert st.kl_divergence(ref, q) == pytest.approx(np.log(2))
  with pytest.raises(ValueError, match="shape"):
    st.kl_divergence(ref, q[:2])


def _reference_draws(w, boot, seed):
  return np.random.default_rng(seed).integers(0, w, size=(boot, w))


def test_ratio_ci_matches_loop():
  rng = np.random.default_rng(1)
  ref = rng.gamma(2.0, 1.5, size=(12, 30))
  nll = ref + rng.normal(0.05, 0.3, size=ref.shape)
  ratio, lo, hi = st.ppl_ratio_ci(nll, ref, num_boot=500, seed=7)
  draws = _reference_draws(12, 500, 7)
  boot = [np.exp(np.concatenate([nll[i] for i in d]).mean()) /
          np.exp(np.concatenate([ref[i] for i in d]).mean()) for d in draws]
  assert ratio == pytest.approx(np.exp(nll.mean()) / np.exp(ref.mean()), rel=1e-12)
  assert (lo, hi) == pytest.approx(tuple(np.percentile(boot, [2.5, 97.5])), rel=1e-10)
  assert lo < ratio < hi


def test_mean_ci_matches_loop():
  rng = np.random.default_rng(2)
  x = rng.exponential(0.02, size=(9, 16))
  mean, lo, hi = st.mean_ci(x, num_boot=300, seed=3, level=0.9)
  boot = [np.concatenate([x[i] for i in d]).mean() for d in _reference_draws(9, 300, 3)]
  assert mean == pytest.approx(x.mean(), rel=1e-12)
  assert (lo, hi) == pytest.approx(tuple(np.percentile(boot, [5, 95])), rel=1e-10)


def test_ci_degenerate_and_bad_input():
  ref = np.random.default_rng(3).gamma(2.0, size=(5, 8))
  assert st.ppl_ratio_ci(ref + 0.1, ref) == pytest.approx((np.exp(0.1),) * 3, rel=1e-12)
  with pytest.raises(ValueError, match="same positions"):
    st.ppl_ratio_ci(ref[:, :4], ref)
  with pytest.raises(ValueError, match="non-finite"):
    st.mean_ci(np.full((2, 2), np.nan))
  with pytest.raises(ValueError, match="windows, positions"):
    st.mean_ci(np.zeros(4))


def test_format_specs():
  assert ev.split_specs("float32,hack:partition_size=32,v_rotation=64,int8;kivi2") == [
      "float32", "hack:partition_size=32,v_rotation=64", "int8", "kivi2"]
  # per-layer specs whose rules carry fields: a part is a new spec unless it starts with FIELD=VALUE
  assert ev.split_specs("hack-p64+18:hack:bits=4,partition_size=64,hack-p32+0:bf16,hack-p64+1:hack:bits=4,int8") == [
      "hack-p64+18:hack:bits=4,partition_size=64", "hack-p32+0:bf16", "hack-p64+1:hack:bits=4", "int8"]
  assert ev.split_specs("hack:partition_size=32,v_group=64+first2:int8,bf16") == [
      "hack:partition_size=32,v_group=64+first2:int8", "bf16"]
  f = ev.parse_format("hack:partition_size=32,v_rotation=64,num_sink_tokens=0,hadamard=16")
  assert f.quant == QuantConfig(kv_format="hack", partition_size=32, page_size=256,
                                num_sink_tokens=0, v_rotation=64) and f.hadamard == 16
  # page_size follows a larger partition when not given
  assert ev.parse_format("hack:partition_size=128").quant.page_size == 512
  assert ev.parse_format("hack-p64") is ev.FORMATS["hack-p64"]
  with pytest.raises(ValueError, match="'no_such_field'"):
    ev.parse_format("hack:no_such_field=3")
  with pytest.raises(ValueError, match="partition_size"):
    ev.parse_format("hack:partition_size=48")
  with pytest.raises(ValueError, match="unknown formats.*'nope'"):
    ev.parse_format("nope")
