"""Loss trend and throughput model: hand-derived values, synthetic timings with a known a and b, the
robustness rules, input checks and state round trips."""

from __future__ import annotations

import math
import random

import pytest
from harness import assert_state_roundtrip

from batchpilot.stats import LossTrend, ThroughputModel


# ------------------------------------------------------------------------------------------ LossTrend
def fill(trend: LossTrend, losses) -> LossTrend:
    for v in losses:
        trend.update(v)
    return trend


def test_loss_trend_hand_derived():
    trend = fill(LossTrend(window=4), [4.0, 4.0, 2.0])
    assert (trend.relative_decrease, trend.slope, trend.metrics()) == (None, None, {})
    trend.update(2.0)
    # halves: mean 4 -> mean 2, a 50% decrease; slope: sum((i-1.5)(y-3)) = -4 over sum((i-1.5)^2) = 5.
    assert trend.relative_decrease == pytest.approx(0.5, rel=1e-15)
    assert trend.slope == pytest.approx(-0.8, rel=1e-15)
    assert trend.metrics() == {"stats/loss_trend": pytest.approx(0.5)}
    trend.update(1.0)  # window slides: [4, 2, 2, 1] -> (3 - 1.5) / 3
    assert trend.relative_decrease == pytest.approx(0.5, rel=1e-15)
    trend.update(3.0)  # [2, 2, 1, 3] -> (2 - 2) / 2
    assert trend.relative_decrease == 0.0


def test_loss_trend_odd_window_ignores_the_middle():
    trend = fill(LossTrend(window=5), [10.0, 8.0, 100.0, 6.0, 4.0])
    assert trend.relative_decrease == pytest.approx((9 - 5) / 9, rel=1e-15)
    assert trend.slope == pytest.approx((-2 * 10 - 8 + 6 + 2 * 4) / 10, rel=1e-15)  # middle has weight 0 in the slope too


def test_loss_trend_rising_and_negative_losses():
    assert fill(LossTrend(2), [1.0, 1.5]).relative_decrease == pytest.approx(-0.5)  # rising: negative
    assert fill(LossTrend(2), [-2.0, -3.0]).relative_decrease == pytest.approx(0.5)  # |first half| in the denominator
    assert fill(LossTrend(2), [0.0, -1.0]).relative_decrease is None  # no scale to be relative to


@pytest.mark.parametrize("window", [1, 0, 2.0, True])
def test_loss_trend_rejects_window(window):
    with pytest.raises(ValueError, match="window"):
        LossTrend(window)


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), "1.0", None])
def test_loss_trend_rejects_loss(loss):
    with pytest.raises(ValueError, match="finite"):
        LossTrend(3).update(loss)


def test_loss_trend_state_roundtrip():
    def advance(trend, step):
        trend.update(10.0 / (1 + step) + 0.1 * (step % 3))

    def observe(trend, step):
        out = []
        for s in range(step, step + 8):
            advance(trend, s)
            out.append((trend.count, trend.relative_decrease, trend.slope))
        return out

    assert_state_roundtrip(lambda: LossTrend(6), advance, observe, steps=(0, 3, 6, 11), advance_before_load=4)


# ------------------------------------------------------------------------------------- ThroughputModel
A, B = 0.004, 0.0005  # true seconds per micro-batch: a + b*m


def test_exact_fit_from_noiseless_timings():
    model = ThroughputModel()
    assert model.fit() is None and model.predict_step_time(64) is None and model.predict_throughput(64) is None
    assert model.metrics() == {}
    for m in (16, 32, 64, 128, 256, 32, 16):
        for _ in range(3):
            model.observe_micro(m, A + B * m)
    a, b = model.fit()
    assert (a, b) == (pytest.approx(A, rel=1e-9), pytest.approx(B, rel=1e-9))
    assert model.predict_micro_time(100) == pytest.approx(A + 100 * B, rel=1e-9)


def test_predict_step_time_hand_derived():
    model = ThroughputModel(warmup=0)
    for m in (10, 20):
        model.observe_micro(m, A + B * m)
    model.observe_overhead(0.05)
    # B = 1000 on W = 3 ranks with m_max = 128: local = 334, accumulation = ceil(334/128) = 3,
    # micro-batch = ceil(334/3) = 112; time = 0.05 + 3 * (a + 112 b).
    expected = 0.05 + 3 * (A + 112 * B)
    assert model.predict_step_time(1000, 3, 128) == pytest.approx(expected, rel=1e-9)
    assert model.predict_throughput(1000, 3, 128) == pytest.approx(1000 / expected, rel=1e-9)
    # No m_max: one micro-batch of ceil(1000/3) = 334.
    assert model.predict_step_time(1000, 3) == pytest.approx(0.05 + A + 334 * B, rel=1e-9)
    assert model.metrics() == {
        "perf/micro_time_a_s": pytest.approx(A), "perf/micro_time_b_s": pytest.approx(B),
        "perf/step_overhead_s": pytest.approx(0.05),
    }


def test_noisy_timings_recover_a_and_b():
    rng = random.Random(0)
    model = ThroughputModel()
    for _ in range(200):
        m = rng.choice((32, 64, 128, 256))
        model.observe_micro(m, (A + B * m) * (1 + 0.05 * rng.gauss(0, 1)))
    a, b = model.fit()
    assert a == pytest.approx(A, rel=0.15) and b == pytest.approx(B, rel=0.03)


def test_first_timing_of_each_size_is_dropped():
    slow_first = [(m, 10 * (A + B * m)) for m in (32, 64)]  # allocation, kernel selection, ...
    later = [(m, A + B * m) for m in (32, 64) for _ in range(3)]
    default, no_warmup = ThroughputModel(), ThroughputModel(warmup=0)
    for model in (default, no_warmup):
        for m, t in slow_first + later:
            model.observe_micro(m, t)
    assert default.fit() == (pytest.approx(A, rel=1e-9), pytest.approx(B, rel=1e-9))
    assert no_warmup.fit()[1] > 2 * B  # without warm-up the first timings pull the fit far off


def test_forgetting_follows_a_change():
    model = ThroughputModel(forget=0.5, warmup=0)
    for m in (32, 64):
        model.observe_micro(m, A + B * m)
    for _ in range(30):  # the machine got twice as slow
        for m in (32, 64):
            model.observe_micro(m, 2 * (A + B * m))
    assert model.fit() == (pytest.approx(2 * A, rel=1e-6), pytest.approx(2 * B, rel=1e-6))


def test_hand_derived_weighted_mean_per_size():
    model = ThroughputModel(forget=0.5, warmup=0)
    model.observe_micro(10, 1.0)
    model.observe_micro(10, 4.0)  # weights 0.5 and 1: mean (0.5*1 + 4) / 1.5 = 3
    assert model.predict_micro_time(10) == pytest.approx(3.0)  # one size: t = b*m through the origin
    assert model.fit() == (0.0, pytest.approx(0.3))


def test_physical_constraints():
    flat = ThroughputModel(warmup=0)
    flat.observe_micro(10, 2.0)
    flat.observe_micro(20, 1.0)  # time falling with size: noise, so b = 0 and a = the mean
    assert flat.fit() == (pytest.approx(1.5), 0.0)
    origin = ThroughputModel(warmup=0)
    origin.observe_micro(10, 1.0)
    origin.observe_micro(20, 3.0)  # line a = -1, b = 0.2: refit through the origin, b = 70/500
    assert origin.fit() == (0.0, pytest.approx(70 / 500))


def test_max_sizes_forgets_the_least_recent():
    model = ThroughputModel(warmup=0, max_sizes=2)
    model.observe_micro(10, 100.0)  # stale, wrong: must be evicted
    model.observe_micro(20, A + 20 * B)
    model.observe_micro(40, A + 40 * B)
    assert model.fit() == (pytest.approx(A, rel=1e-9), pytest.approx(B, rel=1e-9))


def test_observe_step_splits_overhead():
    model = ThroughputModel(warmup=0, overhead_decay=0.0)
    model.observe_step([8, 8, 4], [0.1, 0.1, 0.06], 0.3)
    assert model.overhead == pytest.approx(0.04)
    model.observe_step([8], [0.1], 0.05)  # clock skew: never a negative overhead
    assert model.overhead == 0.0
    model.observe_step([16], [0.2], None)  # the micro-batch counts, but there is no overhead sample
    assert model.overhead == 0.0 and 16 in model._sizes


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.observe_micro(0, 1.0), "micro_batch_size"),
        (lambda m: m.observe_micro(4, -1.0), "seconds"),
        (lambda m: m.observe_micro(4, math.nan), "seconds"),
        (lambda m: m.observe_step([4, 4], [1.0], 2.0), "one timing per"),
        (lambda m: m.predict_step_time(0), "global_batch_size"),
        (lambda m: m.predict_step_time(8, 0), "world_size"),
        (lambda m: m.predict_step_time(8, 1, 0), "max_micro_batch_size"),
    ],
)
def test_throughput_rejects(call, match):
    with pytest.raises(ValueError, match=match):
        call(ThroughputModel())


def test_throughput_constructor_reports_every_problem():
    with pytest.raises(ValueError, match="forget.*warmup.*overhead_decay.*max_sizes"):
        ThroughputModel(forget=1.0, warmup=-1, overhead_decay=2, max_sizes=1)


def test_throughput_state_roundtrip():
    def advance(model, step):
        m = (16, 32, 64, 128, 48)[step % 5]
        model.observe_micro(m, A + B * m + 1e-4 * (step % 3))
        if step % 2:
            model.observe_overhead(0.01 + 0.001 * step)

    def observe(model, step):
        out = []
        for s in range(step, step + 7):
            advance(model, s)
            out.append((model.fit(), model.overhead, model.predict_step_time(500, 2, 64), model.metrics()))
        return out

    assert_state_roundtrip(lambda: ThroughputModel(max_sizes=4), advance, observe, steps=(0, 1, 4, 12),
                           advance_before_load=3)


def test_evicting_a_size_refits_and_a_bad_state_is_refused():
    model = ThroughputModel(max_sizes=2)
    for m, t in ((8, 1.0), (8, 1.0), (16, 1.5), (16, 1.5)):
        model.observe_micro(m, t)
    assert model.fit() == pytest.approx((0.5, 0.0625))
    model.observe_micro(32, 9.0)  # evicts 8 (observed least recently); 32 is still in its warm-up
    restored = ThroughputModel(max_sizes=2)
    restored.load_state_dict(model.state_dict())
    assert model.fit() == restored.fit()  # the fit no longer rests on the evicted size
    for key, value in (("overhead_decay", 1.0), ("forget", 1.5), ("max_sizes", 1), ("warmup", -1)):
        state = {**model.state_dict(), key: value}
        with pytest.raises(ValueError, match=key):
            ThroughputModel().load_state_dict(state)
