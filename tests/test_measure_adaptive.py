"""The noise probe's adaptive period (issue 21, point 5): free small batches first, splits only when needed,
the period following the estimate's relative error, an unbiased estimate, and exact resume."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers.base import Controller
from batchpilot.measure import DECAY_PER_STEP, MAX_PERIOD, MIN_SPLIT_PERIOD, GradientNoiseProbe
from batchpilot.stats import NoiseScaleEstimator


class KeepSize(Controller):
    """Reads the noise scale (so the engine measures it) and keeps the size."""

    required_stats = ("stats/noise_scale",)

    def decide(self, obs) -> int:
        return obs.batch_size


def regression(n: int = 4000, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = x @ torch.randn(d, generator=g) + 0.5 * torch.randn(n, generator=g)
    torch.manual_seed(seed)
    return TensorDataset(x, y), torch.nn.Linear(d, 1)


def feed(probe: GradientNoiseProbe, step: int, rng: torch.Generator, *, mean: torch.Tensor, sigma: float,
         batch: int = 32) -> bool:
    """One step of a synthetic problem: the true gradient ``mean``, per-sample noise ``sigma`` per coordinate
    (``tr(Sigma) = d sigma^2``), split into two halves when measured (or always: ``split`` below)."""
    probe.begin_step(step)
    if not probe.measuring:
        return False
    (param,) = probe.params
    half = batch // 2
    parts = [mean + sigma / math.sqrt(half) * torch.randn(mean.shape, generator=rng, dtype=mean.dtype)
             for _ in range(2)]
    param.grad = torch.zeros_like(param)
    for j, g in enumerate(parts):
        param.grad += 0.5 * g  # the engine's loss weight n_j / B
        probe.after_backward(half, to_mean=0.5, synced=False, last=j == 1)
    probe.end_step(batch, float(param.grad.pow(2).sum()))
    return True


def test_relative_error_needs_two_effective_updates_and_reads_zero_without_spread():
    est = NoiseScaleEstimator(ema_decay=0.5)
    assert est.relative_error is None
    est.update(16, 3.0, 32, 2.0)
    assert est.relative_error is None  # one update: no spread to read
    for _ in range(5):
        est.update(16, 3.0, 32, 2.0)
    assert est.relative_error == pytest.approx(0.0, abs=1e-6)
    est.update(16, 4.0, 32, 2.2)
    assert est.relative_error > 0 and est.relative_error_at(1000.0) < est.relative_error


def test_relative_error_matches_the_spread_of_the_smoothed_estimate():
    # Many independent estimators fed iid unbiased measurements: the spread of their b_simple around its mean
    # is what relative_error says it is (within 25%).
    d, sigma, b = 20, 1.0, 32
    finals, said = [], []
    rng = torch.Generator().manual_seed(0)
    mean = torch.full((d,), 0.5, dtype=torch.float64)
    for _ in range(300):
        est = NoiseScaleEstimator(ema_decay=0.9)
        for _ in range(60):
            halves = [mean + sigma / math.sqrt(b // 2) * torch.randn(d, generator=rng, dtype=torch.float64)
                      for _ in range(2)]
            big = (halves[0] + halves[1]) / 2
            est.update(b // 2, float(sum(h.pow(2).sum() for h in halves)) / 2, b, float(big.pow(2).sum()))
        finals.append(est.b_simple)
        said.append(est.relative_error)
    finals_t = torch.tensor(finals)
    spread = float(finals_t.std() / finals_t.mean())
    assert float(torch.tensor(said).median()) == pytest.approx(spread, rel=0.25)


def test_a_per_update_decay_weighs_each_update_by_it_and_corrects_by_the_sum_of_weights():
    est = NoiseScaleEstimator()
    values = [(3.0, 2.0, 0.5), (5.0, 3.0, 0.9), (4.0, 2.5, 0.2)]  # (small, big, decay)
    for small, big, decay in values:
        est.update(16, small, 32, big, decay=decay)
    weights = [(1 - d) for _, _, d in values]
    weights = [w * math.prod(d for _, _, d in values[i + 1:]) for i, w in enumerate(weights)]
    trace = [(s - b) / (1 / 16 - 1 / 32) for s, b, _ in values]
    assert est.trace_cov == pytest.approx(sum(w * t for w, t in zip(weights, trace)) / sum(weights))
    with pytest.raises(ValueError, match="decay"):
        est.update(16, 3.0, 32, 2.0, decay=1.0)
    assert est.count == 3


def test_a_state_saved_before_per_update_decays_loads_with_the_same_readings():
    est = NoiseScaleEstimator(ema_decay=0.9)
    for small, big in [(3.0, 2.0), (5.0, 3.0)]:
        est.update(16, small, 32, big)
    old = {k: v for k, v in est.state_dict().items() if k not in ("weight", "weight_sq", "moments")}
    loaded = NoiseScaleEstimator()
    loaded.load_state_dict(old)
    assert loaded.metrics() == pytest.approx(est.metrics())
    assert loaded.relative_error is None  # no spread was saved: it is read again from new updates
    with pytest.raises(ValueError, match="weight"):
        loaded.load_state_dict({**est.state_dict(), "weight": 2.0})


def test_bad_probe_settings_are_refused_with_the_fix():
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="ema_decay=0.9 needs a fixed period"):
        GradientNoiseProbe(params, every=None, ema_decay=0.9)
    with pytest.raises(ValueError, match="target_error"):
        GradientNoiseProbe(params, every=None, target_error=0)


def test_the_period_lengthens_once_the_estimate_settles_and_shortens_when_it_moves():
    param = torch.nn.Parameter(torch.zeros(50, dtype=torch.float64))
    probe = GradientNoiseProbe([param], every=None)
    rng = torch.Generator().manual_seed(0)
    mean = torch.full((50,), 0.2, dtype=torch.float64)  # |G|^2 = 2, tr(Sigma) = 50: B_simple = 25
    assert probe.split_every == probe.splits and probe.splits(0) and not probe.splits(1)
    periods = []
    for step in range(3000):
        if feed(probe, step, rng, mean=mean, sigma=1.0):
            periods.append(probe.every)
    assert periods[0] == 1 and max(periods) == MAX_PERIOD and periods[-1] >= MAX_PERIOD // 2
    measured = len(periods)
    assert measured < 3000 / 8  # settled: far fewer measurements than at the start's pace
    # The true gradient collapses (a moving, now very uncertain estimate): the period shortens again, within
    # about the estimate's memory (~400 steps, plus measurements at the long period to notice).
    after = [probe.every for step in range(3000, 3800) if feed(probe, step, rng, mean=mean * 0.05, sigma=1.0)]
    assert after[0] == MAX_PERIOD and min(after) <= 2


def test_the_adaptive_schedule_keeps_the_estimates_unbiased():
    # A stationary synthetic problem with known |G|^2 and tr(Sigma): the time average of the smoothed estimates
    # under the adaptive schedule (which decides from earlier measurements when to measure) matches the truth.
    d, sigma = 50, 1.0
    mean = torch.full((d,), 0.2, dtype=torch.float64)
    true_g2, true_tr = float(mean.pow(2).sum()), d * sigma**2
    g2s, trs = [], []
    for seed in range(3):
        param = torch.nn.Parameter(torch.zeros(d, dtype=torch.float64))
        probe = GradientNoiseProbe([param], every=None)
        rng = torch.Generator().manual_seed(seed)
        for step in range(6000):
            feed(probe, step, rng, mean=mean, sigma=sigma)
            if step >= 500:
                g2s.append(probe.estimator.grad_sq_norm)
                trs.append(probe.estimator.trace_cov)
    assert sum(g2s) / len(g2s) == pytest.approx(true_g2, rel=0.06)
    assert sum(trs) / len(trs) == pytest.approx(true_tr, rel=0.03)


def test_steps_with_their_own_micro_batches_are_measured_without_a_split():
    ds, model = regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=64, max_micro_batch_size=16, controller=KeepSize())
    counts = []
    pilot.add_callback(lambda p, record: counts.append(record["stats/noise_count"]))
    for x, y in pilot.batches(max_steps=6):
        assert pilot.micro_batch.accumulation_steps == 4  # never more micro-batches than the bound asks for
        pilot.backward(((model(x).view(-1) - y) ** 2).mean())
    # At the start (period 1) every step is measured: four micro-batches are four small batches, no split.
    assert counts[:3] == [1, 2, 3]


def run(pilot: batchpilot.Pilot, model: torch.nn.Module, steps: int) -> list[tuple[int, int]]:
    plan = []
    for x, y in pilot.batches(max_steps=steps):
        if pilot.micro_batch.micro_index == 0:
            plan.append((pilot.micro_batch.step, pilot.micro_batch.accumulation_steps))
        pilot.backward(((model(x).view(-1) - y) ** 2).mean())
    return plan


def build(workers: int = 0) -> tuple[batchpilot.Pilot, torch.nn.Module]:
    ds, model = regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # the period goes up to 64 and back down within 400 steps
    prefetch = {"prefetch_factor": 16} if workers else {}  # 32 micro-batches ahead: past a split period of 16
    return batchpilot.Pilot(model, opt, ds, batch_size=32, controller=KeepSize(), num_workers=workers,
                            progress=False, **prefetch), model


def test_the_adaptive_period_resumes_exactly():
    whole, model = build()
    periods: list[float] = []
    whole.add_callback(lambda p, record: periods.append(record["stats/noise_period"]))
    plan = run(whole, model, 400)
    assert any(n == 2 for _, n in plan) and max(periods) == MAX_PERIOD and periods[-1] < MAX_PERIOD

    first, model1 = build()
    run(first, model1, 170)
    state = first.state_dict()
    assert state["noise"]["adaptive"] is True and state["noise"]["last_update"] is not None
    second, model2 = build()
    second.load_state_dict(state)
    assert run(second, model2, 400) == plan[170:]
    assert second.state_dict()["noise"] == whole.state_dict()["noise"]
    assert torch.equal(model2.weight, model.weight)
    keys = [k for k in whole.last_record if k.startswith("stats/")]
    assert keys and {k: second.last_record[k] for k in keys} == {k: whole.last_record[k] for k in keys}


def test_workers_prefetching_ahead_of_a_period_change_split_the_same_steps():
    # With workers the loader plans steps ahead; when the period changes the steps planned under the old one
    # are planned again (a rewind), so the split steps and the weights equal those without workers.
    in_process, model = build()
    plan = run(in_process, model, 200)
    prefetched, model_w = build(workers=2)
    try:
        assert run(prefetched, model_w, 200) == plan
    finally:
        prefetched.close()
    assert torch.equal(model_w.weight, model.weight)
    assert prefetched.loader.rewinds > 0  # the period did change under prefetched steps


def test_a_fixed_period_checkpoint_stays_fixed_when_loaded():
    params = [torch.nn.Parameter(torch.zeros(2))]
    fixed = GradientNoiseProbe(params, every=16)
    state = fixed.state_dict()
    del state["adaptive"], state["last_update"]  # as saved before the adaptive period
    probe = GradientNoiseProbe(params, every=None)
    probe.load_state_dict(state)
    assert not probe.adaptive and probe.every == 16 and probe.split_every == 16
    assert DECAY_PER_STEP ** (4 * MIN_SPLIT_PERIOD) < 1
