"""How a global batch is shared over the ranks: evenly, or in proportion to per-rank weights.

With weights ``w`` each rank ``i`` gets ``B w_i / sum(w)`` samples, rounded by the largest remainder method
(Hamilton's): every rank first gets the floor of its quota, then the ranks with the largest fractional parts get
one more until the shares sum to ``B`` (ties go to the lower rank). The quotas are computed in exact rational
arithmetic from the float weights, so every rank computes the same shares on any platform. Shares are contiguous
slices of the global batch, in rank order, so the union over ranks is exactly the global batch.

Sizing local batches to node speed is the idea of LB-BSP (Chen et al. 2018, arXiv 1806.02508) and Cannikin
(arXiv 2402.05302); the step's gradient stays exact when rank ``i``'s loss is weighted ``b_i / B`` (docs/distributed.md).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence
from fractions import Fraction
from functools import lru_cache
from typing import Any

__all__ = ["check_rank_weights", "checked_weights", "largest_share", "loaded_weights", "share_bounds", "smallest_share",
           "weighted_bounds"]

logger = logging.getLogger("batchpilot")

RankWeights = tuple[float, ...]
"""One positive finite weight per rank (normalised by their sum when shares are cut)."""


def share_bounds(global_batch_size: int, rank: int, world_size: int,
                 weights: Sequence[float] | None = None) -> tuple[int, int]:
    """Return ``(start, stop)`` of ``rank``'s share inside a global batch of ``global_batch_size`` samples.

    Without ``weights`` shares are contiguous and differ by at most one sample: the first
    ``global_batch_size % world_size`` ranks get one extra. With ``weights`` (one per rank) the shares are
    proportional to them, rounded by the largest remainder (ties to the lower rank); equal weights give the even
    split. A rank's share may be empty (a batch smaller than the number of ranks, or a very small weight).
    """
    if weights is None:
        base, extra = divmod(global_batch_size, world_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)
    if len(weights) != world_size:
        raise ValueError(f"got {len(weights)} rank weights for world_size={world_size}; pass one weight per rank.")
    return weighted_bounds(global_batch_size, tuple(float(w) for w in weights))[rank]


@lru_cache(maxsize=256)
def weighted_bounds(global_batch_size: int, weights: RankWeights) -> tuple[tuple[int, int], ...]:
    """Every rank's ``(start, stop)`` in a global batch of ``global_batch_size`` shared in proportion to
    ``weights`` (the largest remainder method, in exact arithmetic; cached)."""
    exact = [Fraction(w) for w in weights]
    total = sum(exact)
    quotas = [global_batch_size * w / total for w in exact]
    sizes = [math.floor(q) for q in quotas]
    left = global_batch_size - sum(sizes)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in by_remainder[:left]:
        sizes[i] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return tuple(bounds)


def _sizes(global_batch_size: int, world_size: int, weights: Sequence[float] | None) -> list[int]:
    if weights is None:
        base, extra = divmod(global_batch_size, world_size)
        return [base + (1 if r < extra else 0) for r in range(world_size)]
    return [stop - start for start, stop in weighted_bounds(global_batch_size, tuple(float(w) for w in weights))]


def largest_share(global_batch_size: int, world_size: int, weights: Sequence[float] | None = None) -> int:
    """Samples of the largest rank share of a global batch (what sets the micro-batches of a step)."""
    return max(_sizes(global_batch_size, world_size, weights))


def smallest_share(global_batch_size: int, world_size: int, weights: Sequence[float] | None = None) -> int:
    """Samples of the smallest rank share of a global batch."""
    return min(_sizes(global_batch_size, world_size, weights))


def check_rank_weights(value: Any, world_size: int | None, *, allow_auto: bool = True) -> RankWeights | str | None:
    """Validate a ``rank_weights`` setting: ``None`` (even shares), ``"auto"`` (measured; only where
    ``allow_auto``) or one positive finite weight per rank; return ``None``, ``"auto"`` or a tuple of floats.
    ``world_size=None`` skips the length check (the world size is not known yet).

    Raises:
        TypeError: not ``None``, a string or a sequence of real numbers (a bool is no weight).
        ValueError: an unknown string, a weight that is zero, negative, NaN or infinite, or a number of weights
            other than ``world_size``.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value == "auto" and allow_auto:
            return "auto"
        choices = "None, 'auto' or a list of one weight per rank" if allow_auto else "None or one weight per rank"
        raise ValueError(f"rank_weights={value!r} is not a valid setting; pass {choices}, e.g. [1.0, 2.0].")
    if not isinstance(value, Sequence) and not _is_array(value):
        raise TypeError(f"rank_weights must be None, 'auto' or a list of one weight per rank, got {value!r} of type "
                        f"{type(value).__name__}; e.g. rank_weights=[1.0, 2.0] gives rank 1 twice rank 0's share.")
    weights = value.tolist() if _is_array(value) else list(value)
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise TypeError(f"rank_weights[{i}] is {w!r} of type {type(w).__name__}; each weight must be a positive "
                            "number (a rank's relative speed).")
        if not math.isfinite(float(w)) or float(w) <= 0:
            raise ValueError(f"rank_weights[{i}] is {w!r}; each weight must be a finite number > 0 (a rank that "
                             "should train nothing belongs outside the process group).")
    if not weights:
        raise ValueError("rank_weights is empty; pass one weight per rank, or None for even shares.")
    if world_size is not None and len(weights) != world_size:
        raise ValueError(f"rank_weights has {len(weights)} weights ({weights!r}) but world_size is {world_size}; "
                         "pass one weight per rank, or 'auto'.")
    return tuple(float(w) for w in weights)


def checked_weights(value: Any, world_size: int | None) -> RankWeights | None:
    """:func:`check_rank_weights` without ``"auto"``: ``None`` or one weight per rank, as a tuple of floats."""
    checked = check_rank_weights(value, world_size, allow_auto=False)
    assert not isinstance(checked, str)  # (allow_auto=False)
    return checked


def loaded_weights(saved: Any, world_size: int) -> RankWeights | None:
    """The rank weights of a loaded state (a list or ``None``): ``None``, with a logged note, when they were saved
    under another world size, whose weights say nothing about these ranks.

    Raises:
        ValueError: the saved weights are not valid weights (a corrupt state).
    """
    if saved is None:
        return None
    try:
        weights = checked_weights(saved, None)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the saved rank weights are invalid: {err}") from err
    if weights is not None and len(weights) != world_size:
        logger.warning("the state was saved with rank weights %s for %d ranks; this run has %d ranks, so global "
                       "batches are shared evenly from here on", list(weights), len(weights), world_size)
        return None
    return weights


def _is_array(value: Any) -> bool:
    """A numpy array or a 1-d tensor (sequences in all but name)."""
    return hasattr(value, "__len__") and hasattr(value, "tolist") and getattr(value, "ndim", 1) == 1
