"""AdaptiveBatchSizeTrainer refuses FSDP (TrainingArguments(fsdp=...), accelerate's FSDP plugin) and names the
alternative: batchpilot.Pilot with a fully_shard model. (Run in a process of its own: FSDP needs torchrun's
environment, and accelerate then starts a process group.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
from _hf_common import PointSet, Recorder
from _hf_helpers import quiet_args
from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer
try:
    AdaptiveBatchSizeTrainer(model=Recorder(), train_dataset=PointSet(20), args=quiet_args(sys.argv[1], fsdp=True))
except ValueError as exc:
    print(exc)
"""


def test_fsdp_is_refused_with_the_alternative(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS / "integrations")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert "FSDP (TrainingArguments(fsdp=...) or accelerate's FSDP plugin) is not supported" in done.stdout, \
        done.stdout + done.stderr
    assert "batchpilot.Pilot (docs/fsdp.md)" in done.stdout
