"""Global batches counted in tokens (``batch_unit="tokens"``): how a token budget becomes samples, rank shares and
micro-batches.

**The rule at the budget.** A step takes the next samples of the epoch's order while their token sum stays
``<= budget``, and at least one sample (a sample longer than the budget is a step of its own). Samples are never
split or skipped, so a step holds at most ``budget`` tokens unless its only sample is longer, and an epoch's last
step takes what is left. The sampler still counts its position in samples, so coverage stays exact (each epoch
is its order, once) and a checkpoint resumes under any world size.

**Rank shares.** The global batch is cut into contiguous shares whose token counts are nearest to each rank's
quota (``T / world_size``, or ``T w_r / sum(w)`` with ``rank_weights``): each cut is the sample boundary nearest
its quota's cumulative target (ties to the lower boundary; exact integer/rational arithmetic, so every rank
computes the same cuts without communicating), so it is off its target by at most half a sample. A cut that would
leave a rank without a sample moves to the next boundary; a batch of fewer samples than ranks gives one sample to
each of the first ranks (the others run a ghost micro-batch, as in samples). Contiguous shares keep the order's
concatenation equal to the epoch's order (the sample mode's guarantee); the step's gradient is exact whatever the
split (:mod:`batchpilot.engine.accumulate` weights each micro-batch by its tokens over the global batch's tokens).
A non-contiguous split (longest-first to the emptiest rank) would balance a little better, at the price of that
guarantee and of a sort per step: here a rank's tokens are within one sample of its quota (half a sample at each
end), unless a cut moved to keep a rank non-empty (then, in random tests, within 1.6 samples).

**Micro-batches.** Every rank runs the same number ``A`` of micro-batches: the most any rank needs so that none
holds more than ``max_micro_batch_tokens`` tokens (a longer sample has one of its own) or ``max_micro_batch_size``
samples. Each rank then cuts its share into ``A`` contiguous parts with the smallest possible largest part (a
binary search over the greedy packing), so micro-batches are balanced in tokens too.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["TokenPlan", "TokenStep", "count_micro_batches", "plan_token_batch", "split_tokens", "token_lengths",
           "token_share_bounds"]

BATCH_UNITS = ("samples", "tokens")


def plan_token_batch(order: Sequence[int] | np.ndarray, offset: int, lengths: Sequence[int] | np.ndarray,
                     budget: int) -> int:
    """Return ``stop``: ``order[offset:stop]`` is the next global batch of ``budget`` tokens.

    It is the longest run of the order from ``offset`` whose token sum (``lengths[i]`` per dataset index ``i``)
    stays ``<= budget``, at least one sample, and never past the end of the order. A pure reference of the rule
    (:class:`TokenPlan` computes the same with cumulative sums, in O(log n) per step).

    Raises:
        ValueError: ``offset`` is outside the order, or ``budget`` < 1.
    """
    if not 0 <= offset < len(order):
        raise ValueError(f"offset={offset} is outside the order of {len(order)} samples.")
    if budget < 1:
        raise ValueError(f"budget={budget} tokens; a token budget must be >= 1.")
    total, stop = 0, offset
    while stop < len(order):
        total += int(lengths[int(order[stop])])
        if total > budget and stop > offset:
            break
        stop += 1
    return stop


def token_lengths(dataset: Any, lengths: Any, num_samples: int) -> np.ndarray:
    """The tokens of every sample, read once: ``lengths`` is a sequence of ints (one per sample), or the name of
    a dataset attribute holding one, or of a column of a Hugging Face ``datasets.Dataset`` (a column of
    sequences, ``"input_ids"`` say, gives their lengths; a column of ints, the ints). Returns a read-only int64
    array.

    Raises:
        TypeError, ValueError: ``lengths`` is missing, not found, of the wrong size, or holds a value that is not
            an integer >= 1 (the message names the first bad sample).
    """
    if lengths is None:
        raise ValueError("batch_unit='tokens' needs lengths=: a sequence with every sample's token count, or the "
                         "name of a dataset attribute or column holding it (e.g. lengths='input_ids').")
    if isinstance(lengths, str):
        lengths = _named_lengths(dataset, lengths)
    if isinstance(lengths, (bytes, bytearray)) or not (isinstance(lengths, Sequence) or hasattr(lengths, "__array__")):
        raise TypeError(f"lengths must be a sequence of ints (one per sample) or the name of a dataset attribute or "
                        f"column, got {type(lengths).__name__}.")
    array = np.asarray(lengths.tolist() if hasattr(lengths, "tolist") else list(lengths), dtype=object)
    if array.ndim != 1 or len(array) != num_samples:
        raise ValueError(f"lengths has {len(array) if array.ndim == 1 else f'shape {array.shape}'} entries but the "
                         f"dataset has {num_samples} samples; pass one token count per sample.")
    for i, value in enumerate(array):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"lengths[{i}] is {value!r} of type {type(value).__name__}; every length must be an int "
                            "(the sample's token count).")
        if value < 1:
            raise ValueError(f"lengths[{i}] is {value}; every sample needs at least one token (drop empty samples "
                             "from the dataset, or count a sample's special tokens too).")
    out = array.astype(np.int64)
    out.setflags(write=False)
    return out


def _named_lengths(dataset: Any, name: str) -> Any:
    """The lengths held by ``dataset``'s attribute or column ``name``."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, (list, tuple)) and name in columns:  # a Hugging Face datasets.Dataset: the column only
        values = dataset[name]
        return [len(v) for v in values] if len(values) and isinstance(values[0], (Sequence, np.ndarray)) else values
    if hasattr(dataset, name):
        value = getattr(dataset, name)
        return value() if callable(value) else value
    found = f"; its columns are {list(columns)}" if isinstance(columns, (list, tuple)) else ""
    raise ValueError(f"lengths={name!r} names no attribute or column of the dataset ({type(dataset).__name__}"
                     f"{found}); pass the name of one that holds every sample's token count, or the counts.")


def token_share_bounds(cumulative: np.ndarray, world_size: int,
                       weights: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Every rank's ``(start, stop)`` in a global batch whose cumulative token counts are ``cumulative``
    (``[0, l_0, l_0 + l_1, ...]``): contiguous shares, each cut at the sample boundary nearest its quota (see the
    module docstring)."""
    count = len(cumulative) - 1
    if count <= world_size:  # a sample per rank, the first ranks first (as in samples); the rest have none
        return [(min(r, count), min(r + 1, count)) for r in range(world_size)]
    cum = cumulative.tolist()
    total = cum[-1]
    cuts = [0]
    for r, (p, q) in enumerate(_quotas(world_size, None if weights is None else tuple(weights)), start=1):
        # the boundary c nearest total * p / q: the smallest |q c - total p| (exact integers), ties to the lower one
        j = bisect.bisect_left(cum, total * p // q)
        cut = min((c for c in (j - 1, j, j + 1) if 0 <= c <= count), key=lambda c: (abs(q * cum[c] - total * p), c))
        cuts.append(min(max(cut, cuts[-1] + 1), count - (world_size - r)))  # every rank keeps a sample
    cuts.append(count)
    return [(cuts[r], cuts[r + 1]) for r in range(world_size)]


@lru_cache(maxsize=64)
def _quotas(world_size: int, weights: tuple[float, ...] | None) -> tuple[tuple[int, int], ...]:
    """The cumulative quota before each rank ``1..world_size-1`` as a fraction ``(p, q)`` of the batch's tokens:
    ``r / world_size``, or the weights' prefix sum over their sum (exact, from the float weights)."""
    if weights is None:
        return tuple((r, world_size) for r in range(1, world_size))
    exact = [Fraction(w) for w in weights]
    fractions = [sum(exact[:r], Fraction(0)) / sum(exact) for r in range(1, world_size)]
    return tuple((f.numerator, f.denominator) for f in fractions)


def _greedy_parts(cumulative: list[int], capacity: int, max_samples: int | None) -> list[int]:
    """Cut points of the greedy contiguous packing into parts of at most ``capacity`` tokens (a longer sample
    alone) and ``max_samples`` samples (``cumulative`` as a list: bisect beats numpy on a few dozen numbers)."""
    count, start, cuts = len(cumulative) - 1, 0, [0]
    while start < count:
        stop = max(bisect.bisect_right(cumulative, cumulative[start] + capacity) - 1, start + 1)
        if max_samples is not None:
            stop = min(stop, start + max_samples)
        cuts.append(min(stop, count))
        start = cuts[-1]
    return cuts


def count_micro_batches(cumulative: np.ndarray, max_tokens: int | None, max_samples: int | None) -> int:
    """The fewest contiguous micro-batches of a share (cumulative token counts ``cumulative``) with at most
    ``max_tokens`` tokens and ``max_samples`` samples each (``None``: no bound); 1 for an empty share."""
    if len(cumulative) <= 1 or (max_tokens is None and max_samples is None):
        return 1
    capacity = int(cumulative[-1]) if max_tokens is None else max_tokens
    return max(1, len(_greedy_parts(cumulative.tolist(), capacity, max_samples)) - 1)


def split_tokens(cumulative: np.ndarray, parts: int, max_samples: int | None = None,
                 max_tokens: int | None = None) -> list[tuple[int, int]]:
    """Cut a share (cumulative token counts ``cumulative``) into exactly ``parts`` contiguous pieces whose largest
    token count is the smallest possible (with at most ``max_samples`` samples each, where ``parts`` allows); with
    fewer samples than parts, one sample per piece and empty pieces last. ``max_tokens``: a bound that ``parts``
    pieces are known to meet (it narrows the search)."""
    count = len(cumulative) - 1
    if count <= parts:
        return [(min(i, count), min(i + 1, count)) for i in range(parts)]
    if parts == 1 and (max_samples is None or count <= max_samples):
        return [(0, count)]
    cum = cumulative.tolist()
    longest = max(b - a for a, b in zip(cum, cum[1:]))
    low, high = max(longest, -(-cum[-1] // parts)), cum[-1]
    if max_samples is not None and -(-count // max_samples) > parts:
        max_samples = None  # (cannot hold: the caller's parts came from another bound)
    if max_tokens is not None and len(_greedy_parts(cum, max(max_tokens, low), max_samples)) - 1 <= parts:
        high = max(max_tokens, low)
    while low < high:  # the smallest capacity whose greedy packing needs at most `parts` pieces
        mid = (low + high) // 2
        if len(_greedy_parts(cum, mid, max_samples)) - 1 <= parts:
            high = mid
        else:
            low = mid + 1
    cuts = _greedy_parts(cum, low, max_samples)
    while len(cuts) - 1 < parts:  # split the heaviest piece of several samples at its token midpoint
        _, i = max((cum[b] - cum[a], i) for i, (a, b) in enumerate(zip(cuts, cuts[1:])) if b - a > 1)
        a, b = cuts[i], cuts[i + 1]
        middle = bisect.bisect_left(cum, (cum[a] + cum[b]) / 2)
        cuts.insert(i + 1, min(max(middle, a + 1), b - 1))
    return list(zip(cuts, cuts[1:]))


@dataclass(frozen=True)
class TokenStep:
    """One global batch counted in tokens: its samples' cumulative token counts and every rank's share."""

    cumulative: np.ndarray  # [0, l_0, l_0 + l_1, ...] over the global batch
    bounds: tuple[tuple[int, int], ...]  # every rank's (start, stop) in the global batch

    @property
    def tokens(self) -> int:
        """Tokens in the global batch."""
        return int(self.cumulative[-1])

    def share_cumulative(self, rank: int) -> np.ndarray:
        """Cumulative token counts of ``rank``'s share, from 0."""
        start, stop = self.bounds[rank]
        return self.cumulative[start:stop + 1] - self.cumulative[start]

    def accumulation_steps(self, *, fixed: int | None, max_tokens: int | None, max_samples: int | None,
                           split: bool) -> int:
        """Micro-batches per rank: ``fixed`` when given, else the most any rank needs for the bounds, and with
        ``split`` at least 2 where every rank has two samples (a gradient-noise measurement's small batches)."""
        if fixed is not None:
            return fixed
        steps = max(count_micro_batches(self.share_cumulative(r), max_tokens, max_samples)
                    for r in range(len(self.bounds)))
        smallest = min(stop - start for start, stop in self.bounds)
        return max(steps, min(2, smallest)) if split else steps


class TokenPlan:
    """The token counts of a dataset's samples, and the cumulative counts along each epoch's order (computed once
    per epoch), for the sampler to cut global batches of a token budget.

    Args:
        lengths: Every sample's token count (see :func:`token_lengths`).
    """

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths
        self.total_tokens = int(lengths.sum())
        self._epoch: int | None = None
        self._cumulative = np.zeros(1, dtype=np.int64)

    def cumulative(self, order: np.ndarray, epoch: int) -> np.ndarray:
        """``[0, l(order[0]), l(order[0]) + l(order[1]), ...]`` for ``epoch``'s order (cached for one epoch)."""
        if epoch != self._epoch:
            cumulative = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(self.lengths[order], out=cumulative[1:])
            self._cumulative, self._epoch = cumulative, epoch
        return self._cumulative

    def take(self, order: np.ndarray, epoch: int, offset: int, budget: int) -> int:
        """How many samples from ``offset`` the next global batch of ``budget`` tokens takes (the rule of
        :func:`plan_token_batch`)."""
        cumulative = self.cumulative(order, epoch)
        stop = int(np.searchsorted(cumulative, cumulative[offset] + budget, side="right")) - 1
        return min(max(stop, offset + 1), len(order)) - offset

    def left(self, order: np.ndarray, epoch: int, offset: int) -> int:
        """Tokens left in ``epoch`` from ``offset`` on."""
        cumulative = self.cumulative(order, epoch)
        return int(cumulative[-1] - cumulative[offset])

    def batches_left(self, order: np.ndarray, epoch: int, offset: int, budget: int, drop_last: bool) -> int:
        """Global batches left in ``epoch`` at a constant ``budget`` (with ``drop_last``, a last one short of the
        budget does not count)."""
        batches = 0
        while offset < len(order):
            if drop_last and self.left(order, epoch, offset) < budget:
                break
            offset += self.take(order, epoch, offset, budget)
            batches += 1
        return batches

    def step(self, global_batch: np.ndarray, world_size: int, weights: Sequence[float] | None) -> TokenStep:
        """The shares of ``global_batch`` (dataset indices) over ``world_size`` ranks."""
        cumulative = np.zeros(len(global_batch) + 1, dtype=np.int64)
        np.cumsum(self.lengths[global_batch], out=cumulative[1:])
        return TokenStep(cumulative, tuple(token_share_bounds(cumulative, world_size, weights)))


def check_batch_unit(batch_unit: Any, lengths: Any, max_micro_batch_tokens: Any) -> None:
    """Check the token settings together (the loader's and ``Pilot``'s).

    Raises:
        ValueError, TypeError: an unknown unit, or a token setting without ``batch_unit="tokens"``.
    """
    if batch_unit not in BATCH_UNITS:
        raise ValueError(f"batch_unit={batch_unit!r}; pass 'samples' (batch sizes count samples) or 'tokens' (they "
                         "count tokens: needs lengths=).")
    if batch_unit == "samples" and (lengths is not None or max_micro_batch_tokens is not None):
        given = "lengths" if lengths is not None else "max_micro_batch_tokens"
        raise ValueError(f"{given} is given but batch_unit='samples'; pass batch_unit='tokens' to count batches in "
                         f"tokens, or leave {given} at None.")
    if max_micro_batch_tokens is not None and (isinstance(max_micro_batch_tokens, bool) or not isinstance(
            max_micro_batch_tokens, numbers.Integral) or max_micro_batch_tokens < 1):
        raise ValueError(f"max_micro_batch_tokens={max_micro_batch_tokens!r}; pass a positive int (the most tokens "
                         "one forward/backward holds on a rank) or None.")


def attach_tokens(sampler: Any, dataset: Any, batch_unit: str, lengths: Any,
                  max_micro_batch_tokens: int | None) -> int | None:
    """Check the token settings and, for ``batch_unit="tokens"``, give ``sampler`` its :class:`TokenPlan` (unless
    it has one); return the micro-batch token bound (an int, or ``None``).

    Raises:
        ValueError, TypeError: see :func:`check_batch_unit` and :func:`token_lengths`.
    """
    check_batch_unit(batch_unit, lengths, max_micro_batch_tokens)
    if batch_unit == "tokens" and sampler.token_plan is None:
        sampler.token_plan = TokenPlan(token_lengths(dataset, lengths, sampler.num_samples))
    elif batch_unit == "samples" and sampler.token_plan is not None:
        raise ValueError("the sampler counts batches in tokens but batch_unit='samples'; pass batch_unit='tokens'.")
    return None if max_micro_batch_tokens is None else int(max_micro_batch_tokens)


def next_step_units(sampler: Any) -> int:
    """Size of the next global batch ``sampler`` cuts, in its unit (with ``drop_last``, past a tail it drops)."""
    plan, order, epoch, offset = sampler.token_plan, sampler.order(), sampler.epoch, sampler.offset
    if plan is None:
        remaining = sampler.num_samples - offset
        return min(sampler.batch_size, sampler.num_samples if sampler.drop_last and remaining < sampler.batch_size
                   else remaining)
    if sampler.drop_last and plan.left(order, epoch, offset) < sampler.batch_size:
        epoch, offset = epoch + 1, 0
        order = sampler.order(epoch)
    cumulative = plan.cumulative(order, epoch)
    return int(cumulative[offset + plan.take(order, epoch, offset, sampler.batch_size)] - cumulative[offset])


def token_state(plan: TokenPlan | None) -> dict[str, Any]:
    """What a sampler's state holds about its unit: nothing for samples; the unit and the total tokens (which tells
    other lengths) for tokens."""
    return {} if plan is None else {"batch_unit": "tokens", "total_tokens": plan.total_tokens}


def check_token_state(state: Any, plan: TokenPlan | None) -> None:
    """Check that a sampler ``state`` counts batches in the unit of ``plan`` (and, in tokens, of the same lengths).

    Raises:
        ValueError: the state was saved with another ``batch_unit`` or other lengths.
    """
    saved = (state.get("batch_unit", "samples"), state.get("total_tokens"))
    here = token_state(plan)
    if saved != (here.get("batch_unit", "samples"), here.get("total_tokens")):
        raise ValueError(f"sampler state counts batches in {saved[0]} (total_tokens={saved[1]}) but this sampler in "
                         f"{here.get('batch_unit', 'samples')} (total_tokens={here.get('total_tokens')}); resume with "
                         "the same batch_unit and lengths.")


def tokens_per_second(tokens: int, seconds: float) -> float:
    """Throughput in tokens per second (NaN without a time)."""
    return tokens / seconds if seconds > 0 else math.nan
