"""Statistics measured by the engine: the gradient noise scale from micro-batches (McCandlish et al. 2018)
on a least-squares problem whose true |G|^2 and tr(Sigma) are known in closed form."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.stats import NoiseScaleEstimator


def least_squares(d: int = 20, n: int = 100_000, noise: float = 0.5, seed: int = 0):
    """y = x.w* + eps with x ~ N(0, I), eps ~ N(0, noise^2); per-example loss 0.5 (x.w - y)^2.

    At w = w* + u the per-example gradient is g = x (x.u - eps): E g = u, and
    E|g|^2 = E[(x.u)^2 |x|^2] + noise^2 E|x|^2 = (d + 2)|u|^2 + d noise^2 (Gaussian fourth moments),
    so |G|^2 = |u|^2 and tr(Sigma) = E|g|^2 - |G|^2 = (d + 1)|u|^2 + d noise^2.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w_star = torch.randn(d, generator=g, dtype=torch.float64)
    y = x @ w_star + noise * torch.randn(n, generator=g, dtype=torch.float64)
    model = torch.nn.Linear(d, 1, bias=False).double()
    u = 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_((w_star + u).view(1, -1))
    true_g2 = float(u @ u)
    true_tr = (d + 1) * true_g2 + d * noise**2
    return TensorDataset(x, y), model, true_g2, true_tr


@pytest.mark.parametrize("micro", [None, 64])
def test_noise_scale_matches_the_closed_form(micro):
    ds, model, true_g2, true_tr = least_squares()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights fixed, so the true values stay fixed
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=256, noise_every=1, max_micro_batch_size=micro)
    accumulation = []
    for x, y in pilot.batches(max_steps=300):
        accumulation.append(pilot.micro_batch.accumulation_steps)
        pilot.backward(0.5 * ((model(x).view(-1) - y) ** 2).mean())
    record = pilot.last_record
    # One micro-batch per step is split in two on measured steps; 256 / 64 gives 4 micro-batches anyway.
    assert set(accumulation) == ({2} if micro is None else {4})
    assert record["stats/grad_sq_norm"] == pytest.approx(true_g2, rel=0.1)
    assert record["stats/trace_cov"] == pytest.approx(true_tr, rel=0.1)
    assert record["stats/noise_scale"] == pytest.approx(true_tr / true_g2, rel=0.1)


def test_a_small_dataset_is_drawn_without_replacement_and_the_estimate_is_corrected_for_it():
    # 2,000 samples and B_simple ~ 390: the sampler draws each epoch without replacement, which makes the
    # uncorrected |G|^2 read ~20% low (B_simple ~25% high). Truth: the dataset's own mean gradient and
    # covariance trace (N - 1 normalisation) at the fixed weights.
    gen = torch.Generator().manual_seed(1)
    n, d = 2000, 20
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w_star = torch.randn(d, generator=gen, dtype=torch.float64)
    y = x @ w_star + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64)
    w = w_star + 0.025 * torch.randn(d, generator=gen, dtype=torch.float64)
    per_sample = x * (x @ w - y)[:, None]
    mean = per_sample.mean(0)
    true_g2, true_tr = float(mean @ mean), float(((per_sample - mean) ** 2).sum()) / (n - 1)
    model = torch.nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w.view(1, -1))
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.0), TensorDataset(x, y),
                             batch_size=256, noise_every=1, seed=1)
    assert pilot._noise.population == n
    # A long memory (~1000 measurements) so that the noise of single draws averages out; uncorrected, this
    # run reads |G|^2 0.81x and B_simple 1.23x the truth (other data seeds: 0.78-0.91x and 1.08-1.30x).
    pilot._noise.estimator = NoiseScaleEstimator(ema_decay=0.999)
    for xb, yb in pilot.batches(max_steps=2000):
        pilot.backward(0.5 * ((model(xb).view(-1) - yb) ** 2).mean())
    record = pilot.last_record
    assert true_tr / true_g2 == pytest.approx(389, rel=0.01)
    assert record["stats/grad_sq_norm"] == pytest.approx(true_g2, rel=0.05)
    assert record["stats/trace_cov"] == pytest.approx(true_tr, rel=0.05)
    assert record["stats/noise_scale"] == pytest.approx(true_tr / true_g2, rel=0.05)


def test_noise_measurement_every_k_steps_only_splits_those_steps(tmp_path):
    ds, model, _, _ = least_squares(n=5000)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=32, noise_every=3, log_path=tmp_path / "log.jsonl")
    steps = []
    for x, y in pilot.batches(max_steps=12):
        micro = pilot.micro_batch
        if micro.micro_index == 0:
            steps.append((micro.step, micro.accumulation_steps))
        pilot.backward(0.5 * ((model(x).view(-1) - y) ** 2).mean())
    pilot.close()
    assert steps == [(s, 2 if s % 3 == 0 else 1) for s in range(12)]
    records = [r for r in batchpilot.read_log(tmp_path / "log.jsonl") if r["type"] == "step"]
    assert "stats/noise_scale" in records[-1]


def test_a_controller_that_reads_noise_gets_the_adaptive_period_with_a_400_step_memory():
    from batchpilot.measure import DECAY_PER_STEP, MIN_SPLIT_PERIOD

    ds, model, _, _ = least_squares(n=5000)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=32, controller=batchpilot.controllers.NoiseScale())
    split = []
    for x, y in pilot.batches(max_steps=3 * MIN_SPLIT_PERIOD):
        if pilot.micro_batch.micro_index == 0:
            split.append(pilot.micro_batch.accumulation_steps == 2)
        pilot.backward(0.5 * ((model(x).view(-1) - y) ** 2).mean())
    # While the estimate is new (its error cannot be told yet), split steps are measured as often as allowed.
    assert [s for s, is_split in enumerate(split) if is_split] == [0, MIN_SPLIT_PERIOD, 2 * MIN_SPLIT_PERIOD]
    assert pilot.last_record["stats/noise_count"] == 3 and pilot.last_record["stats/noise_period"] < MIN_SPLIT_PERIOD
    # Each measurement weighs the steps since the previous one: 0.99 per 4 steps, the ~400-step memory.
    weight = pilot.state_dict()["noise"]["estimator"]["weight"]
    assert weight == pytest.approx(1 - DECAY_PER_STEP ** (1 + 2 * MIN_SPLIT_PERIOD))
    assert DECAY_PER_STEP**4 == pytest.approx(0.99)


def test_no_gradient_statistics_unless_asked():
    ds, model, _, _ = least_squares(n=1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=32)
    for x, y in pilot.batches(max_steps=4):
        assert pilot.micro_batch.accumulation_steps == 1
        pilot.backward(0.5 * ((model(x).view(-1) - y) ** 2).mean())
    assert not any(k.startswith("stats/") for k in pilot.last_record)


def test_adascale_lr_rule_scales_by_the_measured_gain_and_counts_progress():
    ds, model, true_g2, true_tr = least_squares(n=20_000)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=256, base_batch_size=32, lr_rule="adascale", noise_every=1)
    gains = []
    pilot.add_callback(lambda p, record: gains.append(record.get("lr/adascale_gain", 1.0)))
    for x, y in pilot.batches(max_steps=60):
        pilot.backward(0.5 * ((model(x).view(-1) - y) ** 2).mean())
    assert len(gains) == 60 and all(1.0 <= g <= 256 / 32 for g in gains) and max(gains) > 1.5
    # Johnson et al. 2020: r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2), sigma^2 = tr(Sigma) / B0, S = B / B0.
    # The weights move (lr > 0), so compare with the gain computed from the engine's own latest estimates.
    rec = pilot.last_record
    sigma2, mu2, S = rec["stats/trace_cov"] / 32, rec["stats/grad_sq_norm"], 256 / 32
    expected = (sigma2 + mu2) / (sigma2 / S + mu2)
    assert rec["lr/adascale_gain"] == pytest.approx(expected, rel=1e-12)
    assert pilot.adascale.progress == pytest.approx(sum(gains), rel=1e-12)  # progress: the sum of the gains
    assert opt.param_groups[0]["lr"] == 0.001  # the gain is applied around each optimizer step only


def test_micro_timer_on_cpu_is_the_wall_clock_and_feeds_the_throughput_model():
    import time

    from batchpilot.measure import MicroTimer, StepMeter

    timer = MicroTimer("cpu")
    assert not timer.cuda
    timer.start()
    time.sleep(0.02)
    elapsed = timer.stop()
    assert isinstance(elapsed, float) and 0.02 <= elapsed < 0.5 and MicroTimer.seconds(elapsed) == elapsed
    meter = StepMeter(system_every=None)
    for size in (8, 16, 32, 8, 16, 32):
        meter.begin_micro()
        time.sleep(0.001 * size)  # a + b m with b = 1 ms per sample
        meter.end_micro(size)
        meter.end_step(1, 1.0, 0.001 * size, skipped=False)
    a, b = meter.throughput.fit()
    assert b == pytest.approx(0.001, rel=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_micro_timer_on_cuda_counts_the_queued_work_not_the_launches():
    import time

    from batchpilot.measure import MicroTimer

    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    timer = MicroTimer(x.device)
    began = time.perf_counter()
    timer.start()
    for _ in range(50):
        x = torch.tanh(x @ x)
    pending = timer.stop()
    launched = time.perf_counter() - began  # the wall clock when the work is only queued
    torch.cuda.synchronize()
    wall = time.perf_counter() - began
    assert launched < 0.5 * wall  # the work really ran asynchronously
    assert MicroTimer.seconds(pending) == pytest.approx(wall, rel=0.3)


@pytest.fixture
def one_thread():
    # After a sleep torch's idle worker threads take milliseconds to wake, which would land in the next
    # micro-batch's time: these timing tests run on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_pilot(**kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = TensorDataset(torch.randn(512, 4), torch.randint(0, 2, (512,)))
    return model, batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.01), data, batch_size=16,
                                   progress=False, **kw)


def test_the_noise_probes_work_is_not_counted_as_the_micro_batchs_time(monkeypatch, one_thread):
    # The probe reads the gradients after each backward; that cost belongs to measuring, not to the
    # micro-batch, or the throughput fit that Goodput reads would carry it at the measured steps' sizes.
    import time

    model, pilot = _tiny_pilot(noise_every=1)
    slow = pilot._noise.after_backward

    def after_backward(*args, **kwargs):
        time.sleep(0.02)
        return slow(*args, **kwargs)

    monkeypatch.setattr(pilot._noise, "after_backward", after_backward)
    for x, y in pilot.batches(max_steps=25):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    record = pilot.last_record
    predicted = record["perf/micro_time_a_s"] + 16 * record["perf/micro_time_b_s"]
    assert predicted < 0.01  # a tiny linear model: well under the 20 ms the probe slept per micro-batch


def test_starting_a_data_iterator_is_not_counted_as_per_step_overhead(monkeypatch, one_thread):
    import time

    from batchpilot.data.loader import AdaptiveDataLoader

    model, pilot = _tiny_pilot()
    start = AdaptiveDataLoader.__iter__

    def slow_start(self):
        time.sleep(0.05)  # workers starting, say
        return start(self)

    monkeypatch.setattr(AdaptiveDataLoader, "__iter__", slow_start)
    for _ in range(12):  # many short loops: every one starts an iterator
        for x, y in pilot.batches(max_steps=pilot.step + 2):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert pilot.last_record["perf/step_overhead_s"] < 0.01


def test_system_every_is_validated():
    with pytest.raises(ValueError, match="system_every"):
        _tiny_pilot(system_every=0)


def test_the_progress_total_is_the_nearest_bound(monkeypatch):
    import batchpilot.engine.pilot as engine

    totals = []

    class Recording(engine.ProgressBar):
        def __init__(self, total, enabled):
            totals.append(total)
            super().__init__(total, enabled)

    monkeypatch.setattr(engine, "ProgressBar", Recording)
    model, pilot = _tiny_pilot()
    for x, y in pilot.batches(epochs=3, max_samples=64):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert totals == [64]  # not 3 x 512


def test_framework_step_stats_measure_the_parameters_trainable_at_each_measured_step():
    # The HF trainer and the Lightning callback build StepStats with the parameters trainable at the start and
    # read them again (params_of) at each measured step: a layer unfrozen by a callback is then in the small
    # batches' norms as in the step's norm, and the statistics equal those of a run that trained it throughout.
    from batchpilot.clipping import grad_norm
    from batchpilot.integrations._step_stats import StepStats

    def run(frozen_at_build):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
        first = [model.weight] if frozen_at_build else list(model.parameters())
        stats = StepStats(first, world_size=1, accumulation_steps=2, every=1,
                          params_of=lambda: [p for p in model.parameters() if p.requires_grad])
        out = {}
        for step in range(3):  # every step measured (every=1): two micro-batches of 8
            stats.begin_step(step, 16)
            for j in range(2):
                rows = slice(16 * step + 8 * j, 16 * step + 8 * j + 8)
                loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows]) * 0.5
                loss.backward()
                stats.after_micro(8, last=j == 1, to_mean=0.5)
            stats.reduced(grad_norm(model.parameters()))
            out = stats.end_step(step, 1.0)
            model.zero_grad()
        return {k: v for k, v in out.items() if k.startswith("stats/")}

    measured, reference = run(True), run(False)
    assert "stats/trace_cov" in measured and measured == pytest.approx(reference, rel=1e-12)


def test_a_measurement_whose_trainable_set_changed_inside_the_step_is_left_out():
    # Transformers calls on_step_begin after the batch (and its measured step) was planned: a layer unfrozen
    # there is in the step's norm but not in the small batches, so that measurement must not enter the estimate.
    from batchpilot.clipping import grad_norm
    from batchpilot.integrations._step_stats import StepStats

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model.bias.requires_grad_(False)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    stats = StepStats([model.weight], world_size=1, accumulation_steps=2, every=1,
                      params_of=lambda: [p for p in model.parameters() if p.requires_grad])
    stats.begin_step(0, 16)
    model.bias.requires_grad_(True)  # unfrozen inside the step
    for j in range(2):
        (torch.nn.functional.cross_entropy(model(x[8 * j : 8 * j + 8]), y[8 * j : 8 * j + 8]) * 0.5).backward()
        stats.after_micro(8, last=j == 1, to_mean=0.5)
    stats.reduced(grad_norm(model.parameters()))
    assert stats.probe.estimator.count == 0 and "stats/noise_scale" not in stats.end_step(0, 1.0)
    model.zero_grad()
    stats.begin_step(1, 16)  # the next measured step measures both
    assert stats.probe.params == [model.weight, model.bias]


def test_the_noise_probe_refuses_a_corrupt_period_and_keeps_its_state():
    from batchpilot.measure import GradientNoiseProbe

    probe = GradientNoiseProbe([torch.nn.Parameter(torch.zeros(2))], every=16)
    probe.estimator.update(2, 5.0, 8, 2.0)
    state = probe.state_dict()
    for bad, error in [(0, ValueError), (1.5, TypeError), (True, TypeError)]:
        with pytest.raises(error, match="the checkpoint's noise_every must be"):
            probe.load_state_dict({**state, "every": bad, "estimator": {**state["estimator"], "count": 7}})
        assert probe.every == 16 and probe.estimator.count == 1  # nothing changed
