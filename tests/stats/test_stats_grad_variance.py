"""Per-sample gradient variance: torch.func against a brute-force loop (float64, MLP and CNN), the cases
torch.func cannot do, and the micro-batch estimate (hand-derived, exact limits, exact unbiasedness)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from batchpilot.stats import (
    PerSampleGradError,
    micro_batch_grad_variance,
    per_sample_grad_variance,
    small_big_from_micro,
    two_batch_estimates,
)

ce = nn.functional.cross_entropy


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(2, 4, kernel_size=3, padding=1), nn.ReLU(), nn.Conv1d(4, 4, kernel_size=3, stride=2),
        nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4, 3),
    ).double()


def data(shape: tuple[int, ...], n: int = 10):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, *shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def brute_force_grads(model: nn.Module, x, y, loss_fn=ce) -> torch.Tensor:
    """(n, P): one backward per sample, over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(y)):
        grads = torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def seed_002_sigma2(grads: torch.Tensor) -> float:
    return float(((grads - grads.mean(0)) ** 2).sum(1).mean())  # (1/n) sum_i |g_i - g_mean|^2


@pytest.mark.parametrize("make, shape", [(mlp, (6,)), (small_cnn, (2, 9))], ids=["mlp", "cnn"])
@pytest.mark.parametrize("chunk_size", [None, 3, 1])
def test_matches_brute_force_loop(make, shape, chunk_size):
    model = make()
    x, y = data(shape)
    expected = seed_002_sigma2(brute_force_grads(model, x, y))
    got = per_sample_grad_variance(model, ce, x, y, chunk_size=chunk_size)
    assert got == pytest.approx(expected, rel=1e-9)  # float64: agrees to rounding, far inside 1e-6
    assert got != pytest.approx(expected * (1 + 1e-6), rel=1e-9)  # the tolerance can see a 1e-6 slip
    assert all(p.grad is None for p in model.parameters())  # the model's .grad was not touched


def test_only_trainable_parameters_and_tuple_inputs():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(2, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, u, v):
            return self.head(torch.tanh(self.a(u) + self.b(v)))

    torch.manual_seed(0)
    model = TwoInputs().double()
    model.a.requires_grad_(False)  # frozen: not part of g_i
    g = torch.Generator().manual_seed(2)
    u, v = torch.randn(7, 3, generator=g, dtype=torch.float64), torch.randn(7, 2, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (7,), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [torch.cat([t.reshape(-1) for t in torch.autograd.grad(ce(model(u[i:i + 1], v[i:i + 1]), y[i:i + 1]), params)])
            for i in range(7)]
    assert per_sample_grad_variance(model, ce, (u, v), y) == pytest.approx(seed_002_sigma2(torch.stack(rows)), rel=1e-9)


def test_identical_samples_have_zero_variance():
    model = mlp()
    x, y = data((6,), 1)
    assert per_sample_grad_variance(model, ce, x.repeat(5, 1), y.repeat(5)) == pytest.approx(0.0, abs=1e-20)


def test_batchnorm_train_mode_raises_and_eval_mode_works():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)).double()
    x, y = data((6,))
    with pytest.raises(PerSampleGradError, match="BatchNorm1d.*train mode.*micro_batch_grad_variance"):
        per_sample_grad_variance(model, ce, x, y)
    model.eval()
    expected = seed_002_sigma2(brute_force_grads(model, x, y))
    assert per_sample_grad_variance(model, ce, x, y) == pytest.approx(expected, rel=1e-9)


def test_dropout_needs_randomness_or_says_why():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3)).double()
    x, y = data((6,))
    with pytest.raises(PerSampleGradError, match="torch.func could not compute"):
        per_sample_grad_variance(model, ce, x, y, randomness="error")
    assert per_sample_grad_variance(model, ce, x, y) > 0  # default: a fresh mask per sample


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 1}, "at least 2"),
        ({"targets_n": 4}, "samples along dim 0"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_rejects_bad_input(kwargs, match):
    model = mlp()
    x, y = data((6,), kwargs.get("n", 5))
    if "targets_n" in kwargs:
        y = y[: kwargs["targets_n"]]
    with pytest.raises(ValueError, match=match):
        per_sample_grad_variance(model, ce, x, y, chunk_size=kwargs.get("chunk_size"))


# ------------------------------------------------------------------------------ micro-batch estimate
def test_micro_hand_derived():
    # 1-D gradients 0 (1 sample) and 4 (3 samples): N = 4, mean 3, spread = 1*9 + 3*1 = 12,
    # estimate = (N-1)/(N(k-1)) * 12 = 3/4 * 12 = 9.
    assert micro_batch_grad_variance([torch.tensor([0.0]), torch.tensor([4.0])], [1, 3]) == pytest.approx(9.0)
    # The same from squared norms: sum n_j |g_j|^2 - N |g|^2 = 48 - 36 = 12.
    assert micro_batch_grad_variance([0.0, 16.0], [1, 3], sq_norm_mean=9.0) == pytest.approx(9.0)
    # Ghost micro-batches (size 0) are ignored.
    assert micro_batch_grad_variance([0.0, 123.0, 16.0], [1, 0, 3], sq_norm_mean=9.0) == pytest.approx(9.0)


def test_micro_of_single_samples_is_exact():
    model = mlp()
    x, y = data((6,))
    grads = brute_force_grads(model, x, y)
    exact = seed_002_sigma2(grads)
    assert micro_batch_grad_variance(list(grads), [1] * len(grads)) == pytest.approx(exact, rel=1e-12)
    mean = grads.mean(0)
    sq = [float(g @ g) for g in grads]
    assert micro_batch_grad_variance(sq, [1] * len(grads), float(mean @ mean)) == pytest.approx(exact, rel=1e-9)


def test_micro_is_unbiased_over_all_splits():
    # Averaged over every way to split 6 samples into micro-batches of 2 and 4, the estimate equals the
    # exact sigma_t^2 (finite-population correction (N-1)/N included).
    model = mlp()
    x, y = data((6,), 6)
    grads = brute_force_grads(model, x, y)
    estimates = []
    for first in itertools.combinations(range(6), 2):
        rest = [i for i in range(6) if i not in first]
        parts = [list(first), rest]
        estimates.append(micro_batch_grad_variance([grads[p].mean(0) for p in parts], [2, 4]))
    assert sum(estimates) / len(estimates) == pytest.approx(seed_002_sigma2(grads), rel=1e-12)


def test_micro_agrees_with_the_noise_scale_trace():
    # Equal sizes: the population form (without (N-1)/N) equals the two-batch tr(Sigma) estimate.
    g = torch.Generator().manual_seed(3)
    micro = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(4)]
    mean = sum(micro) / 4
    _, trace = two_batch_estimates(*small_big_from_micro([float(m @ m) for m in micro], [8] * 4, float(mean @ mean)))
    n = 32
    assert micro_batch_grad_variance(micro, [8] * 4) * n / (n - 1) == pytest.approx(trace, rel=1e-12)


@pytest.mark.parametrize(
    "micro, sizes, sq_mean, match",
    [
        ([1.0], [3], 1.0, "at least two"),
        ([1.0, 2.0], [3], 1.0, "one size per"),
        ([1.0, 2.0], [3, 3], None, "sq_norm_mean"),
        ([torch.ones(2), torch.ones(2)], [3, 3], 1.0, "only used with squared norms"),
        ([1.0, 2.0], [3, -1], 1.0, "int >= 0"),
    ],
)
def test_micro_rejects(micro, sizes, sq_mean, match):
    with pytest.raises(ValueError, match=match):
        micro_batch_grad_variance(micro, sizes, sq_mean)


def test_a_value_error_inside_torch_func_names_the_fallback_too():
    class CallsBatchNorm(torch.nn.Module):  # functional batch_norm in training mode: one sample per channel fails
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.nn.functional.batch_norm(self.lin(x), None, None, training=True)

    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with pytest.raises(PerSampleGradError, match="micro_batch_grad_variance"):
        per_sample_grad_variance(CallsBatchNorm(), torch.nn.functional.cross_entropy, x, y)


@pytest.mark.parametrize("bad", [float("nan"), -5.0, float("inf")])
def test_micro_batch_squared_norms_must_be_finite_and_non_negative(bad):
    with pytest.raises(ValueError, match=r"micro\[0\] must be a finite squared norm >= 0"):
        micro_batch_grad_variance([bad, 1.0], [4, 4], 0.5)
