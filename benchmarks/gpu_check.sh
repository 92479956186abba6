#!/usr/bin/env bash
# One go on a GPU machine: find (or build from local wheels) a Python with CUDA torch, DALI and
# torchvision; run tests/gpu; run the decode benchmark with the GPU pipeline, train and eval
# presets; write every figure to $OUT (default benchmarks/out/gpu). Never reaches beyond
# package sources already configured for pip (the tree's benchmarks/wheels/, pip's find-links).
#
#   bash benchmarks/gpu_check.sh            # OUT=benchmarks/out/gpu
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/out/gpu}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
say() { echo "[gpu_check] $*" | tee -a "$LOG"; }

if ! nvidia-smi -L >"$OUT/nvidia-smi.txt" 2>&1; then
    say "no NVIDIA GPU visible on this machine (nvidia-smi -L failed): GPU figures not measured"
    exit 3
fi

has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }

PY=""
for cand in "${PYTHON:-}" .venv-bench/bin/python .venv-gpu/bin/python .venv/bin/python python3; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
    if has_cuda_torch "$cand"; then PY="$cand"; break; fi
done

FIND_LINKS=()
for d in benchmarks/wheels /opt/wheels /opt/pypi-more/files /opt/pypi/files; do
    [ -d "$d" ] && FIND_LINKS+=(--find-links "$d")
done

if [ -z "$PY" ]; then
    say "no Python with CUDA torch found; building .venv-gpu from local wheels"
    python3 -m venv --system-site-packages .venv-gpu >>"$LOG" 2>&1
    PY=.venv-gpu/bin/python
    "$PY" -m pip install -q "${FIND_LINKS[@]}" "torch==2.14.1" "torchvision==0.29.1" >>"$LOG" 2>&1 \
        || "$PY" -m pip install -q "${FIND_LINKS[@]}" torch torchvision >>"$LOG" 2>&1
    if ! has_cuda_torch "$PY"; then
        say "FAILED: no CUDA-enabled torch could be installed (see $LOG); GPU figures: not measured"
        nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
        exit 2
    fi
fi
say "python: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'))"

need=()
"$PY" -c "import nvidia.dali" 2>/dev/null || need+=(nvidia-dali-cuda120)
"$PY" -c "import torchvision" 2>/dev/null || need+=("torchvision==0.29.1")
for mod in numpy PIL simplejpeg skimage psutil pytest; do
    "$PY" -c "import $mod" 2>/dev/null || need+=("$(case $mod in PIL) echo pillow;; skimage) echo scikit-image;; *) echo $mod;; esac)")
done
if [ ${#need[@]} -gt 0 ]; then
    say "installing: ${need[*]}"
    "$PY" -m pip install -q "${FIND_LINKS[@]}" "${need[@]}" >>"$LOG" 2>&1 || say "WARNING: pip could not install all of: ${need[*]}"
fi
"$PY" -c "import stallfree" 2>/dev/null || "$PY" -m pip install -q -e . --no-deps >>"$LOG" 2>&1

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
"$PY" - >"$OUT/env.txt" 2>&1 <<'EOF'
import os, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
try:
    import nvidia.dali as d; print("dali", d.__version__)
except ImportError as e:
    print("dali missing:", e)
print("cpu cores", len(os.sched_getaffinity(0)))
EOF
cat "$OUT/env.txt" | tee -a "$LOG"

say "GPU tests (tests/gpu, tests/loader/test_cuda.py)"
"$PY" -m pytest tests/gpu tests/loader/test_cuda.py -q -rs -p no:cacheprovider >"$OUT/tests_gpu.txt" 2>&1
rc_tests=$?
tail -n 5 "$OUT/tests_gpu.txt" | tee -a "$LOG"

CORES=$(nproc)
rc_bench=0
for preset in train eval; do
    say "bench_decode --preset $preset --gpu (threads=$CORES)"
    "$PY" benchmarks/bench_decode.py --gpu --gpu-fp16 --preset "$preset" --images 512 --batch-size 128 \
        --rounds 3 --threads "$CORES" --json "$OUT/bench_$preset.json" >"$OUT/bench_$preset.txt" 2>&1 || rc_bench=1
    cat "$OUT/bench_$preset.txt" | tail -n 12 | tee -a "$LOG"
done
say "done: tests rc=$rc_tests, bench rc=$rc_bench; figures in $OUT"
[ $rc_tests -eq 0 ] && [ $rc_bench -eq 0 ]
