#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs what it needs, then runs pytest once per torch
# version we support (2.13.0 in .venv, 2.14.1 in .venv-torch2.14; pyproject.toml states the range).
# Tests start their own redis-server and HTTP/S3 servers on loopback and stop them afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --all-torch || exit 1
status=0
for venv in .venv .venv-torch2.14; do
  echo "test.sh: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') ($venv)"
  "$venv/bin/python" -m pytest -q "$@"
  rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests" >&2
    rc=1
  fi
  [ "$rc" -ne 0 ] && status=$rc
done
exit "$status"
