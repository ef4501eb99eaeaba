"""The PPO policy's state vector (controllers/ppo_features.py): finite, in range, neutral with a flag for what is
missing, and the same from a real observation (a short Pilot run with Goodput's statistics) and from the simulator's
observation of the same situation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import Goodput, Observation
from batchpilot.controllers.goodput import step_time
from batchpilot.controllers.ppo_features import FEATURES, features

IDX = {name: i for i, name in enumerate(FEATURES)}


def obs(batch_size: int = 128, losses: tuple[float, ...] = (), **stats: float) -> Observation:
    return Observation(step=100, samples_seen=12_800, epoch=0, coverage=0.5, batch_size=batch_size,
                       num_samples=25_600, losses=losses, stats={k.replace("__", "/"): v for k, v in stats.items()})


FULL = dict(stats__noise_scale=500.0, perf__micro_time_a_s=0.01, perf__micro_time_b_s=1e-4, perf__step_overhead_s=0.002,
            perf__max_micro_batch_size=256, dist__world_size=8, system__gpu_util=70.0, system__gpu_mem_frac=0.4,
            cluster__latency_s=2e-5, cluster__comm_frac=0.3, cluster__healthy_frac=0.875, cluster__load=0.2)


def test_names_shape_dtype_and_a_full_observation_in_range():
    assert len(FEATURES) == len(set(FEATURES))
    v = features(obs(losses=tuple(np.linspace(2.0, 1.5, 50)), **FULL), 32, 4096)
    assert v.shape == (len(FEATURES),) and v.dtype == np.float32 and np.isfinite(v).all()
    assert v[IDX["batch_pos"]] == pytest.approx(2 / 7)  # log2(128/32) / log2(4096/32)
    assert v[IDX["noise_ratio"]] == pytest.approx(math.log10(500 / 128) / 3, rel=1e-6)
    assert v[IDX["util"]] == pytest.approx(0.7) and v[IDX["mem"]] == pytest.approx(0.4)
    assert v[IDX["world"]] == pytest.approx(0.5)  # log2(8) / 6
    assert v[IDX["latency"]] == pytest.approx((math.log10(2e-5) + 6) / 4, rel=1e-6)
    assert (v[IDX["comm"]], v[IDX["healthy"]], v[IDX["load"]]) == pytest.approx((0.3, 0.875, 0.2))
    assert v[IDX["loss_trend"]] == pytest.approx(-0.5 / 49 * 50 / 1.75, rel=1e-5)  # slope x count / mean
    for flag in ("noise_missing", "system_missing", "cluster_missing", "perf_missing"):
        assert v[IDX[flag]] == 0.0
    assert np.all(np.abs(v) <= 1.5)


def test_the_action_gains_are_the_goodput_ratios_of_goodput_s_own_model():
    rng = np.random.default_rng(0)
    for _ in range(200):
        size = int(rng.integers(32, 4097))
        a, b, o, phi = 10 ** rng.uniform(-4, -1), 10 ** rng.uniform(-7, -3), 10 ** rng.uniform(-5, -1), 10 ** rng.uniform(0, 5)
        micro, world = int(rng.integers(8, 1024)), int(rng.integers(1, 65))
        v = features(obs(size, stats__noise_scale=phi, perf__micro_time_a_s=a, perf__micro_time_b_s=b,
                         perf__step_overhead_s=o, perf__max_micro_batch_size=micro, dist__world_size=world), 32, 4096)
        ctl = Goodput(32, 4096, base_size=64)

        def goodput(s: int, a=a, b=b, o=o, micro=micro, world=world, ctl=ctl, phi=phi) -> float:
            return s / step_time(s, a, b, o, micro, world) * ctl.efficiency(s, phi)

        up, down = min(2 * size, 4096), max((size + 1) // 2, 32)
        for key, other in (("gain_up", up), ("gain_down", down)):
            expected = float(np.clip(math.log2(goodput(other) / goodput(size)), -1, 1))
            assert v[IDX[key]] == pytest.approx(expected, abs=2e-6), (key, size)


def test_at_the_bounds_an_action_that_cannot_move_gains_nothing():
    v = features(obs(4096, **FULL), 32, 4096)
    assert v[IDX["batch_pos"]] == 1.0 and v[IDX["thr_up"]] == 0.0 and v[IDX["eff_up"]] == 0.0 and v[IDX["gain_up"]] == 0.0
    v = features(obs(32, **FULL), 32, 4096)
    assert v[IDX["batch_pos"]] == 0.0 and v[IDX["gain_down"]] == 0.0
    assert features(obs(100, **FULL), 64, 64)[IDX["batch_pos"]] == 0.0  # min == max
    assert features(obs(10_000, **FULL), 32, 4096)[IDX["batch_pos"]] == 1.0  # outside the bounds: clamped like a decision


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -5.0, 0.0, "x", True, None, 1e300, 1e-300])
def test_bad_or_missing_values_give_neutral_entries_and_flags_never_nan(value):
    stats = {k: value for k in FULL}
    v = features(obs(losses=(value,) * 10 if isinstance(value, float) else (), **stats), 32, 4096)
    assert np.isfinite(v).all() and np.all(np.abs(v) <= 1.5)


def test_an_empty_observation_is_neutral_with_every_flag_raised():
    v = features(obs(), 32, 4096)
    for flag in ("noise_missing", "system_missing", "perf_missing"):
        assert v[IDX[flag]] == 1.0
    assert v[IDX["cluster_missing"]] == 0.0  # one device (no world size): there is no cluster to miss
    assert (v[IDX["util"]], v[IDX["mem"]], v[IDX["healthy"]]) == (0.5, 0.5, 1.0)
    for key in ("noise_ratio", "loss_trend", "thr_up", "thr_down", "eff_up", "eff_down", "gain_up", "gain_down"):
        assert v[IDX[key]] == 0.0
    several = features(obs(dist__world_size=4), 32, 4096)
    assert several[IDX["cluster_missing"]] == 1.0


def test_one_device_ignores_cluster_keys_so_real_and_simulated_runs_agree():
    with_cluster = features(obs(**{**FULL, "dist__world_size": 1}), 32, 4096)
    without = features(obs(**{k: v for k, v in FULL.items() if not k.startswith("cluster")} | {"dist__world_size": 1}),
                       32, 4096)
    np.testing.assert_array_equal(with_cluster, without)
    assert with_cluster[IDX["latency"]] == 0.0 and with_cluster[IDX["healthy"]] == 1.0


def test_cpu_util_stands_in_for_gpu_util_and_the_loss_trend_is_robust():
    v = features(obs(system__cpu_util=250.0, system__mem_used_frac=0.3), 32, 4096)
    assert v[IDX["util"]] == 1.0 and v[IDX["mem"]] == pytest.approx(0.3) and v[IDX["system_missing"]] == 0.0
    assert features(obs(losses=(1.0, 2.0, 3.0)), 32, 4096)[IDX["loss_trend"]] == 0.0  # fewer than 4 losses
    assert features(obs(losses=(0.0,) * 8), 32, 4096)[IDX["loss_trend"]] == 0.0
    rising = features(obs(losses=tuple(np.linspace(1, 100, 50))), 32, 4096)[IDX["loss_trend"]]
    assert rising == 1.0  # clipped


@pytest.mark.parametrize("bounds", [(0, 10), (64, 32), (32.0, 64), (True, 64), (32, None)])
def test_bad_bounds_are_refused_with_the_fix(bounds):
    with pytest.raises(ValueError, match="min_size"):
        features(obs(), *bounds)


class Recorder:
    """Keeps every observation and the current size; reads what Goodput reads."""

    required_stats = Goodput.required_stats

    def __init__(self) -> None:
        self.seen: list[Observation] = []

    def decide(self, o: Observation) -> int:
        self.seen.append(o)
        return o.batch_size

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_real_observation_and_the_simulated_one_of_the_same_situation_give_the_same_vector():
    """A real Pilot run (static 32, Goodput's statistics, no micro-batch bound) and a simulated job on a trace made
    from its numbers: constant noise scale and gradient statistics as measured, B0 = 32 (so progress = samples and
    the k-th simulated step lands on the k-th trace point), the k-th loss as the trace's loss there, and a step time
    ``overhead + a + b B`` (one device, one micro-batch: the simulator folds the overhead into ``a``). The two
    observations hold different numbers for the same step-time curve; the vectors agree."""
    from batchpilot.sim.cluster import Cluster, ClusterSpec
    from batchpilot.sim.episode import SimJob
    from batchpilot.sim.trace import Trace

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    rec = Recorder()
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, y), batch_size=32,
                             controller=rec)
    for xb, yb in pilot.batches(max_steps=60):
        with pilot.micro_step():
            pilot.backward(torch.nn.functional.cross_entropy(model(xb), yb))
    real = rec.seen[-1]
    s = real.stats
    assert "perf/max_micro_batch_size" not in s and s["dist/world_size"] == 1
    n, size = real.step, real.batch_size
    assert len(real.losses) == 50 and n == 60

    phi, a, b, o = s["stats/noise_scale"], s["perf/micro_time_a_s"], s["perf/micro_time_b_s"], s["perf/step_overhead_s"]
    steps = np.arange(n + 1)
    losses = np.concatenate([[real.losses[0]] * (n + 1 - 50), real.losses])  # the trace's loss after step k
    sizes = (1, 1 << 20)
    trace = Trace(workload="real", base_batch_size=size, num_samples=4096, metric="accuracy", target=1.0,
                  progress=np.concatenate([steps * size, [1e9]]), metric_values=np.concatenate([steps * 1e-6, [2.0]]),
                  loss=np.concatenate([losses, [losses[-1]]]), noise_scale=np.full(n + 2, phi),
                  grad_sq=np.full(n + 2, s["stats/grad_sq_norm"]), grad_var=np.full(n + 2, s["stats/trace_cov"]),
                  step_sizes=sizes, step_seconds=tuple(o + a + b * m for m in sizes), compute=(o + a, b),
                  max_micro_batch_size=1 << 20, grad_bytes=4 * 130, source="test")
    job = SimJob(trace, Cluster(ClusterSpec(), trace), size, min_size=16, max_size=1024, observe_system=False)
    job.run(n)
    sim = job.observe()
    assert sim.step == real.step and sim.samples_seen == real.samples_seen and sim.batch_size == real.batch_size
    assert sim.losses == pytest.approx(real.losses, rel=1e-12)
    assert sim.stats["stats/noise_scale"] == pytest.approx(phi, rel=1e-12)
    assert sim.stats["perf/step_overhead_s"] == pytest.approx(0.0, abs=1e-15)  # the numbers differ ...
    vector = features(real, 16, 1024)
    np.testing.assert_allclose(features(sim, 16, 1024), vector, rtol=1e-5, atol=1e-6)  # ... not the vector
    assert vector[IDX["noise_missing"]] == vector[IDX["perf_missing"]] == 0.0 and vector[IDX["loss_trend"]] != 0.0
    assert vector[IDX["thr_up"]] > 0.0 and vector[IDX["eff_up"]] < 0.0
