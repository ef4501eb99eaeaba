"""Auto: the knee rule, the probe result's round trip, its state, its decisions before and after the probes, and
its settings' errors."""

from __future__ import annotations

import json

import pytest

from batchpilot.controllers import Auto, Goodput, Observation
from batchpilot.controllers.auto import ProbeResult, pick_knee

PROBE = ProbeResult(start_size=256, throughput=((64, 1000.0), (128, 1900.0), (256, 3000.0), (512, 3300.0)),
                    bound="knee", lr=0.2, lr_at_min=0.5, seconds=1.5, steps=120)

STATS = {"stats/noise_scale": 4000.0, "stats/noise_count": 20, "perf/micro_time_a_s": 0.01,
         "perf/micro_time_b_s": 1e-5, "perf/step_overhead_s": 0.0, "dist/world_size": 1}


def obs(step: int, size: int, **stats: float) -> Observation:
    return Observation(step=step, samples_seen=step * size, epoch=0, coverage=0.0, batch_size=size,
                       num_samples=100_000, stats={**STATS, **stats})


def test_the_knee_is_where_a_doubling_stops_paying():
    assert pick_knee([(32, 100.0), (64, 190.0), (128, 300.0), (256, 330.0), (512, 700.0)], 1.25) == (128, True)
    assert pick_knee([(32, 100.0), (64, 190.0)], 1.25) == (64, False)  # every doubling paid: not final
    assert pick_knee([(32, 100.0)], 1.25) == (32, False)
    # A size timed too fast by noise ends the walk early (the smaller size), never late.
    assert pick_knee([(32, 100.0), (64, 400.0), (128, 420.0), (256, 1000.0)], 1.25) == (64, True)
    with pytest.raises(ValueError, match="at least one"):
        pick_knee([], 1.25)


def test_a_probe_result_round_trips_through_json():
    assert ProbeResult.from_dict(json.loads(json.dumps(PROBE.to_dict()))) == PROBE
    no_lr = ProbeResult(64, ((64, 10.0),), "memory", None, None, 0.1, 4, max_micro_batch_size=32)
    assert ProbeResult.from_dict(json.loads(json.dumps(no_lr.to_dict()))) == no_lr


def test_before_the_probes_it_keeps_the_size():
    auto = Auto()
    assert auto.decide(obs(100, 32)) == 32
    assert "not run" in auto.reason
    assert auto.adaptive is True and auto.required_stats == Goodput.required_stats


def test_after_the_probes_it_decides_like_goodput_from_the_start_size_up():
    auto, goodput = Auto(max_size=4096), Goodput(256, 4096)
    auto.start(PROBE)
    for step in range(0, 400, 10):
        o = obs(step, 256)
        assert auto.decide(o) == goodput.decide(o)
    assert auto.last_table == goodput.last_table and auto.last_table
    assert min(auto.last_table) == 256  # no candidate below the knee
    # A tiny noise scale makes every larger size a loss: Goodput would shrink, Auto stays at the knee.
    small = Auto(max_size=4096, interval=1, min_measurements=0)
    small.start(PROBE)
    assert small.decide(obs(5, 1024, **{"stats/noise_scale": 1.0})) >= 256


def test_the_state_round_trips_with_the_probe_and_goodput_state():
    auto = Auto(max_size=4096, interval=10)
    assert Auto().load_state_dict(auto.state_dict()) is None  # before the probes: nothing to restore
    auto.start(PROBE)
    for step in range(0, 60, 10):
        auto.decide(obs(step, 256))
    state = json.loads(json.dumps(auto.state_dict()))
    other = Auto(max_size=4096, interval=10)
    other.load_state_dict(state)
    assert other.probe == PROBE and other.state_dict() == auto.state_dict()
    o = obs(70, 256)
    assert other.decide(o) == auto.decide(o)
    fresh = Auto()
    fresh.load_state_dict(Auto().state_dict())
    assert fresh.probe is None
    with pytest.raises(ValueError, match="Goodput"):
        Auto().load_state_dict({**Goodput().state_dict()})


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"min_size": 64, "max_size": 32}, "min_size=64 is larger than max_size=32"),
    ({"min_gain": 1.0}, "min_gain must be > 1"),
    ({"min_gain": "x"}, "min_gain must be a real number"),
    ({"timed_steps": 0}, "timed_steps"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"lr_steps": 5}, "lr_steps"),
    ({"lr_range": (2.0, 10.0)}, "low < 1 < high"),
    ({"lr_range": 10.0}, "lr_range must be a pair"),
    ({"lr_fraction": 0.0}, "lr_fraction must be > 0"),
    ({"lr_anchor": "top"}, "lr_anchor must be 'start'"),
    ({"interval": 0}, "interval"),
    ({"max_change": 0.5}, "max_change must be > 1"),
])
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Auto(**kwargs)


def test_a_start_size_outside_the_bounds_is_refused():
    with pytest.raises(ValueError, match="outside"):
        Auto(min_size=32, max_size=128).start(PROBE)
