#!/usr/bin/env bash
# .venv-dlio: DLIO 2.0.0 (the harness under MLPerf Storage), to run its own AU measurement over our
# loader (benchmarks/dlio/). dlio-benchmark's metadata pulls tensorflow, nvidia-dali-cuda110,
# torchaudio and torchvision; its npz + PyTorch + DALI path needs none of those but DALI and, alas,
# TensorFlow: dlio_benchmark/main.py imports profiler/profiler_factory.py, which imports
# tf_profiler.py, which imports tensorflow at module level, whatever the framework. So it is
# installed with --no-deps plus what that path imports (found by running it): hydra-core and
# omegaconf (its config), pydftracer (its profiler: the fallback DLIO defines when pydftracer is
# missing cannot be called, so it is required), mpi4py (its ranks; needs an MPI from Debian's
# packages), and tensorflow-cpu with its own dependencies (the CPU build: no CUDA wheels). torch, numpy, pandas, psutil, PyYAML, DALI and stallfree itself come from .venv
# through a .pth file read after this venv's own site-packages: one torch on the machine.
# Idempotent: a second run with the same pins does nothing (a stamp file records them).
#   bash scripts/dlio_env.sh
#   bash benchmarks/dlio/run_dlio.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.venv-dlio
pins=(dlio-benchmark==2.0.0 pydftracer==1.0.2 hydra-core==1.3.2 omegaconf==2.3.0
      antlr4-python3-runtime==4.9.3 mpi4py==4.1.2)
tensorflow=tensorflow-cpu==2.21.0
stamp=$dir/.stallfree-dlio
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]} $tensorflow" ] && [ -x "$dir/bin/python" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "dlio_env: .venv is missing (run scripts/setup.sh first)" >&2
  exit 1
fi
if ! command -v mpirun >/dev/null; then
  echo "dlio_env: installing Open MPI from Debian's packages" >&2
  apt-get install -y -qq libopenmpi-dev openmpi-bin
fi
[ -x "$dir/bin/python" ] || .venv/bin/python -m venv "$dir"
"$dir/bin/pip" install -q --disable-pip-version-check --no-deps "${pins[@]}"
ours=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
theirs=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$theirs" > "$ours/zz_stallfree_dotvenv.pth"  # (zz: after the venv's own .pth files)
# with its dependencies, after the .pth: pip then sees .venv's numpy and keeps it
"$dir/bin/pip" install -q --disable-pip-version-check "$tensorflow"
"$dir/bin/python" -c "import dlio_benchmark.main, mpi4py.MPI, stallfree; print('dlio env ok')"
printf '%s' "${pins[*]} $tensorflow" > "$stamp"
