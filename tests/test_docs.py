"""Every ```python block of the README and docs/ runs (in a temporary folder), so examples cannot rot.

Blocks that need a launcher (torchrun) are skipped; they are covered by tests/test_distributed.py."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NEEDS_LAUNCHER = ("init_torchrun(",)


def blocks():
    for path in DOCS:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S)):
            if not any(marker in code for marker in NEEDS_LAUNCHER):
                yield pytest.param(code, id=f"{path.name}-{i}")


@pytest.mark.parametrize("code", list(blocks()))
def test_doc_example_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # An example that sends itself SIGTERM (save_on_sigterm) runs as in a fresh interpreter: with the default
    # handler, not one a library imported by an earlier test left behind.
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        exec(compile(code, "<doc>", "exec"), {"__name__": "__doc_example__"})
    finally:
        signal.signal(signal.SIGTERM, previous)
