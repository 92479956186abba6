#!/usr/bin/env bash
# .venv-engines: the peers of benchmarks/bench_engine_shard.py that .venv lacks: MosaicML
# Streaming's dataframe_to_mds (mosaicml-streaming, --no-deps, with the modules its MDS writer
# imports; the pins of scripts/formats_env.sh). Ray (Ray Data's write_webdataset) and pyspark come
# from .venv through a .pth file read after this venv's own site-packages: one torch, one Ray, one
# pyspark on the machine, nothing installed into .venv.
# streaming/__init__.py imports its vision datasets (torchvision, not installed); the MDS writer
# and dataframe_to_mds do not need them, so a last .pth file registers the package without running
# that file (its names come from streaming.base, as that file imports them), in every process of
# this venv (Spark's Python workers included).
# Idempotent: a second run with the same pins does nothing (a stamp file records them).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.venv-engines
pins=(mosaicml-streaming==0.13.0 brotli==1.2.1 python-snappy==0.7.3 cramjam==2.14.0 zstd==1.5.7.2
      catalogue==2.0.10)
stamp=$dir/.stallfree-engines
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ] && [ -x "$dir/bin/python" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "engines_env: .venv is missing (run scripts/setup.sh first)" >&2
  exit 1
fi
echo "setup: installing the engine benchmark's peers into $dir" >&2
[ -x "$dir/bin/python" ] || .venv/bin/python -m venv "$dir"
"$dir/bin/pip" install -q --disable-pip-version-check --no-deps "${pins[@]}"
ours=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
theirs=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$theirs" > "$ours/zz_stallfree_dotvenv.pth"
echo "$PWD" > "$ours/zz_stallfree_checkout.pth"  # this checkout's stallfree (.venv's editable finder is not run here)
cat > "$ours/zzz_stallfree_streaming.pth" <<'PTH'
import importlib.util as u, sys, types; s = None if "streaming" in sys.modules else u.find_spec("streaming"); m = types.ModuleType("streaming"); m.__path__ = list(s.submodule_search_locations) if s else []; m.__getattr__ = (lambda i: lambda n: getattr(i.import_module("streaming.base"), n))(__import__("importlib")); s and sys.modules.setdefault("streaming", m)
PTH
printf '%s' "${pins[*]}" > "$stamp"
