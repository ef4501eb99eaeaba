"""Benchmark logic without training: the policy language, run specs, the cost model, summaries, targets."""

from __future__ import annotations

import json
import math

import pytest

from batchpilot.bench.calibrate import Calibration, _suffix_min, size_grid
from batchpilot.bench.policies import NAMED_SETS, parse_policies, parse_policy, workload_grid
from batchpilot.bench.specs import Plan, expand
from batchpilot.bench.summary import category, evaluate_targets, grid_search_cost, summarize
from batchpilot.controllers import Goodput, NoiseScale, ThresholdRules, VarianceRule

# A plan like mnist1d's: lr 0.01 at 32, linear rule, 48k samples, bounds 32..4096.
PLAN = Plan(base_lr=0.01, base_batch_size=32, lr_rule="linear", num_samples=48_000, min_size=32, max_size=4096,
            finder_size=2048)


# ------------------------------------------------------------------------------------------ parsing
def test_new_policy_forms_and_canonical_names():
    p = parse_policy("static:512@lr=0.1")
    assert (p.name, p.kind, p.batch_size, p.lr) == ("static:512@lr=0.1", "static", 512, 0.1)
    assert parse_policy("tuned-static:256").name == "tuned-static:256"
    smith = parse_policy("ramp-smith")  # the doubling interval comes from the workload (every_epochs 0)
    assert (smith.name, smith.kind, smith.batch_size, smith.end, smith.every_epochs) == (
        "ramp-smith", "smith", 512, 4096, 0.0)
    assert parse_policy("smith:512-4096@2.5").every_epochs == 2.5
    for name in ("noise-scale", "goodput", "variance-rule", "threshold-rules", "ppo", "finder"):
        assert parse_policy(f" {name.upper()} ").name == name
    assert parse_policy("noise-scale").category == "adaptive"
    assert parse_policy("tuned-static:64").category == "static"
    assert parse_policy("ramp").category == "schedule" and parse_policy("finder").category == "finder"
    g = parse_policy("goodput@lr-rule=adascale")
    assert (g.name, g.kind, g.lr_rule, g.category) == ("goodput@lr-rule=adascale", "goodput", "adascale", "adaptive")


def test_named_sets_and_ranges_expand():
    names = [p.name for p in workload_grid(parse_policies("default"), (32, 1024))]
    assert names == ["static:32", "tuned-static:32", "tuned-static:64", "tuned-static:128", "tuned-static:256",
                     "tuned-static:512", "tuned-static:1024", "finder", "noise-scale", "goodput", "auto"]
    full = [p.name for p in workload_grid(parse_policies("full"), (64, 256))]
    assert full == ["static:32", "tuned-static:64", "tuned-static:128", "tuned-static:256", "finder", "ramp:32-512",
                    "ramp-smith", "noise-scale", "goodput", "variance-rule", "threshold-rules", "ppo", "auto"]
    assert [p.name for p in parse_policies("quick")] == ["static:32", "static:512", "auto"]
    assert [p.name for p in parse_policies("tuned-static:100-400")] == ["tuned-static:100", "tuned-static:200",
                                                                         "tuned-static:400"]
    # A named set may overlap a policy written out: no error, each policy once.
    assert [p.name for p in parse_policies("adaptive,noise-scale")] == NAMED_SETS["adaptive"].split(",")


@pytest.mark.parametrize("spec, fragment", [
    ("finder:3", "takes no argument"),
    ("static:32@foo=1", "the only option of static:N is @lr=X"),
    ("static:32@lr=0", "learning rate must be > 0"),
    ("smith:512-4096", "smith:START-END@EPOCHS"),
    ("tuned-static:x", "'x' is not a whole number"),
    ("goodput@lr-rule=cubic", "lr-rule 'cubic' is not one of"),
    ("ramp-smith@lr-rule=sqrt", "smith fixes its LR"),
])
def test_bad_new_policies(spec, fragment):
    with pytest.raises(ValueError) as info:
        parse_policy(spec)
    assert fragment in str(info.value) and repr(spec) in str(info.value)


# ------------------------------------------------------------------------------------------ run specs
def test_tuned_static_grid_shares_the_plain_static_run():
    specs, members = expand(parse_policies("static:32,tuned-static:32,tuned-static:64"), PLAN)
    by_name = {s.name: s for s in specs}
    # Rule LR at 32 is 0.01, at 64 it is 0.02 (linear); the grid is x0.5, x1, x2 of it.
    assert members["tuned-static:32"] == ["static:32@lr=0.005", "static:32", "static:32@lr=0.02"]
    assert members["tuned-static:64"] == ["static:64@lr=0.01", "static:64", "static:64@lr=0.04"]
    assert members["static:32"] == ["static:32"]
    assert len(specs) == 6  # static:32 is trained once, for both policies
    assert by_name["static:32"].policies == ("static:32", "tuned-static:32") and by_name["static:32"].grid
    cell = by_name["static:64@lr=0.04"]
    assert (cell.optimizer_lr, cell.lr_rule, cell.base_batch_size, cell.lr, cell.grid) == (0.04, "none", 64, 0.04, True)
    plain = by_name["static:64"]
    assert (plain.optimizer_lr, plain.lr_rule, plain.base_batch_size, plain.lr) == (0.01, "linear", 32, 0.02)
    assert all(s.make_controller(48_000) is None for s in specs)


def test_tuned_static_under_adascale_keeps_adascale_in_every_cell():
    # Its gain changes during a run, so a cell at another LR is AdaScale from that LR, not a fixed LR (two of
    # the three cells used to train plain SGD under the AdaScale policy's name, shareable with plain cells).
    specs, members = expand(parse_policies("tuned-static:512@lr-rule=adascale,tuned-static:512"), PLAN)
    by_name = {s.name: s for s in specs}
    cells = members["tuned-static:512@lr-rule=adascale"]
    assert cells == ["static:512@lr=0.005@lr-rule=adascale", "static:512@lr-rule=adascale",
                     "static:512@lr=0.02@lr-rule=adascale"]
    for name, lr in zip(cells, (0.005, 0.01, 0.02)):
        spec = by_name[name]
        assert (spec.lr_rule, spec.optimizer_lr, spec.base_batch_size, spec.noise_every) == ("adascale", lr, 32, None)
    assert not set(cells) & set(members["tuned-static:512"])  # never shared with the plain grid
    assert len(specs) == 6


def test_finder_smith_and_adaptive_specs():
    specs, members = expand(parse_policies("finder,ramp-smith,ramp,noise-scale,goodput,variance-rule,threshold-rules"),
                            PLAN)
    by_name = {s.name: s for s in specs}
    assert members["finder"] == ["static:2048"] and by_name["static:2048"].lr == pytest.approx(0.64)
    smith = by_name["ramp-smith"]
    # Smith et al.: the LR of 512 (0.16) held while the batch doubles every smith_every_epochs = 2 epochs
    # (96,000 samples).
    assert (smith.batch_size, smith.optimizer_lr, smith.lr_rule, smith.base_batch_size) == (512, 0.16, "none", 512)
    ctrl = smith.make_controller(48_000)
    assert (ctrl.start, ctrl.factor, ctrl.every_samples, ctrl.max_size) == (512, 2, 96_000, 4096)
    ramp = by_name["ramp:32-512"]
    assert (ramp.batch_size, ramp.lr_rule, ramp.lr) == (32, "linear", 0.01)
    expected = {"noise-scale": NoiseScale(min_size=32, max_size=4096), "goodput": Goodput(min_size=32, max_size=4096),
                "variance-rule": VarianceRule(min_size=32, max_size=4096),
                "threshold-rules": ThresholdRules(min_size=32, max_size=4096)}
    for name, reference in expected.items():
        spec = by_name[name]
        controller = spec.make_controller(48_000)
        assert repr(controller) == repr(reference)  # the defaults, only the workload's bounds passed
        assert spec.batch_size == 32 and spec.noise_every is None and spec.lr == 0.01
    assert by_name["variance-rule"].lr_rule == "linear-then-sqrt"  # VarianceRule.recommended_lr_rule
    # NoiseScale's own recommended rule (AdaScale, issue 21) where it has one, else the workload's.
    assert by_name["noise-scale"].lr_rule == getattr(NoiseScale, "recommended_lr_rule", "linear")


def test_sqrt_rule_and_lr_rule_override():
    plan = Plan(0.001, 32, "sqrt", 32_768, 32, 4096, 256)
    specs, members = expand(parse_policies("tuned-static:512,goodput@lr-rule=adascale"), plan)
    by_name = {s.name: s for s in specs}
    assert by_name["static:512"].lr == pytest.approx(0.004)  # 0.001 * sqrt(16)
    assert members["tuned-static:512"] == ["static:512@lr=0.002", "static:512", "static:512@lr=0.008"]
    g = by_name["goodput@lr-rule=adascale"]
    assert (g.lr_rule, g.lr, g.noise_every) == ("adascale", 0.001, None)


# ------------------------------------------------------------------------------------------ cost model
def test_size_grid_and_suffix_min():
    assert size_grid(32, 1024) == [32, 64, 128, 256, 512, 1024]
    assert size_grid(32, 100, extra=[16, 48]) == [16, 32, 48, 64, 100]
    assert _suffix_min([3.0, 1.0, 2.0, 5.0]) == [1.0, 1.0, 2.0, 5.0]


def test_step_time_interpolation_and_finder_rule():
    cal = Calibration(sizes=[32, 64, 128, 256], step_s=[0.010, 0.012, 0.016, 0.034],
                      probe_step_s=[0.020, 0.022, 0.026, 0.044])
    assert cal.step_time(64) == 0.012
    assert cal.step_time(96) == pytest.approx(0.014)  # half-way between 0.012 and 0.016
    assert cal.step_time(96, probe=True) == pytest.approx(0.024)
    assert cal.step_time(512) == pytest.approx(0.034 + (0.034 - 0.016) * (512 - 256) / 128)  # last segment
    assert cal.step_time(16) == pytest.approx(0.009)  # first segment extended, within [t0/2, t0]
    assert cal.step_time(1) == pytest.approx(0.010 - 0.002 * 31 / 32)
    steep = Calibration(sizes=[32, 64], step_s=[0.010, 0.030], probe_step_s=[0.010, 0.030])
    assert steep.step_time(1) == 0.005  # extended below 0: clamped at half the smallest size's time
    # Throughputs 3200, 5333, 8000, 7529 samples/s: the best is 8000 at 128; 95% of it is 7600, and 256
    # (7529) falls short, so the smallest size within 5% of the best is 128.
    assert cal.finder_size() == 128
    assert cal.finder_size(max_size=64) == 64
    assert cal.finder_size(tolerance=0.1) == 128  # 7200: 256 is within 10% but 128 is smaller
    with pytest.raises(ValueError, match="no calibrated batch size"):
        cal.finder_size(max_size=16)


# ------------------------------------------------------------------------------------------ summaries
def run(policy, seed, t, acc=0.98, wall=None, grid=False, cost=None):
    return {"policy": policy, "seed": seed, "time_to_target_s": t, "cost_model_time_to_target_s": cost,
            "steps_to_target": None if t is None else 10, "samples_to_target": None if t is None else 100,
            "epochs_to_target": None if t is None else 1.0, "final_accuracy": acc,
            "wall_s": wall if wall is not None else (t if t is not None else 30.0), "grid": grid,
            "cost_model_s": cost, "batch_sizes": [], "lr": 0.1}


def test_tuned_static_picks_the_best_cell_and_counts_the_grid():
    runs = [run("static:64@lr=0.01", s, t, grid=True) for s, t in ((0, 9.0), (1, 11.0), (2, None))]
    runs += [run("static:64", s, t, grid=True, cost=t) for s, t in ((0, 6.0), (1, 8.0), (2, 7.0))]
    runs += [run("static:64@lr=0.04", s, None, acc=0.5, grid=True) for s in (0, 1, 2)]
    runs += [run("noise-scale", s, t) for s, t in ((0, 5.0), (1, 6.0), (2, 4.0))]
    members = {"tuned-static:64": ["static:64@lr=0.01", "static:64", "static:64@lr=0.04"],
               "noise-scale": ["noise-scale"]}
    summary, best = summarize(runs, ["tuned-static:64", "noise-scale"], members)
    tuned = summary["tuned-static:64"]
    assert tuned["chosen"] == "static:64" and tuned["median_time_to_target_s"] == 7.0
    assert tuned["grid"] == {"static:64@lr=0.01": 11.0, "static:64": 7.0, "static:64@lr=0.04": None}
    assert best == "tuned-static:64"
    assert summary["noise-scale"]["ratio_vs_best_static"] == 5.0 / 7.0
    assert summary["tuned-static:64"]["median_cost_model_time_to_target_s"] == 7.0
    assert set(summary) == {"tuned-static:64", "noise-scale"}
    grid = grid_search_cost(runs)
    # Per seed: 9+6+30 = 45, 11+8+30 = 49, 30+7+30 = 67 seconds of training; the median is 49.
    assert grid["per_seed_s"] == {"0": 45.0, "1": 49.0, "2": 67.0}
    assert grid["median_s"] == 49.0 and grid["total_s"] == 161.0 and len(grid["cells"]) == 3


def test_category():
    assert [category(n) for n in ("static:32", "tuned-static:64", "static:64@lr=0.1", "finder", "ramp:32-512",
                                  "smith:512-4096@2", "goodput", "goodput@lr-rule=adascale")] == [
        "static", "static", "static", "finder", "schedule", "schedule", "adaptive", "adaptive"]


def _summary(adaptive_t, static_t=10.0, untuned_t=30.0, adaptive_acc=0.98, static_acc=0.981, wall=None):
    runs = [run("static:512", 0, static_t, acc=static_acc), run("static:32", 0, untuned_t),
            run("noise-scale", 0, adaptive_t, acc=adaptive_acc, wall=wall)]
    summary, best = summarize(runs)
    return summary, best


def test_targets_pass_with_margins():
    summary, best = _summary(8.5)
    t = evaluate_targets(summary, best, {"median_s": 100.0, "cells": ["a"] * 18}, "static:32", stretch=True)
    assert t["best_adaptive"] == "noise-scale"
    assert t["a"]["status"] == "PASS" and t["a"]["value"] == 0.85 and t["a"]["threshold"] == 1.0
    assert "within by 0.15x" in t["a"]["text"] and "stretch <= 0.85x: met" in t["a"]["text"]
    assert t["b"]["status"] == "PASS" and t["b"]["value"] == pytest.approx(30 / 8.5)
    assert t["c"]["status"] == "PASS" and t["c"]["value"] == pytest.approx(100 / 8.5)


def test_targets_miss_and_say_by_how_much():
    summary, best = _summary(10.5, untuned_t=20.0, wall=25.0)
    t = evaluate_targets(summary, best, {"median_s": 100.0, "cells": []}, "static:32", stretch=True)
    assert t["a"]["status"] == "MISS" and "over by 0.05x (5%)" in t["a"]["text"]
    assert t["b"]["status"] == "MISS" and "short by 1.10x" in t["b"]["text"]  # 20 / 10.5 = 1.90x vs 3x
    assert t["c"]["status"] == "MISS" and t["c"]["value"] == 4.0  # 100 s of grid / 25 s of one run
    # Without the stretch the limit is the same 1.0x; the text leaves the stretch out.
    other = evaluate_targets(summary, best, {}, "static:32", stretch=False)
    assert other["a"]["status"] == "MISS" and other["a"]["threshold"] == 1.0 and "stretch" not in other["a"]["text"]
    assert other["c"]["status"] == "N/A"


def test_target_a_needs_the_accuracy_too():
    summary, best = _summary(5.0, adaptive_acc=0.977, static_acc=0.981)  # 0.4 points lower
    t = evaluate_targets(summary, best, {}, "static:32", stretch=True)
    assert t["a"]["status"] == "MISS" and "final accuracy 0.9770 < best static's 0.9810" in t["a"]["text"]
    summary, best = _summary(5.0, adaptive_acc=0.978, static_acc=0.981)  # exactly 0.3 points lower
    assert evaluate_targets(summary, best, {}, "static:32", stretch=True)["a"]["status"] == "PASS"


def test_targets_without_adaptive_or_when_it_misses():
    summary, best = summarize([run("static:32", 0, 3.0)])
    t = evaluate_targets(summary, best, {}, "static:32", stretch=True)
    assert t["best_adaptive"] is None and {t[k]["status"] for k in "abc"} == {"N/A"}
    summary, best = _summary(None)
    t = evaluate_targets(summary, best, {"median_s": 50.0}, "static:32", stretch=False)
    assert t["a"]["status"] == "MISS" and "missed the target" in t["a"]["text"]
    assert t["b"]["status"] == "MISS" and t["c"]["status"] == "MISS"
    assert math.isfinite(t["c"]["value"])


def test_targets_are_not_judged_for_policies_without_runs():
    # A partial results.json (written after every run): static:32 and goodput have no run yet.
    runs = [run("static:512", 0, 10.0), run("noise-scale", 0, 8.0)]
    summary, best = summarize(runs, ["static:512", "static:32", "goodput", "noise-scale"])
    t = evaluate_targets(summary, best, {"median_s": 100.0}, "static:32", stretch=True)
    assert t["best_adaptive"] == "noise-scale" and t["a"]["status"] == "PASS"
    assert t["b"]["status"] == "N/A" and "no finished run yet" in t["b"]["text"]
    summary, best = summarize(runs[:1], ["static:512", "static:32", "goodput"])
    t = evaluate_targets(summary, best, {"median_s": 100.0}, "static:32", stretch=True)
    assert t["best_adaptive"] is None and {t[k]["status"] for k in "abc"} == {"N/A"}
    assert "no adaptive run has finished yet" in t["a"]["text"]


def test_targets_when_the_untrained_model_already_meets_the_target():
    summary, best = _summary(0.0, static_t=0.0, untuned_t=0.0)
    assert summary["noise-scale"]["ratio_vs_best_static"] is None
    t = evaluate_targets(summary, best, {"median_s": 1.0}, "static:32", stretch=True)
    assert {t[k]["status"] for k in "abc"} == {"N/A"} and "raise --target-accuracy" in t["a"]["text"]


def test_the_cost_ratio_divides_by_the_best_statics_own_cost():
    # static:512 is the best by wall time (10 s) but static:1024 is cheaper by the cost model (8 s):
    # the cost ratio still divides by static:512's cost (12 s), the policy the report names.
    runs = [run("static:512", 0, 10.0, cost=12.0), run("static:1024", 0, 11.0, cost=8.0),
            run("noise-scale", 0, 15.0, cost=18.0)]
    summary, best = summarize(runs)
    assert best == "static:512"
    assert summary["noise-scale"]["cost_ratio_vs_best_static"] == 1.5
    assert summary["static:1024"]["cost_ratio_vs_best_static"] == pytest.approx(8 / 12)


def test_finder_picks_among_the_grid_not_the_policies_sizes():
    # 100 was calibrated only because a policy asked for it: it must not change the finder's pick.
    cal = Calibration(sizes=[32, 64, 100, 128], step_s=[0.010, 0.012, 0.0130, 0.016],
                      probe_step_s=[0.020, 0.022, 0.023, 0.026])
    assert cal.finder_size() == 100  # 100 (7692/s) is within 5% of 128's 8000/s
    assert cal.finder_size(among=size_grid(32, 128)) == 128  # the grid without the policies' sizes
    capped = Calibration(sizes=[32, 64, 96], step_s=[0.010, 0.012, 0.0125], probe_step_s=[0.02, 0.022, 0.0225])
    assert capped.finder_size(among=size_grid(32, 96)) == 96  # a largest batch off the powers of two counts


def test_a_policys_size_cannot_move_the_finder_through_the_monotone_fix_up():
    # 96 (a policy's size) measured faster than 64: carried down, it made 64 look as fast as 128 (7805/s
    # against 7758/s) and the finder picked 64. Over the grid's own raw times 64 runs at 3200/s: 128.
    raw = [0.010, 0.020, 0.0082, 0.0165]
    cal = Calibration(sizes=[32, 64, 96, 128], step_s=_suffix_min(raw), probe_step_s=_suffix_min(raw), raw_step_s=raw)
    assert cal.finder_size(among=size_grid(32, 128)) == 128
    assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))) == cal  # kept in results.json
    older = Calibration(sizes=cal.sizes, step_s=cal.step_s, probe_step_s=cal.probe_step_s)  # written before
    assert older.finder_size(among=size_grid(32, 128)) == 64


def test_every_policy_leaves_the_statistics_period_to_the_engine():
    # The engine's default: it measures at its adaptive period where AdaScale or the controller needs statistics;
    # the cost model reads which steps measured from the records (stats/noise_count), not from a fixed period.
    specs, _ = expand(parse_policies("static:128@lr-rule=adascale,ramp@lr-rule=adascale,static:64,goodput,auto"), PLAN)
    assert {s.name: s.noise_every for s in specs} == {
        "static:128@lr-rule=adascale": None, "ramp:32-512@lr-rule=adascale": None, "static:64": None,
        "goodput": None, "auto": None}


def test_a_tuned_static_range_takes_an_lr_rule_suffix():
    names = [p.name for p in parse_policies("tuned-static:32-128@lr-rule=sqrt")]
    assert names == ["tuned-static:32@lr-rule=sqrt", "tuned-static:64@lr-rule=sqrt", "tuned-static:128@lr-rule=sqrt"]
