#!/usr/bin/env bash
# Session 22 call 1: zeros A/B (calls per trip 8 and 1), mixed-cache kernel rows, untested gpu tests.
set -u
O=/tmp/c1; mkdir -p $O
mkdir -p /tmp/m && cp p01/* /tmp/m/ &
export PYTHONPATH=. PYTHONUNBUFFERED=1
(nvidia-smi; python -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())") > $O/env.txt 2>&1
timeout 120 python bench/kernel_ab.py $O/ab1.jsonl new=pallas_kernels/decode_attention.py zeros=harn_tmp/da_zeros.py \
  --shapes b1_32k b1_128k b8_32k --calls-per-iter 1 > $O/ab1.log 2>&1
timeout 100 python bench/bench_decode_attention.py --out $O/dec --impls hack hack4 hackw bf16 --hack-dots folded_f16 \
  --shapes llama3.1-8b:8:32768 llama3.1-8b:1:131072 --reps 3 --no-plot > $O/dec.log 2>&1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 90 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_decode_kernels.py \
  -k "combine_splits or odd_lengths or dequant_kernel_within" > $O/tests1.log 2>&1; echo "rc $?" >> $O/tests1.log
timeout 130 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_fused_decode.py tests/test_stacked_decode.py \
  tests/test_bf16_decode_kernel.py > $O/tests2.log 2>&1; echo "rc $?" >> $O/tests2.log
wait; ls -la /tmp/m > $O/m.txt; tar czf $OUT/call1.tgz -C /tmp c1
