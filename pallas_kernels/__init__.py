"""Pallas (Triton-lowered) kernels for hack-jax. Models never import this package directly:
go through hack_jax.attention (DESIGN.md)."""
