"""The built wheel carries what users' tools need (a build from a copy of this checkout, no network)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_py_typed_and_the_cli(tmp_path: Path) -> None:
    # A copy, so that no build/ folder of an earlier build (stale files) takes part, and none is left behind.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".mypy_cache", ".pytest_cache", ".hypothesis",
        "bench-out", "runs"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "dist")], check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("batchpilot-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "batchpilot = batchpilot.cli:main" in zf.read(entry_points).decode()
    # PEP 561: without py.typed a user's mypy treats batchpilot as untyped and ignores its annotations.
    assert "batchpilot/py.typed" in names
    assert "batchpilot/integrations/hf/trainer.py" in names and "batchpilot/bench/workloads.py" in names
    # Package data: PPOController() and the simulator work from an installed wheel only with these.
    assert {"batchpilot/controllers/policies/ppo_default.pt", "batchpilot/controllers/policies/ppo_default.json"} <= names
    traces = {n for n in names if n.startswith("batchpilot/sim/traces/") and n.endswith(".json")}
    shipped = {f"batchpilot/sim/traces/{p.name}" for p in (ROOT / "src/batchpilot/sim/traces").glob("*.json")}
    assert shipped and traces == shipped


def test_a_framework_that_is_installed_but_fails_to_import_is_not_called_missing() -> None:
    """lightning imports lightning_utilities; with that dependency broken, telling the user to install
    lightning (already installed) would leave them stuck."""
    code = (
        "import sys\n"
        "sys.modules['lightning_utilities'] = None\n"
        "try:\n"
        "    import batchpilot.integrations.lightning\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "installed but fails to import" in out.stdout and "lightning_utilities" in out.stdout
