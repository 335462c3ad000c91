#!/usr/bin/env bash
# The GPU check (issue 35): run first whenever a GPU is lent; under 5 minutes on one H100/H200.
#
#   bash experiments/gpu_check.sh [OUT]       (OUT: where the logs and JSON go; default /tmp/gpu)
#   ONLY=decode,step bash experiments/gpu_check.sh     (some sections; default all)
#
# On the lent machine (its own JAX with CUDA, flax, optax, chex, orbax are there) carry the
# wheels it lacks in .whl (docs/gpu/README.md): ml_collections, grain, array_record, portpicker,
# tensorboardX, math-verify, latex2sympy2_extended, antlr4-python3-runtime. Sections, each under
# its own time limit so that one hang does not cost the rest:
#   machine: GPU, driver, JAX and its devices;
#   moe:     experiments/bench_moe.py --only hlo,gmm: the optimized HLO of every MoE dispatch
#            path (is XLA's ragged_dot a grouped GEMM here, or dense over every expert?) and the
#            grouped-matmul A/B (XLA ragged_dot, capacity, blocked, JAX's Mosaic GPU kernels),
#            forward at decode rows and forward + backward at update rows;
#   decode:  bench_moe.py --only fp8,decode on the 1.2B bench MoE: FP8 weight matmuls at decode
#            rows (where the dequantization happens), and kernels per decode step / tokens/s,
#            bf16 and FP8, B=8 and B=64, 1 or 8 decode steps per check of the loop's condition;
#   cmdbuf:  the decode rows again with XLA's command buffers (CUDA graphs) taking the while
#            loops too (XLA_FLAGS below);
#   step:    experiments/bench_train.py: make run's job (configs/default.py, no warm start), the
#            RL step per phase, 1 and 8 decode steps per check;
#   tests:   the GPU subset: the Mosaic GPU kernels against the group loop (values and
#            gradients), every MoE dispatch path against the per-expert loop, the decode layout
#            and the decode steps per check.
set -u
OUT=${1:-${OUT:-/tmp/gpu}}
ONLY=${ONLY:-machine,moe,decode,cmdbuf,step,tests}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t0=$SECONDS
on() { [[ ",$ONLY," == *",$1,"* ]] && echo && echo "== $1 ($((SECONDS - t0)) s)"; }
quiet() { grep -v "^W0000\|^I0000"; }
DECODE=base:per-layer:8:ragged:1,base:per-layer:8:ragged:8,base:per-layer:64:ragged:1
DECODE=$DECODE,base:per-layer:64:ragged:8,fp8:per-layer:8:ragged:8,fp8:per-layer:64:ragged:8
CMDBUF=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL

if on machine; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
fi
if on moe; then
  timeout 150 $PY experiments/bench_moe.py --only hlo,gmm --json "$OUT/moe.json" \
    --cache /tmp/jax_cache 2>&1 | tee "$OUT/moe.log" | quiet
fi
if on decode; then
  timeout 170 $PY experiments/bench_moe.py --only fp8,decode --decode "$DECODE" \
    --json "$OUT/decode.json" --cache /tmp/jax_cache 2>&1 | tee "$OUT/decode.log" | quiet
fi
if on cmdbuf; then
  XLA_FLAGS="$CMDBUF" timeout 100 $PY experiments/bench_moe.py --only decode \
    --decode base:per-layer:8:ragged:1,base:per-layer:8:ragged:8,base:per-layer:64:ragged:8,fp8:per-layer:8:ragged:8 \
    --json "$OUT/cmdbuf.json" --cache /tmp/jax_cache_cmdbuf 2>&1 | tee "$OUT/cmdbuf.log" | quiet
fi
if on step; then
  for n in 1 8; do
    timeout 75 $PY experiments/bench_train.py --configs default --steps 6 \
      --set "{\"rollout.steps_per_check\": $n}" 2>&1 | tee -a "$OUT/step.log" | quiet | tail -3
  done
fi
if on tests; then
  timeout 80 $PY -m pytest -q -p no:cacheprovider tests/model/test_grouped.py \
    tests/model/test_moe.py "tests/test_sampler.py::test_decode_loop_reads_the_model_decode_params_layout" \
    "tests/test_sampler.py::test_several_decode_steps_per_check_change_no_sample" \
    2>&1 | tail -15 | tee "$OUT/tests.log"
fi
echo "== done ($((SECONDS - t0)) s)"
