#!/usr/bin/env bash
# Set up batchpilot (scripts/setup.sh), then run the quick benchmark; results go to ./bench-out.
#
# Usage: bash scripts/quickstart.sh [more arguments for `batchpilot bench`]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
echo "[quickstart] batchpilot bench --quick --out bench-out $*"
batchpilot bench --quick --out bench-out "$@"
echo "[quickstart] done: see bench-out/"
