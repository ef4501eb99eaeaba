#!/usr/bin/env bash
# Set up batchpilot with the test tools (scripts/setup.sh --dev), then run the whole test suite:
# every test, the `slow` and `distributed` ones included (as CI does).
#
# Usage: bash scripts/test.sh [more pytest arguments, e.g. -x or tests/test_sampler.py]
# Exit status: pytest's (0 = all passed).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --dev
# shellcheck disable=SC1091
source .venv/bin/activate
echo "[test] python -m pytest -q $*"
exec python -m pytest -q "$@"
