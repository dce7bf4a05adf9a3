#!/usr/bin/env bash
# One GPU run for FP8 (an FP8 GPU: compute capability 8.9+): the FP8 GPU tests, the w8a16
# tile sweep, the GEMM table and the 8B bf16-against-FP8 benchmark. Logs and JSON go to
# ${OUT:-results-local} (git-ignored). Usage on the GPU machine, from the repo root:
#   bash bench/scripts/fp8_check.sh
# TESTS=0 skips the tests, SWEEP=0 the tile sweep (SWEEP_OUT: the tile file it merges
# into, default $OUT/fp8_tiles.json; copy it to executor/quant/tiles.json to ship it),
# GEMM=0 the GEMM table, BENCH=0 the 8B benchmark. MODEL: the benchmark's shape.
set -uo pipefail
source "$(dirname "$0")/lab_env.sh"
rc=0
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -s -m gpu tests/executor/quant -p no:cacheprovider 2>&1 \
    | tee "$OUT/fp8_tests.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
if [ "${SWEEP:-1}" = 1 ]; then
  for shape in llama-3.2-1b llama-3.1-8b; do
    python3 -m bench.kernels.fp8_gemm --shape "$shape" --sweep --tokens 1 --tokens 4 \
      --tiles-out "${SWEEP_OUT:-$OUT/fp8_tiles.json}" 2>&1 | tee -a "$OUT/fp8_sweep.log"
  done
fi
if [ "${GEMM:-1}" = 1 ]; then
  python3 -m bench.kernels.fp8_gemm --shape llama-3.1-8b --out "$OUT" 2>&1 \
    | tee "$OUT/fp8_gemm.log"
fi
if [ "${BENCH:-1}" = 1 ]; then
  python3 -m bench.e2e.fp8 --model "${MODEL:-llama-3.1-8b}" --out "$OUT" 2>&1 \
    | tee "$OUT/fp8_bench.log"
  rc=$(( rc || PIPESTATUS[0] ))
fi
echo "fp8 check rc=$rc"
exit $rc
