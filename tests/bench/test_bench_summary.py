"""Bench results without training: summaries, the policy language, the critical-batch fit."""

from __future__ import annotations

import pytest

from batchpilot.bench import parse_policies, parse_policy, summarize
from batchpilot.controllers.base import Observation


# ------------------------------------------------------------------------------------- summaries
def _run(policy, t, samples=None):
    return {"policy": policy, "seed": 0, "time_to_target_s": t, "steps_to_target": None if t is None else 1,
            "samples_to_target": samples if t is not None else None, "final_accuracy": 0.5, "wall_s": 9.0,
            "batch_sizes": []}


def test_summarize_counts_missed_runs_as_infinitely_slow():
    runs = [_run("static:32", 10.0), _run("static:32", 12.0), _run("static:32", None),
            _run("static:128", 5.0), _run("static:128", None), _run("static:128", None),
            _run("ramp:32-512", 4.0), _run("ramp:32-512", 6.0)]
    summary, best = summarize(runs)
    assert summary["static:32"]["median_time_to_target_s"] == 12.0  # median of (10, 12, inf)
    assert summary["static:128"]["median_time_to_target_s"] is None  # median of (5, inf, inf)
    assert summary["static:128"]["ratio_vs_best_static"] is None
    assert summary["static:32"]["runs_reached"] == 2 and summary["static:32"]["runs"] == 3
    assert best == "static:32"
    assert summary["static:32"]["ratio_vs_best_static"] == 1.0
    assert summary["ramp:32-512"]["ratio_vs_best_static"] == 5.0 / 12.0


def test_target_b_reads_static_32_from_the_tuned_grid_when_it_was_not_asked_for_alone():
    from batchpilot.bench.summary import finish_results

    runs = [_run("static:32@lr=0.005", 20.0), _run("static:32", 10.0), _run("static:32@lr=0.02", 8.0),
            _run("noise-scale", 3.2)]
    members = {"tuned-static:32": ["static:32@lr=0.005", "static:32", "static:32@lr=0.02"],
               "noise-scale": ["noise-scale"]}
    results = finish_results({"runs": runs, "members": members,
                              "config": {"policies": ["tuned-static:32", "noise-scale"]}})
    b = results["targets"]["b"]
    assert b["status"] == "PASS" and b["value"] == 3.125, b  # static:32 (10 s) / noise-scale (3.2 s) vs >= 3x
    assert "static:32" not in results["summary"]  # the table keeps the requested policies
    assert results["untuned_default"]["policy"] == "static:32"
    assert results["untuned_default"]["median_time_to_target_s"] == 10.0


def test_summarize_without_a_static_policy_has_no_ratio():
    summary, best = summarize([_run("ramp:32-512", 3.0)])
    assert best is None and summary["ramp:32-512"]["ratio_vs_best_static"] is None
    assert summary["ramp:32-512"]["median_time_to_target_s"] == 3.0


# -------------------------------------------------------------------------------------- policies
def test_parse_policy_forms():
    assert parse_policy("static:64").batch_size == 64 and parse_policy("static:64").kind == "static"
    ramp = parse_policy(" RAMP ")
    assert (ramp.name, ramp.batch_size, ramp.end, ramp.every_epochs) == ("ramp:32-512", 32, 512, 0.25)
    assert parse_policy("ramp:16-256@0.5").name == "ramp:16-256@0.5"
    w = parse_policy("warmup:32-512@1+2")
    assert (w.kind, w.batch_size, w.end, w.every_epochs, w.ramp_epochs) == ("warmup", 32, 512, 1.0, 2.0)
    assert [p.name for p in parse_policies("static:32, static:128,ramp")] == ["static:32", "static:128", "ramp:32-512"]


def test_ramp_doubles_every_quarter_epoch_up_to_its_end():
    controller = parse_policy("ramp").make_controller(4000)  # a quarter epoch is 1000 samples
    sizes = [controller.decide(Observation(step=0, samples_seen=s, epoch=0, coverage=0.0, batch_size=32))
             for s in (0, 999, 1000, 2000, 3000, 4000, 5000, 40000)]
    assert sizes == [32, 32, 64, 128, 256, 512, 512, 512]
    assert parse_policy("static:32").make_controller(4000) is None


@pytest.mark.parametrize("spec, fragment", [
    ("static:0", "not a whole number >= 1"),
    ("static:abc", "'abc' is not a whole number"),
    ("static:", "is not a whole number"),
    ("ramp:512-32", "must be larger than start"),
    ("ramp:32", "ramp:START-END"),
    ("ramp:32-512@0", "must be > 0"),
    ("warmup:32-512", "warmup:SMALL-TARGET@W+R"),
    ("adaptive:7", "unknown policy kind 'adaptive'"),
    ("static:\u00b2", "'\u00b2' is not a whole number"),
    ("static:3\u0663", "'3\u0663' is not a whole number"),
    ("noise-scale@lr-rule=", "lr-rule '' is not one of"),
    ("static:512@lr-rule=", "lr-rule '' is not one of"),
])
def test_bad_policy_names_the_spec_and_the_valid_forms(spec, fragment):
    with pytest.raises(ValueError) as info:
        parse_policy(spec)
    message = str(info.value)
    assert repr(spec) in message and fragment in message and "static:N" in message


def test_policy_list_errors():
    with pytest.raises(ValueError, match="listed twice"):
        parse_policies("static:32,static:32")
    with pytest.raises(ValueError, match="no policy given"):
        parse_policies(" , ")


# ----------------------------------------------------------------------------- critical batch (McCandlish fit)
def _epochs_summary(points: dict[str, float]) -> dict[str, dict[str, float]]:
    return {name: {"median_epochs_to_target": e} for name, e in points.items()}


def _noise_run(values: list[tuple[float, float]], reached: float | None) -> dict:
    return {"epochs_to_target": reached, "curve": [{"epochs": e, "noise_scale": n} for e, n in values]}


def test_critical_batch_recovers_mccandlish_line_and_compares_b_simple():
    from batchpilot.bench.report import critical_batch_lines
    from batchpilot.bench.summary import critical_batch

    # E = 10 (1 + B / 500) exactly; a static:128 at the rule LR loses to the tuned cell of the same size.
    exact = {f"tuned-static:{b}": 10 * (1 + b / 500) for b in (64, 128, 256, 512)}
    summary = _epochs_summary({**exact, "static:128": 99.0, "noise-scale": 3.0, "tuned-static:1024": None})
    runs = [
        _noise_run([(1.0, 100.0), (3.0, 250.0), (5.0, 900.0)], reached=3.0),  # 250 at its target
        _noise_run([(0.5, None), (2.0, 300.0)], reached=2.5),                  # 300
        _noise_run([(1.0, 50.0)], reached=None),                               # missed: not counted
        {"epochs_to_target": 4.0, "curve": [{"epochs": 1.0, "noise_scale": None}]},  # never measured
    ]
    cb = critical_batch(summary, runs)
    assert [b for b, _ in cb["points"]] == [64, 128, 256, 512]
    assert cb["points"][1][1] == pytest.approx(10 * (1 + 128 / 500))
    assert cb["epochs_min"] == pytest.approx(10.0) and cb["b_crit"] == pytest.approx(500.0)
    assert cb["b_simple_at_target"] == pytest.approx(275.0) and cb["runs_with_noise"] == 2
    assert cb["ratio"] == pytest.approx(500 / 275)
    text = "\n".join(critical_batch_lines({"critical_batch": cb}))
    assert "B_crit = 500" in text and "B_crit / B_simple = **1.8**" in text


def test_critical_batch_says_why_there_is_no_fit():
    from batchpilot.bench.summary import critical_batch

    flat = critical_batch(_epochs_summary({"static:64": 5.0, "static:128": 5.0, "static:256": 4.0}), [])
    assert flat["b_crit"] is None and "beyond 256" in flat["note"] and flat["b_simple_at_target"] is None
    steep = critical_batch(_epochs_summary({"static:32": 1.0, "static:64": 3.0, "static:128": 7.0}), [])
    assert steep["b_crit"] is None and "at or below 32" in steep["note"]  # fit -1 + 0.0625 B
    two = critical_batch(_epochs_summary({"static:64": 5.0, "static:128": 6.0}), [])
    assert two["b_crit"] is None and "needs 3" in two["note"]
    assert critical_batch({}, [])["points"] == []
