"""Tests of `AdaptiveBatchSampler`: the exactness and resumability guarantees under random decisions.

The property tests drive every rank of a job (one sampler per rank, as in a real DDP run) through random
sequences of ``set_batch_size`` calls, and check the guarantees of the class docstring against values
derived here from first principles (``share_bounds`` is re-derived, not reused).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from harness import assert_same, assert_state_roundtrip
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.data.sampler import AdaptiveBatchSampler, share_bounds

FAST = settings(max_examples=200, deadline=None)


# ------------------------------------------------------------------------------------------- drivers
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


# ------------------------------------------------------------------------------------------- strategies
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


# ------------------------------------------------------------------------------------------- per-epoch guarantees
@FAST
@given(sc=scenarios(), epochs=st.integers(1, 3))
def test_each_epoch_covers_every_index_once_on_all_ranks(sc, epochs):
    n, w, drop_last, sizes = sc["n"], sc["world_size"], sc["drop_last"], sc["sizes"]
    samplers = make_job(n, w, shuffle=sc["shuffle"], seed=sc["seed"], drop_last=drop_last, batch_size=sizes[0])
    reference = AdaptiveBatchSampler(n, 7, shuffle=sc["shuffle"], seed=sc["seed"])  # other size, rank, world
    step, seen, dropped = 0, 0, 0
    for e in range(epochs):
        for s in samplers:
            assert (s.epoch, s.offset, s.coverage) == (e, 0, 0.0)
        iters = [iter(s) for s in samplers]
        consumed: list[int] = []
        while True:
            request = sizes[step % len(sizes)]
            # Once the last batch is out, the sampler has rolled over: len() counts the next epoch.
            remaining = n - len(consumed) if len(consumed) < n else n
            for s in samplers:
                s.set_batch_size(request)
                assert len(s) == expected_len(remaining, request, drop_last)
            if step % 7 == 3:
                samplers[0].order(e + 5)  # looking at another epoch's order must not disturb this one
            shares = [next(it, None) for it in iters]
            if all(x is None for x in shares):
                break
            assert all(x is not None for x in shares), "all ranks must yield the same number of batches"
            step += 1
            size = len(sum(shares, []))
            # Every rank agrees on the global size; shares differ by at most one, extras to low ranks.
            assert [len(x) for x in shares] == expected_shares(size, w)
            assert size == (request if drop_last else min(request, n - len(consumed)))
            consumed += sum(shares, [])  # shares are contiguous, in rank order
            seen += size
            for s in samplers:
                epoch_done = len(consumed) == n
                assert s.samples_seen == seen
                assert s.virtual_epoch == seen / n
                assert s.epoch == e + epoch_done
                assert s.coverage == (0.0 if epoch_done else len(consumed) / n)
                assert s.dropped_samples == dropped
        # The whole epoch: the order of (seed, epoch), whatever the sizes, each index once.
        order = reference.order(e).tolist()
        assert sorted(order) == list(range(n))
        if not sc["shuffle"]:
            assert order == list(range(n))
        assert consumed == order[: len(consumed)]
        missing = n - len(consumed)
        if drop_last:
            # Exactly the final incomplete batch is dropped: fewer than the size requested for it.
            assert missing < request
        else:
            assert missing == 0
        dropped += missing
        for s in samplers:
            assert s.dropped_samples == dropped
            assert (s.epoch, s.offset, s.samples_seen) == (e + 1, 0, seen)
            assert s.order(e).tolist() == order


@FAST
@given(sc=scenarios(), restore_at=st.integers(0, 60), w2=st.integers(1, 4), data=st.data())
def test_state_roundtrip_under_another_world_size_continues_exactly(sc, restore_at, w2, data):
    n, sizes, drop_last = sc["n"], sc["sizes"], sc["drop_last"]
    if drop_last:
        # A size beyond the dataset makes every epoch empty under drop_last; tested on its own below.
        sizes = [min(x, n) for x in sizes]
    kwargs = dict(shuffle=sc["shuffle"], seed=sc["seed"], drop_last=drop_last)
    horizon = data.draw(st.integers(1, 40), label="horizon")

    def advance(job: Job, step: int) -> None:
        job.step(sizes[step % len(sizes)])

    def observe(job: Job, step: int) -> list:
        out = []
        for t in range(step, step + horizon):
            shares = job.step(sizes[t % len(sizes)])
            assert [len(x) for x in shares] == expected_shares(len(sum(shares, [])), len(shares))
            out.append((sum(shares, []), counters(job.samplers[-1])))
        return out

    assert_state_roundtrip(
        lambda: Job(n, sc["world_size"], batch_size=3, **kwargs),
        advance, observe,
        steps=(0, restore_at),
        make_restored=lambda: Job(n, w2, batch_size=5, **kwargs),
        advance_before_load=2,
    )


@settings(max_examples=40, deadline=None)
@given(sc=scenarios(max_n=80), restore_at=st.integers(0, 40), w2=st.integers(1, 4))
def test_resumed_epoch_is_exactly_the_remaining_indices(sc, restore_at, w2):
    """Mid-epoch resume under another world size: old batches + new batches = the epoch, once each."""
    n, sizes = sc["n"], sc["sizes"]
    job = Job(n, sc["world_size"], shuffle=sc["shuffle"], seed=sc["seed"], batch_size=1)
    for t in range(restore_at):
        job.step(sizes[t % len(sizes)])
    s0 = job.samplers[0]
    epoch, done = s0.epoch, s0.order()[: s0.offset].tolist()
    state = json.loads(json.dumps(s0.state_dict()))

    resumed = make_job(n, w2, shuffle=sc["shuffle"], seed=sc["seed"], batch_size=2)
    for s in resumed:
        s.load_state_dict(state)
        s.set_epoch(epoch)  # what a resumed `for epoch in range(start, E)` loop calls: a no-op here
    per_rank = [list(s) for s in resumed]
    assert len({len(batches) for batches in per_rank}) == 1, "ranks yielded different numbers of batches"
    rest = [idx for shares in zip(*per_rank) for idx in sum(shares, [])]
    assert sorted(done + rest) == list(range(n))
    assert done + rest == AdaptiveBatchSampler(n, 1, shuffle=sc["shuffle"], seed=sc["seed"]).order(epoch).tolist()
    assert all(s.epoch == epoch + 1 for s in resumed)


# ------------------------------------------------------------------------------------------- explicit examples
def test_share_bounds_by_hand():
    assert [share_bounds(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [share_bounds(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert share_bounds(0, 0, 1) == (0, 0)


def test_small_final_batch_gives_empty_shares_but_every_rank_yields():
    ranks = make_job(5, 4, batch_size=3, shuffle=False)
    per_rank = [list(s) for s in ranks]
    assert per_rank == [[[0], [3]], [[1], [4]], [[2], []], [[], []]]


def test_drop_last_drops_exactly_the_incomplete_final_batch():
    s = AdaptiveBatchSampler(10, 4, shuffle=False, drop_last=True)
    assert len(s) == 2
    assert list(s) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (s.epoch, s.offset, s.samples_seen, s.dropped_samples) == (1, 0, 8, 2)
    assert s.virtual_epoch == 0.8


def test_a_loop_that_starts_at_a_tail_to_drop_trains_the_next_epoch():
    s = AdaptiveBatchSampler(10, 4, shuffle=False, drop_last=True)
    it = iter(s)
    assert [next(it), next(it)] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # left before asking past the last batch
    assert (s.epoch, s.offset) == (0, 8)
    assert list(s) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the new loop drops the tail: epoch 1, not nothing
    assert (s.epoch, s.samples_seen, s.dropped_samples) == (2, 16, 4)
    it = iter(s)
    assert [next(it), next(it)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    s.set_batch_size(2)  # decided before the next step: the tail now fits and is kept (the drop is lazy)
    assert list(s) == [[8, 9]]
    assert (s.epoch, s.samples_seen, s.dropped_samples) == (3, 26, 4)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_drop_last_loader_loops_are_whole_epochs(num_workers):
    """A loop ends at an epoch's last full step (as Lightning's does, without asking for one more batch);
    the next loop must be the next epoch. In process it used to be empty every other time."""
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(50)), 7, drop_last=True, num_workers=num_workers)
    epochs = []
    for _ in range(4):
        steps = []
        for micro in loader:
            steps.append(micro.epoch)
            if len(steps) == 7:
                break
        epochs.append(steps)
    assert epochs == [[e] * 7 for e in range(4)]
    # Epochs 0-2 dropped one sample each; epoch 3's tail is left (workers' planning ahead stops at a tail
    # without dropping it, as in process: a smaller size set before the next step could still take it).
    assert loader.sampler.dropped_samples == 3
    loader.close()


def test_drop_last_with_a_size_beyond_the_dataset_drops_the_whole_epoch():
    s = AdaptiveBatchSampler(5, 8, drop_last=True)
    assert len(s) == 0
    assert list(s) == []
    assert (s.epoch, s.samples_seen, s.dropped_samples) == (1, 0, 5)
    s.set_batch_size(5)
    assert len(s) == 1 and len(list(s)) == 1 and s.epoch == 2


def test_len_counts_the_batches_left_at_the_current_size():
    s = AdaptiveBatchSampler(10, 3, shuffle=False)
    assert len(s) == 4
    it = iter(s)
    assert next(it) == [0, 1, 2]
    assert len(s) == 3  # 7 left at size 3
    s.set_batch_size(2)
    assert len(s) == 4
    assert list(it) == [[3, 4], [5, 6], [7, 8], [9]]
    assert len(s) == 5  # a new epoch, at size 2


@FAST
@given(n=st.integers(1, 200), size=st.integers(1, 50), drop_last=st.booleans(), first=st.integers(0, 10))
def test_len_matches_what_iteration_yields_at_a_constant_size(n, size, drop_last, first):
    s = AdaptiveBatchSampler(n, size, drop_last=drop_last)
    it = iter(s)
    for _, _batch in zip(range(first), it):
        pass
    if s.epoch == 0:  # else the last batch is out and len() already counts the next epoch
        assert len(s) == len(list(it))
    assert len(s) == len(list(s))  # and the next epoch, from its start


def test_order_is_a_function_of_seed_and_epoch_only():
    a = AdaptiveBatchSampler(50, 4, seed=3)
    b = AdaptiveBatchSampler(50, 17, seed=3, rank=1, world_size=3, drop_last=True)
    for e in range(3):
        assert a.order(e).tolist() == b.order(e).tolist()
    assert a.order(0).tolist() != a.order(1).tolist()
    assert a.order(0).tolist() != AdaptiveBatchSampler(50, 4, seed=4).order(0).tolist()
    assert AdaptiveBatchSampler(50, 4, shuffle=False).order(2).tolist() == list(range(50))


def test_order_cannot_be_corrupted_by_a_caller():
    s = AdaptiveBatchSampler(20, 4, shuffle=False)
    with pytest.raises(ValueError):
        s.order()[:] = 0
    batch = s.next_global_batch()
    with pytest.raises(ValueError):
        batch[0] = 19
    assert list(s) == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]


# ------------------------------------------------------------------------------------------- set_epoch
def test_set_epoch_to_the_current_epoch_is_a_no_op():
    s = AdaptiveBatchSampler(10, 3, shuffle=False)
    it = iter(s)
    next(it)
    s.set_epoch(0)
    assert (s.epoch, s.offset) == (0, 3)
    assert list(it) == [[3, 4, 5], [6, 7, 8], [9]]


def test_set_epoch_to_another_epoch_starts_it_from_the_beginning():
    s = AdaptiveBatchSampler(10, 3, seed=1)
    next(iter(s))
    s.set_epoch(4)
    assert (s.epoch, s.offset, s.coverage, s.samples_seen) == (4, 0, 0.0, 3)
    assert sum(list(s), []) == s.order(4).tolist()
    assert s.epoch == 5


def test_the_usual_set_epoch_loop_sees_each_epoch_once_in_order():
    s = AdaptiveBatchSampler(10, 4, seed=2)
    seen = []
    for epoch in range(3):
        s.set_epoch(epoch)
        seen.append(sum(list(s), []))
    assert seen == [s.order(e).tolist() for e in range(3)]
    assert (s.epoch, s.samples_seen) == (3, 30)


@pytest.mark.parametrize("bad, exc, message", [
    (-1, ValueError, "epoch must be >= 0, got -1"),
    (1.5, TypeError, "epoch must be an int >= 0, got 1.5"),
    (True, TypeError, "epoch must be an int, got the bool True"),
])
def test_set_epoch_rejects_bad_values(bad, exc, message):
    s = AdaptiveBatchSampler(10, 3)
    with pytest.raises(exc, match=message):
        s.set_epoch(bad)
    assert s.epoch == 0


# ------------------------------------------------------------------------------------------- DataLoader
def test_plain_dataloader_follows_set_batch_size_between_batches_exactly():
    n = 23
    dataset = torch.utils.data.TensorDataset(torch.arange(n) * 10)
    sampler = AdaptiveBatchSampler(n, 2, seed=5)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0)
    assert len(loader) == len(sampler) == 12
    sizes = iter([2, 5, 1, 7, 3, 4, 6, 2, 9, 1, 3])
    got, epochs = [], []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        rows = []
        for (x,) in loader:
            got.append(len(x))
            rows += (x // 10).tolist()
            sampler.set_batch_size(next(sizes, 4))  # decided between steps: the next batch has this size
        epochs.append(rows)
    assert epochs == [sampler.order(0).tolist(), sampler.order(1).tolist()]
    # Epoch 0 (23 samples): 2 initial, then 2 5 1 7 3, then 4 capped at the 3 left. Epoch 1: the size set
    # after epoch 0's last batch (6) starts it, then 2 9 1 3, then 4 (default) capped at the 2 left.
    assert got == [2, 2, 5, 1, 7, 3, 3, 6, 2, 9, 1, 3, 2]


# ------------------------------------------------------------------------------------------- bad input
BAD_SIZES = [
    (0, ValueError, "batch_size must be >= 1, got 0"),
    (-3, ValueError, "batch_size must be >= 1, got -3"),
    (2.0, TypeError, r"batch_size must be an int, got the float 2.0; pass int\(2.0\) = 2 instead"),
    (2.5, TypeError, "batch_size must be an int >= 1, got 2.5 of type float"),
    (True, TypeError, "batch_size must be an int, got the bool True"),
    (float("nan"), ValueError, "batch_size must be an int >= 1, got NaN"),
    ("32", TypeError, "batch_size must be an int >= 1, got '32' of type str"),
    (None, TypeError, "batch_size must be an int >= 1, got None of type NoneType"),
]


@pytest.mark.parametrize("bad, exc, message", BAD_SIZES)
def test_bad_batch_size_in_constructor(bad, exc, message):
    with pytest.raises(exc, match=message):
        AdaptiveBatchSampler(10, bad)


@pytest.mark.parametrize("bad, exc, message", BAD_SIZES)
def test_bad_batch_size_in_set_batch_size_keeps_the_old_size(bad, exc, message):
    s = AdaptiveBatchSampler(10, 4)
    with pytest.raises(exc, match=message):
        s.set_batch_size(bad)
    assert s.batch_size == 4


def test_numpy_integer_batch_size_is_accepted_as_int():
    s = AdaptiveBatchSampler(10, np.int64(4))
    s.set_batch_size(np.int32(3))
    assert type(s.batch_size) is int and s.batch_size == 3
    json.dumps(s.state_dict())


def test_empty_dataset_says_so():
    with pytest.raises(ValueError, match="num_samples is 0: the dataset is empty"):
        AdaptiveBatchSampler(0, 4)


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(num_samples=-5), ValueError, "num_samples must be >= 1, got -5"),
    (dict(num_samples=10.0), TypeError, "num_samples must be an int, got the float 10.0"),
    (dict(rank=2, world_size=2), ValueError, "rank=2 must be < world_size=2; ranks count from 0"),
    (dict(rank=5, world_size=4), ValueError, "rank=5 must be < world_size=4"),
    (dict(rank=-1), ValueError, "rank must be >= 0, got -1"),
    (dict(world_size=0), ValueError, "world_size must be >= 1, got 0"),
    (dict(seed=-1), ValueError, "seed must be >= 0, got -1"),
    (dict(seed="0"), TypeError, "seed must be an int >= 0, got '0' of type str"),
])
def test_bad_constructor_arguments(kwargs, exc, message):
    args = dict(num_samples=10, batch_size=4)
    args.update(kwargs)
    with pytest.raises(exc, match=message):
        AdaptiveBatchSampler(args.pop("num_samples"), args.pop("batch_size"), **args)


def _state(**changes):
    s = AdaptiveBatchSampler(10, 3, seed=1)
    next(iter(s))
    state = s.state_dict()
    state.update(changes)
    return state


def _without(key):
    state = _state()
    del state[key]
    return state


@pytest.mark.parametrize("state, message", [
    ([1, 2], "not an AdaptiveBatchSampler state .*'list'.*pass the dict returned by AdaptiveBatchSampler.state_dict"),
    ("{}", "not an AdaptiveBatchSampler state .*'str'"),
    ({}, r"not an AdaptiveBatchSampler state \(format=None\)"),
    ({"format": "batchpilot.Constant", "version": 1, "size": 3},
     "not an AdaptiveBatchSampler state .*batchpilot.Constant"),
    (_state(version=99), "version=99"),
    (_without("offset"), "missing offset"),
    (_without("samples_seen"), "missing samples_seen"),
    (_state(offset=10), r"offset=10, outside \[0, 10\)"),
    (_state(offset=-1), "offset must be >= 0, got -1"),
    (_state(offset="3"), "offset must be an int >= 0, got '3' of type str"),
    (_state(batch_size=0), "batch_size must be >= 1, got 0"),
    (_state(epoch=-2), "epoch must be >= 0, got -2"),
    (_state(samples_seen=None), "samples_seen must be an int >= 0, got None"),
    (_state(num_samples=11),
     "sampler state has num_samples=11 but this sampler has num_samples=10; resume with the same dataset"),
    (_state(seed=2), "sampler state has seed=2 but this sampler has seed=1"),
    (_state(shuffle=False), "sampler state has shuffle=False but this sampler has shuffle=True"),
])
def test_corrupt_foreign_or_mismatched_state_is_rejected_and_changes_nothing(state, message):
    s = AdaptiveBatchSampler(10, 4, seed=1)
    next(iter(s))
    before = s.state_dict()
    with pytest.raises(ValueError, match=message):
        s.load_state_dict(state)
    assert s.state_dict() == before


def test_state_is_plain_json_and_independent_of_rank_and_world_size():
    a = make_job(37, 3, batch_size=5, seed=9)
    for s in a:
        next(iter(s))
    states = [s.state_dict() for s in a]
    assert states[0] == states[1] == states[2]
    assert json.loads(json.dumps(states[0], allow_nan=False)) == states[0]
    assert states[0]["offset"] == 5 and states[0]["samples_seen"] == 5


# ------------------------------------------------------------------------------------------- the harness has teeth
class _ForgetsSamplesSeen(AdaptiveBatchSampler):
    def load_state_dict(self, state):
        keep = self.samples_seen
        super().load_state_dict(state)
        self.samples_seen = keep


class _NumpyState(AdaptiveBatchSampler):
    def state_dict(self):
        state = super().state_dict()
        state["offset"] = np.int64(state["offset"])
        return state


class _AliasedState(AdaptiveBatchSampler):
    """Keeps a history and hands out the live list in its state instead of a copy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history = []

    def next_global_batch(self):
        self.history.append(self.batch_size)
        return super().next_global_batch()

    def state_dict(self):
        return {**super().state_dict(), "history": self.history}

    def load_state_dict(self, state):
        state = dict(state)
        self.history = state.pop("history")
        super().load_state_dict(state)


@pytest.mark.parametrize("cls, message", [
    (_ForgetsSamplesSeen, "samples_seen"),
    (_NumpyState, "not strictly JSON-serialisable"),
    (_AliasedState, "must be a snapshot"),
])
def test_harness_catches_broken_state_handling(cls, message):
    def make():
        return cls(30, 4, seed=0)

    def advance(s, step):
        s.set_batch_size(1 + step % 5)
        s.next_global_batch()

    def observe(s, step):
        return [(advance(s, t), counters(s)) for t in range(step, step + 5)]

    # The same driver passes on the real class, and fails on each broken one.
    assert_state_roundtrip(lambda: AdaptiveBatchSampler(30, 4, seed=0), advance, observe, steps=(0, 3, 7),
                           advance_before_load=2)
    with pytest.raises(AssertionError, match=message):
        assert_state_roundtrip(make, advance, observe, steps=(3,), advance_before_load=2)


def test_assert_same_is_exact():
    def value():
        return {"a": [1, 2.0, float("nan")], "t": torch.tensor([1.0, float("nan")]), "n": np.arange(3)}

    assert_same(value(), value())
    for a, b in [(1, 1.0), ([1], (1,)), (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64)),
                 ({"a": 1}, {"a": 1, "b": 2}), (torch.tensor([1.0]), torch.tensor([1.0 + 1e-7]))]:
        with pytest.raises(AssertionError):
            assert_same(a, b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_loops_left_anywhere_keep_data_with_indices_and_epochs_exact(num_workers):
    """AdaptiveDataLoader on its own, looped over again and again: loops left at random points (inside a
    step too), sizes changed between steps. Every micro-batch's data is its indices' rows, and the steps whose
    last micro-batch was yielded cover each epoch exactly once (a step left unfinished is planned again).
    With workers this used to fail: a new loop started the worker iterator twice and mispaired the data."""
    import random

    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    n = 97
    ds = TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))
    rng = random.Random(num_workers)
    loader = AdaptiveDataLoader(ds, 7, max_micro_batch_size=3, num_workers=num_workers, seed=1)
    consumed: dict[int, list[int]] = {}
    try:
        while len(consumed) <= 4:
            step: list[int] = []
            for micro in loader:
                assert torch.equal(micro.data[1], torch.as_tensor(micro.indices.tolist()))
                step.extend(micro.indices.tolist())
                if micro.micro_index == micro.accumulation_steps - 1:
                    consumed.setdefault(micro.epoch, []).extend(step)
                    step = []
                    if rng.random() < 0.3:
                        loader.set_batch_size(rng.randint(1, 20))
                if rng.random() < 0.15:
                    break
    finally:
        loader.close()
    finished = sorted(consumed)[:-1]
    assert len(finished) == 4
    assert all(sorted(consumed[e]) == list(range(n)) for e in finished)


@pytest.mark.parametrize("num_workers, micro", [(0, 2), (2, None)])
def test_set_epoch_after_a_loop_left_early_starts_that_epoch(num_workers, micro):
    """The DistributedSampler pattern with a break: planned (prefetched, or the rest of a step) micro-batches
    must not undo the user's set_epoch."""
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(40)), 4, max_micro_batch_size=micro,
                                num_workers=num_workers, seed=3)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        first = None
        for i, m in enumerate(loader):
            first = first or (m.epoch, m.offset)
            if i == 2:
                break
        assert first == (epoch, 0)
    loader.sampler.set_epoch(2)  # the epoch of the next step already: resume-safe no-op
    assert next(iter(loader)).epoch == 2 and loader.position()[1] > 0
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_after_a_loop_left_early_holds_for_the_position_a_checkpoint_and_a_size_change(num_workers):
    """With workers, steps after the break are already planned: a set_epoch made then must show in
    position(), next_step_size() and state_dict(), and survive a size change and close()."""
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(100)), 10, num_workers=num_workers, seed=3)
    try:
        for i, _ in enumerate(loader):
            if i == 2:
                break
        loader.sampler.set_epoch(1)
        assert loader.position() == (1, 0, 30) and loader.epochs_done() == 1
        state = loader.state_dict()
        assert (state["epoch"], state["offset"], state["samples_seen"]) == (1, 0, 30)
        loader.set_batch_size(20)
        assert loader.next_step_size() == 20
        loader.close()
        first = next(iter(loader))
        assert (first.epoch, first.offset, first.global_size) == (1, 0, 20)
    finally:
        loader.close()


def test_in_order_false_is_refused():
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    with pytest.raises(ValueError, match="in_order"):
        AdaptiveDataLoader(TensorDataset(torch.arange(10)), 2, num_workers=2, dataloader_kwargs={"in_order": False})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dropped_samples_count_every_tail_in_the_set_epoch_loop(num_workers):
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(10)), 4, num_workers=num_workers, drop_last=True)
    try:
        for epoch in range(4):
            loader.sampler.set_epoch(epoch)
            assert [(m.epoch, m.global_size) for m in loader] == [(epoch, 4), (epoch, 4)]
            # Without workers the loop drops the tail as it ends; with them, the next loop does.
            pending = 2 if loader.sampler.at_tail_to_drop() else 0
            assert loader.sampler.dropped_samples + pending == 2 * (epoch + 1)
    finally:
        loader.close()


def test_an_iterable_dataset_is_refused_even_with_a_length():
    from batchpilot import AdaptiveDataLoader

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

        def __len__(self):
            return 10

    with pytest.raises(TypeError, match="IterableDataset.*map-style"):
        AdaptiveDataLoader(Stream(), 4)


def test_a_dataset_whose_len_is_no_int_is_told_so_and_a_bad_saved_loader_state_is_refused():
    from batchpilot import AdaptiveDataLoader

    class FloatLength(torch.utils.data.Dataset):
        def __len__(self):
            return 10.0

        def __getitem__(self, i):
            return i

    with pytest.raises(TypeError, match="len\\(\\) of the dataset of type FloatLength failed .*must return the number"):
        AdaptiveDataLoader(FloatLength(), 4)
    loader = AdaptiveDataLoader(torch.utils.data.TensorDataset(torch.arange(20)), 4, max_micro_batch_size=2)
    state = loader.state_dict()
    for key, value, error, says in [("max_micro_batch_size", 0, ValueError, "saved max_micro_batch_size must be >= 1"),
                                    ("max_micro_batch_size", "2", TypeError, "saved max_micro_batch_size must be"),
                                    ("step", -1, ValueError, "the saved step must be >= 0")]:
        with pytest.raises(error, match=says):
            loader.load_state_dict({**state, key: value})
    assert loader.max_micro_batch_size == 2


class Augmented(torch.utils.data.Dataset):
    """Random augmentation in __getitem__, from torch, numpy and random."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        import random as pyrandom

        return torch.tensor([i + torch.rand(()).item(), np.random.rand(), pyrandom.random()])


def test_worker_augmentation_depends_on_the_position_not_on_workers_or_a_resume():
    from batchpilot import AdaptiveDataLoader

    def epoch_data(num_workers, resume_after=None):
        loader = AdaptiveDataLoader(Augmented(), 4, num_workers=num_workers, seed=2)
        out = []
        for m in loader:
            out.append(m.data)
            if resume_after is not None and len(out) == resume_after:
                state = loader.state_dict()
                loader.close()
                loader = AdaptiveDataLoader(Augmented(), 4, num_workers=num_workers, seed=2)  # a new process
                loader.load_state_dict(state)
                out += [m.data for m in loader]
                break
        loader.close()
        return torch.cat(out)

    one, two = epoch_data(1), epoch_data(2)
    assert torch.equal(one, two)  # whichever worker fetched a micro-batch, it drew the same numbers
    assert torch.equal(epoch_data(2, resume_after=3), two)
    assert len(set(one[:, 1].tolist())) == 24  # numpy is seeded per micro-batch, not cloned into each worker


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_smaller_size_set_at_an_epochs_tail_takes_it_with_or_without_workers(num_workers):
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(100)), 30, drop_last=True, num_workers=num_workers, seed=0)
    sizes: list[tuple[int, int]] = []
    while len(sizes) < 6:  # loops over the loader (with workers the tail step may come in the next one)
        for m in loader:
            sizes.append((m.epoch, m.global_size))
            if len(sizes) == 3:
                loader.set_batch_size(10)  # 10 samples are left: the tail is trained, not dropped
            if len(sizes) == 6:
                break
    assert sizes == [(0, 30), (0, 30), (0, 30), (0, 10), (1, 10), (1, 10)]
    assert loader.sampler.dropped_samples == 0
    loader.close()


def _standalone_epochs(n: int, epochs: int, at: int, resume: bool, grow_to: int | None = None):
    """A user's ``for epoch: sampler.set_epoch(epoch); for batch in sampler`` loop over a bare ``drop_last``
    sampler of ``n`` samples at batch 4. After ``at`` batches the size grows to ``grow_to`` (if given); with
    ``resume`` the run is checkpointed there and a fresh sampler re-enters the same epoch's loop."""
    s = AdaptiveBatchSampler(n, 4, shuffle=False, drop_last=True)
    out = []
    for epoch in range(epochs):
        s.set_epoch(epoch)
        for batch in s:
            out.append((epoch, tuple(batch)))
            if len(out) != at:
                continue
            if resume:
                state = s.state_dict()
                s = AdaptiveBatchSampler(n, 4, shuffle=False, drop_last=True)
                s.load_state_dict(state)
                s.set_epoch(epoch)
            if grow_to is not None:
                s.set_batch_size(grow_to)
            if resume:
                out += [(epoch, tuple(b)) for b in s]
                break
    return out, s.samples_seen, s.dropped_samples, s.epoch


def test_a_standalone_loop_resumed_at_a_tail_to_drop_trains_each_epoch_once():
    # A checkpoint saved right after epoch 0's last full batch: the resumed loop for epoch 0 must end there
    # (it used to drop the tail and yield epoch 1 as "epoch 0", and then set_epoch(1) trained epoch 1 again).
    uninterrupted = _standalone_epochs(10, 3, at=0, resume=False)
    assert uninterrupted[1:] == (24, 6, 3)
    assert _standalone_epochs(10, 3, at=2, resume=True) == uninterrupted  # resumed at epoch 0's tail
    assert _standalone_epochs(10, 3, at=3, resume=True) == uninterrupted  # mid-epoch, for comparison


def test_set_epoch_past_a_tail_to_drop_counts_it():
    # A loop that stops after len(sampler) batches (as Lightning does) leaves the tail pending: moving to the
    # next epoch drops it and counts it, so every index is yielded or counted in dropped_samples.
    s = AdaptiveBatchSampler(10, 4, shuffle=False, drop_last=True)
    for epoch in (0, 1):
        s.set_epoch(epoch)
        it = iter(s)
        for _ in range(len(s)):
            next(it)
    s.set_epoch(2)
    assert (s.epoch, s.offset, s.samples_seen, s.dropped_samples) == (2, 0, 16, 4)


def test_a_size_raised_after_set_epoch_at_a_resumed_position_ends_that_epoch_as_uninterrupted():
    # Resumed at offset 8 of 12 (4 left: no tail yet), then the size grows to 8: the 4 left become a tail to
    # drop. The loop set_epoch(0) named must end there, as the uninterrupted run's does when its size grows
    # after the same batch (it used to train epoch 1 inside epoch 0's loop, and then again).
    uninterrupted = _standalone_epochs(12, 2, at=2, resume=False, grow_to=8)
    assert uninterrupted[1:] == (16, 8, 2)
    assert _standalone_epochs(12, 2, at=2, resume=True, grow_to=8) == uninterrupted
