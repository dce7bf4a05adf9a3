#!/usr/bin/env bash
# One GPU call for kernel work (issue 20): kernel tests, the skinny-GEMM bench, kernel
# tables and an interleaved A/B of call latency against a base tree, in one go.
# Usage on the GPU machine, from the repo root (PYTHONPATH set to include the wheels):
#   BASE=path/to/base/tree bash bench/kernel_check.sh
# BASE: a checkout of the code to compare with (it needs bench/kernel_table.py and
# bench/kernel_classes.py copied in if it predates them); without it, no A/B and no
# "before" tables; BASE_COMMIT names it in the results. Issue 20's whole before/after on
# one machine: main before its kernels, 282e7e2, prepared where the call can carry it:
#   git archive 282e7e2 executor service bench | gzip > .cache/gpu/base.tgz
# then on the GPU machine: mkdir base && tar xzf .cache/gpu/base.tgz -C base &&
#   cp bench/{kernel_table,kernel_classes,shapes,hardware,switches}.py base/bench/
# (today's kernel_table runs against that tree: checked on CPU up to the executor's
# construction). Logs go to $OUT/log.txt and $OUT/gpu_tests.log; JSON to $OUT.
# STEPS (default "tests skinny tables ab small") picks the parts; TESTS the test files and
# TESTS_K a -k filter; AB_ROUNDS and AB_ORDER the A/B processes; SHAPES the shapes written.
# "skinny" sweeps the skinny GEMM's tiles and writes them into this tree's kernels.
# "switch" (not in the default) times one kernel switch of bench/switches.py off against on:
# its GPU tests (SWITCH_TESTS), kernel tables and an interleaved A/B, e.g.
#   STEPS=switch SWITCH=pdl bash bench/kernel_check.sh
#   STEPS=switch SWITCH=fuse-decode-rope SWITCH_TESTS=tests/gpu/test_fused_rope_gpu.py ...
#   STEPS=switch SWITCH=skinny-row-kernel SWITCH_TESTS=tests/gpu/test_kernels.py ...
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-results-local}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
STEPS=${STEPS:-tests skinny tables ab small}
MODELS=/tmp/model-executor-bench
BASE=${BASE:-}
here=$(pwd)
log() { echo "== $* ($(date -u +%T))" | tee -a "$LOG"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
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
from bench import shapes
for name in '${SHAPES:-llama-3.2-1b smollm2-135m}'.split():
    print(shapes.write_shape(name, Path('$MODELS')))" 2>&1 | tee -a "$LOG"

if has skinny; then  # tune the tiles: they land in this tree's kernels (and in $OUT)
  log "skinny GEMM tile sweep, 1B"
  timeout 120 python3 -m bench.skinny_gemm --shape llama-3.2-1b \
    --tiles-out executor/kernels/skinny_tiles.json --out "$OUT" 2>&1 | tee -a "$LOG"
  cp executor/kernels/skinny_tiles.json "$OUT/" 2>/dev/null
fi
if has tests; then
  log "GPU tests"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/gpu/test_kernels.py \
    tests/gpu/test_decode_graphs.py} ${TESTS_K:+-k "$TESTS_K"} > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$?" | tee -a "$LOG"
  tail -n 15 "$OUT/gpu_tests.log" | tee -a "$LOG"
fi
if has tables; then
  for side in base new; do
    dir=$here; [ "$side" = base ] && dir=$BASE
    [ -z "$dir" ] && continue
    log "kernel table 1B ($side)"
    tree "$dir" timeout 120 python3 -m bench.kernel_table --model llama-3.2-1b --label "$side" \
      --out "$OUT" 2>&1 | grep -v "^|" | tee -a "$LOG"
  done
fi
if has ab && [ -n "$BASE" ]; then
  log "A/B call latency, 1B (base, new alternating)"
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for side in ${AB_ORDER:-base new}; do
      dir=$here; [ "$side" = base ] && dir=$BASE
      echo -n "$side round $round: " | tee -a "$LOG"
      tree "$dir" timeout 45 python3 -m bench.step_latency "$MODELS/llama-3.2-1b" --rounds 3 \
        --calls 40 2>&1 | tail -n 1 | tee -a "$LOG"
    done
  done
fi
if has small; then
  for side in base new; do
    dir=$here; [ "$side" = base ] && dir=$BASE
    [ -z "$dir" ] && continue
    log "kernel table SmolLM2-135M shape ($side)"
    tree "$dir" timeout 90 python3 -m bench.kernel_table --model smollm2-135m --label "$side" \
      --case decode:1 --case decode:8 --case prefill:128 --out "$OUT" 2>&1 | grep -v "^|" \
      | tee -a "$LOG"
  done
fi
if has switch; then  # one kernel switch off against on, same tree, same machine
  SWITCH=${SWITCH:-pdl}  # a bench/switches.py flag: pdl, fuse-decode-rope, skinny-row-kernel
  SWITCH_TESTS=${SWITCH_TESTS:-tests/gpu/test_pdl_gpu.py}
  log "--$SWITCH: GPU tests ($SWITCH_TESTS)"
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider $SWITCH_TESTS \
    > "$OUT/gpu_tests_$SWITCH.log" 2>&1
  echo "$SWITCH tests rc=$?" | tee -a "$LOG"
  tail -n 5 "$OUT/gpu_tests_$SWITCH.log" | tee -a "$LOG"
  for value in off on; do
    log "kernel table 1B (--$SWITCH $value)"
    timeout 120 python3 -m bench.kernel_table --model llama-3.2-1b --label "$SWITCH-$value" \
      --case decode:1 --case decode:8 --case decode:64 --case prefill:128 --$SWITCH $value \
      --out "$OUT" 2>&1 | grep -v "^|" | tee -a "$LOG"
  done
  log "A/B call latency, 1B (--$SWITCH off, on alternating)"
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for value in off on; do
      echo -n "--$SWITCH $value round $round: " | tee -a "$LOG"
      timeout 45 python3 -m bench.step_latency "$MODELS/llama-3.2-1b" --rounds 3 --calls 40 \
        --$SWITCH $value 2>&1 | tail -n 1 | tee -a "$LOG"
    done
  done
fi
for f in "$OUT"/kernel_table-*.md; do rm -f "$f"; done  # rebuilt from the JSON (--compare)
log "done"
