#!/usr/bin/env bash
# One GPU run: the GPU tests, then the benchmarks. Logs and JSON go to ${OUT:-results-local}
# (git-ignored). Usage on the GPU machine, from the repo root:
#   bash bench/scripts/gpu_check.sh [quick|full]
# TESTS=0 skips the GPU tests (every test marked gpu under tests/), HOST_PROFILE=0 the
# host-time profile, BENCH=0 the benchmark, GRPC=0 the gRPC overhead.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-results-local}
mkdir -p "$OUT"
profile=${1:-quick}
# The folders that hold GPU tests: collecting tests/system/{deploy,reliability} needs the
# CPU suite's test extras (cryptography, kubernetes-validate), which GPU images lack.
GPU_TESTS=${GPU_TESTS:-tests/executor tests/service tests/system/tp_serving}
# Lab-host shims, for GPU machines without a package index: a .whl/ folder of wheels the
# machine's Python lacks (structlog, the grpc extras) is installed into /tmp/site, and a
# .fi_bundle.tar.gz (FlashInfer and its JIT cache, docs/flashinfer.md) is unpacked into
# /tmp/fib. Both are git-ignored; without them, nothing changes.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
if [ -f .fi_bundle.tar.gz ]; then
  mkdir -p /tmp/fib && tar -xzf .fi_bundle.tar.gz -C /tmp/fib \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fib CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
       FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} \
       FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws} MAX_JOBS=${MAX_JOBS:-16}
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" | tee "$OUT/flashinfer.txt"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
tests_rc=0
if [ "${TESTS:-1}" = 1 ]; then
  # One process per file: a device fault (an illegal address) poisons the CUDA context of
  # the process it happens in, and every later test there would fail with it.
  : > "$OUT/gpu_tests.log"
  for f in $(grep -rl --include='test_*.py' -E 'mark\.gpu' $GPU_TESTS | sort); do
    python3 -m pytest -q -m gpu "$f" -p no:cacheprovider > "$OUT/gpu_test_file.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && [ $rc -ne 5 ] && tests_rc=1  # 5: nothing collected (all deselected)
    echo "$f rc=$rc: $(tail -n 1 "$OUT/gpu_test_file.log")" | tee -a "$OUT/gpu_tests.log"
    grep -E '^(FAILED|ERROR)' "$OUT/gpu_test_file.log" | tee -a "$OUT/gpu_tests.log"
  done
fi
if [ "${HOST_PROFILE:-1}" = 1 ]; then  # where a step's host time goes (1B shape)
  python3 -m bench.profile.host_profile --model llama-3.2-1b --calls 100 --kernels 12 \
    --case prefill:breakable:128 --case prefill:tc_piecewise/inductor:128 \
    --case prefill:breakable:2048 --case decode:full:1 --case decode:breakable:1 \
    > "$OUT/host_profile.txt" 2>&1
  tail -n 24 "$OUT/host_profile.txt"
fi
bench_rc=0
if [ "${BENCH:-1}" = 1 ]; then
  python3 -m bench.e2e.run --profile "$profile" --out "$OUT" 2>&1 | tee "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
fi
if [ "${GRPC:-1}" = 1 ]; then  # gRPC Decode overhead over an in-process call (tiny on CUDA)
  python3 -m bench.serving.grpc_overhead --device cuda --out "$OUT" 2>&1 | tail -n 12
fi
echo "gpu tests rc=$tests_rc bench rc=$bench_rc"
[ -f "$OUT/gpu_tests.log" ] && tail -n 3 "$OUT/gpu_tests.log"
exit $(( tests_rc || bench_rc ))
