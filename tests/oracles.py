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
