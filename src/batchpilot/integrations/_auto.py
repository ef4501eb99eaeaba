"""The automatic mode (:class:`~batchpilot.controllers.Auto`) in the integrations: the start probes, run by the
integration itself with the framework's own loss before the framework's training loop starts.

The same probes as ``Pilot(batch_size="auto")`` (:mod:`batchpilot.engine.probe_core`: the throughput sweep at
doubling sizes with the knee rule, then the LR range test at the knee), on the integration's own
:class:`~batchpilot.AdaptiveDataLoader`. Before them the model's and optimizer's states, the data position and
the generators' states are copied; after them they are restored: the probes' samples are not trained on, the
run's first epoch still sees every sample once, and the run is the one it would be started by hand at the knee
with the found LR. The outcome goes to :meth:`Auto.start`, so it lives in the controller's state (and with it in
the integration's checkpoint: a resumed run does not probe again).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch

from ..controllers.auto import Auto, ProbeResult
from ..data.loader import AdaptiveDataLoader
from ..data.micro_batch import MicroBatch
from ..engine.probe_core import Steps, drive, range_test, set_base_lr, sweep
from ..rng import restore_rng_states, rng_state

logger = logging.getLogger("batchpilot")

__all__ = ["DirectSteps", "LocalContext", "auto_controller", "run_start_probes"]


def auto_controller(controller: Any) -> Auto | None:
    """``controller`` when it is an :class:`Auto` that has not probed yet, else ``None``."""
    return controller if isinstance(controller, Auto) and controller.probe is None else None


class LocalContext:
    """One process's probe context: the dataset size, the optimizer, and the probe records (kept in
    :attr:`records` and logged at INFO on the ``batchpilot`` logger)."""

    def __init__(self, num_samples: int, optimizer: Any) -> None:
        self.num_samples, self.optimizer = num_samples, optimizer
        self.records: list[dict[str, Any]] = []

    def agree(self, value: float) -> float:
        return value

    def log(self, record: dict[str, Any]) -> None:
        self.records.append({"type": "probe", **record})
        logger.info("batchpilot start probe: %s", {k: v for k, v in record.items() if k not in ("lrs", "losses")})


class DirectSteps:
    """Probe steps an integration computes itself: each step's micro-batches from ``loader``, then
    ``step(micro_batches) -> the step's mean loss`` (forward, backward, update and zeroing the gradients)."""

    def __init__(self, loader: AdaptiveDataLoader, step: Callable[[list[MicroBatch]], float]) -> None:
        self.loader, self.step = loader, step
        self.count = 0
        self.memory_bound: int | None = None  # (out of memory during a probe is raised, not caught)

    def keep_memory_bound(self) -> None:
        """Nothing to keep (see :attr:`memory_bound`)."""

    def run(self, size: int, steps: int, set_lr: Callable[[int], None] | None = None,
            stop: Callable[[Steps], bool] | None = None) -> Generator[Any, None, Steps | None]:
        """Up to ``steps`` steps of ``size`` samples (or tokens), timed from fetch to update: their (seconds, loss,
        samples or tokens)."""
        self.loader.set_batch_size(size)
        done: Steps = []
        clock = time.perf_counter()
        while True:
            micro: list[MicroBatch] = []
            for m in self.loader:  # the rest of this epoch
                micro.append(m)
                if not m.is_last:
                    continue
                if set_lr is not None:
                    set_lr(len(done))
                loss = self.step(micro)
                micro = []
                now = time.perf_counter()
                done.append((now - clock, loss, m.global_units))  # samples, or tokens
                clock = now
                self.count += 1
                if len(done) >= steps or (stop is not None and stop(done)):
                    return done
            if self.loader.position()[1] == 0 and not done:
                raise RuntimeError(f"a probe epoch at batch {size} produced no step (drop_last with a batch larger "
                                   "than the dataset); lower Auto(min_size=...).")
        yield  # (a generator for probe_core's phases; never reached)


def _snapshot(model: torch.nn.Module, optimizer: Any, loader: AdaptiveDataLoader) -> dict[str, Any]:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict()),
            "loader": copy.deepcopy(loader.state_dict()), "rng": rng_state(device), "device": device}


def _restore(model: torch.nn.Module, optimizer: Any, loader: AdaptiveDataLoader, snap: dict[str, Any]) -> None:
    model.load_state_dict(snap["model"])
    optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
    optimizer.zero_grad(set_to_none=True)
    loader.load_state_dict(copy.deepcopy(snap["loader"]))
    restore_rng_states([snap["rng"]], 0, 1, snap["device"])


def _at_base_lr(optimizer: Any) -> None:
    """The probes run at the schedule's base LR (a warm-up may have set 0 for the first step). (Loading an
    optimizer state replaces its param groups: read them anew after each restore.)"""
    for group in optimizer.param_groups:
        group["lr"] = float(group.get("initial_lr", group["lr"]))


def run_start_probes(auto: Auto, *, model: torch.nn.Module, optimizer: Any, loader: AdaptiveDataLoader,
                     step: Callable[[list[MicroBatch]], float], schedulers: Iterable[Any] = (),
                     range_test_lr: bool = True) -> tuple[ProbeResult, list[dict[str, Any]]]:
    """Run the start probes on one process and hand their outcome to ``auto``; return it and the probe records.

    Afterwards the model, the optimizer, the data position and the generators are as before the probes, the
    loader is at the knee, and (with ``range_test_lr``) every group's LR, ``initial_lr`` and the schedulers'
    base LRs are scaled so that the first group's base LR is the found one. The caller anchors its LR rule at
    ``result.start_size``.
    """
    started = time.perf_counter()
    snap = _snapshot(model, optimizer, loader)
    _at_base_lr(optimizer)
    plan = loader.sampler.token_plan  # token budgets: the sweep's dataset bound counts tokens
    ctx = LocalContext(loader.sampler.num_samples if plan is None else plan.total_tokens, optimizer)
    runner = DirectSteps(loader, step)
    try:
        knee, table, bound = drive(sweep(ctx, runner, auto))
        lr = at_min = None
        if range_test_lr:
            _restore(model, optimizer, loader, snap)  # the range test starts from the pre-probe weights too
            _at_base_lr(optimizer)
            lr, at_min = drive(range_test(ctx, runner, auto, knee))
    finally:
        _restore(model, optimizer, loader, snap)
    result = ProbeResult(start_size=knee, throughput=tuple(table), bound=bound, lr=lr, lr_at_min=at_min,
                         seconds=time.perf_counter() - started, steps=runner.count)
    loader.set_batch_size(knee)
    if lr is not None:
        set_base_lr(optimizer, schedulers, lr)
    auto.start(result)
    ctx.log({"phase": "start", **result.to_dict()})
    return result, ctx.records
