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


def test_the_two_noise_scales_agree_where_the_hessian_is_a_multiple_of_the_identity(bench):
    # loss_i = c/2 |w - t_i|^2: H = c I exactly, so G'HG = c |G|^2 and tr(H Sigma) = c tr(Sigma) in every
    # estimate, and B_noise = B_simple; with the targets' spread known, B_simple = tr(Sigma) / |G|^2 too.
    class Point(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([3.0, -1.0], dtype=torch.float64))

        def forward(self, targets):
            return self.w - targets

    def loss_fn(diff, _):
        return 2.5 * (diff**2).sum(dim=1).mean()  # c = 5

    gen = torch.Generator().manual_seed(0)
    targets = torch.randn(4096, 2, generator=gen, dtype=torch.float64)
    batches = [(targets[i : i + 1024], None) for i in range(0, 4096, 1024)]
    simple, noise = bench.noise_scales(Point(), loss_fn, [(x, torch.zeros(len(x))) for x, _ in batches])
    assert noise == pytest.approx(simple, rel=1e-9)
    # per-sample gradient 5 (w - t_i): tr(Sigma) = 25 x 2 (unit variance per coordinate), |G|^2 = 25 |w|^2 = 250
    assert simple == pytest.approx(50 / 250, rel=0.25)
    with pytest.raises(ValueError, match="multiple of it"):
        bench.noise_scales(Point(), loss_fn, [(targets[:100], torch.zeros(100))])


def test_noise_mode_records_both_noise_scales(bench, tmp_path):
    result = bench.main(["--mode", "noise", "--workload", "digits", "--batch", "64", "--lr", "0.02", "--seeds", "0",
                         "--epochs", "0.3", "--every", "0.25", "--probe-samples", "128", "--threads", "1",
                         "--out", str(tmp_path)])
    checks = result["runs"][0]["checks"]
    assert [c["epoch"] for c in checks] == [0.0, pytest.approx(0.25, abs=0.01)]
    assert all(set(c) == {"epoch", "b_simple", "b_noise"} for c in checks)
