"""Launch a Gluon (or any Triton-compiled) kernel inside `jax.jit`: compile it with the installed Triton, hand
the PTX to jaxlib's Triton kernel call (the custom call jax-triton also lowers to).

jax-triton 0.3.1 compiles only `@triton.jit` functions (its pipeline runs Triton's TTIR passes, which a Gluon
module must skip) and passes no register cap; this module compiles with `triton.compile` (a
`GluonASTSource`, options `num_warps` / `maxnreg`) and builds the call itself, the way jax-triton's lowering
does: one `TritonKernel` (name, warps, shared memory, PTX), one `TritonKernelCall` (grid, one parameter per
operand and output), serialized into jaxlib's typed-FFI `triton_kernel_call_ffi` custom call where this jaxlib
registers it (the kernel looked up once, when the executable initializes; command-buffer compatible), else the
legacy `triton_kernel_call` (its opaque proto found per call, on the host). Arrays only (no scalar operands:
pass them as constexprs), all assumed 16-byte aligned (XLA's buffers are).

GPU only (CUDA, Triton >= 3.6 with `triton.experimental.gluon`); on other platforms the lowering raises.
"""
from __future__ import annotations

import functools
import zlib

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

_TRITON_TYPE = {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16", np.dtype(jnp.bfloat16): "bf16",
                np.dtype(np.int32): "i32", np.dtype(np.uint8): "u8", np.dtype(np.int8): "i8",
                np.dtype(np.uint16): "u16", np.dtype(np.int64): "i64"}

gluon_call_p = jex.core.Primitive("hack_gluon_call")
gluon_call_p.multiple_results = True


@gluon_call_p.def_abstract_eval
def _abstract_eval(*_, out_shapes, **__):
    return [jax.core.ShapedArray(s.shape, s.dtype) for s in out_shapes]


@functools.lru_cache(maxsize=64)
def compile_kernel(kernel, signature: tuple, constexprs: tuple, num_warps: int, maxnreg: int | None, cc: int):
    """triton.compile of a @gluon.jit `kernel` (cached): `signature` ((name, "*fp16"), ...) its pointer
    parameters, all 16-byte aligned; `constexprs` ((name, value), ...); `cc` the compute capability (90: sm_90).
    Also what the offline and torch harnesses in bench/ compile with."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = dict(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
    src = GluonASTSource(kernel, signature=sig, constexprs=dict(constexprs), attrs=attrs)
    opts = {"num_warps": num_warps}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=opts)


FFI_TARGET = "triton_kernel_call_ffi"  # jaxlib's typed-FFI Triton call (kernel looked up once, at initialization)
LEGACY_TARGET = "triton_kernel_call"  # the custom call jax-triton 0.3.1 lowers to (the opaque parsed per call)


@functools.lru_cache(maxsize=1)
def ffi_target_registered() -> bool:
    """Whether this jaxlib registers FFI_TARGET for CUDA (its Triton module's registrations list it)."""
    from jax._src.lib import gpu_triton as lib
    for mod in (lib, getattr(lib, "_cuda_triton", None)):
        regs = getattr(mod, "registrations", None)
        if callable(regs):
            try:
                return FFI_TARGET in regs()
            except Exception:  # noqa: BLE001 (a registry that cannot be listed: assume absent)
                return False
    return False


def _lowering(ctx, *args, kernel, out_shapes, grid, constexprs, num_warps, maxnreg, name, launch):
    from jax._src.lib import gpu_triton as lib
    cc = lib.get_compute_capability(0)
    avals = list(ctx.avals_in) + list(ctx.avals_out)
    names = kernel.arg_names
    signature = tuple((names[i], "*" + _TRITON_TYPE[np.dtype(a.dtype)]) for i, a in enumerate(avals))
    compiled = compile_kernel(kernel, signature, constexprs, num_warps, maxnreg, cc)
    tk = lib.TritonKernel(compiled.metadata.name, num_warps, 1, compiled.metadata.shared, compiled.asm["ptx"],
                          "", cc)
    params = [lib.create_array_parameter(0, 16) for _ in avals]
    call = lib.TritonKernelCall(tk, grid[0], grid[1], grid[2], params)
    opaque = zlib.compress(call.to_proto(name, b""))
    if launch == "ffi" or (launch == "auto" and ffi_target_registered()):
        return jax.ffi.ffi_lowering(FFI_TARGET, api_version=4)(ctx, *args, opaque=opaque)
    return jax.ffi.ffi_lowering(LEGACY_TARGET, api_version=2, backend_config=opaque)(ctx, *args)


mlir.register_lowering(gluon_call_p, _lowering, platform="cuda")


def gluon_call(kernel, *arrays, out_shapes, grid, constexprs: dict, num_warps: int = 1, maxnreg: int | None = None,
               name: str = "hack_gluon", launch: str = "auto"):
    """Outputs of `kernel(*arrays, *outputs, **constexprs)` launched on `grid` (3 ints): `out_shapes` a list of
    jax.ShapeDtypeStruct, written by the kernel (not zeroed first). The kernel's pointer parameters are the
    arrays then the outputs, in order; `constexprs` its constexpr parameters (hashable values). launch: the
    custom call, "ffi" (FFI_TARGET), "legacy" (LEGACY_TARGET) or "auto" (FFI_TARGET where registered)."""
    if launch not in ("auto", "ffi", "legacy"):
        raise ValueError(f"launch must be 'auto', 'ffi' or 'legacy', got launch={launch!r}")
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    return gluon_call_p.bind(*arrays, kernel=kernel, out_shapes=tuple(out_shapes), grid=grid,
                             constexprs=tuple(sorted(constexprs.items())), num_warps=num_warps, maxnreg=maxnreg,
                             name=name, launch=launch)
