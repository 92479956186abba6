#!/usr/bin/env bash
# DLIO's own AU for its built-in `pytorch` and `dali` loaders and for stallfree's (the plug-in in
# stallfree_dlio.py), one run each, on the same DLIO-generated data, the same ranks.
#   bash benchmarks/dlio/run_dlio.sh                 # both workloads, 2 ranks
#   NRANKS=1 bash benchmarks/dlio/run_dlio.sh unet3d_h100_small
# Output: benchmarks/out/dlio/<workload>-<loader>-n<N>/summary.json (DLIO's) and the table of
# benchmarks/dlio/summarize.py. Needs scripts/dlio_env.sh (run first here).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/dlio_env.sh
py=$PWD/.venv-dlio/bin/python
out=benchmarks/out/dlio
ranks=${NRANKS:-2}
workloads=("$@")
[ ${#workloads[@]} -gt 0 ] || workloads=(unet3d_h100_small resnet50_h100_small)
export PYTHONPATH=$PWD/benchmarks/dlio${PYTHONPATH:+:$PYTHONPATH}
# Open MPI refuses root without these, wants more slots than cores to oversubscribe, and binds each
# rank to one core unless told not to (the harness of stallfree bench binds nothing either)
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TF_CPP_MIN_LOG_LEVEL=2
mkdir -p "$out"
for wl in "${workloads[@]}"; do
  model=${wl%%_*}
  if [ ! -f "$out/data/$model/.generated" ]; then
    echo "== generating $wl" >&2
    rm -rf "$out/data/$model"
    "${mpi[@]}" 1 "$py" -m dlio_benchmark.main --config-dir "$PWD/benchmarks/dlio/configs" workload="$wl" \
      ++workload.workflow.generate_data=True ++workload.workflow.train=False \
      ++workload.output.folder="$out/gen-$wl" hydra.run.dir="$out/hydra"
    touch "$out/data/$model/.generated"
  fi
  for loader in pytorch dali stallfree; do
    run="$out/$wl-$loader-n$ranks"
    rm -rf "$run"
    extra=(++workload.reader.data_loader=pytorch)
    case $loader in
      dali) extra=(++workload.reader.data_loader=dali) ;;
      stallfree) extra+=(++workload.reader.data_loader_classname=stallfree_dlio.StallfreeDataLoader
                         ++workload.reader.data_loader_sampler=index) ;;
    esac
    echo "== $wl $loader, $ranks ranks" >&2
    nice -n 10 "${mpi[@]}" "$ranks" "$py" -m dlio_benchmark.main --config-dir "$PWD/benchmarks/dlio/configs" \
      workload="$wl" "${extra[@]}" ++workload.output.folder="$run" hydra.run.dir="$out/hydra" \
      > "$run.log" 2>&1 || { echo "FAILED: see $run.log" >&2; tail -20 "$run.log" >&2; }
  done
done
"$py" benchmarks/dlio/summarize.py "$out"
