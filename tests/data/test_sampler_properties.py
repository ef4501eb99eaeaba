"""Property tests of `AdaptiveBatchSampler`: the exactness and resumability guarantees under random decisions.

The properties drive every rank of a job (one sampler per rank, as in a real DDP run) through random
sequences of ``set_batch_size`` calls, and check the guarantees of the class docstring against values
derived from first principles (``share_bounds`` is re-derived, not reused).
"""

from __future__ import annotations

import json

from _sampler_helpers import FAST, Job, UserLoop, counters, expected_len, expected_shares, make_job, scenarios
from harness import assert_state_roundtrip, epoch_ends
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.data.sampler import AdaptiveBatchSampler


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


# ------------------------------------------------------------------------------------------- resume
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


# ------------------------------------------------------------------------------------------- len
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


@FAST
@given(sc=scenarios(max_n=60), set_epoch=st.booleans(), w2=st.integers(1, 4), data=st.data())
def test_a_users_loop_resumed_from_inside_it_goes_on_as_the_uninterrupted_one(sc, set_epoch, w2, data):
    """A state saved in a user's loop body (right after an epoch's last batch, before the loop's StopIteration,
    too), with or without set_epoch, drop_last tails and another world size on load: the resumed loop trains
    exactly what the uninterrupted one does from there, under the same epoch numbers (it used to train the
    epoch again, or one epoch too many)."""
    n, drop_last = sc["n"], sc["drop_last"]
    sizes = [min(x, n) for x in sc["sizes"]] if drop_last else sc["sizes"]  # no empty epochs
    kwargs = dict(shuffle=sc["shuffle"], seed=sc["seed"], drop_last=drop_last)

    def make(world_size: int) -> UserLoop:
        return UserLoop(n, world_size, sizes, set_epoch=set_epoch, **kwargs)

    live = make(sc["world_size"])
    ends = epoch_ends([live.step(t)[0] for t in range(60)])
    restore_at = [data.draw(st.sampled_from(ends), label="at an epoch end")] if ends else []
    restore_at.append(data.draw(st.integers(0, 40), label="anywhere"))
    horizon = data.draw(st.integers(1, 30), label="horizon")
    assert_state_roundtrip(
        lambda: make(sc["world_size"]),
        lambda loop, t: loop.step(t),
        lambda loop, t: [loop.step(u) for u in range(t, t + horizon)],
        steps=restore_at,
        make_restored=lambda: make(w2),
        advance_before_load=2,
    )
