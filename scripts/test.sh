#!/usr/bin/env bash
# Set up batchpilot with the test tools (scripts/setup.sh --dev), lint (ruff) and type-check the package
# (mypy; both configured in pyproject.toml), then run the whole test suite: every test, the `slow` and
# `distributed` ones included (as CI does). With pytest arguments only those tests run, without the lint and type check.
#
# Usage: bash scripts/test.sh [more pytest arguments, e.g. -x or tests/test_sampler.py]
# Exit status: ruff's or mypy's if one fails, else pytest's (0 = all passed).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh --dev
# shellcheck disable=SC1091
source .venv/bin/activate
if [ "$#" -eq 0 ]; then
    echo "[test] python -m ruff check (lint of src, tests, benchmarks, examples)"
    python -m ruff check .
    echo "[test] python -m mypy (type check of src/batchpilot)"
    python -m mypy
fi
echo "[test] python -m pytest -q $*"
exec python -m pytest -q "$@"
