#!/usr/bin/env bash
# One GPU call for kernel work: kernel GPU tests, the skinny-GEMM tile sweep, kernel tables
# and an interleaved A/B of call latency against a base tree, in one go. Output goes to
# ${OUT:-results-local} (git-ignored): logs in log.txt and gpu_tests.log, JSON beside them.
# Usage on the GPU machine, from the repo root (PYTHONPATH set to include the wheels):
#   BASE=path/to/base/tree bash bench/scripts/kernel_check.sh
# BASE: a copy of the code to compare with, e.g. from `git archive COMMIT executor service
# bench | gzip > base.tgz` unpacked on the GPU machine; its own bench measures it, in this
# layout (bench/profile/...) or the flat one before it (bench/kernel_table.py). Without
# BASE, no A/B and no "before" tables; BASE_COMMIT names it in the results.
# STEPS (default "tests skinny tables ab small") picks the parts; TESTS the pytest paths
# (default tests) and TESTS_K the -k filter of the GPU tests (default "kernels or
# decode_graphs"); AB_ROUNDS and AB_ORDER the A/B processes; SHAPES the shapes written.
# "skinny" sweeps the skinny GEMM's tiles and writes them into this tree's kernels.
# "switch" (not in the default) times one kernel switch of bench/common/switches.py off
# against on: its GPU tests (-k SWITCH_K), kernel tables and an interleaved A/B, e.g.
#   STEPS=switch SWITCH=pdl bash bench/scripts/kernel_check.sh
#   STEPS=switch SWITCH=fuse-decode-rope SWITCH_K=fused_rope bash bench/scripts/kernel_check.sh
#   STEPS=switch SWITCH=skinny-row-kernel SWITCH_K="skinny or row_kernel" ...
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-results-local}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the base tree's runs cd elsewhere
LOG="$OUT/log.txt"
STEPS=${STEPS:-tests skinny tables ab small}
MODELS=/tmp/model-executor-bench
BASE=${BASE:-}
here=$(pwd)
log() { echo "== $* ($(date -u +%T))" | tee -a "$LOG"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
mod() {  # mod DIR MODULE: MODULE (bench.GROUP.NAME) as DIR's bench lays it out
  if [ -d "$1/bench/common" ]; then echo "$2"; else echo "bench.${2##*.}"; fi
}
tree() {  # tree DIR cmd...: run a command from a checkout's root (base: its commit)
  local dir=$1; shift
  local commit=${MODEL_EXECUTOR_COMMIT:-unknown}
  [ "$dir" = "$BASE" ] && commit=${BASE_COMMIT:-base}
  (cd "$dir" && PYTHONPATH=".:${PYTHONPATH#.:}" MODEL_EXECUTOR_COMMIT=$commit "$@")
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
  --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$LOG"
log "writing bench shapes"
python3 -c "
from pathlib import Path
from bench.common import shapes
for name in '${SHAPES:-llama-3.2-1b smollm2-135m}'.split():
    print(shapes.write_shape(name, Path('$MODELS')))" 2>&1 | tee -a "$LOG"

if has skinny; then  # tune the tiles: they land in this tree's kernels (and in $OUT)
  log "skinny GEMM tile sweep, 1B"
  timeout 120 python3 -m bench.kernels.skinny_gemm --shape llama-3.2-1b \
    --tiles-out executor/kernels/skinny/tiles.json --out "$OUT" 2>&1 | tee -a "$LOG"
  cp executor/kernels/skinny/tiles.json "$OUT/" 2>/dev/null
fi
if has tests; then
  log "GPU tests"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/executor tests/service tests/system/tp_serving} \
    -k "${TESTS_K:-kernels or decode_graphs}" > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$?" | tee -a "$LOG"
  tail -n 15 "$OUT/gpu_tests.log" | tee -a "$LOG"
fi
if has tables; then
  for side in base new; do
    dir=$here; [ "$side" = base ] && dir=$BASE
    [ -z "$dir" ] && continue
    log "kernel table 1B ($side)"
    tree "$dir" timeout 120 python3 -m "$(mod "$dir" bench.profile.kernel_table)" \
      --model llama-3.2-1b --label "$side" \
      --out "$OUT" 2>&1 | grep -v "^|" | tee -a "$LOG"
  done
fi
if has ab && [ -n "$BASE" ]; then
  log "A/B call latency, 1B (base, new alternating)"
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for side in ${AB_ORDER:-base new}; do
      dir=$here; [ "$side" = base ] && dir=$BASE
      echo -n "$side round $round: " | tee -a "$LOG"
      tree "$dir" timeout 45 python3 -m "$(mod "$dir" bench.e2e.step_latency)" \
        "$MODELS/llama-3.2-1b" --rounds 3 \
        --calls 40 2>&1 | tail -n 1 | tee -a "$LOG"
    done
  done
fi
if has small; then
  for side in base new; do
    dir=$here; [ "$side" = base ] && dir=$BASE
    [ -z "$dir" ] && continue
    log "kernel table SmolLM2-135M shape ($side)"
    tree "$dir" timeout 90 python3 -m "$(mod "$dir" bench.profile.kernel_table)" \
      --model smollm2-135m --label "$side" \
      --case decode:1 --case decode:8 --case prefill:128 --out "$OUT" 2>&1 | grep -v "^|" \
      | tee -a "$LOG"
  done
fi
if has switch; then  # one kernel switch off against on, same tree, same machine
  SWITCH=${SWITCH:-pdl}  # a bench/common/switches.py flag: pdl, fuse-decode-rope, skinny-row-kernel
  SWITCH_K=${SWITCH_K:-pdl}
  log "--$SWITCH: GPU tests (-k $SWITCH_K)"
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/executor tests/service tests/system/tp_serving -k "$SWITCH_K" \
    > "$OUT/gpu_tests_$SWITCH.log" 2>&1
  echo "$SWITCH tests rc=$?" | tee -a "$LOG"
  tail -n 5 "$OUT/gpu_tests_$SWITCH.log" | tee -a "$LOG"
  for value in off on; do
    log "kernel table 1B (--$SWITCH $value)"
    timeout 120 python3 -m bench.profile.kernel_table --model llama-3.2-1b --label "$SWITCH-$value" \
      --case decode:1 --case decode:8 --case decode:64 --case prefill:128 --$SWITCH $value \
      --out "$OUT" 2>&1 | grep -v "^|" | tee -a "$LOG"
  done
  log "A/B call latency, 1B (--$SWITCH off, on alternating)"
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for value in off on; do
      echo -n "--$SWITCH $value round $round: " | tee -a "$LOG"
      timeout 45 python3 -m bench.e2e.step_latency "$MODELS/llama-3.2-1b" --rounds 3 --calls 40 \
        --$SWITCH $value 2>&1 | tail -n 1 | tee -a "$LOG"
    done
  done
fi
for f in "$OUT"/kernel_table-*.md; do rm -f "$f"; done  # rebuilt from the JSON (--compare)
log "done"
