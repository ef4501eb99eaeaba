"""Rank weights in the data layer: weighted shares (largest remainder), their validation, the sampler's state,
loaders of two ranks whose weights change mid-epoch (exact coverage, also with prefetching workers), and the
balancer's arithmetic (fold, proposal, hysteresis, state)."""

from __future__ import annotations

import logging
import math
import random

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from batchpilot.data import AdaptiveBatchSampler, AdaptiveDataLoader
from batchpilot.data.micro_batch import accumulation_steps_for
from batchpilot.data.sampler import share_bounds
from batchpilot.data.shares import check_rank_weights
from batchpilot.engine.rank_balance import RankBalancer


# ------------------------------------------------------------------------------------------- shares
def test_weighted_shares_are_contiguous_sum_to_the_batch_and_follow_the_quotas():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(1, 6)
        b = rng.randint(0, 500)
        weights = [rng.choice([rng.uniform(0.01, 10), rng.randint(1, 5)]) for _ in range(n)]
        bounds = [share_bounds(b, r, n, weights) for r in range(n)]
        assert bounds[0][0] == 0 and bounds[-1][1] == b
        assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:]))  # contiguous, in rank order
        total = sum(weights)
        for (start, stop), w in zip(bounds, weights):
            assert abs((stop - start) - b * w / total) < 1  # the largest remainder never rounds by a whole sample
        # Scale-free: the same shares for weights times 10 (the quotas are exact rationals).
        assert [share_bounds(b, r, n, [10 * w for w in weights]) for r in range(n)] == bounds


def test_equal_weights_give_the_even_split_and_ties_go_to_the_lower_rank():
    for b in range(0, 40):
        for n in (1, 2, 3, 5):
            assert [share_bounds(b, r, n, [2.5] * n) for r in range(n)] == [share_bounds(b, r, n) for r in range(n)]
    assert [share_bounds(1, r, 2, [1.0, 1.0]) for r in range(2)] == [(0, 1), (1, 1)]
    # 1:3 of one sample: rank 1's quota 0.75 has the larger remainder; rank 0's share is empty (a ghost).
    assert [share_bounds(1, r, 2, [1.0, 3.0]) for r in range(2)] == [(0, 0), (0, 1)]
    assert [share_bounds(128, r, 2, [1.0, 3.0]) for r in range(2)] == [(0, 32), (32, 128)]


def test_accumulation_follows_the_largest_weighted_share():
    # 1:3 of 100: shares 25 and 75; micro-batches of at most 10 -> 8 on both ranks.
    assert accumulation_steps_for(100, 2, 10, [1.0, 3.0]) == 8
    assert accumulation_steps_for(100, 2, 10) == 5


@pytest.mark.parametrize(("value", "error", "words"), [
    ([1.0, -1.0], ValueError, "rank_weights[1] is -1.0"),
    ([0, 1], ValueError, "finite number > 0"),
    ([math.nan, 1.0], ValueError, "rank_weights[0] is nan"),
    ([1.0, math.inf], ValueError, "rank_weights[1] is inf"),
    ([1.0, 2.0, 3.0], ValueError, "has 3 weights"),
    ([], ValueError, "empty"),
    ("fast", ValueError, "rank_weights='fast'"),
    (2.0, TypeError, "got 2.0 of type float"),
    ({"a": 1.0}, TypeError, "of type dict"),
    ([True, 1.0], TypeError, "rank_weights[0] is True"),
    (["1", 1.0], TypeError, "rank_weights[0] is '1'"),
    ([[1.0], [2.0]], TypeError, "rank_weights[0] is [1.0]"),
])
def test_bad_rank_weights_are_refused_with_the_value_and_the_fix(value, error, words):
    with pytest.raises(error) as info:
        check_rank_weights(value, 2)
    assert words in str(info.value)


def test_rank_weights_accept_arrays_auto_and_none():
    assert check_rank_weights(np.array([1, 2]), 2) == (1.0, 2.0)
    assert check_rank_weights(torch.tensor([1.0, 0.5]), 2) == (1.0, 0.5)
    assert check_rank_weights("auto", 4) == "auto" and check_rank_weights(None, 4) is None
    assert check_rank_weights([3], None) == (3.0,)  # world size unknown yet: no length check
    with pytest.raises(ValueError, match="one weight per rank"):
        AdaptiveBatchSampler(10, 4, world_size=2).set_rank_weights("auto")  # the sampler takes weights only


# ------------------------------------------------------------------------------------------- sampler state
def test_sampler_state_holds_the_weights_and_drops_them_under_another_world_size(caplog):
    sampler = AdaptiveBatchSampler(50, 8, rank=1, world_size=2, seed=3)
    sampler.set_rank_weights([1.0, 3.0])
    assert len(next(iter(sampler))) == 6
    state = sampler.state_dict()
    assert state["rank_weights"] == [1.0, 3.0]
    again = AdaptiveBatchSampler(50, 8, rank=0, world_size=2, seed=3)
    again.load_state_dict(state)
    assert again.rank_weights == (1.0, 3.0)
    three = AdaptiveBatchSampler(50, 8, rank=0, world_size=3, seed=3)
    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        three.load_state_dict(state)
    assert three.rank_weights is None and "shared evenly" in caplog.text
    assert three.offset == state["offset"]
    old = dict(state)
    del old["rank_weights"]  # a state saved before rank weights existed
    again.load_state_dict(old)
    assert again.rank_weights is None
    broken = dict(state, rank_weights=[1.0, -2.0], offset=0)
    with pytest.raises(ValueError, match="saved rank weights are invalid"):
        again.load_state_dict(broken)
    assert again.offset == state["offset"]  # a rejected state changes nothing


# ------------------------------------------------------------------------------------------- two loaders
def _lockstep(num_workers: int, changes: dict[int, list[float] | None], sizes: dict[int, int], steps: int,
              micro: int | None = None) -> list[list[tuple[list[int], list[int], int]]]:
    """Two ranks' loaders driven in lockstep in one process; per step each rank's indices and the global size."""
    ds = TensorDataset(torch.arange(97))
    loaders = [AdaptiveDataLoader(ds, 10, rank=r, world_size=2, seed=7, num_workers=num_workers,
                                  max_micro_batch_size=micro) for r in range(2)]
    its = [iter(loader) for loader in loaders]
    out: list[list[tuple[list[int], list[int], int]]] = []
    step = 0
    while step < steps:
        per_rank = []
        for r, loader in enumerate(loaders):
            indices: list[int] = []
            while True:
                try:
                    micro_batch = next(its[r])
                except StopIteration:
                    its[r] = iter(loader)
                    continue
                if not micro_batch.ghost:
                    indices += micro_batch.data[0].tolist()
                assert micro_batch.accumulation_steps >= 1
                if micro_batch.is_last:
                    break
            per_rank.append((indices, micro_batch.global_size, micro_batch.accumulation_steps))
        assert per_rank[0][1] == per_rank[1][1] and per_rank[0][2] == per_rank[1][2]
        out.append([(per_rank[0][0], per_rank[1][0], per_rank[0][1])])
        step += 1
        for loader in loaders:  # between steps, on every rank alike
            if step in changes:
                loader.set_rank_weights(changes[step])
            if step in sizes:
                loader.set_batch_size(sizes[step])
    for loader in loaders:
        loader.close()
    return out


@pytest.mark.parametrize("num_workers", [0, 1])
def test_weights_changed_mid_epoch_by_two_ranks_cover_each_epoch_exactly(num_workers):
    changes = {2: [1.0, 3.0], 5: [4.0, 1.0], 9: None, 11: [1.0, 2.0], 14: [1.0, 1e-3]}
    sizes = {4: 17, 8: 3, 12: 40}
    steps = _lockstep(num_workers, changes, sizes, 22, micro=6)
    seen = [i for step in steps for a, b, _ in step for i in a + b]
    epochs = len(seen) // 97
    assert epochs >= 2
    for e in range(epochs):  # each sample once per epoch, over both ranks, whatever the weights did
        assert sorted(seen[e * 97:(e + 1) * 97]) == list(range(97))
    (a, b, size), = steps[2]  # weights 1:3 from the third step on: quotas 2.5 and 7.5, the tie to rank 0
    assert (len(a), len(b), size) == (3, 7, 10)
    (a, b, size), = steps[15]  # 1 : 0.001 -> rank 1's share rounds to nothing: ghost micro-batches there
    assert len(b) == 0 and len(a) == size


# ------------------------------------------------------------------------------------------- balancer arithmetic
def test_balancer_proposes_weights_in_proportion_to_the_measured_rates():
    b = RankBalancer(2, 0, smoothing=0.5, hysteresis=0.05)
    assert b.weights == (1.0, 1.0) and b.propose() is None  # nothing measured yet
    b.fold([64, 64], [0.064, 0.192])  # 1000 and 333 samples per second
    assert b.propose() == (1.5, 0.5)
    b.weights = (1.5, 0.5)
    b.fold([96, 32], [0.1, 0.098])  # within 5% of the same rates: the weights hold (hysteresis)
    assert b.propose() is None
    b.fold([96, 32], [0.096, 0.048])  # rank 1 got 2x faster: its rate (EMA) moves halfway
    proposal = b.propose()
    assert proposal is not None and proposal[1] > 0.6
    b.fold([0, 0], [0.0, 0.0])  # nothing computed: the rates stay
    assert b.propose() == proposal


def test_balancer_keeps_a_slow_rank_measurable_and_fills_in_an_unmeasured_one():
    b = RankBalancer(3, 0, min_weight=0.1)
    b.fold([100, 100, 0], [0.1, 100.0, 0.0])  # rank 1 1000x slower, rank 2 computed nothing yet
    w = b.propose()  # rank 2 gets the measured ranks' mean rate; rank 1 about min_weight of the mean weight
    assert w is not None and w[1] == pytest.approx(0.1, rel=0.05) and w[2] == pytest.approx(w[0] / 2, rel=0.01)


def test_balancer_state_round_trip_and_reset_under_another_world_size(caplog):
    b = RankBalancer(2, 1, every=5)
    b.fold([64, 64], [0.064, 0.192])
    b.weights = b.propose() or b.weights
    b.record(10, 0.5)
    state = b.state_dict()
    c = RankBalancer(2, 0, every=5)
    c.load_state_dict(state)
    assert c.state_dict() == state
    d = RankBalancer(3, 0)
    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        d.load_state_dict(state)
    assert d.weights == (1.0, 1.0, 1.0) and d.rates == [None] * 3 and "start even again" in caplog.text
    with pytest.raises(ValueError, match="not a RankBalancer state"):
        d.load_state_dict({"weights": [1.0]})


def test_balancer_with_one_rank_never_syncs_and_bad_arguments_are_refused():
    solo = RankBalancer(1, 0, every=1)
    solo.record(10, 0.1)
    assert not solo.due(100) and solo.maybe_update(100) is None  # no process group needed
    with pytest.raises(ValueError, match="smoothing"):
        RankBalancer(2, 0, smoothing=1.0)
    with pytest.raises(ValueError, match="hysteresis"):
        RankBalancer(2, 0, hysteresis=-0.1)
    with pytest.raises(ValueError, match="rank=2 must be < world_size=2"):
        RankBalancer(2, 2)
    with pytest.raises(TypeError, match="every"):
        RankBalancer(2, 0, every=2.5)
