#!/usr/bin/env bash
# Set up batchpilot in a virtual environment at ./.venv (the README's set-up).
#
# Usage: bash scripts/setup.sh [--dev]
#   (default)  torch + batchpilot with every optional extra:  pip install -e ".[all]"
#   --dev      the same plus the test tools (pytest, hypothesis): pip install -e ".[dev]"
#
# Safe to run again: an existing .venv, torch and an up-to-date install are kept.
# Torch is installed first, pinned, so that no later step resolves an unpinned "torch" to a newer release
# (on Linux that is a CUDA build of several GB). Environment overrides:
#   PYTHON                     interpreter that creates the venv (default: python3, then python3.1x; >= 3.10)
#   BATCHPILOT_TORCH           torch requirement to install first (default: torch==2.13.0)
#   BATCHPILOT_TORCH_PIP_ARGS  extra pip arguments for that install, e.g. an --index-url of CPU-only wheels
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
EXTRA=all
TORCH_REQ=${BATCHPILOT_TORCH:-torch==2.13.0}

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

for arg in "$@"; do
    case "$arg" in
        --dev) EXTRA=dev ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) die "unknown argument '$arg'; usage: bash scripts/setup.sh [--dev]" ;;
    esac
done

python_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; }

# 1. The virtual environment.
if [ -x "$VENV/bin/python" ] && python_ok "$VENV/bin/python"; then
    log "using the existing virtual environment $VENV ($("$VENV/bin/python" --version 2>&1))"
else
    PY=""
    for candidate in ${PYTHON:-} python3 python3.13 python3.12 python3.11 python3.10; do
        if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then PY=$candidate; break; fi
    done
    [ -n "$PY" ] || die "no Python >= 3.10 found (tried ${PYTHON:-} python3 python3.1x); install one or set PYTHON=/path/to/python3.11"
    if [ -e "$VENV" ]; then
        log "removing the unusable virtual environment $VENV (its Python is older than 3.10)"
        rm -rf "$VENV"
    fi
    log "creating the virtual environment $VENV with $PY ($("$PY" --version 2>&1))"
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if ! python -m pip --version >/dev/null 2>&1; then  # a venv made without pip (uv venv, --without-pip)
    log "the virtual environment has no pip: adding it with ensurepip"
    python -m ensurepip --upgrade >/dev/null || die "$VENV has no pip and ensurepip failed; install pip into it (or remove $VENV and install your distribution's python3-venv)"
fi
export PIP_NO_INPUT=1

# 2. Torch, pinned, before anything that depends on it.
torch_version() { python -c 'import torch; print(torch.__version__)' 2>/dev/null; }
if TORCH_VERSION=$(torch_version); then
    log "torch $TORCH_VERSION is already installed in $VENV"
else
    log "installing $TORCH_REQ first (pinned: an unpinned torch would pull a newer, multi-GB CUDA build)"
    # shellcheck disable=SC2086
    python -m pip install ${BATCHPILOT_TORCH_PIP_ARGS:-} "$TORCH_REQ"
    TORCH_VERSION=$(torch_version) || die "torch was installed but does not import; see the pip output above"
    log "installed torch $TORCH_VERSION"
fi

# 3. batchpilot itself, editable, with its extras. Skipped when this exact pyproject.toml was already
#    installed with these extras ([dev] includes [all]).
STAMP_DIR="$VENV/.batchpilot-setup"
HASH=$(python -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' pyproject.toml)
installed() {
    [ -f "$STAMP_DIR/$1" ] && [ "$(cat "$STAMP_DIR/$1")" = "$HASH" ] \
        && python -c 'import importlib.metadata as m; m.version("batchpilot")' >/dev/null 2>&1
}
if installed "$EXTRA" || { [ "$EXTRA" = all ] && installed dev; }; then
    log "batchpilot[$EXTRA] is already installed from this pyproject.toml; nothing to do"
else
    log "installing batchpilot (editable) with extras [$EXTRA]: pip install -e \".[$EXTRA]\""
    # torch held at the installed version: an extra asking for a newer one must fail here, not pull a
    # multi-GB CUDA build over it.
    python -m pip install -e ".[$EXTRA]" "torch==$TORCH_VERSION"
    mkdir -p "$STAMP_DIR"
    echo "$HASH" > "$STAMP_DIR/$EXTRA"
fi

log "ready: torch $TORCH_VERSION, batchpilot $(python -c 'import importlib.metadata as m; print(m.version("batchpilot"))')"
log "activate it with: source .venv/bin/activate"
