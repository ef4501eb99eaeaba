"""AdaScale (Johnson et al. 2020): the gain ratio, LR scaling around a step, progress, state."""

from __future__ import annotations

import math

import pytest
import torch
from harness import assert_state_roundtrip
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.lr import AdaScaleLR, SampleLRSchedule, adascale_gain, warmup_constant

# ----------------------------------------------------------------------------- adascale_gain


@pytest.mark.parametrize(
    "trace_cov, grad_sq_norm, b, b0, expected",
    [
        # sigma^2 = tr(Sigma) / B0 = 1000 / 10 = 100, mu^2 = 1, S = 10: (100 + 1) / (100 / 10 + 1) = 101 / 11.
        (1000.0, 1.0, 100, 10, 101 / 11),
        # Same in noise-scale form: B_simple = 1000: (1000/10 + 1) / (1000/100 + 1) = 101 / 11.
        (4000.0, 4.0, 100, 10, 101 / 11),
        (0.0, 5.0, 640, 32, 1.0),  # no noise: a bigger batch buys nothing, r = 1
        (7.0, 0.0, 640, 32, 20.0),  # pure noise: r = S = 20 (linear scaling)
        (0.0, 0.0, 640, 32, 1.0),  # nothing measured: r = 1
        (-3.0, 2.0, 640, 32, 1.0),  # a negative trace estimate counts as 0
        (3.0, -2.0, 640, 32, 20.0),  # a negative |G|^2 estimate counts as 0
        (1000.0, 1.0, 10, 10, 1.0),  # S = 1
        # S = 0.5 (below the base batch): sigma^2 = 100: 101 / (100 / 0.5 + 1) = 101 / 201.
        (1000.0, 1.0, 5, 10, 101 / 201),
    ],
)
def test_gain_values(trace_cov, grad_sq_norm, b, b0, expected):
    assert adascale_gain(trace_cov, grad_sq_norm, b, b0) == pytest.approx(expected, rel=1e-12)


@given(
    trace_cov=st.floats(0, 1e12),
    grad_sq_norm=st.floats(0, 1e12),
    b0=st.integers(1, 4096),
    k=st.integers(1, 4096),
)
def test_gain_is_between_one_and_the_scale(trace_cov, grad_sq_norm, b0, k):
    r = adascale_gain(trace_cov, grad_sq_norm, b0 * k, b0)
    assert 1.0 <= r <= k


@given(trace_cov=st.floats(1e-6, 1e6), grad_sq_norm=st.floats(1e-6, 1e6), b=st.integers(1, 10_000))
def test_gain_is_monotone_in_the_batch(trace_cov, grad_sq_norm, b):
    assert adascale_gain(trace_cov, grad_sq_norm, b, 16) <= adascale_gain(trace_cov, grad_sq_norm, b + 1, 16)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((math.nan, 1.0, 64, 32), ValueError, "trace_cov must be finite"),
        ((1.0, math.inf, 64, 32), ValueError, "grad_sq_norm must be finite"),
        (("1", 1.0, 64, 32), TypeError, "trace_cov must be a real number"),
        ((1.0, True, 64, 32), TypeError, "grad_sq_norm must be a real number"),
        ((1.0, 1.0, 0, 32), ValueError, "batch_size must be >= 1"),
        ((1.0, 1.0, 64, 32.5), TypeError, "base_batch_size must be an int"),
    ],
)
def test_gain_errors(args, error, match):
    with pytest.raises(error, match=match):
        adascale_gain(*args)


# ----------------------------------------------------------------------------- AdaScaleLR


def sgd(lr: float = 0.1) -> torch.optim.Optimizer:
    model = torch.nn.Linear(2, 1)
    return torch.optim.SGD([{"params": [model.weight], "lr": lr}, {"params": [model.bias], "lr": lr / 10}])


def test_scale_unscale_and_progress():
    opt = sgd(0.1)
    ada = AdaScaleLR(opt, base_batch_size=32)
    assert (ada.progress, ada.progress_samples, ada.steps, ada.gain) == (0.0, 0, 0, 1.0)
    assert ada.scale(2.5) == 2.5
    assert [g["lr"] for g in opt.param_groups] == [0.1 * 2.5, 0.01 * 2.5]
    assert ada.is_scaled
    ada.unscale()
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]  # exactly restored, no x * r / r drift
    ada.scale(1.5)
    ada.unscale()
    # progress = 2.5 + 1.5 = 4 base steps = 4 * 32 = 128 samples at B0.
    assert (ada.progress, ada.progress_samples, ada.steps, ada.gain) == (4.0, 128, 2, 1.5)


def test_scale_and_unscale_must_alternate():
    ada = AdaScaleLR(sgd(), 8)
    with pytest.raises(RuntimeError, match="not scaled; call scale"):
        ada.unscale()
    ada.scale(1.0)
    with pytest.raises(RuntimeError, match="already scaled by 1.0; call unscale"):
        ada.scale(2.0)


@pytest.mark.parametrize("gain", [0.0, -1.0, math.nan, math.inf, "2", True])
def test_scale_rejects_bad_gains(gain):
    with pytest.raises(ValueError, match="gain must be a finite real > 0"):
        AdaScaleLR(None, 8).scale(gain)


def test_gain_for_uses_b0_and_falls_back_to_one():
    ada = AdaScaleLR(None, base_batch_size=10)
    assert ada.gain_for(100, 1000.0, 1.0) == pytest.approx(101 / 11)  # as in test_gain_values
    assert ada.gain_for(100) == 1.0  # not measured yet: no scaling above B0
    assert ada.gain_for(100, math.nan, 1.0) == 1.0
    assert ada.gain_for(4) == 0.4  # below B0 the smallest gain possible, S (the linear rule), not 1
    # The batch size is checked whether or not the statistics are there.
    for bad, error in [(0, ValueError), (-64, ValueError), (True, TypeError), (64.0, TypeError)]:
        with pytest.raises(error, match="batch_size must be"):
            ada.gain_for(bad)


def test_unscale_divides_when_something_else_changed_the_lr():
    opt = sgd(0.1)
    ada = AdaScaleLR(opt, 16)
    ada.scale(4.0)
    opt.param_groups[0]["lr"] = 0.8  # someone else wrote the LR while scaled
    ada.unscale()
    assert opt.param_groups[0]["lr"] == 0.2 and opt.param_groups[1]["lr"] == 0.01


def test_a_b0_schedule_runs_on_progress():
    """Warm-up written for B0 = 10 over 100 samples: with gain 4 per step it is done after 3 steps (120)."""
    opt = sgd(1.0)
    schedule = SampleLRSchedule(opt, warmup_constant(100))
    ada = AdaScaleLR(opt, base_batch_size=10)
    lrs = []
    for _ in range(3):
        ada.scale(ada.gain_for(40, trace_cov=1e9, grad_sq_norm=0.0))  # pure noise: r = S = 4
        lrs.append(opt.param_groups[0]["lr"])
        ada.unscale()
        schedule.step(ada.progress_samples)
    # Multipliers (s + 1) / 100 at s = 0, 40, 80 samples, times the gain 4: 0.04, 1.64, 3.24.
    assert lrs == pytest.approx([4 * 1 / 100, 4 * 41 / 100, 4 * 81 / 100])
    assert opt.param_groups[0]["lr"] == 1.0  # 120 samples at B0: warm-up over


def test_state_round_trip_bookkeeping():
    def make():
        return AdaScaleLR(None, base_batch_size=24)

    def advance(ada, step):
        ada.scale(ada.gain_for(24 * (1 + step % 5), 100.0 + step, 1.0 + step % 3))
        ada.unscale()

    def observe(ada, step):
        out = []
        for s in range(step, step + 20):
            advance(ada, s)
            out.append((ada.gain, ada.progress, ada.progress_samples, ada.steps))
        return out

    assert_state_roundtrip(make, advance, observe, steps=(0, 1, 7), advance_before_load=2)


def test_state_round_trip_while_scaled():
    """Saved between scale() and unscale() (a checkpoint mid-step): the restored LRs come back exactly."""
    def make():
        opt = sgd(0.1)
        return opt, AdaScaleLR(opt, 8)

    def advance(pair, step):
        opt, ada = pair
        if ada.is_scaled:
            ada.unscale()
        ada.scale(1.0 + step / 3)

    def observe(pair, step):
        opt, ada = pair
        out = [[g["lr"] for g in opt.param_groups]]
        for s in range(step, step + 5):
            advance(pair, s)
            out.append([g["lr"] for g in opt.param_groups])
        ada.unscale()
        return out + [[g["lr"] for g in opt.param_groups], ada.progress]

    def get_state(pair):
        opt, ada = pair
        return {"lrs": [g["lr"] for g in opt.param_groups], "ada": ada.state_dict()}

    def set_state(pair, state):
        opt, ada = pair
        for group, lr in zip(opt.param_groups, state["lrs"]):
            group["lr"] = lr  # what loading the optimizer's state dict does
        ada.load_state_dict(state["ada"])

    assert_state_roundtrip(make, advance, observe, steps=(1, 4), get_state=get_state, set_state=set_state)


def test_load_rejects_another_b0():
    with pytest.raises(ValueError, match="saved with base_batch_size=8, but this object has 16"):
        AdaScaleLR(None, 16).load_state_dict(AdaScaleLR(None, 8).state_dict())


def test_constructor_errors():
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        AdaScaleLR(object(), 8)
    with pytest.raises(ValueError, match="base_batch_size must be >= 1, got 0"):
        AdaScaleLR(None, 0)


def test_a_pilot_step_record_holds_the_lr_adascale_used():
    # The record's lr is the LR the optimizer stepped with: under AdaScale the schedule's LR x the gain.
    from torch.utils.data import TensorDataset

    import batchpilot

    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g, dtype=torch.float64)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = iter([16, 16, 32, 32, 32, 32, 32])
    pilot = batchpilot.Pilot(model, optimizer, data, batch_size=8, controller=lambda s, b: next(sizes),
                             lr_rule="adascale", noise_every=1)
    used, records = [], []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    pilot.add_callback(lambda p, r: records.append(r))
    for xb, yb in pilot.batches(max_steps=6):
        pilot.backward(torch.nn.functional.cross_entropy(model(xb), yb))
    assert [r["lr"] for r in records] == used
    assert any(r.get("lr/adascale_gain", 1.0) > 1.0 for r in records)
