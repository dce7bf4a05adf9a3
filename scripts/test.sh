#!/usr/bin/env bash
# The test command: install, lint, type-check, then the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
echo "== ruff"; .venv/bin/ruff check .
echo "== mypy"; .venv/bin/mypy executor service bench
# Triton's interpreter runs the attention kernels on CPU tensors; it must be chosen before
# triton is first imported, hence here.
export TRITON_INTERPRET=1
# Two pytest-xdist workers, each taking whole test files (--dist loadfile keeps a module's
# shared fixtures, servers and checkpoints, on one worker); TEST_WORKERS=0 runs in-process.
# Arguments come after, so `-n 0` given to this script wins.
echo "== pytest"; .venv/bin/python -m pytest -q -m "not gpu" \
  -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
