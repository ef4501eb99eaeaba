"""validate_decision: the one boundary every controller decision passes through."""

from __future__ import annotations

import functools
import logging
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.controllers import (
    InvalidDecisionError,
    Observation,
    Schedule,
    linear_increase_scheduler,
    validate_decision,
)

FIX = r"a decision must be a whole number >= 1\. Fix the controller, or pass on_invalid='keep'"


@pytest.mark.parametrize(
    "value, problem",
    [
        (0, r"returned 0 \(not positive\)"),
        (-3, r"returned -3 \(not positive\)"),
        (-0.0, r"returned -0.0 \(not positive\)"),
        (math.nan, r"returned nan \(not finite\)"),
        (math.inf, r"returned inf \(not finite\)"),
        (-math.inf, r"returned -inf \(not finite\)"),
        (True, r"returned True \(a bool\)"),
        (False, r"returned False \(a bool\)"),
        ("64", r"returned '64' \(of type str\)"),
        (None, r"returned None \(of type NoneType\)"),
        (12.5, r"returned 12.5 \(not a whole number\)"),
        (np.float32(12.5), r"returned .*12.5.* \(not a whole number\)"),
        (np.float64("nan"), r"\(not finite\)"),
        (np.int64(0), r"\(not positive\)"),
        (np.bool_(True), r"\(of type bool_?\)"),
        (torch.tensor(64), r"\(of type Tensor\)"),  # call .item() in the controller
        (4e19, r"returned 4e\+19 \(larger than 4611686018427387904\)"),  # ranks exchange sizes as int64
        (2**62 + 1, r"\(larger than 4611686018427387904\)"),
    ],
)
def test_invalid_values_raise_with_the_rule_and_the_fix(value, problem):
    with pytest.raises(InvalidDecisionError, match=problem) as info:
        validate_decision(value, current=32, source="MyController")
    message = str(info.value)
    assert message.startswith("MyController returned ")
    assert re.search(FIX, message)


def test_invalid_decision_error_is_a_value_error():
    assert issubclass(InvalidDecisionError, ValueError)
    with pytest.raises(ValueError, match="controller returned 0"):
        validate_decision(0, current=8)  # default source name


@pytest.mark.parametrize(
    "value, note",
    [
        (0, "invalid value 0 (not positive); kept 32"),
        (-7, "invalid value -7 (not positive); kept 32"),
        (math.nan, "invalid value nan (not finite); kept 32"),
        (True, "invalid value True (a bool); kept 32"),
        ("big", "invalid value 'big' (of type str); kept 32"),
        (3.5, "invalid value 3.5 (not a whole number); kept 32"),
    ],
)
def test_keep_keeps_the_current_size_and_notes_it(value, note, caplog):
    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        size, got_note = validate_decision(value, current=32, on_invalid="keep", source="Sched")
    assert (size, got_note) == (32, note)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("Sched returned" in m and "keeping batch size 32" in m.lower() for m in messages), messages


@pytest.mark.parametrize(
    "value, expected",
    [
        (3, (8, "clamped 3 up to min_size=8")),
        (1000, (512, "clamped 1000 down to max_size=512")),
        (8, (8, None)),  # on a bound: used as is, no note
        (512, (512, None)),
        (100, (100, None)),
        (100.0, (100, None)),  # a whole float is accepted and made an int
    ],
)
def test_clamping_to_bounds_is_noted(value, expected):
    size, note = validate_decision(value, current=32, min_size=8, max_size=512)
    assert (size, note) == expected
    assert type(size) is int


def test_invalid_value_is_not_clamped_but_rejected():
    with pytest.raises(InvalidDecisionError, match=r"returned 0 \(not positive\)"):
        validate_decision(0, current=32, min_size=8, max_size=512)


@pytest.mark.parametrize(
    "value", [np.int64(64), np.int32(64), np.uint16(64), np.int8(64), np.float64(64.0), np.array(64)[()]]
)
def test_numpy_scalars_are_accepted_as_plain_ints(value):
    size, note = validate_decision(value, current=32)
    assert (size, note) == (64, None)
    assert type(size) is int


def test_numpy_ints_are_clamped_too():
    assert validate_decision(np.int64(4096), current=32, max_size=1024) == (
        1024,
        "clamped 4096 down to max_size=1024",
    )


@given(
    value=st.integers(1, 10**6),
    lo=st.integers(1, 1000),
    span=st.integers(0, 10**5),
)
def test_every_positive_int_is_used_or_clamped(value, lo, span):
    hi = lo + span
    size, note = validate_decision(value, current=lo, min_size=lo, max_size=hi)
    assert size == min(max(value, lo), hi)
    assert (note is None) == (lo <= value <= hi)


def test_schedule_output_goes_through_the_boundary():
    """A Schedule returns whatever its function returns; the boundary is what catches nonsense."""
    shrink = Schedule(lambda step, size: size - 8, name="shrink")
    obs = Observation(step=3, samples_seen=96, epoch=0, coverage=0.1, batch_size=8)
    with pytest.raises(InvalidDecisionError, match=r"^shrink returned 0 \(not positive\)"):
        validate_decision(shrink.decide(obs), current=obs.batch_size, source=shrink.name)
    grow = Schedule(functools.partial(linear_increase_scheduler, interval=1, max_size=10_000, increment=500))
    size, note = validate_decision(grow.decide(obs), current=8, max_size=256, source=grow.name)
    assert (size, note) == (256, "clamped 508 down to max_size=256")


def test_validate_decision_refuses_impossible_arguments():
    with pytest.raises(ValueError, match="min_size=100 is larger than max_size=50: impossible bounds"):
        validate_decision(70, current=64, min_size=100, max_size=50)
    # A bound is a batch size too: 0, negatives, NaN and fractions would make a "decision" below 1.
    for bounds, error, match in [({"max_size": 0}, ValueError, "max_size must be >= 1, got 0"),
                                 ({"max_size": -5}, ValueError, "max_size must be >= 1, got -5"),
                                 ({"max_size": math.nan}, ValueError, "max_size must be an int >= 1, got NaN"),
                                 ({"min_size": 2.5}, TypeError, "min_size must be an int >= 1, got 2.5")]:
        with pytest.raises(error, match=match):
            validate_decision(64, current=32, **bounds)
    with pytest.raises(ValueError, match="on_invalid must be 'raise' or 'keep'; got 'raises'"):
        validate_decision(0, current=64, on_invalid="raises")
