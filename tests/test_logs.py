"""The adjustment log holds one run: a fresh start (nothing to resume) moves an earlier run's records aside, a
resume from a checkpoint cuts back to the checkpoint's position and appends, and the same Pilot appends
across loops and close(). Processes are killed for real (``os._exit(9)``) before and after the first checkpoint."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.logs import AdjustmentLog

REPO = Path(__file__).resolve().parents[1]

# The README's pattern: load_checkpoint(missing_ok=True), then train; exits with 9 inside step KILL_AT (0: never).
SCRIPT = """
import os, sys
from pathlib import Path
import torch
from torch.utils.data import TensorDataset
import batchpilot

out, kill_at, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
x = torch.randn(512, 4)
model = torch.nn.Linear(4, 1)
pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.01), TensorDataset(x, x.sum(1, keepdim=True)),
                         batch_size=8, log_path=out / "log.jsonl", checkpoint_dir=out / "ckpt", checkpoint_every=150)
pilot.load_checkpoint(out / "ckpt", missing_ok=True)
for xb, yb in pilot.batches(max_steps=steps):
    if pilot.step + 1 == kill_at:
        os._exit(9)
    pilot.backward(torch.nn.functional.mse_loss(model(xb), yb))
pilot.close()
"""


def run(out: Path, kill_at: int, steps: int = 200) -> subprocess.CompletedProcess:
    script = out / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(out), str(kill_at), str(steps)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == (9 if kill_at else 0), done.stderr[-2000:]
    return done


def steps_in(path: Path) -> list[int]:
    return [r["step"] for r in batchpilot.read_log(path) if r["type"] == "step"]


def logs_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.jsonl"))


def test_a_restart_after_a_kill_before_the_first_checkpoint_starts_a_fresh_log(tmp_path):
    run(tmp_path, kill_at=120)  # flush_every=100: steps 1-100 reached the file, no checkpoint yet
    killed = (tmp_path / "log.jsonl").read_bytes()
    assert steps_in(tmp_path / "log.jsonl") == list(range(1, 101))
    restart = run(tmp_path, kill_at=0)
    assert steps_in(tmp_path / "log.jsonl") == list(range(1, 201))  # each step once (it was 1-100 twice)
    assert (tmp_path / "log.1.jsonl").read_bytes() == killed  # the killed run, moved aside untouched
    assert logs_in(tmp_path) == ["log.1.jsonl", "log.jsonl"]
    assert "moved them to" in restart.stderr and "log.1.jsonl" in restart.stderr


def test_a_restart_after_a_kill_after_a_checkpoint_resumes_the_log_without_moving_it(tmp_path):
    run(tmp_path, kill_at=170)  # the checkpoint of step 150 exists
    restart = run(tmp_path, kill_at=0)
    assert steps_in(tmp_path / "log.jsonl") == list(range(1, 201))
    assert logs_in(tmp_path) == ["log.jsonl"] and "moved" not in restart.stderr


def make_pilot(log: Path, **kwargs) -> tuple[batchpilot.Pilot, torch.nn.Module]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.01), TensorDataset(x, x.sum(1, keepdim=True)),
                             batch_size=8, log_path=log, **kwargs)
    return pilot, model


def train(pilot: batchpilot.Pilot, model: torch.nn.Module, max_steps: int) -> None:
    for xb, yb in pilot.batches(max_steps=max_steps):
        pilot.backward(torch.nn.functional.mse_loss(model(xb), yb))


def test_the_same_pilot_appends_across_loops_and_close_and_moves_the_earlier_run_aside_once(tmp_path, caplog):
    log = tmp_path / "log.jsonl"
    earlier = b'{"type": "step", "step": 1}\n{"type": "step", "step": 2}\n'
    log.write_bytes(earlier)
    pilot, model = make_pilot(log)
    assert log.read_bytes() == earlier  # nothing moves before this run writes
    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        train(pilot, model, 2)
    assert caplog.text.count("moved them to") == 1
    train(pilot, model, 4)  # a second loop
    pilot.close()
    train(pilot, model, 5)  # after close(): the log opens again
    pilot.close()
    assert steps_in(log) == [1, 2, 3, 4, 5]
    assert logs_in(tmp_path) == ["log.1.jsonl", "log.jsonl"] and (tmp_path / "log.1.jsonl").read_bytes() == earlier


def test_a_resume_from_a_checkpoint_in_the_same_folder_cuts_back_and_appends(tmp_path):
    log = tmp_path / "log.jsonl"
    first, model = make_pilot(log, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    train(first, model, 5)  # step 5's records lie past the checkpoint of step 4
    first.close()
    second, model = make_pilot(log, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)
    assert second.load_checkpoint(tmp_path / "ckpt") is not None and second.step == 4
    train(second, model, 6)
    second.close()
    assert steps_in(log) == [1, 2, 3, 4, 5, 6] and logs_in(tmp_path) == ["log.jsonl"]


def test_a_fresh_start_takes_the_first_free_name_and_a_log_never_written_moves_nothing(tmp_path):
    log = tmp_path / "run.jsonl"
    for n in (1, 2):
        (tmp_path / f"run.{n}.jsonl").write_text(f"earlier {n}\n")
    log.write_text('{"type": "step", "step": 7}\n')
    AdjustmentLog(log).close()  # opened and closed without a record: the earlier run stays where it is
    assert log.read_text() == '{"type": "step", "step": 7}\n'
    fresh = AdjustmentLog(log)
    assert fresh.position() == 0  # a fresh start's checkpoint counts from an empty log
    assert fresh.rotated_to == tmp_path / "run.3.jsonl" and fresh.rotated_to.read_text() == '{"type": "step", "step": 7}\n'
    fresh.write("step", {"step": 1})
    fresh.close()
    assert steps_in(log) == [1]
    new = AdjustmentLog(tmp_path / "sub" / "new.jsonl")  # no earlier file: created, nothing moved
    new.write("step", {"step": 1})
    new.close()
    assert new.rotated_to is None and logs_in(tmp_path / "sub") == ["new.jsonl"]


def test_a_resumed_log_checks_and_truncates_without_moving_the_file(tmp_path):
    log = tmp_path / "log.jsonl"
    lines = b'{"type": "step", "step": 1}\n{"type": "step", "step": 2}\n'
    log.write_bytes(lines + b'{"type": "step", "step": 3}\n')
    resumed = AdjustmentLog(log)
    assert resumed.resume_problem(10**6) is not None and log.is_file()  # a refused checkpoint moves nothing
    resumed.truncate(len(lines))
    resumed.write("step", {"step": 3})
    assert resumed.position() == len(lines) + len(b'{"type": "step", "step": 3}\n')
    resumed.close()
    assert steps_in(log) == [1, 2, 3] and resumed.rotated_to is None and logs_in(tmp_path) == ["log.jsonl"]
    empty = AdjustmentLog(tmp_path / "empty.jsonl")  # a fresh log_path resumed: it starts anew at the checkpoint
    empty.truncate(500)
    empty.write("step", {"step": 9})
    empty.close()
    assert steps_in(tmp_path / "empty.jsonl") == [9]
