#!/usr/bin/env bash
# Benchmark-only environments (gitignored): the torchvision-style baselines need torchvision,
# which must never enter the library's own .venv or its tests. Installs from the wheels on local
# disk (pip's configured find-links / file indexes); idempotent.
#   bash benchmarks/env.sh      .venv-bench: decode, loader and peer benches
#                               (then: .venv-bench/bin/python benchmarks/bench_decode.py)
#   bash benchmarks/env.sh s3   .venv-s3bench: the object-storage benches, every peer reader
#                               (WebDataset, MosaicML Streaming, LitData, s3torchconnector), the
#                               S3 clients bench_s3_clients.py compares (s3fs, obstore, boto3)
#                               and the s3rver bucket (npm, under .venv-s3bench/node)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
KIND="${1:-bench}"
COMMON=(numpy pillow simplejpeg nvidia-dali-cuda120 psutil litdata mosaicml-streaming webdataset "moto[server]" s3fs)
case "$KIND" in
    bench) VENV=.venv-bench; EXTRA=(scikit-image spdl==0.8.0 torchdata==0.11.0) ;;  # spdl.io needs Debian's ffmpeg
    s3) VENV=.venv-s3bench; EXTRA=(s3torchconnector obstore boto3) ;;
    *) echo "usage: bash benchmarks/env.sh [bench|s3]" >&2; exit 2 ;;
esac
if [ "$KIND" = bench ] && ! ldconfig -p | grep -q libavcodec; then
    apt-get install -y -qq ffmpeg  # SPDL's decoder loads FFmpeg's libraries at run time
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torchvision, torch" 2>/dev/null; then
    "$VENV/bin/pip" install -q torch==2.14.1 torchvision==0.29.1
fi
"$VENV/bin/pip" install -q "${COMMON[@]}" "${EXTRA[@]}"
"$VENV/bin/pip" install -q -e .  # the library's own deps; torch 2.14.1 above already satisfies its torch requirement
if [ "$KIND" = s3 ] && [ ! -x "$VENV/node/node_modules/.bin/s3rver" ]; then
    mkdir -p "$VENV/node"
    (cd "$VENV/node" && npm install --silent --no-audit --no-fund s3rver@3.7.1)
fi
"$VENV/bin/python" -c "import torch, torchvision, nvidia.dali; print('bench env ok: torch', torch.__version__, 'torchvision', torchvision.__version__, 'dali', nvidia.dali.__version__)"
