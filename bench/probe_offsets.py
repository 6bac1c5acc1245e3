"""GPU probe: does the HACK decode kernel read the right bytes of a stacked cache whose u8 code arrays are
2-4 GiB (Pallas-Triton uses 32-bit element offsets up to 2**32 bytes; offsets >= 2**31 may go negative)?

Layer 2 of a 3-layer stacked kivi cache (H 1, d 128, P 64, page 256, 90000 pages per layer: k_codes / v_codes
2.21 GB each), its sequence on pages past byte offset 2**31: the kernel on the stack (layer 2 of the flat view)
vs the same kernel on layer 2's own arrays (737 MB each, 32-bit safe). Prints the max difference. The public
entry points now refuse such operands (common.stacked_view, `misaddressed`), so the stacked call goes to the
jitted launcher `_hack_decode` with the flat view built here. Measured on the H200 (session 14): 9.0e-2 for both
plane encodings, outputs up to 0.23.

Usage: PYTHONPATH=. python bench/probe_offsets.py
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention import _hack_decode, default_config, hack_decode_attention

L, N, H, D, P, PAGE, NS = 3, 90000, 1, 128, 64, 256, 4
rows, bpp = PAGE // 4, PAGE // P
PAGES = np.array([[89000, 89500, 89990, 88000]], np.int32)  # layer-local ids: pid = 2 N + id > 2**31 / 8192
key = jax.random.key(0)


def big(shape, dtype, seed):
    x = jnp.zeros(shape, dtype)
    k = jax.random.fold_in(key, seed)
    upd = (jax.random.randint(k, (L, len(PAGES[0])) + shape[2:], 0, 256).astype(dtype) if dtype == jnp.uint8 else
           (0.01 + 0.1 * jax.random.uniform(k, (L, len(PAGES[0])) + shape[2:])).astype(dtype))
    return x.at[:, PAGES[0]].set(upd)


arrays = [big((L, N, H, rows, D), jnp.uint8, 0), big((L, N, H, bpp, D), jnp.float16, 1),
          big((L, N, H, bpp, D), jnp.float16, 2), big((L, N, H, PAGE, 2), jnp.uint8, 3),
          big((L, N, H, D, rows), jnp.uint8, 4), big((L, N, H, PAGE, 2), jnp.float16, 5),
          big((L, N, H, PAGE, 2), jnp.float16, 6), big((L, N, H, bpp, D), jnp.uint8, 7)]
small = [jax.random.normal(jax.random.fold_in(key, i), (L, 1, H, s, D)).astype(jnp.bfloat16)
         for i, s in enumerate((P, P, NS, NS))]
q = jax.random.normal(jax.random.fold_in(key, 9), (1, 4, D), jnp.float32)
lens = jnp.array([NS + 4 * PAGE - 10], jnp.int32)
print("k_codes bytes", arrays[0].size, "> 2**31:", arrays[0].size > 2 ** 31)
for dn in (True, False):
    kw = dict(partition_size=P, num_sink_tokens=NS, dot_dtype="folded_f16", denormal=dn)
    cfg = dataclasses.replace(default_config(batch=1, num_kv_heads=H, pages_per_seq=PAGES.shape[1], page_size=PAGE,
                                             partition_size=P, dot_dtype="folded_f16"), denormal=dn)
    flat = [x.reshape((-1,) + x.shape[2:]) for x in arrays + small]
    stacked = _hack_decode(q, *flat, jnp.asarray(PAGES), lens, jnp.array([2 * N, 2], jnp.int32), partition_size=P,
                           num_sink_tokens=NS, num_layers=L, config=cfg, open_full=False, interpret=False, bits=2)
    own = hack_decode_attention(q, *[a[2] for a in arrays], *[s[2] for s in small], jnp.asarray(PAGES), lens, **kw)
    d = float(jnp.abs(stacked - own).max())
    print(f"denormal={dn}: max |stacked - own| = {d:.3e}, max |own| = {float(jnp.abs(own).max()):.3e}", flush=True)
