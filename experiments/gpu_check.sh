#!/usr/bin/env bash
# The GPU check (issue 35): run first whenever a GPU is lent; under 5 minutes on one H100/H200.
#
#   bash experiments/gpu_check.sh [OUT]       (OUT: where the logs and JSON go; default /tmp/gpu)
#
# On the lent machine (its own JAX with CUDA, flax, optax, chex, orbax are there) carry the
# wheels it lacks in .whl (docs/gpu/README.md): ml_collections, grain, array_record, portpicker,
# tensorboardX. Sections, each under its own time limit so that one hang does not cost the rest:
#   1. the machine: GPU, driver, JAX and its devices;
#   2. experiments/bench_moe.py: the optimized HLO of every MoE dispatch path (is XLA's
#      ragged_dot a grouped GEMM here, or dense over every expert?), the grouped-matmul A/B
#      (XLA ragged_dot, capacity, blocked, JAX's Mosaic GPU kernels) forward at decode rows and
#      forward + backward at update rows, and decode kernels per step / tokens/s (scanned vs
#      per-layer weights, ragged vs the "auto" dispatch; bf16 and FP8; B=8 and B=64) on the
#      1.2B bench MoE;
#   3. the GPU subset of the tests: the Mosaic GPU kernels against the group loop (values and
#      gradients), every MoE dispatch path against the per-expert loop, the decode layout.
set -u
OUT=${1:-${OUT:-/tmp/gpu}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t0=$SECONDS
section() { echo; echo "== $1 ($((SECONDS - t0)) s)"; }

section "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
$PY -c "import jax; print('jax', jax.__version__, jax.devices(), getattr(jax.devices()[0], 'compute_capability', ''))"

section "bench_moe: HLO, grouped-matmul A/B, decode"
timeout 240 $PY experiments/bench_moe.py --json "$OUT/bench_moe.json" --cache /tmp/jax_cache \
  2>&1 | tee "$OUT/bench_moe.log" | grep -v "^W0000\|^I0000"

section "tests (GPU subset)"
timeout 150 $PY -m pytest -q -p no:cacheprovider tests/model/test_grouped.py \
  tests/model/test_moe.py "tests/test_sampler.py::test_decode_loop_reads_the_model_decode_params_layout" \
  2>&1 | tail -15 | tee "$OUT/tests.log"

section "done"
