"""save_on_sigterm=True: a real SIGTERM makes every rank save at the end of the current step and stop cleanly
(engine/preemption.py); the resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from _benchmarks import load_benchmark
from torch.utils.data import TensorDataset

import batchpilot

REPO = Path(__file__).resolve().parents[2]


def build(tmp: Path, **settings):
    torch.manual_seed(0)
    x = torch.randn(120, 5)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pilot = batchpilot.Pilot(model, opt, TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8, max_micro_batch_size=4,
                             controller=lambda step, size: 8 + 4 * (step % 3), checkpoint_dir=tmp / "ckpt",
                             save_on_sigterm=True, **settings)
    return model, pilot


def train(model, pilot, steps: int, signal_at: int | None = None) -> int:
    """Train to ``steps``; SIGTERM this process from the callback after step ``signal_at``; return the steps
    that ran in this loop."""
    ran = 0

    def callback(p, record):
        nonlocal ran
        ran += 1
        if p.step == signal_at:
            signal.raise_signal(signal.SIGTERM)

    pilot.add_callback(callback)
    for x, y in pilot.batches(max_steps=steps):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    return ran


def test_sigterm_saves_after_the_current_step_stops_and_resumes_exactly(tmp_path):
    model, pilot = build(tmp_path / "ref")
    train(model, pilot, 20)
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    before = signal.getsignal(signal.SIGTERM)
    model, pilot = build(tmp_path / "run")
    # The signal arrives after step 6's loss reduction (in its callback): step 7 is the first end that sees it.
    assert train(model, pilot, 20, signal_at=6) == 7
    assert pilot.preempted and pilot.step == 7
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back when the loop ends
    assert [p.name for p in (tmp_path / "run" / "ckpt").iterdir()] == ["step-000000007.pt"]
    assert list(pilot.batches(max_steps=20)) == []  # stopped for good

    model, pilot = build(tmp_path / "run")
    assert pilot.load_checkpoint(tmp_path / "run" / "ckpt") is not None and pilot.step == 7
    assert train(model, pilot, 20) == 13 and not pilot.preempted
    for a, b in zip(model.parameters(), uninterrupted):
        assert torch.equal(a, b)


def test_a_periodic_checkpoint_of_the_same_step_is_not_written_twice(tmp_path):
    model, pilot = build(tmp_path, checkpoint_every=4)
    saves = []
    real_save = pilot._state.save
    pilot._state.save = lambda *a: saves.append(pilot.step) or real_save(*a)
    train(model, pilot, 20, signal_at=3)
    assert pilot.preempted and pilot.step == 4 and saves == [4]


def test_the_users_own_handler_still_runs(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        model, pilot = build(tmp_path)
        train(model, pilot, 20, signal_at=2)
        assert pilot.preempted and pilot.step == 3 and seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is not None and signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
        signal.raise_signal(signal.SIGTERM)  # the user's handler is back
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_loop_in_another_thread_trains_without_the_handler_and_says_so(tmp_path, caplog):
    model, pilot = build(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    done = []
    thread = threading.Thread(target=lambda: done.append(train(model, pilot, 3)))
    thread.start()
    thread.join()
    assert done == [3] and not pilot.preempted and signal.getsignal(signal.SIGTERM) is before
    assert "needs the main thread" in caplog.text


def test_a_sigterm_after_the_last_step_still_terminates_the_process(tmp_path):
    # The loop ends at max_steps before a step end could act on the signal: the default action follows.
    code = textwrap.dedent(f"""
        import sys, signal, torch
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        from pathlib import Path
        from test_sigterm import build, train
        model, pilot = build(Path({str(tmp_path)!r}))
        train(model, pilot, 5, signal_at=5)
        print("survived", flush=True)
    """)
    env = {"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "PATH": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert "survived" not in done.stdout and "after the last step's end" in done.stderr


@pytest.mark.parametrize(("settings", "message"), [
    ({"save_on_sigterm": True}, "save_on_sigterm=True saves into checkpoint_dir, which is None"),
    ({"save_on_sigterm": "yes", "checkpoint_dir": "x"}, "save_on_sigterm"),
    ({"save_on_sigterm": 1, "checkpoint_dir": "x"}, "save_on_sigterm"),
])
def test_bad_settings_are_refused(settings, message):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=message):
        batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(torch.randn(8, 3)),
                         batch_size=4, **settings)


@pytest.mark.distributed
def test_sigterm_to_one_of_two_gloo_ranks_stops_both_at_one_step_and_resume_is_exact(tmp_path):
    """Two real gloo processes; a real SIGTERM to rank 1 only, mid-epoch: the flag rides on the step's loss
    all-reduce, so both ranks save at the same step end and exit 0; torchrun then resumes on 2 ranks, and the
    run trains every sample exactly as an uninterrupted one, to bitwise-equal weights."""
    elastic = load_benchmark("elastic")
    ref = elastic.reference(tmp_path / "ref", 2)
    run = elastic.sigterm_case(tmp_path / "run", "2->2")  # rank 1 is signalled after step 9
    first = [json.loads(p.read_text()) for p in sorted((tmp_path / "run").glob("end-a0w2-r*.json"))]
    # Step 10's end is the first to see the signal: both ranks save there and stop.
    assert first == [{"step": 10, "preempted": True}] * 2
    assert run["starts"] == [0, 10] and run["redone"] == 0  # resumed from the checkpoint of that step
    result = elastic.compare(run, ref)
    assert result["samples_lost"] == result["samples_repeated"] == 0
    assert result["same_sizes"] and result["same_samples_per_step"]
    assert result["max_weight_diff"] == 0.0 and result["max_loss_diff"] == 0.0


@pytest.mark.distributed
def test_sigterm_to_the_torchrun_agent_reaches_every_worker_and_each_saves(tmp_path):
    """A scheduler preempting the whole job signals torchrun's agent, which SIGTERMs its workers (and SIGKILLs
    them 30 s later): both ranks finish the step they are in, save it, and stop."""
    elastic = load_benchmark("elastic")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           str(elastic.SCRIPT), str(tmp_path), "--save-on-sigterm", "--hold-at", "6"]
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        elastic.wait_for_steps(tmp_path, "steps-a0w2-r0.jsonl", 6)
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
    ends = [json.loads((tmp_path / f"end-a0w2-r{r}.json").read_text()) for r in (0, 1)]
    assert ends == [{"step": 7, "preempted": True}] * 2
    assert batchpilot.latest_checkpoint(tmp_path / "checkpoints").name == "step-000000007.pt"
