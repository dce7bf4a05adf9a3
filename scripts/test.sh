#!/usr/bin/env bash
# The test command: install, lint, type-check, then the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
echo "== ruff"; .venv/bin/ruff check .
echo "== mypy"; .venv/bin/mypy executor service
echo "== pytest"; .venv/bin/python -m pytest -q -m "not gpu" "$@"
