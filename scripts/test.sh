#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs what it needs, then runs pytest: every test
# on torch 2.13.0 (.venv), and again on torch 2.14.1 (.venv-torch2.14; pyproject.toml states the
# range) the tests that exercise torch itself: the loader (whose torch internals sit behind
# loader/_torch_compat.py), mixtures and token streams through it, the decode-through-the-loader
# and cache-through-the-loader tests and the examples. The rest (shard formats, cache tiers, the
# CLI, decoders) does not depend on the torch version, and running it twice would double CI time.
# Arguments go to pytest and then select the same tests on both versions.
# Tests start their own redis-server and HTTP/S3 servers on loopback and stop them afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --all-torch || exit 1
TORCH_TESTS=(
  tests/loader tests/mix tests/tokens tests/examples tests/test_imports.py tests/test_package.py
  tests/gpu_decode/test_loader.py tests/cache/test_loader_integration.py tests/harness/test_units.py
)
status=0
for venv in .venv .venv-torch2.14; do
  echo "test.sh: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') ($venv)"
  if [ "$#" -gt 0 ]; then
    args=("$@")
  elif [ "$venv" = .venv ]; then
    args=()
  else
    args=("${TORCH_TESTS[@]}")
  fi
  "$venv/bin/python" -m pytest -q "${args[@]}"
  rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests" >&2
    rc=1
  fi
  [ "$rc" -ne 0 ] && status=$rc
done
exit "$status"
