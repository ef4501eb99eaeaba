"""The state vector of seed 000's PPO policy, read from an :class:`~batchpilot.controllers.Observation`.

One function, two sources: :func:`features` reads the real observation a ``Pilot`` hands its controller and the
simulated one that :mod:`batchpilot.sim.episode` builds with the same ``stats`` keys, so a policy trained in the
simulator sees in training exactly the numbers it saw there. Every entry is finite and of order one; a missing
or non-finite input gives a neutral value and raises the flag of its group, never a NaN.

``B`` is the global batch size in force (``obs.batch_size``), ``B_up = clamp(2B)`` and ``B_down = clamp(B/2)``
the sizes the actions x2 and x0.5 lead to (clamped to ``[min_size, max_size]``, as the boundary clamps them),
``phi`` the gradient noise scale ``B_simple`` in samples (McCandlish et al. 2018), ``T(B)`` the engine's step
time model (:func:`batchpilot.controllers.goodput.step_time`: ``overhead + accum * (a + b * m)`` per rank, the
model Goodput reads), ``E(B) = (phi + B0) / (phi + B)`` the statistical efficiency (Pollux, Qiao et al. 2021).

=================  ==============================================================================  ===========
name               formula                                                                         range
=================  ==============================================================================  ===========
``batch_pos``      ``log2(B / min_size) / log2(max_size / min_size)`` (0 when min == max)         [0, 1]
``noise_ratio``    ``log10(phi / B) / 3`` (``stats/noise_scale``); 0 when missing                 [-1, 1]
``noise_missing``  1 when ``stats/noise_scale`` is absent, not finite or not positive             {0, 1}
``loss_trend``     least-squares slope of ``obs.losses`` x their count / mean loss (negative while  [-1, 1]
                   the loss falls); 0 with fewer than 4 finite losses or a mean of 0
``util``           ``system/gpu_util`` else ``system/cpu_util``, percent / 100; 0.5 when missing    [0, 1]
``mem``            ``system/gpu_mem_frac`` else ``system/mem_used_frac``; 0.5 when missing         [0, 1]
``system_missing`` 1 when neither utilisation key is there                                         {0, 1}
``world``          ``log2(dist/world_size) / 6`` (1 device: 0; 64 devices: 1)                      [0, 1.5]
``latency``        ``(log10(cluster/latency_s) + 6) / 4``; 0 on one device or when missing          [0, 1]
``comm``           ``cluster/comm_frac``: share of the step spent on the network; 0 when missing   [0, 1]
``healthy``        ``cluster/healthy_frac``; 1 when missing                                          [0, 1]
``load``           ``cluster/load``: background share of the bandwidth; 0 when missing              [0, 1]
``cluster_missing`` 1 when ``dist/world_size > 1`` and no ``cluster/*`` key is there               {0, 1}
``thr_up``         ``log2(thr(B_up) / thr(B))``, ``thr(B) = B / T(B)``; 0 when the model is missing [-1, 1]
``thr_down``       ``log2(thr(B_down) / thr(B))``                                                   [-1, 1]
``eff_up``         ``log2(E(B_up) / E(B)) = log2((phi + B) / (phi + B_up))``; 0 without ``phi``     [-1, 0]
``eff_down``       ``log2(E(B_down) / E(B))``                                                       [0, 1]
``gain_up``        ``thr_up + eff_up``: log2 of the goodput ratio of x2 (Pollux's criterion)        [-1, 1]
``gain_down``      ``thr_down + eff_down``: the same for x0.5                                        [-1, 1]
``perf_missing``   1 when ``perf/micro_time_a_s`` or ``perf/micro_time_b_s`` is missing             {0, 1}
=================  ==============================================================================  ===========

On one device (``dist/world_size`` 1 or absent) there is no network: ``latency``, ``comm`` and ``load`` are 0 and
``healthy`` 1 whatever the observation holds, so a real single-process run (no ``cluster/*`` keys) and a simulated
single-device one (which has them) give the same vector. ``B0`` cancels in every ratio, so it is not needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._adaptive import clamp, read_stat
from .base import Observation
from .goodput import step_time

__all__ = ["FEATURES", "features"]

FEATURES: tuple[str, ...] = (
    "batch_pos", "noise_ratio", "noise_missing", "loss_trend", "util", "mem", "system_missing", "world",
    "latency", "comm", "healthy", "load", "cluster_missing", "thr_up", "thr_down", "eff_up", "eff_down",
    "gain_up", "gain_down", "perf_missing",
)
"""Names of the entries of :func:`features`, in order (formulas and ranges in the module docstring)."""

MIN_LOSSES = 4
"""Fewest finite losses the trend is computed from."""


def features(obs: Observation, min_size: int, max_size: int) -> np.ndarray:
    """The policy's state vector for ``obs`` (float32, shape ``(len(FEATURES),)``, every entry finite).

    Args:
        obs: The observation (real or simulated).
        min_size, max_size: The bounds of every decision (the batch position and the sizes of the actions).

    Raises:
        ValueError: ``min_size`` or ``max_size`` is not an int >= 1, or ``min_size > max_size``.
    """
    if isinstance(min_size, bool) or isinstance(max_size, bool) or not isinstance(min_size, int) \
            or not isinstance(max_size, int) or not 1 <= min_size <= max_size:
        raise ValueError(
            f"features needs integer bounds 1 <= min_size <= max_size, got min_size={min_size!r}, "
            f"max_size={max_size!r}; pass the controller's bounds."
        )
    size = clamp(max(int(obs.batch_size), 1), min_size, max_size)
    up, down = clamp(2 * size, min_size, max_size), clamp((size + 1) // 2, min_size, max_size)
    out = dict.fromkeys(FEATURES, 0.0)
    span = math.log2(max_size / min_size)
    out["batch_pos"] = math.log2(size / min_size) / span if span > 0 else 0.0

    phi = _stat(obs, "stats/noise_scale")
    if phi is None or phi <= 0:
        out["noise_missing"] = 1.0
    else:
        out["noise_ratio"] = _clip(math.log10(phi / size) / 3.0, -1.0, 1.0)
        out["eff_up"] = math.log2((phi + size) / (phi + up))
        out["eff_down"] = math.log2((phi + size) / (phi + down))
    out["loss_trend"] = _loss_trend(obs.losses)

    util = _stat(obs, "system/gpu_util")
    if util is None:
        util = _stat(obs, "system/cpu_util")
    mem = _stat(obs, "system/gpu_mem_frac")
    if mem is None:
        mem = _stat(obs, "system/mem_used_frac")
    out["util"] = 0.5 if util is None else _clip(util / 100.0, 0.0, 1.0)
    out["mem"] = 0.5 if mem is None else _clip(mem, 0.0, 1.0)
    out["system_missing"] = 1.0 if util is None else 0.0

    world_stat = _stat(obs, "dist/world_size")
    world = 1 if world_stat is None or world_stat < 1 else int(world_stat)
    out["world"] = _clip(math.log2(world) / 6.0, 0.0, 1.5)
    out["healthy"] = 1.0
    if world > 1:
        latency = _stat(obs, "cluster/latency_s")
        comm, healthy, load = (_stat(obs, f"cluster/{k}") for k in ("comm_frac", "healthy_frac", "load"))
        if latency is not None and latency > 0:
            out["latency"] = _clip((math.log10(latency) + 6.0) / 4.0, 0.0, 1.0)
        out["comm"] = 0.0 if comm is None else _clip(comm, 0.0, 1.0)
        out["healthy"] = 1.0 if healthy is None else _clip(healthy, 0.0, 1.0)
        out["load"] = 0.0 if load is None else _clip(load, 0.0, 1.0)
        present = [v for v in (latency, comm, healthy, load) if v is not None]
        out["cluster_missing"] = 0.0 if present else 1.0

    model = _model(obs, world)
    if model is None:
        out["perf_missing"] = 1.0
    else:
        now = size / step_time(size, *model)
        out["thr_up"] = _clip(math.log2(up / step_time(up, *model) / now), -1.0, 1.0)
        out["thr_down"] = _clip(math.log2(down / step_time(down, *model) / now), -1.0, 1.0)
    out["gain_up"] = _clip(out["thr_up"] + out["eff_up"], -1.0, 1.0)
    out["gain_down"] = _clip(out["thr_down"] + out["eff_down"], -1.0, 1.0)
    return np.array([out[name] for name in FEATURES], dtype=np.float32)


def _stat(obs: Observation, key: str) -> float | None:
    """:func:`read_stat` with a fast path for a plain finite float."""
    value = obs.stats.get(key) if obs.stats is not None else None
    if type(value) is float:
        return value if math.isfinite(value) else None
    return None if value is None else read_stat(obs, key)


def _model(obs: Observation, world: int) -> tuple[float, float, float, int | None, int, int | None] | None:
    """``(a, b, overhead, max_micro, world, fixed_accum)`` of the engine's step-time model, or ``None`` when it is not fitted or
    predicts a zero step time (negative coefficients count as 0, as in Goodput)."""
    a, b = _stat(obs, "perf/micro_time_a_s"), _stat(obs, "perf/micro_time_b_s")
    if a is None or b is None:
        return None
    overhead = max(_stat(obs, "perf/step_overhead_s") or 0.0, 0.0)
    a, b = max(a, 0.0), max(b, 0.0)
    if a == 0.0 and b == 0.0 and overhead == 0.0:
        return None
    micro = _stat(obs, "perf/max_micro_batch_size")
    accum = _stat(obs, "perf/accumulation_steps")
    return (a, b, overhead, None if micro is None or micro < 1 else int(micro), world,
            None if accum is None or accum < 1 else int(accum))


def _loss_trend(losses: Sequence[float]) -> float:
    """Least-squares slope of the finite losses times their count, over their mean absolute value, in [-1, 1]."""
    try:
        y = np.asarray(losses, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return 0.0
    y = y[np.isfinite(y)]
    n = y.size
    if n < MIN_LOSSES:
        return 0.0
    scale = float(np.abs(y).sum()) / n
    if scale <= 0.0:
        return 0.0
    x = np.arange(n, dtype=np.float64) - (n - 1) / 2.0
    slope = float(np.dot(x, y)) / (n * (n * n - 1) / 12.0)  # sum(x) = 0, sum(x^2) = n (n^2 - 1) / 12
    return _clip(slope * n / scale, -1.0, 1.0)


def _clip(value: float, lo: float, hi: float) -> float:
    return lo if value < lo else hi if value > hi else float(value)
