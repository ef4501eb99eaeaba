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
   optimizer's own LR when the loss did not fall beyond its noise (:func:`~batchpilot.lr.range_test.loss_fell`)
   or the valley spans more than ``max_valley_span`` (:func:`~batchpilot.lr.range_test.valley_bounds`).
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

import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import replace
from typing import Any

import torch

from .. import distributed as bpdist
from ..controllers.auto import Auto, ProbeResult, resolve_auto_mode
from .config import LRConfig, PilotConfig
from .probe_core import Steps, range_test, set_base_lr, sweep
from .snapshot import restore_snapshot, take_snapshot

__all__ = ["adopt_anchor", "lr_config", "resolve_auto", "run_probes"]


def resolve_auto(batch_size: Any, controller: Any, config: PilotConfig) -> tuple[Any, Any, PilotConfig, bool]:
    """``Pilot``'s arguments with ``batch_size="auto"`` resolved: the first size (Auto's ``min_size``), the
    controller (``Auto()`` when none is given), the settings (``lr_rule`` ``"auto"`` unless set), and whether the
    automatic mode is on.

    Raises:
        ValueError: ``batch_size="auto"`` with another controller, ``Auto`` or ``lr_rule="auto"`` without it.
    """
    rule = config.lr.lr_rule
    batch_size, controller, on = resolve_auto_mode(batch_size, controller)
    if on:
        if rule is None:
            config = replace(config, lr=replace(config.lr, lr_rule="auto"))
        return batch_size, controller, config, True
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
    runner, ctx = _ProbeSteps(pilot), _PilotContext(pilot)
    adascale, pilot._step_end.adascale = pilot._step_end.adascale, None  # probe steps run at the LR set for them
    result = None
    pilot.probing = True
    try:
        knee, table, bound = yield from sweep(ctx, runner, auto)
        lr = at_min = None
        if pilot.config.lr.lr_rule == "auto":
            restore_snapshot(pilot, snapshot)  # the range test starts from the pre-probe weights too
            runner.keep_memory_bound()
            lr, at_min = yield from range_test(ctx, runner, auto, knee)
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


class _PilotContext:
    """The Pilot as the probe phases' context (:class:`~.probe_core.ProbeContext`)."""

    def __init__(self, pilot: Any) -> None:
        # the dataset's size in the batch's unit (tokens with batch_unit="tokens"), for the sweep's dataset bound
        self.pilot, self.num_samples, self.optimizer = pilot, pilot.driver.num_samples, pilot.optimizer

    def agree(self, value: float) -> float:
        return _agree_float(self.pilot, value)

    def log(self, record: dict[str, Any]) -> None:
        _log(self.pilot, record)


class _ProbeSteps:
    """Runs probe steps of a given size through the Pilot's accumulation and update."""

    def __init__(self, pilot: Any) -> None:
        self.pilot = pilot
        self.count = 0  # probe steps run
        self.memory_bound: int | None = None  # the micro-batch bound after a probe step ran out of memory

    def run(self, size: int, steps: int, set_lr: Callable[[int], None] | None = None,
            stop: Callable[[Steps], bool] | None = None) -> Generator[Any, None, Steps | None]:
        """Run ``steps`` steps of ``size`` samples or tokens (fewer when ``stop(done)`` says so after one); their
        (seconds, loss, samples or tokens), or ``None`` when one ran out of memory (on any rank)."""
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
                outcome = pilot._step_end.apply(micro.global_units, self._event)  # samples, or tokens
                pilot._acc.micro, pilot._acc.step_open = None, False
                now = time.perf_counter()
                done.append((now - clock, outcome.loss, micro.global_units))
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
        set_base_lr(pilot.optimizer, pilot.lr_schedulers, result.lr)
    auto.start(result)
    _log(pilot, {"phase": "start", **result.to_dict()})


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
