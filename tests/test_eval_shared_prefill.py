"""The accuracy harness's shared prefill (models/eval_score.PrefillStore): the float32 run keeps its
exact prefill K/V and every real cache format writes them into its own cache instead of prefilling.

On a tiny random 3-layer Llama (3 windows of 40 + 6 tokens, prefilled in groups of 2 and handed into
the decode batch): the stored K/V and token 0's log-probs against tests/model_oracle.py's float64
decoder; the shared and the unshared run of hack (P16: sealed 2-bit blocks in the prompt), int8 and a
per-layer format give the same NLL and KL; the int8 and per-layer runs against the float64 decoder over
the K/V as stored; the per-layer writer on a tuple cache against kv_cache.write_prefill layer by
layer; and the formats whose prefill depends on the cache are refused.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from hack_jax import kv_cache
from hack_jax.backend import Backend
from hack_jax.kv_cache import mixed
from hack_jax.step import Step
from model_oracle import oracle_logits_weights
from models import eval as ev
from models.config import ModelConfig
from models.eval_score import PrefillStore, _write_layers, score
from models.llama import Llama
from test_layer_formats import bf16, int8_stored

HACK = "hack:partition_size=16,page_size=64"
LAYERS = 3
CFG = dict(vocab_size=97, num_layers=LAYERS, embed_dim=64, hidden_dim=96, num_q_heads=4, num_kv_heads=2,
           head_dim=32, rms_norm_eps=1e-5, rope_theta=1e4, max_seq_len=512, tied_embeddings=True,
           qkv_bias=False)


class _Tok:
  stop_ids = frozenset()

  def decode(self, ids):
    return ""


def _gens(fmt, model):
  """(decode batch of 3, prefill groups of 2) Generators of fmt."""
  return tuple(ev.eval_generator(fmt, model, _Tok(), max_seqs=m, max_len=64) for m in (3, 2))


@pytest.fixture(scope="module")
def ref():
  """The float32 reference run with its PrefillStore."""
  model = Llama(ModelConfig("llama", **CFG), rngs=nnx.Rngs(0))
  ids = np.random.default_rng(1).integers(0, 97, size=3 * (40 + 6)).tolist()
  prompts, forced = ev.windows_of(ids, 40, 6, 3)
  gen, pre = _gens(ev.FORMATS["float32"], model)
  store = PrefillStore()
  nll, _, logp, stats = score(gen, prompts, forced, keep=True, keep_prefill=store, prefill_gen=pre)
  assert not stats["prefill_shared"] and len(store.batches) == 1
  return model, prompts, forced, store, nll, logp


def _oracle(model, tokens, first, stored):
  """log-softmax f64[T, V] of tests/model_oracle.py's decoder with the model's weights."""
  b = model.layers  # scan_layers (the CPU default): one Block whose parameters are stacked over layers
  params = {"attn_norm": b.attn_norm.scale, "ffn_norm": b.ffn_norm.scale, "gate": b.mlp.gate,
            "up": b.mlp.up, "down": b.mlp.down, "q": b.attn.q, "k": b.attn.k, "v": b.attn.v, "o": b.attn.o}

  def w(name, i):
    if name in ("embed", "norm"):
      return np.asarray((model.embed if name == "embed" else model.final_norm.scale)[...], np.float64)
    if name == "head" or name.endswith("_bias"):
      return None
    a = np.asarray(params[name][...], np.float64)[i]
    return a if a.ndim == 1 else a.reshape(-1, a.shape[-1]).T if name == "o" else a.reshape(a.shape[0], -1).T

  logits = oracle_logits_weights(w, tokens, n_layers=LAYERS, n_head=4, n_kv=2, hd=32,
                                 eps=CFG["rms_norm_eps"], theta=CFG["rope_theta"], cached=(first, stored))
  logits -= logits.max(-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def test_stored_prefill_is_the_float64_one(ref):
  """The store's K/V of every layer and window, and token 0's log-probs, against the float64 decoder."""
  model, prompts, forced, store, _, _ = ref
  ks, vs, logp0 = store.batches[0]
  assert ks.shape == (LAYERS, 3, 40, 2, 32)
  for s, p in enumerate(prompts):
    seen = {}
    def stored(i, k, v, seen=seen):
      seen[i] = (k, v)
      return k, v
    want = _oracle(model, p + forced[s, :1].tolist(), len(p), stored)[len(p) - 1]
    assert np.abs(logp0[s] - want).max() < 2e-5
    for i, (k, v) in seen.items():
      for got, exact in ((ks[i, s], k[:len(p)]), (vs[i, s], v[:len(p)])):
        assert np.abs(np.asarray(got, np.float64) - exact).max() < 1e-5 * np.abs(exact).max()


@pytest.mark.parametrize("spec", [HACK, "int8", "int8+1:bf16"])
def test_shared_prefill_changes_no_logprob(ref, spec):
  """Shared vs own prefill through one Generator: NLL and KL to float32 noise; the format differs
  from float32 (the comparison can fail); int8 and the per-layer [int8, bf16, int8] cache (a scan
  per run of layers, the last at offset 1 of the int8 stack) against the float64 decoder over the
  K/V as each layer stores them."""
  model, prompts, forced, store, ref_nll, logp = ref
  fmt = ev.parse_format(spec)
  assert ev.shares_prefill(fmt, model)
  gen = _gens(fmt, model)[0]
  own_nll, own_kl, _, own = score(gen, prompts, forced, ref=logp)
  nll, kl, _, shared = score(gen, prompts, forced, ref=logp, prefill=store)
  assert shared["prefill_shared"] and not own["prefill_shared"]
  assert np.abs(nll - own_nll).max() < 2e-5 and np.abs(kl - own_kl).max() < 2e-6
  assert np.abs(nll - ref_nll).max() > 1e-4
  if spec != HACK:
    stored = [int8_stored, bf16 if spec != "int8" else int8_stored, int8_stored]
    for s, p in enumerate(prompts):
      seq = p + forced[s].tolist()
      want = _oracle(model, seq, len(p), lambda i, k, v: (stored[i](k), stored[i](v)))
      want = -np.take_along_axis(want[len(p) - 1:-1], forced[s][:, None], 1)[:, 0]
      assert np.abs(nll[s] - want).max() < 2e-5


def test_write_layers_is_write_prefill_per_layer():
  """_write_layers on a per-layer [hack, int8, hack] cache held as a tuple of layers (the unrolled
  model's form; the stacked form, one scan per run of layers, is the CPU default that the tests
  above run) stores the bytes of kv_cache.write_prefill on each layer alone (the prefill key folded
  with the layer index)."""
  quant = ev.parse_format(HACK + "+1:int8").quant
  rng = np.random.default_rng(3)
  ks, vs = (rng.standard_normal((LAYERS, 2, 40, 2, 32)).astype(np.float32) for _ in range(2))
  lengths = np.array([40, 23], np.int32)
  table = np.array([[1, 2], [3, 0]], np.int32)
  step = Step.prefill(table, lengths, jax.random.key(0))
  sizes = dict(num_layers=LAYERS, num_kv_heads=2, head_dim=32, num_pages=4, max_seqs=2, pages_per_seq=2)
  got = _write_layers(kv_cache.init_cache(quant, stacked=False, **sizes), ks, vs, step)
  for i, (layer, config) in enumerate(zip(mixed.layer_list(got.layers), quant.configs(LAYERS))):
    want = kv_cache.write_prefill(
        kv_cache.init_layer(config, num_kv_heads=2, head_dim=32, num_pages=4, max_seqs=2), ks[i], vs[i],
        lengths=lengths, page_indices=table, key=jax.random.fold_in(step.key, i))
    assert type(layer) is type(want)
    for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_formats_whose_prefill_differs_keep_their_own(ref):
  """fake quantization, the K/q Hadamard and a homomorphic prefill are not shareable, and score
  refuses a store for them, for other prompts or for another run's keep_prefill."""
  model, prompts, forced, store, _, _ = ref
  for name in ("kivi2", "fake-k32v64-vhad-w128", "seed-p64-had"):
    assert not ev.shares_prefill(ev.FORMATS[name], model)
  homomorphic = Llama(ModelConfig("llama", **CFG, attention=Backend(prefill_attention="homomorphic")),
                      rngs=nnx.Rngs(0))
  assert not ev.shares_prefill(ev.FORMATS["int8"], homomorphic)
  gen = ev.eval_generator(ev.FORMATS["kivi2"], model, _Tok(), max_seqs=3, max_len=64)
  with pytest.raises(ValueError, match="not shareable"):
    score(gen, prompts, forced, prefill=store)
  gen = ev.eval_generator(ev.FORMATS["int8"], model, _Tok(), max_seqs=3, max_len=64)
  with pytest.raises(ValueError, match="other prompts"):
    score(gen, prompts[::-1], forced, prefill=store)
  with pytest.raises(ValueError, match="float32 cache"):
    score(gen, prompts, forced, keep_prefill=PrefillStore())
