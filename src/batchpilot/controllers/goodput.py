"""Pollux-style goodput: pick the batch size that maximises throughput x statistical efficiency."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .._validation import check_batch_size, check_positive_int
from ._adaptive import (
    check_interval,
    check_real,
    check_size_bounds,
    check_state,
    clamp,
    fmt,
    limit_step,
    optional_int,
    read_stat,
    round_half_up,
    warming_up,
)
from .base import Observation

__all__ = ["Goodput", "step_time"]

NOISE_SCALE_KEY = "stats/noise_scale"
A_KEY = "perf/micro_time_a_s"
B_KEY = "perf/micro_time_b_s"
OVERHEAD_KEY = "perf/step_overhead_s"
MAX_MICRO_KEY = "perf/max_micro_batch_size"
WORLD_KEY = "dist/world_size"
LEAD_SHARE_KEY = "dist/lead_share"
ACCUM_KEY = "perf/accumulation_steps"  # a fixed number of micro-batches per step (the HF / Lightning loops)


def step_time(
    batch_size: int, a: float, b: float, overhead: float = 0.0, max_micro: int | None = None,
    world_size: int | float = 1, fixed_accum: int | None = None,
) -> float:
    """Predicted seconds of one optimizer step at global batch ``batch_size`` (the engine's throughput model).

    Each of ``world_size`` ranks takes ``local = ceil(B / W)`` samples (with uneven ``rank_weights``, ``W`` is
    ``1 / share`` of rank 0, whose step times the model fits, and may be fractional). The training loop cuts them into
    ``fixed_accum`` micro-batches (Trainer's ``gradient_accumulation_steps``; 1 when ``None``) of
    ``ceil(local / fixed_accum)`` samples, and each of those into ``ceil(that / max_micro)`` passes (1 when
    ``max_micro`` is ``None``): ``accum`` forward/backward passes of ``m`` samples in all (for ``Pilot``,
    ``accum = ceil(local / max_micro)``, ``m = ceil(local / accum)``). A pass costs ``a + b * m`` seconds, and
    the step ``overhead + accum * (a + b * m)``.
    """
    local = -(-batch_size // world_size) if isinstance(world_size, int) else max(1, math.ceil(batch_size / world_size))
    loop = fixed_accum or 1
    per_loop = -(-local // loop)
    passes = 1 if max_micro is None else -(-per_loop // max_micro)
    micro = -(-per_loop // passes)
    return overhead + loop * passes * (a + b * micro)


class Goodput:
    """Maximise ``goodput(B) = throughput(B) x efficiency(B)`` over geometric candidates (Pollux).

    Qiao et al. 2021, "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep Learning"
    (OSDI '21, section 3.1; open-source as AdaptDL). Statistical efficiency is the progress per sample
    at batch ``B`` relative to the base batch ``B0``:

        ``E(B) = (phi + B0) / (phi + B)``

    with ``phi`` the gradient noise scale ``B_simple = tr(Sigma)/|G|^2`` in **samples** (McCandlish et
    al. 2018), read from ``stats/noise_scale``. Pollux's paper writes ``phi`` in ``B0`` units,
    ``E = (phi' + 1) / (phi' + B / B0)`` with ``phi' = phi / B0`` (AdaptDL stores the gradient variance
    of a ``B0``-sample batch, ``tr(Sigma)/B0``, hence its units); the two are the same number. It equals
    AdaScale's gain divided by the scale, ``r / (B / B0)`` (:func:`batchpilot.lr.adascale_gain`). ``B0`` only
    scales every candidate's goodput by the same factor, so it never changes the choice.

    Throughput is ``B / step_time(B)`` from the engine's fitted model (:func:`step_time`):
    ``perf/micro_time_a_s`` and ``perf/micro_time_b_s`` (required), ``perf/step_overhead_s``
    (default 0), ``perf/max_micro_batch_size`` (default: no limit), ``dist/world_size`` (default 1) and
    ``perf/accumulation_steps`` (a fixed number of micro-batches per step, given by the HF and Lightning
    integrations, each then cut into passes of at most ``max_micro``; default: as many as ``max_micro`` needs).
    Negative fitted coefficients are taken as 0.

    At the first call of each new period of ``interval`` steps (not once per epoch, AdaptDL's limit) it
    evaluates ``candidates`` geometrically spaced sizes in ``[min_size, max_size]`` plus the current
    size, and switches to the best only if its goodput exceeds the current size's by more than
    ``switch_threshold`` (relative; ties go to the smaller size), moving at most a factor ``max_change``
    towards it per decision. It waits until the noise scale rests on ``min_measurements`` measured steps. :attr:`last_table` holds the table of
    the last evaluation for logging. While a required stat is missing, the current size is kept and the
    period is not used up.

    Args:
        min_size, max_size: Bounds of every decision (AdaptDL needs a user-given memory bound too: pass
            the largest batch that your time budget allows; memory is handled by micro-batching).
        candidates: Number of geometric candidates (Pollux: 50), >= 2.
        switch_threshold: Relative improvement needed to switch (Pollux: 0.05).
        interval: Steps between decisions.
        base_size: ``B0`` of the efficiency; default the batch size at the first call.
        max_change: Most a single decision may multiply or divide the size by (``> 1``; default 2.0, so the
            coupled LR changes gradually too); ``None``: jump straight to the best candidate.
        min_measurements: Measured steps the noise-scale estimate must rest on before the first decision
            (default 10); 0: decide from the first.

    Attributes:
        reason: Why the last call decided what it did (the engine logs it).
        last_table: ``{candidate size: goodput}`` of the last evaluation (samples/s at ``B0``-equivalent
            progress), the current size included; empty before the first one. Not part of the state.

    Raises:
        TypeError, ValueError: an argument has the wrong type or is out of range.
    """

    required_stats: tuple[str, ...] = (NOISE_SCALE_KEY, A_KEY, B_KEY, OVERHEAD_KEY, MAX_MICRO_KEY, WORLD_KEY, ACCUM_KEY)
    """The ``obs.stats`` keys it reads (the engine switches the matching measurements on)."""
    adaptive = True
    """It decides from measurements: a Pilot's rollback guard watches its changes by default (docs/rollback.md)."""
    recommended_lr_rule = "adascale"
    """The LR coupling ``Pilot(lr_rule=None)`` uses with it: AdaScale's gain (Johnson et al. 2020), the LR
    counterpart of the efficiency ``E(B)`` it maximises (Pollux couples the two the same way)."""

    def __init__(
        self,
        min_size: int = 32,
        max_size: int = 4096,
        candidates: int = 50,
        switch_threshold: float = 0.05,
        interval: int = 50,
        base_size: int | None = None,
        max_change: float | None = 2.0,
        min_measurements: int = 10,
    ) -> None:
        self.min_size, self.max_size = check_size_bounds(min_size, max_size)
        self.candidates = check_positive_int(candidates, "candidates", minimum=2)
        self.switch_threshold = check_real(
            switch_threshold, "switch_threshold", low=0.0, low_inclusive=True,
            hint=" It is relative: 0.05 = switch only for a 5% better goodput.",
        )
        self.interval = check_interval(interval)
        self.base_size = None if base_size is None else check_batch_size(base_size, "base_size")
        self.sizes = _geometric(self.min_size, self.max_size, self.candidates)
        self.max_change = None if max_change is None else check_real(
            max_change, "max_change", low=1.0, hint=" 2.0 = at most double or halve per decision; None = no limit."
        )
        self.min_measurements = check_positive_int(min_measurements, "min_measurements", minimum=0)
        self.name = "Goodput"
        self.reason = "no decision yet"
        self.last_table: dict[int, float] = {}
        self._b0: int | None = None
        self._period = 0

    def efficiency(self, batch_size: int, noise_scale: float) -> float:
        """``E(B) = (phi + B0) / (phi + B)``, ``phi = noise_scale`` in samples (``B0`` set at the first call)."""
        b0 = self._b0 if self._b0 is not None else (self.base_size or batch_size)
        return (noise_scale + b0) / (noise_scale + batch_size)

    def decide(self, obs: Observation) -> int:
        """Return the global batch size of step ``obs.step`` (see the class docstring)."""
        global_batch_size = obs.batch_size
        if self._b0 is None:
            self._b0 = self.base_size if self.base_size is not None else global_batch_size
        noise = read_stat(obs, NOISE_SCALE_KEY)
        model = self._throughput_model(obs)
        if noise is None or noise <= 0 or isinstance(model, str):
            if isinstance(model, str):
                what = model
            else:
                what = f"{NOISE_SCALE_KEY} " + ("not measured yet" if noise is None else f"not positive ({fmt(noise)})")
            self.reason = f"{what}; kept {global_batch_size}"
            return global_batch_size
        waiting = warming_up(obs, self.min_measurements)
        if waiting is not None:
            self.reason = f"{waiting}; kept {global_batch_size}"
            return global_batch_size
        period = obs.step // self.interval
        if period <= self._period:
            self.reason = f"next decision at step {(self._period + 1) * self.interval}; kept {global_batch_size}"
            return global_batch_size
        self._period = period

        phi = noise  # narrowed to float above: the closure keeps the narrowing

        def goodput(candidate: int) -> float:
            return candidate / step_time(candidate, *model) * self.efficiency(candidate, phi)

        global_batch_size = clamp(global_batch_size, self.min_size, self.max_size)
        table = {s: goodput(s) for s in self.sizes}
        table.setdefault(global_batch_size, goodput(global_batch_size))
        self.last_table = dict(sorted(table.items()))
        best = max(self.sizes, key=lambda s: (table[s], -s))  # ties: the smaller size
        gain = table[best] / table[global_batch_size]
        prefix = (
            f"step {obs.step}: phi={fmt(phi)}, best {best} (goodput {fmt(table[best])}) vs {global_batch_size} "
            f"({fmt(table[global_batch_size])}): x{gain:.3f}"
        )
        if best != global_batch_size and table[best] > (1.0 + self.switch_threshold) * table[global_batch_size]:
            decided = limit_step(global_batch_size, best, self.max_change)
            limited = "" if decided == best or self.max_change is None else \
                f", limited to x{fmt(self.max_change)} per decision"
            self.reason = f"{prefix} > 1 + {fmt(self.switch_threshold)} -> {decided}{limited}"
            return decided
        self.reason = f"{prefix} <= 1 + {fmt(self.switch_threshold)}; kept {global_batch_size}"
        return global_batch_size

    def _throughput_model(self, obs: Observation) -> tuple[float, float, float, int | None, int | float, int | None] | str:
        """``(a, b, overhead, max_micro, world_size, fixed_accum)`` from ``obs.stats``, or a text saying what is
        missing."""
        a, b = read_stat(obs, A_KEY), read_stat(obs, B_KEY)
        if a is None or b is None:
            missing = [k for k, v in ((A_KEY, a), (B_KEY, b)) if v is None]
            return f"throughput model not fitted yet ({', '.join(missing)} not measured)"
        overhead = read_stat(obs, OVERHEAD_KEY)
        max_micro = read_stat(obs, MAX_MICRO_KEY)
        world = read_stat(obs, WORLD_KEY)
        if max(a, 0.0) == 0.0 and max(b, 0.0) == 0.0 and max(overhead or 0.0, 0.0) == 0.0:
            return f"throughput model predicts zero step time ({A_KEY}={a}, {B_KEY}={b}, {OVERHEAD_KEY}={overhead})"
        a, b, overhead = max(a, 0.0), max(b, 0.0), max(overhead or 0.0, 0.0)
        micro = None if max_micro is None or max_micro < 1 else int(max_micro)
        world_size: int | float = 1 if world is None or world < 1 else int(world)
        share = read_stat(obs, LEAD_SHARE_KEY)  # uneven rank_weights: rank 0 takes this share of each batch
        if share is not None and 0.0 < share < 1.0:
            world_size = 1.0 / share
        accum = read_stat(obs, ACCUM_KEY)
        return a, b, overhead, micro, world_size, None if accum is None or accum < 1 else int(accum)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: ``B0`` in use and the period of the last decision."""
        return {"name": self.name, "b0": self._b0, "period": self._period}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (:attr:`last_table` is refilled at the next decision)."""
        state = check_state(state, self.name, ("b0", "period"))
        self._b0 = optional_int(state["b0"])
        self._period = int(state["period"])
        self.last_table = {}
        self.reason = "state loaded"

    def __repr__(self) -> str:
        return (
            f"Goodput(min_size={self.min_size}, max_size={self.max_size}, candidates={self.candidates}, "
            f"switch_threshold={self.switch_threshold!r}, interval={self.interval}, base_size={self.base_size!r})"
        )


def _geometric(lo: int, hi: int, n: int) -> list[int]:
    """``n`` sizes spaced geometrically from ``lo`` to ``hi`` (both included), rounded, deduplicated."""
    if lo == hi:
        return [lo]
    ratio = math.log(hi / lo)
    sizes = {round_half_up(lo * math.exp(ratio * i / (n - 1))) for i in range(1, n - 1)}
    return sorted(sizes | {lo, hi})
