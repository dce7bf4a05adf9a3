#!/usr/bin/env bash
# Create .venv and install the project with its test tools and the demo extra (the GGUF
# reader that converts named models such as smollm2-135m), idempotently.
# torch is pinned to the CPU build that installs from local disk on CI machines; GPU
# machines bring their own torch (see bench/scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
fi
.venv/bin/python -m pip install -q -e ".[test,demo]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, transformers, grpc, executor" \
  || { echo "bootstrap: installation failed" >&2; exit 1; }
