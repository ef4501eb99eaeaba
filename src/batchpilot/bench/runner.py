"""Time to a target accuracy, for several batch-size policies side by side.

``run_benchmark`` trains a :class:`~batchpilot.bench.workloads.Workload` once per (seed, policy), each run
from a fresh model and optimizer, through :class:`batchpilot.Pilot` with the linear LR rule relative to
the workload's base batch size (32): a policy at batch B trains at ``base_lr * B / 32``.

Measurement rules:

* The clock counts *training* wall time only. Every ``eval_every`` epochs of samples (and once before the
  first step) the test accuracy is measured with the clock paused; a run stops at the first evaluation
  that reaches the target, or when the training time exceeds ``budget_s``.
* Time to target is therefore quantised to evaluation points; ``samples_to_target`` and
  ``steps_to_target`` are counted at the same point.
* Runs go seed-major (all policies for seed 0, then all for seed 1, ...) so that slow drift of the machine
  hits every policy alike; the policy order is rotated by one for each seed so that no policy always
  runs first. A short untimed warm-up run precedes the first timed one.
* A run that misses the target counts as infinitely slow in the medians: a policy's median time is
  ``null`` unless more than half of its runs reached the target.

Policies (``parse_policy``):

* ``static:N`` — batch size N throughout.
* ``ramp`` — ``ramp:32-512``: start at 32 and double every quarter epoch (in samples) up to 512, i.e. 32,
  64, 128, 256 over the first epoch and 512 from then on (:class:`~batchpilot.controllers.schedules.
  MultiplicativeStep`, Smith et al. 2018: grow the batch instead of decaying the LR).
* ``ramp:START-END`` or ``ramp:START-END@E`` — the same, doubling every ``E`` epochs (default 0.25).
* ``warmup:SMALL-TARGET@W+R`` — :class:`~batchpilot.controllers.schedules.WarmupRamp`: SMALL for W epochs,
  then a linear ramp to TARGET over R epochs (seed 000, section 4.2).

``results.json`` (see :func:`run_benchmark`) holds, per run, ``batch_sizes``: the batch-size trace as a
list of change points ``{"step", "samples_seen", "time_s", "batch_size"}`` (the size used from that step
on; the first entry is step 0), plus ``curve``: the evaluations ``{"time_s", "step", "samples_seen",
"epochs", "accuracy", "batch_size"}``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import TensorDataset

from .workloads import Workload, get_workload

__all__ = ["Policy", "parse_policies", "parse_policy", "run_benchmark", "summarize"]

DEFAULT_POLICIES = "static:32,static:128,static:512,ramp"
_POLICY_HELP = (
    "static:N (fixed batch size N), ramp (= ramp:32-512), ramp:START-END[@EPOCHS] (double every EPOCHS "
    "epochs, default 0.25), warmup:SMALL-TARGET@W+R (WarmupRamp: SMALL for W epochs, linear to TARGET "
    "over R epochs)"
)


# ------------------------------------------------------------------------------------------ policies
@dataclass(frozen=True)
class Policy:
    """A batch-size policy of the benchmark.

    Attributes:
        name: Canonical spec, e.g. ``"static:128"`` or ``"ramp:32-512"`` (the key in results).
        kind: ``"static"``, ``"ramp"`` or ``"warmup"``.
        batch_size: Size of the first step.
        end: Largest size (ramp, warmup); equal to ``batch_size`` for static.
        every_epochs: Ramp: epochs between doublings. Warmup: epochs at the small size.
        ramp_epochs: Warmup: epochs of the linear ramp.
    """

    name: str
    kind: str
    batch_size: int
    end: int
    every_epochs: float = 0.25
    ramp_epochs: float = 0.0

    def make_controller(self, num_samples: int) -> Any:
        """The controller that realises this policy for a dataset of ``num_samples`` (None: static)."""
        from ..controllers.schedules import MultiplicativeStep, WarmupRamp

        if self.kind == "static":
            return None
        if self.kind == "ramp":
            every = max(1, round(self.every_epochs * num_samples))
            return MultiplicativeStep(self.batch_size, 2, every_samples=every, max_size=self.end)
        return WarmupRamp(
            self.batch_size, self.end, warmup_epochs=self.every_epochs, ramp_epochs=self.ramp_epochs
        )


def _bad(spec: str, why: str) -> ValueError:
    return ValueError(f"bad policy {spec!r}: {why}. Valid forms: {_POLICY_HELP}.")


def _size(spec: str, text: str, what: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise _bad(spec, f"{what} {text!r} is not a whole number >= 1")
    return int(text)


def _epochs(spec: str, text: str, what: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _bad(spec, f"{what} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise _bad(spec, f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {text!r}")
    return value


def parse_policy(spec: str) -> Policy:
    """Parse one policy spec (see the module docstring).

    Raises:
        ValueError: the spec is malformed; the message lists the valid forms.
    """
    text = spec.strip().lower()
    if text == "ramp":
        text = "ramp:32-512"
    kind, _, arg = text.partition(":")
    if kind == "static":
        n = _size(spec, arg, "batch size")
        return Policy(f"static:{n}", "static", n, n)
    if kind == "ramp":
        m = re.fullmatch(r"(\w+)-(\w+)(?:@(.+))?", arg)
        if not m:
            raise _bad(spec, "a ramp is written ramp:START-END or ramp:START-END@EPOCHS")
        start, end = _size(spec, m[1], "start"), _size(spec, m[2], "end")
        if end <= start:
            raise _bad(spec, f"end {end} must be larger than start {start}")
        every = 0.25 if m[3] is None else _epochs(spec, m[3], "doubling interval", allow_zero=False)
        name = f"ramp:{start}-{end}" + ("" if m[3] is None else f"@{every:g}")
        return Policy(name, "ramp", start, end, every)
    if kind == "warmup":
        m = re.fullmatch(r"(\w+)-(\w+)@([^+]+)\+(.+)", arg)
        if not m:
            raise _bad(spec, "a warmup is written warmup:SMALL-TARGET@W+R, e.g. warmup:32-512@1+2")
        small, target = _size(spec, m[1], "small size"), _size(spec, m[2], "target size")
        warm = _epochs(spec, m[3], "warmup epochs", allow_zero=True)
        ramp = _epochs(spec, m[4], "ramp epochs", allow_zero=True)
        return Policy(f"warmup:{small}-{target}@{warm:g}+{ramp:g}", "warmup", small, target, warm, ramp)
    raise _bad(spec, f"unknown policy kind {kind!r}")


def parse_policies(specs: str | Sequence[str | Policy]) -> list[Policy]:
    """Parse a comma-separated string (or a list) of policy specs; :class:`Policy` objects pass through.

    Raises:
        ValueError: a spec is malformed, the list is empty, or a policy appears twice.
    """
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    items = [i.strip() if isinstance(i, str) else i for i in items]
    items = [i for i in items if i != ""]
    if not items:
        raise ValueError(f"no policy given; pass at least one of: {_POLICY_HELP}.")
    policies = [p if isinstance(p, Policy) else parse_policy(p) for p in items]
    names = [p.name for p in policies]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"policy {', '.join(duplicates)} is listed twice; list each policy once.")
    return policies


# ------------------------------------------------------------------------------------------- one run
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


class _Run:
    """The clock, the evaluations and the stopping rule of one run (a Pilot step callback)."""

    def __init__(self, model, test, num_samples, target, budget_s, eval_every, on_eval) -> None:
        self.model, self.test, self.num_samples = model, test, num_samples
        self.target, self.budget_s = target, budget_s
        self.eval_samples = max(1, round(eval_every * num_samples))
        self.next_eval = self.eval_samples
        self.on_eval = on_eval
        self.curve: list[dict[str, Any]] = []
        self.batch_sizes: list[dict[str, Any]] = []
        self.reached: dict[str, Any] | None = None
        self.done = False
        self.excluded = 0.0  # seconds of evaluation, not counted as training time
        self.start = 0.0
        self.stopped_at: float | None = None
        self.last = {"step": 0, "samples_seen": 0}
        self.eval_s = 0.0

    def train_time(self, now: float | None = None) -> float:
        return (time.perf_counter() if now is None else now) - self.start - self.excluded

    def begin(self, batch_size: int) -> None:
        self.batch_sizes.append({"step": 0, "samples_seen": 0, "time_s": 0.0, "batch_size": batch_size})
        self.evaluate(0.0, 0, 0, batch_size)
        self.start = time.perf_counter()

    def evaluate(self, t: float, step: int, samples: int, batch_size: int) -> float:
        t0 = time.perf_counter()
        acc = evaluate(self.model, self.test)
        self.eval_s += time.perf_counter() - t0
        point = {
            "time_s": t,
            "step": step,
            "samples_seen": samples,
            "epochs": samples / self.num_samples,
            "accuracy": acc,
            "batch_size": batch_size,
        }
        self.curve.append(point)
        if self.reached is None and acc >= self.target:
            self.reached = point
        self.on_eval(point, self)
        return acc

    def __call__(self, pilot: Any, record: dict[str, Any]) -> None:
        now = time.perf_counter()
        t = self.train_time(now)
        step, samples = record["step"], record["samples_seen"]
        self.last = {"step": step, "samples_seen": samples}
        # The policy's size for the step just done (record["batch/global_size"] is smaller for the last,
        # partial batch of an epoch), and the size of the next step (the decision has been made).
        current, size = self.batch_sizes[-1]["batch_size"], pilot.batch_size
        if size != current:
            self.batch_sizes.append({"step": step, "samples_seen": samples, "time_s": t, "batch_size": size})
        if samples >= self.next_eval:
            self.next_eval = (samples // self.eval_samples + 1) * self.eval_samples
            self.evaluate(t, step, samples, current)
            if self.reached is not None:
                self.done = True
        if t >= self.budget_s:
            self.done = True
        if self.done:
            self.stopped_at = t
        self.excluded += time.perf_counter() - now  # bookkeeping and evaluation are not training


def _train(
    workload: Workload,
    policy: Policy,
    seed: int,
    train: TensorDataset,
    test: TensorDataset,
    *,
    target: float,
    budget_s: float,
    eval_every: float,
    on_eval: Callable[[dict[str, Any], _Run], None],
    max_steps: int | None = None,
) -> dict[str, Any]:
    from ..engine import Pilot

    model = workload.build_model(seed)
    optimizer = workload.make_optimizer(model.parameters(), workload.base_lr)
    pilot = Pilot(
        model,
        optimizer,
        train,
        batch_size=policy.batch_size,
        controller=policy.make_controller(len(train)),
        lr_rule="linear",
        base_batch_size=workload.base_batch_size,
        seed=seed,
        progress=False,
    )
    run = _Run(model, test, len(train), target, budget_s, eval_every, on_eval)
    pilot.add_callback(run)
    loss_fn = workload.loss_fn
    model.train()
    run.begin(policy.batch_size)
    # A generous epoch limit: the callback stops the run (target reached or budget spent).
    batches = pilot.batches(epochs=1_000_000, max_steps=max_steps)
    try:
        for x, y in batches:
            if run.done:
                break
            pilot.backward(loss_fn(model(x), y))
    finally:
        batches.close()
        pilot.close()
    wall = run.stopped_at if run.stopped_at is not None else run.train_time()
    last = run.curve[-1]
    if last["samples_seen"] != run.last["samples_seen"]:  # the run ended between evaluations
        run.evaluate(wall, run.last["step"], run.last["samples_seen"], run.batch_sizes[-1]["batch_size"])
    reached = run.reached
    return {
        "policy": policy.name,
        "seed": seed,
        "time_to_target_s": None if reached is None else reached["time_s"],
        "steps_to_target": None if reached is None else reached["step"],
        "samples_to_target": None if reached is None else reached["samples_seen"],
        "epochs_to_target": None if reached is None else reached["epochs"],
        "final_accuracy": run.curve[-1]["accuracy"],
        "best_accuracy": max(p["accuracy"] for p in run.curve),
        "wall_s": wall,
        "eval_s": run.eval_s,
        "steps": run.last["step"],
        "samples": run.last["samples_seen"],
        "samples_per_s": run.last["samples_seen"] / wall if wall > 0 else None,
        # 1-minute load average at the end of the run: a busy machine explains a slow run.
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "batch_sizes": run.batch_sizes,
        "curve": run.curve,
    }


# --------------------------------------------------------------------------------------- the bench
def _median_or_none(values: list[float]) -> float | None:
    """Median where ``inf`` marks a run that missed the target; ``None`` if the median is not finite."""
    if not values:
        return None
    m = statistics.median(values)
    return m if math.isfinite(m) else None


def summarize(runs: list[dict[str, Any]], policies: Sequence[str] | None = None) -> tuple[dict[str, Any], str | None]:
    """Per-policy medians and ratios; returns ``(summary, best_static_policy)``.

    ``median_time_to_target_s`` counts missed runs as infinitely slow, so it is ``None`` unless more than
    half the runs reached the target. ``ratio_vs_best_static`` divides by the smallest such median among
    ``static:*`` policies (``None`` when either is undefined).
    """
    names = list(policies) if policies is not None else list(dict.fromkeys(r["policy"] for r in runs))
    summary: dict[str, Any] = {}
    for name in names:
        rs = [r for r in runs if r["policy"] == name]
        reached = [r for r in rs if r["time_to_target_s"] is not None]

        def med(key: str) -> float | None:
            return _median_or_none([math.inf if r.get(key) is None else float(r[key]) for r in rs])

        summary[name] = {
            "median_time_to_target_s": med("time_to_target_s"),
            "median_steps_to_target": med("steps_to_target"),
            "median_samples_to_target": med("samples_to_target"),
            "median_epochs_to_target": med("epochs_to_target"),
            "median_final_accuracy": statistics.median(r["final_accuracy"] for r in rs) if rs else None,
            "runs": len(rs),
            "runs_reached": len(reached),
            "ratio_vs_best_static": None,
        }
    statics = {
        n: s["median_time_to_target_s"]
        for n, s in summary.items()
        if n.startswith("static:") and s["median_time_to_target_s"] is not None
    }
    best = min(statics, key=statics.get) if statics else None  # type: ignore[arg-type]
    if best is not None and statics[best] > 0:
        for s in summary.values():
            t = s["median_time_to_target_s"]
            s["ratio_vs_best_static"] = None if t is None else t / statics[best]
    return summary, best


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _Progress:
    """One tqdm bar per run on a terminal (training seconds vs budget); else a line per evaluation."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.bar = None

    def start(self, label: str, budget_s: float) -> None:
        if not self.enabled:
            return
        self.label = label
        if self.tty:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                self.tty = False
            else:
                self.bar = tqdm(total=round(budget_s, 1), desc=label, unit="s", leave=False, file=sys.stderr,
                                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.0f} s train {postfix}")
                if getattr(self.bar, "disable", False):  # tqdm turned itself off: print lines instead
                    self.bar = None

    def on_eval(self, point: dict[str, Any], run: _Run) -> None:
        if not self.enabled:
            return
        text = f"epoch {point['epochs']:.2f} acc {point['accuracy']:.4f} B {point['batch_size']}"
        if self.bar is not None:
            self.bar.n = min(round(point["time_s"], 1), self.bar.total)
            self.bar.set_postfix_str(text, refresh=True)
        else:
            print(f"  {self.label}  t={point['time_s']:6.2f}s  {text}", file=sys.stderr, flush=True)

    def finish(self, line: str) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.enabled:
            print(line, flush=True)


def run_benchmark(
    workload: str | Workload,
    policies: str | Sequence[str],
    seeds: Sequence[int],
    target_accuracy: float | None = None,
    budget_s: float = 120.0,
    out_dir: str | os.PathLike = "bench-out",
    eval_every: float = 0.25,
    progress: bool = True,
    *,
    warmup: bool = True,
) -> dict[str, Any]:
    """Train ``workload`` under every policy for every seed and report the time to ``target_accuracy``.

    Args:
        workload: A registered name (``"mnist1d"``, ``"synthetic"``) or a :class:`Workload`.
        policies: Policy specs, a comma-separated string or a list (see :func:`parse_policy`).
        seeds: Run seeds (model initialisation and data order); the dataset itself is fixed.
        target_accuracy: Test accuracy to reach (default: the workload's).
        budget_s: Most *training* seconds per run (evaluation excluded).
        out_dir: Folder for ``results.json`` (rewritten after every run, so partial results survive).
        eval_every: Epochs of samples between evaluations.
        progress: Show progress and print one line per finished run.
        warmup: Run a short untimed warm-up first (allocator, kernels, caches).

    Returns:
        The results dict, also written to ``out_dir/results.json``: ``workload``, ``target_accuracy``,
        ``runs`` (per run: ``policy``, ``seed``, ``time_to_target_s`` (None if missed),
        ``steps_to_target``, ``samples_to_target``, ``epochs_to_target``, ``final_accuracy``, ``wall_s``,
        ``batch_sizes``, ``curve``, ...), ``summary`` (per policy: ``median_time_to_target_s``,
        ``ratio_vs_best_static``, ...), ``best_static_policy`` and ``config``.

    Raises:
        ValueError: unknown workload, malformed policy, no seeds, or a bad target/budget/eval_every.
    """
    wl = get_workload(workload)
    pols = parse_policies(policies)
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("no seeds given; pass at least one, e.g. seeds=[0].")
    target = wl.target_accuracy if target_accuracy is None else float(target_accuracy)
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target_accuracy must be in (0, 1], got {target_accuracy!r}.")
    if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s > 0):
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}.")
    if not (isinstance(eval_every, (int, float)) and math.isfinite(eval_every) and eval_every > 0):
        raise ValueError(f"eval_every must be a positive number of epochs, got {eval_every!r}.")
    out = Path(out_dir)

    show = _Progress(progress)
    if progress:
        print(f"batchpilot bench: building the {wl.name} data ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    train, test = wl.build_data(wl.data_seed)
    data_s = time.perf_counter() - t0
    if warmup:
        # Untimed: touch every batch size once so the first timed run does not pay one-off costs.
        for p in pols:
            _train(wl, Policy(p.name, "static", p.end, p.end), seeds[0], train, test, target=2.0,
                   budget_s=math.inf, eval_every=1e6, on_eval=lambda *_: None, max_steps=3)

    results: dict[str, Any] = {
        "workload": wl.name,
        "target_accuracy": target,
        "runs": [],
        "summary": {},
        "best_static_policy": None,
        "config": {
            "policies": [p.name for p in pols],
            "seeds": seeds,
            "budget_s": budget_s,
            "eval_every_epochs": eval_every,
            "lr_rule": "linear",
            "base_batch_size": wl.base_batch_size,
            "base_lr": wl.base_lr,
            "train_samples": len(train),
            "test_samples": len(test),
            "data_build_s": data_s,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "description": wl.description,
        },
    }
    total = len(seeds) * len(pols)
    index = 0
    for i, seed in enumerate(seeds):
        k = i % len(pols)
        for policy in pols[k:] + pols[:k]:  # seed-major, order rotated per seed
            index += 1
            label = f"[{index}/{total}] {policy.name} seed {seed}"
            show.start(label, budget_s)
            run = _train(wl, policy, seed, train, test, target=target, budget_s=budget_s,
                         eval_every=eval_every, on_eval=show.on_eval)
            results["runs"].append(run)
            results["summary"], results["best_static_policy"] = summarize(results["runs"], [p.name for p in pols])
            _write_json(out / "results.json", results)
            show.finish(_run_line(label, run, target))
    return results


def _run_line(label: str, run: dict[str, Any], target: float) -> str:
    if run["time_to_target_s"] is not None:
        what = (f"reached {target:.3f} in {run['time_to_target_s']:.2f} s ({run['steps_to_target']} steps, "
                f"{run['samples_to_target']} samples, {run['epochs_to_target']:.2f} epochs)")
    else:
        what = f"missed {target:.3f} in {run['wall_s']:.1f} s (best {run['best_accuracy']:.4f})"
    return f"{label}: {what}; final acc {run['final_accuracy']:.4f}"
