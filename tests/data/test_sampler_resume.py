"""Resuming `AdaptiveBatchSampler` from inside a loop: a state saved right after an epoch's last batch (before
the loop's StopIteration) goes on as the uninterrupted loop would, whichever way the user loops; and the
position()/seek() API the loader rewinds with."""

from __future__ import annotations

import json

import pytest
import torch
from harness import assert_same

from batchpilot import AdaptiveDataLoader
from batchpilot.data.sampler import AdaptiveBatchSampler, SamplerPosition


def _resumed_run(n: int, size: int, *, save_after: int, set_epoch: bool, epochs: int = 2, world_sizes=(1, 1),
                 drop_last: bool = False):
    """``for epoch in range(epochs): [set_epoch]; for batch in sampler``, saved in the loop body after batch
    ``save_after`` (counted from 1) and resumed there with ``world_sizes[1]`` ranks: the (epoch, global batch)
    pairs the resumed run trains, and the state it saved."""
    def job(world_size):
        return [AdaptiveBatchSampler(n, size, shuffle=False, drop_last=drop_last, rank=r, world_size=world_size)
                for r in range(world_size)]

    def loop(samplers, start, stop_after=None):
        out = []
        for epoch in range(start, epochs):
            if set_epoch:
                for s in samplers:
                    s.set_epoch(epoch)
            iters = [iter(s) for s in samplers]
            while (shares := [next(it, None) for it in iters]) != [None] * len(iters):  # every rank, as in DDP
                out.append((epoch, sum(shares, [])))
                if len(out) == stop_after:
                    return out, epoch, json.loads(json.dumps(samplers[0].state_dict()))
        return out, None, None

    uninterrupted, _, _ = loop(job(world_sizes[0]), 0)
    _, epoch, state = loop(job(world_sizes[0]), 0, stop_after=save_after)
    resumed = job(world_sizes[1])
    for s in resumed:
        s.load_state_dict(state)
    out, _, _ = loop(resumed, epoch)
    assert out == uninterrupted[save_after:]
    return out, state


@pytest.mark.parametrize("set_epoch", [True, False])
def test_the_issues_example_trains_the_next_epoch_once_after_resuming_at_an_epochs_end(set_epoch):
    # Saved after the second (last) batch of epoch 0: it used to train epoch 0 again (set_epoch(0) moved back
    # to its start), or, without set_epoch, epoch 1 under the number 0 and then epoch 2: 20 samples, not 10.
    out, state = _resumed_run(10, 5, save_after=2, set_epoch=set_epoch)
    assert out == [(1, [0, 1, 2, 3, 4]), (1, [5, 6, 7, 8, 9])]
    assert (state["epoch"], state["offset"], state["loop_epoch"]) == (1, 0, 0)


@pytest.mark.parametrize("set_epoch", [True, False])
@pytest.mark.parametrize("world_sizes", [(2, 3), (3, 1)])
def test_a_resume_at_an_epochs_end_under_another_world_size_goes_on_as_uninterrupted(set_epoch, world_sizes):
    out, _ = _resumed_run(7, 3, save_after=3, set_epoch=set_epoch, epochs=3, world_sizes=world_sizes)
    assert [epoch for epoch, _ in out] == [1, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("set_epoch", [True, False])
def test_a_resume_after_an_epochs_last_full_batch_drops_its_tail_and_ends_that_epoch(set_epoch):
    # drop_last: 10 samples at 4 leave a tail of 2 after batch 2, dropped by the loop's next (last) request.
    out, state = _resumed_run(10, 4, save_after=2, set_epoch=set_epoch, drop_last=True)
    assert out == [(1, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
    assert (state["epoch"], state["offset"], state["loop_epoch"]) == (0, 8, 0)


def test_the_resumed_loop_drops_and_counts_the_tail_exactly_once():
    s = AdaptiveBatchSampler(10, 4, shuffle=False, drop_last=True)
    it = iter(s)
    next(it), next(it)
    state = s.state_dict()
    r = AdaptiveBatchSampler(10, 4, shuffle=False, drop_last=True)
    r.load_state_dict(state)
    assert list(r) == [] and (r.epoch, r.offset, r.dropped_samples) == (1, 0, 2)
    assert list(it) == [] and (s.epoch, s.offset, s.dropped_samples) == (1, 0, 2)  # the uninterrupted loop
    assert r.state_dict() == s.state_dict()
    assert list(r) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_smaller_size_set_before_resuming_at_a_tail_takes_it_as_the_uninterrupted_loop_would():
    s = AdaptiveBatchSampler(10, 4, shuffle=False, drop_last=True)
    it = iter(s)
    next(it), next(it)
    s.set_batch_size(2)
    r = AdaptiveBatchSampler(10, 4, shuffle=False, drop_last=True)
    r.load_state_dict(s.state_dict())
    assert list(r) == list(it) == [[8, 9]]


def test_naming_the_next_epoch_after_resuming_at_an_epochs_end_trains_it_at_once():
    # A user who saved epoch + 1 (the loop was done) calls set_epoch(1): the saved loop is over.
    s = AdaptiveBatchSampler(6, 3, shuffle=False)
    it = iter(s)
    next(it), next(it)
    r = AdaptiveBatchSampler(6, 3, shuffle=False)
    r.load_state_dict(s.state_dict())
    r.set_epoch(1)
    assert list(r) == [[0, 1, 2], [3, 4, 5]] and r.epoch == 2


def test_a_state_saved_between_loops_or_after_a_break_starts_a_new_loop():
    s = AdaptiveBatchSampler(6, 3, shuffle=False)
    assert len(list(s)) == 2  # the loop ended: StopIteration
    between = s.state_dict()
    assert "loop_epoch" not in between
    for _ in s:
        break  # the loop is left (its iterator closed) at epoch 1's first batch
    after_break = s.state_dict()
    assert "loop_epoch" not in after_break and after_break["offset"] == 3
    r = AdaptiveBatchSampler(6, 3, shuffle=False)
    r.load_state_dict(between)
    assert list(r) == [[0, 1, 2], [3, 4, 5]]
    r.load_state_dict(after_break)
    assert list(r) == [[3, 4, 5]]


def test_a_torch_dataloader_over_the_sampler_resumes_at_an_epochs_end_as_uninterrupted():
    dataset = torch.utils.data.TensorDataset(torch.arange(8))

    def run(sampler, start, save_after=None):
        rows = []
        for epoch in range(start, 3):
            sampler.set_epoch(epoch)
            for (x,) in torch.utils.data.DataLoader(dataset, batch_sampler=sampler):
                rows.append((epoch, x.tolist()))
                if len(rows) == save_after:
                    return rows, epoch, sampler.state_dict()
        return rows, None, None

    uninterrupted, _, _ = run(AdaptiveBatchSampler(8, 4, seed=1), 0)
    _, epoch, state = run(AdaptiveBatchSampler(8, 4, seed=1), 0, save_after=4)
    resumed = AdaptiveBatchSampler(8, 4, seed=1)
    resumed.load_state_dict(state)
    assert run(resumed, epoch)[0] == uninterrupted[4:] and [e for e, _ in uninterrupted[4:]] == [2, 2]


def test_a_state_inside_a_loop_round_trips_and_an_older_state_without_loop_epoch_loads():
    s = AdaptiveBatchSampler(6, 3, shuffle=False)
    it = iter(s)
    next(it)
    state = s.state_dict()
    assert state["loop_epoch"] == 0
    r = AdaptiveBatchSampler(6, 3, shuffle=False)
    r.load_state_dict(state)
    assert_same(r.state_dict(), state)
    r.load_state_dict({k: v for k, v in state.items() if k != "loop_epoch"})
    assert "loop_epoch" not in r.state_dict() and list(r) == [[3, 4, 5]]


@pytest.mark.parametrize("bad, message", [(-1, "loop_epoch must be >= 0"), ("0", "loop_epoch must be an int")])
def test_a_corrupt_loop_epoch_is_refused_and_changes_nothing(bad, message):
    s = AdaptiveBatchSampler(6, 3, shuffle=False)
    before = s.state_dict()
    with pytest.raises(ValueError, match=message):
        s.load_state_dict({**before, "loop_epoch": bad})
    assert s.state_dict() == before


# ------------------------------------------------------------------------------------------- position and seek
def test_position_and_seek_round_trip_and_seek_refuses_an_offset_outside_the_epoch():
    s = AdaptiveBatchSampler(10, 4, shuffle=False, drop_last=True)
    assert s.position() == SamplerPosition(0, 0, 0, 0)
    list(s)
    assert s.position() == SamplerPosition(epoch=1, offset=0, samples_seen=8, dropped_samples=2)
    s.seek(SamplerPosition(3, 4, 20, 6))
    assert (s.epoch, s.offset, s.samples_seen, s.dropped_samples) == (3, 4, 20, 6)
    assert list(s) == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"offset=10: it must be in \[0, 10\)"):
        s.seek(SamplerPosition(0, 10, 0, 0))


def test_the_loaders_states_hold_no_loop_and_its_set_epoch_speaks_of_its_next_step():
    loader = AdaptiveDataLoader(torch.utils.data.TensorDataset(torch.arange(6)), 3, shuffle=False)
    for _ in loader:
        state = loader.state_dict()
    assert "loop_epoch" not in state and (state["epoch"], state["offset"]) == (1, 0)
    sampler_state = AdaptiveBatchSampler(6, 3, shuffle=False).state_dict()
    loader.load_state_dict({**sampler_state, "loop_epoch": 0})  # a bare sampler's state: the loader's loops are its own
    assert "loop_epoch" not in loader.state_dict()
    assert [m.indices.tolist() for m in loader] == [[0, 1, 2], [3, 4, 5]]
    loader.sampler.set_epoch(1)  # the epoch of the next step: a no-op
    assert loader.position() == (1, 0, 6)
