"""Issue 18 probe, step 1: per-layer q (last 512 positions), post-RoPE K and V of SmolLM2-135M on 2048
tokens of sotu2026 (from token 1000) -> /tmp/clip/qkv.npz. Run: PYTHONPATH=. python bench/clip_capture.py
(bench/NOTES_formats.md, clip section)."""
import dataclasses, sys
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from models import llama
from models.gguf_loader import load_checkpoint
from models.eval import load_text

T = 2048
ckpt = load_checkpoint(None, dtype=jnp.float32)
cfg = dataclasses.replace(ckpt.config, scan_layers=False)
model = llama.Llama.from_weights(cfg, ckpt.weights)
_, text = load_text("sotu2026")
ids = ckpt.tokenizer.encode(text)[1000:1000 + T]
rec = []
orig = llama.causal_attention
def cap(q, k, v, positions):
    rec.append((np.asarray(q[0, -512:], np.float32), np.asarray(k[0], np.float32), np.asarray(v[0], np.float32)))
    return orig(q, k, v, positions)
llama.causal_attention = cap
tokens = jnp.asarray([ids], jnp.int32)
positions = jnp.arange(T, dtype=jnp.int32)[None]
model.run(tokens, positions)
q = np.stack([r[0] for r in rec]); k = np.stack([r[1] for r in rec]); v = np.stack([r[2] for r in rec])
print(q.shape, k.shape, v.shape)
np.savez("/tmp/clip/qkv.npz", q=q, k=k, v=v)
