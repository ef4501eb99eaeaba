"""batchpilot.integrations.horovod under horovodrun (2 gloo processes): shares by rank weight with one Horovod
all-reduce per step (backward_passes_per_step = the step's micro-batches), exact coverage, weights equal a
1-process full-batch SGD reference, exact resume; bad settings refused.

Skipped where horovod.torch does not import: horovod 0.28.1 does not build against torch >= 2.1 as released
(docs/distributed.md, "Horovod", says how it was built here), so CI does not run these tests.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

hvd = pytest.importorskip("horovod.torch")

from _hf_common import PointSet, Recorder  # noqa: E402

from batchpilot.data.shares import share_bounds  # noqa: E402
from batchpilot.integrations.horovod import HorovodSteps  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAUNCH = "from horovod.runner.launch import run_commandline; run_commandline()"


def horovodrun(out: Path, *args: str) -> list[dict]:
    cmd = [sys.executable, "-c", LAUNCH, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
           str(REPO / "tests" / "_horovod_worker.py"), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def check_exact(ranks: list[dict], weights) -> None:
    steps0, steps1 = ranks[0]["steps"], ranks[1]["steps"]
    assert [s["size"] for s in steps0] == [s["size"] for s in steps1]
    for s0, s1 in zip(steps0, steps1):
        assert len(s0["micro"]) == len(s1["micro"])  # the same backward passes on both ranks
        for rank, s in enumerate((s0, s1)):
            start, stop = share_bounds(s["size"], rank, 2, weights)
            assert len(s["ids"]) == sum(s["micro"]) == stop - start
    per_epoch = collections.Counter(i for r in ranks for s in r["steps"] for i in s["ids"])
    assert per_epoch == {i: 2 for i in range(61)}  # two epochs, each sample once per epoch
    assert ranks[0]["weights"] == ranks[1]["weights"]
    data, reference = PointSet(61), Recorder()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for s0, s1 in zip(steps0, steps1):
        idx = torch.tensor(s0["ids"] + s1["ids"])
        optimizer.zero_grad()
        reference(data.x[idx], data.y[idx])["loss"].backward()
        optimizer.step()
    for got, want in zip(ranks[0]["weights"], reference.parameters()):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want.detach(), rtol=0, atol=1e-13)


@pytest.mark.distributed
def test_rank_weights_and_accumulation_under_horovod_are_exact(tmp_path):
    ranks = horovodrun(tmp_path / "weighted", "--rank-weights", "1,3")
    assert any(0 in s["micro"] for s in ranks[0]["steps"])  # rank 0's ghost micro-batches (weight 0)
    assert max(len(s["micro"]) for s in ranks[0]["steps"]) >= 4  # backward_passes_per_step changed with the size
    check_exact(ranks, (1.0, 3.0))
    summed = horovodrun(tmp_path / "summed", "--sum")  # op=hvd.Sum: losses weighted n / B instead of n * size / B
    check_exact(summed, None)


@pytest.mark.distributed
def test_a_resumed_horovod_run_continues_exactly(tmp_path):
    full = horovodrun(tmp_path / "full", "--rank-weights", "1,3")
    horovodrun(tmp_path / "first", "--rank-weights", "1,3", "--max-steps", "7", "--save", str(tmp_path / "state.pt"))
    rest = horovodrun(tmp_path / "rest", "--rank-weights", "1,3", "--resume", str(tmp_path / "state.pt"))
    for a, b in zip(full, rest):
        assert [(s["size"], s["ids"]) for s in a["steps"][7:]] == [(s["size"], s["ids"]) for s in b["steps"]]
        assert a["weights"] == b["weights"]


def test_bad_settings_are_refused_with_the_fix():
    hvd.init()  # one process
    model = Recorder()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="hvd.DistributedOptimizer"):
        HorovodSteps(plain, PointSet(8), batch_size=4)
    optimizer = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
    with pytest.raises(ValueError, match="rank_weights='auto' needs torch.distributed"):
        HorovodSteps(optimizer, PointSet(8), batch_size=4, rank_weights="auto")
    with pytest.raises(ValueError, match="has 2 weights"):
        HorovodSteps(optimizer, PointSet(8), batch_size=4, rank_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="rank_weights\\[0\\] is -1.0"):
        HorovodSteps(optimizer, PointSet(8), batch_size=4, rank_weights=[-1.0])
    steps = HorovodSteps(optimizer, PointSet(8), batch_size=4)
    with pytest.raises(ValueError, match="pass epochs= or max_steps="):
        next(steps.batches())
    with pytest.raises(RuntimeError, match="end_step"):
        for micro in steps.batches(epochs=1):
            steps.weight(model(**micro.data)["loss"]).backward()  # no optimizer step, no end_step()
