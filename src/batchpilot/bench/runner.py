"""Time to a target accuracy, for several batch-size policies side by side.

``run_benchmark`` trains a :class:`~batchpilot.bench.workloads.Workload` once per (seed, run spec), each
run from a fresh model and optimizer, through :class:`batchpilot.Pilot`. Policies are in
:mod:`.policies` and the run specs they expand to in :mod:`.specs`; one run in :mod:`.train`; the
step-time calibration (cost model, finder) in :mod:`.calibrate`; medians, the best static and targets
(a)(b)(c) in :mod:`.summary`.

Measurement rules:

* The clock counts *training* wall time only. Every ``eval_every`` epochs of samples (and once before the
  first step) the test accuracy is measured with the clock paused; a run stops at the first evaluation
  that reaches the target (``stop_reason`` ``"target"``; with ``target_window`` W > 1, the first at which
  the mean of the last W evaluations does, so that one lucky evaluation of a fluctuating curve does not
  count), when its training time exceeds ``budget_s``
  (``"budget"``), when it diverges (``"diverged"``: a non-finite loss, or 5 steps skipped for non-finite
  gradients), or when it is stuck (``"stalled"``: after 5 epochs its best accuracy is
  still within 0.1 of the accuracy at step 0, i.e. it never learned; a learning rate too large
  for the batch typically does this). A user running the grid would kill such a run early too.
* Time to target is therefore quantised to evaluation points; steps, samples, epochs and cost-model
  time to target are counted at the same point. The cost-model time is the sum of calibrated step times
  over the run's steps (see :mod:`.calibrate`): it does not move with the machine's load.
* Runs go seed-major (all run specs for seed 0, then all for seed 1, ...) so that slow drift of the
  machine hits every policy alike; the order is rotated by one for each seed so that no policy always
  runs first. The calibration before the first run doubles as the warm-up of every batch size.

``results.json`` holds, per run, ``batch_sizes``: the batch-size trace as a list of change points
``{"step", "samples_seen", "time_s", "batch_size"}`` (the size used from that step on; the first entry is
step 0), and ``curve``: the evaluations ``{"time_s", "cost_s", "step", "samples_seen", "epochs",
"accuracy", "batch_size", "noise_scale"}`` (``noise_scale``: the engine's ``stats/noise_scale`` where it
measured gradient statistics, else ``None``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .cache import BenchCache
from .calibrate import Calibration, calibrate, size_grid, warm_up
from .cluster_clock import MeasuredDevice, add_cluster_clock, parse_clock
from .policies import DESCRIPTIONS, POLICY_HELP, TUNE_FACTORS, Policy, parse_policies, parse_policy, workload_grid
from .progress import Progress, run_line
from .report import check_results
from .specs import Plan, expand
from .summary import finish_results, summarize
from .train import evaluate, train_one
from .workloads import Workload, get_workload

__all__ = ["Policy", "evaluate", "finish_results", "parse_policies", "parse_policy", "run_benchmark", "summarize",
           "write_json"]

DEFAULT_POLICIES = "default"
_POLICY_HELP = POLICY_HELP  # the foundation's name, kept for callers
# What must match for a resumed bench to continue an earlier one (runs of both are compared side by side).
RESUME_KEYS = ("policies", "seeds", "budget_s", "eval_every_epochs", "target_window", "lr_rule", "base_batch_size",
               "base_lr", "tune_factors", "smith_every_epochs", "min_batch_size", "max_batch_size", "train_samples",
               "test_samples", "torch", "torch_threads", "device")
# What a results.json written before a key existed meant by it.
_RESUME_DEFAULTS = {"device": "cpu", "target_window": 1}


def _previous(path: Path) -> dict[str, Any] | None:
    """The results.json an interrupted bench left in ``path`` (``None`` if there is none)."""
    if not path.exists():
        return None
    fix = "delete it or pass another --out to start afresh"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        Calibration.from_json(data["calibration"])
        runs, config = data["runs"], data["config"]
        if not isinstance(runs, list) or not isinstance(config, dict):
            raise TypeError("runs or config has the wrong type")
        check_results(data, path)  # every run has what the summary and the report read
        for i, run in enumerate(runs):
            if not isinstance(run["policy"], str) or isinstance(run["seed"], bool) or not isinstance(run["seed"], int):
                raise TypeError(f"run {i} has policy {run['policy']!r} and seed {run['seed']!r}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot resume from {str(path)!r}: it is not a complete bench results.json ({exc}); {fix}.") from None
    return data


def _check_resumable(previous: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    """Raise unless ``previous`` (an earlier results.json) was run with the settings of ``now``."""
    old = {"workload": previous.get("workload"), "target_accuracy": previous.get("target_accuracy"),
           **{k: previous["config"].get(k, _RESUME_DEFAULTS.get(k)) for k in RESUME_KEYS}}
    new = {"workload": now["workload"], "target_accuracy": now["target_accuracy"],
           **{k: now["config"].get(k) for k in RESUME_KEYS}}
    differ = [f"{k}: {old[k]!r} there, {new[k]!r} now" for k in old if old[k] != new[k]]
    if differ:
        raise ValueError(f"cannot resume from {str(path)!r}: it was run with other settings ({'; '.join(differ)}); "
                         "rerun with the same settings, or pass another --out to start afresh.")


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device that this machine has (``ValueError`` naming the fix otherwise)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc}); use e.g. 'cpu' or 'cuda'.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but torch.cuda.is_available() is False (no GPU, or a CPU build of "
                             "torch); use device='cpu' or install a CUDA build of torch.")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                             f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}.")
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r}: the bench runs on 'cpu' or 'cuda' devices.")
    return dev


def on_device(data: Any, device: torch.device) -> Any:
    """A TensorDataset with its tensors on ``device`` (the same object when they are there already)."""
    if all(t.device == device for t in data.tensors):
        return data
    return type(data)(*(t.to(device) for t in data.tensors))


# --------------------------------------------------------------------------------------- the bench
def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (a time never reached, a ratio to it) as ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file, then a rename: a kill never leaves half a
    file) as standard JSON, with every non-finite float as ``null``; creates the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(_finite(data), f, indent=1)  # standard JSON: no Infinity/NaN for other tools to choke on
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_benchmark(
    workload: str | Workload,
    policies: str | Sequence[str | Policy],
    seeds: Sequence[int],
    target_accuracy: float | None = None,
    budget_s: float | None = None,
    out_dir: str | os.PathLike = "bench-out",
    eval_every: float = 0.25,
    progress: bool = True,
    *,
    calibrate_steps: int = 4,
    tune_factors: Sequence[float] = TUNE_FACTORS,
    resume: bool = False,
    device: str | torch.device = "cpu",
    target_window: int = 1,
    cache_dir: str | os.PathLike | None = None,
    clock: str | None = None,
) -> dict[str, Any]:
    """Train ``workload`` under every policy for every seed and report the time to ``target_accuracy``.

    Args:
        workload: A registered name (``"mnist1d"``, ``"digits"``, ...) or a :class:`Workload`.
        policies: Policy specs or named sets, a comma-separated string or a list (see :mod:`.policies`).
        seeds: Run seeds (model initialisation and data order); the dataset itself is fixed.
        target_accuracy: Test accuracy to reach (default: the workload's).
        budget_s: Most *training* seconds per run (default: the workload's ``budget_s``).
        out_dir: Folder for ``results.json`` (rewritten after every run, so partial results survive).
        eval_every: Epochs of samples between evaluations.
        progress: Show progress and print one line per finished run.
        calibrate_steps: Timed steps per batch size and round in the calibration (3 rounds).
        tune_factors: The LR grid of ``tuned-static``, as multiples of the rule LR.
        resume: Continue the bench whose ``results.json`` is in ``out_dir`` (an interrupted one): keep its
            finished runs and its calibration (so the cost model stays the same), train only the missing
            (seed, run) pairs, and note the resumption in ``config["resumed"]``. The earlier run must have
            the same workload, target, policies, seeds, budget and machine settings (``RESUME_KEYS``).
            Without a ``results.json`` there it starts afresh.
        device: Where to train (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...): the data sets are moved there
            once and every model (calibration and runs) follows them. Evaluation time stays excluded.
        target_window: The target counts as reached at the first evaluation where the mean accuracy of the
            last ``target_window`` evaluations is at or above it (1: the first evaluation at or above it).
            Use 4-8 with a finer ``eval_every`` when the accuracy fluctuates around the target at a
            constant LR, so that one lucky evaluation does not decide (docs/benchmark.md#how-robust-is-time-to-target).
        cache_dir: Keep static runs and the calibration in this folder and reuse those an earlier bench with the
            same settings left there (:mod:`.cache`; such runs carry ``"cached": true``). ``None``: no cache.
        clock: ``"cluster:SPEC"``: also report the time to target the same runs would take on a simulated cluster
            (:mod:`.cluster_clock`; ``results["cluster_clock"]``, labelled simulated). ``None``: wall time and the
            cost model only.

    Returns:
        The results dict, also written to ``out_dir/results.json`` (schema in docs/benchmark.md):
        ``workload``, ``target_accuracy``, ``runs``, ``summary``, ``best_static_policy``, ``best_static``,
        ``grid_search_total_s``, ``grid_search``, ``untuned_default``, ``targets``, ``calibration``,
        ``finder``, ``members``, ``config``.

    Raises:
        ValueError: unknown workload, malformed policy, no seeds, or a bad target/budget/eval_every/target_window; with
            ``resume``, a ``results.json`` that is damaged or was run with other settings.
    """
    wl = get_workload(workload)
    pols = workload_grid(parse_policies(policies), wl.grid)
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("no seeds given; pass at least one, e.g. seeds=[0].")
    target = wl.target_accuracy if target_accuracy is None else float(target_accuracy)
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target_accuracy must be in (0, 1], got {target_accuracy!r}.")
    budget_s = wl.budget_s if budget_s is None else budget_s
    if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s > 0):
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}.")
    if not (isinstance(eval_every, (int, float)) and math.isfinite(eval_every) and eval_every > 0):
        raise ValueError(f"eval_every must be a positive number of epochs, got {eval_every!r}.")
    if isinstance(target_window, bool) or not isinstance(target_window, int) or target_window < 1:
        raise ValueError(f"target_window must be a positive int (evaluations averaged), got {target_window!r}; "
                         "1 counts the first evaluation at or above the target.")
    if clock is not None:
        parse_clock(clock)  # a bad spec fails before any training
    dev = resolve_device(device)
    out = Path(out_dir)
    show = Progress(progress)
    previous = _previous(out / "results.json") if resume else None

    show.note(f"batchpilot bench: building the {wl.name} data ...")
    t0 = time.perf_counter()
    train, test = (on_device(ds, dev) for ds in wl.build_data(wl.data_seed))
    data_s = time.perf_counter() - t0
    n = len(train)
    units, unit = dataset_units(wl, train)  # the sizes' unit: samples, or tokens (gpt)
    lo, hi = min(wl.min_batch_size, units), min(wl.max_batch_size, units)
    extra = [s for p in pols if p.batch_size for s in (p.batch_size, p.end)]
    largest = {p.name: max(s for s in (p.batch_size, p.end) if s) for p in pols if p.batch_size}
    too_big = [f"{name} ({most})" for name, most in largest.items() if most > units]
    if too_big:
        raise ValueError(f"batch sizes beyond the {wl.name} training set of {units} {unit}: {', '.join(too_big)}; a "
                         f"step cannot hold more {unit} than there are (the LR would be scaled for a batch that never "
                         f"trains). Use sizes up to {units}.")
    sizes = size_grid(lo, hi, extra)
    cache = None if cache_dir is None else BenchCache(cache_dir, wl, {
        "target": target, "budget_s": budget_s, "eval_every": eval_every, "target_window": target_window,
        "train_samples": n, "test_samples": len(test)}, dev)
    cached_cal = None if cache is None or previous is not None else cache.load_calibration(sizes, calibrate_steps)
    if previous is not None:
        cal = Calibration.from_json(previous["calibration"])
        show.note(f"resuming {out / 'results.json'}: {len(previous['runs'])} runs done; reusing its calibration "
                  "(after a throwaway pass at each size, as the calibration's was the first session's warm-up)")
        warm_up(wl, train, sizes)
    elif cached_cal is not None:
        cal = cached_cal
        show.note("reusing the cached calibration (after a throwaway pass at each size, the warm-up it gave before)")
        warm_up(wl, train, sizes)
    else:
        show.note(f"calibrating step times at batch sizes {', '.join(map(str, sizes))} ...")
        cal = calibrate(wl, train, sizes, steps=calibrate_steps)
        show.note(f"calibration took {cal.seconds:.1f} s")
        if cache is not None:
            cache.save_calibration(cal, sizes, calibrate_steps)
    if cache is not None and previous is not None:
        cache.use_calibration(cal)
    finder = cal.finder_size(hi, among=size_grid(lo, hi))  # not the sizes calibrated for the policies
    show.note(f"finder picks batch {finder}")

    plan = Plan(wl.base_lr, wl.base_batch_size, wl.lr_rule, units, lo, hi, finder, tuple(tune_factors),
                wl.smith_every_epochs)
    specs, members = expand(pols, plan)
    results: dict[str, Any] = {
        "workload": wl.name,
        "target_accuracy": target,
        "runs": [],
        "members": members,
        "policies": {p.name: {"category": p.category, "runs": members[p.name],
                              "description": DESCRIPTIONS.get(p.kind, "")} for p in pols},
        "calibration": cal.to_json(),
        "finder": {"batch_size": finder, "rule": "smallest size of the calibration grid (powers of two from the "
                   "smallest to the largest batch) within 5% of the best throughput",
                   "max_size": hi, "measure_s": cal.plain_seconds},
        "config": {
            "policies": [p.name for p in pols],
            "seeds": seeds,
            "budget_s": budget_s,
            "eval_every_epochs": eval_every,
            "target_window": target_window,
            "lr_rule": wl.lr_rule,
            "base_batch_size": wl.base_batch_size,
            "base_lr": wl.base_lr,
            "tune_factors": list(tune_factors),
            "smith_every_epochs": wl.smith_every_epochs,
            "min_batch_size": lo,
            "max_batch_size": hi,
            "train_samples": n,
            "test_samples": len(test),
            "data_build_s": data_s,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "cache_dir": None if cache is None else str(cache.folder),
            "calibration_cached": cached_cal is not None,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "description": wl.description,
        },
    }
    if previous is not None:
        _check_resumable(previous, results, out / "results.json")
        results["runs"] = previous["runs"]
        resumed = previous["config"].get("resumed", [])
        results["config"]["resumed"] = resumed + [{"after_runs": len(previous["runs"]),
                                                   "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]
    finish_results(results)
    done = {(r["policy"], r["seed"]) for r in results["runs"]}
    total = len(seeds) * len(specs)
    index = 0
    for i, seed in enumerate(seeds):
        k = i % len(specs)
        for spec in specs[k:] + specs[:k]:  # seed-major, order rotated per seed
            index += 1
            if (spec.name, seed) in done:
                continue
            label = f"[{index}/{total}] {spec.name} seed {seed}"
            run = None if cache is None else cache.get(spec, seed)
            if run is not None:
                label += " (cached)"
            else:
                show.start(label, budget_s)
                run = train_one(wl, spec, seed, train, test, target=target, budget_s=budget_s, eval_every=eval_every,
                                on_eval=show.on_eval, calibration=cal, target_window=target_window)
                if cache is not None:
                    cache.put(spec, seed, run)
            results["runs"].append(run)
            finish_results(results)
            write_json(out / "results.json", results)
            show.finish(run_line(label, run, target))
    if clock is not None:
        params = sum(p.numel() for p in wl.build_model(seeds[0]).parameters())
        add_cluster_clock(results, clock, MeasuredDevice.from_calibration(cal, 4 * params, hi))
    write_json(out / "results.json", results)  # also when a resumed bench had nothing left to train
    return _finite(results)  # what results.json holds: a target never reached is None, never inf


def dataset_units(wl: Workload, train: Any) -> tuple[int, str]:
    """The training set's size in the unit its batch sizes count: ``(len(train), "samples")``, or for a workload
    whose Pilot counts tokens (``gpt``) ``(its tokens, "tokens")``; the policies' epochs (``ramp``'s period, the
    bounds) are in that unit."""
    settings = wl.pilot_settings(train) if wl.pilot_settings is not None else {}
    if settings.get("batch_unit") == "tokens":
        return int(np.sum(np.asarray(settings["lengths"]))), "tokens"
    return len(train), "samples"
