"""Bench tests: every test gets its own, empty cache of static runs (``BATCHPILOT_BENCH_CACHE``), so that no test
reads what another (or an earlier session) trained; the MNIST-1D data cache stays shared."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_bench_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHPILOT_BENCH_CACHE", str(tmp_path / "bench-cache"))
