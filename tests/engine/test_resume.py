"""Kill -9 and resume: a subprocess trains with changing sizes, SIGKILLs itself mid-epoch, mid-accumulation
or right after an epoch boundary, and a new process resumes from the last checkpoint. Sample ids before +
after equal an uninterrupted run, sizes are identical and final weights are bitwise equal (CPU)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _script_runner import run_script

import batchpilot

SCRIPT = Path(__file__).resolve().parents[1] / "_resume_script.py"


def run(out: Path, *args: str, expect_kill: bool = False) -> None:
    run_script(SCRIPT, out, *args, expect_kill=expect_kill)


def read_ids(path: Path) -> list[tuple[int, int, list[int]]]:
    rows = []
    for line in path.read_text().splitlines():
        step, size, *ids = (int(v) for v in line.split())
        rows.append((step, size, ids))
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    run(out)
    return out


def _kill_points() -> list[str]:
    rng = random.Random(2026)
    # step 7 micro 0: mid-epoch, first micro-batch; a step of size 40 (5 micro-batches) killed at micro 3;
    # the first step after an epoch boundary; and one random (step, micro) point.
    # The size of the step run while pilot.step == s is the decision made after s steps: SIZES[s % 7].
    steps_with_40 = [s for s in range(1, 38) if [8, 24, 5, 40, 16, 3, 31][s % 7] == 40]
    return ["7:0", f"{steps_with_40[1]}:3", "epoch-start", f"{rng.randrange(4, 38)}:0"]


@pytest.mark.parametrize("kill_at", _kill_points())
def test_sigkill_then_resume_equals_the_uninterrupted_run(tmp_path, reference, kill_at):
    run(tmp_path, "--kill-at", kill_at, expect_kill=True)
    killed = read_ids(tmp_path / "ids.txt")
    run(tmp_path)  # a new process: resumes from the newest checkpoint
    start = int((tmp_path / "started_at.txt").read_text())
    assert start > 0 and start % 3 == 0
    rows = read_ids(tmp_path / "ids.txt")
    resumed = rows[len(killed):]
    combined = [r for r in killed if r[0] <= start] + resumed
    expected = read_ids(reference / "ids.txt")
    assert [r[0] for r in combined] == list(range(1, 41))
    assert [r[1] for r in combined] == [r[1] for r in expected]  # identical sizes
    assert combined == expected  # identical sample ids, step by step
    for a, b in zip(torch.load(reference / "weights.pt"), torch.load(tmp_path / "weights.pt")):
        assert torch.equal(a, b)
    # The log reads as if the run had never been interrupted.
    ref_log = [r for r in batchpilot.read_log(reference / "log.jsonl") if r["type"] != "event"]
    log = [r for r in batchpilot.read_log(tmp_path / "log.jsonl") if r["type"] != "event"]
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("perf/", "system/"))} for r in rs]  # noqa: E731
    inputs = lambda rs: [{**r, "inputs": None} if r["type"] == "decision" else r for r in rs]  # noqa: E731
    assert inputs(strip(log)) == inputs(strip(ref_log))


@pytest.mark.slow
def test_sigkill_with_worker_processes(tmp_path, reference):
    run(tmp_path, "--kill-at", "11:1", "--workers", "2", expect_kill=True)
    run(tmp_path, "--workers", "2")
    assert read_ids(tmp_path / "ids.txt")[-1] == read_ids(reference / "ids.txt")[-1]
    for a, b in zip(torch.load(reference / "weights.pt"), torch.load(tmp_path / "weights.pt")):
        assert torch.equal(a, b)


def test_a_cpu_runs_checkpoint_holds_no_cuda_state():
    # Only the training device's CUDA stream is kept: a CPU run stores none (and never initialises CUDA for it).
    from batchpilot.rng import gather_rng_states

    state = gather_rng_states(1, torch.device("cpu"))[0]
    assert state["cuda"] == [] and state["cuda_device"] is True
