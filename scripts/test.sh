#!/usr/bin/env bash
# The test command: install, lint, type-check, then the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
echo "== ruff"; .venv/bin/ruff check .
echo "== mypy"; .venv/bin/mypy executor service
# Triton's interpreter runs the attention kernels on CPU tensors; it must be chosen before
# triton is first imported, hence here.
export TRITON_INTERPRET=1
echo "== pytest"; .venv/bin/python -m pytest -q -m "not gpu" "$@"
