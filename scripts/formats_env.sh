#!/usr/bin/env bash
# .venv-formats: MosaicML Streaming's and LitData's own writers, for the test that opens what they
# write in place and checks it against `stallfree shard` of it (tests/shards/test_inplace_writers.py).
# Both packages depend on a torch of their own; installed here with --no-deps, with only the
# modules their writers import (found by trying: streaming's compression module imports brotli,
# snappy (cramjam), zstd; its registry catalogue). Everything else they import (torch, numpy,
# lightning-utilities, ...) comes from .venv through a .pth file read after this venv's own
# site-packages: one torch on the machine, nothing installed into .venv.
# Idempotent: a second run with the same pins does nothing (a stamp file records them).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.venv-formats
pins=(mosaicml-streaming==0.13.0 litdata==0.2.76 brotli==1.2.1 python-snappy==0.7.3 cramjam==2.14.0
      zstd==1.5.7.2 catalogue==2.0.10)
stamp=$dir/.stallfree-formats
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ] && [ -x "$dir/bin/python" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "formats_env: .venv is missing (run scripts/setup.sh first)" >&2
  exit 1
fi
echo "setup: installing MDS and LitData writers into $dir" >&2
# the same interpreter as .venv, so .venv's compiled packages (torch) load here too
[ -x "$dir/bin/python" ] || .venv/bin/python -m venv "$dir"
"$dir/bin/pip" install -q --disable-pip-version-check --no-deps "${pins[@]}"
ours=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
theirs=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$theirs" > "$ours/zz_stallfree_dotvenv.pth"  # (zz: after the venv's own .pth files)
printf '%s' "${pins[*]}" > "$stamp"
