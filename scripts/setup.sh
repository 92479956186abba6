#!/usr/bin/env bash
# Idempotent dev set-up: Debian packages (redis-server; gcc and libjpeg-turbo's headers for the C
# extension), a venv in .venv, Python packages. Packages install with uv when it can be had (pip
# install uv): on a fresh 2-core machine it installs requirements-dev.txt in about 12 s where pip
# takes about 2 minutes (same packages, same versions). uv gets pip's configuration (indexes,
# find-links, constraints, certificate), so both pick the same wheels; without uv, pip installs.
# --compile-bytecode as pip does: else the test suite's first processes all compile torch's
# modules at once (a fresh clone's parallel pass took 5:48 against 4:19 with the .pyc there).
set -euo pipefail
cd "$(dirname "$0")/.."
# uv_pip_args DIR: the configuration pip in DIR's venv installs with (pip.conf files and PIP_*
# variables) as uv flags, one a line. uv reads neither, and without them it would miss the local
# wheels and indexes pip is pointed at. pip's precedence: PIP_* over [install] over [global]; its
# "best version across every index" is uv's unsafe-best-match.
uv_pip_args() {
  local line scope key value rank item
  declare -A values=() ranks=()
  while IFS= read -r line; do  # scope.key='value'
    scope=${line%%.*} key=${line#*.} key=${key%%=*} value=${line#*=} value=${value#\'} value=${value%\'}
    case $scope in
      :env:) rank=3 ;;
      install) rank=2 ;;
      global) rank=1 ;;
      *) continue ;;
    esac
    if [ "$rank" -gt "${ranks[$key]:-0}" ]; then
      values[$key]=$value ranks[$key]=$rank
    fi
  done < <("$1/bin/pip" config list 2>/dev/null)
  printf '%s\n' --index-strategy unsafe-best-match
  for key in index-url extra-index-url find-links constraint; do
    for item in ${values[$key]:-}; do  # pip splits these lists on whitespace
      case $key in
        constraint) printf '%s\n' --constraint "$item" ;;
        *) printf '%s\n' "--$key" "$item" ;;
      esac
    done
  done
  if [ -n "${values[cert]:-}" ]; then
    printf '%s\n' "CERT=${values[cert]}"
  fi
}
# uv_install DIR PIP-INSTALL-ARGS...: install with uv into DIR's venv; fails when uv cannot be had
# or cannot install them (then pip does).
uv_install() {
  local dir=$1 line flags=() cert_env=()
  shift
  if [ ! -x "$dir/bin/uv" ]; then
    "$dir/bin/pip" install -q --disable-pip-version-check uv >/dev/null 2>&1 || return 1
  fi
  while IFS= read -r line; do
    case $line in
      CERT=*) cert_env=("SSL_CERT_FILE=${line#CERT=}") ;;  # the CA bundle pip trusts, for uv
      *) flags+=("$line") ;;
    esac
  done < <(uv_pip_args "$dir")
  if ! env "${cert_env[@]}" "$dir/bin/uv" pip install -q --compile-bytecode --python "$dir/bin/python" "${flags[@]}" "$@"; then
    echo "setup: uv could not install into $dir; trying pip" >&2
    return 1
  fi
}
# ours DIR: whether DIR's venv imports stallfree from this checkout (an editable install made
# from another clone, since moved or deleted, left a venv whose subprocesses could not import it)
ours() {
  local want=$PWD/stallfree/__init__.py py=$1/bin/python
  case $py in /*) ;; *) py=$PWD/$py ;; esac
  (cd / && "$py" -c 'import sys, stallfree; sys.exit(stallfree.__file__ != sys.argv[1])' "$want") 2>/dev/null
}
# venv_for DIR REQUIREMENTS: a venv in DIR with REQUIREMENTS installed (again only when they changed).
venv_for() {
  local dir=$1 reqs=$2 stamp=$1/.stallfree-setup
  if [ ! -x "$dir/bin/python" ]; then
    python3 -m venv "$dir"
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$reqs" -nt "$stamp" ] \
    || [ setup.py -nt "$stamp" ] || [ stallfree/gpu_decode/_turbo.c -nt "$stamp" ] \
    || [ examples/requirements.txt -nt "$stamp" ] || ! ours "$dir"; then
    echo "setup: installing Python packages into $dir" >&2
    # examples/requirements.txt (Lightning): tests/examples runs the examples on every torch CI tests
    local wanted=(-r "$reqs" -r examples/requirements.txt)
    if ! uv_install "$dir" "${wanted[@]}"; then
      "$dir/bin/pip" install -q --disable-pip-version-check "${wanted[@]}"
    fi
    touch "$stamp"
  fi
}
# --uv-pip-args DIR: print the flags uv_install passes for DIR's pip configuration, one a line, and
# stop (tests/test_wheel.py installs a built wheel into a fresh venv with them)
if [ "${1:-}" = "--uv-pip-args" ]; then
  uv_pip_args "${2:-.venv}"
  exit 0
fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server (apt-get)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
if ! command -v java >/dev/null 2>&1; then  # Spark's JVM (tests/engines: --engine spark, write_spark)
  echo "setup: installing default-jre-headless (apt-get)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-jre-headless >/dev/null
fi
if [ ! -f /usr/include/jpeglib.h ] || ! command -v gcc >/dev/null 2>&1; then
  echo "setup: installing gcc and libjpeg62-turbo-dev (apt-get)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libjpeg62-turbo-dev >/dev/null
fi
venv_for .venv requirements-dev.txt
# setup.py goes on without the C JPEG decoder when it cannot build it; say so here, not later
.venv/bin/python -c 'import sys
from stallfree.gpu_decode.jpeg_info import jpeg_decoder
d = jpeg_decoder()
if d.name != "turbo":
    print(f"setup: WARNING: JPEGs will be decoded with {d.name}: {d.reason}", file=sys.stderr)'
bash scripts/formats_env.sh || echo "setup: no .venv-formats (MDS/LitData writers): their test skips" >&2
if [ "${1:-}" = "--all-torch" ]; then  # the test suite also runs on the second torch version CI tests
  venv_for .venv-torch2.14 requirements-dev-torch2.14.txt
fi
