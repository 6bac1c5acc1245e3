"""Float64 NumPy oracles, written independently of hack_jax (only QuantizedTensor's fields are read)."""

import numpy as np


def per_element(meta, axis, partition_size):
    """f64[..., G, ...] -> f64[..., G * partition_size, ...]: partition metadata per element."""
    return np.repeat(np.asarray(meta, np.float64), partition_size, axis=axis)


def np_dequantize(qt):
    """scale * codes + minimum in float64 (HACK.md §2)."""
    codes = np.asarray(qt.codes, np.float64)
    return (per_element(qt.scale, qt.axis, qt.partition_size) * codes
            + per_element(qt.minimum, qt.axis, qt.partition_size))


def np_partition_sums(values, axis, partition_size):
    """Sum over each partition of `axis`, in int64 or float64 as given."""
    v = np.asarray(values)
    v = np.moveaxis(v, axis, -1)
    v = v.reshape(v.shape[:-1] + (v.shape[-1] // partition_size, partition_size)).sum(-1)
    return np.moveaxis(v, -1, axis)


def q8_rows(x):
    """INT8 per row, nearest, float32 metadata, folded minimum: the quantizer contract's float32
    arithmetic (DESIGN.md), which the kernels repeat in-register. Returns float64 (codes, scale,
    minimum)."""
    x = np.asarray(x, np.float32)
    lo, hi = x.min(1), x.max(1)
    raw = (np.float32(0.5) * hi - np.float32(0.5) * lo) * np.float32(2.0 / 255)
    s = np.where(hi > lo, np.maximum(raw, np.finfo(np.float32).tiny), np.float32(0)).astype(np.float32)
    mf = (lo + np.float32(128) * s).astype(np.float32)
    t = (x - mf[:, None]) / np.where(s > 0, s, np.float32(1))[:, None]
    return np.clip(np.round(t), -128, 127).astype(np.float64), s.astype(np.float64), mf.astype(np.float64)
