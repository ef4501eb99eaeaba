"""Drivers and strategies shared by the sampler tests: one sampler per rank, driven like a training loop.

``share_bounds`` is re-derived here, not reused, so the tests check the guarantees against first principles.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from hypothesis import settings
from hypothesis import strategies as st

from batchpilot.data.sampler import AdaptiveBatchSampler

FAST = settings(max_examples=200, deadline=None)


def make_job(n: int, world_size: int, **kwargs) -> list[AdaptiveBatchSampler]:
    """One sampler per rank, built the same way on every rank (as each process of a DDP job would)."""
    kwargs.setdefault("batch_size", 1)
    return [AdaptiveBatchSampler(n, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]


def expected_shares(global_size: int, world_size: int) -> list[int]:
    """Share sizes derived by hand: ``global_size`` split as evenly as possible, extras to low ranks."""
    return [global_size // world_size + (1 if r < global_size % world_size else 0) for r in range(world_size)]


def counters(s: AdaptiveBatchSampler) -> dict:
    return {
        "epoch": s.epoch, "offset": s.offset, "samples_seen": s.samples_seen,
        "dropped_samples": s.dropped_samples, "coverage": s.coverage,
        "virtual_epoch": s.virtual_epoch, "batch_size": s.batch_size,
    }


class Job:
    """All ranks of a job driven like a training loop: ``step(size)`` is one optimizer step.

    The size is set on every rank before the batch is drawn (the decision of step t+1 is made between
    steps). When the epoch's iterators end, fresh ones are started, as ``for epoch ...: for batch in
    loader`` does, and the same size is used for the first batch of the new epoch.
    """

    def __init__(self, n: int, world_size: int, **kwargs) -> None:
        self.samplers = make_job(n, world_size, **kwargs)
        self.iters: list | None = None

    def step(self, size: int) -> list[list[int]]:
        for s in self.samplers:
            s.set_batch_size(size)
        for _ in range(2):
            if self.iters is None:
                self.iters = [iter(s) for s in self.samplers]
            shares = [next(it, None) for it in self.iters]
            if all(x is None for x in shares):
                self.iters = None
                continue
            assert all(x is not None for x in shares), f"ranks disagree on the end of the epoch: {shares}"
            return shares
        raise AssertionError("a fresh epoch yielded no batch")

    def state_dict(self) -> dict:
        states = [s.state_dict() for s in self.samplers]
        for r, st_r in enumerate(states[1:], 1):
            assert st_r == states[0], f"rank {r}'s state differs from rank 0's: the state must not depend on rank"
        return states[0]

    def load_state_dict(self, state: dict) -> None:
        for s in self.samplers:
            s.load_state_dict(state)
        self.iters = None  # a resumed loop starts new iterators


@st.composite
def scenarios(draw, max_n: int = 300):
    """A dataset length, a job shape and a decision sequence (``sizes[step % len(sizes)]``)."""
    n = draw(st.integers(1, max_n))
    drop_last = draw(st.booleans())
    # Mostly small sizes (many batches per epoch), some large ones, some beyond the dataset.
    size = st.one_of(st.integers(1, 8), st.integers(1, n + 3))
    return {
        "n": n,
        "world_size": draw(st.integers(1, 4)),
        "drop_last": drop_last,
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
        "sizes": draw(st.lists(size, min_size=1, max_size=30)),
    }


def expected_len(remaining: int, size: int, drop_last: bool) -> int:
    return remaining // size if drop_last else math.ceil(remaining / size)


class UserLoop:
    """A user's own loop over all ranks' samplers, checkpointed and resumed the way a user would do it::

        for epoch in range(start_epoch, ...):
            sampler.set_epoch(epoch)          # only with set_epoch=True
            for batch in sampler:
                ...                           # train; decide the next size; save {"sampler": ..., "epoch": epoch}

    ``step(t)`` runs the loop body once (one global batch over all ranks) and then sets the size of batch
    ``t + 1``, so a state saved after it may sit right after an epoch's last batch, before the loop's
    StopIteration. A resumed loop starts at the saved ``epoch`` with fresh iterators.
    """

    def __init__(self, n: int, world_size: int, sizes: list[int], *, set_epoch: bool, **kwargs) -> None:
        self.samplers = make_job(n, world_size, batch_size=sizes[0], **kwargs)
        self.sizes, self.set_epoch = sizes, set_epoch
        self.epoch = 0  # the user's own epoch counter, saved with the sampler's state
        self._body: Iterator[list[int]] | None = None

    def _loop(self) -> Iterator[list[int]]:
        empty = 0  # epochs in a row that yielded nothing (a resumed loop's first one may)
        while True:
            if self.set_epoch:
                for s in self.samplers:
                    s.set_epoch(self.epoch)
            iters = [iter(s) for s in self.samplers]
            yielded = False
            while True:
                shares = [next(it, None) for it in iters]
                if all(x is None for x in shares):
                    break
                assert all(x is not None for x in shares), f"ranks disagree on the end of the epoch: {shares}"
                yielded = True
                yield sum(shares, [])
            empty = 0 if yielded else empty + 1
            assert empty < 3, "the loop yields nothing"
            self.epoch += 1

    def step(self, t: int) -> tuple[int, list[int], dict]:
        """Batch ``t``: the user's epoch, the global batch, and the counters after it."""
        if self._body is None:
            self._body = self._loop()
        batch = next(self._body)
        for s in self.samplers:
            s.set_batch_size(self.sizes[(t + 1) % len(self.sizes)])
        return self.epoch, batch, counters(self.samplers[-1])

    def state_dict(self) -> dict:
        states = [s.state_dict() for s in self.samplers]
        assert all(st_r == states[0] for st_r in states), "the state must not depend on the rank"
        return {"sampler": states[0], "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        for s in self.samplers:
            s.load_state_dict(state["sampler"])
        self.epoch, self._body = state["epoch"], None  # the resumed run enters its loop again
