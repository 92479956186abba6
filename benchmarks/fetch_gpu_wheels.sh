#!/usr/bin/env bash
# Download, HERE (where pip can reach PyPI), the wheels benchmarks/gpu_check.sh installs offline on
# the lent GPU machine: nvImageCodec for CUDA 13 and the nvJPEG runtime it loads. That machine has
# Python 3.12, torch 2.11 + CUDA 13 and torchvision 0.26 but no network and no DALI; DALI's CUDA 13
# wheel (199 MB) would not fit the 64 MiB of tree that travels there, these two (~30 MB) do.
# The folder is git-ignored: carry it (`carry: ["third_party/wheels"]`) in the device call.
#
#   bash benchmarks/fetch_gpu_wheels.sh                # into third_party/wheels/
#   PYVER=3.12 DEST=/tmp/w bash benchmarks/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${DEST:-third_party/wheels}"
PYVER="${PYVER:-3.12}"           # the GPU machine's python3 (KINDS.md: 3.12.3)
PIP="${PIP:-python3 -m pip}"
# Pinned so a run's figures name what ran; one version of each (two would stop the offline install).
WHEELS=("nvidia-nvimgcodec-cu13==0.9.0.20" "nvidia-nvjpeg==13.2.3.58")
LIMIT_MIB=60                      # leaves room for the tree itself within the 64 MiB that travels

mkdir -p "$DEST"
for w in "${WHEELS[@]}"; do
    name="${w%%==*}"
    rm -f "$DEST/${name//-/_}"-*.whl   # an older pin's wheel would clash with this one
    $PIP download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_28_x86_64 -d "$DEST" "$w"
done
ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -n 1 | cut -f1)
echo "total: $((total / 1024 / 1024)) MiB in $DEST"
if [ "$total" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "FAILED: wheels exceed ${LIMIT_MIB} MiB; they would not travel with the tree" >&2
    exit 1
fi
