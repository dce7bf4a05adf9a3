#!/usr/bin/env bash
# Start the service on the embedded default model (flags are passed through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/model-executor serve "$@"
