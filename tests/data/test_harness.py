"""The state round-trip harness (tests/harness.py) has teeth: on the sampler, it passes the real class and
catches each way of breaking a state; its equality is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _sampler_helpers import counters
from harness import assert_same, assert_state_roundtrip

from batchpilot.data.sampler import AdaptiveBatchSampler


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
