"""Token budgets in the data layer: the rule at the budget, token-balanced rank shares and micro-batches, exact
coverage and resume in tokens, and the errors for bad lengths."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from batchpilot import AdaptiveBatchSampler, AdaptiveDataLoader
from batchpilot.data.tokens import (
    TokenPlan,
    count_micro_batches,
    plan_token_batch,
    split_tokens,
    token_lengths,
    token_share_bounds,
)


def cumulative(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def token_sampler(lengths, budget, **kwargs) -> AdaptiveBatchSampler:
    sampler = AdaptiveBatchSampler(len(lengths), budget, **kwargs)
    sampler.token_plan = TokenPlan(token_lengths(None, list(lengths), len(lengths)))
    return sampler


def test_a_step_takes_samples_while_the_sum_stays_within_the_budget_and_at_least_one():
    lengths = [3, 4, 2, 9, 1, 1]
    order = np.arange(6)
    assert plan_token_batch(order, 0, lengths, 7) == 2        # 3 + 4 = 7 fits exactly; + 2 would be 9
    assert plan_token_batch(order, 0, lengths, 6) == 1        # 3 fits, 3 + 4 does not
    assert plan_token_batch(order, 2, lengths, 5) == 3        # 2 fits, 2 + 9 does not
    assert plan_token_batch(order, 3, lengths, 5) == 4        # 9 > 5: the sample alone, never split or skipped
    assert plan_token_batch(order, 4, lengths, 100) == 6      # the epoch's end cuts the last batch
    with pytest.raises(ValueError, match="offset=6"):
        plan_token_batch(order, 6, lengths, 5)
    with pytest.raises(ValueError, match="budget=0"):
        plan_token_batch(order, 0, lengths, 0)


def test_the_cached_plan_takes_what_the_pure_rule_takes():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=200)
    plan = TokenPlan(np.asarray(lengths))
    for epoch in range(3):
        order = rng.permutation(200)
        for offset in range(0, 200, 13):
            for budget in (1, 7, 39, 40, 100, 1000, 10**6):
                assert offset + plan.take(order, epoch, offset, budget) == plan_token_batch(order, offset, lengths,
                                                                                            budget)


def test_rank_shares_are_contiguous_nonempty_and_near_their_quota():
    rng = np.random.default_rng(1)
    for _ in range(300):
        lengths = rng.integers(1, 30, size=int(rng.integers(1, 20)))
        world = int(rng.integers(1, 5))
        weights = None if rng.random() < 0.5 else rng.uniform(0.2, 3.0, size=world).tolist()
        c = cumulative(lengths)
        bounds = token_share_bounds(c, world, weights)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(lengths)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        share = [1 / world] * world if weights is None else [x / sum(weights) for x in weights]
        for (start, stop), s in zip(bounds, share):
            assert stop > start or len(lengths) < world  # every rank has a sample while there are enough
            assert abs(int(c[stop] - c[start]) - s * c[-1]) <= 2 * lengths.max()


def test_even_shares_cut_at_the_nearest_boundary():
    # [5, 5, 5, 5]: halves at 10. [9, 1, 1, 1]: the target 6 is nearest to 9 (3 away) - rank 0 gets one sample.
    assert token_share_bounds(cumulative([5, 5, 5, 5]), 2) == [(0, 2), (2, 4)]
    assert token_share_bounds(cumulative([9, 1, 1, 1]), 2) == [(0, 1), (1, 4)]
    # [100, 1, 1, 1] over 3 ranks: the nearest cut for rank 0 would leave it empty; it gets the long sample.
    assert token_share_bounds(cumulative([100, 1, 1, 1]), 3) == [(0, 1), (1, 2), (2, 4)]
    assert token_share_bounds(cumulative([4]), 2) == [(0, 1), (1, 1)]  # one sample: one rank has none


def test_micro_batches_are_the_fewest_within_the_bounds_and_balanced_in_tokens():
    rng = np.random.default_rng(2)
    for _ in range(200):
        lengths = rng.integers(1, 20, size=int(rng.integers(1, 9)))
        c = cumulative(lengths)
        bound = int(rng.integers(1, 40))
        needed = count_micro_batches(c, bound, None)
        best = None  # brute force over every contiguous split into `needed` parts
        for cuts in itertools.combinations(range(1, len(lengths)), needed - 1):
            edges = (0, *cuts, len(lengths))
            parts = [int(c[b] - c[a]) for a, b in zip(edges, edges[1:])]
            ok = all(p <= bound or b - a == 1 for p, a, b in zip(parts, edges, edges[1:]))
            if ok:
                best = max(parts) if best is None else min(best, max(parts))
        assert best is not None  # the greedy count is feasible
        if needed > 1:  # and no fewer parts are
            for cuts in itertools.combinations(range(1, len(lengths)), needed - 2):
                edges = (0, *cuts, len(lengths))
                assert any(int(c[b] - c[a]) > bound and b - a > 1 for a, b in zip(edges, edges[1:]))
        pieces = split_tokens(c, needed)
        assert len(pieces) == needed and max(int(c[b] - c[a]) for a, b in pieces) == best


def test_split_into_more_parts_than_samples_leaves_the_last_ones_empty():
    assert split_tokens(cumulative([3, 4]), 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert split_tokens(cumulative([3, 4, 5, 6]), 2, max_samples=2) == [(0, 2), (2, 4)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_epoch_is_covered_exactly_under_changing_budgets_and_resumes_under_another_world_size(world_size,
                                                                                                   drop_last):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 25, size=97).tolist()
    budgets = [30, 200, 7, 64, 150, 12]
    samplers = [token_sampler(lengths, 30, world_size=world_size, rank=r, seed=4, drop_last=drop_last)
                for r in range(world_size)]
    seen, dropped = [], 0
    for epoch in range(3):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        steps = [iter(s) for s in samplers]
        k = 0
        while True:
            for sampler in samplers:
                sampler.set_batch_size(budgets[k % len(budgets)])
            try:
                shares = [next(s) for s in steps]
            except StopIteration:
                break
            batch = [i for share in shares for i in share]
            tokens = sum(lengths[i] for i in batch)
            assert tokens <= budgets[k % len(budgets)] or len(batch) == 1
            seen.extend(batch)
            k += 1
        covered = sorted(seen[len(seen) - (97 - samplers[0].dropped_samples + dropped):])
        dropped = samplers[0].dropped_samples
        if not drop_last:
            assert covered == list(range(97))
        else:
            assert len(set(covered)) == len(covered)
    # A state saved mid-epoch continues under another world size with exactly the remaining indices.
    one = token_sampler(lengths, 50, seed=4, drop_last=drop_last)
    batches = iter(one)
    first = [next(batches) for _ in range(3)]
    state = one.state_dict()
    assert state["batch_unit"] == "tokens" and state["total_tokens"] == sum(lengths)
    rest_one = [i for b in batches for i in b]
    two = [token_sampler(lengths, 1, world_size=2, rank=r, seed=4, drop_last=drop_last) for r in range(2)]
    for s in two:
        s.load_state_dict(state)
    rest_two = [i for shares in zip(*(iter(s) for s in two)) for share in shares for i in share]
    assert rest_two == rest_one and len(set(sum(first, []) + rest_one)) == len(sum(first, []) + rest_one)


def test_len_counts_the_batches_an_iteration_yields():
    lengths = np.random.default_rng(5).integers(1, 20, size=60).tolist()
    for drop_last in (False, True):
        sampler = token_sampler(lengths, 45, seed=1, drop_last=drop_last)
        expected = len(sampler)
        assert expected == len(list(sampler))


def test_a_state_in_another_unit_or_of_other_lengths_is_refused():
    lengths = [3, 4, 5, 6]
    tokens = token_sampler(lengths, 8)
    samples = AdaptiveBatchSampler(4, 2)
    with pytest.raises(ValueError, match="counts batches in samples .* this sampler in tokens"):
        tokens.load_state_dict(samples.state_dict())
    with pytest.raises(ValueError, match="counts batches in tokens"):
        samples.load_state_dict(tokens.state_dict())
    with pytest.raises(ValueError, match=r"total_tokens=18\) but this sampler in tokens \(total_tokens=19"):
        token_sampler([3, 4, 5, 7], 8).load_state_dict(tokens.state_dict())


class Columns:
    """What a Hugging Face datasets.Dataset shows batchpilot: column names and whole columns by name."""

    column_names = ["input_ids", "n"]

    def __init__(self) -> None:
        self.rows = [[1, 2, 3], [4], [5, 6]]

    def __len__(self) -> int:
        return 3

    def __getitem__(self, key):
        if key == "input_ids":
            return self.rows
        if key == "n":
            return [3, 1, 2]
        return {"input_ids": torch.tensor(self.rows[key])}


def test_lengths_come_from_a_sequence_an_attribute_or_a_column():
    ds = TensorDataset(torch.arange(3))
    ds.lengths = [2, 5, 1]  # type: ignore[attr-defined]
    assert token_lengths(ds, "lengths", 3).tolist() == [2, 5, 1]
    assert token_lengths(ds, np.array([2, 5, 1]), 3).tolist() == [2, 5, 1]
    assert token_lengths(ds, torch.tensor([2, 5, 1]), 3).tolist() == [2, 5, 1]
    assert token_lengths(Columns(), "input_ids", 3).tolist() == [3, 1, 2]
    assert token_lengths(Columns(), "n", 3).tolist() == [3, 1, 2]


@pytest.mark.parametrize("lengths, error, message", [
    (None, ValueError, "batch_unit='tokens' needs lengths="),
    ([2, 5], ValueError, "lengths has 2 entries but the dataset has 3 samples"),
    ([2, 0, 1], ValueError, r"lengths\[1\] is 0; every sample needs at least one token"),
    ([2, -4, 1], ValueError, r"lengths\[1\] is -4"),
    ([2, 1.5, 1], TypeError, r"lengths\[1\] is 1.5 of type float"),
    ([2, True, 1], TypeError, r"lengths\[1\] is True"),
    ("sizes", ValueError, "lengths='sizes' names no attribute or column"),
    (3, TypeError, "lengths must be a sequence of ints"),
])
def test_bad_lengths_are_refused_with_the_sample_and_the_fix(lengths, error, message):
    with pytest.raises(error, match=message):
        AdaptiveDataLoader(TensorDataset(torch.arange(3)), 10, batch_unit="tokens", lengths=lengths)


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_unit="words", lengths=[1, 1, 1]), "batch_unit='words'"),
    (dict(lengths=[1, 1, 1]), "lengths is given but batch_unit='samples'"),
    (dict(max_micro_batch_tokens=8), "max_micro_batch_tokens is given but batch_unit='samples'"),
    (dict(batch_unit="tokens", lengths=[1, 1, 1], max_micro_batch_tokens=0), "max_micro_batch_tokens=0"),
])
def test_bad_token_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveDataLoader(TensorDataset(torch.arange(3)), 10, **kwargs)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_plans_token_micro_batches_and_rewinds_on_a_budget_change(num_workers):
    lengths = np.random.default_rng(6).integers(1, 16, size=50).tolist()
    ds = TensorDataset(torch.arange(50))
    loader = AdaptiveDataLoader(ds, 40, batch_unit="tokens", lengths=lengths, max_micro_batch_tokens=24, seed=2,
                                num_workers=num_workers)
    seen, budgets = [], iter([90, 13, 60, 200, 35] * 10)
    assert loader.next_step_size() == sum(lengths[i] for i in loader.sampler.order()[:plan_token_batch(
        loader.sampler.order(), 0, lengths, 40)])
    for micro in loader:
        assert micro.data[0].tolist() == micro.indices.tolist()
        assert micro.tokens == sum(lengths[i] for i in micro.indices) and (micro.tokens <= 24 or micro.size == 1)
        seen.extend(micro.indices.tolist())
        if micro.is_last:
            loader.set_batch_size(next(budgets))
    loader.close()
    assert sorted(seen) == list(range(50))


def test_a_fixed_number_of_micro_batches_per_step_on_every_rank():
    lengths = np.random.default_rng(7).integers(1, 16, size=41).tolist()
    ds = TensorDataset(torch.arange(41))
    loaders = [AdaptiveDataLoader(ds, 60, batch_unit="tokens", lengths=lengths, accumulation_steps=3, rank=r,
                                  world_size=2, seed=1) for r in range(2)]
    seen = []
    for pair in zip(*loaders):
        assert pair[0].accumulation_steps == pair[1].accumulation_steps == 3
        assert pair[0].global_tokens == pair[1].global_tokens
        seen.extend(i for m in pair if not m.ghost for i in m.indices.tolist())
    assert sorted(seen) == list(range(41))
