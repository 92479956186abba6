#!/usr/bin/env bash
# The main job on an embedded default: makes a small dataset of real-photo JPEGs, shards it,
# reads it back through stallfree.DataLoader and prints a short stall benchmark table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/stallfree demo "$@"
