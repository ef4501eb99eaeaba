"""The simulated training job: one run of a policy on a workload trace and a cluster, to the trace's target.

Pollux's simulator (Qiao et al., OSDI '21; ``adaptdl/simulator``) in steps: at global batch ``B`` one optimizer
step takes ``cluster.step_time(B)`` seconds and advances progress by ``B * E(B, progress)``, with the statistical
efficiency ``E(B) = (phi + B0) / (phi + B)`` and ``phi`` the trace's noise scale at that progress; the metric and the
loss are the trace's at the progress reached; the job ends when progress crosses :meth:`Trace.target_progress`
(the time to target is interpolated inside the step that crosses it).

Every ``interval`` steps the policy sees an :class:`~batchpilot.controllers.Observation` with the ``stats`` keys the
engine gives a controller in real training (:func:`observation_stats`), and its answer passes the engine's decision
boundary (:func:`batchpilot.controllers.validate_decision`: invalid values raise, sizes are clamped to
``[min_size, max_size]``). The batch size is constant between two decisions, so the steps of one interval are
simulated together: the step time is read once per interval (it depends on the clock only through the network's
background load, which moves on a scale of hours, and on failures, drawn by ``cluster.advance`` for the interval's
span), and the efficiency of each step is taken at the progress it starts from, found by fixed-point passes over
the interval (from the interval's first efficiency; at most ``FIXED_POINT_PASSES``, until nothing moves by 1e-9).

**Rescale cost.** Changing the global batch size on the same devices costs nothing here, on one device or many:
batchpilot's sampler plans the next step at the new size, no process restarts (Pollux's restart cost is for
changing the *devices* a job holds, which no policy here does). A device failure does cost the cluster's
``restart_s`` (the clock moves on in ``cluster.advance``; no progress is lost).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..controllers.base import Observation
from ..controllers.boundary import validate_decision
from .cluster import Cluster, ClusterSpec, StepTime
from .trace import Trace

__all__ = ["LOSS_HISTORY", "SimJob", "SimResult", "drive", "make_job", "observation_stats", "run_policy"]

LOSS_HISTORY = 50
"""Step losses an observation carries (the engine's default ``loss_history``)."""
FIXED_POINT_PASSES = 6
"""Most passes over an interval to find each step's efficiency at the progress it starts from."""
LIMIT_FACTOR = 5.0
"""The default time limit: this many times the slowest static run's bound (:meth:`SimJob.default_time_limit`)."""

Decide = Callable[[Observation], Any]


@dataclass
class SimResult:
    """The outcome of one simulated job.

    Attributes:
        policy: Name of the policy.
        time_to_target_s: Simulated seconds until the target was reached (``inf`` when it was not).
        reached: Whether the target was reached before the time limit.
        steps, samples: Optimizer steps and samples consumed.
        progress: Efficiency-weighted samples reached.
        history: One dict per interval (``time_s``, ``step``, ``progress``, ``batch_size``, ``step_time_s``,
            ``throughput``, ``efficiency``, ``goodput``, ``metric``, ``loss``, ``noise_scale``, ``utilization``,
            ``events``): what the plots of ``batchpilot simulate`` draw.
    """

    policy: str
    time_to_target_s: float
    reached: bool
    steps: int
    samples: int
    progress: float
    history: list[dict[str, Any]] = field(default_factory=list)

    def series(self, key: str) -> np.ndarray:
        """``history``'s ``key`` as an array (e.g. ``series("batch_size")`` against ``series("time_s")``)."""
        return np.array([h[key] for h in self.history], dtype=float)

    def ratio_to(self, other: SimResult) -> float:
        """This job's time to target over ``other``'s (``inf`` when this one did not reach it)."""
        return self.time_to_target_s / other.time_to_target_s


@dataclass
class SimJob:
    """The state of one simulated job; :meth:`run` moves it by a number of steps, :meth:`observe` builds the
    observation a controller sees, :meth:`set_batch_size` applies a decision through the engine's boundary,
    :meth:`state_dict` / :meth:`load_state_dict` save and restore it exactly.

    Args:
        trace: The workload.  cluster: The cluster it runs on (its clock is the job's clock).
        batch_size: The global batch size of the next step.  min_size, max_size: Bounds of every decision.
        seed: Seeds the observation noise.  observation_noise: Relative standard deviation of the noise added to
            the observed noise scale (log-normal) and losses (Gaussian, shrinking as ``sqrt(B0 / B)``); 0: the
            trace's values exactly.  observe_system: Put the cluster's ``system/*`` and ``cluster/*`` readings in
            the observation (real runs have them only with a system monitor).
    """

    trace: Trace
    cluster: Cluster
    batch_size: int
    min_size: int = 32
    max_size: int = 4096
    seed: int = 0
    observation_noise: float = 0.0
    observe_system: bool = True
    progress: float = 0.0
    time_s: float = 0.0
    steps: int = 0
    samples: int = 0
    metric: float = math.nan
    done: bool = False
    time_to_target_s: float = math.inf
    history: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.batch_size, _ = validate_decision(self.batch_size, current=1, min_size=self.min_size,
                                               max_size=self.max_size, source="start_size")
        self.target = self.trace.target_progress()
        self.time_s = self.cluster.time_s
        self.metric = float(np.interp(self.progress, self.trace.progress, self.trace.metric_values))
        self.losses: deque[float] = deque(maxlen=LOSS_HISTORY)
        self.rng = np.random.default_rng(self.seed)
        self.last_step_time: Any = None
        self.perf_cache: tuple[tuple[int, ...], dict[str, float]] | None = None
        self.done = self.progress >= self.target
        if self.done:
            self.time_to_target_s = self.time_s

    # ------------------------------------------------------------------------------------------ dynamics
    def efficiency(self, batch_size: float, progress: float | np.ndarray) -> Any:
        """``E(B) = (k phi + B0) / (k phi + B)`` at ``progress`` (array-friendly; :meth:`Trace.efficiencies`, with the
        trace's ``noise_scale_factor`` k: 1 unless the trace was fitted to static runs)."""
        return self.trace.efficiencies(batch_size, np.atleast_1d(np.asarray(progress, dtype=float))) \
            if np.ndim(progress) else self.trace.efficiency(batch_size, float(progress))

    def run(self, steps: int) -> None:
        """Run ``steps`` optimizer steps at the current batch size (fewer when the target is crossed)."""
        if self.done or steps < 1:
            return
        size = self.batch_size
        st = self.cluster.step_time(size)
        seconds = float(st.seconds)
        k = np.arange(steps, dtype=np.float64)
        guess = self.progress + k * size * self.efficiency(size, self.progress)  # progress before each step
        for _ in range(FIXED_POINT_PASSES):  # each step's efficiency at the progress it starts from
            gains = size * self.efficiency(size, guess)
            reached = self.progress + np.cumsum(gains)  # progress after each step
            moved = float(np.abs(guess[1:] - reached[:-1]).max()) if steps > 1 else 0.0
            guess[1:] = reached[:-1]
            if moved <= 1e-9 * reached[-1]:
                break
        n = steps
        crossing = math.inf
        if reached[-1] >= self.target:
            n = int(np.searchsorted(reached, self.target, side="left")) + 1
            before = reached[n - 2] if n > 1 else self.progress
            crossing = (n - 1) + (self.target - before) / gains[n - 1]
        start = self.time_s
        events = self.cluster.advance(n * seconds)
        self.time_s = self.cluster.time_s
        self.losses.extend(np.interp(reached[max(n - LOSS_HISTORY, 0):n], self.trace.progress, self.trace.loss))
        self.progress = float(reached[n - 1])
        self.steps += n
        self.samples += n * size
        self.metric = float(np.interp(self.progress, self.trace.progress, self.trace.metric_values))
        self.last_step_time = st
        efficiency = float(gains[:n].mean()) / size
        self.history.append({
            "time_s": self.time_s, "step": self.steps, "progress": self.progress, "batch_size": size,
            "step_time_s": seconds, "throughput": size / seconds, "efficiency": efficiency,
            "goodput": size * efficiency / seconds, "metric": self.metric, "loss": self.losses[-1],
            "noise_scale": float(np.interp(self.progress, self.trace.progress, self.trace.noise_scale)),
            "utilization": float(getattr(st, "utilization", math.nan)), "events": list(events),
        })
        if math.isfinite(crossing):
            self.done = True
            self.time_to_target_s = start + crossing / n * (self.time_s - start)

    def set_batch_size(self, value: Any, source: str = "policy") -> int:
        """Apply a decision the way the engine does (invalid values raise, sizes are clamped); returns the size."""
        self.batch_size, _ = validate_decision(value, current=self.batch_size, min_size=self.min_size,
                                               max_size=self.max_size, source=source)
        return self.batch_size

    # ------------------------------------------------------------------------------------------ observation
    def observe(self) -> Observation:
        """The observation a controller gets after the last step (see :func:`observation_stats`)."""
        n = self.trace.num_samples
        losses = tuple(self.losses)
        stats = observation_stats(self)
        if self.observation_noise > 0:
            sigma = self.observation_noise
            stats["stats/noise_scale"] *= float(np.exp(sigma * self.rng.standard_normal()))
            shrink = math.sqrt(self.trace.base_batch_size / self.batch_size)
            noisy = np.asarray(losses) * (1.0 + sigma * shrink * self.rng.standard_normal(len(losses)))
            losses = tuple(noisy.tolist())
        seconds = stats.get("perf/step_time_s")
        return Observation(
            step=self.steps, samples_seen=self.samples, epoch=self.samples // n, coverage=(self.samples % n) / n,
            batch_size=self.batch_size, num_samples=n, losses=losses,
            samples_per_s=None if not seconds else self.batch_size / seconds, stats=stats,
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically (the cluster's state included; JSON-able)."""
        last = self.last_step_time
        return {
            "batch_size": self.batch_size, "progress": self.progress, "time_s": self.time_s, "steps": self.steps,
            "samples": self.samples, "metric": self.metric, "done": self.done, "time_to_target_s": self.time_to_target_s,
            "losses": list(self.losses), "history": [dict(h) for h in self.history], "rng": self.rng.bit_generator.state,
            "last_step_time": None if last is None else [last.seconds, last.compute_s, last.network_s, last.utilization],
            "cluster": self.cluster.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a job built with the same trace, cluster spec and bounds."""
        missing = [k for k in ("batch_size", "progress", "time_s", "steps", "cluster") if k not in state]
        if missing:
            raise ValueError(f"SimJob state is missing {missing}; pass the dict returned by SimJob.state_dict().")
        self.cluster.load_state_dict(state["cluster"])
        self.batch_size, self.progress, self.time_s = int(state["batch_size"]), float(state["progress"]), \
            float(state["time_s"])
        self.steps, self.samples, self.metric = int(state["steps"]), int(state["samples"]), float(state["metric"])
        self.done, self.time_to_target_s = bool(state["done"]), float(state["time_to_target_s"])
        self.losses = deque((float(v) for v in state["losses"]), maxlen=LOSS_HISTORY)
        self.history = [dict(h) for h in state["history"]]
        self.rng.bit_generator.state = state["rng"]
        last = state["last_step_time"]
        self.last_step_time = None if last is None else StepTime(*(float(v) for v in last))
        self.perf_cache = None

    def default_time_limit(self, factor: float = LIMIT_FACTOR) -> float:
        """``factor`` (default ``LIMIT_FACTOR``) times the longest of three static runs' bounds (at ``min_size``, the current size and
        ``max_size``): ``target / (B * E_min(B)) * T(B)`` with the lowest efficiency over the trace and the step time
        at the current clock. A policy slower than that is hopeless."""
        phi = self.trace.noise_scale_factor * float(self.trace.noise_scale.min())
        bounds = []
        for size in {self.min_size, self.batch_size, self.max_size}:
            eff = (phi + self.trace.base_batch_size) / (phi + size)
            bounds.append(self.target / (size * eff) * float(self.cluster.step_time(size).seconds))
        return self.time_s + factor * max(bounds)


def observation_stats(job: SimJob) -> dict[str, float]:
    """The ``stats`` of a simulated observation, under the engine's names.

    * ``stats/noise_scale``, ``stats/grad_sq_norm``, ``stats/trace_cov``, ``stats/grad_variance``: the trace's
      ``noise_scale``, ``grad_sq`` and ``grad_var`` at the progress reached; ``stats/noise_count``: the steps run
      (as if every step were measured); ``grad/norm``: ``sqrt(|G|^2 + tr(Sigma) / B)``, the expected norm of a
      ``B``-sample gradient.
    * ``perf/micro_time_a_s``, ``perf/micro_time_b_s``, ``perf/step_overhead_s``, ``perf/max_micro_batch_size``,
      ``dist/world_size``: :meth:`Cluster.perf_stats` (what the engine's throughput model would report on the
      slowest healthy device); ``perf/step_time_s``, ``perf/samples_per_s``: the last step's.
    * ``system/*`` and ``cluster/*``: ``cluster.observation_stats()`` (with ``observe_system``; ``system/gpu_util``
      in percent, the engine monitor's unit).
    """
    trace, size = job.trace, job.batch_size
    at = trace.at(job.progress)
    stats: dict[str, float] = {
        "stats/noise_scale": at["noise_scale"], "stats/grad_sq_norm": at["grad_sq"], "stats/trace_cov": at["grad_var"],
        "stats/grad_variance": at["grad_var"], "stats/noise_count": float(job.steps),
        "stats/noise_scale_biased": 0.0, "grad/norm": math.sqrt(max(at["grad_sq"] + at["grad_var"] / size, 0.0)),
    }
    stats.update(_perf_stats(job))
    seconds = float(job.last_step_time.seconds) if job.last_step_time is not None else None
    if seconds:
        stats["perf/step_time_s"], stats["perf/samples_per_s"] = seconds, size / seconds
    system = job.cluster.observation_stats()
    if job.observe_system:
        stats.update({k: float(v) for k, v in system.items() if k.startswith(("system/", "cluster/"))})
    return stats


def _perf_stats(job: SimJob) -> dict[str, float]:
    """:meth:`Cluster.perf_stats`, kept while the healthy devices stay the same (its fit of the compute line depends
    on nothing else), with the overhead of the last step taken afresh: ``seconds - compute_s``."""
    healthy = tuple(job.cluster.healthy)
    cached = job.perf_cache
    if cached is None or cached[0] != healthy:
        cached = job.perf_cache = (healthy, job.cluster.perf_stats())
    out = dict(cached[1])
    last = job.last_step_time
    if last is not None:
        out["perf/step_overhead_s"] = float(last.seconds) - float(last.compute_s)
    return out


def run_policy(
    decide: Decide | Any,
    trace: Trace,
    spec: ClusterSpec | str,
    *,
    start_size: int,
    min_size: int = 32,
    max_size: int = 4096,
    interval: int = 50,
    seed: int = 0,
    time_limit_s: float | None = None,
    observation_noise: float = 0.0,
    observe_system: bool = True,
    name: str | None = None,
    first_interval: int | None = None,
) -> SimResult:
    """Run one simulated job with ``decide`` (a controller, or a callable ``Observation -> size``) asked after the
    first ``first_interval`` steps (default ``interval``) and then after every ``interval`` steps, until the target or
    ``time_limit_s`` simulated seconds (default :meth:`SimJob.default_time_limit`). ``seed`` seeds the cluster (load
    phase, failures) and the observation noise.
    """
    job = make_job(trace, spec, start_size=start_size, min_size=min_size, max_size=max_size, seed=seed,
                   observation_noise=observation_noise, observe_system=observe_system)
    call = getattr(decide, "decide", decide)
    label = name or getattr(decide, "name", None) or getattr(decide, "__name__", None) or type(decide).__name__
    return drive(job, lambda j: call(j.observe()), interval=interval, time_limit_s=time_limit_s, name=str(label),
                 first_interval=first_interval)


def make_job(trace: Trace, spec: ClusterSpec | str, *, start_size: int, min_size: int = 32, max_size: int = 4096,
             seed: int = 0, observation_noise: float = 0.0, observe_system: bool = True) -> SimJob:
    """A fresh :class:`SimJob` on a new :class:`Cluster` built from ``spec`` (a spec or its text) and ``seed``."""
    if isinstance(spec, str):
        spec = ClusterSpec.parse(spec)
    if isinstance(observation_noise, bool) or not isinstance(observation_noise, (int, float)) \
            or not observation_noise >= 0:
        raise ValueError(f"observation_noise must be a number >= 0, got {observation_noise!r}; 0 = exact values.")
    return SimJob(trace, Cluster(spec, trace, seed=seed), start_size, min_size=min_size, max_size=max_size, seed=seed,
                  observation_noise=float(observation_noise), observe_system=observe_system)


def drive(job: SimJob, choose: Callable[[SimJob], Any], *, interval: int = 50, time_limit_s: float | None = None,
          name: str = "policy", first: bool = False, first_interval: int | None = None) -> SimResult:
    """Run ``job`` to its end: ``first_interval`` steps (default ``interval``), then
    ``job.set_batch_size(choose(job))``, then ``interval`` steps and a decision, and again.

    ``first=True`` asks ``choose`` before the first step too (the oracle's privilege: real controllers see the first
    observation after some steps)."""
    first_interval = interval if first_interval is None else first_interval
    for label, value in (("interval", interval), ("first_interval", first_interval)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a whole number of steps >= 1, got {value!r}.")
    limit = job.default_time_limit() if time_limit_s is None else float(time_limit_s)
    if first and not job.done:
        job.set_batch_size(choose(job), source=name)
    steps = first_interval
    while not job.done and job.time_s < limit:
        job.run(steps)
        steps = interval
        if not job.done:
            job.set_batch_size(choose(job), source=name)
    return SimResult(policy=name, time_to_target_s=job.time_to_target_s, reached=job.done, steps=job.steps,
                     samples=job.samples, progress=job.progress, history=job.history)
