"""Micro-batch planning: how many micro-batches a step gets, and how each rank's share is split into them
(values derived by hand; a property checks the split on every rank against the global batch)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.data.loader import MicroBatch, accumulation_steps_for, split_even
from batchpilot.data.micro_batch import PlannedMicroBatch, plan_accumulation_steps, plan_micro_batches
from batchpilot.data.sampler import SamplerPosition, share_bounds

AT = SamplerPosition(epoch=2, offset=30, samples_seen=130, dropped_samples=1)


@pytest.mark.parametrize("global_batch_size, world_size, bound, expected", [
    (10, 1, None, 1),  # no bound: one micro-batch
    (10, 1, 4, 3),  # 4 + 3 + 3
    (10, 3, 2, 2),  # the largest share (4) decides, for every rank
    (7, 4, 1, 2),
    (1, 4, 1, 1),
])
def test_accumulation_steps_fit_the_largest_share_into_the_bound(global_batch_size, world_size, bound, expected):
    assert accumulation_steps_for(global_batch_size, world_size, bound) == expected


def test_split_even_by_hand():
    assert split_even(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_even(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize("global_batch_size, world_size, fixed, bound, split, expected", [
    (8, 2, 5, None, True, 5),  # a fixed count wins over everything
    (8, 1, None, 3, False, 3),
    (8, 2, None, None, True, 2),  # two half-batches for a noise measurement
    (8, 2, None, 1, True, 4),  # ... never fewer than the bound needs
    (3, 2, None, None, True, 1),  # one sample per rank: no rank may get an empty half
    (3, 4, None, None, False, 1),
])
def test_planned_accumulation_steps(global_batch_size, world_size, fixed, bound, split, expected):
    assert plan_accumulation_steps(global_batch_size, world_size, accumulation_steps=fixed,
                                   max_micro_batch_size=bound, split=split) == expected


def test_a_share_splits_into_near_equal_micro_batches_and_an_empty_part_becomes_a_ghost():
    batch = np.arange(10, 15)  # 5 samples over 2 ranks: rank 1 holds [13, 14]
    start, stop = share_bounds(5, 1, 2)
    parts = plan_micro_batches(batch, batch[start:stop], 3, AT, step=7)
    assert [p.indices.tolist() for p in parts] == [[13], [14], [10]]
    assert [(p.micro_index, p.accumulation_steps, p.ghost) for p in parts] == [
        (0, 3, False), (1, 3, False), (2, 3, True)]
    assert {(p.local_batch_size, p.global_batch_size, p.position, p.step) for p in parts} == {(2, 5, AT, 7)}
    empty = plan_micro_batches(batch[:1], batch[:0], 1, AT, step=0)  # 1 sample, and this rank has none
    assert [(p.indices.tolist(), p.ghost, p.local_batch_size) for p in empty] == [([10], True, 0)]


def test_a_planned_micro_batch_fetched_is_the_micro_batch_the_loop_sees():
    planned = PlannedMicroBatch(np.array([4, 5]), 1, 2, 3, 6, AT, step=9)
    micro = planned.fetched("data")
    assert micro == MicroBatch("data", planned.indices, 1, 2, 3, 6, False, 2, 30, 9, samples_seen=AT.samples_seen)
    assert micro.size == 2 and micro.is_last
    ghost = PlannedMicroBatch(np.array([4]), 0, 2, 0, 1, AT, step=9, ghost=True).fetched("data")
    assert ghost.size == 0 and not ghost.is_last


@settings(max_examples=200, deadline=None)
@given(global_batch_size=st.integers(1, 40), world_size=st.integers(1, 5),
       bound=st.one_of(st.none(), st.integers(1, 9)), fixed=st.one_of(st.none(), st.integers(1, 6)), split=st.booleans())
def test_every_rank_plans_the_same_count_and_together_the_ranks_cover_the_batch_once(
        global_batch_size, world_size, bound, fixed, split):
    batch = np.arange(100, 100 + global_batch_size)
    steps = plan_accumulation_steps(global_batch_size, world_size, accumulation_steps=fixed,
                                    max_micro_batch_size=bound if fixed is None else None, split=split)
    covered = []
    for rank in range(world_size):
        start, stop = share_bounds(global_batch_size, rank, world_size)
        parts = plan_micro_batches(batch, batch[start:stop], steps, AT, step=0)
        assert len(parts) == steps and [p.micro_index for p in parts] == list(range(steps))
        real = [len(p.indices) for p in parts if not p.ghost]
        assert max(real, default=0) - min(real, default=0) <= 1  # near-equal
        assert all(p.indices.tolist() == [100] for p in parts if p.ghost)  # a ghost borrows the step's first sample
        if fixed is None and bound is not None:
            assert max(real, default=0) <= bound
        covered += [i for p in parts if not p.ghost for i in p.indices.tolist()]
    assert covered == batch.tolist()
