"""The automatic mode's controller: start at the knee of the measured throughput curve, grow only when goodput
says a larger batch pays.

``Pilot(model, optimizer, data, batch_size="auto")`` uses :class:`Auto`. Before the first step the engine runs
the start probes (:mod:`batchpilot.engine.probes`): it times a few steps at doubling sizes, picks the knee with
:func:`pick_knee`, runs an LR range test at the knee, restores the pre-probe state and hands the outcome to
:meth:`Auto.start`. From then on :class:`Auto` decides like :class:`~batchpilot.controllers.Goodput` (Pollux's
throughput x statistical efficiency) over the sizes from the knee up, so it never goes below where it started.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .._validation import check_positive_int
from ._adaptive import check_real, check_size_bounds, check_state
from .base import Observation
from .goodput import Goodput

__all__ = ["Auto", "ProbeResult", "pick_knee", "resolve_auto_mode"]

DEFAULT_MIN, DEFAULT_MAX = 32, 4096
"""``Auto``'s bounds when none are given, in samples."""

BOUNDS = ("knee", "max_size", "dataset", "memory")
"""Why the throughput sweep stopped: a doubling bought too little (``"knee"``), or the next size would pass
``max_size``, leave an epoch fewer than ``min_epoch_steps`` steps (``"dataset"``), or ran out of memory."""


@dataclass(frozen=True)
class ProbeResult:
    """What the start probes found (``pilot.controller.probe``).

    Attributes:
        start_size: The knee: the global batch size the run starts at.
        throughput: ``((size, samples per second), ...)`` for each size the sweep timed, ascending.
        bound: What ended the sweep (see :data:`BOUNDS`).
        lr: The LR the run starts with at ``start_size`` (the range test's suggestion, or the optimizer's LR when
            the test's loss did not fall beyond its noise); ``None`` when the range test was skipped (an explicit
            ``lr_rule`` other than ``"auto"``: the optimizer's LR is kept).
        lr_at_min: The LR at the range test's smoothed-loss minimum (``None`` without a range test).
        seconds: Wall time of all probes (sweep, range test and restoring the pre-probe state).
        steps: Probe steps run (none of them is a training step).
        max_micro_batch_size: The micro-batch bound an out-of-memory probe set (``None``: memory never bound).
    """

    start_size: int
    throughput: tuple[tuple[int, float], ...]
    bound: str
    lr: float | None
    lr_at_min: float | None
    seconds: float
    steps: int
    max_micro_batch_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (for state dicts and logs)."""
        state = asdict(self)
        state["throughput"] = [[int(s), float(t)] for s, t in self.throughput]
        return state

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> ProbeResult:
        """The inverse of :meth:`to_dict`."""
        lr, at_min, micro = state["lr"], state["lr_at_min"], state.get("max_micro_batch_size")
        return cls(start_size=int(state["start_size"]),
                   throughput=tuple((int(s), float(t)) for s, t in state["throughput"]),
                   bound=str(state["bound"]), lr=None if lr is None else float(lr),
                   lr_at_min=None if at_min is None else float(at_min), seconds=float(state["seconds"]),
                   steps=int(state["steps"]), max_micro_batch_size=None if micro is None else int(micro))


def resolve_auto_mode(batch_size: Any, controller: Any) -> tuple[Any, Any, bool]:
    """``(first batch size, controller, whether the automatic mode is on)`` for a loop's ``batch_size`` and
    ``controller`` arguments: ``batch_size="auto"`` takes ``Auto()`` unless an :class:`Auto` is given, and starts at
    its ``min_size`` until the probes find the knee (``Pilot`` and the Lightning callback use this).

    Raises:
        ValueError: ``batch_size="auto"`` with another controller, or :class:`Auto` with another batch size.
    """
    if isinstance(batch_size, str) and batch_size == "auto":
        controller = Auto() if controller is None else controller
        if not isinstance(controller, Auto):
            raise ValueError(f"batch_size='auto' starts the automatic mode, whose controller is batchpilot.controllers"
                             f".Auto; got controller={controller!r}. Pass no controller (or Auto(...)), or give an "
                             "int batch_size to run that controller.")
        return controller.min_size, controller, True
    if isinstance(controller, Auto):
        raise ValueError(f"the Auto controller needs batch_size='auto' (it picks the first size itself): pass "
                         f"batch_size='auto', not batch_size={batch_size!r}, or use Goodput() with an int batch_size.")
    return batch_size, controller, False


def pick_knee(throughput: Sequence[tuple[int, float]], min_gain: float) -> tuple[int, bool]:
    """The knee of a throughput sweep at doubling sizes, and whether it is final (a doubling bought too little).

    Walk up the sizes while each one's throughput is at least ``min_gain`` times the current knee's; the first
    that falls short ends the walk. Why not "the smallest size within 5% of the best" (the bench's finder): on a
    loaded machine the best of a flat tail is noise, and that rule picked 4096 on mnist1d where 2048 already
    diverges. Here every step up must be *earned* by a clear gain over the size below: a timing made too fast
    by noise stops the walk early (a smaller, safer size), and one made too slow lets it go on by at most the
    next doubling, which must then earn its own gain.
    """
    if not throughput:
        raise ValueError("pick_knee() needs at least one (size, samples/s) measurement.")
    knee, best = throughput[0]
    for size, samples_per_s in throughput[1:]:
        if samples_per_s < min_gain * best:
            return knee, True
        knee, best = size, samples_per_s
    return knee, False


class Auto:
    """Start at the knee of the throughput curve with the LR of a range test there; then grow like Goodput.

    The settings of the start probes (read by :mod:`batchpilot.engine.probes`):

    Args:
        min_size, max_size: The sweep's first size and its upper bound; every later decision lies in
            ``[start size, max_size]``. Left out: 32 and 4096 samples, or with ``batch_unit="tokens"`` that many
            samples of the dataset's mean length in tokens (:meth:`count_tokens`).
        min_gain: A doubling of the batch must raise the measured throughput by at least this factor to be taken
            (default 1.2; see :func:`pick_knee`).
        timed_steps: Steps timed per size (the fastest gives the size's throughput), after ``warmup_steps``.
        warmup_steps: Untimed steps at each size first (allocator, kernels, a refilled prefetch).
        min_epoch_steps: The sweep stays at sizes that leave an epoch at least this many steps.
        lr_steps: Steps of the LR range test (Smith 2017) at the knee.
        lr_range: The range test's LRs, relative to the optimizer's LR (``(1e-3, 1e3)``: three decades either
            side).
        lr_fraction: The found LR is this fraction of the centre of the range test's loss valley.
        max_valley_span: A valley wider than this factor (its highest LR over its lowest) means the test's few
            steps cannot tell the LRs apart (Adam on a language model: 200x); the run then keeps the optimizer's
            LR, as when the loss did not fall beyond its noise.
        lr_anchor: Where the found LR sits on the LR curve ``lr (1 + B_simple / anchor) / (1 + B_simple / B)``
            (with ``lr_rule="auto"``): at the start size (``"start"``: the knee trains at the found LR) or at
            ``max_size`` (``"max_size"``: the found LR is the curve's top; the knee trains below it while the
            gradient noise is small).
        interval, switch_threshold, candidates, max_change, min_measurements: :class:`Goodput`'s, after the probes.

    Raises:
        TypeError, ValueError: a setting has the wrong type or is out of range (the message names it).
    """

    adaptive = True
    """It decides from measurements: the engine's rollback guard watches its changes."""
    recommended_lr_rule = "auto"
    """The LR rule ``lr_rule=None`` resolves to: the range test's LR on the AdaScale curve through the knee."""
    required_stats: tuple[str, ...] = Goodput.required_stats

    def __init__(
        self,
        min_size: int | None = None,
        max_size: int | None = None,
        *,
        min_gain: float = 1.2,
        timed_steps: int = 5,
        warmup_steps: int = 1,
        min_epoch_steps: int = 16,
        lr_steps: int = 100,
        lr_range: tuple[float, float] = (1e-3, 1e3),
        lr_fraction: float = 0.4,
        max_valley_span: float = 10.0,
        lr_anchor: str = "start",
        interval: int = 50,
        switch_threshold: float = 0.05,
        candidates: int = 50,
        max_change: float | None = 2.0,
        min_measurements: int = 10,
    ) -> None:
        self._defaults = (min_size is None, max_size is None)  # which bounds count_tokens() may rescale
        self.min_size, self.max_size = check_size_bounds(DEFAULT_MIN if min_size is None else min_size,
                                                         DEFAULT_MAX if max_size is None else max_size)
        self.min_gain = check_real(min_gain, "min_gain", low=1.0,
                                   hint=" It is a factor: 1.2 = a doubling must buy 20% more samples/s.")
        self.timed_steps = check_positive_int(timed_steps, "timed_steps")
        self.warmup_steps = check_positive_int(warmup_steps, "warmup_steps", minimum=0)
        self.min_epoch_steps = check_positive_int(min_epoch_steps, "min_epoch_steps")
        self.lr_steps = check_positive_int(lr_steps, "lr_steps", minimum=10)
        if not isinstance(lr_range, (tuple, list)) or len(lr_range) != 2:
            raise TypeError(f"lr_range must be a pair (low, high) of factors of the optimizer's LR, got {lr_range!r}.")
        low = check_real(lr_range[0], "lr_range[0]", low=0.0)
        high = check_real(lr_range[1], "lr_range[1]", low=0.0)
        if not low < 1.0 < high:
            raise ValueError(f"lr_range={lr_range!r} must hold the optimizer's LR strictly inside: low < 1 < high, "
                             "e.g. (1e-3, 1e3).")
        self.lr_range = (low, high)
        self.lr_fraction = check_real(lr_fraction, "lr_fraction", low=0.0, high=1.0, high_inclusive=True)
        self.max_valley_span = check_real(max_valley_span, "max_valley_span", low=1.0,
                                          hint=" It is a factor: 10 = the valley may span one decade of LR.")
        if lr_anchor not in ("start", "max_size"):
            raise ValueError(f"lr_anchor must be 'start' (the found LR is the knee's) or 'max_size' (it is the top of "
                             f"the LR curve, reached at max_size), got {lr_anchor!r}.")
        self.lr_anchor = lr_anchor
        self.interval, self.switch_threshold, self.candidates = interval, switch_threshold, candidates
        self.max_change, self.min_measurements = max_change, min_measurements
        self._goodput(self.min_size)  # Goodput checks its settings now: a bad one is refused here, not after probes
        self.name = "Auto"
        self.reason = "start probes not run yet"
        self.probe: ProbeResult | None = None
        self.goodput: Goodput | None = None

    def count_tokens(self, mean_length: float) -> None:
        """Count sizes in tokens (``batch_unit="tokens"``, before the probes): a bound left at its default becomes
        that many samples of ``mean_length`` tokens (the dataset's mean), so the sweep covers the same batches as
        in samples; a bound given is already a token count and stays."""
        if self.probe is not None:
            raise RuntimeError("count_tokens() comes before the start probes; this Auto has already started.")
        if not (math.isfinite(mean_length) and mean_length > 0):
            raise ValueError(f"mean_length must be a positive number of tokens per sample, got {mean_length!r}.")
        low = max(1, round(DEFAULT_MIN * mean_length)) if self._defaults[0] else self.min_size
        high = max(1, round(DEFAULT_MAX * mean_length)) if self._defaults[1] else self.max_size
        low, high = (min(low, high), high) if self._defaults[0] else (low, max(low, high))
        self.min_size, self.max_size = check_size_bounds(low, high)
        self._goodput(self.min_size)

    @property
    def last_table(self) -> dict[int, float]:
        """Goodput's table of its last evaluation (empty before one)."""
        return {} if self.goodput is None else self.goodput.last_table

    def start(self, probe: ProbeResult) -> None:
        """Take the probes' outcome: from now on decide like Goodput over ``[probe.start_size, max_size]``."""
        if not self.min_size <= probe.start_size <= self.max_size:
            raise ValueError(f"the probes' start size {probe.start_size} lies outside [min_size={self.min_size}, "
                             f"max_size={self.max_size}].")
        self.probe = probe
        self.goodput = self._goodput(probe.start_size)
        self.reason = f"start probes: knee {probe.start_size} ({probe.bound})"

    def _goodput(self, min_size: int) -> Goodput:
        return Goodput(min_size, self.max_size, candidates=self.candidates, switch_threshold=self.switch_threshold,
                       interval=self.interval, max_change=self.max_change, min_measurements=self.min_measurements)

    def decide(self, obs: Observation) -> int:
        """Keep the size until the probes ran; then Goodput's decision, never below the start size."""
        if self.goodput is None or self.probe is None:
            self.reason = f"start probes not run yet; kept {obs.batch_size}"
            return obs.batch_size
        decided = max(self.goodput.decide(obs), self.probe.start_size)
        self.reason = self.goodput.reason
        return decided

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: the probes' outcome and Goodput's state (``None`` before the probes)."""
        return {"name": self.name, "probe": None if self.probe is None else self.probe.to_dict(),
                "goodput": None if self.goodput is None else self.goodput.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (a state without probe results means: probe again)."""
        state = check_state(state, self.name, ("probe", "goodput"))
        if state["probe"] is None:
            self.probe, self.goodput, self.reason = None, None, "state loaded; start probes not run yet"
            return
        self.start(ProbeResult.from_dict(state["probe"]))
        assert self.goodput is not None
        if state["goodput"] is not None:
            self.goodput.load_state_dict(state["goodput"])
        self.reason = "state loaded"

    def __repr__(self) -> str:
        return (f"Auto(min_size={self.min_size}, max_size={self.max_size}, min_gain={self.min_gain!r}, "
                f"lr_fraction={self.lr_fraction!r})")
