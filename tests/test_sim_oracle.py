"""The simulated job (sim/episode.py) and the limit it is measured against (sim/oracle.py): closed-form instances,
the greedy oracle against other policies, and our real controllers run through their own decide()."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _sim_cases import make_trace

from batchpilot.controllers import Goodput, InvalidDecisionError, NoiseScale
from batchpilot.sim.cluster import ClusterSpec, Network
from batchpilot.sim.episode import SimJob, drive, make_job, run_policy
from batchpilot.sim.oracle import (
    best_size,
    best_static,
    goodput_oracle,
    goodput_policy,
    run_controller,
    static_sizes,
)

A, B_COEF, PHI, B0, P = 0.1, 1e-3, 2000.0, 64, 2e6


def goodput(size: float, phi: float = PHI) -> float:
    """Progress per second at a static ``size``: ``B E(B) / T(B)``, ``E = (phi + B0)/(phi + B)``, ``T = a + b B``."""
    return size * (phi + B0) / (phi + size) / (A + B_COEF * size)


def test_the_oracle_beats_every_static_batch_on_a_closed_form_instance():
    """One device, step time ``T(B) = a + b B`` (a = 0.1 s, b = 1e-3 s), constant noise scale ``phi = 2000``,
    ``B0 = 64``, target at progress ``P = 2e6``.

    A static ``B`` advances progress at ``G(B) = B E(B) / T(B) = B (phi + B0) / ((phi + B)(a + b B))`` per second,
    so it needs ``P / G(B)`` seconds. ``d log G / dB = 1/B - 1/(phi + B) - b/(a + b B) = 0`` gives
    ``phi / (B (phi + B)) = b / (a + b B)``, i.e. ``phi a + phi b B = b B phi + b B^2``: ``B* = sqrt(a phi / b)
    = sqrt(2e5) = 447.2``. The goodput does not change with progress, so the oracle picks ``B*`` (rounded) at once
    and needs ``P / G(B*)``; every other static batch needs more. The simulator must reproduce each number: the
    time to target is interpolated inside the step that crosses ``P``."""
    trace, spec = make_trace(phi=PHI, a=A, b=B_COEF, base=B0, target_progress=P), ClusterSpec()
    star = math.sqrt(A * PHI / B_COEF)
    greedy = goodput_oracle(trace, spec, method="greedy")
    assert greedy.reached and {h["batch_size"] for h in greedy.history} == {round(star)}
    assert greedy.time_to_target_s == pytest.approx(P / goodput(round(star)), rel=1e-9)
    oracle = goodput_oracle(trace, spec)  # the dynamic program: the same, up to its table's interpolation
    assert {h["batch_size"] for h in oracle.history} <= {447, 448}
    assert oracle.time_to_target_s == pytest.approx(greedy.time_to_target_s, rel=1e-6)
    sizes = static_sizes(32, 4096)
    assert sizes[:4] == [32, 45, 64, 91] and sizes[-1] == 4096 and len(sizes) == 15
    for size in sizes:
        static = run_policy(lambda o, s=size: s, trace, spec, start_size=size)
        assert static.time_to_target_s == pytest.approx(P / goodput(size), rel=1e-9)
        assert oracle.time_to_target_s < static.time_to_target_s
    best, result = best_static(trace, spec)
    assert best == 512 and result.time_to_target_s == pytest.approx(P / goodput(512), rel=1e-9)  # 512 / 447 < 447 / 362
    same = run_policy(lambda o: round(star), trace, spec, start_size=round(star))
    assert same.time_to_target_s == pytest.approx(greedy.time_to_target_s, rel=1e-12)  # greedy's static twin ties


def test_with_a_rising_noise_scale_the_oracle_follows_the_optimum_and_beats_the_best_static_clearly():
    """The same device, the noise scale rising from 100 to 1e5 along progress. The optimum moves: at each progress
    ``B*(p) = sqrt(a phi(p) / b)`` clamped to [32, 4096], and the least time to target is
    ``integral over [0, P] of dp / G(B*(p), p)`` (computed here by the trapezoid rule); the oracle, which holds its
    size for 50 steps at a time, must come within 0.2% of it, and a static batch cannot follow (the best one, 256,
    needs 7% more)."""
    trace, spec = make_trace(phi=(100.0, 1e5), a=A, b=B_COEF, base=B0, target_progress=P), ClusterSpec()
    p = np.linspace(0.0, P, 200_001)
    phi = np.interp(p, trace.progress, trace.noise_scale)
    star = np.clip(np.sqrt(A * phi / B_COEF), 32, 4096)
    rate = 1.0 / goodput(star, phi)
    least = float(np.sum((rate[1:] + rate[:-1]) / 2 * np.diff(p)))
    for method in ("greedy", "dp"):
        oracle = goodput_oracle(trace, spec, method=method)
        assert oracle.time_to_target_s == pytest.approx(least, rel=2e-3)
        assert oracle.time_to_target_s >= least * (1 - 1e-4)
        sizes = oracle.series("batch_size")
        assert sizes[0] < 150 and sizes.max() > 900 and np.all(np.diff(sizes[:-3]) >= -1)  # it grows with phi
    best, static = best_static(trace, spec)
    assert oracle.time_to_target_s < 0.95 * static.time_to_target_s  # measured: 0.93 x static 256


def test_where_the_noise_scale_jumps_within_an_interval_the_dynamic_program_beats_greedy_and_every_static():
    """A noise scale that jumps between 40 and 600 every 750 samples of progress, shorter than one interval of 50
    steps (as a recorded trace's early or noisy stretch can): greedy holds for 50 steps the size that suited the
    first of them. The dynamic program over progress (sim/oracle_dp.py) plans for whole intervals."""
    import dataclasses

    trace = make_trace(a=1e-3, b=1e-4, target_progress=2e4, base=32, points=41)
    phi = np.where(np.arange(41) % 2 == 0, 40.0, 600.0)
    trace = dataclasses.replace(trace, noise_scale=phi, grad_var=0.5 * phi)
    dp = goodput_oracle(trace, "cpu")
    greedy = goodput_oracle(trace, "cpu", method="greedy")
    assert greedy.time_to_target_s > 1.01 * dp.time_to_target_s  # measured: 1.018
    for size in static_sizes(32, 4096):
        static = run_policy(lambda o, s=size: s, trace, "cpu", start_size=size)
        assert dp.time_to_target_s < static.time_to_target_s  # the closest, static 45: 1.001
    with pytest.raises(ValueError, match="method"):
        goodput_oracle(trace, "cpu", method="bellman")


def test_greedy_is_not_beaten_by_other_policies_under_a_day_night_load_and_failures():
    """Module docstring of sim/oracle.py: a size change costs nothing and the cluster's state follows the clock, so
    no policy gets ahead of the greedy oracle's progress. Checked against 20 random and 10 near-oracle policies on an
    8-device cluster whose network load swings over the job's length, with failures."""
    trace = make_trace(phi=(200.0, 20000.0), a=0.02, b=2e-4, grad_bytes=40_000_000, target_progress=1e6)
    spec = ClusterSpec.parse("gpus=8,bandwidth=1e9,load=0.4:0.4:600,fail=0.5,restart=20,repair=120")
    oracle = goodput_oracle(trace, spec, seed=3, method="greedy")
    assert oracle.reached and any(h["events"] for h in oracle.history)
    dp = goodput_oracle(trace, spec, seed=3)
    assert dp.time_to_target_s <= oracle.time_to_target_s * (1 + 1e-4)
    rng = np.random.default_rng(0)
    for k in range(30):
        job = make_job(trace, spec, start_size=64, seed=3)
        if k < 20:
            choices = iter(np.round(2 ** rng.uniform(5, 12, 100_000)).astype(int))
            choose = lambda j, c=choices: int(next(c))  # noqa: E731
        else:
            factor = iter(2 ** rng.uniform(-0.7, 0.7, 100_000))
            choose = lambda j, f=factor: max(32, min(4096, round(best_size(j) * float(next(f)))))  # noqa: E731
        other = drive(job, choose, first=True)
        assert oracle.time_to_target_s <= other.time_to_target_s * (1 + 1e-9), k


@pytest.mark.parametrize("cluster", ["cpu", "gpus=16,speedup=20"])
def test_our_goodput_controller_reaches_the_target_in_the_simulator_no_faster_than_the_oracle(cluster):
    trace = make_trace(phi=(200.0, 20000.0), a=0.02, b=2e-4, target_progress=1e6)
    result = goodput_policy(trace, cluster, seed=1)
    oracle = goodput_oracle(trace, cluster, seed=1)
    assert result.reached and result.policy == "Goodput"
    assert oracle.time_to_target_s <= result.time_to_target_s < 1.5 * oracle.time_to_target_s
    assert len(set(result.series("batch_size"))) > 2  # it did adapt
    noise = run_controller(NoiseScale(32, 4096), trace, cluster, seed=1)
    assert noise.reached and noise.time_to_target_s >= oracle.time_to_target_s


@pytest.mark.parametrize("size", [64, 512, 4096])
def test_simulating_an_interval_at_once_matches_the_step_by_step_loop(size):
    """``interval=1`` reads the step time and the efficiency at every single step: the exact loop. Fifty steps at
    once (each step's efficiency by fixed-point passes, the step time read once) must agree with it, also while the noise scale rises 1000-fold and
    the load swings."""
    trace = make_trace(phi=(100.0, 1e5), target_progress=5e5)
    for spec in ("cpu", "gpus=8,load=0.3:0.3:3000"):
        together = drive(make_job(trace, spec, start_size=size), lambda j: size, interval=50)
        exact = drive(make_job(trace, spec, start_size=size), lambda j: size, interval=1)
        assert together.time_to_target_s == pytest.approx(exact.time_to_target_s, rel=1e-6)  # measured: <= 2.2e-7
        assert abs(together.steps - exact.steps) <= 1


def test_decisions_pass_the_engine_boundary():
    trace = make_trace()
    for bad in (0, -3, math.nan, 2.5, "64", True):
        with pytest.raises(InvalidDecisionError):
            run_policy(lambda o, v=bad: v, trace, "cpu", start_size=64)
    clamped = run_policy(lambda o: 10**9, trace, "cpu", start_size=64, max_size=1024)
    assert set(clamped.series("batch_size")) == {64, 1024}
    with pytest.raises(ValueError, match="start_size"):
        run_policy(lambda o: 64, trace, "cpu", start_size=0)
    with pytest.raises(ValueError, match="interval"):
        run_policy(lambda o: 64, trace, "cpu", start_size=64, interval=0)


def test_a_time_limit_ends_a_hopeless_job():
    trace = make_trace()
    result = run_policy(lambda o: 32, trace, "cpu", start_size=32, time_limit_s=100.0)
    assert not result.reached and result.time_to_target_s == math.inf and 100.0 <= result.history[-1]["time_s"] < 110
    job = make_job(trace, "cpu", start_size=64)
    assert job.default_time_limit() == pytest.approx(5 * P / (32 * (PHI + 64) / (PHI + 32)) * (A + B_COEF * 32))


def test_simulated_observations_carry_the_engine_s_keys_and_the_controllers_see_them():
    trace = make_trace(phi=(200.0, 20000.0))
    spec = ClusterSpec.parse("gpus=4,load=0.3")
    job = make_job(trace, spec, start_size=128, seed=0)
    job.run(50)
    obs = job.observe()
    for key in Goodput.required_stats[:-1]:  # all but the HF / Lightning loops' fixed accumulation
        assert key in obs.stats, key
    assert obs.stats["dist/world_size"] == 4 and obs.step == 50 and obs.samples_seen == 50 * 128
    assert len(obs.losses) == 50 and obs.losses[-1] < obs.losses[0]
    assert 0 < obs.stats["system/gpu_util"] <= 100  # percent, like the engine's monitor
    assert obs.stats["cluster/load"] == pytest.approx(0.3) and obs.samples_per_s == pytest.approx(
        128 / obs.stats["perf/step_time_s"])
    quiet = make_job(trace, spec, start_size=128, observe_system=False)
    quiet.run(50)
    assert not [k for k in quiet.observe().stats if k.startswith(("system/", "cluster/"))]


def test_a_job_that_starts_at_its_target_is_done_and_noise_is_seeded():
    trace = make_trace()
    job = SimJob(trace, make_job(trace, "cpu", start_size=64).cluster, 64, progress=3e6)
    assert job.done and job.time_to_target_s == 0.0
    noisy = [make_job(trace, "cpu", start_size=64, seed=s, observation_noise=0.2) for s in (5, 5, 6)]
    for j in noisy:
        j.run(50)
    values = [j.observe().stats["stats/noise_scale"] for j in noisy]
    assert values[0] == values[1] != values[2] and values[0] != PHI
    with pytest.raises(ValueError, match="observation_noise"):
        make_job(trace, "cpu", start_size=64, observation_noise=-1.0)
    assert Network().load(0.0) == 0.0


def test_a_job_resumed_from_its_state_continues_exactly():
    import json

    trace = make_trace(phi=(200.0, 20000.0), a=0.02, b=2e-4, target_progress=1e6)
    spec = ClusterSpec.parse("gpus=8,load=0.3:0.3:900,fail=10,restart=20,repair=60")

    def choose(job: SimJob) -> int:
        o = job.observe()  # draws observation noise: the generator's state must carry over
        return max(32, min(4096, round(o.batch_size * (1.3 if o.stats["stats/noise_scale"] > 2 * o.batch_size else 0.9))))

    whole = make_job(trace, spec, start_size=64, seed=0, observation_noise=0.1)
    first = make_job(trace, spec, start_size=64, seed=0, observation_noise=0.1)
    for _ in range(7):
        first.run(50)
        first.set_batch_size(choose(first))
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make_job(trace, spec, start_size=64, seed=0, observation_noise=0.1)
    resumed.load_state_dict(state)
    a = drive(whole, choose)
    b = drive(resumed, choose)
    assert a.time_to_target_s == b.time_to_target_s and a.steps == b.steps and a.history == b.history
    assert any(h["events"] for h in a.history)
    with pytest.raises(ValueError, match="state_dict"):
        resumed.load_state_dict({"steps": 3})


def test_the_observed_throughput_model_is_the_cluster_s_also_across_failures_and_load_changes():
    trace = make_trace(phi=(200.0, 20000.0), a=0.02, b=2e-4, target_progress=1e6)
    spec = ClusterSpec.parse("gpus=8,hetero=0.5,load=0.3:0.3:600,fail=10,restart=20,repair=60")
    job = make_job(trace, spec, start_size=64, seed=0)
    worlds = set()
    while not job.done:
        job.run(50)
        stats = job.observe().stats
        expected = job.cluster.perf_stats()  # uncached, from the same last step
        for key, value in expected.items():
            assert stats[key] == pytest.approx(value, rel=1e-12), key
        worlds.add(stats["dist/world_size"])
        job.set_batch_size(min(job.batch_size * 2, 1024))
    assert len(worlds) > 1  # a failure changed the healthy devices on the way


def test_a_fitted_noise_scale_factor_is_part_of_the_true_model():
    """A trace whose efficiency was fitted to static runs (``noise_scale_factor`` k: ``E = (k phi + B0)/(k phi + B)``)
    is simulated as fitted: with constant ``phi`` the optimum moves to ``sqrt(a k phi / b)``, and the oracle (both
    methods) follows it while the observation still reports the measured ``phi``."""
    import dataclasses

    trace = dataclasses.replace(make_trace(phi=PHI, a=A, b=B_COEF, base=B0, target_progress=P), noise_scale_factor=0.25)
    star = round(math.sqrt(A * 0.25 * PHI / B_COEF))  # 224
    assert {h["batch_size"] for h in goodput_oracle(trace, "cpu", method="greedy").history} == {star}
    assert {h["batch_size"] for h in goodput_oracle(trace, "cpu").history} <= {star - 1, star, star + 1}
    job = make_job(trace, "cpu", start_size=64)
    job.run(50)
    assert job.observe().stats["stats/noise_scale"] == PHI
