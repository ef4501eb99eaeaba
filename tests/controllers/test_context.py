"""Context-aware schedules (seed 003 §5.3, §7.1, §7.2): ``ContextSchedule(fn, provider)`` and the data providers
``DataMix`` / ``DataScore``, alone and in real ``Pilot`` runs (in process, with workers, resumed, on 2 gloo ranks).

Expected sizes come from a by-hand simulation of the epoch order (the sampler's permutation), not from batchpilot's
loader: the context is the next samples of the order from the data position."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import (
    ContextSchedule,
    DataMix,
    DataScore,
    InvalidDecisionError,
    Observation,
    curriculum_scheduler,
    incremental_scheduler,
    task_aware_scheduler,
)
from batchpilot.data import AdaptiveBatchSampler

N = 90


def problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 5, generator=g, dtype=torch.float64)
    y = (x[:, 0] - x[:, 1] > 0).long()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    return TensorDataset(x, y), model


def difficulty_scores() -> np.ndarray:
    return np.random.default_rng(7).random(N)  # a per-sample difficulty in [0, 1)


def simulate(first: int, decide, epochs: int, *, seed: int = 0, shuffle: bool = True, steps: int | None = None):
    """Sizes of a run whose decision after each step is ``decide(step, size, next_indices)`` (next ``size``
    samples of the epoch order from the position), worked out from the sampler's order alone."""
    order = AdaptiveBatchSampler(N, 1, seed=seed, shuffle=shuffle).order
    stream = lambda e, o, k: order(e)[o:o + k]  # noqa: E731  (the next step's samples: never past the epoch)
    sizes, size, step = [], first, 0
    for epoch in range(epochs):
        offset = 0
        while offset < N and (steps is None or step < steps):
            sizes.append(min(size, N - offset))
            offset += sizes[-1]
            step += 1
            at = (epoch + 1, 0) if offset == N else (epoch, offset)
            size = decide(step, size, stream(*at, min(size, N)))
    return sizes


def run_pilot(controller, provider=None, *, first=6, epochs=2, steps=None, **settings):
    ds, model = problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=first, controller=controller, **settings)
    if provider is not None:
        provider.attach(pilot)
    sizes = []
    for x, y in pilot.batches(epochs=epochs if steps is None else None, max_steps=steps):
        if pilot.micro_batch.micro_index == 0:
            sizes.append(pilot.micro_batch.global_size)
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    return sizes, [p.detach().clone() for p in model.parameters()], pilot


# ---------------------------------------------------------------------- the seed's functions and the schedule
def test_seed_functions_follow_the_seed_rules():
    assert task_aware_scheduler(0, 10, {"task_a": 0.6, "task_b": 0.4}) == 12
    assert task_aware_scheduler(0, 63, {"task_a": 0.6, "task_b": 0.4}) == 64
    assert task_aware_scheduler(0, 10, {"task_a": 0.3, "task_b": 0.7}) == 9
    assert task_aware_scheduler(0, 8, {"task_a": 0.3, "task_b": 0.7}) == 8
    assert incremental_scheduler(0, 10, 0.29) == 11 and incremental_scheduler(0, 32, 0.0) == 32
    assert incremental_scheduler(0, 10, 0.3) == 9 and incremental_scheduler(0, 8, 0.9) == 8
    assert curriculum_scheduler(0, 10, 0.81) == 8 and curriculum_scheduler(0, 5, 0.9) == 4
    assert curriculum_scheduler(0, 10, 0.8) == 11 and curriculum_scheduler(0, 32, 0.1) == 32
    assert functools.partial(curriculum_scheduler, max_size=64)(0, 40, 0.1) == 41
    with pytest.raises(ValueError, match="task_ratios is empty"):
        task_aware_scheduler(0, 10, {})


def test_context_holds_the_observation_and_the_provider_entries():
    seen = []
    schedule = ContextSchedule(lambda step, size, ctx: seen.append(dict(ctx)) or size + 1,
                               lambda: {"difficulty": 0.25, "task_ratios": {"a": 1.0}})
    obs = Observation(step=3, samples_seen=30, epoch=0, coverage=0.5, batch_size=10, num_samples=60,
                      losses=(0.9, 0.7), samples_per_s=100.0, stats={"stats/noise_scale": 42.0})
    assert schedule.decide(obs) == 11
    ctx = seen[0]
    assert ctx["step"] == 3 and ctx["batch_size"] == 10 and ctx["epochs_done"] == 0.5 and ctx["loss"] == 0.7
    assert ctx["stats/noise_scale"] == 42.0 and ctx["difficulty"] == 0.25 and ctx["task_ratios"] == {"a": 1.0}
    assert schedule.reason == "{'difficulty': 0.25, 'task_ratios': {'a': 1}} -> 11"
    with pytest.raises(TypeError):
        schedule.last_context["step"] = 4  # read-only
    # Without a provider: the observation alone (here its noise scale); with key=, only that entry.
    by_noise = ContextSchedule(lambda step, size, noise: int(noise), key="stats/noise_scale")
    assert by_noise.decide(obs) == 42 and by_noise.reason == "stats/noise_scale=42 -> 42"
    assert ContextSchedule(lambda s, b, ctx: ctx["loss"] > 0.5 and 2 * b).decide(obs) == 20


def test_bad_functions_providers_and_contexts_are_refused_clearly():
    with pytest.raises(TypeError, match=r"fn\(step, current_size, context\).*cannot be called"):
        ContextSchedule(lambda step, size: size)
    with pytest.raises(TypeError, match="needs a callable"):
        ContextSchedule(3)
    with pytest.raises(TypeError, match=r"provider\(\).*cannot be called"):
        ContextSchedule(curriculum_scheduler, lambda obs: {})
    with pytest.raises(TypeError, match="zero-argument callable"):
        ContextSchedule(curriculum_scheduler, {"difficulty": 0.3})
    with pytest.raises(TypeError, match="key must be a str"):
        ContextSchedule(curriculum_scheduler, key=1)
    obs = Observation(step=1, samples_seen=8, epoch=0, coverage=0.1, batch_size=8)
    with pytest.raises(TypeError, match="must return a mapping with string keys"):
        ContextSchedule(curriculum_scheduler, lambda: 0.4, key="difficulty").decide(obs)
    with pytest.raises(ValueError, match=r"returned \['step'\], which the observation already provides"):
        ContextSchedule(curriculum_scheduler, lambda: {"step": 4}).decide(obs)
    with pytest.raises(KeyError, match=r"reads context\['difficulty'\], which is missing.*'hardness'"):
        ContextSchedule(curriculum_scheduler, lambda: {"hardness": 0.4}, key="difficulty").decide(obs)


@pytest.mark.parametrize("bad,problem_text", [(0, "not positive"), (math.nan, "not finite"), (2.5, "not a whole"),
                                              ("8", "of type str")])
def test_a_bad_size_stops_the_pilot_at_the_decision_boundary_naming_the_schedule(bad, problem_text, tmp_path):
    schedule = ContextSchedule(lambda step, size, d: bad if step == 2 else size, lambda: {"d": 0.5}, key="d",
                               name="my_curriculum")
    with pytest.raises(InvalidDecisionError, match=f"my_curriculum returned .*{problem_text}"):
        run_pilot(schedule, steps=5, checkpoint_dir=tmp_path)
    assert (tmp_path / "step-000000002.pt").exists()  # the finished step was kept, as for every controller
    sizes, _, pilot = run_pilot(schedule, steps=5, on_invalid="keep")
    assert sizes == [6] * 5 and "invalid value" in pilot.last_decision["note"]


class CountingProvider:
    """A stateful provider: counts its calls (its count is in the checkpoint)."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return {"calls": self.calls}

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_state_is_the_fn_and_provider_state_and_a_foreign_state_is_refused():
    provider = CountingProvider()
    schedule = ContextSchedule(lambda s, b, c: b + c, provider, key="calls")
    obs = Observation(step=1, samples_seen=8, epoch=0, coverage=0.1, batch_size=8)
    assert [schedule.decide(obs) for _ in range(3)] == [9, 10, 11]
    state = json.loads(json.dumps(schedule.state_dict()))
    assert state == {"name": "<lambda>", "provider": {"calls": 3}}
    again = ContextSchedule(lambda s, b, c: b + c, CountingProvider(), key="calls")
    again.load_state_dict(state)
    assert again.decide(obs) == 12
    with pytest.raises(ValueError, match="not by a ContextSchedule"):
        again.load_state_dict({"name": "LinearIncrease", "start": 4})


# ---------------------------------------------------------------------- the data providers
def test_data_providers_read_the_next_samples_from_the_position():
    sampler = AdaptiveBatchSampler(N, 10, seed=3)
    labels = np.where(np.arange(N) < 30, "task_a", "task_b")
    mix, score = DataMix(labels, key="task_ratios", source=sampler), DataScore(np.arange(N) / N, source=sampler)
    for _ in range(4):
        sampler.next_global_batch()
    window = sampler.order(0)[40:50]  # the next step's samples at the size in force
    assert list(window) == list(score.indices())
    assert score() == {"score": pytest.approx(float(np.mean(window / N)))}
    share = float(np.mean(window < 30))
    assert mix() == {"task_ratios": {"task_a": pytest.approx(share), "task_b": pytest.approx(1 - share)}}
    for size in [10] * 4 + [5]:  # 85 samples in: the next step takes the epoch's last 5 only
        sampler.set_batch_size(size)
        sampler.next_global_batch()
    sampler.set_batch_size(10)
    assert list(score.indices()) == list(sampler.order(0)[85:])
    crossing = DataScore(np.zeros(N), window=10, source=sampler).indices()  # window=: into epoch 1's order
    assert list(crossing) == list(sampler.order(0)[85:]) + list(sampler.order(1)[:5])
    assert len(DataScore(np.zeros(N), window=50, source=sampler).indices()) == 50
    assert DataScore(np.arange(N), reduce=np.max, source=lambda: sampler)()["score"] == max(sampler.order(0)[85:])
    # drop_last: a tail smaller than the size in force is skipped, as the sampler drops it.
    dropping = AdaptiveBatchSampler(N, 20, seed=3, drop_last=True)
    for _ in range(4):
        dropping.next_global_batch()
    assert list(DataScore(np.zeros(N), source=dropping).indices()) == list(dropping.order(1)[:20])


def test_data_providers_refuse_bad_values_and_sources_clearly():
    with pytest.raises(ValueError, match="must be finite; sample 2 has nan"):
        DataScore([0.1, 0.2, math.nan])
    with pytest.raises(ValueError, match="one value per sample"):
        DataScore([])
    with pytest.raises(TypeError, match="all strings or all numbers"):
        DataMix(["a", 1, None])
    with pytest.raises(RuntimeError, match=r"call \.attach\(source\)"):
        DataScore(np.zeros(N))()
    with pytest.raises(TypeError, match="cannot read the data position from 3"):
        DataScore(np.zeros(N), source=3)()
    with pytest.raises(ValueError, match="has 10 values, but the training data has 90 samples"):
        DataScore(np.zeros(10), source=AdaptiveBatchSampler(N, 4))()
    with pytest.raises(ValueError, match="window must be"):
        DataScore(np.zeros(N), window=0)


# ---------------------------------------------------------------------- in Pilot
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pilot_curriculum_follows_the_difficulty_of_the_next_samples(num_workers):
    scores = difficulty_scores()
    difficulty = DataScore(scores, key="difficulty")
    schedule = ContextSchedule(functools.partial(curriculum_scheduler, threshold=0.55, min_size=2, max_size=16),
                               difficulty, key="difficulty")
    sizes, _, pilot = run_pilot(schedule, difficulty, epochs=3, num_workers=num_workers)
    rule = functools.partial(curriculum_scheduler, threshold=0.55, min_size=2, max_size=16)
    expected = simulate(6, lambda step, size, idx: rule(step, size, float(np.mean(scores[idx]))), 3)
    assert sizes == expected  # workers prefetch ahead: the context is still read at the trained position
    assert len(set(sizes)) > 4 and pilot.samples_seen == 3 * N
    assert pilot.controller.reason.startswith("difficulty=")


def test_pilot_multi_task_and_incremental_examples_follow_their_data_mix():
    tasks = np.where(np.arange(N) % 3 == 0, "task_b", "task_a")  # two thirds task_a
    mix = DataMix(tasks, key="task_ratios")
    sizes, _, _ = run_pilot(ContextSchedule(task_aware_scheduler, mix, key="task_ratios"), mix)
    expected = simulate(6, lambda s, b, idx: task_aware_scheduler(
        s, b, {t: float(np.mean(tasks[idx] == t)) for t in ("task_a", "task_b")}), 2)
    assert sizes == expected and min(sizes[:-1]) >= 6
    is_new = (np.arange(N) >= 60).astype(float)  # the last 30 samples are new data; natural order
    new = DataScore(is_new, key="new_data_ratio")
    sizes, _, _ = run_pilot(ContextSchedule(incremental_scheduler, new, key="new_data_ratio"), new, shuffle=False,
                            first=10)
    expected = simulate(10, lambda s, b, idx: incremental_scheduler(s, b, float(np.mean(is_new[idx]))), 2,
                        shuffle=False)
    assert sizes == expected and sizes[:7] == [10, 11, 12, 13, 14, 13, 12]  # grows on old data, shrinks on new


def test_pilot_resume_gives_the_same_sizes_and_bitwise_weights(tmp_path):
    scores = difficulty_scores()

    def schedule(provider):
        return ContextSchedule(functools.partial(curriculum_scheduler, threshold=0.5, min_size=2, max_size=20),
                               provider, key="difficulty")

    d_full = DataScore(scores, key="difficulty")
    full_sizes, full_weights, _ = run_pilot(schedule(d_full), d_full, steps=30)
    d_first = DataScore(scores, key="difficulty")
    first_sizes, _, _ = run_pilot(schedule(d_first), d_first, steps=13, checkpoint_dir=tmp_path, checkpoint_every=13)
    ds, model = problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d_rest = DataScore(scores, key="difficulty")
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=6, controller=schedule(d_rest), checkpoint_dir=tmp_path)
    d_rest.attach(pilot)
    pilot.load_checkpoint(tmp_path)
    rest = []
    for x, y in pilot.batches(max_steps=30):
        if pilot.micro_batch.micro_index == 0:
            rest.append(pilot.micro_batch.global_size)
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert first_sizes + rest == full_sizes
    for a, b in zip(full_weights, model.parameters()):
        assert torch.equal(a, b.detach())


# ---------------------------------------------------------------------- 2 gloo ranks
def _rank_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        scores = difficulty_scores()
        difficulty = DataScore(scores, key="difficulty")
        calls = []
        # Rank 1's provider would return garbage: only rank 0 decides, so it is never called.
        provider = difficulty if rank == 0 else (lambda: calls.append(1) or {"difficulty": math.nan})
        rule = functools.partial(curriculum_scheduler, threshold=0.55, min_size=2, max_size=16)
        ds, model = problem()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        pilot = batchpilot.Pilot(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), ds, batch_size=6,
                                 controller=ContextSchedule(rule, provider, key="difficulty"))
        difficulty.attach(pilot)
        seen = []  # what DataScore reads on this rank after each step (the same global order and position)
        pilot.add_callback(lambda p, record: seen.append(difficulty()["difficulty"]))
        sizes = []
        for x, y in pilot.batches(epochs=2):
            if pilot.micro_batch.micro_index == 0:
                sizes.append(pilot.micro_batch.global_size)
            pilot.backward(torch.nn.functional.cross_entropy(ddp(x), y))
        result = {"sizes": sizes, "seen": seen, "calls": len(calls),
                  "weights": [p.detach().tolist() for p in model.parameters()]}
        Path(out_dir, f"context{rank}.json").write_text(json.dumps(result))
        del pilot, ddp
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.distributed
def test_two_gloo_ranks_agree_on_the_context_and_rank_0_decides(tmp_path):
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"context{r}.json").read_text()) for r in range(2))
    scores = difficulty_scores()
    rule = functools.partial(curriculum_scheduler, threshold=0.55, min_size=2, max_size=16)
    expected = simulate(6, lambda step, size, idx: rule(step, size, float(np.mean(scores[idx]))), 2)
    assert r0["sizes"] == r1["sizes"] == expected
    assert r0["seen"] == r1["seen"] and len(r0["seen"]) == len(expected)  # the context is the global batch's
    assert r1["calls"] == 0
    assert r0["weights"] == r1["weights"]


def test_with_token_budgets_the_window_is_the_samples_of_the_next_budget():
    lengths = np.random.default_rng(1).integers(1, 9, N)
    ds, model = problem()
    scores = difficulty_scores()
    difficulty = DataScore(scores, key="difficulty")
    seen = []
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=40,
                             batch_unit="tokens", lengths=lengths.tolist(),
                             controller=ContextSchedule(lambda s, b, d: seen.append(d) or b, difficulty,
                                                        key="difficulty"))
    difficulty.attach(pilot)
    steps = []
    for x, y in pilot.batches(max_steps=6):
        if pilot.micro_batch.micro_index == 0:
            steps.append(pilot.micro_batch.epoch * N + pilot.micro_batch.offset)
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    order = pilot.loader.sampler.order(0)
    starts = steps[1:] + [None]
    for d, start, stop in zip(seen, steps[1:], starts[1:]):  # the context of step k+1 is step k+1's samples
        if stop is not None:
            assert d == pytest.approx(float(np.mean(scores[order[start:stop]])))


def test_required_stats_make_the_pilot_measure_what_the_schedule_reads():
    for required in ((), ("stats/trace_cov",)):
        seen: list = []
        schedule = ContextSchedule(lambda s, b, ctx, seen=seen: seen.append(ctx.get("stats/trace_cov")) or b,
                                   required_stats=required)
        run_pilot(schedule, steps=20, max_micro_batch_size=3)  # no noise_every: measured only when asked for
        assert any(v is not None for v in seen) == bool(required)
    with pytest.raises(TypeError, match="required_stats must be a sequence"):
        ContextSchedule(curriculum_scheduler, required_stats="stats/noise_scale")
