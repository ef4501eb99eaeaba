"""Gradient noise scale: hand-derived estimates, exact unbiasedness by enumeration, EMA arithmetic,
the biased flag, input checks and the state round trip."""

from __future__ import annotations

import itertools

import pytest
import torch
from harness import assert_state_roundtrip

from batchpilot.stats import NoiseScaleEstimator, small_big_from_micro, two_batch_estimates

# Hand-derived example: |G|^2 = 1, tr(Sigma) = 8 give E|G_2|^2 = 1 + 8/2 = 5 and E|G_8|^2 = 1 + 8/8 = 2.
B_SMALL, S_SMALL, B_BIG, S_BIG = 2, 5.0, 8, 2.0


def test_two_batch_estimates_hand_derived():
    # |G|^2 = (8*2 - 2*5) / (8 - 2) = 1;  tr = (5 - 2) / (1/2 - 1/8) = 8.
    assert two_batch_estimates(B_SMALL, S_SMALL, B_BIG, S_BIG) == pytest.approx((1.0, 8.0), rel=1e-15)


@pytest.mark.parametrize(
    "which, d_grad_sq, d_trace",
    [
        # d|G|^2/ds_small = -b_small/(b_big-b_small) = -1/3; dtr/ds_small = 1/(1/2-1/8) = 8/3
        ("small", -1 / 3, 8 / 3),
        # d|G|^2/ds_big = b_big/(b_big-b_small) = 4/3;  dtr/ds_big = -8/3
        ("big", 4 / 3, -8 / 3),
    ],
)
def test_two_batch_estimates_sensitivity(which, d_grad_sq, d_trace):
    eps = 1e-3
    s_small, s_big = (S_SMALL + eps, S_BIG) if which == "small" else (S_SMALL, S_BIG + eps)
    g, t = two_batch_estimates(B_SMALL, s_small, B_BIG, s_big)
    assert (g - 1.0) / eps == pytest.approx(d_grad_sq, rel=1e-9)
    assert (t - 8.0) / eps == pytest.approx(d_trace, rel=1e-9)


def test_unbiased_by_exhaustive_enumeration():
    # Per-sample gradients drawn uniformly with replacement from a finite population: E over all draws
    # of each estimate must equal the population's |mu|^2 and tr(Sigma) exactly. Micro-batch sizes 1 and
    # 2 are unequal, so this also pins b_small to the harmonic mean (4/3), not the arithmetic one.
    pop = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]], dtype=torch.float64)
    mu = pop.mean(0)
    true_g, true_t = float(mu @ mu), float(((pop - mu) ** 2).sum(1).mean())
    gs, ts = [], []
    for a, b, c in itertools.product(range(3), repeat=3):
        micro = [pop[a], (pop[b] + pop[c]) / 2]  # sizes 1 and 2
        big = (pop[a] + pop[b] + pop[c]) / 3
        args = small_big_from_micro([float(g @ g) for g in micro], [1, 2], float(big @ big))
        assert args[0] == pytest.approx(4 / 3) and args[2] == 3.0
        g, t = two_batch_estimates(*args)
        gs.append(g)
        ts.append(t)
    assert sum(gs) / len(gs) == pytest.approx(true_g, rel=1e-12)
    assert sum(ts) / len(ts) == pytest.approx(true_t, rel=1e-12)


def test_without_replacement_the_population_correction_makes_it_unbiased():
    # A sampler that draws without replacement (one permutation per epoch) from N samples: every ordered
    # draw of 3 distinct samples out of 4, split into micro-batches of 1 and 2. E|G_b|^2 = |G|^2 +
    # S^2 (1/b - 1/N) with S^2 the N-1-normalised covariance trace, so the plain estimate's |G|^2 reads
    # low by S^2 / N and population=N removes exactly that; tr(Sigma) is S^2 either way.
    pop = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0], [-1.0, 0.5]], dtype=torch.float64)
    n = len(pop)
    mu = pop.mean(0)
    true_g, s2 = float(mu @ mu), float(((pop - mu) ** 2).sum()) / (n - 1)
    plain, corrected = [], []
    for a, b, c in itertools.permutations(range(n), 3):
        micro = [pop[a], (pop[b] + pop[c]) / 2]
        big = (pop[a] + pop[b] + pop[c]) / 3
        args = small_big_from_micro([float(g @ g) for g in micro], [1, 2], float(big @ big))
        plain.append(two_batch_estimates(*args))
        corrected.append(two_batch_estimates(*args, population=n))
    mean = lambda xs, i: sum(x[i] for x in xs) / len(xs)  # noqa: E731
    assert mean(corrected, 0) == pytest.approx(true_g, rel=1e-12)
    assert mean(corrected, 1) == pytest.approx(s2, rel=1e-12) == mean(plain, 1)
    assert mean(plain, 0) == pytest.approx(true_g - s2 / n, rel=1e-12)
    # A whole-dataset step is the true gradient: |G|^2 comes out exact from any single draw.
    g, _ = two_batch_estimates(2, 9.0, n, float(mu @ mu), population=n)
    assert g == pytest.approx(true_g, rel=1e-12)
    with pytest.raises(ValueError, match="b_big=8.0 is larger than population=4.0"):
        two_batch_estimates(2, 5.0, 8, 2.0, population=4)
    with pytest.raises(ValueError, match="population must be a finite number of samples > 0, got 0"):
        two_batch_estimates(2, 5.0, 8, 2.0, population=0)


def test_small_big_from_micro_hand_derived_and_ghosts():
    # sizes 2, 4, 4 (and a ghost of size 0, ignored): b_small = 3 / (1/2 + 1/4 + 1/4) = 3, b_big = 10.
    out = small_big_from_micro([6.0, 3.0, 0.0, 3.0], [2, 4, 0, 4], 1.5)
    assert out == (3.0, 4.0, 10.0, 1.5)


@pytest.mark.parametrize(
    "norms, sizes, big, match",
    [
        ([1.0], [4], 1.0, "at least two"),
        ([1.0, 2.0], [4, 0], 1.0, "at least two"),
        ([1.0, 2.0], [4], 1.0, "one size per"),
        ([1.0, -2.0], [4, 4], 1.0, "squared norm"),
        ([1.0, 2.0], [4, 4.0], 1.0, "int"),
        ([1.0, 2.0], [4, 4], float("nan"), "sq_norm_big"),
    ],
)
def test_small_big_from_micro_rejects(norms, sizes, big, match):
    with pytest.raises(ValueError, match=match):
        small_big_from_micro(norms, sizes, big)


def test_ema_of_numerator_and_denominator_separately():
    est = NoiseScaleEstimator(ema_decay=0.5)
    assert (est.count, est.grad_sq_norm, est.trace_cov, est.b_simple) == (0, None, None, None)
    assert est.metrics() == {}
    est.update(B_SMALL, S_SMALL, B_BIG, S_BIG)  # (|G|^2, tr) = (1, 8): corrected EMAs are exactly these
    assert (est.grad_sq_norm, est.trace_cov, est.b_simple) == pytest.approx((1.0, 8.0, 8.0), rel=1e-15)
    est.update(2, 3 + 4 / 2, 8, 3 + 4 / 8)  # (|G|^2, tr) = (3, 4)
    # EMAs 0.5*0.5 + 0.5*3 = 1.75 and 0.5*4 + 0.5*4 = 4, corrected by 1 - 0.5^2 = 0.75.
    assert est.count == 2
    assert est.grad_sq_norm == pytest.approx(1.75 / 0.75, rel=1e-14)
    assert est.trace_cov == pytest.approx(4 / 0.75, rel=1e-14)
    # Ratio of the EMAs: 16/7, not the EMA of the ratios (0.25*8 + 0.5*4/3) / 0.75 = 32/9.
    assert est.b_simple == pytest.approx(16 / 7, rel=1e-14)
    assert est.metrics() == pytest.approx({
        "stats/noise_scale": 16 / 7, "stats/grad_sq_norm": 1.75 / 0.75, "stats/trace_cov": 4 / 0.75,
        "stats/noise_scale_biased": 0.0,
    })


def test_ema_decay_zero_keeps_last():
    est = NoiseScaleEstimator(ema_decay=0.0)
    est.update(B_SMALL, S_SMALL, B_BIG, S_BIG)
    est.update(2, 5.0, 8, 3.5)  # (|G|^2, tr) = (3, 4)
    assert (est.grad_sq_norm, est.trace_cov) == pytest.approx((3.0, 4.0), rel=1e-15)


def test_b_simple_edge_cases():
    est = NoiseScaleEstimator(ema_decay=0.0)
    est.update(2, 1.0, 8, 4.0)  # |G|^2 = (32 - 2)/6 = 5, tr = -3/(3/8) = -8 < 0: no measurable noise
    assert est.b_simple == 0.0
    est.update(2, 5.0, 8, 0.5)  # |G|^2 = (4 - 10)/6 = -1 <= 0: no signal yet
    assert est.b_simple is None
    assert "stats/noise_scale" not in est.metrics() and "stats/grad_sq_norm" in est.metrics()


def test_biased_flag_decays_with_the_ema():
    est = NoiseScaleEstimator(ema_decay=0.5)
    est.update(B_SMALL, S_SMALL, B_BIG, S_BIG, biased=True)
    assert est.biased and est.biased_fraction == 1.0
    # After n unbiased updates the share of biased weight is 0.5^(n+1) / (1 - 0.5^(n+1)).
    for n in range(1, 7):
        est.update(B_SMALL, S_SMALL, B_BIG, S_BIG)
        assert est.biased_fraction == pytest.approx(0.5 ** (n + 1) / (1 - 0.5 ** (n + 1)), rel=1e-12)
        assert est.biased == (n <= 5)  # 0.0159 at n=5 > 1% >= 0.0079 at n=6
    assert est.metrics()["stats/noise_scale_biased"] == 0.0


@pytest.mark.parametrize("decay", [1.0, -0.1, 1.5, True, "0.9", float("nan")])
def test_rejects_bad_decay(decay):
    with pytest.raises(ValueError, match="ema_decay"):
        NoiseScaleEstimator(ema_decay=decay)


@pytest.mark.parametrize(
    "args, match",
    [
        ((8, 1.0, 8, 1.0), "larger than"),
        ((8, 1.0, 2, 1.0), "larger than"),
        ((0, 1.0, 2, 1.0), "b_small"),
        ((2, 1.0, float("inf"), 1.0), "b_big"),
        ((2, -1.0, 8, 1.0), "sq_norm_small"),
        ((2, 1.0, 8, float("nan")), "sq_norm_big"),
    ],
)
def test_update_rejects_and_leaves_state(args, match):
    est = NoiseScaleEstimator()
    est.update(B_SMALL, S_SMALL, B_BIG, S_BIG)
    before = est.state_dict()
    with pytest.raises(ValueError, match=match):
        est.update(*args)
    assert est.state_dict() == before


def _inputs(step: int) -> tuple[tuple[float, float, float, float], bool]:
    # Deterministic, varied inputs: sizes change, some updates are flagged biased.
    b_small = 2 + step % 3
    g, t = 1.0 + 0.1 * (step % 5), 8.0 + step % 7
    b_big = 4 * b_small
    return (b_small, g + t / b_small, b_big, g + t / b_big), step % 4 == 0


def test_state_roundtrip():
    def advance(est, step):
        args, biased = _inputs(step)
        est.update(*args, biased=biased)

    def observe(est, step):
        out = []
        for s in range(step, step + 6):
            advance(est, s)
            out.append((est.count, est.metrics(), est.biased_fraction))
        return out

    assert_state_roundtrip(lambda: NoiseScaleEstimator(0.9), advance, observe, steps=(0, 1, 5, 13), advance_before_load=3)


def test_load_rejects_bad_state():
    state = NoiseScaleEstimator().state_dict()
    with pytest.raises(ValueError, match="invalid NoiseScaleEstimator state"):
        NoiseScaleEstimator().load_state_dict({**state, "ema_decay": 1.0})
