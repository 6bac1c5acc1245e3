"""The tests' float64 NumPy twin of the fp8, int8 and kivi2 caches (hack_jax.kv_cache.fp8 / int8 / kivi2).

  poison(cache): like twin.poison, for these formats: every page entry no live token reads (dead
      pages, the null page, rows / chunks / code planes past what the KIVI rules read, stale
      residual rows) set to NaN (floats) or all-ones codes.
  decode(cache) -> [(k_hat, v_hat, k_step, v_step) f64[n, H, D]] per sequence: the pages decoded here
      (own unpacking and page arithmetic, not kv_cache's readers), the 16-bit parts taken from the raw
      inputs rounded to bf16; step = the element's quantization scale (0 for 16-bit elements).
KIVI rules (module docstring of hack_jax.kv_cache.kivi2, restated): G = 32, R = 128; with L tokens
K is 2-bit for t < R ((L - 1) // R), V for t < max(L - 1 - R, 0).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from twin import _pages_of, bf16, poison as twin_poison

G, R = 32, 128


def kivi_ranges(n):
    """(K 2-bit tokens, V 2-bit tokens) of an n-token sequence."""
    return R * (max(n - 1, 0) // R), max(n - 1 - R, 0)


def _arrays(layer):
    return {f.name: np.array(getattr(layer, f.name)) for f in dataclasses.fields(layer) if f.name != "config"}


def poison(cache):
    if cache.config.kv_format in ("fp8", "int8"):
        return twin_poison(cache)
    layer, ps = cache.layer, cache.config.page_size
    a = _arrays(layer)
    live = {int(x) for s in range(len(cache.lengths)) for x in cache.table[s, :_pages_of(cache, s)]}
    dead = [x for x in range(layer.num_pages) if x not in live]
    junk = lambda x: np.nan if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else 255
    for name, x in a.items():
        if not name.startswith("open"):
            x[dead] = junk(x)
    for s, n in enumerate(int(x) for x in cache.lengths):
        nk, nq = kivi_ranges(n)
        for col in range(_pages_of(cache, s)):
            page = cache.table[s, col]
            for u in range(ps):
                t = col * ps + u
                m, w = divmod(u, R)
                j, i = divmod(w, G)
                if t >= nk:
                    a["k_codes"][page, :, m * G + i] |= np.uint8(3 << (2 * j))
                    a["k_scale"][page, :, u // G] = np.nan
                    a["k_min"][page, :, u // G] = np.nan
                if t >= nq:
                    a["v_codes"][page, :, m * G + i] |= np.uint8(3 << (2 * j))
                    a["v_scale"][page, :, :, u] = np.nan
                    a["v_min"][page, :, :, u] = np.nan
        keep_k = {t % R for t in range(nk, n)}
        keep_v = {t % (2 * R) for t in range(nq, n)}
        for row in range(R):
            if row not in keep_k:
                a["open_k"][s, :, row] = np.nan
        for row in range(2 * R):
            if row not in keep_v:
                a["open_v"][s, :, row] = np.nan
    return dataclasses.replace(cache, layer=dataclasses.replace(layer, **a))


def decode(cache):
    cfg, layer = cache.config, cache.layer
    f = _arrays(layer)
    ps, out = cfg.page_size, []
    for s, n in enumerate(int(x) for x in cache.lengths):
        t = np.arange(n)
        pages, u = cache.table[s, t // ps], t % ps
        if cfg.kv_format == "fp8":
            ks = f["k_scale"][pages, :, u].astype(np.float64)[..., None]
            vs = f["v_scale"][pages, :, u].astype(np.float64)[..., None]
            k = f["k_codes"][pages, :, u].astype(np.float64) * ks
            v = f["v_codes"][pages, :, u].astype(np.float64) * vs
            # e4m3: 3 mantissa bits, smallest normal 2**-6
            step = lambda x, sc: sc * 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x / sc), 2.0 ** -6))) - 3)
            out.append((k, v, step(k, ks), step(v, vs)))
            continue
        if cfg.kv_format == "int8":  # x = scale * code + min per (token, kv head); step = scale
            meta = lambda name: f[name][pages, :, u].astype(np.float64)[..., None]
            ks, vs = meta("k_scale"), meta("v_scale")
            k = f["k_codes"][pages, :, u].astype(np.float64) * ks + meta("k_min")
            v = f["v_codes"][pages, :, u].astype(np.float64) * vs + meta("v_min")
            out.append((k, v, np.broadcast_to(ks, k.shape), np.broadcast_to(vs, v.shape)))
            continue
        m, w = u // R, u % R
        j, i = w // G, w % G
        shift = (2 * j)[:, None, None]
        code = lambda name: ((f[name][pages, :, m * G + i].astype(np.int64) >> shift) & 3).astype(np.float64)
        k_sc = f["k_scale"][pages, :, u // G].astype(np.float64)
        k_q = code("k_codes") * k_sc + f["k_min"][pages, :, u // G].astype(np.float64)
        rep = lambda x: np.repeat(x.astype(np.float64), G, axis=-1)  # [n, H, D // G] -> [n, H, D]
        v_sc = rep(f["v_scale"][pages, :, :, u])
        v_q = code("v_codes") * v_sc + rep(f["v_min"][pages, :, :, u])
        nk, nq = kivi_ranges(n)
        kq, vq = (t < nk)[:, None, None], (t < nq)[:, None, None]
        k = np.where(kq, k_q, bf16(cache.k[s, :n]))
        v = np.where(vq, v_q, bf16(cache.v[s, :n]))
        out.append((k, v, np.where(kq, k_sc, 0.0), np.where(vq, v_sc, 0.0)))
    return out
