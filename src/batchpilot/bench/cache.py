"""The bench's cache of static runs and calibrations, kept between invocations.

A static run (a fixed batch without a controller: ``static:N``, the cells of ``tuned-static``'s LR grid, the
finder's pick) trains the same steps on the same seed every time; only its wall time moves with the machine.
The LR grid is most of a full bench's time, so :class:`BenchCache` keeps every static run's result, and the
step-time calibration the runs' cost-model times were summed with, in a folder
(``$BATCHPILOT_BENCH_CACHE``, else ``$BATCHPILOT_CACHE/bench``, default ``~/.cache/batchpilot/bench``;
``batchpilot bench --cache-dir``). A later
bench with the same settings reads them instead of training again; adaptive policies and ``auto`` always
train (they are what is measured), and ``--no-cache`` trains everything.

A run's key is a hash of everything that determines it: the workload (name, description, data seed, base LR
and rule, bounds), the seed, the run spec (name, batch size, optimizer LR, LR rule, base batch size, gradient
statistics period), the target, target window, budget and evaluation interval, the torch thread count, the
device, the versions of batchpilot, torch and numpy, a hash of the source of every batchpilot module a static
run executes (all but the controllers, the integrations and the bench's reporting), and the calibration's own
hash. A calibration's key has the workload, the batch sizes, the timed steps, threads, device, versions and
code hash. Change any of them and the cache misses. What it cannot see: the machine's load and which machine of
a kind it runs on; the report marks every row read from the cache (``cached``), and the rows keep their own
``load_avg_1min``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .calibrate import Calibration
from .mnist1d import cache_dir
from .specs import RunSpec
from .workloads import Workload

__all__ = ["BenchCache", "code_hash", "default_cache_dir"]

# Modules a static run never executes: editing them must not throw the cached grid away.
_OFF_THE_STATIC_PATH = ("integrations/", "cli.py", "__main__.py", "_plotting.py", "bench/report.py", "bench/plots.py",
                        "bench/summary.py", "bench/progress.py", "bench/cache.py", "engine/probes.py", "engine/probe_core.py",
                        "lr/range_test.py")
_CONTROLLERS_USED = ("controllers/__init__.py", "controllers/base.py", "controllers/boundary.py")


def default_cache_dir() -> Path:
    """``$BATCHPILOT_BENCH_CACHE`` if set, else ``$BATCHPILOT_CACHE/bench`` (default ``~/.cache/batchpilot/bench``)."""
    env = os.environ.get("BATCHPILOT_BENCH_CACHE")
    return Path(env).expanduser() if env else cache_dir() / "bench"


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """sha256 of the source of every batchpilot module a static bench run executes (path and content)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(_OFF_THE_STATIC_PATH) or (rel.startswith("controllers/") and rel not in _CONTROLLERS_USED):
            continue
        digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _digest(material: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


class BenchCache:
    """Static runs and calibrations of one workload under one set of machine settings, in ``folder``.

    Args:
        folder: The cache folder (created on the first write).
        workload: The workload the bench trains.
        settings: What else determines a run (target, budget, evaluation, data sizes; see the module docstring).
        device: Where the bench trains.
    """

    def __init__(self, folder: str | os.PathLike, workload: Workload, settings: dict[str, Any],
                 device: torch.device) -> None:
        from .. import __version__

        self.folder = Path(folder) / workload.name
        self.machine = {
            "workload": [workload.name, workload.description, workload.data_seed, workload.base_lr,
                         workload.base_batch_size, workload.lr_rule, workload.min_batch_size, workload.max_batch_size],
            "threads": torch.get_num_threads(), "device": str(device), "processor": platform.processor(),
            "machine": platform.machine(), "batchpilot": __version__, "torch": torch.__version__,
            "numpy": np.__version__, "code": code_hash(),
        }
        self.settings = settings
        self.calibration_hash: str | None = None
        self.hits = 0

    # ------------------------------------------------------------------------------ calibration
    def _calibration_path(self, sizes: list[int], steps: int) -> Path:
        return self.folder / f"calibration-{_digest({**self.machine, 'sizes': sizes, 'steps': steps})}.json"

    def load_calibration(self, sizes: list[int], steps: int) -> Calibration | None:
        """The calibration a bench with these sizes and steps measured before (``None``: none, or damaged)."""
        data = _read(self._calibration_path(sizes, steps))
        if data is None:
            return None
        try:
            cal = Calibration.from_json(data)
        except (KeyError, TypeError, ValueError):
            return None
        self.use_calibration(cal)
        return cal

    def save_calibration(self, cal: Calibration, sizes: list[int], steps: int) -> None:
        """Keep ``cal`` (measured at ``sizes`` with ``steps`` timed steps) and key the runs to it."""
        _write(self._calibration_path(sizes, steps), cal.to_json())
        self.use_calibration(cal)

    def use_calibration(self, cal: Calibration) -> None:
        """Key the runs to ``cal``: their cost-model times were summed with it."""
        self.calibration_hash = _digest(cal.to_json())

    # ------------------------------------------------------------------------------ runs
    def _run_path(self, spec: RunSpec, seed: int) -> Path:
        material = {**self.machine, **self.settings, "seed": seed, "calibration": self.calibration_hash,
                    "spec": [spec.name, spec.batch_size, spec.optimizer_lr, spec.lr_rule, spec.base_batch_size,
                             spec.noise_every]}
        return self.folder / f"run-{_digest(material)}.json"

    def get(self, spec: RunSpec, seed: int) -> dict[str, Any] | None:
        """The cached result of ``spec`` on ``seed`` (marked ``"cached": True``), or ``None``. Only static runs are
        kept; what the run serves in this bench (``serves``, ``grid``) is taken from ``spec``."""
        if not spec.static:
            return None
        run = _read(self._run_path(spec, seed))
        if run is None or run.get("policy") != spec.name or run.get("seed") != seed:
            return None
        self.hits += 1
        return {**run, "serves": list(spec.policies), "grid": spec.grid, "cached": True}

    def put(self, spec: RunSpec, seed: int, run: dict[str, Any]) -> None:
        """Keep a static run's result (others are not kept)."""
        if spec.static:
            _write(self._run_path(spec, seed), {k: v for k, v in run.items() if k != "cached"})


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # missing, or damaged (a half-written file cannot happen: writes are atomic)
    return data if isinstance(data, dict) else None


def _write(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (a temporary file, then a rename: a reader sees the old file or the whole new one)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
    except OSError:  # a read-only cache folder: the bench goes on, only without keeping this result
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
