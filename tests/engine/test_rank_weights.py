"""Rank weights over two real gloo processes: unequal shares give the gradient of one process training the same
global batches (with DDP, with the engine's own reduction, with accumulation and ghost micro-batches), weights
changed mid-epoch keep exact coverage, "auto" finds the speed ratio of a slowed rank, and a checkpoint resumes the
weights (and resets them under another world size)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_engine_stats, in the spawned workers too
import _dist_helpers as h  # noqa: E402
from _hf_common import SizeList  # noqa: E402

import batchpilot  # noqa: E402

pytestmark = pytest.mark.distributed

# Sizes that end epochs of 101 samples in batches of 1 and 2 samples: with weights 1:3, rank 0's share is empty.
SIZES = [8, 21, 5, 33, 10, 17, 6, 1, 12, 40, 3, 9, 25, 2, 30, 7]
WEIGHTS = [1.0, 3.0]


def _train(rank: int, world_size: int, *, wrap_ddp: bool, micro: int | None, weights, steps: int,
           change_at: dict[int, list[float]] | None = None, oom_recovery: bool = False,
           oom_limit: int | None = None) -> dict:
    model = h.make_model()
    if oom_limit is not None:  # rank 1, the one with the larger share, runs out of memory above oom_limit rows
        model = torch.nn.Sequential(h._OutOfMemoryAbove(oom_limit if rank == 1 else None), model)
    net = torch.nn.parallel.DistributedDataParallel(model) if wrap_ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    pilot = batchpilot.Pilot(net, opt, h.make_data(), batch_size=4, controller=SizeList(SIZES), seed=5,
                             max_micro_batch_size=micro, lr_rule="linear", base_batch_size=4, noise_every=2,
                             rank_weights=weights, oom_recovery=oom_recovery)
    if change_at:
        pilot.add_callback(lambda p, record: p.loader.set_rank_weights(change_at[p.step])
                           if p.step in change_at else None)
    by_step: dict[int, dict] = {}
    for x, y in pilot.batches(max_steps=steps):
        m = pilot.micro_batch
        if m.micro_index == 0:  # (a step run again after running out of memory starts over)
            by_step[m.step] = {"global_size": m.global_size, "accumulation_steps": m.accumulation_steps,
                               "epoch": m.epoch, "local_size": m.local_size, "indices": [], "ghosts": 0}
        if m.ghost:
            by_step[m.step]["ghosts"] += 1
        else:
            by_step[m.step]["indices"].extend(m.indices.tolist())
        with pilot.micro_step():
            pilot.backward(torch.nn.functional.cross_entropy(net(x), y))
    noise = {k: v for k, v in pilot.last_record.items() if k.startswith("stats/")}
    return {"records": [by_step[k] for k in sorted(by_step)], "weights": [p.detach().tolist() for p in model.parameters()],
            "noise": noise, "rank_weights": pilot.rank_weights, "replays": pilot.oom_replays,
            "micro": pilot.loader.max_micro_batch_size}


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, kwargs: dict) -> None:
    with h.worker_group(rank, world_size, init_file):
        result = _train(rank, world_size, **kwargs)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _spawn(tmp_path: Path, **kwargs) -> list[dict]:
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), kwargs), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _check_against_one_process(ranks: list[dict], steps: int, micro: int | None, expected_weights) -> None:
    r0, r1 = (r["records"] for r in ranks)
    assert len(r0) == len(r1) == steps
    for a, b in zip(r0, r1):
        assert a["global_size"] == b["global_size"] and a["accumulation_steps"] == b["accumulation_steps"]
        assert len(a["indices"]) + len(b["indices"]) == a["global_size"]
    # Exact coverage: each sample once per complete epoch, over both ranks.
    per_epoch: dict[int, list[int]] = {}
    for a, b in zip(r0, r1):
        per_epoch.setdefault(a["epoch"], []).extend(a["indices"] + b["indices"])
    for e in [e for e in per_epoch if e < max(per_epoch)]:
        assert sorted(per_epoch[e]) == list(range(h.NUM_SAMPLES)), e
    # The reference: one process, the same global batches, the same optimizer.
    ref = _train(0, 1, wrap_ddp=False, micro=micro, weights=None, steps=steps)
    assert [sorted(r["indices"]) for r in ref["records"]] == [sorted(a["indices"] + b["indices"])
                                                              for a, b in zip(r0, r1)]
    assert ranks[0]["noise"] == ranks[1]["noise"] and "stats/trace_cov" in ranks[0]["noise"]
    assert ranks[0]["rank_weights"] == ranks[1]["rank_weights"] == expected_weights
    for w_ref, w0, w1 in zip(ref["weights"], ranks[0]["weights"], ranks[1]["weights"]):
        assert w0 == w1
        torch.testing.assert_close(torch.tensor(w0), torch.tensor(w_ref), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(("wrap_ddp", "micro", "oom_recovery"),
                         [(True, None, False), (False, 3, False), (True, 4, False),
                          pytest.param(True, 4, True, marks=pytest.mark.slow)])
def test_unequal_shares_match_one_process_at_the_same_global_batch(tmp_path, wrap_ddp, micro, oom_recovery):
    steps = 24  # > 2 epochs of 101 samples, with final batches of 1 and 2 samples (ghosts on rank 0)
    ranks = _spawn(tmp_path, wrap_ddp=wrap_ddp, micro=micro, weights=WEIGHTS, steps=steps, oom_recovery=oom_recovery)
    r0, r1 = (r["records"] for r in ranks)
    # Shares in proportion 1:3 by the largest remainder: rank 1 gets 3/4 of each batch (rounded).
    for a, b in zip(r0, r1):
        size = a["global_size"]
        assert a["local_size"] == len(a["indices"]) and b["local_size"] == len(b["indices"])
        assert abs(len(b["indices"]) - 0.75 * size) < 1
    assert any(a["local_size"] == 0 for a in r0), "no ghost micro-batch on rank 0"
    if micro is not None:  # accumulation: both ranks run the larger share's count of micro-batches
        assert any(a["accumulation_steps"] > 1 and len(a["indices"]) < len(b["indices"]) for a, b in zip(r0, r1))
    _check_against_one_process(ranks, steps, micro, [1.0, 3.0])


def test_out_of_memory_replay_with_unequal_shares_matches_one_process(tmp_path):
    # Rank 1 holds 3/4 of each batch and fits at most 9 rows: its steps of more run again with smaller
    # micro-batches (the bound agreed over ranks), rank 0's too, with the same samples and the same result.
    steps = 16
    ranks = _spawn(tmp_path, wrap_ddp=True, micro=None, weights=WEIGHTS, steps=steps, oom_recovery=True, oom_limit=9)
    assert ranks[0]["replays"] == ranks[1]["replays"] >= 1
    assert ranks[0]["micro"] == ranks[1]["micro"] <= 9
    _check_against_one_process(ranks, steps, None, [1.0, 3.0])


def test_weights_changed_mid_epoch_keep_exact_coverage_and_exact_gradients(tmp_path):
    steps = 24
    change_at = {3: [2.0, 1.0], 7: [1.0, 5.0], 11: [1.0, 1.0], 16: [3.0, 2.0]}
    ranks = _spawn(tmp_path, wrap_ddp=True, micro=5, weights=None, steps=steps, change_at=change_at)
    r0, r1 = (r["records"] for r in ranks)
    assert len(r1[4]["indices"]) == r1[4]["global_size"] // 3  # step 4 (after the change at step 3): 2:1
    _check_against_one_process(ranks, steps, 5, [3.0, 2.0])


def _noise_worker(rank: int, world_size: int, init_file: str, out_dir: str, wrap_ddp: bool, micro) -> None:
    """The gradient noise of a least-squares problem (weights frozen) with shares 1:3."""
    from test_engine_stats import least_squares

    with h.worker_group(rank, world_size, init_file):
        ds, model, true_g2, true_tr = least_squares(n=60_000)
        net = torch.nn.parallel.DistributedDataParallel(model) if wrap_ddp else model
        pilot = batchpilot.Pilot(net, torch.optim.SGD(net.parameters(), lr=0.0), ds, batch_size=256, noise_every=1,
                                 max_micro_batch_size=micro, rank_weights=WEIGHTS)
        sizes = set()
        for x, y in pilot.batches(max_steps=600):
            sizes.add(len(x))
            pilot.backward(0.5 * ((net(x).view(-1) - y) ** 2).mean())
        out = {k: v for k, v in pilot.last_record.items() if k.startswith("stats/")}
        out.update(true_g2=true_g2, true_tr=true_tr, sizes=sorted(sizes))
        Path(out_dir, f"noise{rank}.json").write_text(json.dumps(out))
        del pilot, net, model


@pytest.mark.parametrize(("wrap_ddp", "micro"), [(True, None), pytest.param(False, None, marks=pytest.mark.slow),
                                                  pytest.param(True, 40, marks=pytest.mark.slow)])
def test_noise_scale_with_unequal_shares_matches_the_closed_form(tmp_path, wrap_ddp, micro):
    # The small batches (each rank's micro-batches: 64 and 192 samples here) differ in size; the estimator's
    # harmonic mean of their sizes keeps E|g_small|^2 = |G|^2 + tr(Sigma) / b_small exact. An arithmetic mean
    # (128) would overstate tr(Sigma) by a third.
    mp.spawn(_noise_worker, args=(2, str(tmp_path / "init"), str(tmp_path), wrap_ddp, micro), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"noise{r}.json").read_text()) for r in range(2))
    assert {k: v for k, v in r0.items() if k != "sizes"} == {k: v for k, v in r1.items() if k != "sizes"}
    assert max(r0["sizes"]) < min(r1["sizes"])  # rank 0's micro-batches are the smaller ones
    assert r0["stats/grad_sq_norm"] == pytest.approx(r0["true_g2"], rel=0.1)
    assert r0["stats/trace_cov"] == pytest.approx(r0["true_tr"], rel=0.1)


# ---------------------------------------------------------------------------------------------- "auto"
class _SlowLinear(torch.nn.Module):
    """A linear model whose forward sleeps ``per_sample`` seconds per sample (a slower device)."""

    def __init__(self, per_sample: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 2).double()
        self.per_sample = per_sample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.per_sample * len(x))
        return self.linear(x)


def _auto_worker(rank: int, world_size: int, init_file: str, out_dir: str, wrap_ddp: bool) -> None:
    with h.worker_group(rank, world_size, init_file):
        torch.manual_seed(0)
        # rank 1 is 3x slower per sample; sleeps long enough that a loaded machine's wake-up delays (a fixed cost per
        # micro-batch, which pulls the measured ratio towards 1) stay small beside them
        model = _SlowLinear(0.002 if rank == 0 else 0.006)
        net = torch.nn.parallel.DistributedDataParallel(model) if wrap_ddp else model
        log = Path(out_dir, "log.jsonl")
        pilot = batchpilot.Pilot(net, torch.optim.SGD(net.parameters(), lr=0.01), h.make_data(), batch_size=32,
                                 rank_weights="auto", log_path=log, checkpoint_dir=Path(out_dir, "ckpt"))
        for x, y in pilot.batches(max_steps=60):
            pilot.backward(torch.nn.functional.cross_entropy(net(x), y))
        pilot.save_checkpoint()
        pilot.close()
        result = {"weights": pilot.rank_weights, "changes": pilot._ranks.balancer.changes}
        # Resumed on 2 ranks: "auto" continues the saved weights and estimates exactly; a fixed list is the new
        # Pilot's own setting; None shares evenly again.
        for setting in ("auto", [2.0, 1.0], None):
            again = batchpilot.Pilot(net, torch.optim.SGD(net.parameters(), lr=0.01), h.make_data(), batch_size=32,
                                     rank_weights=setting)
            again.load_checkpoint(Path(out_dir, "ckpt"))
            result[f"resumed {setting}"] = again.rank_weights
            if setting == "auto":
                result["same estimates"] = again._ranks.balancer.state_dict() == pilot._ranks.balancer.state_dict()
        Path(out_dir, f"auto{rank}.json").write_text(json.dumps(result))
        del pilot, net


@pytest.mark.parametrize("wrap_ddp", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_auto_weights_find_the_speed_ratio_of_a_slowed_rank(tmp_path, wrap_ddp):
    mp.spawn(_auto_worker, args=(2, str(tmp_path / "init"), str(tmp_path), wrap_ddp), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"auto{r}.json").read_text()) for r in range(2))
    assert r0["weights"] == r1["weights"]
    w0, w1 = r0["weights"]
    assert w0 / w1 == pytest.approx(3.0, rel=0.3)
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    changes = [line for line in lines if line.get("event") == "rank_weights"]
    assert len(changes) == r0["changes"] >= 1
    assert changes[-1]["new"] == r0["weights"] and changes[0]["old"] is None
    assert r0["resumed auto"] == r0["weights"] and r0["same estimates"]
    assert r0["resumed [2.0, 1.0]"] == [2.0, 1.0] and r0["resumed None"] is None
    # The checkpoint holds the weights and the estimates: a one-process run resumes it with even shares.
    state = batchpilot.read_checkpoint(sorted((tmp_path / "ckpt").glob("step-*.pt"))[-1])
    assert state["loader"]["rank_weights"] == r0["weights"]
    assert state["rank_weights"]["balancer"]["weights"] == r0["weights"]
    model = _SlowLinear(0.0)
    solo = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.01), h.make_data(), batch_size=32,
                            rank_weights="auto", world_size=1)
    solo.load_state_dict(state)
    assert solo.rank_weights is None


def test_world_size_one_accepts_one_weight_and_auto_as_no_ops():
    for setting in ([2.5], "auto", None):
        model = h.make_model()
        pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), h.make_data(), batch_size=8,
                                 rank_weights=setting)
        for x, y in pilot.batches(max_steps=3):
            assert pilot.micro_batch.local_size == pilot.micro_batch.global_size
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        assert pilot.rank_weights == ((2.5,) if setting == [2.5] else None)


@pytest.mark.parametrize(("value", "words"), [
    ([-1.0], "rank_weights[0] is -1.0"),
    ([0.0], "finite number > 0"),
    ([float("nan")], "rank_weights[0] is nan"),
    ([float("inf")], "rank_weights[0] is inf"),
    ([1.0, 2.0], "has 2 weights ([1.0, 2.0]) but world_size is 1"),
    ("fastest", "rank_weights='fastest'"),
    (3, "of type int"),
])
def test_pilot_refuses_bad_rank_weights(value, words):
    model = h.make_model()
    # Checked with the other settings (one ValueError listing every problem; a wrong type too), the number of
    # weights once the world size is known.
    with pytest.raises(ValueError) as info:
        batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), h.make_data(), batch_size=8,
                         rank_weights=value)
    assert words in str(info.value)


def test_a_checkpoint_from_before_rank_weights_resumes_with_this_pilots_fixed_weights():
    # A state without the "rank_weights" part (saved before it existed): the loader's state shares evenly, and the
    # part still applies this Pilot's fixed setting instead of leaving the shares even.
    from batchpilot.data.loader import AdaptiveDataLoader
    from batchpilot.engine.rank_balance import PilotRankWeights
    from batchpilot.engine.state import load_parts

    loader = AdaptiveDataLoader(list(range(40)), 8, rank=0, world_size=2)
    part = PilotRankWeights([3.0, 1.0], loader=loader, world_size=2, rank=0, device=torch.device("cpu"),
                            forward_only=False, event=lambda kind, data: None)
    assert loader.sampler.rank_weights == (3.0, 1.0)
    loader.set_rank_weights(None)  # what loading an old loader state does
    load_parts({"lr_schedulers": []}, {"rank_weights": part}, [])
    assert loader.sampler.rank_weights == (3.0, 1.0)
