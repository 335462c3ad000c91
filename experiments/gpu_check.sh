#!/usr/bin/env bash
# The GPU check (issues 35, 53, 54): run first whenever a GPU is lent; about 9 minutes on one
# H200 with BUDGET=540 (run 7: the tests alone took over 90 s, Mosaic GPU compiles are slow).
#
#   BUDGET=540 bash experiments/gpu_check.sh [OUT]  (OUT: the logs and JSON; default /tmp/gpu)
#   ONLY=decode,step bash experiments/gpu_check.sh  (some sections; default: machine, tests,
#                                                   aotab, longdecode, decode, tiles)
# BUDGET (seconds in all): each section's limit is cut to what is left, and a section with under
# 30 s left is skipped. On the lent machine (its own JAX with CUDA, flax, optax, chex, orbax are
# there) carry the wheels it lacks in .whl/ (`make gpu-wheels` here; docs/gpu/README.md "Run 7").
# Sections, in this order, each under its own time limit so that one hang does not cost the rest:
#   machine: GPU, driver, JAX and its devices, a copy to host memory and back (offload_state);
#   tests:   the GPU subset: the Triton and Mosaic GPU grouped matmuls compiled, against the
#            group loop (values and gradients) and the per-expert loop (every dispatch path),
#            the decode-attention kernel compiled against the whole-buffer softmax;
#   aotab:   the update alone at 2 layers of the Qwen3-30B-A3B preset compiled on this GPU
#            (--local, not run), each arm under its own 150 s: the defaults (Triton flash
#            attention, Mosaic GPU experts), XLA's blocked attention (run 8: under 40 s), the
#            capacity MoE path (no Mosaic GPU kernels); the compile s column (or a timeout's
#            progress) says which part holds the GPU compile up;
#   longdecode: bench_long_decode.py: decode steps over 1k / 8k / 32k tokens of context, 4
#            layers of Qwen3-30B-A3B's shape in bf16, 16 rows, against the bandwidth, two
#            attentions alternated: the default (`gpu_attention`'s Triton kernel over the filled
#            slots, layers.GPU_BLOCKED_DECODE; run 8: 2.4 ms a step at 32k) and the dense
#            softmax over the whole buffer (4.0 ms); docs/performance.md "Decoding at a
#            reasoning trace's length";
#   aot:     (asked for by name) aot.py's estimate checked: 2 layers of the Qwen3-30B-A3B preset
#            at 4k tokens, its update / pi_old / rollout compiled on this GPU (--local) and each
#            program run on the GPU against its roofline (--run); run 7: 8 layers' update took
#            over 230 s to compile and over 18 GiB of host memory; run 8: 2 layers' three
#            programs over 300 s, the update alone with AOT_EXTRA="--set
#            model.attention_impl=blocked" (appended to aot.py's arguments) compiled in under
#            40 s (then aot's FLOP count failed on JAX 0.11's scan: mended); aotab next;
#   decode:  bench_moe.py --only decode on the 1.9B bench MoE: kernels per decode step and
#            tokens/s, bf16 and FP8 weights, B=8 and B=64, XLA's ragged_dot against the Triton
#            grouped matmul (`experts.expert_ffn(impl="triton")`: only the touched experts read, FP8
#            read as FP8);
#   tiles:   bench_moe.py --only tiles: the Triton path's forward at decode rows, bf16 and FP8
#            experts, per tile setting (split contraction, FP8 x FP8 rows among them);
#   attention: (asked for by name; run 7 spent its 100 s compiling) bench_moe.py --only
#            attention: the bench MoE's sampler at 1024 and 4096 new tokens, attention over the
#            whole cache buffer against the filled slots only, alternated;
#   step:    (asked for by name; run 5: 0.331 s) experiments/bench_train.py: make run's job
#            (configs/default.py, no warm start) and the same on a Qwen3-30B-A3B-shaped MoE
#            (default:qwen3_shape), the RL step per phase;
#   moe:     (asked for by name; runs 1, 2, 5) bench_moe.py --only hlo,gmm: the optimized HLO of
#            every MoE dispatch path (is XLA's ragged_dot a grouped GEMM here, or dense over
#            every expert?) and the grouped-matmul A/B (XLA ragged_dot, capacity, blocked, Mosaic
#            GPU, Triton), forward at decode rows and forward + backward at update rows;
#   aotcpu:  (asked for by name; needs no GPU: run it anywhere) aot's programs compiled on one
#            emulated CPU device, its per-device memory to set beside the GPU's;
#   cmdbuf:  (asked for by name) decode rows with XLA's command buffers (CUDA graphs) taking the
#            while loops too (XLA_FLAGS below; 0.78-0.93x without them on an H100, run 3).
# Measured before (docs/gpu/README.md): FP8 matmul forms (--only fp8), 8 decode steps per check
# (no gain on an H100), the scanned layer layout.
set -u
OUT=${1:-${OUT:-/tmp/gpu}}
ONLY=${ONLY:-machine,tests,aotab,longdecode,decode,tiles}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t0=$SECONDS
left() { local l=$((${BUDGET:-100000} - (SECONDS - t0))); echo $((l < $1 ? l : $1)); }
on() {
  [[ ",$ONLY," == *",$1,"* ]] || return 1
  if (($(left 30) < 30)); then echo && echo "== $1 skipped: BUDGET spent" && return 1; fi
  echo && echo "== $1 ($((SECONDS - t0)) s)"
}
quiet() { grep -v "^W0000\|^I0000"; }
DECODE=base:per-layer:8:ragged:1,base:per-layer:8:triton:1,base:per-layer:64:ragged:1
DECODE=$DECODE,base:per-layer:64:triton:1,fp8:per-layer:8:triton:1,fp8:per-layer:64:triton:1
AOT="--config configs/qwen3_moe.py:30b_a3b --set model.num_layers=2 --gpus 1 --mesh data=1 --full"
CMDBUF=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL

if on machine; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
  $PY -c "import jax, jax.numpy as jnp; from espo import sharding  # rollout.offload_state's copy
sharding.check_host_memory('--config.rollout', 'offload_state')
sh = sharding.replicated(sharding.make_mesh(data=1)); x = jax.device_put(jnp.ones((4096, 4096)), sh)
h = jax.device_put(x, sharding.in_memory(sh, sharding.HOST_MEMORY))
print('offload:', h.sharding.memory_kind, 'and back equal:', bool((jax.device_put(h, sh) == x).all()))"
fi
if on tests; then
  timeout $(left 180) $PY -m pytest -q -p no:cacheprovider tests/model/test_grouped.py \
    tests/model/test_experts.py tests/model/test_decode_attention.py \
    -k "triton or mosaic or gpu or skewed" \
    2>&1 | tee "$OUT/tests.log" | tail -15
fi
if on aotab; then
  for arm in "" "--set model.attention_impl=blocked" "--set model.moe_impl=capacity"; do
    echo "aotab: ${arm:-the defaults}"
    t=$(left 150)  # aot's own --timeout kills its compiling subprocess first and says where it was
    timeout $t $PY experiments/aot.py $AOT $arm --programs update --chip h200 --local \
      --max-rss-gb 100 --timeout $((t - 15)) 2>&1 | tee -a "$OUT/aotab.log" | quiet | grep "^| data"
  done
fi
if on longdecode; then
  timeout $(left 300) $PY experiments/bench_long_decode.py --model qwen3_L4 --rows 16 --new 64 \
    --reps 1 --moe-chunk 4096 --contexts 1024,8192,32768 --attention auto,dense \
    --json "$OUT/longdecode.json" \
    2>&1 | tee "$OUT/longdecode.log" | quiet
fi
if on aot; then
  t=$(left 300)
  timeout $t $PY experiments/aot.py $AOT ${AOT_EXTRA:-} --chip h200 --local --run \
    --max-rss-gb 100 --timeout $((t - 15)) \
    --json "$OUT/aot_gpu.json" 2>&1 | tee "$OUT/aot_gpu.log" | quiet | grep "^|"
fi
if on decode; then
  timeout $(left 200) $PY experiments/bench_moe.py --only decode --decode "$DECODE" \
    --json "$OUT/decode.json" --cache /tmp/jax_cache 2>&1 | tee "$OUT/decode.log" | quiet
fi
if on tiles; then
  timeout $(left 60) $PY experiments/bench_moe.py --only tiles --json "$OUT/tiles.json" \
    --cache /tmp/jax_cache 2>&1 | tee "$OUT/tiles.log" | quiet
fi
if on attention; then
  timeout $(left 100) $PY experiments/bench_moe.py --only attention --json "$OUT/attention.json" \
    --cache /tmp/jax_cache 2>&1 | tee "$OUT/attention.log" | quiet
fi
if on step; then
  timeout $(left 300) $PY experiments/bench_train.py --configs default,default:qwen3_shape --steps 5 \
    2>&1 | tee -a "$OUT/step.log" | quiet | tail -4
fi
if on moe; then
  timeout $(left ${MOE_LIMIT:-120}) $PY experiments/bench_moe.py --only hlo,gmm --json "$OUT/moe.json" \
    --cache /tmp/jax_cache 2>&1 | tee "$OUT/moe.log" | quiet
fi
if on aotcpu; then
  timeout $(left 900) $PY experiments/aot.py $AOT --chip h200 --json "$OUT/aot_emulated.json" \
    2>&1 | tee "$OUT/aot_emulated.log" | quiet | grep "^|"
fi
if on cmdbuf; then
  XLA_FLAGS="$CMDBUF" timeout $(left 100) $PY experiments/bench_moe.py --only decode \
    --decode base:per-layer:8:ragged:1,base:per-layer:64:ragged:1,base:per-layer:8:triton:1 \
    --json "$OUT/cmdbuf.json" --cache /tmp/jax_cache_cmdbuf 2>&1 | tee "$OUT/cmdbuf.log" | quiet
fi
echo "== done ($((SECONDS - t0)) s)"
