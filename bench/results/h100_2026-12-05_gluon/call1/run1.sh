#!/usr/bin/env bash
# GPU call 1 (session 24): the Gluon kernel: gpu tests, harness vs the Pallas kernel (torch, pip Triton),
# bench_decode_attention (JAX: gluon vs hack folded vs bf16, one process)
set -u
O=/tmp/g1; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv > $O/env.txt 2>&1
python -c "import triton, torch, jax; print(triton.__version__, torch.__version__, jax.__version__)" >> $O/env.txt 2>&1
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 110 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gluon_decode.py > $O/tests_gluon.log 2>&1; echo "rc $?" >> $O/tests_gluon.log)
timeout 120 python harn_tmp/gl/run_gl.py harn_tmp/glh $O/gl.jsonl --shapes b8_32k --variants s16=16:0 s16r200=16:200 s16r168=16:168 s24r168=24:168 s16p=16:0:1 s32=32:0 > $O/gl_b8.log 2>&1
tar czf $OUT/g1.tgz -C /tmp g1
timeout 190 python bench/bench_decode_attention.py --out $O/dec --impls gluon gluon168 hack bf16 --hack-dots folded_f16 \
  --shapes llama3.1-8b:8:32768 llama3.1-8b:1:131072 llama3.1-8b:1:32768 llama3.1-8b:8:1024 llama3.1-8b:8:131072 --reps 3 --no-plot > $O/dec.log 2>&1
tar czf $OUT/g1.tgz -C /tmp g1
timeout 70 python harn_tmp/gl/run_gl.py harn_tmp/glh $O/gl.jsonl --shapes b1_128k --variants s64=64:0 s128=128:0 s192r168=192:168 > $O/gl_b1l.log 2>&1
timeout 50 python harn_tmp/gl/run_gl.py harn_tmp/glh $O/gl.jsonl --shapes b1_32k --variants s64=64:0 s128=128:0 > $O/gl_b1s.log 2>&1
tar czf $OUT/g1.tgz -C /tmp g1
