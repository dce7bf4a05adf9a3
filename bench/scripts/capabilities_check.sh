#!/usr/bin/env bash
# One GPU run for the benchmarks of the served families and controls, each against its
# target ratio: the Qwen3-30B-A3B shape (MoE, against its active-weight floor), the Gemma 3
# 12B shape's decode (against its floor), masked and grammar-constrained decode (against
# plain decode), and, with two GPUs, a weight update from a trainer process and Sleep /
# WakeUp. Logs and JSON go to ${OUT:-results-local}. Usage on the GPU machine, from the
# repo root: bash bench/scripts/capabilities_check.sh. STEPS picks a subset
# ("moe gemma sampling weights"); each step has its own time limit (LIMIT, seconds).
set -uo pipefail
LIMIT=${LIMIT:-540}
source "$(dirname "$0")/lab_env.sh"
rc=0
run() {  # name, command...: one step under the time limit, its log kept
  local name=$1; shift
  timeout "$LIMIT" "$@" > "$OUT/$name.log" 2>&1
  local step_rc=$?
  echo "== $name rc=$step_rc"; tail -n 20 "$OUT/$name.log"
  rc=$(( rc || step_rc ))
}
for step in ${STEPS:-moe gemma sampling weights}; do
  case $step in
    moe) run moe python3 -m bench.e2e.moe --out "$OUT" ;;
    gemma) run gemma python3 -m bench.profile.kernel_table --model gemma-3-12b \
             --load-format random --case decode:1 --case decode:8 --out "$OUT" --label gemma ;;
    sampling) run sampling python3 -m bench.serving.sampling_controls --shape llama-3.2-1b \
                --batch 64 --steps 200 --out "$OUT" ;;
    weights) run weights python3 -m bench.e2e.weights --shape llama-3.1-8b --out "$OUT" ;;
    *) echo "unknown step $step (moe, gemma, sampling, weights)"; rc=1 ;;
  esac
done
exit $rc
