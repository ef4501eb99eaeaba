"""benchmarks/sharpness.py: the power iteration against a closed form, its refusal of Adam, and a run on a tiny
budget (no speed asserted)."""

import json

import pytest
import torch
from _benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sharpness")


def test_power_iteration_finds_the_top_eigenvalue_of_a_least_squares_hessian(bench):
    torch.manual_seed(0)
    x = torch.randn(64, 5) * torch.tensor([3.0, 1.0, 1.0, 0.5, 0.2])
    y = torch.randn(64, 1)
    model = torch.nn.Linear(5, 1, bias=False)
    expected = float(torch.linalg.eigvalsh(2 * x.T @ x / 64).max())  # mean squared error: H = 2 X'X / n
    value, vector = bench.top_eigenvalue(model, torch.nn.functional.mse_loss, x, y, None, iters=200)
    assert value == pytest.approx(expected, rel=1e-4)
    again, _ = bench.top_eigenvalue(model, torch.nn.functional.mse_loss, x, y, vector, iters=1)  # warm start
    assert again == pytest.approx(expected, rel=1e-4)


def test_the_stability_bound_is_refused_for_adam(bench):
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert bench.momentum_of(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == 0.9
    with pytest.raises(SystemExit, match="Adam"):
        bench.momentum_of(torch.optim.Adam(params))


def test_gated_growth_runs_on_a_tiny_budget_and_grows_only_under_the_bound(bench, tmp_path):
    out = tmp_path / "out"
    result = bench.main(["--mode", "gate", "--workload", "digits", "--batch", "64", "--lr", "0.02", "--seeds", "0",
                         "--every", "0.25", "--probe-samples", "64", "--iters", "2", "--max-batch", "256",
                         "--budget-s", "3", "--threads", "1", "--out", str(out)])
    assert json.loads((out / "sharpness.json").read_text())["medians"] == result["medians"]
    static, gated = result["runs"]
    assert (static["variant"], gated["variant"]) == ("static", "gated")
    assert static["checks"] == [] and static["probe_s"] == 0.0
    assert gated["checks"] and gated["probe_s"] > 0
    bound = 2 * (1 + 0.9)
    batch, lr = 64, 0.02
    for check in gated["checks"]:  # each decision follows the rule, from the size and LR of its time
        assert (check["batch"], check["lr"]) == (batch, pytest.approx(lr))
        assert check["lr_x_lambda"] == pytest.approx(lr * check["lambda_max"])
        assert batch < 256 and check["grew"] == (2 * lr * check["lambda_max"] < 0.7 * bound)
        if check["grew"]:
            batch, lr = 2 * batch, 2 * lr
    assert gated["final_batch"] == batch


def test_the_noise_scale_estimators_recover_the_exact_values_of_a_population(bench):
    # Weighted least squares, loss_i = a_i (w.x_i - t_i)^2 / 2: per-sample gradients a_i r_i x_i and per-sample
    # Hessians a_i x_i x_i' that differ. With the whole population as the big batch (cut into 64s in random
    # orders), H is exact and both estimates must converge to tr(Sigma)/|G|^2 and tr(H Sigma)/(G'HG).
    gen = torch.Generator().manual_seed(1)
    n, f64 = 2048, torch.float64
    x = torch.randn(n, 3, generator=gen, dtype=f64) * torch.tensor([3.0, 1.0, 0.3], dtype=f64)  # anisotropic
    a = 0.5 + 2.0 * torch.rand(n, generator=gen, dtype=f64)
    t = x @ torch.tensor([1.0, -2.0, 0.5], dtype=f64) + 0.3 * torch.randn(n, generator=gen, dtype=f64)
    y = torch.stack([t, a], dim=1)
    model = torch.nn.Linear(3, 1, bias=False).to(f64)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.9, -1.0, 0.0]], dtype=f64))

    def loss_fn(out, target):
        return (target[:, 1] * (out[:, 0] - target[:, 0]) ** 2).mean() / 2

    w = model.weight.detach()[0]
    per_sample = (a * (x @ w - t))[:, None] * x
    g = per_sample.mean(0)
    sigma = (per_sample - g).T @ (per_sample - g) / n
    hessian = (a[:, None, None] * x[:, :, None] * x[:, None, :]).mean(0)
    exact_simple = float(torch.trace(sigma) / (g @ g))
    exact_noise = float(torch.trace(hessian @ sigma) / (g @ hessian @ g))
    assert abs(exact_noise / exact_simple - 1) > 0.1  # the two differ here: the test tells them apart

    # One draw, against the two-batch formulas written out with the exact small-batch gradients (the algebra).
    order = torch.randperm(n, generator=gen)
    small = per_sample[order].reshape(n // 64, 64, 3).mean(1)  # the gradients of the 32 small batches
    sq_s, q_s = (small * small).sum(1).mean(), torch.einsum("ki,ij,kj->k", small, hessian, small).mean()
    spread = 1 / 64 - 1 / n
    by_hand = (float((sq_s - g @ g) / spread / ((n * (g @ g) - 64 * sq_s) / (n - 64))),
               float((q_s - g @ hessian @ g) / spread / ((n * (g @ hessian @ g) - 64 * q_s) / (n - 64))))
    assert bench.noise_scales(model, loss_fn, [(x[order], y[order])]) == pytest.approx(by_hand, rel=1e-9)
    # Many draws: both converge to the population values (the sampling spread is ~3% at 200 draws).
    orders = [torch.randperm(n, generator=gen) for _ in range(60)]
    simple, noise = bench.noise_scales(model, loss_fn, [(x[o], y[o]) for o in orders])
    assert simple == pytest.approx(exact_simple, rel=0.12)
    assert noise == pytest.approx(exact_noise, rel=0.12)
    with pytest.raises(ValueError, match="multiple of it"):
        bench.noise_scales(model, loss_fn, [(x[:100], y[:100])])


def test_the_top_eigenvalue_is_found_where_a_negative_one_is_larger(bench):
    # H = diag(1, -5): plain power iteration converges to -5 (the largest in magnitude); lambda_max is 1.
    class Saddle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([0.3, 0.2], dtype=torch.float64))

        def forward(self, x):
            return self.w

    def loss_fn(w, _):
        return 0.5 * (w[0] ** 2 - 5 * w[1] ** 2)

    value, _ = bench.top_eigenvalue(Saddle(), loss_fn, torch.zeros(1), torch.zeros(1), None, iters=50)
    assert value == pytest.approx(1.0, rel=1e-6)


def test_noise_mode_records_both_noise_scales(bench, tmp_path):
    result = bench.main(["--mode", "noise", "--workload", "digits", "--batch", "64", "--lr", "0.02", "--seeds", "0",
                         "--epochs", "0.3", "--every", "0.25", "--probe-samples", "128", "--threads", "1",
                         "--out", str(tmp_path)])
    checks = result["runs"][0]["checks"]
    assert [c["epoch"] for c in checks] == [0.0, pytest.approx(0.25, abs=0.01)]
    assert all(set(c) == {"epoch", "b_simple", "b_noise"} for c in checks)
