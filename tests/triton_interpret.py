"""Runs pallas_kernels.triton_decode_kernel in Triton's interpreter (TRITON_INTERPRET=1, CPU, NumPy
arrays; unpack_asm=False since the interpreter has no inline PTX) and checks it against
test_triton_decode's float64 twin with that file's tolerance.

    TRITON_INTERPRET=1 python tests/triton_interpret.py [--vs-int8] [SHAPE ...]
    (SHAPE: a key of test_triton_decode.SHAPES; default all)

Prints one line per (shape, splits) and exits 1 if any fails. --vs-int8 also prints, per shape, the error
of the Pallas INT8 kernel (pallas_kernels.decode_attention, interpret mode) against the same float64
dequantize-then-attend twin: the accuracy of the two numerics side by side (bench/NOTES_triton.md). tests/test_triton_decode.py runs it in a
subprocess (the interpreter must be on before triton.jit runs). Needs `triton` importable, not jax-triton.
"""
from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


class _Storage:
    def __init__(self, t):
        self.t = t

    def data_ptr(self):
        return self.t.a.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other):  # host and "device" are the same memory
        pass


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return "torch." + self.name

    def __hash__(self):
        return hash(self.name)

    def __eq__(self, other):
        return str(self) == str(other)


class NpTensor:
    """Just enough of a torch CPU tensor for Triton's interpreter, over a NumPy array (in place)."""
    NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int32): "int32",
             np.dtype(np.uint8): "uint8", np.dtype(np.uint16): "uint16", np.dtype(ml_dtypes.bfloat16): "bfloat16"}

    def __init__(self, a, name=None):
        self.a = np.ascontiguousarray(a)
        self.dtype = _Dtype(name or self.NAMES[self.a.dtype])

    def data_ptr(self):
        return self.a.ctypes.data

    def untyped_storage(self):
        return _Storage(self)

    def new_empty(self, *_, **__):
        return NpTensor(self.a[:0], self.dtype.name)

    def set_(self, storage, *_):
        self.a = storage.t.a
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.a.shape

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)


def _patch_interpreter():
    import triton.runtime.interpreter as interp
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):  # NumPy 2: int() of the interpreter's 1-element scalars is an error
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interp._patch_lang_tensor = patched


def run_interpreted(q, c, *, P, ns, splits):
    """The kernel on the test cache `c` (test_decode_kernels.make_cache) -> f32[S, Hq, d] via td.combine."""
    import jax.numpy as jnp

    from pallas_kernels import triton_decode_attention as td
    from pallas_kernels.triton_decode_kernel import hack_triton_decode_kernel
    S, Hq, d = q.shape
    N, H, quarter, _ = c["k_codes"].shape
    consts = td.kernel_constants(num_q_heads=Hq, num_kv_heads=H, head_dim=d, partition_size=P, page_size=4 * quarter,
                                 pages_per_seq=c["page_indices"].shape[1], num_pages=N, num_sink_tokens=ns,
                                 num_splits=splits, unpack_asm=False)
    outs = [NpTensor(np.zeros(s.shape, np.float32)) for s in td.out_shapes(S, H, splits, consts["Q_PER_KV_PAD"], d)]
    sink_k, sink_v = (c["sink_k"], c["sink_v"]) if ns else (c["open_k"], c["open_v"])
    args = [c["kv_lens"], c["page_indices"], q, c["k_codes"], c["k_scale"], c["k_min"], c["v_codes"], c["v_scale"],
            c["v_min"], c["open_k"], c["open_v"], sink_k, sink_v]
    hack_triton_decode_kernel[(S, H, splits + 1)](*[NpTensor(a) for a in args], *outs, **consts)
    return np.asarray(td.combine(*[jnp.asarray(o.a) for o in outs], num_q_heads=Hq))


def _int8_error(q, c, s, exact):
    """(max, rms) error of the Pallas INT8 kernel vs `exact` over the sequences with tokens."""
    import jax.numpy as jnp

    import test_triton_decode as T
    from pallas_kernels.decode_attention import hack_decode_attention
    out = np.asarray(hack_decode_attention(jnp.asarray(q), *[jnp.asarray(c[f]) for f in T.FIELDS],
                                           partition_size=s["P"], num_sink_tokens=s["ns"], dot_dtype="int8",
                                           interpret=True))
    err = (out - exact)[np.asarray(c["kv_lens"]) > 0]
    return np.abs(err).max(), np.sqrt((err ** 2).mean())


def main(names):
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1")
    vs_int8 = "--vs-int8" in names
    names = [n for n in names if n != "--vs-int8"]
    _patch_interpreter()
    import test_triton_decode as T
    failed = False
    for name in names or sorted(T.SHAPES):
        s = T._shape(name)
        q, c = T.build(**s)
        if vs_int8:
            exact = T.numpy_folded_decode(q, c, P=s["P"], ns=s["ns"])
            live = np.asarray(c["kv_lens"]) > 0
            err = (run_interpreted(q, c, P=s["P"], ns=s["ns"], splits=2) - exact)[live]
            print(f"{name}: vs float64 dequantize-then-attend, max|V| {T.v_scale_of(c):.3g}: triton (scale-folded) "
                  f"max {np.abs(err).max():.3g} rms {np.sqrt((err ** 2).mean()):.3g}; pallas int8 max "
                  "%.3g rms %.3g" % _int8_error(q, c, s, exact), flush=True)
        for splits in (1, 3):
            out = run_interpreted(q, c, P=s["P"], ns=s["ns"], splits=splits)
            try:
                err = T.check(out, q, c, P=s["P"], ns=s["ns"])
                print(f"{name} splits={splits}: ok, max error {err:.3g} (max|V| {T.v_scale_of(c):.3g})", flush=True)
            except AssertionError as e:
                failed = True
                print(f"{name} splits={splits}: FAIL {e}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
