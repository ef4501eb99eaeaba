"""The start probes' framework-neutral core: the throughput sweep with the knee rule and the LR range test.

Shared by :class:`~batchpilot.Pilot`'s automatic mode (:mod:`.probes`, whose probe steps run through the user's
own loop) and the integrations' (the Hugging Face trainer and the Lightning callback, which run probe steps
themselves with the framework's loss). Each phase is a generator so that the Pilot can hand its micro-batches to
the user's loop; a runner that computes its steps itself yields nothing, and :func:`drive` runs such a phase to
its result.

A phase needs two things:

- a *context* (:class:`ProbeContext`): the dataset size, the optimizer, agreement of a float over ranks (rank 0's
  value) and a probe log;
- a *runner* (:class:`ProbeRunner`): ``run(size, steps, set_lr, stop)`` runs up to ``steps`` optimizer steps of
  ``size`` samples (calling ``set_lr(i)`` before the ``i``-th update and ``stop(done)`` after each) and returns
  their ``(seconds, mean loss, size)``, or ``None`` when one ran out of memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable
from typing import Any, Protocol

from ..controllers.auto import Auto, pick_knee
from ..lr.range_test import diverged, loss_fell, min_loss_lr, smoothed_losses, valley_bounds

__all__ = ["ProbeContext", "ProbeRunner", "Steps", "drive", "range_test", "set_base_lr", "sweep"]

Steps = list[tuple[float, float, int]]  # (seconds, mean loss, global batch size) of each probe step


class ProbeContext(Protocol):
    """What the probe phases read from the run they probe."""

    num_samples: int
    optimizer: Any

    def agree(self, value: float) -> float:
        """Rank 0's ``value`` on every rank (the value itself on one process)."""

    def log(self, record: dict[str, Any]) -> None:
        """Write a ``{"type": "probe", ...}`` record (or nothing, without a log)."""


class ProbeRunner(Protocol):
    """Runs probe steps (see the module docstring)."""

    count: int
    memory_bound: int | None

    def run(self, size: int, steps: int, set_lr: Callable[[int], None] | None = None,
            stop: Callable[[Steps], bool] | None = None) -> Generator[Any, None, Steps | None]:
        """Up to ``steps`` steps of ``size`` samples: their (seconds, loss, size), or ``None`` on out of memory."""

    def keep_memory_bound(self) -> None:
        """Keep the micro-batch bound a probe step ran into (after a state was restored)."""


def drive(phase: Generator[Any, None, Any]) -> Any:
    """Run a phase whose runner computes its steps itself (yields nothing) and return its result."""
    try:
        item = next(phase)
    except StopIteration as done:
        return done.value
    phase.close()
    raise RuntimeError(f"a probe phase yielded {type(item).__name__}: its runner hands steps to a loop; use it "
                       "from Pilot.batches(), not drive().")


def sweep(ctx: ProbeContext, runner: ProbeRunner, auto: Auto
          ) -> Generator[Any, None, tuple[int, list[tuple[int, float]], str]]:
    """The throughput at doubling sizes: ``(knee, [(size, samples/s), ...], what stopped the sweep)``.

    A size's throughput is read from its fastest timed step: other work on the machine only ever makes a step
    slower. A doubling that falls short of ``min_gain`` is timed again, both sizes, before it ends the sweep, and
    each keeps its faster reading: one burst of load must not end the sweep early (seen on mnist1d: 64 timed at
    half the throughput of 32)."""
    per_epoch = max(ctx.num_samples // auto.min_epoch_steps, 1)  # largest size leaving min_epoch_steps steps
    table: list[tuple[int, float]] = []
    size, bound = auto.min_size, ""
    while not bound:
        rate = yield from _throughput(ctx, runner, auto, size)
        if rate is None:
            bound = "memory"
            break
        table.append((size, rate))
        if pick_knee(table, auto.min_gain)[1]:  # confirm it: time the two sizes again
            for i in (-2, -1):
                again = yield from _throughput(ctx, runner, auto, table[i][0])
                table[i] = (table[i][0], max(table[i][1], again or 0.0))
        if pick_knee(table, auto.min_gain)[1]:
            bound = "knee"
        elif size * 2 > auto.max_size:
            bound = "max_size"
        elif size * 2 > per_epoch:
            bound = "dataset"
        size *= 2
    knee = pick_knee(table, auto.min_gain)[0] if table else auto.min_size
    return knee, table, bound


def _throughput(ctx: ProbeContext, runner: ProbeRunner, auto: Auto, size: int) -> Generator[Any, None, float | None]:
    """Samples/s at ``size`` from its fastest timed step (rank 0's), or ``None`` when it ran out of memory."""
    steps = yield from runner.run(size, auto.warmup_steps + auto.timed_steps)
    if steps is None:
        runner.keep_memory_bound()
        ctx.log({"phase": "throughput", "batch_size": size, "out_of_memory": True,
                 "max_micro_batch_size": runner.memory_bound})
        return None
    timed = steps[auto.warmup_steps:]
    # An epoch's smaller tail step is no sample. A token budget's steps fall short of it by up to a sample, so
    # steps that hold more than half of it count as full.
    full = [s for s in timed if 2 * s[2] > size] or timed
    rate = ctx.agree(max(n / t if t > 0 else math.inf for t, _, n in full))
    ctx.log({"phase": "throughput", "batch_size": size, "samples_per_s": rate,
             "step_s": [t for t, _, _ in timed], "loss": steps[-1][1]})
    return rate


def range_test(ctx: ProbeContext, runner: ProbeRunner, auto: Auto, knee: int
               ) -> Generator[Any, None, tuple[float, float]]:
    """The LR range test (Smith 2017) at ``knee``: ``(the run's LR, the LR at the smoothed loss's minimum)``.

    The run's LR is ``lr_fraction`` x the centre of the loss valley, or the optimizer's own LR when the loss did
    not fall beyond its noise or the valley spans more than ``max_valley_span`` (then the test says nothing
    about the LR)."""
    groups = ctx.optimizer.param_groups
    base = [float(g["lr"]) for g in groups]
    ref = base[0]
    if not ref > 0:
        raise ValueError(f"the LR range test sweeps LRs relative to the optimizer's LR, which is {ref!r}; give the "
                         "optimizer a positive LR of the right order (e.g. 0.01 for SGD, 1e-3 for Adam).")
    lo, hi = ref * auto.lr_range[0], ref * auto.lr_range[1]
    n = auto.lr_steps
    lrs: list[float] = []

    def set_lr(i: int) -> None:
        lr = lo * (hi / lo) ** (i / (n - 1))
        for group, b in zip(groups, base):
            group["lr"] = lr * b / ref  # the groups keep their ratios
        lrs.append(lr)

    def stop(done: Steps) -> bool:
        losses = [loss for _, loss, _ in done]
        return not math.isfinite(losses[-1]) or diverged(smoothed_losses(losses))

    steps = yield from runner.run(knee, n, set_lr, stop)
    if steps is None:
        raise RuntimeError(f"the LR range test ran out of memory at batch {knee}, where the throughput sweep did not;"
                           " set Auto(max_size=...) below it, or max_micro_batch_size.")
    losses = [loss for _, loss, _ in steps]
    finite = next((i for i, x in enumerate(losses) if not math.isfinite(x)), len(losses))
    if finite < 2:
        raise RuntimeError(f"the LR range test's first losses are {losses[:2]}: nothing to compare; check the model "
                           "and the loss, or lower the optimizer's LR (the test starts at "
                           f"{auto.lr_range[0]:g} x it).")
    smoothed = smoothed_losses(losses[:finite])
    # A loss that did not fall beyond its own noise, or that sat in a valley many times wider than the LR steps it
    # can tell apart, says nothing about the LR: keep the optimizer's.
    fell = loss_fell(losses[:finite], smoothed)
    low, high = valley_bounds(lrs[:finite], smoothed)
    told = fell and high <= auto.max_valley_span * low
    lr = ctx.agree(auto.lr_fraction * math.sqrt(low * high) if told else ref)
    at_min = ctx.agree(min_loss_lr(lrs[:finite], smoothed))
    ctx.log({"phase": "lr_range_test", "batch_size": knee, "steps": len(steps), "lr": lr, "lr_at_min": at_min,
             "loss_fell": fell, "valley": [low, high], "lr_kept": not told, "lrs": lrs, "losses": losses})
    return lr, at_min


def set_base_lr(optimizer: Any, schedulers: Iterable[Any], lr: float) -> None:
    """Scale every group's LR (and the schedules' base LRs) so that the first group's base LR is ``lr``."""
    groups = optimizer.param_groups
    first = groups[0]
    ratio = lr / float(first.get("initial_lr", first["lr"]))
    for group in groups:  # (the first group's base LR is set to lr itself: no rounding)
        base = "initial_lr" if "initial_lr" in group else "lr"
        if "initial_lr" in group:
            group["lr"] = float(group["lr"]) * ratio
        group[base] = lr if group is first else float(group[base]) * ratio
    for scheduler in schedulers:
        if isinstance(getattr(scheduler, "base_lrs", None), list):
            scheduler.base_lrs = [float(b) * ratio for b in scheduler.base_lrs]
