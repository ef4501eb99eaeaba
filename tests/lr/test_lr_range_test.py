"""The LR range test on a least-squares problem whose stability limit is known: SGD on the mean of
(x.w - y)^2 / 2 with x ~ N(0, diag(c)) has Hessian diag(c), so it diverges for lr > 2 / max(c)."""

from __future__ import annotations

import pytest
import torch

from batchpilot.lr import lr_range_test

C = torch.tensor([1.0, 0.1, 0.01])  # curvatures: the limit is lr = 2


def problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(3, generator=g, dtype=torch.float64)
    batches = []
    for _ in range(200):
        x = torch.randn(256, 3, generator=g, dtype=torch.float64) * C.double().sqrt()
        batches.append((x, x @ w_star))
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1, bias=False).double()
    return model, batches


def loss_fn(model, batch):
    x, y = batch
    return ((model(x).squeeze(1) - y) ** 2).mean() / 2


def test_suggestion_lies_below_the_stability_limit_and_the_test_stops_past_it():
    model, batches = problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    result = lr_range_test(model, optimizer, batches, loss_fn, lr_min=1e-4, lr_max=100.0, steps=80)
    assert result.stopped_early and result.lrs[-1] < 100.0  # diverged on the way up
    assert 1e-2 < result.suggestion < 2.0  # fastest descent: below the limit 2 / max(c)
    assert result.suggestion <= result.best_lr < 8.0
    assert len(result.lrs) == len(result.losses) == len(result.smoothed) and result.seconds > 0
    assert result.lrs[0] == pytest.approx(1e-4) and all(b > a for a, b in zip(result.lrs, result.lrs[1:]))


def test_the_moving_averages_start_up_is_no_suggestion():
    # The bias-corrected average follows single batches for its first ~10 points (10.13 -> 9.78 -> 9.17 at
    # lr ~1e-5, where nothing is learned), which used to be the "steepest" fall: Adam's suggestion was 1.15e-5.
    torch.manual_seed(0)
    x = torch.randn(4096, 8)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(4096, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    result = lr_range_test(model, optimizer, (b for _ in range(3) for b in loader),
                           lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), steps=100)
    assert result.smoothed[1] < result.smoothed[0]  # the start-up's fall is there ...
    assert 0.01 < result.suggestion < result.best_lr  # ... but not taken (one epoch at 0.115 reaches 0.014)


def test_model_optimizer_and_rng_are_restored():
    model, batches = problem(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn(model, batches[0]).backward()
    optimizer.step()  # a momentum buffer to restore
    weights = [p.detach().clone() for p in model.parameters()]
    buffers = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    model.eval()
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    drawing = lambda m, b: loss_fn(m, b) + 0.0 * torch.rand(1).sum()  # noqa: E731  (the test advances the RNG)
    lr_range_test(model, optimizer, batches, drawing, lr_min=1e-3, lr_max=10.0, steps=30)
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], b) for p, b in zip(model.parameters(), buffers))
    assert optimizer.param_groups[0]["lr"] == 0.05 and not model.training


def test_no_gradient_is_left_on_parameters_the_optimizer_does_not_hold():
    model, batches = problem(1)
    head = list(model.parameters())[-2:]  # the optimizer holds only the last layer; the rest stays trainable
    lr_range_test(model, torch.optim.SGD(head, lr=0.05), batches, loss_fn, lr_min=1e-3, lr_max=1.0, steps=20)
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_that_never_falls_has_no_suggestion():
    model, batches = problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    result = lr_range_test(model, optimizer, batches, lambda m, b: m.weight.sum() * 0 + 1.0, steps=10)
    assert result.suggestion is None and not result.stopped_early


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr_min=1.0, lr_max=0.1), "lr_min=1.0 must be smaller"),
    (dict(lr_min=0.0), "lr_min must be a finite real > 0"),
    (dict(lr_max=float("nan")), "lr_max must be a finite real > 0"),
    (dict(steps=3), "steps must be an int >= 5"),
    (dict(smoothing=1.0), "smoothing must be a real in"),
    (dict(diverge=1.0), "diverge must be a real > 1"),
])
def test_bad_settings_are_named(kwargs, message):
    model, batches = problem()
    with pytest.raises(ValueError, match=message):
        lr_range_test(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, loss_fn, **kwargs)


def test_too_few_batches_and_a_bad_loss_are_refused_and_leave_the_model_alone():
    model, batches = problem()
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="ran out after 4 of steps=20"):
        lr_range_test(model, optimizer, batches[:4], loss_fn, steps=20)
    with pytest.raises(ValueError, match="scalar tensor"):
        lr_range_test(model, optimizer, batches, lambda m, b: m(b[0]), steps=10)
    with pytest.raises(ValueError, match="first loss is nan"):
        lr_range_test(model, optimizer, batches, lambda m, b: loss_fn(m, b) * float("nan"), steps=10)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def test_plot(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    model, batches = problem()
    result = lr_range_test(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, loss_fn, steps=40)
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # stands for a notebook's inline backend, which plotting must leave alone
    try:
        assert result.plot(tmp_path / "lr.png").stat().st_size > 0
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_negative_loss_is_swept_like_a_positive_one():
    # The same problem shifted down by 10: the loss is negative throughout, the sweep must not stop at once.
    model, batches = problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    shifted = lr_range_test(model, optimizer, batches, lambda m, b: loss_fn(m, b) - 10.0, lr_min=1e-4, lr_max=100.0,
                            steps=80)
    assert len(shifted.lrs) > 40 and shifted.suggestion is not None and 1e-2 < shifted.suggestion < 2.0


def test_no_gradient_is_left_and_each_module_keeps_its_mode():
    model, batches = problem()
    net = torch.nn.Sequential(model, torch.nn.Dropout(0.0)).double()
    net.train()
    net[1].eval()  # frozen by hand, as for fine-tuning: the sweep and its end leave it so
    modes = []
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def loss(m, b):
        modes.append(m[1].training)
        return loss_fn(m[0], b)

    lr_range_test(net, optimizer, batches, loss, lr_min=1e-4, lr_max=1.0, steps=10)
    assert not any(modes) and net.training and not net[1].training
    assert all(p.grad is None for p in net.parameters())
