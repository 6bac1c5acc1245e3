#!/usr/bin/env bash
# Session 27 call 2: why the Gluon kernel takes 40 us inside the JAX call at 1 x 32K (ncu, cold L2) where the harness's
# took 26: ptxas versions; ncu per-kernel duration / registers / local-memory bytes of the gluon kernel at lengths with
# and without open tokens / a partial last group, the dense part in the kernel vs in jnp, direct vs staged loads.
set -u
O=/tmp/c2; mkdir -p $O
export PYTHONPATH=. PYTHONUNBUFFERED=1
pk() { tar czf $OUT/c2.tgz -C /tmp c2; }
{ which -a ptxas; for p in $(find / -name ptxas -type f 2>/dev/null | grep -v ^/proc | head -8); do echo "$p: $($p --version | tail -1)"; done
  python -c "import jax, jaxlib, os; print(jax.__version__, jaxlib.__file__)"; pip list 2>/dev/null | grep -i -E "nvidia|jax|triton"; } > $O/ptxas.txt 2>&1; pk
M=gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,smsp__inst_executed.sum,dram__bytes_read.sum
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 ncu --clock-control none -k regex:hack_ --metrics $M --csv \
  python harn_tmp/ncu_call.py gluon:1:32768 gluon:1:32772 gluon:1:32768:jnp gluon:1:32772:direct gluon:8:32768 gluon:8:32772 \
  hack:1:32768 hack:1:32772 > $O/ncu.csv 2> $O/ncu.err; echo "exit $?" >> $O/ncu.err; pk
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 100 ncu --clock-control none -k regex:gluon --launch-count 5 --metrics $M --csv \
  python bench/gluon_harness.py harn_tmp/glh $O/gl.jsonl --shapes b1_32k --variants s128=128:0:21 > $O/ncu_harness.csv 2> $O/ncu_harness.err
echo "exit $?" >> $O/ncu_harness.err; pk
