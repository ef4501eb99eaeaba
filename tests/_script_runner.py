"""Run a helper script of the test suite in a fresh Python process (the kill -9 and resume tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_script(script: Path, out: Path, *args: str, expect_kill: bool = False) -> None:
    """Run ``script out *args`` with the repository's ``src`` importable and one OMP thread; it must exit 0, or be
    killed by SIGKILL when ``expect_kill``."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(out), *args], env=env, capture_output=True, text=True,
                          timeout=240)
    if expect_kill:
        assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    else:
        assert done.returncode == 0, done.stderr[-2000:]


def torchrun_ranks(script: str, out: Path, *args: str) -> list[dict]:
    """Run ``tests/<script>`` on 2 ranks under torchrun (``--standalone``, one thread each); return each rank's
    ``out/rank<r>.json``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests" / script), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
