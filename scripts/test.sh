#!/usr/bin/env bash
# The whole test suite, on a fresh machine: installs what it needs, then runs every test on torch
# 2.13.0 (.venv), in parallel (pytest-xdist: one process per core and one more, for the tests
# that wait on subprocesses and servers; the suite keeps 2 cores 96% busy, and each more process
# collects the suite and starts its own zygotes and servers again: on 2 cores, 3 processes took
# 521 and 502 s for the parallel pass, 4 took 560 and 533, run in turn on one clone). Tests
# marked `serial` watch machine-wide state (/dev/shm, the process table) and run afterwards,
# alone.
#
#   bash scripts/test.sh [PYTEST ARGS]          the README's command
#   bash scripts/test.sh --all-torch [ARGS]     also the tests that exercise torch itself on torch
#                                               2.14.1 (.venv-torch2.14); what .ci/run runs
#
# On torch 2.14.1 only the tests that exercise torch run again: the loader (whose torch internals
# sit behind loader/_torch_compat.py), mixtures and token streams through it, decode- and
# cache-through-the-loader, the examples. The rest (shard formats, cache tiers, the CLI, decoders)
# does not depend on the torch version. Arguments go to pytest and select the same tests on both.
# Tests start their own redis-server and HTTP/S3 servers on loopback and stop them afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
all_torch=0
if [ "${1:-}" = "--all-torch" ]; then
  all_torch=1
  shift
fi
if [ "$all_torch" = 1 ]; then
  bash scripts/setup.sh --all-torch || exit 1
else
  bash scripts/setup.sh || exit 1
fi
TORCH_TESTS=(
  tests/loader tests/mix tests/tokens tests/examples tests/integrations tests/test_imports.py tests/test_package.py
  tests/gpu_decode/test_loader.py tests/cache/test_loader_integration.py tests/harness/test_units.py
)
jobs=$(( $(nproc) + 1 ))
# This checkout's modules compiled once, up front: the suite starts hundreds of interpreters (CLI
# runs, scripts, spawned workers and ranks) that import stallfree, and where PYTHONDONTWRITEBYTECODE
# is set (this machine's environment sets it) none of them writes the .pyc it compiled, so each one
# compiled the package again (about 0.3 CPU-s a process); elsewhere the first ones all compile the
# same modules at once. compileall writes .pyc whatever that variable says, and skips what is current.
.venv/bin/python -m compileall -q -j 0 stallfree tests benchmarks examples >/dev/null \
  || echo "test.sh: compileall could not compile every file (pytest shows where)" >&2
# One OpenMP thread per process unless the caller chose: with two pytest workers per core, each
# with its own subprocesses, torch's default (one intra-op thread per core) oversubscribes the
# CPUs and its threads wait for each other (tests/gpu_decode's decode tests: 13 % less CPU).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
status=0

# run VENV ARGS...: pytest in VENV; sets rc (pytest's exit code: 5 = nothing collected)
run() {
  local venv=$1
  shift
  "$venv/bin/python" -m pytest -q "$@"
  rc=$?
}

venvs=(.venv)
[ "$all_torch" = 1 ] && venvs+=(.venv-torch2.14)
for venv in "${venvs[@]}"; do
  echo "test.sh: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') ($venv)"
  if [ "$#" -gt 0 ]; then
    args=("$@")
  elif [ "$venv" = .venv ]; then
    args=()
  else
    args=("${TORCH_TESTS[@]}")
  fi
  run "$venv" -n "$jobs" --dist loadgroup -m "not serial" "${args[@]}"
  parallel_rc=$rc
  serial_args=("${args[@]}")
  if [ "$#" -eq 0 ]; then  # only the files that mark tests serial: collecting all of tests/ costs 5 s
    mapfile -t serial_args < <(grep -rl --include='*.py' 'mark\.serial' tests | sort)
  fi
  run "$venv" -m serial "${serial_args[@]}"
  serial_rc=$rc
  if [ "$parallel_rc" -eq 5 ] && [ "$serial_rc" -eq 5 ]; then  # pytest's "no tests ran"
    echo "test.sh: pytest collected no tests" >&2
    status=1
  fi
  for r in "$parallel_rc" "$serial_rc"; do
    if [ "$r" -ne 0 ] && [ "$r" -ne 5 ]; then
      status=$r
    fi
  done
done
exit "$status"
