"""Batch-size schedules: hand-derived sizes, seed-003 equivalence, state round trips, constructor errors."""

from __future__ import annotations

import functools
import json
import math
import re

import pytest
from harness import assert_state_roundtrip
from hypothesis import given
from hypothesis import strategies as st

import batchpilot.controllers as controllers
from batchpilot.controllers import (
    Constant,
    Controller,
    Exponential,
    LinearIncrease,
    MultiplicativeStep,
    Observation,
    Piecewise,
    Schedule,
    WarmupRamp,
    linear_increase_scheduler,
    validate_decision,
)


def obs(step: int = 0, samples_seen: int = 0, epoch: int = 0, coverage: float = 0.0, batch_size: int = 8):
    return Observation(
        step=step, samples_seen=samples_seen, epoch=epoch, coverage=coverage, batch_size=batch_size
    )


def test_all_is_sorted_and_complete():
    assert controllers.__all__ == sorted(controllers.__all__)
    for name in controllers.__all__:
        assert hasattr(controllers, name)


# ----------------------------------------------------------------------------- seed 003 function


@pytest.mark.parametrize(
    "args, expected",
    [
        ((0, 8, 50, 64, 4), 12),  # fires at step 0 too: 0 % 50 == 0
        ((49, 8, 50, 64, 4), 8),
        ((50, 8, 50, 64, 4), 12),
        ((51, 12, 50, 64, 4), 12),
        ((100, 62, 50, 64, 4), 64),  # capped: min(66, 64)
        ((100, 64, 50, 64, 4), 64),
        ((150, 70, 50, 64, 4), 70),  # already above max: unchanged, never shrunk
        ((100, 30), 32),  # defaults interval=100, max_size=32, increment=2
        ((200, 31), 32),
        ((101, 30), 30),
    ],
)
def test_linear_increase_scheduler_is_seed_003(args, expected):
    assert linear_increase_scheduler(*args) == expected


def test_partial_of_seed_function_flow_over_800_steps():
    """Seed 003's example, driven the way the engine drives it: decide after each step 1, 2, ..."""
    schedule = Schedule(
        functools.partial(linear_increase_scheduler, interval=50, max_size=64, increment=4)
    )
    closed_form = LinearIncrease(8, 4, 50, 64)
    size, sizes = 8, {}
    for step in range(1, 801):
        decided = schedule.decide(obs(step=step, samples_seen=0, batch_size=size))
        size, note = validate_decision(decided, current=size)
        assert note is None
        sizes[step] = size
        assert size == min(8 + 4 * (step // 50), 64)
        assert size == closed_form.decide(obs(step=step))
    assert [sizes[s] for s in (1, 49, 50, 99, 100, 150, 300, 650, 699, 700, 800)] == [
        8, 8, 12, 12, 16, 20, 32, 60, 60, 64, 64,
    ]


@given(
    start=st.integers(1, 64),
    increment=st.integers(1, 16),
    interval=st.integers(1, 40),
    extra=st.integers(0, 200),
)
def test_linear_increase_equals_seed_function_called_every_step(start, increment, interval, extra):
    max_size = start + extra
    closed = LinearIncrease(start, increment, interval, max_size)
    size = start
    for step in range(1, 200):
        size = linear_increase_scheduler(step, size, interval, max_size, increment)
        assert closed.decide(obs(step=step)) == size


# ----------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize(
    "step, expected", [(0, 8), (49, 8), (50, 12), (99, 12), (100, 16), (699, 60), (700, 64), (10000, 64)]
)
def test_linear_increase_values(step, expected):
    assert LinearIncrease(8, 4, 50, 64).decide(obs(step=step, batch_size=999)) == expected


def test_constant():
    assert [Constant(48).decide(obs(step=s, batch_size=7)) for s in (0, 1, 10**6)] == [48, 48, 48]


@pytest.mark.parametrize(
    "step, expected", [(0, 32), (99, 32), (100, 64), (250, 128), (399, 256), (400, 512), (10**9, 512)]
)
def test_multiplicative_step_doubles_every_100_steps(step, expected):
    schedule = MultiplicativeStep(32, 2, every_steps=100, max_size=512)
    assert schedule.decide(obs(step=step)) == expected


@pytest.mark.parametrize(
    "samples, expected", [(0, 32), (999, 32), (1000, 64), (3500, 256), (10**12, 256)]
)
def test_multiplicative_step_on_samples(samples, expected):
    schedule = MultiplicativeStep(32, 2, every_samples=1000, max_size=256)
    assert schedule.decide(obs(step=5, samples_seen=samples)) == expected


@pytest.mark.parametrize(
    "step, expected", [(0, 100), (10, 50), (20, 25), (30, 13), (40, 8), (10**9, 8)]
)
def test_multiplicative_step_shrinks_to_min_size(step, expected):
    # 100 * 0.5**3 = 12.5 rounds half up to 13; 6.25 -> 6 is clamped up to 8.
    schedule = MultiplicativeStep(100, 0.5, every_steps=10, min_size=8)
    assert schedule.decide(obs(step=step)) == expected


@pytest.mark.parametrize("step, expected", [(40, 6), (50, 3), (60, 2), (70, 1), (80, 1), (10**9, 1)])
def test_multiplicative_step_shrinks_never_below_one(step, expected):
    # 100 * 0.5**8 = 0.39 rounds to 0, which is clamped up to 1.
    assert MultiplicativeStep(100, 0.5, every_steps=10).decide(obs(step=step)) == expected


@pytest.mark.parametrize("k, expected", [(0, 10), (1, 15), (2, 23), (3, 34), (5, 76), (6, 100)])
def test_multiplicative_step_fractional_factor_rounds_half_up(k, expected):
    # 10 * 1.5**k = 10, 15, 22.5, 33.75, ..., 75.9375, 113.9 (capped at 100)
    schedule = MultiplicativeStep(10, 1.5, every_steps=1, max_size=100)
    assert schedule.decide(obs(step=k)) == expected


@given(
    start=st.integers(1, 100),
    factor=st.integers(2, 5),
    k=st.integers(0, 300),
    cap_extra=st.integers(0, 10**6),
)
def test_multiplicative_step_matches_exact_integer_arithmetic(start, factor, k, cap_extra):
    """The log-space shortcut agrees with naive big-int arithmetic."""
    max_size = start + cap_extra
    schedule = MultiplicativeStep(start, factor, every_steps=3, max_size=max_size)
    assert schedule.decide(obs(step=3 * k + 2)) == min(start * factor**k, max_size)


@pytest.mark.parametrize(
    "step, expected", [(0, 32), (10, 42), (25, 64), (50, 128), (75, 256), (100, 512), (10**6, 512)]
)
def test_exponential_on_steps(step, expected):
    # 32 * 16**(s/100): 16**0.1 = 1.3195 -> 42.22 -> 42; 16**0.25 = 2 -> 64
    assert Exponential(32, 512, total_steps=100).decide(obs(step=step)) == expected


@pytest.mark.parametrize("samples, expected", [(0, 64), (250, 45), (500, 32), (1000, 16), (5000, 16)])
def test_exponential_decay_on_samples(samples, expected):
    # 64 * 0.25**0.25 = 45.25 -> 45; 64 * 0.25**0.5 = 32
    assert Exponential(64, 16, total_samples=1000).decide(obs(samples_seen=samples)) == expected


@given(st.integers(1, 4096), st.integers(0, 4096), st.integers(1, 1000))
def test_exponential_is_monotone_and_bounded(start, extra, total):
    schedule = Exponential(start, start + extra, total_steps=total)
    steps = [*range(0, total, max(1, total // 50)), total, total + 1]
    sizes = [schedule.decide(obs(step=s)) for s in steps]
    assert sizes == sorted(sizes)
    assert sizes[0] == start and sizes[-1] == start + extra


@pytest.mark.parametrize(
    "epoch, coverage, expected",
    [
        (0, 0.0, 32),
        (4, 0.99, 32),
        (5, 0.0, 32),  # ramp starts: 32 + 224 * 0
        (6, 0.0, 77),  # 32 + 224 * 0.2 = 76.8
        (7, 0.5, 144),  # 32 + 224 * 0.5
        (9, 0.75, 245),  # 32 + 224 * 0.95 = 244.8
        (10, 0.0, 256),
        (50, 0.3, 256),
    ],
)
def test_warmup_ramp(epoch, coverage, expected):
    schedule = WarmupRamp(32, 256, warmup_epochs=5.0, ramp_epochs=5.0)
    assert schedule.decide(obs(epoch=epoch, coverage=coverage)) == expected


def test_warmup_ramp_without_ramp_jumps_at_end_of_warmup():
    schedule = WarmupRamp(16, 64, warmup_epochs=2.0, ramp_epochs=0.0)
    assert [schedule.decide(obs(epoch=e, coverage=c)) for e, c in [(1, 0.99), (2, 0.0), (3, 0.5)]] == [
        16, 64, 64,
    ]


def test_warmup_ramp_defaults_are_seed_000_five_epochs():
    schedule = WarmupRamp(8, 108)
    assert [schedule.decide(obs(epoch=e)) for e in (4, 5, 6, 10)] == [8, 8, 28, 108]


@pytest.mark.parametrize("step, expected", [(0, 64), (999, 64), (1000, 128), (4999, 128), (5000, 256)])
def test_piecewise_on_steps(step, expected):
    assert Piecewise([1000, 5000], [64, 128, 256], key="step").decide(obs(step=step)) == expected


def test_piecewise_other_keys():
    on_samples = Piecewise([10_000], [32, 64])
    assert [on_samples.decide(obs(samples_seen=s)) for s in (9_999, 10_000)] == [32, 64]
    on_epochs = Piecewise([1.5, 3], [16, 32, 64], key="epoch")
    assert [on_epochs.decide(obs(epoch=e, coverage=c)) for e, c in [(1, 0.49), (1, 0.5), (3, 0.0)]] == [
        16, 32, 64,
    ]
    on_coverage = Piecewise([0.5], [8, 16], key="coverage")
    assert [on_coverage.decide(obs(epoch=3, coverage=c)) for c in (0.49, 0.5)] == [8, 16]
    assert Piecewise([], [42]).decide(obs(step=123)) == 42


# ----------------------------------------------------------------------------- Schedule wrapper


def test_schedule_names():
    inner = functools.partial(linear_increase_scheduler, interval=50)
    assert Schedule(functools.partial(inner, max_size=64)).name == "linear_increase_scheduler"
    assert Schedule(lambda step, size: size).name == "<lambda>"
    assert Schedule(linear_increase_scheduler, name="seed003").name == "seed003"

    class Doubler:
        def __call__(self, step, size):
            return 2 * size

    assert Schedule(Doubler()).name == "Doubler"


def test_a_schedule_that_cannot_take_step_and_size_is_refused_at_once():
    # It used to be accepted and fail after the first training step with Python's own message.
    for fn, shown in [(lambda s: 5, "<lambda>(s)"), (lambda step, size, lr: 5, "<lambda>(step, size, lr)"),
                      (functools.partial(linear_increase_scheduler, step=0), "linear_increase_scheduler")]:
        with pytest.raises(TypeError, match=r"called as fn\(step, current_size\) -> size, but " + re.escape(shown)):
            Schedule(fn)
    # Extra defaults, *args and objects with __call__ are fine; so is a builtin whose signature is unknown.
    for fn in (lambda step, size, scale=2: size * scale, lambda *args: args[1], max):
        Schedule(fn)


def test_schedule_passes_step_and_current_size_unvalidated():
    calls = []

    def fn(step, size):
        calls.append((step, size))
        return 0  # nonsense on purpose: the boundary, not the wrapper, rejects it

    assert Schedule(fn).decide(obs(step=7, batch_size=24)) == 0
    assert calls == [(7, 24)]


def test_schedule_delegates_state_of_a_stateful_callable():
    class Counter:
        def __init__(self):
            self.calls = 0

        def __call__(self, step, size):
            self.calls += 1
            return size + self.calls

        def state_dict(self):
            return {"calls": self.calls}

        def load_state_dict(self, state):
            self.calls = state["calls"]

    a = Schedule(Counter())
    for step in range(3):
        a.decide(obs(step=step))
    state = json.loads(json.dumps(a.state_dict()))
    assert state == {"name": "Counter", "fn": {"calls": 3}}
    b = Schedule(Counter())
    b.load_state_dict(state)
    assert b.decide(obs(step=3, batch_size=10)) == a.decide(obs(step=3, batch_size=10)) == 14


# ----------------------------------------------------------------------------- protocol and state

ALL_SCHEDULES = [
    lambda: Schedule(functools.partial(linear_increase_scheduler, interval=50, max_size=64, increment=4)),
    lambda: Constant(32),
    lambda: LinearIncrease(8, 4, 50, 64),
    lambda: MultiplicativeStep(32, 2, every_steps=100, max_size=512),
    lambda: MultiplicativeStep(256, 0.5, every_samples=5000, min_size=16),
    lambda: Exponential(32, 512, total_samples=20_000),
    lambda: WarmupRamp(16, 128, warmup_epochs=1.0, ramp_epochs=2.5),
    lambda: Piecewise([0.25, 0.75], [8, 16, 32], key="coverage"),
]


def obs_at(step: int) -> Observation:
    """A deterministic observation for step ``step`` (inputs depend on the step number only)."""
    return obs(step=step, samples_seen=40 * step, epoch=step // 250, coverage=(step % 250) / 250,
               batch_size=8 + step // 10)


@pytest.mark.parametrize("make", ALL_SCHEDULES)
def test_state_round_trip(make):
    assert isinstance(make(), Controller)
    assert "name" in make().state_dict() and isinstance(repr(make()), str)

    def advance(ctrl, step):
        ctrl.decide(obs_at(step))

    def observe(ctrl, step):
        return [ctrl.decide(obs_at(s)) for s in range(step, step + 1000, 7)]

    assert_state_roundtrip(make, advance, observe, steps=(0, 1, 49, 50, 300), advance_before_load=3)


def test_load_state_dict_rejects_non_mapping():
    with pytest.raises(TypeError, match="expects the dict returned by state_dict"):
        Constant(8).load_state_dict([1, 2])


def test_a_state_saved_by_another_controller_is_refused():
    from batchpilot.controllers import NoiseScale

    with pytest.raises(ValueError, match="saved by controller 'NoiseScale', not 'Constant'"):
        Constant(64).load_state_dict(NoiseScale().state_dict())
    with pytest.raises(ValueError, match="saved by controller 'Constant', not 'MultiplicativeStep'"):
        MultiplicativeStep(8, 2, every_steps=10, max_size=64).load_state_dict(Constant(8).state_dict())
    with pytest.raises(ValueError, match="not by a Schedule"):
        Schedule(lambda step, size: size).load_state_dict(NoiseScale().state_dict())
    Constant(64).load_state_dict(Constant(32).state_dict())  # the same kind of controller loads


# ----------------------------------------------------------------------------- constructor errors


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: Schedule(42), TypeError, "needs a callable"),
        (lambda: Schedule(len, name=3), TypeError, "name must be a str"),
        (lambda: Constant(0), ValueError, r"size must be >= 1, got 0"),
        (lambda: Constant(8.0), TypeError, r"pass int\(8.0\) = 8"),
        (lambda: Constant(True), TypeError, "bool"),
        (lambda: LinearIncrease(128, 4, 50, 64), ValueError, "start=128 is larger than max_size=64"),
        (lambda: LinearIncrease(8, 4, 0, 64), ValueError, "interval must be >= 1"),
        (lambda: LinearIncrease(8, -1, 50, 64), ValueError, "increment must be >= 1"),
        (lambda: MultiplicativeStep(8, 1, every_steps=10), ValueError, r"use Constant\(start\)"),
        (lambda: MultiplicativeStep(8, 0, every_steps=10), ValueError, "factor must be > 0"),
        (lambda: MultiplicativeStep(8, -2, every_steps=10), ValueError, "factor must be > 0"),
        (lambda: MultiplicativeStep(8, math.nan, every_steps=10), ValueError, "factor must be finite"),
        (lambda: MultiplicativeStep(8, "2", every_steps=10, max_size=64), TypeError, "factor must be a real"),
        (lambda: MultiplicativeStep(8, 2, max_size=64), ValueError, "exactly one of every_steps= or every_samples"),
        (
            lambda: MultiplicativeStep(8, 2, every_steps=1, every_samples=1, max_size=64),
            ValueError,
            "exactly one of",
        ),
        (lambda: MultiplicativeStep(8, 2, every_steps=10), ValueError, "without limit; pass max_size="),
        (lambda: MultiplicativeStep(8, 2, every_steps=0, max_size=64), ValueError, "every_steps must be >= 1"),
        (
            lambda: MultiplicativeStep(4, 2, every_steps=10, min_size=8, max_size=64),
            ValueError,
            "start=4 is outside",
        ),
        (
            lambda: MultiplicativeStep(8, 0.5, every_steps=10, min_size=64, max_size=8),
            ValueError,
            "impossible bounds",
        ),
        (lambda: Exponential(32, 512), ValueError, "exactly one of total_steps= or total_samples="),
        (lambda: Exponential(32, 512, total_steps=0), ValueError, "total_steps must be >= 1"),
        (lambda: Exponential(0, 512, total_steps=10), ValueError, "start must be >= 1"),
        (lambda: WarmupRamp(8, 64, warmup_epochs=-1), ValueError, "warmup_epochs must be >= 0"),
        (lambda: WarmupRamp(8, 64, ramp_epochs=math.inf), ValueError, "ramp_epochs must be finite"),
        (lambda: WarmupRamp(8, 64, warmup_epochs="5"), TypeError, "warmup_epochs must be a real"),
        (lambda: WarmupRamp(8, 0), ValueError, "target_size must be >= 1"),
        (lambda: Piecewise([10], [8]), ValueError, r"len\(sizes\) == len\(boundaries\) \+ 1"),
        (lambda: Piecewise([10, 10], [8, 16, 32]), ValueError, "strictly increasing, but boundaries\\[0\\]=10"),
        (lambda: Piecewise([20, 10], [8, 16, 32]), ValueError, "strictly increasing"),
        (lambda: Piecewise([10], [8, 16], key="loss"), ValueError, "key must be one of"),
        (lambda: Piecewise([1.5], [8, 16], key="coverage"), ValueError, "fractions of an epoch"),
        (lambda: Piecewise([10], [8, 0]), ValueError, r"sizes\[1\] must be >= 1"),
        (lambda: Piecewise([math.nan], [8, 16]), ValueError, r"boundaries\[0\] must be finite"),
    ],
)
def test_constructor_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()
