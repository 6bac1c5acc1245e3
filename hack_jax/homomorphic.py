"""The homomorphic matmul: A @ B computed on quantization codes, HACK.md §3 (four-term identity)."""

import functools

import jax
import jax.numpy as jnp

from hack_jax.quantization import QuantizedTensor, split_partitions


def homomorphic_matmul(a, b, *, use_cached_sums=True):
    """dequantize(a) @ dequantize(b), computed from the codes without dequantizing (HACK.md §3).

    With partitions p of P elements of the inner axis Z, A_ik ~ sA_ip a_ik + mA_ip and
    B_kj ~ sB_pj b_kj + mB_pj:

        (AB)_ij = sum_p [ sA_ip sB_pj sum_{k in p} a_ik b_kj      (1) int8 x int8 -> int32 dot
                        + sA_ip mB_pj alpha_ip                     (2) alpha_ip = sum_{k in p} a_ik
                        + mA_ip sB_pj beta_pj                      (3) beta_pj  = sum_{k in p} b_kj
                        + P mA_ip mB_pj ]                          (4)

    exactly, up to float32 rounding of the correction terms. Codes of any bits in [1, 8] fit int8
    (unsigned codes below 8 bits are < 128; 8-bit codes are stored signed), and the int32 dot cannot
    overflow for P < 2**17.

    Args:
      a: QuantizedTensor of shape [..., M, Z], quantized along its last axis (Z).
      b: QuantizedTensor of shape [Z, N] or [..., Z, N], quantized along axis -2 (Z), with the
        same partition_size; batch axes broadcast against a's.
      use_cached_sums: take alpha/beta from the tensors' code_sums (HACK's summation elimination);
        False recomputes them from the codes.

    Returns:
      f32[..., M, N].

    Raises:
      ValueError: an operand is not a QuantizedTensor, has fewer than 2 axes, is quantized along
        the wrong axis, or the inner lengths or partition sizes differ.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, QuantizedTensor):
            raise ValueError(f"{name} must be a QuantizedTensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ValueError(f"{name} needs at least 2 axes, got {name}.shape={t.shape}")
    if a.axis != a.ndim - 1:
        raise ValueError(f"a must be quantized along its last axis, got {a.axis=} for {a.shape=}")
    if b.axis != b.ndim - 2:
        raise ValueError(f"b must be quantized along axis -2, got {b.axis=} for {b.shape=}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"inner lengths differ: {a.shape=}, {b.shape=}")
    if a.partition_size != b.partition_size:
        raise ValueError(f"partitions differ: {a.partition_size=}, {b.partition_size=}")
    try:
        jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(f"batch axes do not broadcast: {a.shape=}, {b.shape=}") from None
    return _homomorphic_matmul(a, b, use_cached_sums=use_cached_sums)


@functools.partial(jax.jit, static_argnames="use_cached_sums")
def _homomorphic_matmul(a, b, *, use_cached_sums):
    size = a.partition_size
    a_codes = split_partitions(a.codes, a.axis, size)  # [..., M, G, P]
    b_codes = split_partitions(b.codes, b.axis, size)  # [..., G, P, N]
    dot = jnp.einsum("...mgp,...gpn->...mgn", a_codes.astype(jnp.int8), b_codes.astype(jnp.int8),
                     preferred_element_type=jnp.int32)
    if use_cached_sums:
        alpha, beta = a.code_sums, b.code_sums
    else:
        alpha = a_codes.astype(jnp.int32).sum(axis=-1)
        beta = b_codes.astype(jnp.int32).sum(axis=-2)
    f32 = lambda v: v.astype(jnp.float32)
    sa, ma, alpha = f32(a.scale)[..., :, None], f32(a.minimum)[..., :, None], f32(alpha)[..., :, None]
    sb, mb, beta = f32(b.scale)[..., None, :, :], f32(b.minimum)[..., None, :, :], f32(beta)[..., None, :, :]
    # [..., M, G, N]: the four terms of one partition, then the sum over partitions.
    terms = sa * sb * f32(dot) + sa * mb * alpha + ma * sb * beta + size * ma * mb
    return terms.sum(axis=-2)
