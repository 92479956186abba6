#!/usr/bin/env bash
# Idempotent dev set-up: Debian packages (redis-server; gcc and libjpeg-turbo's headers for the C
# extension), a venv in .venv, Python packages.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server (apt-get)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
if [ ! -f /usr/include/jpeglib.h ] || ! command -v gcc >/dev/null 2>&1; then
  echo "setup: installing gcc and libjpeg62-turbo-dev (apt-get)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libjpeg62-turbo-dev >/dev/null
fi
# venv_for DIR REQUIREMENTS: a venv in DIR with REQUIREMENTS installed (again only when they changed).
venv_for() {
  local dir=$1 reqs=$2 stamp=$1/.stallfree-setup
  if [ ! -x "$dir/bin/python" ]; then
    python3 -m venv "$dir"
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$reqs" -nt "$stamp" ] \
    || [ setup.py -nt "$stamp" ] || [ stallfree/gpu_decode/_turbo.c -nt "$stamp" ] \
    || [ examples/requirements.txt -nt "$stamp" ]; then
    echo "setup: installing Python packages into $dir" >&2
    # examples/requirements.txt (Lightning): tests/examples runs the examples on every torch CI tests
    "$dir/bin/pip" install -q --disable-pip-version-check -r "$reqs" -r examples/requirements.txt
    touch "$stamp"
  fi
}
venv_for .venv requirements-dev.txt
if [ "${1:-}" = "--all-torch" ]; then  # the test suite also runs on the second torch version CI tests
  venv_for .venv-torch2.14 requirements-dev-torch2.14.txt
fi
