"""`AdaptiveBatchSampler` refuses bad arguments and bad states with a message that names them, and changes
nothing when it does; its state is plain JSON, the same on every rank."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _sampler_helpers import make_job

from batchpilot.data.sampler import AdaptiveBatchSampler

# ------------------------------------------------------------------------------------------- batch sizes and settings
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


# ------------------------------------------------------------------------------------------- states
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
