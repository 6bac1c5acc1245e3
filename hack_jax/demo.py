"""Demo on random data: 2-bit K/V, attention's two matmuls computed on the codes (HACK.md §3).

Run: python -m hack_jax.demo. Shows that the homomorphic matmul equals dequantize-then-matmul
(the identity is exact; only float32 rounding differs), how far both are from the float matmul
(the quantization error), and the storage cost in bits per element.
"""

import jax
import jax.numpy as jnp
import numpy as np

from hack_jax import dequantize, homomorphic_matmul, pack_2bit, quantize, unpack_2bit

KV_LEN, HEAD_DIM, Q_ROWS, PARTITION_SIZE = 1024, 128, 4, 64


def _matmul(a, b):
    # "highest": GPUs otherwise multiply float32 in TF32/bf16, which would swamp the identity's rounding.
    return jnp.matmul(a, b, precision="highest")


def _report(name, homomorphic, dequantized, exact):
    scale = float(jnp.abs(exact).max())
    identity = float(jnp.abs(homomorphic - dequantized).max()) / scale
    quant = float(jnp.abs(homomorphic - exact).max()) / scale
    print(f"{name}: max |homomorphic - dequantize-then-matmul| = {identity:.1e} (float32 rounding)")
    print(f"{name}: max |homomorphic - float matmul|          = {quant:.1e} (quantization error)")


def _bits_per_element(qt, sums_bytes=1):
    """Stored bits per element: packed 2-bit codes, fp16 scale and minimum, code sums as the cache
    keeps them (uint8)."""
    packed = pack_2bit(qt.codes, qt.axis)
    if not bool(jnp.all(unpack_2bit(packed, qt.axis) == qt.codes)):
        raise RuntimeError("pack_2bit / unpack_2bit round trip failed")
    total = packed.nbytes + qt.scale.nbytes + qt.minimum.nbytes + qt.code_sums.size * sums_bytes
    return 8 * total / qt.codes.size


def main():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (Q_ROWS, HEAD_DIM)) / np.sqrt(HEAD_DIM)
    k = jax.random.normal(kk, (KV_LEN, HEAD_DIM))
    v = jax.random.normal(kv, (KV_LEN, HEAD_DIM))
    print(f"q [{Q_ROWS}, {HEAD_DIM}], K and V [{KV_LEN}, {HEAD_DIM}], partition_size {PARTITION_SIZE}, "
          f"on {jax.devices()[0].platform}; errors relative to max |float matmul|")

    # QK^T, inner axis head_dim: Q INT8 per (row, channel partition), K 2-bit per (token, channel partition).
    qq = quantize(q, bits=8, axis=-1, partition_size=PARTITION_SIZE)
    kt = quantize(k.T, bits=2, axis=0, partition_size=PARTITION_SIZE)
    logits = homomorphic_matmul(qq, kt)
    _report("QK^T", logits, _matmul(dequantize(qq), dequantize(kt)), _matmul(q, k.T))

    # PV, inner axis tokens: weights INT8 per (row, token partition), V 2-bit per (channel, token partition).
    w = jax.nn.softmax(logits, axis=-1)
    wq = quantize(w, bits=8, axis=-1, partition_size=PARTITION_SIZE)
    vq = quantize(v, bits=2, axis=0, partition_size=PARTITION_SIZE)
    out = homomorphic_matmul(wq, vq)
    _report("PV  ", out, _matmul(dequantize(wq), dequantize(vq)), _matmul(w, v))

    rmse = float(jnp.sqrt(jnp.mean((dequantize(vq) - v) ** 2)))
    print(f"V 2-bit: {_bits_per_element(vq):.3f} bits per element (codes 2, fp16 scale+min "
          f"{32 / PARTITION_SIZE:.3f}, uint8 sums {8 / PARTITION_SIZE:.3f}) vs 16 for bf16; "
          f"RMSE {rmse:.3f} on unit-variance data")


if __name__ == "__main__":
    main()
