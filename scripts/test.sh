#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs what it needs, then runs pytest.
# Tests start their own redis-server and HTTP servers on loopback and stop them afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
