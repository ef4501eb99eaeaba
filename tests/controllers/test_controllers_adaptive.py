"""Adaptive controllers: hand-derived decisions, missing stats, hysteresis, bounds, errors, state round trips.

Every expected size below is worked out by hand in the comment next to it, from the formula in the
controller's docstring; none is produced by running the code.
"""

from __future__ import annotations

import math

import pytest
from harness import assert_state_roundtrip
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.controllers import (
    Controller,
    Goodput,
    NoiseScale,
    Observation,
    ThresholdRules,
    VarianceRule,
    validate_decision,
)
from batchpilot.controllers.goodput import step_time
from batchpilot.lr import adascale_gain, lr_factor


def obs(step: int = 0, batch_size: int = 512, stats: dict | None = None, epoch: int = 0, coverage: float = 0.0):
    return Observation(
        step=step, samples_seen=0, epoch=epoch, coverage=coverage, batch_size=batch_size, stats=stats or {}
    )


def var(v: float) -> dict:
    return {"stats/grad_variance": v}


# ============================================================================ VarianceRule (seed 002)


def test_variance_rule_seed_002_sequence():
    rule = VarianceRule()  # [256, 8192], every 1000 steps
    # First measurement: sigma_base^2 = 2e-3 and B0 = 1024 (the size at that moment); not a decision step.
    assert rule.decide(obs(1, 1024, var(2e-3))) == 1024
    assert rule.base_variance == 2e-3
    assert rule.decide(obs(999, 1024, var(4e-3))) == 1024  # still in period 0
    # Variance doubled -> the batch HALVES: floor(1024 * 2e-3 / 4e-3) = 512.
    assert rule.decide(obs(1000, 1024, var(4e-3))) == 512
    assert "floor(1024" in rule.reason and "-> 512" in rule.reason
    assert rule.decide(obs(1500, 512, var(1e-3))) == 512  # period 1 already decided
    # B0 stays 1024 (not the current 512): floor(1024 * 2e-3 / 1e-3) = 2048.
    assert rule.decide(obs(2000, 512, var(1e-3))) == 2048
    # floor(1024 * 2e-3 / 1e-4) = 20480 -> clamped to max_size 8192.
    assert rule.decide(obs(3000, 2048, var(1e-4))) == 8192
    # floor(1024 * 2e-3 / 0.1) = floor(20.48) = 20 -> clamped up to min_size 256.
    assert rule.decide(obs(4000, 8192, var(0.1))) == 256
    # floor(1024 * 2e-3 / 3e-3) = floor(682.67) = 682.
    assert rule.decide(obs(5000, 256, var(3e-3))) == 682
    # sigma_t^2 = 0: the ratio is infinite -> max_size.
    assert rule.decide(obs(6000, 682, var(0.0))) == 8192


def test_variance_rule_given_base_and_exact_floor():
    # sigma_base = 0.5 -> sigma_base^2 = 0.25; B0 = 512 given, whatever the current size.
    rule = VarianceRule(base_size=512, sigma_base=0.5, min_size=1, max_size=10_000, interval=10)
    assert rule.decide(obs(10, 64, var(0.125))) == 1024  # 512 * 0.25 / 0.125 = 1024 exactly
    # 768 * 0.3 / 0.1 is 2303.9999999999995 in floating point; the exact ratio 2304 must not floor to 2303.
    exact = VarianceRule(base_size=768, min_size=1, max_size=10_000, interval=10)
    assert exact.decide(obs(1, 768, var(0.3))) == 768
    assert exact.decide(obs(10, 768, var(0.1))) == 2304


def test_variance_rule_missing_stat_keeps_and_retries():
    rule = VarianceRule(interval=1000)
    assert rule.decide(obs(1000, 300)) == 300  # never measured: keep
    assert "not measured" in rule.reason
    assert rule.decide(obs(1001, 300, var(math.nan))) == 300  # NaN = not measured
    assert rule.decide(obs(1002, 300, var(-1.0))) == 300  # a negative variance is unusable
    assert "negative" in rule.reason
    # First real measurement at step 1003 (period 1, due): base 1e-3, B0 = 300: floor(300 * 1) = 300.
    assert rule.decide(obs(1003, 300, var(1e-3))) == 300
    assert rule.decide(obs(1999, 300, var(1e-4))) == 300  # period 1 used up
    assert rule.decide(obs(2000, 300)) == 300  # due but missing: kept, period NOT used up ...
    assert rule.decide(obs(2001, 300, var(5e-4))) == 600  # ... so step 2001 decides: floor(300 * 2) = 600


def test_variance_rule_when_called_every_few_steps():
    rule = VarianceRule(min_size=1, max_size=10_000, interval=100)
    rule.decide(obs(7, 100, var(1.0)))  # base 1.0, B0 = 100
    assert rule.decide(obs(98, 100, var(0.5))) == 100  # period 0
    assert rule.decide(obs(105, 100, var(0.5))) == 200  # first call of period 1: floor(100 / 0.5)
    assert rule.decide(obs(196, 200, var(0.25))) == 200  # still period 1
    assert rule.decide(obs(203, 200, var(0.25))) == 400  # period 2: floor(100 / 0.25)


def test_variance_rule_documents_the_direction_and_lr_rule():
    doc = VarianceRule.__doc__
    assert "SHRINKS the batch" in doc and "opposite" in doc and "McCandlish" in doc and "AdaScale" in doc
    rule = VarianceRule()
    assert (rule.recommended_lr_rule, rule.recommended_lr_knee) == ("linear-then-sqrt", 4096)
    # The pairing of seed 002: linear up to 4096, then square root: 16 * sqrt(8192 / 4096) from B0 = 256.
    assert lr_factor(rule.recommended_lr_rule, 8192, 256, rule.recommended_lr_knee) == 16 * math.sqrt(2)


# ============================================================================ ThresholdRules (seed 000)


def after_warmup(step: int, batch_size: int, **stats) -> Observation:
    named = {
        "variance": "stats/grad_variance", "trend": "stats/loss_trend", "gpu": "system/gpu_util",
        "cpu": "system/cpu_util",
    }
    return obs(step, batch_size, {named[k]: v for k, v in stats.items()}, epoch=6)


def test_threshold_rules_warmup_then_rules():
    rules = ThresholdRules()  # [32, 4096], warm-up 5 epochs at 32, a check every 50 steps
    # Warm-up wins over everything, including a low GPU utilisation.
    assert rules.decide(obs(50, 256, {"system/gpu_util": 10.0}, epoch=4, coverage=0.99)) == 32
    assert "warm-up" in rules.reason
    # Epoch 5.0 is past the warm-up; step 50 is the first check: variance 2e-3 > 1e-3 -> 256 * 0.5 = 128.
    assert rules.decide(obs(50, 256, {"stats/grad_variance": 2e-3}, epoch=5)) == 128
    assert rules.decide(after_warmup(99, 128, variance=2e-3)) == 128  # not a check step


def test_threshold_rules_precedence():
    rules = ThresholdRules(util_source="gpu")
    # Variance high AND GPU idle: variance first -> shrink 256 -> 128.
    assert rules.decide(after_warmup(50, 256, variance=2e-3, gpu=10.0)) == 128
    # Variance fine (5e-4 <= 1e-3), GPU at 50% < 70% -> grow 256 -> 512.
    assert rules.decide(after_warmup(100, 256, variance=5e-4, gpu=50.0)) == 512
    # GPU at 70% is not below 70%; no trend yet -> keep.
    assert rules.decide(after_warmup(150, 256, variance=5e-4, gpu=70.0)) == 256
    assert "no rule fired" in rules.reason
    # Variance exactly at the threshold is not above it.
    assert rules.decide(after_warmup(200, 256, variance=1e-3, gpu=90.0)) == 256


@pytest.mark.parametrize(
    "source, stats, expected",
    [
        ("gpu", {"cpu": 10.0}, 256),  # no GPU: the utilisation rule is skipped
        ("gpu-or-cpu", {"cpu": 10.0}, 512),  # opt-in: CPU at 10% < 70% -> grow
        ("gpu-or-cpu", {"gpu": 90.0, "cpu": 10.0}, 256),  # GPU present: it is the one read
        ("cpu", {"gpu": 10.0, "cpu": 90.0}, 256),
        ("cpu", {"cpu": 69.9}, 512),
        ("off", {"gpu": 1.0, "cpu": 1.0}, 256),
    ],
)
def test_threshold_rules_utilisation_source(source, stats, expected):
    assert ThresholdRules(util_source=source).decide(after_warmup(50, 256, **stats)) == expected


def test_threshold_rules_plateau_patience_and_reset():
    rules = ThresholdRules()
    # Loss decrease 0.5% < 1% at checks 50, 100 -> counts 1, 2: keep; at 150 -> 3 = patience: grow 256 -> 512.
    assert rules.decide(after_warmup(50, 256, trend=0.005)) == 256
    assert rules.decide(after_warmup(100, 256, trend=0.005)) == 256
    assert rules.plateau_checks == 2
    assert rules.decide(after_warmup(150, 256, trend=0.005)) == 512
    assert "3 checks in a row: grow" in rules.reason and rules.plateau_checks == 0
    # A check without a trend leaves the count alone; a real decrease (2% >= 1%) resets it.
    assert rules.decide(after_warmup(200, 512, trend=0.005)) == 512  # 1
    assert rules.decide(after_warmup(250, 512)) == 512  # missing: still 1
    assert rules.plateau_checks == 1
    assert rules.decide(after_warmup(300, 512, trend=0.02)) == 512  # 0
    assert rules.decide(after_warmup(350, 512, trend=-0.01)) == 512  # 1 (the loss rose: also a plateau)
    assert rules.decide(after_warmup(400, 512, trend=0.0)) == 512  # 2
    assert rules.decide(after_warmup(450, 512, trend=0.0099)) == 1024  # 3 -> grow


def test_threshold_rules_plateau_shrink_and_size_change_resets_count():
    rules = ThresholdRules(plateau_action="shrink", patience=2)
    assert rules.decide(after_warmup(50, 256, trend=0.0)) == 256  # 1
    # A variance shrink changes the size: the count restarts (1 -> 0 after this check's plateau made it 2).
    assert rules.decide(after_warmup(100, 256, trend=0.0, variance=1.0)) == 128
    assert rules.plateau_checks == 0
    assert rules.decide(after_warmup(150, 128, trend=0.0)) == 128  # 1
    assert rules.decide(after_warmup(200, 128, trend=0.0)) == 64  # 2 -> shrink: 128 * 0.5


def test_threshold_rules_bounds_and_small_sizes():
    rules = ThresholdRules(min_size=1, max_size=100, grow_factor=1.2, shrink_factor=0.9, warmup_epochs=0)
    # round_half_up(2 * 1.2) = 2 would not move: a grow is at least +1 -> 3.
    assert rules.decide(obs(50, 2, {"system/gpu_util": 0.0})) == 3
    # round_half_up(5 * 0.9) = round(4.5) = 5 would not move: a shrink is at least -1 -> 4.
    assert rules.decide(obs(100, 5, var(1.0))) == 4
    assert rules.decide(obs(150, 90, {"system/gpu_util": 0.0})) == 100  # 108 clamped to max_size
    assert rules.decide(obs(200, 1, var(1.0))) == 1  # at min_size: the shrink is a no-op, nothing else fires
    assert rules.decide(obs(250, 500)) == 100  # outside the bounds, no rule: clamped to max_size


def test_threshold_rules_warmup_size_and_check_every():
    rules = ThresholdRules(min_size=16, max_size=512, warmup_epochs=2.5, warmup_size=64, check_every=10)
    assert rules.decide(obs(3, 999, epoch=2, coverage=0.49)) == 64
    assert rules.decide(obs(10, 64, {"system/gpu_util": 5.0}, epoch=2, coverage=0.5)) == 128
    assert rules.decide(obs(19, 128, {"system/gpu_util": 5.0}, epoch=3)) == 128
    assert rules.decide(obs(20, 128, {"system/gpu_util": 5.0}, epoch=3)) == 256


# ============================================================================ NoiseScale


def ns(v: float) -> dict:
    return {"stats/noise_scale": v}


def test_noise_scale_never_decides_before_the_estimate():
    ctrl = NoiseScale(interval=50, max_change=None, min_measurements=0)
    assert ctrl.decide(obs(50, 64)) == 64
    assert "not measured" in ctrl.reason
    assert ctrl.decide(obs(51, 64, ns(math.nan))) == 64
    assert ctrl.decide(obs(52, 64, ns(-5.0))) == 64  # a negative B_simple (|G|^2 estimate < 0) is unusable
    assert "not positive" in ctrl.reason and ctrl.smoothed_noise_scale is None
    # First estimate at step 53, period 1 due: 1000 > 64 * 1.2 -> 1000.
    assert ctrl.decide(obs(53, 64, ns(1000.0))) == 1000


def test_noise_scale_hysteresis():
    ctrl = NoiseScale(smoothing=0.0, hysteresis=0.2, interval=50, max_change=None, min_measurements=0)
    assert ctrl.decide(obs(50, 100, ns(119.0))) == 100  # 119 <= 100 * 1.2 = 120: inside the band
    assert "hysteresis band" in ctrl.reason
    assert ctrl.decide(obs(100, 100, ns(120.0))) == 100  # 120 is not > 120
    assert ctrl.decide(obs(150, 100, ns(121.0))) == 121  # 121 > 120 -> track it
    assert ctrl.decide(obs(151, 121, ns(500.0))) == 121  # not a decision step (period 3 used)
    # Without shrinking (default) a low target never lowers the size ...
    assert ctrl.decide(obs(200, 121, ns(10.0))) == 121
    assert "allow_shrink=False" in ctrl.reason


def test_noise_scale_shrink_when_allowed():
    ctrl = NoiseScale(smoothing=0.0, hysteresis=0.2, interval=10, allow_shrink=True, max_change=None, min_measurements=0)
    assert ctrl.decide(obs(10, 100, ns(84.0))) == 100  # 84 * 1.2 = 100.8 >= 100: inside the band
    assert ctrl.decide(obs(20, 100, ns(83.0))) == 83  # 83 * 1.2 = 99.6 < 100: shrink
    assert ctrl.decide(obs(30, 83, ns(1.0))) == 32  # 1 -> clamped up to min_size 32


def test_noise_scale_smoothing_in_log_space_per_step():
    ctrl = NoiseScale(smoothing=0.5, hysteresis=0.2, interval=10, max_change=None, min_measurements=0)
    ctrl.decide(obs(1, 32, ns(100.0)))  # EMA starts at log 100
    ctrl.decide(obs(2, 32, ns(400.0)))  # 1 step: 0.5 log 100 + 0.5 log 400 = log 200
    assert ctrl.smoothed_noise_scale == pytest.approx(200.0, rel=1e-12)
    ctrl.decide(obs(2, 32, ns(1e6)))  # same step again: no second update
    assert ctrl.smoothed_noise_scale == pytest.approx(200.0, rel=1e-12)
    # 8 steps later: keep 0.5**8 = 1/256 of log 200, 255/256 of log 800 -> 800 * (1/4)**(1/256) = 795.68.
    assert ctrl.decide(obs(10, 32, ns(800.0))) == 796
    assert ctrl.smoothed_noise_scale == pytest.approx(800 * 0.25 ** (1 / 256), rel=1e-12)


def test_noise_scale_factor_rounding_and_bounds():
    # factor 2: target 2 * 350 = 700.
    assert NoiseScale(2.0, smoothing=0.0, max_change=None, min_measurements=0).decide(obs(50, 256, ns(350.0))) == 700
    # pow2: log2(700) = 9.45 -> 2**9 = 512 > 256.
    assert NoiseScale(2.0, smoothing=0.0, round_to="pow2", max_change=None, min_measurements=0).decide(obs(50, 256, ns(350.0))) == 512
    # Multiples of 64: 700 / 64 = 10.94 -> 11 * 64 = 704.
    assert NoiseScale(2.0, smoothing=0.0, round_to=64, max_change=None, min_measurements=0).decide(obs(50, 256, ns(350.0))) == 704
    # 722 > 600 * 1.2 = 720 asks to grow, but log2(722) = 9.496 rounds to 9: 512 < 600, no move.
    pow2 = NoiseScale(smoothing=0.0, round_to="pow2", max_change=None, min_measurements=0)
    assert pow2.decide(obs(50, 600, ns(722.0))) == 600
    assert "no move" in pow2.reason
    assert NoiseScale(smoothing=0.0, max_change=None, min_measurements=0).decide(obs(50, 256, ns(1e9))) == 4096  # clamped to max_size


def test_noise_scale_rounds_after_the_step_limit():
    # The limit first, then the grid, staying within the limit when a grid point there moves: 32 x 1.5 = 48
    # has no pow2 move within x1.5 (32 is no move), so the nearest, 64; 64 x 1.5 = 96 is on the 32-grid;
    # shrinking 256 / 1.5 = 170.7: the nearest 160 is past the limit, 192 is within it and moves.
    def decide(current, noise, max_change=1.5, **kw):
        return NoiseScale(smoothing=0.0, max_change=max_change, min_measurements=0, **kw).decide(
            obs(50, current, ns(noise)))

    assert decide(32, 4000.0, round_to="pow2") == 64
    assert decide(64, 4000.0, round_to=32) == 96
    assert decide(256, 40.0, round_to=32, allow_shrink=True) == 192
    assert decide(40, 4000.0, round_to=32, max_change=2.0) == 64  # 80 -> nearest 96 is past x2: 64
    assert decide(48, 4000.0, round_to="pow2") == 64  # 48 x 1.5 = 72 -> 64
    # Without a grid the limit is floored, as Goodput's: 33 x 1.5 = 49.5 gives 49, not 50 (x1.515).
    assert decide(33, 4000.0, round_to=None) == 49
    assert decide(33, 1.0, round_to=None, allow_shrink=True, min_size=1) == 22  # 33 / 1.5 = 22 exactly
    assert decide(34, 1.0, round_to=None, allow_shrink=True, min_size=1) == 23  # 34 / 1.5 = 22.7: at most /1.5, so 23
    assert NoiseScale(10.0, smoothing=0.0, max_change=None, min_measurements=0).decide(obs(50, 256, ns(1e308))) == 4096  # 1e309 = inf: still 4096


def test_noise_scale_with_a_limit_inside_half_a_grid_step_still_moves_one_grid_point():
    # x1.25 from 64 is 80, whose nearest power of two is 64 itself: no grid point moves within the limit, so
    # the decision goes one grid point past it (it used to stay at 64 forever, whatever the noise scale).
    def decide(current, noise, max_change=1.25, **kw):
        return NoiseScale(smoothing=0.0, max_change=max_change, min_measurements=0, **kw).decide(
            obs(50, current, ns(noise)))

    assert decide(64, 4000.0, round_to="pow2") == 128
    assert decide(1024, 40.0, round_to="pow2", allow_shrink=True) == 512
    assert decide(64, 4000.0, round_to=32, max_change=1.1) == 96
    assert decide(100, 4000.0, round_to=32, max_change=1.1) == 128  # off the grid: the first point above
    assert decide(100, 1.0, round_to=32, max_change=1.1, allow_shrink=True) == 96  # 96 is within the limit
    assert decide(4096, 1e6, round_to="pow2") == 4096  # at max_size: nowhere to go
    assert decide(80, 80.0, round_to="pow2") == 80  # within the hysteresis band: no decision to move
    # But a limit never moves the batch further than no limit: 81 rounds to 64 on the pow2 grid, 79 to 64 on
    # the 32-grid, so nothing moves, with or without the limit.
    assert decide(64, 81.0, round_to="pow2") == decide(64, 81.0, round_to="pow2", max_change=None) == 64
    assert decide(64, 79.0, round_to=32, max_change=1.1) == decide(64, 79.0, round_to=32, max_change=None) == 64
    assert NoiseScale(smoothing=0.0, max_change=None, min_measurements=0).decide(obs(50, 8000, ns(100.0))) == 4096  # current above max: clamped


def test_noise_scale_grows_monotonically_by_default():
    ctrl = NoiseScale(smoothing=0.8, interval=5, max_change=None, min_measurements=0)
    size, sizes = 32, []
    for step in range(1, 400):
        noise = 50.0 * 1.01**step * (1.5 if step % 7 == 0 else 1.0)  # growing, with noisy spikes
        size, _ = validate_decision(ctrl.decide(obs(step, size, ns(noise))), current=size)
        sizes.append(size)
    assert sizes == sorted(sizes) and 32 < sizes[-1] <= 4096


def test_noise_scale_never_shrinks_at_the_edge_of_the_band():
    # A target a rounding step below size / band used to miss both the band test and the "below" test.
    for size in range(2, 3000):
        ctrl = NoiseScale(min_size=1, smoothing=0.0, min_measurements=0)
        for noise in (size / 1.2, math.nextafter(size / 1.2, 0.0), size / 1.2 * (1 - 1e-12)):
            assert ctrl.decide(obs(50, size, ns(noise))) == size, (size, noise, ctrl.reason)
            ctrl._period = 0  # decide again in the same period
    ctrl = NoiseScale(min_measurements=0)
    assert ctrl.decide(obs(50, 34, ns(28.333333333333332))) == 34
    assert "below, and allow_shrink=False" in ctrl.reason


# ============================================================================ Goodput (Pollux)

PERF = {"perf/micro_time_a_s": 0.1, "perf/micro_time_b_s": 0.001}


def goodput_obs(step: int, batch_size: int, phi: float = 100.0, **extra) -> Observation:
    return obs(step, batch_size, {"stats/noise_scale": phi, **PERF, **extra})


def test_step_time_model():
    assert step_time(100, 0.1, 0.001) == pytest.approx(0.2)  # 0.1 + 0.001 * 100
    # W = 2: local ceil(1000 / 2) = 500; m_max 128: accum ceil(500 / 128) = 4, m = 125.
    # 0.05 + 4 * (0.1 + 0.125) = 0.95.
    assert step_time(1000, 0.1, 0.001, 0.05, 128, 2) == pytest.approx(0.95)
    # 1001: local 501, accum 4, m = ceil(501 / 4) = 126: 0.05 + 4 * 0.226 = 0.954.
    assert step_time(1001, 0.1, 0.001, 0.05, 128, 2) == pytest.approx(0.954)


def test_goodput_hand_derived():
    # a = 0.1 s, b = 0.001 s/sample, phi = 100, B0 = 100:
    # goodput(B) = B / (0.1 + 0.001 B) * (100 + 100) / (100 + B) = 200000 B / (100 + B)^2, maximal at B = 100.
    # Candidates 25 * 2**i: 25 -> 320, 50 -> 444.4, 100 -> 500, 200 -> 444.4, 400 -> 320.
    ctrl = Goodput(25, 400, candidates=5, interval=10, base_size=100, max_change=None, min_measurements=0)
    assert ctrl.sizes == [25, 50, 100, 200, 400]
    assert ctrl.decide(goodput_obs(10, 400)) == 100  # 500 / 320 = 1.5625 > 1.05
    assert list(ctrl.last_table) == [25, 50, 100, 200, 400]
    assert [ctrl.last_table[s] for s in ctrl.sizes] == pytest.approx([320, 4e7 / 90000, 500, 4e7 / 90000, 320])
    assert ctrl.decide(goodput_obs(20, 100)) == 100  # already the best
    # 90 is not a candidate: goodput(90) = 18e6 / 190**2 = 498.6; 500 / 498.6 = 1.003 <= 1.05: keep 90.
    assert ctrl.decide(goodput_obs(30, 90)) == 90
    assert ctrl.last_table[90] == pytest.approx(18e6 / 190**2)
    assert ctrl.decide(goodput_obs(40, 50)) == 100  # 500 / 444.4 = 1.125 > 1.05


def test_goodput_switch_threshold_and_b0_invariance():
    # 500 / 444.4 = 1.125 is not > 1.2: stay at 50.
    assert Goodput(25, 400, candidates=5, switch_threshold=0.2, interval=10, max_change=None, min_measurements=0).decide(goodput_obs(10, 50)) == 50
    # B0 scales every goodput by the same factor: the decision does not depend on it.
    for b0 in (1, 25, 400, 10_000):
        assert Goodput(25, 400, candidates=5, interval=10, base_size=b0, max_change=None, min_measurements=0).decide(goodput_obs(10, 400)) == 100


def test_goodput_efficiency_is_adascale_gain_over_scale():
    ctrl = Goodput(base_size=64, max_change=None, min_measurements=0)
    trace_cov, grad_sq_norm = 3000.0, 4.0  # phi = 750 samples
    for b in (64, 128, 1000, 4096):
        expected = adascale_gain(trace_cov, grad_sq_norm, b, 64) / (b / 64)
        assert ctrl.efficiency(b, trace_cov / grad_sq_norm) == pytest.approx(expected, rel=1e-12)
    assert ctrl.efficiency(64, 750.0) == 1.0  # E(B0) = 1


def test_goodput_extremes_follow_the_noise_scale():
    # Huge phi: efficiency ~ 1 everywhere and throughput B / (0.1 + 0.001 B) rises with B -> max_size.
    assert Goodput(32, 4096, max_change=None, min_measurements=0).decide(goodput_obs(50, 256, phi=1e12)) == 4096
    # Tiny phi: efficiency ~ (phi + B0) / B falls faster than throughput rises -> min_size.
    assert Goodput(32, 4096, max_change=None, min_measurements=0).decide(goodput_obs(50, 256, phi=1e-3)) == 32


def test_goodput_micro_batch_limit_and_ranks():
    # phi = 1e12: efficiency ~ 1, goodput ~ throughput. Candidates 50, 100, 200.
    # No micro-batch limit: 50 / 0.15 = 333/s, 100 / 0.2 = 500/s, 200 / 0.3 = 667/s -> 200.
    assert Goodput(50, 200, candidates=3, interval=1, max_change=None, min_measurements=0).decide(goodput_obs(1, 50, phi=1e12)) == 200
    # m_max = 100: 200 needs 2 micro-batches of 100: 200 / (2 * 0.2) = 500/s, no better than 100 (500/s);
    # the (tiny) efficiency loss of the larger batch and the tie rule pick 100.
    limited = Goodput(50, 200, candidates=3, interval=1, max_change=None, min_measurements=0)
    assert limited.sizes == [50, 100, 200]
    assert limited.decide(goodput_obs(1, 50, phi=1e12, **{"perf/max_micro_batch_size": 100})) == 100
    # 2 ranks: 200 is one micro-batch of 100 per rank: 200 / 0.2 = 1000/s vs 100 / 0.15 = 667/s -> 200.
    ranks = {"perf/max_micro_batch_size": 100, "dist/world_size": 2}
    assert Goodput(50, 200, candidates=3, interval=1, max_change=None, min_measurements=0).decide(goodput_obs(1, 100, phi=1e12, **ranks)) == 200
    # A 1 s step overhead: 50 -> 50 / 1.125 = 44/s, 200 -> 200 / 1.2 = 167/s (W = 2).
    overhead = Goodput(50, 200, candidates=3, interval=1, max_change=None, min_measurements=0)
    assert overhead.decide(goodput_obs(1, 50, phi=1e12, **ranks, **{"perf/step_overhead_s": 1.0})) == 200
    assert overhead.last_table[50] == pytest.approx(50 / 1.125, rel=1e-9)


def test_goodput_uneven_rank_weights_time_rank_0s_share():
    # a = 0.1 s, b = 1e-3 s/sample (goodput_obs). Weights 3:1 give rank 0 (whose times are measured) 3/4 of the
    # batch: 200 -> 150 samples there, 0.25 s, not the 0.2 s of an even split.
    from batchpilot.controllers.goodput import step_time
    assert step_time(200, 0.1, 1e-3, world_size=2) == pytest.approx(0.2)
    assert step_time(200, 0.1, 1e-3, world_size=4 / 3) == pytest.approx(0.25)
    ctrl = Goodput(50, 200, candidates=3, interval=1, max_change=None, min_measurements=0)
    ctrl.decide(goodput_obs(1, 100, phi=1e12, **{"dist/world_size": 2, "dist/lead_share": 0.75}))
    assert ctrl.last_table[200] == pytest.approx(200 / 0.25, rel=1e-6)


def test_observed_stats_carry_rank_0s_share_only_for_uneven_weights():
    from batchpilot.engine.decisions import observed_stats
    assert "dist/lead_share" not in observed_stats({}, world_size=2, max_micro_batch_size=None)
    assert observed_stats({}, world_size=2, max_micro_batch_size=None, rank_weights=(3.0, 1.0))["dist/lead_share"] == 0.75


def test_goodput_missing_inputs_keep_and_retry():
    ctrl = Goodput(25, 400, candidates=5, interval=10, base_size=100, max_change=None, min_measurements=0)
    assert ctrl.decide(obs(10, 400, PERF)) == 400
    assert "stats/noise_scale not measured" in ctrl.reason
    assert ctrl.decide(obs(11, 400, {"stats/noise_scale": 100.0})) == 400
    assert "throughput model not fitted" in ctrl.reason and "perf/micro_time_a_s" in ctrl.reason
    zero = {"stats/noise_scale": 100.0, "perf/micro_time_a_s": -1.0, "perf/micro_time_b_s": 0.0}
    assert ctrl.decide(obs(12, 400, zero)) == 400
    assert "zero step time" in ctrl.reason and ctrl.last_table == {}
    assert "perf/micro_time_a_s=-1.0" in ctrl.reason  # the measured values, not the clamped ones
    assert ctrl.decide(goodput_obs(13, 400)) == 100  # period 1 was never used up
    assert ctrl.decide(goodput_obs(19, 400)) == 400  # now it is


# ============================================================================ shared behaviour


def obs_at(step: int) -> Observation:
    """A deterministic observation of step ``step``; stats depend on the step only, some are missing."""
    stats = {
        "stats/grad_variance": 1e-3 * (1 + (step * 7919) % 13) / 4,
        "stats/noise_scale": 40.0 * 1.02**step,
        "stats/loss_trend": 0.004 if step % 5 else 0.03,
        "system/gpu_util": 55.0 + (step * 31) % 40,
        **PERF,
    }
    if step % 11 == 3:
        stats = {}  # nothing measured at this step
    return obs(step, 32 + (step * 37) % 900, stats, epoch=step // 40, coverage=(step % 40) / 40)


ALL = [
    lambda: VarianceRule(min_size=32, max_size=2048, interval=7),
    lambda: VarianceRule(base_size=100, sigma_base=0.03, interval=5),
    lambda: ThresholdRules(warmup_epochs=1.5, check_every=3, patience=2),
    lambda: ThresholdRules(util_source="off", plateau_action="shrink", warmup_epochs=0, check_every=2),
    lambda: NoiseScale(smoothing=0.7, interval=4, max_change=None, min_measurements=0),
    lambda: NoiseScale(1.5, 16, 1024, smoothing=0.0, hysteresis=0.0, interval=3, allow_shrink=True, round_to="pow2", max_change=None, min_measurements=0),
    lambda: Goodput(16, 2048, candidates=12, interval=6, max_change=None, min_measurements=0),
    lambda: Goodput(base_size=64, interval=9, max_change=None, min_measurements=0),
]


@pytest.mark.parametrize("make", ALL)
def test_state_round_trip(make):
    assert isinstance(make(), Controller)
    assert make().name in repr(make()) and make().state_dict()["name"] == make().name

    def advance(ctrl, step):
        ctrl.decide(obs_at(step))

    def observe(ctrl, step):
        out = [(ctrl.decide(obs_at(s)), ctrl.reason) for s in range(step, step + 120)]
        return out, getattr(ctrl, "last_table", None)

    assert_state_roundtrip(make, advance, observe, steps=(0, 1, 3, 14, 40, 77), advance_before_load=5)


@pytest.mark.parametrize("make", ALL)
def test_no_stats_keeps_the_current_size(make):
    ctrl = make()
    for step in (1, 50, 1000, 5000):
        assert ctrl.decide(obs(step, 777, epoch=10)) == 777  # ThresholdRules: no rule fires, 777 in bounds
        assert ctrl.reason


@given(
    data=st.lists(
        st.tuples(st.floats(1e-8, 1e8), st.floats(0, 1e3), st.integers(1, 100_000)), min_size=1, max_size=30
    )
)
def test_decisions_always_inside_the_bounds(data):
    ctrls = [make() for make in ALL]
    for step, (value, util, size) in enumerate(data, start=1):
        stats = {
            "stats/grad_variance": value, "stats/noise_scale": value, "stats/loss_trend": value - 1.0,
            "system/gpu_util": util, **PERF,
        }
        for ctrl in ctrls:
            decided = ctrl.decide(obs(step * 10, size, stats, epoch=5))
            assert decided == size or ctrl.min_size <= decided <= ctrl.max_size
            assert validate_decision(decided, current=size)[1] is None


def test_load_state_dict_checks_its_input():
    with pytest.raises(TypeError, match="expects the dict returned by state_dict"):
        NoiseScale().load_state_dict([1])
    with pytest.raises(ValueError, match="saved by controller 'Goodput', not 'NoiseScale'"):
        NoiseScale().load_state_dict(Goodput().state_dict())
    with pytest.raises(ValueError, match=r"missing \['period'\]"):
        VarianceRule().load_state_dict({"name": "VarianceRule", "b0": None, "base_variance": None})


# ============================================================================ constructor errors


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: VarianceRule(min_size=0), ValueError, "min_size must be >= 1, got 0"),
        (lambda: VarianceRule(min_size=9000), ValueError, "min_size=9000 is larger than max_size=8192"),
        (lambda: VarianceRule(interval=0), ValueError, "interval must be >= 1"),
        (lambda: VarianceRule(interval=10.0), TypeError, r"pass int\(10.0\) = 10"),
        (lambda: VarianceRule(base_size=-1), ValueError, "base_size must be >= 1"),
        (lambda: VarianceRule(sigma_base=0.0), ValueError, "sigma_base must be > 0, got 0.0. It is a standard"),
        (lambda: VarianceRule(sigma_base=math.inf), ValueError, "sigma_base must be finite"),
        (lambda: VarianceRule(sigma_base="1"), TypeError, "sigma_base must be a real number"),
        (lambda: VarianceRule(sigma_base=1e200), ValueError, r"sigma_base=1e\+200 squares to inf in floating point"),
        (lambda: VarianceRule(sigma_base=1e-200), ValueError, r"sigma_base=1e-200 squares to 0.0 in floating point"),
        (lambda: NoiseScale(max_change=1.0), ValueError, "max_change must be > 1, got 1.0"),
        (lambda: Goodput(max_change=1.0), ValueError, "max_change must be > 1, got 1.0"),
        (lambda: ThresholdRules(shrink_factor=1.5), ValueError, r"shrink_factor must be < 1, got 1.5. A shrink"),
        (lambda: ThresholdRules(shrink_factor=0), ValueError, "shrink_factor must be > 0"),
        (lambda: ThresholdRules(grow_factor=1.0), ValueError, "grow_factor must be > 1"),
        (lambda: ThresholdRules(util_threshold=170), ValueError, r"util_threshold must be <= 100.*percentage"),
        (lambda: ThresholdRules(util_source="tpu"), ValueError, "util_source must be one of 'gpu', 'gpu-or-cpu'"),
        (lambda: ThresholdRules(plateau_action="wait"), ValueError, "plateau_action must be one of 'grow'"),
        (lambda: ThresholdRules(patience=0), ValueError, "patience must be >= 1"),
        (lambda: ThresholdRules(variance_threshold=-1e-3), ValueError, "variance_threshold must be >= 0"),
        (lambda: ThresholdRules(plateau_threshold=math.nan), ValueError, "plateau_threshold must be finite"),
        (lambda: ThresholdRules(warmup_epochs=-1), ValueError, "warmup_epochs must be >= 0"),
        (lambda: ThresholdRules(warmup_size=8), ValueError, r"warmup_size=8 is outside \[min_size=32"),
        (lambda: ThresholdRules(check_every=0), ValueError, "check_every must be >= 1"),
        (lambda: NoiseScale(factor=0), ValueError, "factor must be > 0"),
        (lambda: NoiseScale(smoothing=1.0), ValueError, "smoothing must be < 1, got 1.0. It is the per-step"),
        (lambda: NoiseScale(hysteresis=-0.1), ValueError, "hysteresis must be >= 0"),
        (lambda: NoiseScale(allow_shrink="yes"), TypeError, "allow_shrink must be True or False"),
        (lambda: NoiseScale(round_to="pow3"), ValueError, "round_to must be None, 'pow2' or an int quantum"),
        (lambda: NoiseScale(round_to=0), ValueError, "round_to must be >= 1"),
        (lambda: NoiseScale(round_to=8192), ValueError, "round_to=8192 is larger than max_size=4096"),
        (lambda: NoiseScale(min_size=64, max_size=32), ValueError, "impossible bounds"),
        (lambda: Goodput(candidates=1), ValueError, "candidates must be >= 2"),
        (lambda: Goodput(switch_threshold=-0.05), ValueError, "switch_threshold must be >= 0"),
        (lambda: Goodput(interval=True), TypeError, "interval must be an int, got the bool"),
        (lambda: Goodput(base_size=0), ValueError, "base_size must be >= 1"),
    ],
)
def test_constructor_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_goodput_with_equal_bounds_has_one_candidate():
    ctrl = Goodput(64, 64, interval=1)
    assert ctrl.sizes == [64]
    assert ctrl.decide(goodput_obs(1, 100)) == 64  # the current size is out of bounds: clamped


def test_required_stats_name_the_keys_read():
    assert VarianceRule().required_stats == ("stats/grad_variance",)
    assert NoiseScale().required_stats == ("stats/noise_scale",)
    assert Goodput().required_stats == (
        "stats/noise_scale", "perf/micro_time_a_s", "perf/micro_time_b_s", "perf/step_overhead_s",
        "perf/max_micro_batch_size", "dist/world_size", "perf/accumulation_steps",
    )
    assert ThresholdRules().required_stats == ("stats/grad_variance", "stats/loss_trend", "system/gpu_util")
    assert ThresholdRules(util_source="gpu-or-cpu").required_stats[2:] == ("system/gpu_util", "system/cpu_util")
    assert ThresholdRules(util_source="off").required_stats == ("stats/grad_variance", "stats/loss_trend")


def test_noise_controllers_wait_for_the_estimate_and_change_at_most_twofold():
    # Early estimates rest on few measured steps; defaults wait for 10 (stats/noise_count).
    early = {"stats/noise_scale": 5000.0, "stats/noise_count": 3}
    ctrl = NoiseScale(smoothing=0.0, interval=50)
    assert ctrl.decide(obs(50, 64, early)) == 64
    assert "3 of 10 measured steps: warming up" in ctrl.reason
    # Warmed up: the target 5000 > 64 * 1.2, but one decision at most doubles (max_change=2): 128.
    ready = {"stats/noise_scale": 5000.0, "stats/noise_count": 10}
    assert ctrl.decide(obs(100, 64, ready)) == 128
    assert ctrl.decide(obs(150, 128, ready)) == 256
    good = Goodput(32, 4096, interval=50)
    perf = {"perf/micro_time_a_s": 0.1, "perf/micro_time_b_s": 1e-4}
    assert good.decide(obs(50, 64, {**early, **perf})) == 64 and "warming up" in good.reason
    # phi = 5000 and a large fixed cost: the best candidate is far above 64, limited to 128 this time.
    assert good.decide(obs(100, 64, {**ready, **perf})) == 128 and "limited to x2" in good.reason


def test_goodput_counts_a_fixed_accumulation_in_the_step_time():
    # Trainer-style loops run A micro-batches per step whatever B is: A fixed costs a per step.
    from batchpilot.controllers.goodput import step_time

    assert step_time(64, 0.01, 0.001, 0.002, world_size=2, fixed_accum=4) == pytest.approx(0.002 + 4 * (0.01 + 0.001 * 8))
    assert step_time(64, 0.01, 0.001, 0.002, world_size=2) == pytest.approx(0.002 + 0.01 + 0.001 * 32)
    # Both (the HF trainer with max_micro_batch_size): 2 micro-batches of 32, each run as 4 passes of 8.
    assert step_time(64, 0.01, 0.001, max_micro=8, fixed_accum=2) == pytest.approx(8 * (0.01 + 0.001 * 8))
    assert step_time(60, 0.01, 0.001, max_micro=8, fixed_accum=2) == pytest.approx(8 * (0.01 + 0.001 * 8))
    assert step_time(64, 0.01, 0.001, max_micro=40, fixed_accum=2) == pytest.approx(2 * (0.01 + 0.001 * 32))
    good = Goodput(32, 4096, interval=50)
    stats = {"stats/noise_scale": 500.0, "stats/noise_count": 10, "perf/micro_time_a_s": 0.01,
             "perf/micro_time_b_s": 0.001, "perf/accumulation_steps": 4.0}
    good.decide(obs(50, 64, stats))
    for size, value in good.last_table.items():
        assert value == pytest.approx(size / (4 * (0.01 + 0.001 * math.ceil(size / 4))) * good.efficiency(size, 500.0))
