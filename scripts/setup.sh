#!/usr/bin/env bash
# Idempotent dev set-up: Debian packages (redis-server), a venv in .venv, Python packages.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server (apt-get)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.stallfree-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements-dev.txt -nt "$stamp" ]; then
  echo "setup: installing Python packages into .venv" >&2
  .venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
  touch "$stamp"
fi
