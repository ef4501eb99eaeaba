"""The automatic mode across processes: two real gloo ranks agree on every probe result and decision and keep
exact coverage; a kill -9 during the start probes, or after them, resumes to the uninterrupted run's weights."""

from __future__ import annotations

import json
from pathlib import Path

import _dist_helpers as h
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _script_runner import run_script
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import Auto

SCRIPT = Path(__file__).resolve().parent / "_auto_script.py"
NUM_SAMPLES = 203


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 5, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x[:, 0] - x[:, 2] > 0).long())


def worker(rank: int, world_size: int, init_file: str, out_dir: str, wrap_ddp: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2)).double()
        net = torch.nn.parallel.DistributedDataParallel(model) if wrap_ddp else model
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        # Timings differ between the ranks; rank 0's decide. min_gain just above 1: the sweep goes on while
        # timings rise, so it usually runs several sizes.
        auto = Auto(8, 64, min_gain=1.0001, lr_steps=15, min_epoch_steps=3, interval=4, min_measurements=0)
        pilot = batchpilot.Pilot(net, opt, data(), batch_size="auto", controller=auto, lr_rule="auto", noise_every=2,
                                 seed=4)
        steps: list[dict] = []
        current: list[int] = []
        for x, y in pilot.batches(epochs=4):
            micro = pilot.micro_batch
            if not pilot.probing:
                current.extend(micro.indices.tolist())
                if micro.is_last:
                    steps.append({"epoch": micro.epoch, "size": micro.global_size, "indices": current,
                                  "lr": pilot.optimizer.param_groups[0]["lr"]})
                    current = []
            pilot.backward(torch.nn.functional.cross_entropy(net(x), y))
        result = {"probe": pilot.controller.probe.to_dict(), "steps": steps,
                  "weights": [p.detach().tolist() for p in model.parameters()]}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        del pilot, net  # the DDP model goes before its process group
    except BaseException:
        dist.destroy_process_group()
        raise
    h.finish()  # (leaves without interpreter finalisation: see its docstring)


@pytest.mark.distributed
@pytest.mark.parametrize("wrap_ddp", [False, True])
def test_two_ranks_agree_on_the_probes_and_every_decision_and_cover_exactly(tmp_path, wrap_ddp):
    mp.spawn(worker, args=(2, str(tmp_path / "init"), str(tmp_path), wrap_ddp), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["probe"] == r1["probe"]  # knee, throughput table, bound, LR, seconds: rank 0's everywhere
    assert r0["probe"]["lr"] is not None and len(r0["probe"]["throughput"]) >= 1
    assert [s["size"] for s in r0["steps"]] == [s["size"] for s in r1["steps"]]
    assert [s["lr"] for s in r0["steps"]] == [s["lr"] for s in r1["steps"]]
    assert r0["steps"][0]["size"] == r0["probe"]["start_size"]
    per_epoch: dict[int, list[int]] = {}
    for a, b in zip(r0["steps"], r1["steps"]):
        per_epoch.setdefault(a["epoch"], []).extend(a["indices"] + b["indices"])
    assert sorted(per_epoch) == [0, 1, 2, 3]
    for indices in per_epoch.values():
        assert sorted(indices) == list(range(NUM_SAMPLES))
    assert r0["weights"] == r1["weights"]


def run(out: Path, *args: str, expect_kill: bool = False) -> None:
    run_script(SCRIPT, out, *args, expect_kill=expect_kill)


def rows(path: Path) -> dict[int, tuple[int, list[int]]]:
    out = {}
    for line in path.read_text().splitlines():
        step, size, *ids = (int(v) for v in line.split())
        out[step] = (size, ids)
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("auto-ref")
    run(out)
    return out


@pytest.mark.parametrize(("kill_at", "resumed_from"), [("probe:9", 0), ("step:7", 6)])
def test_a_kill_during_or_after_the_probes_resumes_exactly(tmp_path, uninterrupted, kill_at, resumed_from):
    run(tmp_path, "--kill-at", kill_at, expect_kill=True)
    first = rows(tmp_path / "ids.txt")
    run(tmp_path)
    assert int((tmp_path / "started_at.txt").read_text()) == resumed_from
    ref, got = rows(uninterrupted / "ids.txt"), rows(tmp_path / "ids.txt")
    assert got == ref  # every step's size and samples (lines the kill cut short were written again)
    assert all(first[s] == ref[s] for s in first)
    assert json.loads((tmp_path / "probe.json").read_text())["lr"] == json.loads(
        (uninterrupted / "probe.json").read_text())["lr"]
    for a, b in zip(torch.load(uninterrupted / "weights.pt"), torch.load(tmp_path / "weights.pt")):
        assert torch.equal(a, b)
