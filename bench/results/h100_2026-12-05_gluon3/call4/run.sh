#!/usr/bin/env bash
# Session 26 call D: is jaxlib's typed-FFI Triton call registered; gluon through it vs the legacy custom call vs the Pallas
# kernel (one process); the gluon gpu tests with launch="auto".
set -u
O=/tmp/s5; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/s5.tgz -C /tmp s5; }
nvidia-smi --query-gpu=name --format=csv > $O/env.txt 2>&1
timeout 30 python -c "
from jax._src.lib import gpu_triton as lib
print([n for n in dir(lib) if not n.startswith('__')])
m = getattr(lib, '_cuda_triton', None); print(m)
r = getattr(m, 'registrations', None) or getattr(lib, 'registrations', None); print(sorted(r()) if callable(r) else r)
from pallas_kernels import gluon_launch; print('ffi registered', gluon_launch.ffi_target_registered())
" > $O/probe.log 2>&1; pk
timeout 120 python bench/bench_decode_attention.py --out $O/dec --impls hack gluonffi gluonlegacy --hack-dots folded_f16 \
  --shapes llama3.1-8b:1:32768 llama3.1-8b:8:32768 llama3.1-8b:8:1024 --reps 3 --no-plot > $O/dec.log 2>&1; pk
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_gluon_decode.py \
  > $O/tests_gluon.log 2>&1; echo "rc $?" >> $O/tests_gluon.log); pk
