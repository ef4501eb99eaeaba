"""How to install an optional extra, for ImportError messages."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The pip command for the ``extra``, in a source checkout (batchpilot is not on a package index yet)."""
    return f'pip install -e ".[{extra}]" in the batchpilot checkout'
