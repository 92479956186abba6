#!/usr/bin/env bash
# Drop-in fidelity: run PyTorch's own test/test_dataloader.py twice, once with torch's DataLoader
# and once with torch.utils.data.DataLoader rebound to stallfree.DataLoader in every process of the
# run (a sitecustomize.py on PYTHONPATH, so spawned workers and `python -c` children get it too),
# then print the tests that pass with torch but not with stallfree.
#
# It downloads nothing: pass the upstream file (matching the installed torch) yourself; it is copied
# into a temp dir and run there, never from this repo. torch.testing._internal needs `expecttest`;
# put it on PYTHONPATH (e.g. `pip install --target DIR expecttest`) if the venv lacks it.
#
#   scripts/torch_suite.sh /tmp/upstream/test_dataloader.py [OUTDIR] [-- PYTEST_ARGS...]
#   e.g. scripts/torch_suite.sh /tmp/upstream/test_dataloader.py /tmp/upstream/run -- -k TestDataLoader
#
# OUTDIR (default: a new temp dir) receives torch.xml, stallfree.xml, torch.log, stallfree.log and
# diff.txt (one line per test: "Class::test  reason"). Exit 0 when nothing differs, 1 when something
# does, 2 on a setup error. PYTHON (default: .venv/bin/python) and TEST_TIMEOUT (seconds per test,
# default 600; a hang fails that test, not the run) may be set. On a loaded 2-core machine the
# torch run takes ~40 min and a few of its tests take minutes each.
set -uo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$repo/.venv/bin/python}"
per_test="${TEST_TIMEOUT:-600}"

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: $0 UPSTREAM_TEST_DATALOADER_PY [OUTDIR] [-- PYTEST_ARGS...]" >&2
  exit 2
fi
upstream="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
shift
out=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
  out="$1"
  shift
fi
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
[ -n "$out" ] || out="$(mktemp -d -t torch_suite.XXXXXX)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

work="$(mktemp -d -t torch_suite_work.XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tests" "$work/shim"
cp "$upstream" "$work/tests/test_dataloader.py"

# The rebinding: runs at interpreter start in the pytest process and in every child it starts.
cat >"$work/shim/sitecustomize.py" <<'EOF'
"""torch_suite.sh: rebind torch's DataLoader to stallfree's in this process (and its children)."""
import torch.utils.data
import torch.utils.data.dataloader

import stallfree.loader.dataloader as _ours

torch.utils.data.DataLoader = _ours.DataLoader
torch.utils.data.dataloader.DataLoader = _ours.DataLoader
EOF

base_pp="$work/tests:$repo${PYTHONPATH:+:$PYTHONPATH}"

if ! PYTHONPATH="$base_pp" "$py" -c "import expecttest, psutil, torch.testing._internal.common_utils" 2>"$out/setup.err"; then
  echo "torch_suite: cannot import torch.testing._internal (needs expecttest, psutil):" >&2
  tail -3 "$out/setup.err" >&2
  exit 2
fi
if ! PYTHONPATH="$work/shim:$base_pp" "$py" -c "
import torch.utils.data as t, torch.utils.data.dataloader as d, stallfree.loader.dataloader as s
assert t.DataLoader is s.DataLoader and d.DataLoader is s.DataLoader
" 2>"$out/setup.err"; then
  echo "torch_suite: the rebinding did not take effect:" >&2
  tail -3 "$out/setup.err" >&2
  exit 2
fi

run_suite() {  # NAME PYTHONPATH
  echo "torch_suite: running with $1 (log: $out/$1.log)" >&2
  (cd "$work/tests" && PYTHONPATH="$2" timeout 7200 "$py" -m pytest -q -rN -p no:cacheprovider \
    -c /dev/null --rootdir "$work/tests" --timeout "$per_test" \
    --junitxml "$out/$1.xml" test_dataloader.py "${@:3}" >"$out/$1.log" 2>&1)
  tail -1 "$out/$1.log" >&2
}
run_suite torch "$base_pp" "$@"
run_suite stallfree "$work/shim:$base_pp" "$@"
for name in torch stallfree; do
  if [ ! -s "$out/$name.xml" ]; then
    echo "torch_suite: the $name run wrote no report; see $out/$name.log" >&2
    exit 2
  fi
done

"$py" - "$out/torch.xml" "$out/stallfree.xml" "$out/diff.txt" <<'EOF'
"""Tests that pass under torch but not under stallfree, with the first line of the reason."""
import sys
import xml.etree.ElementTree as ET


def outcomes(path):
    res = {}
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            lines = (bad.get("message") or bad.text or "").strip().splitlines()
            res[name] = ("failed", " ".join(lines[:1])[:200] or bad.tag)
        elif case.find("skipped") is not None:
            res[name] = ("skipped", "")
        else:
            res[name] = ("passed", "")
    return res


ref, ours = outcomes(sys.argv[1]), outcomes(sys.argv[2])
passed = sorted(n for n, (o, _) in ref.items() if o == "passed")
diff = [(n, ours.get(n, ("missing", "not run under stallfree"))) for n in passed]
diff = [(n, why or o) for n, (o, why) in diff if o != "passed"]
with open(sys.argv[3], "w") as f:
    for n, why in diff:
        f.write(f"{n}  {why}\n")
print(f"torch passed {len(passed)}; stallfree passed {len(passed) - len(diff)} of those; "
      f"{len(diff)} differ (skipped under torch: {sum(o == 'skipped' for o, _ in ref.values())})")
for n, why in diff:
    print(f"  {n}  {why}")
sys.exit(1 if diff else 0)
EOF
