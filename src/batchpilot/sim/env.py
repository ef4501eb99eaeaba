"""``BatchSizeEnv``: seed 000's batch-size decision as a gymnasium environment (one episode = one job to its target).

Needs the optional extra ``rl`` (gymnasium); ``import batchpilot.sim`` does not import this module.

* **Observation**: :func:`batchpilot.controllers.ppo_features.features` of the simulated
  :class:`~batchpilot.controllers.Observation` (:mod:`.episode` fills it with the engine's ``stats`` keys), the same
  function the PPO controller applies to the real one.
* **Actions**: ``actions[a]`` multiplies the global batch (default ``ACTIONS``: x0.5, x1, x2; the shipped policy
  was trained with ``WIDE_ACTIONS``, x1/4 ... x4), then the engine's boundary clamps it to ``[min_size, max_size]``;
  the job then runs ``interval`` steps. ``reset`` runs the first ``first_interval`` steps (default ``interval``) at the
  start size. The action set and both intervals are recorded in a trained policy's metadata, and
  :class:`~batchpilot.controllers.ppo.PPOController` reads them from there.
* **Reward** (seed 000's weights 0.6 / 0.3 / 0.1, ``reward_weights``): ``w_acc * acc + w_time * time + w_util * util``
  per decision, each term normalised so that it sums to order one over an episode:

  - ``acc = (metric after - metric before) / (target - metric at the start)``: sums to about 1 (the job ends at the
    target);
  - ``time = (t_ref(p1) - t_ref(p0) - dt) / T_ref`` with ``t_ref(p)`` the time the reference static batch
    (the trace's ``B0`` clamped to the bounds) needs to reach progress ``p`` on this cluster as it is at the start
    (``T(B_ref) * integral of dp / (B_ref E(B_ref, p))``), ``T_ref = t_ref(target)``, ``p`` capped at the target
    and ``dt`` the simulated seconds of the interval (up to the crossing): sums to ``1 - T / T_ref``;
  - ``util = u * dt / T_ref``, ``u`` the cluster's mean device utilisation over the interval: sums to
    ``mean u * T / T_ref``. Alone it would reward a slow job; with seed 000's weights a second saved is worth
    ``w_time - w_util * u >= 0.2 / T_ref``, so the sum still prefers the faster job.

  The sums run over the whole job: the first interval, run by ``reset`` at the start size before any decision, has
  its terms in ``reset``'s ``info["terms"]`` (they are the same for every policy). ``info["terms"]`` of a step holds
  its three unweighted terms.
* **Episodes**: with ``randomise=True`` each reset draws a trace (:meth:`Trace.perturbed`, scale ``perturb_scale``),
  a cluster (:func:`random_cluster`: 1-64 devices, heterogeneous speeds, network, day/night load, failures) and a
  start size (drawn again, up to ``REDRAWS`` times, when the job would end within its first interval, before any
  decision); otherwise the traces and clusters given are used in turn. :func:`held_out_cases` draws evaluation
  cases from a separate seed stream; ``BatchSizeEnv(cases=...)`` replays them in order. A job slower than
  :meth:`SimJob.default_time_limit` is truncated.

Deterministic given the ``seed`` of ``reset`` (or of the constructor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._extras import install_hint
from ..controllers.ppo_features import FEATURES, features
from .cluster import ClusterSpec, Device, Network
from .episode import LIMIT_FACTOR, SimJob, make_job
from .trace import Trace, load_trace, shipped_traces

try:
    import gymnasium as gym
    from gymnasium import spaces
except ImportError as exc:  # pragma: no cover - the rl extra is installed in the test environment
    raise ImportError(f"batchpilot.sim.env needs gymnasium: {install_hint('rl')}") from exc

__all__ = ["ACTIONS", "WIDE_ACTIONS", "BatchSizeEnv", "Case", "HELD_OUT_SEED", "held_out_cases", "random_cluster", "sample_case"]

ACTIONS: tuple[float, ...] = (0.5, 1.0, 2.0)
"""What each action multiplies the global batch by (seed 000's three actions; the environment's default)."""
WIDE_ACTIONS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
"""The shipped policy's actions: up to x4 per decision reaches the large batches many clusters want in a few
decisions (the true-model greedy bound on 40 held-out jobs: 1.083x the oracle against 1.129x with ``ACTIONS``, both
every 50 steps; 1.022x every 10 steps; docs/ppo.md)."""
REDRAWS = 20
"""Draws a randomised reset makes to find a job that does not end within its first interval (the last one is kept)."""
HELD_OUT_SEED = 20_261_206
"""Seed stream of :func:`held_out_cases` (training episodes draw from the reset seed's own stream)."""


@dataclass(frozen=True)
class Case:
    """One episode's workload, cluster, start size and seed (the cluster's load phase, failures, noise)."""

    trace: Trace
    spec: ClusterSpec
    start_size: int
    seed: int


def random_cluster(rng: np.random.Generator) -> ClusterSpec:
    """A random cluster for training: 1-64 devices (log-uniform) whose per-sample work is ``f`` times faster than the
    trace's recording device, its fixed cost per step unchanged (``ClusterSpec.speedup``; ``f`` log-uniform in
    [1, 100]: CPUs to GPUs), half the clusters heterogeneous (device speeds uniform in [1 - h, 1], ``h`` up to 0.6),
    latency 5 us-200 us and bandwidth 1-25 GB/s (log-uniform), background load with a
    mean up to 0.5 and a day/night amplitude up to the mean, a failure rate up to 0.05 per device-hour on a third
    of the clusters."""
    n = int(round(2 ** rng.uniform(0.0, 6.0)))
    fast = 10 ** rng.uniform(0.0, 2.0)
    hetero = rng.uniform(0.0, 0.6) if rng.random() < 0.5 else 0.0
    speeds = 1.0 - hetero * rng.random(n)
    mean = rng.uniform(0.0, 0.5)
    network = Network(latency_s=float(10 ** rng.uniform(math.log10(5e-6), math.log10(2e-4))),
                      bandwidth_Bps=float(10 ** rng.uniform(9.0, math.log10(2.5e10))), load_mean=float(mean),
                      load_amplitude=float(rng.uniform(0.0, min(mean, 0.9 - mean))))
    fail = float(rng.uniform(0.0, 0.05)) if rng.random() < 1 / 3 else 0.0
    return ClusterSpec(devices=tuple(Device(speed=float(s)) for s in speeds), network=network,
                       failure_rate_per_hour=fail, speedup=float(fast))


def sample_case(rng: np.random.Generator, traces: Sequence[Trace], clusters: Sequence[ClusterSpec] | None, *,
                min_size: int, max_size: int, perturb_scale: float = 0.3) -> Case:
    """A random :class:`Case`: a perturbed trace, a cluster (one of ``clusters``, else :func:`random_cluster`), a
    start size log-uniform in the bounds."""
    trace = traces[int(rng.integers(len(traces)))].perturbed(rng, perturb_scale)
    spec = clusters[int(rng.integers(len(clusters)))] if clusters else random_cluster(rng)
    start = int(round(2 ** rng.uniform(math.log2(min_size), math.log2(max_size))))
    return Case(trace, spec, min(max(start, min_size), max_size), int(rng.integers(2**31)))


def held_out_cases(traces: Sequence[Trace] | None = None, n: int = 20, *, seed: int = HELD_OUT_SEED,
                   min_size: int = 32, max_size: int = 4096, perturb_scale: float = 0.3) -> list[Case]:
    """``n`` evaluation cases drawn like the training ones but from their own seed stream (new perturbations,
    clusters and seeds); every case starts at the trace's base batch, as a user would."""
    pool = _traces(traces)
    rng = np.random.default_rng([seed, 1])
    cases = [sample_case(rng, pool, None, min_size=min_size, max_size=max_size, perturb_scale=perturb_scale)
             for _ in range(n)]
    return [Case(c.trace, c.spec, min(max(c.trace.base_batch_size, min_size), max_size), c.seed) for c in cases]


def _traces(traces: Sequence[Trace] | None) -> list[Trace]:
    if traces is None:
        traces = [load_trace(name) for name in shipped_traces()]
    pool = list(traces)
    if not pool or not all(isinstance(t, Trace) for t in pool):
        raise ValueError("BatchSizeEnv needs at least one Trace (none given and none shipped); pass traces=[...] "
                         "built with batchpilot.sim.trace.record_trace or load_trace.")
    return pool


class BatchSizeEnv(gym.Env):
    """The batch-size decision of one training job as a gymnasium environment (see the module docstring).

    Args:
        traces: Workloads (default: the shipped traces).  clusters: Cluster specs or their text (default:
            :func:`random_cluster` when randomising, else ``"cpu"``).
        interval: Steps per decision.  first_interval: Steps run by ``reset`` before the first decision (default
            ``interval``).  actions: The factors each discrete action multiplies the batch by (default ``ACTIONS``).
        min_size, max_size: Bounds of the global batch.
        reward_weights: ``(w_acc, w_time, w_util)``.  randomise: Draw perturbed traces, random clusters and start
            sizes (training); ``False``: the given ones in turn, each from its base batch.
        seed: Seed of the first reset when ``reset`` gets none.  cases: Fixed episodes to replay in order
            (:func:`held_out_cases`); overrides ``traces``/``clusters``/``randomise``.
        perturb_scale: Scale of :meth:`Trace.perturbed`.  observation_noise: Of the simulated statistics
            (:class:`~batchpilot.sim.episode.SimJob`; default 0.1 when randomising, else 0).
        time_limit_factor: An episode is truncated after this many times :meth:`SimJob.default_time_limit`'s
            bound (default ``LIMIT_FACTOR`` = 5).
    """

    metadata = {"render_modes": []}

    def __init__(self, traces: Sequence[Trace] | None = None, clusters: Sequence[ClusterSpec | str] | None = None,
                 *, interval: int = 50, min_size: int = 32, max_size: int = 4096,
                 reward_weights: tuple[float, float, float] = (0.6, 0.3, 0.1), randomise: bool = True,
                 seed: int | None = None, cases: Sequence[Case] | None = None, perturb_scale: float = 0.3,
                 observation_noise: float | None = None, time_limit_factor: float = LIMIT_FACTOR,
                 first_interval: int | None = None, actions: Sequence[float] = ACTIONS) -> None:
        super().__init__()
        first_interval = interval if first_interval is None else first_interval
        for name, value in (("interval", interval), ("first_interval", first_interval)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of steps >= 1, got {value!r}.")
        factors = tuple(float(a) for a in actions)
        if len(factors) < 2 or not all(math.isfinite(a) and a > 0 for a in factors):
            raise ValueError(f"actions must be >= 2 positive factors such as (0.5, 1, 2), got {actions!r}.")
        self.actions, self.first_interval = factors, first_interval
        if not (isinstance(min_size, int) and isinstance(max_size, int) and 1 <= min_size <= max_size):
            raise ValueError(f"need whole numbers 1 <= min_size <= max_size, got {min_size!r} and {max_size!r}.")
        weights = tuple(float(w) for w in reward_weights)
        if len(weights) != 3 or not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward_weights must be three finite numbers (acc, time, util), got {reward_weights!r}.")
        self.interval, self.min_size, self.max_size = interval, min_size, max_size
        self.reward_weights = weights
        self.cases = list(cases) if cases is not None else None
        self.traces = [] if self.cases is not None else _traces(traces)
        specs = [ClusterSpec.parse(c) if isinstance(c, str) else c for c in clusters] if clusters else None
        self.clusters: list[ClusterSpec] | None = specs if specs or randomise else [ClusterSpec.parse("cpu")]
        self.randomise = randomise and self.cases is None
        self.perturb_scale = perturb_scale
        if not (isinstance(time_limit_factor, (int, float)) and time_limit_factor > 0):
            raise ValueError(f"time_limit_factor must be a number > 0, got {time_limit_factor!r}; 5 is the default.")
        self.time_limit_factor = float(time_limit_factor)
        self.observation_noise = (0.1 if self.randomise else 0.0) if observation_noise is None else observation_noise
        self.observation_space = spaces.Box(low=-2.0, high=2.0, shape=(len(FEATURES),), dtype=np.float32)
        self.action_space = spaces.Discrete(len(factors))
        self._first_seed = seed
        self._episode = 0
        self.job: SimJob | None = None
        self.case: Case | None = None

    # ------------------------------------------------------------------------------------------ episodes
    def _next_case(self) -> Case:
        i = self._episode
        self._episode += 1
        if self.cases is not None:
            return self.cases[i % len(self.cases)]
        if self.randomise:
            return sample_case(self.np_random, self.traces, self.clusters, min_size=self.min_size,
                               max_size=self.max_size, perturb_scale=self.perturb_scale)
        assert self.clusters is not None
        trace = self.traces[i % len(self.traces)]
        spec = self.clusters[(i // len(self.traces)) % len(self.clusters)]
        return Case(trace, spec, min(max(trace.base_batch_size, self.min_size), self.max_size), i)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        """Start the next job and run its first ``first_interval`` steps at the start size; returns the first
        features."""
        if seed is None and self._first_seed is not None and self._episode == 0:
            seed = self._first_seed
        if seed is not None:
            self._episode = 0
        super().reset(seed=seed)
        for _ in range(REDRAWS):
            self.case = case = self._next_case()
            self.job = job = make_job(case.trace, case.spec, start_size=case.start_size, min_size=self.min_size,
                                      max_size=self.max_size, seed=case.seed, observation_noise=self.observation_noise,
                                      observe_system=bool(self.np_random.random() < 0.5) if self.randomise else True)
            self._reference(job)
            self._limit = job.default_time_limit(self.time_limit_factor)
            gap = case.trace.target - job.metric
            self._acc_span = gap if gap > 0 else 1.0  # a trace that starts at its target: acc is the raw change
            reward_terms = self._advance(job, self.first_interval)
            if not (job.done and self.randomise):
                break  # a random draw that ends before the first decision is drawn again
        obs = features(job.observe(), self.min_size, self.max_size)
        return obs, {"case": case, "terms": reward_terms, "reference_time_s": self.reference_time_s}

    def _reference(self, job: SimJob) -> None:
        """``t_ref(p)`` on the trace's progress grid (see the module docstring) and ``T_ref = t_ref(target)``."""
        trace = job.trace
        size = min(max(trace.base_batch_size, self.min_size), self.max_size)
        seconds = float(job.cluster.step_time(size).seconds)
        grid = np.union1d(trace.progress, [job.target])
        grid = grid[grid <= max(job.target, grid[0])]
        rate = seconds / (size * job.efficiency(size, grid))  # seconds per unit of progress
        self._ref_p = grid
        self._ref_t = np.concatenate([[0.0], np.cumsum(np.diff(grid) * (rate[1:] + rate[:-1]) / 2)])
        self.reference_size = size
        self.reference_time_s = max(float(self._ref_t[-1]), 1e-12)

    def _t_ref(self, progress: float) -> float:
        return float(np.interp(min(progress, self._ref_p[-1]), self._ref_p, self._ref_t))

    def _advance(self, job: SimJob, steps: int) -> dict[str, float]:
        """Run one interval; the unweighted reward terms of it (all 0 for a job that has already ended)."""
        if job.done:
            return {"acc": 0.0, "time": 0.0, "util": 0.0}
        p0, t0, m0 = job.progress, job.time_s, job.metric
        job.run(steps)
        t1 = job.time_to_target_s if job.done else job.time_s
        dt = t1 - t0
        util = float(job.history[-1]["utilization"]) if job.history else 0.0
        return {
            "acc": (job.metric - m0) / self._acc_span,
            "time": (self._t_ref(job.progress) - self._t_ref(p0) - dt) / self.reference_time_s,
            "util": (util if math.isfinite(util) else 0.0) * dt / self.reference_time_s,
        }

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        """Apply ``actions[action]``, run ``interval`` steps; ``(features, reward, terminated, truncated, info)``."""
        job = self.job
        if job is None:
            raise RuntimeError("call reset() before step()")
        if not self.action_space.contains(action):
            raise ValueError(f"action must be an index 0..{len(self.actions) - 1} of the factors {self.actions}, "
                             f"got {action!r}.")
        job.set_batch_size(max(int(round(job.batch_size * self.actions[int(action)])), 1), source="action")
        terms = self._advance(job, self.interval)
        w_acc, w_time, w_util = self.reward_weights
        reward = w_acc * terms["acc"] + w_time * terms["time"] + w_util * terms["util"]
        terminated = job.done
        truncated = not terminated and job.time_s >= self._limit
        obs = features(job.observe(), self.min_size, self.max_size)
        info = {"terms": terms, "batch_size": job.batch_size, "time_s": job.time_s}
        if terminated or truncated:
            info["time_to_target_s"] = job.time_to_target_s
            info["reference_time_s"] = self.reference_time_s
        return obs, float(reward), bool(terminated), bool(truncated), info
