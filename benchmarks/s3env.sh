#!/usr/bin/env bash
# Object-storage benchmark environment (.venv-s3bench, gitignored): every peer reader of
# bench_s3_netns.py (WebDataset, MosaicML Streaming, LitData, s3torchconnector), the S3 clients
# bench_s3_clients.py compares (s3fs, obstore, boto3), torchvision for the peers' decode recipe,
# and the s3rver bucket (npm, under .venv-s3bench/node). None of it enters the library's .venv or
# its tests. Idempotent.
# Usage: bash benchmarks/s3env.sh   (then: PYTHONPATH=. .venv-s3bench/bin/python benchmarks/bench_s3_netns.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv-s3bench/bin/python ]; then
    "$PY" -m venv .venv-s3bench
fi
if ! .venv-s3bench/bin/python -c "import torchvision, torch" 2>/dev/null; then
    .venv-s3bench/bin/pip install -q torch==2.14.1 torchvision==0.29.1
fi
.venv-s3bench/bin/pip install -q numpy pillow simplejpeg psutil webdataset mosaicml-streaming \
    litdata s3torchconnector s3fs obstore boto3 "moto[server]" nvidia-dali-cuda120
.venv-s3bench/bin/pip install -q -e .  # the library's own deps; torch 2.14.1 above satisfies it
if [ ! -x .venv-s3bench/node/node_modules/.bin/s3rver ]; then
    mkdir -p .venv-s3bench/node
    (cd .venv-s3bench/node && npm install --silent --no-audit --no-fund s3rver@3.7.1)
fi
.venv-s3bench/bin/python -c "import webdataset, streaming, litdata, s3torchconnector, obstore; print('s3 bench env ok')"
