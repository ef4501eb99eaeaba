"""Explicit examples of `AdaptiveBatchSampler`: shares, drop_last tails, len, the order, set_epoch, and a
plain torch DataLoader over it."""

from __future__ import annotations

import pytest
import torch
from _sampler_helpers import make_job

from batchpilot.data.sampler import AdaptiveBatchSampler, share_bounds


def test_share_bounds_by_hand():
    assert [share_bounds(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [share_bounds(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert share_bounds(0, 0, 1) == (0, 0)


def test_small_final_batch_gives_empty_shares_but_every_rank_yields():
    ranks = make_job(5, 4, batch_size=3, shuffle=False)
    per_rank = [list(s) for s in ranks]
    assert per_rank == [[[0], [3]], [[1], [4]], [[2], []], [[], []]]


# ------------------------------------------------------------------------------------------- drop_last
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


def test_drop_last_with_a_size_beyond_the_dataset_drops_the_whole_epoch():
    s = AdaptiveBatchSampler(5, 8, drop_last=True)
    assert len(s) == 0
    assert list(s) == []
    assert (s.epoch, s.samples_seen, s.dropped_samples) == (1, 0, 5)
    s.set_batch_size(5)
    assert len(s) == 1 and len(list(s)) == 1 and s.epoch == 2


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


# ------------------------------------------------------------------------------------------- len and order
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
