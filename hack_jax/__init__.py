"""hack-jax: a 2-bit KV cache with attention computed on the codes (HACK, arXiv 2502.03589)."""

from hack_jax.config import QuantConfig
from hack_jax.homomorphic import homomorphic_matmul
from hack_jax.packing import pack_2bit, unpack_2bit
from hack_jax.quantization import QuantizedTensor, dequantize, quantize

__version__ = "0.1.0"

__all__ = [
    "QuantConfig",
    "QuantizedTensor",
    "dequantize",
    "homomorphic_matmul",
    "pack_2bit",
    "quantize",
    "unpack_2bit",
]
