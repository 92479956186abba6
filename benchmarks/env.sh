#!/usr/bin/env bash
# Benchmark-only environment (.venv-bench, gitignored): the torchvision-style baseline needs
# torchvision, which must never enter the library's own .venv or its tests. Installs from the
# wheels on local disk (pip's configured find-links / file indexes); idempotent.
# Usage: bash benchmarks/env.sh   (then: .venv-bench/bin/python benchmarks/bench_decode.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv-bench/bin/python ]; then
    "$PY" -m venv .venv-bench
fi
if ! .venv-bench/bin/python -c "import torchvision, torch" 2>/dev/null; then
    .venv-bench/bin/pip install -q torch==2.14.1 torchvision==0.29.1
fi
.venv-bench/bin/pip install -q numpy pillow simplejpeg nvidia-dali-cuda120 scikit-image psutil litdata mosaicml-streaming webdataset "moto[server]" s3fs
.venv-bench/bin/pip install -q -e .  # the library's own deps; torch 2.14.1 above already satisfies its torch requirement
.venv-bench/bin/python -c "import torch, torchvision, nvidia.dali; print('bench env ok: torch', torch.__version__, 'torchvision', torchvision.__version__, 'dali', nvidia.dali.__version__)"
