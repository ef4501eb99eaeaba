"""How to install an optional extra, for ImportError messages."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The pip command for ``batchpilot[extra]``, from an index or from a source checkout."""
    return f'pip install "batchpilot[{extra}]" (from a source checkout: pip install -e ".[{extra}]")'
