"""One training run of the benchmark: the clock, the cost model, evaluations and the stopping rule.

:func:`train_one` trains a fresh model under one :class:`~batchpilot.bench.specs.RunSpec` through
:class:`batchpilot.Pilot` and returns the run's dict for ``results.json`` (the measurement rules are in
:mod:`batchpilot.bench.runner`).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from ..controllers.auto import Auto
from .calibrate import Calibration
from .specs import RunSpec
from .workloads import Workload

__all__ = ["AUTO_STEPS_PER_SIZE", "MAX_SKIPPED_STEPS", "STALL_EPOCHS", "STALL_GAIN", "evaluate", "probe_steps", "reaches_target",
           "train_one"]

MAX_SKIPPED_STEPS = 5
STALL_EPOCHS = 5.0
STALL_GAIN = 0.1


def evaluate(model: torch.nn.Module, test: TensorDataset, chunk: int = 4096) -> float:
    """Top-1 accuracy of ``model`` on ``test`` (in eval mode, without gradients)."""
    x, y = test.tensors[0], test.tensors[1]
    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(y), chunk):
            correct += int((model(x[i : i + chunk]).argmax(dim=1) == y[i : i + chunk]).sum())
    model.train(was_training)
    return correct / len(y)


def reaches_target(last: list[float], window: int, target: float) -> bool:
    """The bench's target rule: the mean of the last ``window`` accuracies on the evaluation grid (``last``,
    in order) is at or above ``target``; fewer than ``window`` evaluations never reach it."""
    return len(last) >= window and sum(last[-window:]) / window >= target


class _Run:
    """The clock, the cost model, the evaluations and the stopping rule of one run (a step callback)."""

    def __init__(self, model, test, num_samples, target, budget_s, eval_every, on_eval,
                 calibration: Calibration | None, noise_every: int | None, target_window: int = 1) -> None:
        self.model, self.test, self.num_samples = model, test, num_samples
        self.target, self.budget_s = target, budget_s
        self.target_window = target_window
        self._window: list[float] = []  # the last target_window accuracies on the evaluation grid
        self.eval_samples = max(1, round(eval_every * num_samples))
        self.next_eval = self.eval_samples
        self.on_eval = on_eval
        self.calibration, self.noise_every = calibration, noise_every
        self.curve: list[dict[str, Any]] = []
        self.batch_sizes: list[dict[str, Any]] = []
        self.reached: dict[str, Any] | None = None
        self.done = False
        self.diverged = False
        self.stop_reason = "budget"
        self.excluded = 0.0  # seconds of evaluation and bookkeeping, not counted as training time
        self.start = 0.0
        self.stopped_at: float | None = None
        self.last = {"step": 0, "samples_seen": 0}
        self.eval_s = 0.0
        self.cost_s = 0.0  # cost-model time so far
        self.noise_scale: float | None = None
        self.noise_count: Any = None  # the engine's stats/noise_count: it moves on a step that measured statistics
        self.probe_cost_s: float | None = None  # cost-model time of auto's start probes (counted at the first step)
        self.metric: Callable[[Any, Any], float] = evaluate  # the workload's metric (Workload.evaluate), higher is better
        self.size_key = "batch/global_size"  # the record's step size in the batch's unit ("tokens" for token budgets)
        self.tokens_seen: int | None = None  # with token budgets: the tokens trained so far

    def train_time(self, now: float | None = None) -> float:
        return (time.perf_counter() if now is None else now) - self.start - self.excluded

    def begin(self, batch_size: int | None) -> None:
        """Start the clock (``batch_size`` ``None``: auto's, known after its probes)."""
        self.batch_sizes.append({"step": 0, "samples_seen": 0, "time_s": 0.0, "batch_size": batch_size})
        self.evaluate(0.0, 0, 0, batch_size)
        if self.reached is not None:  # the untrained model already meets the target: nothing to train
            self.done, self.stop_reason, self.stopped_at = True, "target", 0.0
        self.start = time.perf_counter()

    def evaluate(self, t: float, step: int, samples: int, batch_size: int | None, final: bool = False) -> float:
        """Evaluate and record a curve point; one on the evaluation grid may reach the target, the ``final``
        one of a run that stopped between grid points (at the budget, say) only gives the final accuracy.

        The target is reached at the first grid point where the mean accuracy of the last ``target_window``
        grid points (this one included) is at or above it; with 1, the first point at or above it."""
        t0 = time.perf_counter()
        acc = self.metric(self.model, self.test)
        self.eval_s += time.perf_counter() - t0
        point = {"time_s": t, "cost_s": self.cost_s, "step": step, "samples_seen": samples,
                 "epochs": samples / self.num_samples, "accuracy": acc, "batch_size": batch_size,
                 "noise_scale": self.noise_scale}
        if self.size_key == "tokens":
            point["tokens_seen"] = self.tokens_seen or 0
        self.curve.append(point)
        if not final:
            self._window = (self._window + [acc])[-self.target_window:]
        if self.reached is None and not final and reaches_target(self._window, self.target_window, self.target):
            self.reached = point
        elif point["epochs"] >= STALL_EPOCHS and max(p["accuracy"] for p in self.curve) < \
                self.curve[0]["accuracy"] + STALL_GAIN:
            self.stop_reason, self.done = "stalled", True
        self.on_eval(point, self)
        return acc

    def _after_probes(self, pilot: Any) -> None:
        """Auto's first step: its start size is the knee, and the probes' steps enter the cost model."""
        probe = pilot.controller.probe
        self.batch_sizes[0]["batch_size"] = self.curve[0]["batch_size"] = probe.start_size
        if self.calibration is not None:
            self.probe_cost_s = probe_cost(probe, pilot.controller, self.calibration)
            self.cost_s += self.probe_cost_s

    def __call__(self, pilot: Any, record: dict[str, Any]) -> None:
        now = time.perf_counter()
        t = self.train_time(now)
        step, samples = record["step"], record["samples_seen"]
        if self.batch_sizes[0]["batch_size"] is None:  # auto: the probes before this first step found its size
            self._after_probes(pilot)
        self.last = {"step": step, "samples_seen": samples, "batch_size": self.batch_sizes[-1]["batch_size"]}
        count = record.get("stats/noise_count")
        measured = count is not None and count != self.noise_count  # this step measured gradient statistics
        self.noise_count = count
        if self.calibration is not None:
            self.cost_s += self.calibration.step_time(record[self.size_key], measured)
        self.tokens_seen = record.get("tokens_seen")
        noise = record.get("stats/noise_scale")
        if isinstance(noise, (int, float)) and math.isfinite(noise):
            self.noise_scale = float(noise)
        # The policy's size for the step just done (record["batch/global_size"] is smaller for the last,
        # partial batch of an epoch), and the size of the next step (the decision has been made).
        global_batch_size, next_global_batch_size = self.batch_sizes[-1]["batch_size"], pilot.batch_size
        if next_global_batch_size != global_batch_size:
            self.batch_sizes.append({"step": step, "samples_seen": samples, "time_s": t,
                                     "batch_size": next_global_batch_size})
        loss = record.get("loss")
        if (isinstance(loss, float) and not math.isfinite(loss)) or \
                record.get("train/skipped_steps", 0) >= MAX_SKIPPED_STEPS:
            self.diverged = self.done = True
            self.stop_reason = "diverged"
        if samples >= self.next_eval or self.diverged:
            # A divergence between grid points is evaluated for the record, but cannot reach the target.
            off_grid = samples < self.next_eval
            self.next_eval = (samples // self.eval_samples + 1) * self.eval_samples
            self.evaluate(t, step, samples, global_batch_size, final=off_grid)
            if self.reached is not None:
                self.done, self.stop_reason = True, "target"
        if t >= self.budget_s:
            self.done = True
        if self.done:
            self.stopped_at = t
        self.excluded += time.perf_counter() - now  # bookkeeping and evaluation are not training


AUTO_STEPS_PER_SIZE = Auto().warmup_steps + Auto().timed_steps
"""Steps the throughput sweep runs at each size with ``Auto``'s defaults (the bench's ``auto`` policy)."""


def probe_steps(probe: Mapping[str, Any], per_size: int = AUTO_STEPS_PER_SIZE) -> list[tuple[int, int]]:
    """``[(batch size, steps), ...]`` of auto's start probes from their record (``ProbeResult.to_dict()``, as in
    results.json): ``per_size`` steps at each size the throughput sweep timed, the rest of the probe steps (the LR
    range test) at the knee."""
    sizes = [int(size) for size, _ in probe["throughput"]]
    rest = max(int(probe["steps"]) - per_size * len(sizes), 0)
    return [(size, per_size) for size in sizes] + [(int(probe["start_size"]), rest)]


def probe_cost(probe: Any, auto: Any, calibration: Calibration) -> float:
    """Cost-model seconds of auto's start probes (:func:`probe_steps` with ``auto``'s ``warmup_steps + timed_steps``)."""
    steps = probe_steps(probe.to_dict(), auto.warmup_steps + auto.timed_steps)
    return sum(count * calibration.step_time(size) for size, count in steps)


def _short(value: Any) -> Any:
    """A log value for results.json: long lists (a rollback's losses) cut to their last 16 entries."""
    return value[-16:] if isinstance(value, list) and len(value) > 16 else value


def rollbacks_in_log(path: Path) -> list[dict[str, Any]]:
    """The rollback decisions (``"decision/rollback": true``) of an adjustment log, each as its step and its
    ``decision/`` and ``rollback/`` fields (lists cut to their last 16 entries)."""
    from ..logs import read_log

    if not path.is_file() or path.stat().st_size == 0:
        return []
    return [{k: _short(v) for k, v in r.items() if k in ("step", "samples_seen") or k.startswith(("decision/", "rollback"))}
            for r in read_log(path) if r.get("type") == "decision" and r.get("decision/rollback") is True]


def train_one(workload: Workload, spec: RunSpec, seed: int, train: TensorDataset, test: TensorDataset, *,
           target: float, budget_s: float, eval_every: float, on_eval: Callable[[dict[str, Any], _Run], None],
           calibration: Calibration | None = None, max_steps: int | None = None,
           target_window: int = 1) -> dict[str, Any]:
    """Train one run (see the module docstring); every run writes its adjustment log to a temporary file, read
    afterwards for its rollbacks (the same logging cost for every policy)."""
    with tempfile.TemporaryDirectory(prefix="batchpilot-bench-") as tmp:
        log_path = Path(tmp) / "log.jsonl"
        run, pilot = _train(workload, spec, seed, train, test, target=target, budget_s=budget_s,
                            eval_every=eval_every, on_eval=on_eval, calibration=calibration, max_steps=max_steps,
                            target_window=target_window, log_path=log_path)
        rollbacks = rollbacks_in_log(log_path)
    return _result(spec, seed, run, pilot, rollbacks, calibration)


def _train(workload: Workload, spec: RunSpec, seed: int, train: TensorDataset, test: TensorDataset, *,
           target: float, budget_s: float, eval_every: float, on_eval: Callable[[dict[str, Any], _Run], None],
           calibration: Calibration | None, max_steps: int | None, target_window: int, log_path: Path
           ) -> tuple[_Run, Any]:
    from ..engine import Pilot

    model = workload.build_model(seed).to(train.tensors[0].device)  # the model goes where the data is
    optimizer = workload.make_optimizer(model.parameters(), spec.optimizer_lr)
    controller = spec.make_controller(len(train))
    settings: dict[str, Any] = {"seed": seed, "progress": False, "noise_every": spec.noise_every, "log_path": log_path}
    size: int | str = spec.batch_size
    if spec.auto:  # the Pilot's own defaults: lr_rule "auto" (unless the policy names one), anchored at the knee
        size = "auto"
        if spec.lr_rule is not None:
            settings["lr_rule"] = spec.lr_rule
    else:
        settings.update(lr_rule=spec.lr_rule, base_batch_size=spec.base_batch_size)
    if workload.pilot_settings is not None:  # e.g. gpt's token budgets
        settings.update(workload.pilot_settings(train))
    pilot = Pilot(model, optimizer, train, batch_size=size, controller=controller, **settings)
    run = _Run(model, test, len(train), target, budget_s, eval_every, on_eval, calibration, spec.noise_every,
               target_window)
    if workload.evaluate is not None:
        run.metric = workload.evaluate
    if settings.get("batch_unit") == "tokens":
        run.size_key = "tokens"
    pilot.add_callback(run)
    loss_fn = workload.loss_fn
    model.train()
    run.begin(None if spec.auto else spec.batch_size)  # the clock starts here: auto's probes run inside it
    # A generous epoch limit: the callback stops the run (target reached, budget spent, diverged).
    batches = pilot.batches(epochs=1_000_000, max_steps=max_steps)
    try:
        for x, y in batches:
            if run.done:
                break
            pilot.backward(loss_fn(model(x), y))
    finally:
        batches.close()
        pilot.close()
    return run, pilot


def _result(spec: RunSpec, seed: int, run: _Run, pilot: Any, rollbacks: list[dict[str, Any]],
            calibration: Calibration | None) -> dict[str, Any]:
    """The run's dict for results.json."""
    wall = run.stopped_at if run.stopped_at is not None else run.train_time()
    if run.curve[-1]["samples_seen"] != run.last["samples_seen"]:  # the run ended between evaluations
        # The policy's size of the last step trained (batch_sizes[-1] may be a next size never trained).
        run.evaluate(wall, run.last["step"], run.last["samples_seen"], run.last["batch_size"], final=True)
    reached = run.reached

    probe = getattr(pilot.controller, "probe", None) if spec.auto else None

    def at_target(key: str) -> Any:
        return None if reached is None else reached[key]

    return {
        "policy": spec.name,
        "seed": seed,
        "serves": list(spec.policies),
        "grid": spec.grid,
        "lr": probe.lr if probe is not None else spec.lr,
        "lr_rule": pilot.config.lr.lr_rule if spec.auto else spec.lr_rule,
        "rollbacks": len(rollbacks),
        "rollback_records": rollbacks,
        "probe": None if probe is None else {**probe.to_dict(), "cost_model_s": run.probe_cost_s},
        "time_to_target_s": at_target("time_s"),
        "cost_model_time_to_target_s": at_target("cost_s") if calibration is not None else None,
        "steps_to_target": at_target("step"),
        "samples_to_target": at_target("samples_seen"),
        **({"tokens_to_target": at_target("tokens_seen"), "tokens": run.tokens_seen} if run.size_key == "tokens" else {}),
        "epochs_to_target": at_target("epochs"),
        "final_accuracy": run.curve[-1]["accuracy"],
        "best_accuracy": max(p["accuracy"] for p in run.curve),
        "wall_s": wall,
        "cost_model_s": run.cost_s if calibration is not None else None,
        "eval_s": run.eval_s,
        "steps": run.last["step"],
        "samples": run.last["samples_seen"],
        "samples_per_s": run.last["samples_seen"] / wall if wall > 0 else None,
        "diverged": run.diverged,
        "stop_reason": run.stop_reason,
        # 1-minute load average at the end of the run: a busy machine explains a slow run.
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "batch_sizes": run.batch_sizes,
        "curve": run.curve,
    }
