#!/bin/bash
# Call 1 (session 19): the three bench/candidates/ patches against the committed kernel through XLA (kernel_ab.py, one
# process), test_bits' gpu tests on the committed code, the union candidate's test_decode_kernels gpu tests in a copy of
# the tree, and ncu (stalls, shared-store bank conflicts) of the committed kernel and of the union candidate.
set -u
O=/tmp/o1; mkdir -p $O; export PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $O/env.txt
python3 -c 'import jax, jaxlib, triton; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "triton", triton.__version__, jax.devices())' >> $O/env.txt 2>&1
timeout -k 5 170 python3 bench/kernel_ab.py $O/ab.jsonl ship=pallas_kernels/decode_attention.py mf=harn_tmp/da_meta_flat.py \
  kc=harn_tmp/da_kchain.py mfkc=harn_tmp/da_meta_flat_kchain.py --shapes b8_32k b1_128k > $O/ab.log 2>&1; echo "ab rc $?" >> $O/ab.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 100 python3 -m pytest -q -m gpu -n 4 tests/test_bits.py \
  -p no:cacheprovider > $O/tests_bits.log 2>&1; echo "pytest rc $?" >> $O/tests_bits.log
T=/tmp/t_mfkc; rm -rf $T; mkdir -p $T; cp -r pallas_kernels hack_jax models tests bench pyproject.toml $T/
cp harn_tmp/da_meta_flat_kchain.py $T/pallas_kernels/decode_attention.py
(cd $T && PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 100 python3 -m pytest -q -m gpu -n 8 \
   tests/test_decode_kernels.py -p no:cacheprovider > $O/tests_mfkc.log 2>&1; echo "pytest rc $?" >> $O/tests_mfkc.log)
for d in . $T; do
  tag=$([[ $d == . ]] && echo ship || echo mfkc)
  (cd $d && PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 80 ncu --clock-control none -k regex:hack_decode \
    --launch-skip 2 --launch-count 1 --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --section MemoryWorkloadAnalysis_Tables \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,smsp__inst_executed.sum,gpu__time_duration.sum' \
    python3 bench/bench_hack_decode.py --out /tmp/ncu_$tag --stages profile --shapes b8_32k --variants hack=folded_f16 > $O/ncu_$tag.txt 2>&1
   echo "ncu rc $?" >> $O/ncu_$tag.txt)
done
tar czf $OUT/call1.tgz -C $O .
