#!/usr/bin/env bash
# One go on a GPU machine with no network (the one lent here: Python 3.12, torch 2.11 + CUDA 13,
# torchvision 0.26, no DALI): install nvImageCodec + nvJPEG from the wheels carried in the tree
# (third_party/wheels/, fetched beforehand by benchmarks/fetch_gpu_wheels.sh, git-ignored), run
# the GPU tests, run benchmarks/bench_gpu.py (ours on nvImageCodec vs torchvision.io.decode_jpeg
# on CUDA, uint8 and float32 out), and write every figure to $OUT (default benchmarks/out/gpu):
#   gpu_check.log  env.txt  nvidia-smi.txt  tests_gpu.txt  bench_gpu.txt  bench_gpu.json  bench_gpu.md
# Nothing is fetched: pip runs with --no-index on the carried wheels only.
#
#   bash benchmarks/fetch_gpu_wheels.sh     # here, where PyPI is reachable (once)
#   bash benchmarks/gpu_check.sh            # there; OUT=/some/dir to choose where figures go
#
# Stage time limits (seconds): TESTS_TIMEOUT (default 200), BENCH_TIMEOUT (default 200).
# Exit status: 0 all passed; 1 tests or benchmark failed; 2 no usable CUDA torch; 3 no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
OUT="${OUT:-benchmarks/out/gpu}"
WHEELS="${WHEELS:-third_party/wheels}"
SITE="${SITE:-/tmp/stallfree-gpu-site}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-200}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-200}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
export PYTHONUNBUFFERED=1
export PYNVIMGCODEC_VERBOSITY="${PYNVIMGCODEC_VERBOSITY:-1}"  # nvImageCodec's own log: errors only

if ! nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1; then
    say "no NVIDIA GPU visible on this machine (nvidia-smi failed): GPU figures not measured"
    exit 3
fi

PY=""
for cand in "${PYTHON:-}" python3 .venv-bench/bin/python .venv/bin/python; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
    if "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
        PY="$cand"
        break
    fi
done
if [ -z "$PY" ]; then
    say "FAILED: no Python whose torch sees the GPU (tried \$PYTHON, python3, .venv-bench, .venv)"
    exit 2
fi
say "python: $(command -v "$PY") ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, torch.cuda.get_device_name(0))'))"

# nvImageCodec + nvJPEG into one folder: nvImageCodec finds libnvjpeg through its rpath
# ($ORIGIN/../../cu13/lib), so both must land under the same nvidia/ tree.
if "$PY" -c "import nvidia.nvimgcodec" >/dev/null 2>&1; then
    say "nvImageCodec already importable; not installing the carried wheels"
elif compgen -G "$WHEELS/*.whl" >/dev/null; then
    say "installing carried wheels into $SITE: $(cd "$WHEELS" && ls ./*.whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl >>"$LOG" 2>&1 || say "WARNING: pip could not install the wheels (see $LOG)"
else
    say "WARNING: no wheels in $WHEELS (run benchmarks/fetch_gpu_wheels.sh where PyPI is reachable, carry $WHEELS)"
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# The CPU backend's region decoder (a C extension; the tree carries no binaries). Optional: without
# a compiler or libjpeg headers the CPU backend uses PIL, which stats()["jpeg_library"] reports.
if ! "$PY" -c "import stallfree.gpu_decode._turbo" >/dev/null 2>&1; then
    if timeout 120 "$PY" setup.py -q build_ext --inplace >>"$LOG" 2>&1 \
        && "$PY" -c "import stallfree.gpu_decode._turbo" >/dev/null 2>&1; then
        say "built the CPU backend's region decoder (stallfree/gpu_decode/_turbo)"
    else
        say "could not build the CPU backend's region decoder here (see $LOG): CPU backend uses PIL"
    fi
fi

"$PY" - >"$OUT/env.txt" 2>&1 <<'EOF'
import os, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("cpu cores", len(os.sched_getaffinity(0)))
for mod in ("torchvision", "nvidia.nvimgcodec", "nvidia.dali", "PIL", "numpy", "skimage", "psutil", "pytest"):
    try:
        m = __import__(mod, fromlist=["__version__"])
        print(mod, getattr(m, "__version__", "?"))
    except ImportError as exc:
        print(mod, "missing:", exc)
from stallfree.gpu_decode.select import ImageDecode
st = ImageDecode(train=True, size=224).stats()
print("ImageDecode auto ->", st["backend"], "|", st["reason"])
EOF
tee -a "$LOG" <"$OUT/env.txt"

say "GPU tests: tests/gpu tests/loader/test_cuda.py tests/gpu_decode/test_orientation.py (limit ${TESTS_TIMEOUT}s)"
timeout "$TESTS_TIMEOUT" "$PY" -m pytest tests/gpu tests/loader/test_cuda.py tests/gpu_decode/test_orientation.py -q -rs -p no:cacheprovider \
    >"$OUT/tests_gpu.txt" 2>&1
rc_tests=$?
[ $rc_tests -eq 124 ] && say "GPU tests ran past ${TESTS_TIMEOUT}s and were stopped"
tail -n 25 "$OUT/tests_gpu.txt" | tee -a "$LOG"

say "benchmark: bench_gpu.py, train preset, uint8 + float32 (limit ${BENCH_TIMEOUT}s)"
timeout "$BENCH_TIMEOUT" "$PY" benchmarks/bench_gpu.py --preset train --json "$OUT/bench_gpu.json" \
    --md "$OUT/bench_gpu.md" >"$OUT/bench_gpu.txt" 2>&1
rc_bench=$?
[ $rc_bench -eq 124 ] && say "benchmark ran past ${BENCH_TIMEOUT}s and was stopped"
tail -n 16 "$OUT/bench_gpu.txt" | tee -a "$LOG"

say "done: tests rc=$rc_tests, bench rc=$rc_bench; figures in $OUT"
[ $rc_tests -eq 0 ] && [ $rc_bench -eq 0 ]
