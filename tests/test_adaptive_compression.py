"""AdaptiveCompression: the decision rule, bad input, and 2 real gloo ranks (choices, agreement, exact resume)."""

from __future__ import annotations

import json
import math

import _adaptive_workers as w
import pytest
import torch.multiprocessing as mp

from batchpilot.distributed.adaptive_compression import AdaptiveCompression
from batchpilot.distributed.adaptive_rule import choose_level, codec_seconds, level_bytes, parse_level


def test_levels_parse_and_bad_names_say_what_to_use():
    assert parse_level("none") == ("none", 0)
    assert parse_level("PowerSGD:4") == ("powersgd", 4)
    assert parse_level("powersgd") == ("powersgd", 1)
    for bad in ("gzip", "fp16:2", "powersgd:0", "powersgd:x"):
        with pytest.raises(ValueError, match="powersgd"):
            parse_level(bad)
    with pytest.raises(TypeError, match="string"):
        parse_level(3)


@pytest.mark.parametrize("kwargs,match", [
    ({"levels": ["none", "zip"]}, "unknown compression level"),
    ({"levels": []}, "non-empty"),
    ({"levels": "fp16"}, "non-empty list"),
    ({"levels": ["fp16", "fp16"]}, "twice"),
    ({"initial": "1bit", "levels": ["none", "fp16"]}, "initial"),
    ({"every": 0}, "every"),
    ({"min_dwell": -1}, "min_dwell"),
    ({"tolerance": float("nan")}, "tolerance"),
    ({"hysteresis": -0.1}, "hysteresis"),
    ({"link_delay": -1e-9}, "link_delay"),
    ({"memory": 3, "every": 10}, "memory"),
])
def test_bad_settings_are_refused_with_the_value_and_a_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveCompression(**kwargs)


def test_the_rule_prefers_fidelity_within_tolerance_and_does_not_flap():
    # levels least to most lossy; predicted step seconds
    assert choose_level([1.00, 0.99, 0.98], current=0, tolerance=0.05, hysteresis=0.05) == 0  # all within 5%
    assert choose_level([2.00, 1.20, 1.00], current=0, tolerance=0.05, hysteresis=0.05) == 2  # network-bound
    # 8% slower than the fastest: outside the tolerance but inside the dead band -> stay
    assert choose_level([1.08, 1.00], current=0, tolerance=0.05, hysteresis=0.05) == 0
    assert choose_level([1.11, 1.00], current=0, tolerance=0.05, hysteresis=0.05) == 1
    # back to the less lossy level only once it is within the tolerance again
    assert choose_level([1.08, 1.00], current=1, tolerance=0.05, hysteresis=0.05) == 1
    assert choose_level([1.04, 1.00], current=1, tolerance=0.05, hysteresis=0.05) == 0


def test_predicted_bytes_match_the_hooks_formulas():
    shapes = [(256, 64), (256,), (10, 256), (10,)]
    n = 256 * 64 + 256 + 2560 + 10
    for world in (2, 4):
        ring = 2 * (world - 1) / world
        assert level_bytes("none", 0, shapes, world) == ring * 4 * n
        assert level_bytes("fp16", 0, shapes, world) == ring * 2 * n
        # PowerSGD rank 2: both matrices compressed, the biases sent as they are
        assert level_bytes("powersgd", 2, shapes, world) == ring * 4 * ((256 + 64) * 2 + 256 + (10 + 256) * 2 + 10)
        one_bit = level_bytes("1bit", 0, shapes, world)
        assert one_bit == 2 * (world - 1) * sum(math.ceil(m / (8 * world)) + 4 for m in (256 * 64, 256, 2560, 10))
        assert level_bytes("none", 0, shapes, world) / one_bit > 25
    assert all(codec_seconds(k, r, shapes, 2) >= 0 for k, r in (("none", 0), ("fp16", 0), ("powersgd", 2), ("1bit", 0)))


@pytest.mark.distributed
def test_two_ranks_keep_full_precision_when_cheap_compress_behind_a_slow_link_and_agree(tmp_path):
    mp.spawn(w.choice_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"choice{r}.json").read_text()) for r in range(2))
    for name in ("cheap", "slow"):
        assert r0[name]["used"] == r1[name]["used"], name  # every step, every rank, the same level
        assert r0[name]["switches"] == r1[name]["switches"]
    cheap, slow = r0["cheap"], r0["slow"]
    # cheap: full precision, but for a level tried on a prediction and left at the next decision
    assert cheap["used"][-1] == "none" and cheap["used"].count("none") >= 0.6 * len(cheap["used"]), cheap
    # slow: a compressed level from the first decision with a latency sample (step 10) on
    assert not {"none", "fp16"} & set(slow["used"][20:]), slow
    assert slow["wire"] < 0.5 * slow["full"], slow


@pytest.mark.distributed
@pytest.mark.parametrize("level", ["powersgd:2", "1bit"])
def test_state_dict_round_trips_and_resume_is_exact(tmp_path, level):
    mp.spawn(w.resume_worker, args=(2, str(tmp_path / "init"), str(tmp_path), level), nprocs=2, join=True)
    for r in range(2):
        res = json.loads((tmp_path / f"resume{r}.json").read_text())
        assert res["has_error"], res  # the error-feedback buffers were in the state
        assert res["same_state"], res
        assert res["equal"], res
        assert res["wire2"] == res["wire"], res
        assert res["wire"] < res["full"] / 3, res


@pytest.mark.distributed
def test_pilot_runs_auto_and_resumes_a_compressed_level_exactly(tmp_path):
    mp.spawn(w.pilot_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"pilot{r}.json").read_text()) for r in range(2))
    assert r0["auto"]["kind"] == "AdaptiveCompression" and r0["auto"]["step"] == 12
    assert r0["auto"]["weights"] == r1["auto"]["weights"]
    for r in (r0, r1):
        assert r["resumed"]["weights"] == r["straight"]["weights"]
        assert r["resumed"]["wire"] == r["straight"]["wire"] < r["straight"]["full"]
