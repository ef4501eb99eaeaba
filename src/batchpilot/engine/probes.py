"""The automatic mode's start probes: ``Pilot(model, optimizer, data, batch_size="auto")``.

Before the first training step, :meth:`Pilot.batches` runs probe steps through the user's own loop (it just
sees more micro-batches; each probe step goes through the normal accumulation, backward and update):

1. **Throughput sweep.** From :class:`~batchpilot.controllers.Auto`'s ``min_size``, doubling: at each size
   ``warmup_steps`` untimed steps, then ``timed_steps`` timed ones (the whole step: fetch, forward, backward,
   update); the fastest is the size's samples/s (load only slows a step down). The sweep stops at the knee
   (:func:`~batchpilot.controllers.auto.pick_knee`: a doubling must buy ``min_gain`` more throughput, confirmed
   by timing both sizes again), at ``max_size``, where an epoch would keep
   fewer than ``min_epoch_steps`` steps, or when a probe step runs out of memory (with ``oom_recovery=True``;
   the micro-batch bound is then kept).
2. **LR range test** at the knee (Smith 2017): ``lr_steps`` steps with the LR growing exponentially over
   ``lr_range`` times the optimizer's LR, stopped when the smoothed loss diverges; the run's LR is
   ``lr_fraction`` x the centre of the loss valley (:func:`~batchpilot.lr.range_test.valley_lr`), or the
   optimizer's own LR when the loss did not fall beyond its noise (:func:`~batchpilot.lr.range_test.loss_fell`).
3. **Back to the start.** The pre-probe snapshot is restored (weights, optimizer, data position, RNG,
   statistics): probe steps are no training steps and their samples are not trained on, so coverage stays
   exact. The run starts at the knee with the found LR, anchored there: with ``lr_rule="auto"`` the LR of any
   other size follows AdaScale's gain, ``lr (1 + B_simple / knee) / (1 + B_simple / B)`` (McCandlish et al.'s
   curve through the knee).

Under DDP every rank runs the probes; rank 0's timings decide and are broadcast, and the range test's losses
are reduced over ranks, so every rank finds the same knee and LR. Probe lines go to the log as
``{"type": "probe", ...}``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import replace
from typing import Any

import torch

from .. import distributed as bpdist
from ..controllers.auto import Auto, ProbeResult, pick_knee
from ..lr.range_test import diverged, loss_fell, min_loss_lr, smoothed_losses, valley_lr
from .config import LRConfig, PilotConfig
from .snapshot import restore_snapshot, take_snapshot

__all__ = ["adopt_anchor", "lr_config", "resolve_auto", "run_probes"]

Steps = list[tuple[float, float, int]]  # (seconds, mean loss, global batch size) of each probe step


def resolve_auto(batch_size: Any, controller: Any, config: PilotConfig) -> tuple[Any, Any, PilotConfig, bool]:
    """``Pilot``'s arguments with ``batch_size="auto"`` resolved: the first size (Auto's ``min_size``), the
    controller (``Auto()`` when none is given), the settings (``lr_rule`` ``"auto"`` unless set), and whether the
    automatic mode is on.

    Raises:
        ValueError: ``batch_size="auto"`` with another controller, ``Auto`` or ``lr_rule="auto"`` without it.
    """
    rule = config.lr.lr_rule
    if isinstance(batch_size, str) and batch_size == "auto":
        if controller is None:
            controller = Auto()
        if not isinstance(controller, Auto):
            raise ValueError(f"batch_size='auto' starts the automatic mode, whose controller is batchpilot.controllers"
                             f".Auto; got controller={controller!r}. Pass controller=None (or Auto(...)), or give an "
                             "int batch_size to run that controller.")
        if rule is None:
            config = replace(config, lr=replace(config.lr, lr_rule="auto"))
        return controller.min_size, controller, config, True
    if isinstance(controller, Auto):
        raise ValueError(f"the Auto controller needs batch_size='auto' (it picks the first size itself); got "
                         f"batch_size={batch_size!r}. Pass batch_size='auto', or use Goodput() with an int batch_size.")
    if isinstance(rule, str) and rule == "auto":
        raise ValueError(f"lr_rule='auto' belongs to the automatic mode (the LR range test runs at the knee it finds);"
                         f" pass batch_size='auto' too, or another lr_rule with batch_size={batch_size!r}.")
    return batch_size, controller, config, False


def lr_config(lr: LRConfig) -> LRConfig:
    """The LR settings the coupling is built from: ``"auto"`` runs as AdaScale (re-anchored after the probes)."""
    return replace(lr, lr_rule="adascale") if isinstance(lr.lr_rule, str) and lr.lr_rule == "auto" else lr


def adopt_anchor(pilot: Any, state: Any) -> None:
    """Before loading ``state``: anchor the LR rules at the batch size the state's run anchored them at (the knee
    its probes found; the first size before them), unless ``base_batch_size`` is set."""
    if pilot.config.lr.base_batch_size is not None or not isinstance(state, Mapping):
        return
    for key, part in (("coupling", pilot.coupling), ("adascale", pilot.adascale)):
        saved = state.get(key)
        if part is not None and isinstance(saved, Mapping) and isinstance(saved.get("base_batch_size"), int):
            _anchor(part, saved["base_batch_size"])


def _anchor(part: Any, base_batch_size: int) -> None:
    if hasattr(part, "rebase"):
        part.rebase(base_batch_size)  # LRCoupling (its factors are cached)
    else:
        part.base_batch_size = base_batch_size  # AdaScaleLR


def run_probes(pilot: Any) -> Generator[Any, None, None]:
    """Run the start probes once (nothing when ``pilot.controller.probe`` holds a result), yielding the probe
    steps' micro-batches; afterwards the Pilot is back at its pre-probe state, at the knee, with the found LR."""
    auto: Auto = pilot.controller
    if auto.probe is not None:
        return
    started = time.perf_counter()
    snapshot = take_snapshot(pilot)
    runner = _ProbeSteps(pilot)
    adascale, pilot._step_end.adascale = pilot._step_end.adascale, None  # probe steps run at the LR set for them
    result = None
    pilot.probing = True
    try:
        knee, table, bound = yield from _sweep(pilot, runner, auto)
        lr = at_min = None
        if pilot.config.lr.lr_rule == "auto":
            restore_snapshot(pilot, snapshot)  # the range test starts from the pre-probe weights too
            runner.keep_memory_bound()
            lr, at_min = yield from _range_test(pilot, runner, auto, knee)
        result = ProbeResult(start_size=knee, throughput=tuple(table), bound=bound, lr=lr, lr_at_min=at_min,
                             seconds=0.0, steps=runner.count, max_micro_batch_size=runner.memory_bound)
    finally:
        pilot.probing = False
        runner.drop_open_step()
        pilot._step_end.adascale = adascale
        restore_snapshot(pilot, snapshot)
    assert result is not None  # (an error in the probes was raised above)
    seconds = _agree_float(pilot, time.perf_counter() - started)
    _start(pilot, auto, replace(result, seconds=seconds))


class _ProbeSteps:
    """Runs probe steps of a given size through the Pilot's accumulation and update."""

    def __init__(self, pilot: Any) -> None:
        self.pilot = pilot
        self.count = 0  # probe steps run
        self.memory_bound: int | None = None  # the micro-batch bound after a probe step ran out of memory

    def run(self, size: int, steps: int, set_lr: Callable[[int], None] | None = None,
            stop: Callable[[Steps], bool] | None = None) -> Generator[Any, None, Steps | None]:
        """Run ``steps`` steps of ``size`` samples (fewer when ``stop(done)`` says so after one); their
        (seconds, loss, size), or ``None`` when one ran out of memory (on any rank)."""
        pilot = self.pilot
        pilot.loader.set_batch_size(size)
        done: Steps = []
        clock = time.perf_counter()
        while True:
            yielded = False
            for micro in pilot.loader:  # the rest of this epoch
                yielded = True
                yield from pilot._acc.run(micro)
                if self._out_of_memory(micro):
                    return None
                if not micro.is_last:
                    continue
                if set_lr is not None:
                    set_lr(len(done))
                outcome = pilot._step_end.apply(micro.global_size, self._event)
                pilot._acc.micro, pilot._acc.step_open = None, False
                now = time.perf_counter()
                done.append((now - clock, outcome.loss, micro.global_size))
                clock = now
                self.count += 1
                if len(done) >= steps or (stop is not None and stop(done)):
                    return done
            if not yielded and pilot.loader.position()[1] == 0:
                raise RuntimeError(f"a probe epoch at batch {size} produced no step (drop_last with a batch larger than "
                                   f"the dataset of {pilot.num_samples}); lower Auto(min_size=...).")

    def _event(self, kind: str, data: dict[str, Any], warn: bool = True) -> None:
        self.pilot._log.event(self.pilot.step + 1, kind, {**data, "probe": True}, False)

    def _out_of_memory(self, micro: Any) -> bool:
        replay = self.pilot._replay
        if not self.pilot.oom_recovery or (replay.failed_micro_batch_size is None and not micro.is_last):
            return False
        bound = replay.agreed_bound()  # a collective: every rank calls it once per step attempt
        if bound is None:
            return False
        replay.failed_micro_batch_size = None
        self.memory_bound = bound
        self.drop_open_step()
        if self.pilot.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the failed step's cached blocks back
        return True

    def drop_open_step(self) -> None:
        """Drop a probe step left unfinished (out of memory, or the loop left)."""
        pilot = self.pilot
        if pilot._acc.step_open:
            pilot._step_end.discard()
            pilot.loader.restart_step()
        pilot._acc.micro, pilot._acc.step_open = None, False

    def keep_memory_bound(self) -> None:
        """After restoring the snapshot: keep the micro-batch bound a probe ran into."""
        if self.memory_bound is not None:
            self.pilot.loader.set_max_micro_batch_size(self.memory_bound)


def _sweep(pilot: Any, runner: _ProbeSteps, auto: Auto) -> Generator[Any, None, tuple[int, list[tuple[int, float]], str]]:
    """The throughput at doubling sizes: ``(knee, [(size, samples/s), ...], what stopped the sweep)``.

    A size's throughput is read from its fastest timed step: other work on the machine only ever makes a step
    slower. A doubling that falls short of ``min_gain`` is timed again, both sizes, before it ends the sweep, and
    each keeps its faster reading: one burst of load must not end the sweep early (seen on mnist1d: 64 timed at
    half the throughput of 32)."""
    per_epoch = max(pilot.num_samples // auto.min_epoch_steps, 1)  # largest size leaving min_epoch_steps steps
    table: list[tuple[int, float]] = []
    size, bound = auto.min_size, ""
    while not bound:
        rate = yield from _throughput(pilot, runner, auto, size)
        if rate is None:
            bound = "memory"
            break
        table.append((size, rate))
        if pick_knee(table, auto.min_gain)[1]:  # confirm it: time the two sizes again
            for i in (-2, -1):
                again = yield from _throughput(pilot, runner, auto, table[i][0])
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


def _throughput(pilot: Any, runner: _ProbeSteps, auto: Auto, size: int) -> Generator[Any, None, float | None]:
    """Samples/s at ``size`` from its fastest timed step (rank 0's), or ``None`` when it ran out of memory."""
    steps = yield from runner.run(size, auto.warmup_steps + auto.timed_steps)
    if steps is None:
        runner.keep_memory_bound()
        _log(pilot, {"phase": "throughput", "batch_size": size, "out_of_memory": True,
                     "max_micro_batch_size": runner.memory_bound})
        return None
    timed = steps[auto.warmup_steps:]
    full = [s for s in timed if s[2] == size] or timed  # an epoch's smaller tail step is no sample
    rate = _agree_float(pilot, max(n / t if t > 0 else math.inf for t, _, n in full))
    _log(pilot, {"phase": "throughput", "batch_size": size, "samples_per_s": rate,
                 "step_s": [t for t, _, _ in timed], "loss": steps[-1][1]})
    return rate


def _range_test(pilot: Any, runner: _ProbeSteps, auto: Auto, knee: int) -> Generator[Any, None, tuple[float, float]]:
    """The LR range test at ``knee``: ``(the run's LR, the LR at the smoothed loss's minimum)``."""
    groups = pilot.optimizer.param_groups
    base = [float(g["lr"]) for g in groups]
    ref = base[0]
    if not ref > 0:
        raise ValueError(f"lr_rule='auto' sweeps LRs relative to the optimizer's LR, which is {ref!r}; give the "
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
    # A loss that did not fall beyond its own noise says nothing about the LR: keep the optimizer's.
    fell = loss_fell(losses[:finite], smoothed)
    lr = _agree_float(pilot, auto.lr_fraction * valley_lr(lrs[:finite], smoothed) if fell else ref)
    at_min = _agree_float(pilot, min_loss_lr(lrs[:finite], smoothed))
    _log(pilot, {"phase": "lr_range_test", "batch_size": knee, "steps": len(steps), "lr": lr, "lr_at_min": at_min,
                 "loss_fell": fell, "lrs": lrs, "losses": losses})
    return lr, at_min


def _start(pilot: Any, auto: Auto, result: ProbeResult) -> None:
    """Set the Pilot (back at its pre-probe state) to start at the knee with the found LR, anchored there."""
    knee = result.start_size
    if result.max_micro_batch_size is not None:
        pilot.loader.set_max_micro_batch_size(result.max_micro_batch_size)
    pilot.loader.set_batch_size(knee)
    if pilot.config.lr.base_batch_size is None:
        anchor = auto.max_size if auto.lr_anchor == "max_size" and pilot.config.lr.lr_rule == "auto" else knee
        for part in (pilot.coupling, pilot.adascale):
            if part is not None:
                _anchor(part, anchor)
    if result.lr is not None:
        _set_base_lr(pilot, result.lr)
    auto.start(result)
    _log(pilot, {"phase": "start", **result.to_dict()})


def _set_base_lr(pilot: Any, lr: float) -> None:
    """Scale every group's LR (and the schedules' base LRs) so that the first group's base LR is ``lr``."""
    groups = pilot.optimizer.param_groups
    first = groups[0]
    ratio = lr / float(first.get("initial_lr", first["lr"]))
    for group in groups:  # (the first group's base LR is set to lr itself: no rounding)
        base = "initial_lr" if "initial_lr" in group else "lr"
        if "initial_lr" in group:
            group["lr"] = float(group["lr"]) * ratio
        group[base] = lr if group is first else float(group[base]) * ratio
    for scheduler in pilot.lr_schedulers:
        if isinstance(getattr(scheduler, "base_lrs", None), list):
            scheduler.base_lrs = [float(b) * ratio for b in scheduler.base_lrs]


def _agree_float(pilot: Any, value: float) -> float:
    """Rank 0's ``value`` on every rank."""
    if pilot.world_size == 1:
        return value
    mine = torch.tensor([value if pilot.rank == 0 else 0.0], dtype=torch.float64)
    return float(bpdist.all_reduce_sum(mine)[0])


def _log(pilot: Any, record: dict[str, Any]) -> None:
    log = pilot._log.log
    if log is not None:
        log.write("probe", record)
