"""Per-layer cache formats (hack_jax/layer_formats.py, hack_jax/kv_cache/mixed.py) through the model.

Model level: a tiny random 4-layer Llama whose layers cache int8 / hack / float32 / bf16, prefilled and
then decoded (teacher-forced) by the Generator, against tests/model_oracle.py's float64 decoder in which
each decode row attends to its layer's K/V as that layer's format stores them (an own NumPy int8
quantizer, bf16 / float32 rounding; the hack layer holds only sinks and its 16-bit open block at these
lengths). The same check with the formats permuted must fail (the test can tell the layers apart).
Bytes: after a prefill every layer's cache equals, byte for byte, that layer of a one-format cache of
its format (prefill attention is exact on the fresh K/V, so no layer's input depends on the cache);
after decode steps the first layer (bf16) still does. Deferred sealing over the mixed cache: the seal
step matters and a seal after every step changes nothing (tests/test_deferred_seal.py: its bytes).
"""

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import tiny_llama
from hack_jax import handoff, kv_cache
from hack_jax.backend import Backend
from hack_jax.config import QuantConfig
from hack_jax.kv_cache import mixed
from hack_jax.layer_formats import LayerFormats, keep_layers, parse_layer_formats
from hack_jax.step import Step
from model_oracle import oracle_logits_weights
from models import eval as model_eval
from models.config import ModelConfig
from models.engine import Engine, Request
from models.generate import Generator, Sampling
from models.llama import Llama
from models.stepper import LogpHead, Stepper, decode_record

BASE = QuantConfig(partition_size=16, page_size=64)  # hack: 4 sinks, 16-token open block
SPEC = "0:int8;2:float32;-1:bf16"                    # layers: int8, hack, float32, bf16
FORMS = dict(scan=dict(scan_layers=True), stacked=dict(scan_layers=False, stack_cache=True),
             tuple=dict(scan_layers=False, stack_cache=False))


def _config(**kw):
  return ModelConfig("llama", vocab_size=tiny_llama.tokenizer().vocab_size, num_layers=4, embed_dim=64,
                     hidden_dim=96, num_q_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                     rope_theta=1e4, max_seq_len=512, tied_embeddings=True, qkv_bias=False, **kw)


@pytest.fixture(scope="module")
def weights():
  """The weights of one random model, in models.llama's parameter shapes (per layer dicts)."""
  model = Llama(_config(scan_layers=False, stack_cache=False), rngs=nnx.Rngs(0))
  layer = lambda b: dict(attn_norm=b.attn_norm.scale, ffn_norm=b.ffn_norm.scale, q=b.attn.q, k=b.attn.k,
                         v=b.attn.v, o=b.attn.o, gate=b.mlp.gate, up=b.mlp.up, down=b.mlp.down)
  return dict(embed=np.asarray(model.embed[...]), final_norm=np.asarray(model.final_norm.scale[...]),
              layers=[{n: np.asarray(p[...]) for n, p in layer(b).items()} for b in model.layers])


def _model(weights, form):
  return Llama.from_weights(_config(**FORMS[form]), weights)


# ---------------------------------------------------------------------------- the float64 oracle

def _f16(x, direction):
  """x float64 -> float16 values rounded toward -inf (direction -1), +inf (+1) or nearest (0)."""
  y = np.asarray(x, np.float64).astype(np.float16)
  if direction:
    off = (y.astype(np.float64) - x) * direction < 0
    y = np.where(off, np.nextafter(y, np.float16(direction * np.inf)), y)
  return y.astype(np.float64)


def int8_stored(x):
  """The int8 cache's x_hat per (token, kv head) over head_dim, from DESIGN.md's quantizer contract:
  minimum rounded down and scale up to f16, the minimum folded with +128 scale (f16, nearest), codes
  round((x - m_f) / s) clipped to [-128, 127]."""
  x = np.asarray(x, np.float32).astype(np.float64)
  lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
  m = _f16(lo, -1)
  s = np.where(hi > m, np.maximum(_f16((hi - m) / 255, +1), np.finfo(np.float16).tiny), 0.0)
  mf = _f16(m + 128 * s, 0)
  c = np.clip(np.round((x - mf) / np.where(s > 0, s, 1)), -128, 127)
  return s * c + mf


def bf16(x):
  return np.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), np.float64)


STORED = dict(int8=int8_stored, bf16=bf16, hack=bf16,  # hack: sinks + open block only, 16-bit
              float32=lambda x: np.asarray(x, np.float32).astype(np.float64))


def oracle_logp(weights, tokens, first, formats):
  """log-softmax f64[T, V] of one sequence: rows >= first decode over K/V stored per `formats`."""
  cfg = _config(scan_layers=False)
  def w(name, i):
    if name == "embed":
      return weights["embed"].astype(np.float64)
    if name == "norm":
      return weights["final_norm"].astype(np.float64)
    if name == "head" or name.endswith("_bias"):
      return None
    a = weights["layers"][i][name].astype(np.float64)
    return a if a.ndim == 1 else a.reshape(-1, a.shape[-1]).T if name == "o" else a.reshape(a.shape[0], -1).T
  stored = lambda i, k, v: (STORED[formats[i]](k), STORED[formats[i]](v))
  logits = oracle_logits_weights(w, tokens, n_layers=4, n_head=4, n_kv=2, hd=32, eps=cfg.rms_norm_eps,
                                 theta=cfg.rope_theta, cached=(first, stored))
  logits -= logits.max(-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------------- the tests

def test_spec_resolves_and_names_errors():
  lf = parse_layer_formats("0,-1:bf16;2:int8", BASE)
  assert [c.kv_format for c in lf.configs(5)] == ["bf16", "hack", "int8", "hack", "bf16"]
  keep = keep_layers("2:int8", BASE)
  assert [c.kv_format for c in keep.configs(6)] == ["int8", "int8", "hack", "hack", "int8", "int8"]
  assert parse_layer_formats("first2last2:int8", BASE).configs(6) == keep.configs(6)
  assert lf.configs(5)[1] is BASE and lf.configs(5)[0].page_size == BASE.page_size
  assert kv_cache.sink_tokens(lf) == 0 and kv_cache.sink_tokens(BASE) == 4
  for spec, match in [("x:int8", "selector 'x'"), ("0:int3", "unknown layer format 'int3'"),
                      ("0", "not LAYERS:FORMAT"), ("first0:int8", "N must be >= 1"), ("", "name no rule")]:
    with pytest.raises(ValueError, match=match):
      parse_layer_formats(spec, BASE)
  with pytest.raises(ValueError, match="layer 7 is outside a model of 4 layers"):
    parse_layer_formats("7:bf16", BASE).configs(4)
  with pytest.raises(ValueError, match="layer 3 is named by two rules"):
    parse_layer_formats("-1:bf16;last2:int8", BASE).configs(4)
  with pytest.raises(ValueError, match="page_size=256"):
    LayerFormats(BASE, (("0", QuantConfig(kv_format="int8")),))
  with pytest.raises(ValueError, match="N:FORMAT"):
    keep_layers("two:int8", BASE)
  # a format with fields: the base's hack cache (or a format's defaults) with those fields changed
  four = parse_layer_formats("1:hack:bits=4/partition_size=32;0:int8:page_size=64", BASE)
  assert four.configs(3) == (QuantConfig(kv_format="int8", page_size=64, partition_size=16),
                             dataclasses.replace(BASE, bits=4, partition_size=32), BASE)
  assert parse_layer_formats(four.spec, BASE) == four  # the spec spells the changed fields
  for spec, match in [("0:hack:bitz=4", "'bitz=4' is not FIELD=VALUE"), ("0:hack:bits", "'bits' is not FIELD=VALUE"),
                      ("0:hack:bits=3", "bits must be one of"), ("0:int8:bits=4", "bits applies to kv_format='hack'"),
                      ("0:hack:page_size=128", "share the base's page_size=64")]:
    with pytest.raises(ValueError, match=match):
      parse_layer_formats(spec, BASE)
  with pytest.raises(ValueError, match="selector 'hack'"):  # the missing LAYERS named, not 'bits=4'
    parse_layer_formats("hack:bits=4", BASE)
  # a 4-bit base whose page holds 2 blocks: another format's defaults (and its fields) still resolve
  two_blocks = dataclasses.replace(BASE, bits=4, partition_size=32)
  other = parse_layer_formats("0:int8;1:bf16:num_sink_tokens=0", two_blocks)
  assert [c.kv_format for c in other.configs(3)] == ["int8", "bf16", "hack"]
  assert parse_layer_formats(other.spec, two_blocks) == other
  python_rule = LayerFormats(BASE, (("0", QuantConfig(kv_format="int8", page_size=64, partition_size=16,
                                                      num_sink_tokens=0)),))
  assert parse_layer_formats(python_rule.spec, BASE) == python_rule
  fmt = model_eval.parse_format("hack-k32v64-vhad-w128+first2last2:int8")
  assert fmt.quant.base == model_eval.FORMATS["hack-k32v64-vhad-w128"].quant and fmt.quant.spec == "first2,last2:int8"
  with pytest.raises(ValueError, match="real cache format before"):
    model_eval.parse_format("kivi2+0:int8")
  listed = model_eval.parse_formats("float32,hack-k32v64-vhad-w128+18:hack:bits=4,partition_size=64,int8")
  assert [f.name for f in listed] == ["float32", "hack-k32v64-vhad-w128+18:hack:bits=4,partition_size=64", "int8"]
  assert listed[1].quant.configs(20)[18] == dataclasses.replace(listed[1].quant.base, bits=4, partition_size=64)


def test_array_bits_from_the_cache_arrays():
  """Bits per element read from the arrays, against hand counts at head_dim 32, P = 16: int8 (32 codes
  + f16 scale and min) / 32 = 9 bits; bf16 16; hack K: 2-bit codes + f16 scale / min per 16 tokens (2)
  + u8 sums per (token, 16-channel group) (0.5), V likewise: 4.5; 4-bit codes: 6.5."""
  cache = kv_cache.init_cache(parse_layer_formats(SPEC, BASE), num_layers=4, num_kv_heads=2, head_dim=32,
                              num_pages=5, max_seqs=2, pages_per_seq=2, stacked=True)
  bits = mixed.array_bits(cache)
  assert [b for _, b in bits["per_layer"]] == [9.0, 4.5, 32.0, 16.0]
  assert bits["page_bits_per_element"] == pytest.approx((9 + 4.5 + 32 + 16) / 4)
  four = kv_cache.init_cache(parse_layer_formats("1:hack:bits=4", BASE), num_layers=3, num_kv_heads=2, head_dim=32,
                             num_pages=5, max_seqs=2, pages_per_seq=2, stacked=True)
  assert [b for _, b in mixed.array_bits(four)["per_layer"]] == [4.5, 6.5, 4.5]
  total = sum(a.nbytes for a in jax.tree.leaves(cache.layers))
  assert bits["total_bytes"] == total
  held = 2 * 2 * 32 * 2 * (2 * 64 + np.array([0, 4, 0, 0]))  # K+V x heads x dim x slots x capacity
  assert bits["bits_per_element"] == pytest.approx(8 * total / held.sum())


@pytest.mark.parametrize("form", ["scan", "stacked", "tuple"])
def test_generator_logprobs_match_the_float64_oracle(weights, form):
  """Teacher-forced log-probs of the Generator (prefill, then decode steps over the mixed cache) vs the
  float64 oracle with each layer's stored K/V; the oracle with the formats permuted is far off."""
  gen = Generator(_model(weights, form), tiny_llama.tokenizer(), BASE, layer_formats=SPEC, max_seqs=2,
                  max_len=32)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 49152, 7).tolist(), rng.integers(0, 49152, 4).tolist()]
  forced = rng.integers(0, 49152, (2, 8)).astype(np.int32)
  got = np.array(gen.generate_ids(prompts, 8, Sampling(), forced=forced).forced_logprobs)
  formats = [c.kv_format for c in gen.quant.configs(4)]
  assert formats == ["int8", "hack", "float32", "bf16"]
  err = wrong = 0.0
  for s, p in enumerate(prompts):
    seq = p + forced[s].tolist()
    want = oracle_logp(weights, seq, len(p), formats)[len(p) - 1:-1]
    want = np.take_along_axis(want, forced[s][:, None], 1)[:, 0]
    swapped = oracle_logp(weights, seq, len(p), formats[::-1])[len(p) - 1:-1]
    err = max(err, np.abs(got[s] - want).max())
    wrong = max(wrong, np.abs(np.take_along_axis(swapped, forced[s][:, None], 1)[:, 0] - want).max())
  assert err < 2e-5, err
  assert wrong > 20 * err and wrong > 1e-4, (wrong, err)


def _layers(cache):
  return [{f.name: np.asarray(getattr(l, f.name)) for f in dataclasses.fields(l) if f.name != "config"}
          for l in mixed.layer_list(cache.layers)]


@pytest.mark.parametrize("form", ["scan", "stacked"])
def test_a_layer_holds_the_bytes_of_its_format(weights, form):
  """Mixed [bf16, 4-bit hack, hack, int8] vs one-format caches: every layer's bytes after a prefill
  (prompts of 45 and 23 tokens: hack seals two 16-token blocks), the bf16 first layer's after 6 decode
  steps (the hack layers seal again at 52 tokens)."""
  model = _model(weights, form)
  spec = "0:bf16;1:hack:bits=4;-1:int8"
  rng = np.random.default_rng(2)
  lens = np.array([45, 23], np.int32)
  tokens = rng.integers(0, 49152, (2, 64)).astype(np.int32)
  feed = rng.integers(0, 49152, (6, 2)).astype(np.int32)

  def run(quant, decode_steps):
    st = Stepper(model, quant, max_seqs=2, max_len=64)
    alloc, cache = st.new_allocator(), st.new_cache()
    for s, n in enumerate(lens):
      alloc.admit(s, int(n))
    cache, _ = st(tokens, Step.prefill(alloc.page_indices, lens, jax.random.key(0)), cache, LogpHead())
    kv = lens.copy()
    for i in range(decode_steps):
      kv += 1
      step = decode_record(alloc, quant, kv, np.ones(2, bool), jax.random.key(i))
      cache, _ = st(feed[i], step, cache, LogpHead())
    return _layers(cache)

  lf = parse_layer_formats(spec, BASE)
  mixed_prefill = run(lf, 0)
  for i, c in enumerate(lf.configs(4)):
    alone = run(c, 0)[i]
    assert mixed_prefill[i].keys() == alone.keys()
    for name, a in alone.items():
      np.testing.assert_array_equal(mixed_prefill[i][name], a, err_msg=f"layer {i} {name}")
  first_mixed, first_alone = run(lf, 6)[0], run(lf.configs(4)[0], 6)[0]
  for name, a in first_alone.items():
    np.testing.assert_array_equal(first_mixed[name], a, err_msg=name)


def test_deferred_seal_over_per_layer_formats(weights, monkeypatch):
  """A stacked mixed cache defers its seals as a one-format one does (Stepper.deferred_seal: every decode
  step seal="after", then Backend.finish seals each format's stack; docs/DESIGN.md "Deferred sealing").
  Prompts of 17 and 30 tokens, 12 forced tokens: the hack layer fills 16-token regions at 20 and 36. A
  seal step after every step changes nothing; without the seal steps (blocks counted sealed but not) the
  log-probs move several times more than between the deferred seal and seal="always" (which differ by
  the filling steps' attention over 16-bit rows instead of 2-bit codes)."""
  gen = Generator(_model(weights, "stacked"), tiny_llama.tokenizer(), BASE, layer_formats=SPEC, max_seqs=2,
                  max_len=48)
  assert gen.stepper.deferred_seal
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, 49152, 17).tolist(), rng.integers(0, 49152, 30).tolist()]
  forced = rng.integers(0, 49152, (2, 12)).astype(np.int32)
  run = lambda: np.array(gen.generate_ids(prompts, 12, Sampling(), forced=forced).forced_logprobs)
  after = run()
  monkeypatch.setattr(kv_cache, "seals_block", lambda *a, **k: True)
  np.testing.assert_array_equal(run(), after)
  monkeypatch.setattr(kv_cache, "seals_block", lambda *a, **k: False)
  unsealed = run()
  monkeypatch.undo()
  gen.stepper.deferred_seal = False
  always = run()
  diff, off = np.abs(after - always).max(), np.abs(unsealed - always).max()
  assert diff < off / 3, (diff, off)  # measured 3.9e-3 vs 7.5e-2 (CPU)


def test_engine_decodes_the_generators_tokens(weights):
  """The Engine with per-layer formats decodes the Generator's greedy tokens."""
  model, tok = _model(weights, "stacked"), tiny_llama.tokenizer()
  prompt = np.random.default_rng(3).integers(0, 49152, 9).tolist()
  # max_seqs 2 (slot 1 idle): the stacked Generator programs of the tests above, not new ones
  gen = Generator(model, tok, BASE, layer_formats=SPEC, max_seqs=2, max_len=40)
  want = gen.generate_ids([prompt], 10, Sampling(), stop_on_eos=False).tokens[0]
  engine = Engine(model, tok, BASE, layer_formats=SPEC, max_seqs=2, max_len=40)
  (done,) = engine.generate([Request(prompt_ids=prompt, max_tokens=10, ignore_eos=True)])
  assert list(done.tokens) == list(want)


def test_handoff_of_a_mixed_cache(weights):
  """A mixed cache's sequence travels through the hand-off byte for byte (into another slot and other
  pages); a one-format cache refuses it, naming the per-layer configs."""
  model, lf = _model(weights, "stacked"), parse_layer_formats(SPEC, BASE)
  st = Stepper(model, lf, max_seqs=2, max_len=64)
  alloc, cache = st.new_allocator(), st.new_cache()
  lens = np.array([45, 23], np.int32)
  for s, n in enumerate(lens):
    alloc.admit(s, int(n))
  tokens = np.random.default_rng(6).integers(0, 49152, (2, 64)).astype(np.int32)
  cache, _ = st(tokens, Step.prefill(alloc.page_indices, lens, jax.random.key(0)), cache, LogpHead())
  payload = handoff.export_sequence(cache, slot=0, page_indices=alloc.page_indices, kv_len=45)
  other = st.new_allocator()
  other.admit(0, 30)  # slot 1's pages are not slot 0's of the sender
  other.admit(1, 45)
  moved = handoff.import_sequence(st.new_cache(), payload, slot=1, page_indices=other.page_indices)
  assert bytes(handoff.export_sequence(moved, slot=1, page_indices=other.page_indices, kv_len=45)) == bytes(payload)
  with pytest.raises(ValueError, match="layer_configs"):
    handoff.import_sequence(Stepper(model, BASE, max_seqs=2, max_len=64).new_cache(), payload, slot=1,
                            page_indices=other.page_indices)


def test_pallas_interpret_matches_reference(weights):
  """Unrolled over a stacked [int8, hack, bf16, bf16] cache, decode through the Pallas kernels
  in interpret mode (hack / bf16 / int8 decode kernels, in place where they read layer_index) vs the
  reference impl: the same log-probs within the kernels' bf16 roundings."""
  spec, base = "0:int8;2:bf16;-1:bf16", QuantConfig(partition_size=32, page_size=128)  # the kernels' P >= 32
  prompt = np.random.default_rng(4).integers(0, 49152, 37).tolist()  # 4 sinks + a 32-token block sealed
  forced = np.random.default_rng(5).integers(0, 49152, (1, 4)).astype(np.int32)
  out = []
  for backend in (Backend(), Backend("pallas", {"interpret": True})):
    gen = Generator(_model(weights, "stacked"), tiny_llama.tokenizer(), base, layer_formats=spec,
                    max_seqs=1, max_len=48, attention=backend)
    out.append(np.array(gen.generate_ids([prompt], 4, Sampling(), forced=forced).forced_logprobs))
  np.testing.assert_allclose(out[1], out[0], atol=2e-3)
