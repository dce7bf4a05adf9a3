#!/usr/bin/env bash
# buf checks of the API (proto/, rules in buf.yaml): lint, format, and breaking changes
# against the previous commit. buf comes from npm (@bufbuild/buf, pinned) into .cache/buf;
# if the registry cannot be reached the checks are skipped with a message (not failed).
set -euo pipefail
cd "$(dirname "$0")/.."
BUF_VERSION=1.75.0
DIR=.cache/buf
BUF="$DIR/node_modules/.bin/buf"
if [ ! -x "$BUF" ] || [ "$("$BUF" --version 2>/dev/null)" != "$BUF_VERSION" ]; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "buf: SKIPPED (npm is not installed; install Node.js to run buf lint/breaking)" >&2
    exit 0
  fi
  mkdir -p "$DIR"
  if ! npm install --prefix "$DIR" --no-audit --no-fund --silent \
      "@bufbuild/buf@$BUF_VERSION" >/dev/null 2>&1; then
    echo "buf: SKIPPED (could not install @bufbuild/buf@$BUF_VERSION from npm: registry" \
         "unreachable?)" >&2
    exit 0
  fi
fi
echo "== buf lint"; "$BUF" lint
echo "== buf format"; "$BUF" format -d --exit-code
# Breaking changes against the previous commit. A shallow clone may lack it: deepen by one
# if possible; on the first commit (or without history) there is nothing to compare.
if git rev-parse --verify -q HEAD~1 >/dev/null || \
   { git fetch -q --deepen=1 2>/dev/null && git rev-parse --verify -q HEAD~1 >/dev/null; }; then
  echo "== buf breaking (against HEAD~1)"
  "$BUF" breaking --against '.git#ref=HEAD~1'
else
  echo "buf breaking: SKIPPED (no previous commit in this clone)"
fi
