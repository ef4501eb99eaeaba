"""The LR range test: find the largest useful learning rate in a few dozen steps, then undo them.

Smith 2017, "Cyclical Learning Rates for Training Neural Networks" (WACV, section 3.3): train for a short
while with the LR growing exponentially from ``lr_min`` to ``lr_max`` and watch the loss; it falls fastest
somewhat below the LR at which training turns unstable. The model, the optimizer (its state and LRs) and
torch's random number generators are restored afterwards, so the test leaves no trace but its result.

Paired with ``lr_rule="adascale"`` and a large ``base_batch_size``, the suggestion is the top of McCandlish
et al.'s optimal-LR curve ``lr_max / (1 + B_noise / B)`` (see docs/lr.md).
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._plotting import figures, finish

__all__ = ["LRRangeTest", "diverged", "loss_fell", "lr_range_test", "min_loss_lr", "smoothed_losses", "steepest_lr",
           "valley_bounds", "valley_lr"]


@dataclass(frozen=True)
class LRRangeTest:
    """What :func:`lr_range_test` measured.

    Attributes:
        lrs: The LR of every step that ran.
        losses: Each step's loss (before its update).
        smoothed: The bias-corrected exponential moving average of ``losses``.
        suggestion: The LR at which the smoothed loss fell fastest per unit of ``log(lr)``, looking only up to
            its minimum and past the moving average's start-up (its first ``1 / (1 - smoothing)`` points, 10 by
            default, where it follows the noise of single batches); ``None`` when it never fell.
        best_lr: The LR at the smoothed loss's minimum (training turns unstable not far above it).
        stopped_early: The loss diverged (non-finite, or ``diverge`` x its minimum) before ``lr_max``.
        seconds: Wall time of the test.
    """

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggestion: float | None
    best_lr: float
    stopped_early: bool
    seconds: float

    def plot(self, path: str | Path) -> Path:
        """Save the smoothed loss against the LR (log axis), with the suggestion marked; needs matplotlib."""
        fig, ax = figures().subplots(figsize=(6, 3.6))
        ax.plot(self.lrs, self.losses, color="#bbbbbb", lw=0.8, label="loss")
        ax.plot(self.lrs, self.smoothed, color="#08519c", label="smoothed")
        if self.suggestion is not None:
            ax.axvline(self.suggestion, color="#e6550d", ls="--", label=f"suggestion {self.suggestion:.3g}")
        ax.set_xscale("log")
        out = Path(path)
        finish(fig, ax, out, "learning rate", "training loss", "LR range test", legend_size=10, grid="major")
        return out


def _check_lr(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not (math.isfinite(value) and float(value) > 0):
        raise ValueError(f"{name} must be a finite real > 0, got {value!r}.")
    return float(value)


def lr_range_test(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    lr_min: float = 1e-5,
    lr_max: float = 10.0,
    steps: int = 100,
    smoothing: float = 0.9,
    diverge: float = 4.0,
) -> LRRangeTest:
    """Run the LR range test (Smith 2017) and restore the model, the optimizer and the RNGs.

    Step ``i`` of ``steps`` trains one batch at ``lr_min * (lr_max / lr_min) ** (i / (steps - 1))`` (every
    param group). The test stops early when the loss is not finite or the smoothed loss exceeds ``diverge``
    times its minimum (rises above it by ``diverge - 1`` times its magnitude, for losses of any sign).

    Args:
        model: The model to probe (its weights are restored afterwards).
        optimizer: Its optimizer (state and LRs restored afterwards).
        batches: At least ``steps`` batches, e.g. a DataLoader at the batch size you want the LR for.
        loss_fn: ``loss_fn(model, batch) -> scalar loss tensor``.
        lr_min, lr_max: The LR range, ``0 < lr_min < lr_max``.
        steps: Steps in the sweep (>= 5).
        smoothing: EMA factor of the smoothed loss, in ``[0, 1)``.
        diverge: Stop once the smoothed loss exceeds this multiple of its minimum (> 1; see above).

    Raises:
        ValueError: a bound, ``steps``, ``smoothing`` or ``diverge`` is out of range; ``batches`` ran out
            before ``steps`` steps; ``loss_fn`` returned something other than a scalar tensor; the first loss
            is not finite (nothing to compare with).
    """
    lo, hi = _check_lr(lr_min, "lr_min"), _check_lr(lr_max, "lr_max")
    if lo >= hi:
        raise ValueError(f"lr_min={lr_min!r} must be smaller than lr_max={lr_max!r}; e.g. lr_min=1e-5, lr_max=10.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 5:
        raise ValueError(f"steps must be an int >= 5, got {steps!r}; 100 is typical.")
    if isinstance(smoothing, bool) or not isinstance(smoothing, numbers.Real) or not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be a real in [0, 1), got {smoothing!r}.")
    if isinstance(diverge, bool) or not isinstance(diverge, numbers.Real) or not diverge > 1:
        raise ValueError(f"diverge must be a real > 1, got {diverge!r}.")

    model_state = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    modes = [(module, module.training) for module in model.modules()]
    started = time.perf_counter()
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    stopped_early = False
    with torch.random.fork_rng():  # torch's CPU and CUDA generators are restored on the way out
        try:
            if not model.training:
                model.train()  # in train mode already: submodules the user put in eval (frozen BN) stay so
            iterator = iter(batches)
            average = 0.0
            for i in range(steps):
                try:
                    batch = next(iterator)
                except StopIteration:
                    raise ValueError(
                        f"batches ran out after {i} of steps={steps} steps; pass at least {steps} batches "
                        "(e.g. a DataLoader with enough samples, or fewer steps)."
                    ) from None
                lr = lo * (hi / lo) ** (i / (steps - 1))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.zero_grad()
                loss = loss_fn(model, batch)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ValueError(
                        f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                        f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; reduce it with .mean()."
                    )
                value = float(loss.detach())
                if not math.isfinite(value):
                    if i == 0:
                        raise ValueError(f"the first loss is {value}; check the model and loss_fn before the test.")
                    stopped_early = True
                    break
                lrs.append(lr)
                losses.append(value)
                average = smoothing * average + (1 - smoothing) * value
                smoothed.append(average / (1 - smoothing ** (i + 1)))
                if diverged(smoothed, diverge):
                    stopped_early = True
                    break
                loss.backward()
                optimizer.step()
        finally:
            model.load_state_dict(model_state)
            optimizer.load_state_dict(optimizer_state)
            optimizer.zero_grad(set_to_none=True)  # the last sweep step's gradient must not reach training
            for param in model.parameters():  # nor the sweep's summed gradients of parameters the optimizer lacks
                param.grad = None
            for module, training in modes:
                module.train(training)
    return LRRangeTest(lrs, losses, smoothed, steepest_lr(lrs, smoothed, smoothing), min_loss_lr(lrs, smoothed),
                       stopped_early, time.perf_counter() - started)


def smoothed_losses(losses: Sequence[float], smoothing: float = 0.9) -> list[float]:
    """The bias-corrected exponential moving average of ``losses`` (Smith 2017's smoothed loss)."""
    average, out = 0.0, []
    for i, value in enumerate(losses):
        average = smoothing * average + (1 - smoothing) * value
        out.append(average / (1 - smoothing ** (i + 1)))
    return out


def diverged(smoothed: Sequence[float], diverge: float = 4.0) -> bool:
    """Whether the last smoothed loss rose above the lowest by ``diverge - 1`` times the lowest's magnitude
    (the range test's stop rule, for losses of any sign)."""
    lowest = min(smoothed)
    return smoothed[-1] - lowest > (diverge - 1) * abs(lowest)


def min_loss_lr(lrs: Sequence[float], smoothed: Sequence[float]) -> float:
    """The LR at the smoothed loss's minimum (training turns unstable not far above it)."""
    if not smoothed or len(lrs) != len(smoothed):
        raise ValueError(f"min_loss_lr() needs one smoothed loss per LR, got {len(lrs)} LRs and {len(smoothed)} "
                         "losses.")
    return lrs[min(range(len(smoothed)), key=smoothed.__getitem__)]


def loss_fell(losses: Sequence[float], smoothed: Sequence[float], smoothing: float = 0.9,
              sigmas: float = 3.0) -> bool:
    """Whether the smoothed loss fell by more than its own noise before its minimum (after the average's start-up,
    its first ``1 / (1 - smoothing)`` points): by ``sigmas`` standard deviations of the moving average, ``sqrt((1 - smoothing) / (1 + smoothing))`` times the spread of the single
    losses around it. Where it did not (a loss that barely moves in the test's few steps, as a transformer's
    with Adam on seqsum can), the test says nothing about the LR and its minimum is noise."""
    best = min(range(len(smoothed)), key=smoothed.__getitem__)
    window = round(1 / (1 - smoothing))  # the moving average's start-up: its first points are single losses
    if best <= window:
        return False
    residuals = [x - m for x, m in zip(losses[: best + 1], smoothed[: best + 1])]
    mean = sum(residuals) / len(residuals)
    spread = math.sqrt(sum((r - mean) ** 2 for r in residuals) / (len(residuals) - 1))
    noise = spread * math.sqrt((1 - smoothing) / (1 + smoothing))
    return max(smoothed[window : best + 1]) - smoothed[best] > sigmas * noise


def valley_lr(lrs: Sequence[float], smoothed: Sequence[float], depth: float = 0.5) -> float:
    """The geometric centre of the loss valley: the contiguous LRs around the smoothed loss's minimum whose loss
    lies within ``depth`` of the way from the minimum up to the highest loss before it.

    A steadier reading than the minimum itself (:func:`min_loss_lr`) where the valley is flat: with Adam on
    seqsum (100 steps at batch 128, seeds 0-4) the minimum fell anywhere in 7e-5..0.06, the valley's centre in
    6e-4..5e-3; with SGD on mnist1d and digits the two agree within 20% (docs/auto.md)."""
    low, high = valley_bounds(lrs, smoothed, depth)
    return math.sqrt(low * high)


def valley_bounds(lrs: Sequence[float], smoothed: Sequence[float], depth: float = 0.5) -> tuple[float, float]:
    """The lowest and the highest LR of the loss valley :func:`valley_lr` takes the centre of.

    Their ratio says how much the test can tell: with SGD on mnist1d and digits the valley spans 1.5-3.5x; with
    Adam (100 steps) 200-350x on the byte-level GPT and 40x to 1e5x on six of seven seqsum seeds, a loss that the
    short test cannot tell apart over decades of LR (docs/auto.md)."""
    if not 0 < depth <= 1:
        raise ValueError(f"depth must lie in (0, 1], got {depth!r}.")
    best = min(range(len(smoothed)), key=smoothed.__getitem__)
    level = smoothed[best] + depth * (max(smoothed[: best + 1]) - smoothed[best])
    low = high = best
    while low > 0 and smoothed[low - 1] <= level:
        low -= 1
    while high < len(smoothed) - 1 and smoothed[high + 1] <= level:
        high += 1
    return lrs[low], lrs[high]


def steepest_lr(lrs: Sequence[float], smoothed: Sequence[float], smoothing: float = 0.9) -> float | None:
    """The LR at which the smoothed loss fell fastest per unit of ``log(lr)``, up to its minimum and past the
    moving average's start-up (its first ``1 / (1 - smoothing)`` points, where a slope is one batch's noise);
    ``None`` when it never fell. :attr:`LRRangeTest.suggestion`; it scatters from seed to seed and is poor with
    Adam (docs/choosing-a-controller.md)."""
    best = min(range(len(smoothed)), key=smoothed.__getitem__)
    return _steepest(list(lrs), list(smoothed), best, round(1 / (1 - smoothing)))


def _steepest(lrs: list[float], smoothed: list[float], best: int, start: int = 0) -> float | None:
    """The LR of the most negative slope d(smoothed)/d(log lr) among the points from ``start`` (fewer when the
    minimum comes sooner) up to ``best``."""
    if best < 1 or smoothed[0] - smoothed[best] <= 1e-9 * abs(smoothed[0]):  # it never fell (beyond rounding)
        return None
    first = min(start, best - 1)
    slopes = {j: (smoothed[j + 1] - smoothed[j]) / (math.log(lrs[j + 1]) - math.log(lrs[j])) for j in range(first, best)}
    j = min(slopes, key=slopes.__getitem__)
    return lrs[j] if slopes[j] < 0 else None
