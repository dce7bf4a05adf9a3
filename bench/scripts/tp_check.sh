#!/usr/bin/env bash
# One call on a multi-GPU machine: the tensor-parallel GPU tests and, with STEPS containing
# "bench", bench.e2e.tensor_parallel. Run from the repo root with the wheels on PYTHONPATH
# (bench/scripts/gpu_check.sh says how). Output goes to ${OUT:-results-local} (git-ignored),
# the servers' JSON logs of a failed test too.
# STEPS (default "tests"): any of "tests regress bench profile trace"; "trace" runs
# bench.e2e.tensor_parallel (--tp TRACE_RUNS, default 2,2) with every rank's step path
# traced (bench.profile.tp_trace, medians per batch in trace.md); "profile" runs
# bench.profile.tp_profile (the 8B at TP = 2, batch 1: per rank, kernels by class and which
# rank reaches the first collective last); "regress" runs the single-GPU step-path tests on
# GPU 1 while the world-of-one tests run on GPU 0. GPU tests are picked by the gpu marker
# and -k over tests/; WS1_K and TP2_K narrow the world-of-one and the multi-GPU tests.
# SHAPES and RUNS (--tp) are the benchmark's (a shape written name@4 runs at size 4 only;
# the default RUNS alternates TP = 2 and TP = 1 servers, for medians over starts; add
# 2:auto/off for the projections not sending into the all-reduce), LOAD_FORMAT its weights
# (default random: drawn on the GPUs, no checkpoint written first).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-results-local}
STEPS=${STEPS:-tests}
SHAPES=${SHAPES:-llama-3.2-1b,llama-3.1-8b}
RUNS=${RUNS:-2,1,2,1,2}
LOAD_FORMAT=${LOAD_FORMAT:-random}
WS1_K=${WS1_K:-}
TP2_K=${TP2_K:-}
mkdir -p "$OUT"
has() { [[ " $STEPS " == *" $1 "* ]]; }
log() { echo "== $* ($(date -u +%T))" | tee -a "$OUT/log.txt"; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/gpus.csv"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
if has regress; then
  log "single-GPU step-path tests on GPU 1"
  CUDA_VISIBLE_DEVICES=1 timeout 500 python -m pytest -q -m gpu -p no:cacheprovider tests/executor tests/service tests/system/tp_serving \
    -k "kv_primitives or pipelined or no_sync or decode_graphs or prefill_graphs or piecewise" \
    > "$OUT/gpu_single_gpu_regression.log" 2>&1 &
  regress=$!
fi
if has tests; then
  log "world of one through NCCL on GPU 0"
  CUDA_VISIBLE_DEVICES=0 timeout 400 python -m pytest -q -m gpu -p no:cacheprovider tests/executor tests/service tests/system/tp_serving \
    -k "world_of_one${WS1_K:+ and ($WS1_K)}" > "$OUT/gpu_world_of_one.log" 2>&1
  log "world of one: $(tail -1 "$OUT/gpu_world_of_one.log")"
fi
if has regress; then
  wait "$regress"
  log "single GPU: $(tail -1 "$OUT/gpu_single_gpu_regression.log")"
fi
if has tests; then
  log "TP=2 against TP=1 under graphs"
  rm -f /tmp/tp*-serve-*.log
  timeout 500 python -m pytest -q -m gpu -p no:cacheprovider -x tests/executor tests/service tests/system/tp_serving \
    -k "(tp_equals_tp1 or all_reduce_algorithms)${TP2_K:+ and ($TP2_K)}" \
    > "$OUT/gpu_tp2_test.log" 2>&1
  rc=$?
  log "TP=2: $(tail -1 "$OUT/gpu_tp2_test.log")"
  if [ $rc -ne 0 ]; then
    for f in /tmp/tp*-serve-*.log; do grep -v '"level": "info"' "$f" | tail -200 > "$OUT/$(basename "$f")"; done
  fi
fi
if has profile; then
  log "bench.profile.tp_profile (llama-3.1-8b, TP = 2, batch 1)"
  timeout 150 python -m bench.profile.tp_profile --model llama-3.1-8b --tp 2 --batches 1 \
    --load-format "$LOAD_FORMAT" --out "$OUT/prof" > "$OUT/prof.log" 2>&1
  log "profile rc=$?"
fi
if has trace; then
  log "bench.e2e.tensor_parallel traced ($SHAPES, --tp ${TRACE_RUNS:-2,2})"
  mkdir -p "$OUT/trace"
  MODEL_EXECUTOR_TP_TRACE="$OUT/trace" PYTHONPATH="bench/profile/tp_trace:${PYTHONPATH:-.}" \
    python -m bench.e2e.tensor_parallel --shapes "$SHAPES" --tp "${TRACE_RUNS:-2,2}" \
    --load-format "$LOAD_FORMAT" --no-all-reduce-table --out "$OUT/traced" \
    > "$OUT/traced.log" 2>&1
  log "traced rc=$?"
  python -m bench.profile.tp_trace "$OUT/trace" > "$OUT/trace.md" 2>&1
  head -30 "$OUT/trace.md"
fi
if has bench; then
  log "bench.e2e.tensor_parallel ($SHAPES)"
  python -m bench.e2e.tensor_parallel --shapes "$SHAPES" --tp "$RUNS" --load-format "$LOAD_FORMAT" \
    --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40
  log "bench done"
fi
