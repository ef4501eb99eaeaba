"""Online throughput model: seconds per micro-batch ``t(m) = a + b*m`` plus a per-step overhead.

Pollux (Qiao et al., OSDI 2021, its system-throughput model) models the time of one gradient computation on a micro-batch of
``m`` samples as ``T_grad = a + b*m`` and fits ``a`` and ``b`` to timings observed while training. We do the
same, online, with three choices that keep the fit stable under the way a training job produces data:

* **Per-size exponential forgetting.** Timings are pooled per micro-batch size: each size keeps an
  exponentially weighted mean of its timings (weight ``forget`` per new timing at that size, so it
  follows drift) and a weight that saturates at ``1 / (1 - forget)``. The line is a weighted least-squares
  fit through these per-size means, refitted when data arrives. Forgetting per observation across
  sizes would let thousands of timings at today's size erase the only timings at other sizes, and
  the slope with them.
* **Warm-up.** The first ``warmup`` timings of every new size are dropped: the first micro-batch of a new
  shape pays for allocation and kernel selection (oneDNN primitives, cuDNN benchmarking, the CUDA
  caching allocator) and can be many times slower than the next.
* **Physical constraints.** ``a >= 0`` and ``b >= 0`` (a noisy fit with a negative term is refitted with it
  at 0). With a single size observed, ``a`` and ``b`` cannot be told apart; the model then assumes
  ``a = 0`` (throughput independent of the micro-batch size), which predicts no gain from growing it.

A step of global batch ``B`` on ``W`` ranks with at most ``m_max`` samples per micro-batch runs
``accumulation_steps = ceil(ceil(B / W) / m_max)`` micro-batches of ``ceil(ceil(B / W) / accumulation_steps)``
samples, plus the per-step overhead (optimizer step, synchronisation, bookkeeping: everything outside
the micro-batches), smoothed by a bias-corrected EMA.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

__all__ = ["ThroughputModel"]


def _check_seconds(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}.")
    return float(value)


def _check_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    return int(value)


def _check_settings(forget: float, warmup: int, overhead_decay: float, max_sizes: int) -> None:
    problems = []
    if not (isinstance(forget, numbers.Real) and 0 <= forget < 1):
        problems.append(f"forget must be in [0, 1), got {forget!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        problems.append(f"warmup must be an int >= 0, got {warmup!r}")
    if not (isinstance(overhead_decay, numbers.Real) and 0 <= overhead_decay < 1):
        problems.append(f"overhead_decay must be in [0, 1), got {overhead_decay!r}")
    if isinstance(max_sizes, bool) or not isinstance(max_sizes, int) or max_sizes < 2:
        problems.append(f"max_sizes must be an int >= 2, got {max_sizes!r}")
    if problems:
        raise ValueError("invalid ThroughputModel arguments: " + "; ".join(problems) + ".")


class ThroughputModel:
    """Seconds per micro-batch ``a + b*m`` and per-step overhead, fitted online (Pollux's ``T_grad``).

    Args:
        forget: Weight of the past in each size's running mean, in ``[0, 1)``.
        warmup: Timings dropped at the start of every new micro-batch size.
        overhead_decay: EMA decay of the per-step overhead, in ``[0, 1)``.
        max_sizes: Most distinct micro-batch sizes remembered; the least recently observed is dropped.

    Raises:
        ValueError: an argument outside its range.
    """

    def __init__(self, forget: float = 0.9, warmup: int = 1, overhead_decay: float = 0.9, max_sizes: int = 64) -> None:
        _check_settings(forget, warmup, overhead_decay, max_sizes)
        self.forget, self.warmup = float(forget), warmup
        self.overhead_decay, self.max_sizes = float(overhead_decay), max_sizes
        # micro-batch size -> [timings seen, weight, weighted mean seconds, clock of the last timing]
        self._sizes: dict[int, list[float]] = {}
        self._clock = 0
        self._overhead_count = 0
        self._overhead_ema = 0.0
        self._fit: tuple[float, float] | None = None
        self._stale = True

    # ------------------------------------------------------------------ observations
    def observe_micro(self, micro_batch_size: int, seconds: float) -> None:
        """Record the time of one forward/backward on ``micro_batch_size`` samples (one rank).

        Raises:
            ValueError: ``micro_batch_size`` < 1 or ``seconds`` negative or not finite.
        """
        m, t = _check_int(micro_batch_size, "micro_batch_size"), _check_seconds(seconds, "seconds")
        self._clock += 1
        entry = self._sizes.get(m)
        if entry is None:
            if len(self._sizes) >= self.max_sizes:  # forget the size observed least recently
                del self._sizes[min(self._sizes, key=lambda k: self._sizes[k][3])]
                self._stale = True  # the fit must drop its timings too
            entry = self._sizes[m] = [0, 0.0, 0.0, 0]
        entry[0] += 1
        entry[3] = self._clock
        if entry[0] <= self.warmup:
            return
        weight = self.forget * entry[1] + 1.0
        entry[2] += (t - entry[2]) / weight  # exponentially weighted mean: newest weight 1, older ones * forget
        entry[1] = weight
        self._stale = True

    def observe_overhead(self, seconds: float) -> None:
        """Record the time of one step spent outside its micro-batches.

        Raises:
            ValueError: ``seconds`` negative or not finite.
        """
        t = _check_seconds(seconds, "seconds")
        self._overhead_count += 1
        self._overhead_ema = self.overhead_decay * self._overhead_ema + (1 - self.overhead_decay) * t

    def observe_step(self, micro_batch_sizes: Sequence[int], micro_seconds: Sequence[float],
                     step_seconds: float | None) -> None:
        """Record a whole step: each micro-batch, and ``step_seconds - sum(micro_seconds)`` (at least 0)
        as the overhead; ``step_seconds=None``: no overhead sample (a step whose time outside its
        micro-batches is not representative, one that started a data iterator, say).

        Raises:
            ValueError: lengths differ, or an invalid size or time.
        """
        if len(micro_batch_sizes) != len(micro_seconds):
            raise ValueError(
                f"{len(micro_batch_sizes)} micro-batch sizes but {len(micro_seconds)} timings; pass one timing per micro-batch."
            )
        if step_seconds is not None:
            step_seconds = _check_seconds(step_seconds, "step_seconds")
        for m, t in zip(micro_batch_sizes, micro_seconds):
            self.observe_micro(m, t)
        if step_seconds is not None:
            self.observe_overhead(max(step_seconds - sum(micro_seconds), 0.0))

    # ------------------------------------------------------------------ the fit
    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` in seconds and seconds per sample, or ``None`` before any timing past warm-up."""
        if self._stale:
            self._fit = self._refit()
            self._stale = False
        return self._fit

    def _refit(self) -> tuple[float, float] | None:
        points = [(m, e[1], e[2]) for m, e in sorted(self._sizes.items()) if e[1] > 0]  # (m, weight, mean time)
        if not points:
            return None
        sw = sum(w for _, w, _ in points)
        mx = sum(w * m for m, w, _ in points) / sw
        my = sum(w * t for _, w, t in points) / sw
        sxx = sum(w * (m - mx) ** 2 for m, w, _ in points)
        if len(points) >= 2 and sxx > 0:
            b = sum(w * (m - mx) * (t - my) for m, w, t in points) / sxx
            a = my - b * mx
            if b < 0:  # time falling with size is noise: flat line
                return my, 0.0
            if a >= 0:
                return a, b
        # One size only, or a negative intercept: the line through the origin, t = b*m.
        b = sum(w * m * t for m, w, t in points) / sum(w * m * m for m, w, _ in points)
        return 0.0, b

    @property
    def overhead(self) -> float:
        """Smoothed per-step overhead in seconds (0 until one is observed)."""
        if self._overhead_count == 0:
            return 0.0
        return self._overhead_ema / (1 - self.overhead_decay**self._overhead_count)

    def predict_micro_time(self, micro_batch_size: int) -> float | None:
        """``a + b*m`` seconds, or ``None`` before the first usable timing."""
        fit = self.fit()
        return None if fit is None else fit[0] + fit[1] * _check_int(micro_batch_size, "micro_batch_size")

    def predict_step_time(
        self, global_batch_size: int, world_size: int = 1, max_micro_batch_size: int | None = None
    ) -> float | None:
        """Predicted seconds of one step (``None`` before the first usable timing).

        ``local = ceil(B / W)``, ``accumulation_steps = ceil(local / m_max)`` (1 without ``m_max``),
        micro-batch ``m = ceil(local / accumulation_steps)``; time ``= overhead + accumulation_steps * (a + b*m)``.

        Raises:
            ValueError: a size or count < 1.
        """
        fit = self.fit()
        local = -(-_check_int(global_batch_size, "global_batch_size") // _check_int(world_size, "world_size"))
        accum = 1 if max_micro_batch_size is None else -(-local // _check_int(max_micro_batch_size, "max_micro_batch_size"))
        if fit is None:
            return None
        m = -(-local // accum)
        return self.overhead + accum * (fit[0] + fit[1] * m)

    def predict_throughput(
        self, global_batch_size: int, world_size: int = 1, max_micro_batch_size: int | None = None
    ) -> float | None:
        """Predicted samples per second at ``global_batch_size`` (``None`` before the first usable timing
        or when the predicted step time is 0)."""
        t = self.predict_step_time(global_batch_size, world_size, max_micro_batch_size)
        return None if t is None or t <= 0 else global_batch_size / t

    def metrics(self) -> dict[str, float]:
        """``perf/micro_time_a_s``, ``perf/micro_time_b_s`` (once fitted) and ``perf/step_overhead_s``
        (once observed)."""
        out: dict[str, float] = {}
        fit = self.fit()
        if fit is not None:
            out["perf/micro_time_a_s"], out["perf/micro_time_b_s"] = fit
        if self._overhead_count:
            out["perf/step_overhead_s"] = self.overhead
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot."""
        return {
            "forget": self.forget,
            "warmup": self.warmup,
            "overhead_decay": self.overhead_decay,
            "max_sizes": self.max_sizes,
            "clock": self._clock,
            "sizes": [[m, int(e[0]), float(e[1]), float(e[2]), int(e[3])] for m, e in sorted(self._sizes.items())],
            "overhead_count": self._overhead_count,
            "overhead_ema": self._overhead_ema,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: a field is out of range or not finite.
        """
        sizes = {int(m): [int(n), float(w), float(t), int(c)] for m, n, w, t, c in state["sizes"]}
        ema = float(state["overhead_ema"])
        if any(m < 1 or not (math.isfinite(e[1]) and math.isfinite(e[2])) for m, e in sizes.items()) or not math.isfinite(ema):
            raise ValueError(f"invalid ThroughputModel state {state!r}: sizes >= 1 and finite timings expected.")
        _check_settings(state["forget"], state["warmup"], state["overhead_decay"], state["max_sizes"])
        self.forget, self.warmup = float(state["forget"]), int(state["warmup"])
        self.overhead_decay, self.max_sizes = float(state["overhead_decay"]), int(state["max_sizes"])
        self._clock, self._sizes = int(state["clock"]), sizes
        self._overhead_count, self._overhead_ema = int(state["overhead_count"]), ema
        self._stale = True

    def __repr__(self) -> str:
        return f"ThroughputModel(fit={self.fit()}, overhead={self.overhead:.3g}s, sizes={sorted(self._sizes)})"
