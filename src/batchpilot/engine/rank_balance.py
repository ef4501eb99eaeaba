"""Rank weights: each rank's share of a global batch in proportion to its speed (uneven clusters).

:class:`RankBalancer` estimates the weights online, as LB-BSP (Chen et al. 2018, arXiv 1806.02508) and Cannikin
(arXiv 2402.05302) size local batches to node speed: each rank measures its *compute* time per sample (time spent
waiting in collectives excluded), every few steps the ranks all-reduce their measurements, every rank folds
them into the same smoothed (EMA) rates, and the weights become proportional to the rates (rank 0's decision, which
every rank computes from the same exact numbers); they change only when a weight would move by more than
``hysteresis``. Weights proportional to the
rate measured at the current shares have a fixed point where every rank's compute time per step is equal
(``b_i / t_i(b_i)`` proportional to ``b_i`` means equal ``t_i``), also when a step has a fixed cost per rank.
Agreement costs one small all-reduce per re-estimate (see :meth:`RankBalancer.maybe_update`).

:class:`PilotRankWeights` is a `Pilot`'s part: the setting (``None``, a list or ``"auto"``), the timings it takes
from the accumulation, the weights it hands to the loader between steps, the log line of each change and the state.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .. import distributed as bpdist
from .._validation import check_positive_int
from ..data.shares import RankWeights, check_rank_weights, checked_weights, loaded_weights
from ..measure import MicroTimer

__all__ = ["PilotRankWeights", "RankBalancer", "check_rank_weights"]

logger = logging.getLogger("batchpilot")

_FORMAT = "batchpilot.RankBalancer"


class RankBalancer:
    """Online estimate of rank weights from each rank's measured compute speed, agreed through rank 0.

    Call :meth:`record` with each micro-batch's (or step's) samples and compute seconds on this rank, the time
    spent waiting in collectives excluded (e.g. the forward only under DDP, whose last backward waits in the
    all-reduce), and :meth:`maybe_update` on every rank after every step.

    Args:
        world_size, rank: The process group's size and this process's rank.
        every: Re-estimate ``every`` steps after the last change (a collective on those steps only); while the
            weights hold, the period doubles after each re-estimate, up to ``max_every``.
        max_every: The longest period (default ``16 * every``).
        smoothing: EMA weight of the old rate when a new window's rate is folded in (0: no smoothing).
        hysteresis: Change the weights only when a rank's proposed weight differs from its current one by more
            than this fraction.
        min_weight: No rank's weight falls below this share of the mean weight, so a slow rank keeps samples
            to be measured on.
        weights: The starting weights (``None``: even).

    Raises:
        TypeError, ValueError: an argument is out of range.
    """

    def __init__(self, world_size: int, rank: int, *, every: int = 10, max_every: int | None = None,
                 smoothing: float = 0.5, hysteresis: float = 0.05, min_weight: float = 0.05,
                 weights: Sequence[float] | None = None) -> None:
        self.world_size = check_positive_int(world_size, "world_size")
        self.rank = check_positive_int(rank, "rank", minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank={rank} must be < world_size={world_size}.")
        self.every = check_positive_int(every, "every")
        self.max_every = 16 * self.every if max_every is None else check_positive_int(max_every, "max_every")
        self.period = self.every  # steps from one re-estimate to the next
        self.next_step = self.every  # the step count after which the next re-estimate runs
        for name, value, top in (("smoothing", smoothing, 1.0), ("hysteresis", hysteresis, math.inf),
                                 ("min_weight", min_weight, 1.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < top:
                raise ValueError(f"{name} must be a number in [0, {top}), got {value!r}.")
        self.smoothing, self.hysteresis, self.min_weight = float(smoothing), float(hysteresis), float(min_weight)
        start = checked_weights(weights, world_size)
        self.weights: RankWeights = _mean_one(start) if start is not None else (1.0,) * world_size
        self.rates: list[float | None] = [None] * world_size  # smoothed samples per compute second, per rank
        self.changes = 0  # weight changes made
        self.estimates = 0  # re-estimates made (each one all-reduce)
        self.sync_seconds = 0.0  # time spent in this balancer's collectives
        self._samples = 0.0  # this rank's samples and compute seconds since the last estimate
        self._seconds = 0.0

    def record(self, samples: int, compute_seconds: float) -> None:
        """Add ``samples`` computed in ``compute_seconds`` on this rank (not counting waits in collectives)."""
        if samples > 0 and math.isfinite(compute_seconds) and compute_seconds > 0:
            self._samples += samples
            self._seconds += compute_seconds

    def due(self, step: int) -> bool:
        """Whether :meth:`maybe_update` after ``step`` steps is a collective (re-estimates)."""
        return self.world_size > 1 and step >= self.next_step

    def maybe_update(self, step: int) -> RankWeights | None:
        """After ``step`` steps, when due (:meth:`due`): gather the ranks' measurements, fold them into the rates
        and return the new weights when they changed (``None``: unchanged). Every rank must call this after every
        step with the same ``step``.

        One all-reduce per re-estimate: each rank fills its own slots, so the sums are exact and every rank folds
        bit-identical numbers into identical rates and computes rank 0's decision itself (no broadcast needed);
        the current weights ride along, so ranks whose weights differ are caught.

        Raises:
            RuntimeError: the ranks hold different weights (a rank loaded another state, or set its own).
        """
        if not self.due(step):
            return None
        started = time.perf_counter()
        self.estimates += 1
        n = self.world_size
        packed = torch.zeros(3 * n, dtype=torch.float64)
        packed[self.rank], packed[n + self.rank] = self._samples, self._seconds
        packed[2 * n:] = torch.tensor(self.weights, dtype=torch.float64) / n
        totals = bpdist.all_reduce_sum(packed).tolist()
        self._samples = self._seconds = 0.0
        if any(not math.isclose(t, w, rel_tol=1e-9) for t, w in zip(totals[2 * n:], self.weights)):
            raise RuntimeError(f"the ranks hold different rank weights (this rank, {self.rank}: {list(self.weights)}; "
                               f"the mean over ranks: {totals[2 * n:]}); every rank must load the same state.")
        self.fold(totals[:n], totals[n:2 * n])
        proposal = self.propose()
        self.sync_seconds += time.perf_counter() - started
        # While the weights hold, look less often (the collective's cost fades); after a change, soon again.
        self.period = self.every if proposal is not None else min(2 * self.period, self.max_every)
        self.next_step = step + self.period
        if proposal is None:
            return None
        self.weights = proposal
        self.changes += 1
        return self.weights

    def fold(self, samples: Sequence[float], seconds: Sequence[float]) -> None:
        """Fold one window's per-rank samples and compute seconds into the smoothed rates (ranks that computed
        nothing keep theirs)."""
        for i, (n, s) in enumerate(zip(samples, seconds)):
            if n > 0 and s > 0:
                rate, old = n / s, self.rates[i]
                self.rates[i] = rate if old is None else self.smoothing * old + (1 - self.smoothing) * rate

    def propose(self) -> RankWeights | None:
        """Weights proportional to the smoothed rates (mean 1, at least ``min_weight``, 4 decimals), or ``None``
        when no rank is measured yet or no weight would move by more than ``hysteresis``."""
        known = [r for r in self.rates if r is not None]
        if not known:
            return None
        mean_known = sum(known) / len(known)
        rates = [mean_known if r is None else r for r in self.rates]  # an unmeasured rank: the average
        target = _mean_one([max(w, self.min_weight) for w in _mean_one(rates)])
        target = tuple(round(w, 4) for w in target)
        if all(abs(t / w - 1) <= self.hysteresis for t, w in zip(target, self.weights)):
            return None
        return target

    def state_dict(self) -> dict[str, Any]:
        """The weights, the smoothed rates, the open window and the counters (JSON-serialisable)."""
        return {"format": _FORMAT, "world_size": self.world_size, "weights": list(self.weights),
                "rates": list(self.rates), "window": [self._samples, self._seconds], "changes": self.changes,
                "period": self.period, "next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; one saved under another world size starts over from even weights
        (logged: its rates belong to other ranks).

        Raises:
            ValueError: ``state`` is not a balancer state.
        """
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError("not a RankBalancer state; pass what RankBalancer.state_dict() returned.")
        if state["world_size"] != self.world_size:
            logger.warning("the rank balancer's state was saved with %d ranks, this run has %d: rank weights start "
                           "even again and are re-estimated", state["world_size"], self.world_size)
            self.weights, self.rates = (1.0,) * self.world_size, [None] * self.world_size
            self._samples = self._seconds = 0.0
            return
        weights = loaded_weights(state["weights"], self.world_size)
        self.weights = weights if weights is not None else (1.0,) * self.world_size
        self.rates = [None if r is None else float(r) for r in state["rates"]]
        self._samples, self._seconds = (float(v) for v in state["window"])
        self.changes = int(state["changes"])
        self.period = int(state.get("period", self.every))
        self.next_step = int(state.get("next_step", self.every))


def fold_and_update(balancer: RankBalancer, pending: list[tuple[int, Any]], loader: Any,
                    step: int) -> tuple[RankWeights | None, RankWeights | None]:
    """Fold a finished step's ``(samples, timing)`` pairs into ``balancer`` (``pending`` is emptied), re-estimate
    (a collective on the balancer's steps) and set new weights on ``loader``; return ``(old, new)`` weights
    (``new`` is ``None`` when they stay). Shared by the Pilot and the HF / Lightning integrations."""
    for samples, timing in pending:
        balancer.record(samples, MicroTimer.seconds(timing))
    pending.clear()
    old = loader.sampler.rank_weights
    new = balancer.maybe_update(step)
    if new is not None:
        loader.set_rank_weights(new)
    return old, new


def _call(method: weakref.WeakMethod) -> None:
    bound = method()
    if bound is not None:
        bound()


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _mean_one(values: Sequence[float]) -> RankWeights:
    """``values`` scaled to mean 1."""
    mean = sum(values) / len(values)
    return tuple(v / mean for v in values)


class PilotRankWeights:
    """A `Pilot`'s ``rank_weights`` setting at work (see :meth:`attach`).

    ``None``: even shares. A list: fixed weights, set on the loader (a resumed run keeps this setting). ``"auto"``:
    a :class:`RankBalancer` fed with each micro-batch's compute time: on a CPU from the forward's start to the
    backward's last accumulated gradient (a hook on each parameter), which leaves out DDP's wait for the all-reduce
    at the end of the backward; on a CUDA device CUDA events time the forward alone when DDP syncs in the backward
    (the backward is taken to scale like the forward), forward and backward when the engine reduces at the step's
    end. Its weights go to the loader between steps and each change is logged (an ``event`` line ``rank_weights``
    in the adjustment log). With one rank ``"auto"`` does nothing.
    """

    def __init__(self, setting: Any, *, loader: Any, world_size: int, rank: int, device: torch.device,
                 forward_only: bool, event: Any, params: Sequence[torch.nn.Parameter] = ()) -> None:
        self.setting = check_rank_weights(setting, world_size)
        self.loader, self.event = loader, event
        self.balancer = RankBalancer(world_size, rank) if self.setting == "auto" and world_size > 1 else None
        self.timer = MicroTimer(device)
        # On a CUDA device the GPU time comes from events: the forward alone where DDP's backward may wait.
        self.forward_only = forward_only and self.timer.cuda
        self._pending: list[tuple[int, float | tuple[Any, Any]]] = []  # this step's (samples, timing)
        self._started = 0.0
        self._last_grad: float | None = None  # (CPU) when the backward's last gradient was accumulated
        if self.balancer is not None and not self.timer.cuda:
            # The backward's compute ends with its last gradient, before DDP waits for the sync. The hooks hold
            # this part weakly and go when it goes (a later Pilot on the same model adds its own).
            ready = weakref.WeakMethod(self._grad_ready)
            handles = [p.register_post_accumulate_grad_hook(lambda _, ready=ready: _call(ready)) for p in params]
            weakref.finalize(self, _remove, handles)
        if isinstance(self.setting, tuple):
            loader.set_rank_weights(self.setting)

    @classmethod
    def attach(cls, pilot: Any) -> PilotRankWeights:
        """Build the part for ``pilot``: hooked into its accumulation, registered in its state."""
        part = cls(pilot.config.distributed.rank_weights, loader=pilot.loader, world_size=pilot.world_size,
                   rank=pilot.rank, device=pilot.device, forward_only=pilot._acc.ddp_syncs,
                   event=lambda kind, data: pilot._log.event(pilot.step, kind, data, warn=False),
                   params=[p for p in pilot.model.parameters() if p.requires_grad])
        if part.balancer is not None:
            pilot._acc.balance = part
        pilot._state.parts["rank_weights"] = part
        return part

    # ---------------------------------------------------------------- timings (from the accumulation)
    def _grad_ready(self) -> None:
        self._last_grad = time.perf_counter()

    def forward_starts(self, first: bool) -> None:
        """A micro-batch's forward starts (``first``: the step's first; a step run again starts over)."""
        if first:
            self._pending.clear()
        if self.timer.cuda:
            self.timer.start()
        else:
            self._started, self._last_grad = time.perf_counter(), None

    def before_backward(self, samples: int) -> None:
        """The forward of ``samples`` samples ended (the loss is there)."""
        if self.forward_only:
            self._pending.append((samples, self.timer.stop()))

    def after_backward(self, samples: int) -> None:
        """The backward returned: on a CPU the compute ended with the last gradient accumulated (a wait in DDP's
        all-reduce comes after it); on CUDA without DDP's sync the whole backward is compute."""
        if self.timer.cuda:
            if not self.forward_only:
                self._pending.append((samples, self.timer.stop()))
            return
        end = self._last_grad if self._last_grad is not None else time.perf_counter()
        self._pending.append((samples, end - self._started))

    # ---------------------------------------------------------------- between steps
    def after_step(self, step: int) -> RankWeights | None:
        """Record the finished step's timings and, with ``"auto"``, re-estimate (on every rank after every step)."""
        if self.balancer is None:
            return None
        old, new = fold_and_update(self.balancer, self._pending, self.loader, step)
        if new is not None:
            rates = [None if r is None else round(r, 3) for r in self.balancer.rates]
            self.event("rank_weights", {"old": None if old is None else list(old), "new": list(new),
                                        "samples_per_compute_s": rates, "source": "auto"})
        return new

    loads_missing_state = True  # a checkpoint from before rank weights: this Pilot's setting applies

    def state_dict(self) -> dict[str, Any]:
        return {"setting": self.setting if not isinstance(self.setting, tuple) else list(self.setting),
                "balancer": None if self.balancer is None else self.balancer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the loader's state (which holds the weights it shares by): a fixed setting is kept, ``None``
        shares evenly, ``"auto"`` continues the saved estimates (even again after a change of world size)."""
        loader = self.loader
        if self.balancer is not None:
            saved = state.get("balancer")
            if saved is not None:
                self.balancer.load_state_dict(saved)
            else:  # saved without "auto": start the estimate from the loaded weights
                self.balancer.weights = _mean_one(loader.sampler.rank_weights or (1.0,) * self.balancer.world_size)
            weights = self.balancer.weights
            loader.set_rank_weights(None if len(set(weights)) == 1 else weights)
            return
        here = self.setting if isinstance(self.setting, tuple) else None
        if loader.sampler.rank_weights != here:
            logger.warning("the checkpoint's global batches were shared with rank weights %s; continuing with this "
                           "Pilot's rank_weights=%s", loader.sampler.rank_weights, here)
            loader.set_rank_weights(here)
