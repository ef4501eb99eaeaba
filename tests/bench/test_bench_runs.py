"""Tiny-budget benchmark runs of the new workloads and policies: schema, order, report. No speed is asserted."""

from __future__ import annotations

import functools
import json
import statistics
from dataclasses import replace

import numpy as np
import pytest
import torch

from batchpilot.bench import run_benchmark, write_report
from batchpilot.bench import workloads as workloads_module
from batchpilot.bench.tasks import _shift, digits_data, seqsum_data
from batchpilot.bench.workloads import WORKLOADS
from batchpilot.cli import main

RUN_KEYS = {"policy", "seed", "time_to_target_s", "steps_to_target", "samples_to_target", "final_accuracy",
            "wall_s", "batch_sizes", "cost_model_time_to_target_s", "epochs_to_target", "serves", "grid", "lr",
            "lr_rule", "diverged", "curve", "cost_model_s"}
TOP_KEYS = {"workload", "target_accuracy", "runs", "summary", "best_static_policy", "best_static",
            "grid_search_total_s", "grid_search", "untuned_default", "targets", "calibration", "finder", "members",
            "policies", "config"}
SUMMARY_KEYS = {"median_time_to_target_s", "ratio_vs_best_static", "median_cost_model_time_to_target_s",
                "median_epochs_to_target", "median_samples_to_target", "median_final_accuracy",
                "cost_ratio_vs_best_static", "runs", "runs_reached"}


def tiny(name: str, max_batch_size: int = 256, **data_kwargs):
    """A registered workload with a small dataset and small batch bounds (a fast calibration)."""
    w = WORKLOADS[name]
    return replace(w, build_data=functools.partial(w.build_data, **data_kwargs), max_batch_size=max_batch_size)


@pytest.fixture(scope="module")
def digits_results(tmp_path_factory):
    pytest.importorskip("sklearn")
    out = tmp_path_factory.mktemp("digits")
    policies = ("static:32,tuned-static:64,finder,smith:64-256@0.5,noise-scale,goodput,variance-rule,"
                "threshold-rules,goodput@lr-rule=adascale")
    results = run_benchmark(tiny("digits", copies=1, shift=0), policies, [0, 1], target_accuracy=0.6, budget_s=0.7,
                            out_dir=out, eval_every=0.5, progress=False, calibrate_steps=1)
    return results, out


def test_digits_run_schema(digits_results):
    results, out = digits_results
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
    assert TOP_KEYS <= set(results)
    n = results["config"]["train_samples"]
    assert n == 1198 and results["config"]["test_samples"] == 599
    cal = results["calibration"]
    assert cal["sizes"] == [32, 64, 128, 256] and len(cal["step_s"]) == len(cal["probe_step_s"]) == 4
    assert all(t > 0 for t in cal["step_s"] + cal["probe_step_s"])
    assert cal["step_s"] == sorted(cal["step_s"])  # suffix minimum: never faster at a larger size
    assert results["finder"]["batch_size"] in cal["sizes"]
    for run in results["runs"]:
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert run["curve"][0]["samples_seen"] == 0 and run["curve"][0]["cost_s"] == 0.0
        assert run["batch_sizes"][0]["step"] == 0
        assert run["cost_model_s"] > 0 and run["wall_s"] > 0
        costs = [p["cost_s"] for p in run["curve"]]
        assert costs == sorted(costs)
        if run["time_to_target_s"] is not None:
            point = next(p for p in run["curve"] if p["accuracy"] >= 0.6)
            assert run["cost_model_time_to_target_s"] == point["cost_s"] > 0
            assert run["epochs_to_target"] == run["samples_to_target"] / n == point["epochs"]
    names = [p for p in results["config"]["policies"]]
    assert names == ["static:32", "tuned-static:64", "finder", "smith:64-256@0.5", "noise-scale", "goodput",
                     "variance-rule", "threshold-rules", "goodput@lr-rule=adascale"]
    assert set(results["summary"]) == set(names)
    for s in results["summary"].values():
        assert SUMMARY_KEYS <= set(s)
    tuned = results["summary"]["tuned-static:64"]
    assert set(tuned["grid"]) == {"static:64@lr=0.01", "static:64", "static:64@lr=0.04"}
    assert tuned["chosen"] in tuned["grid"]


def test_digits_run_order_grid_and_targets(digits_results):
    results, _ = digits_results
    runs = results["runs"]
    per_seed = len(runs) // 2
    first = [r["policy"] for r in runs[:per_seed]]
    second = [r["policy"] for r in runs[per_seed:]]
    assert [r["seed"] for r in runs] == [0] * per_seed + [1] * per_seed
    assert second == first[1:] + first[:1]  # seed-major, rotated by one
    assert "static:32" in first and first.count("static:32") == 1  # shared by static:32 and no one else
    grid_runs = [r for r in runs if r["grid"]]
    assert {r["policy"] for r in grid_runs} == {"static:64@lr=0.01", "static:64", "static:64@lr=0.04"}
    sums = [sum(r["wall_s"] for r in grid_runs if r["seed"] == s) for s in (0, 1)]
    assert results["grid_search_total_s"] == pytest.approx(statistics.median(sums))
    assert results["untuned_default"]["policy"] == "static:32"
    targets = results["targets"]
    assert targets["best_adaptive"] in ("noise-scale", "goodput", "variance-rule", "threshold-rules",
                                        "goodput@lr-rule=adascale")
    for key in "abc":
        assert targets[key]["status"] in ("PASS", "MISS", "N/A") and targets[key]["text"]
    best = results["best_static_policy"]
    if best is not None:
        assert best in ("static:32", "tuned-static:64") and results["best_static"]["policy"] == best
    noise = [p for r in runs if r["policy"] == "noise-scale" for p in r["curve"]]
    assert all("noise_scale" in p for p in noise)
    adascale = next(r for r in runs if r["policy"] == "goodput@lr-rule=adascale")
    assert adascale["lr_rule"] == "adascale"


def test_digits_report(digits_results, tmp_path):
    results, out = digits_results
    paths = write_report(results, out)
    report = paths["report"].read_text()
    for fragment in ("## Targets", "(a) vs LR-tuned best static", "(b) vs untuned static:32",
                     "(c) one run vs the grid search", "(d) collapsed adaptive runs", "median cost-model time",
                     "time vs best static", "| rollbacks |", "| collapsed |",
                     "## LR grid of the tuned statics", "tuned-static:64", "## Throughput calibration",
                     "![accuracy vs time](accuracy_vs_time.png)", "![batch size vs time](batch_size_vs_time.png)",
                     "![throughput](throughput.png)", "goodput@lr-rule=adascale"):
        assert fragment in report, fragment
    assert any(s in report for s in ("**PASS**", "**MISS**", "**N/A**"))
    for key in ("accuracy_vs_time", "batch_size_vs_time", "throughput"):
        assert paths[key].stat().st_size > 1000


def test_report_plots_the_noise_scale(tmp_path):
    curve = [{"time_s": t, "cost_s": t, "step": 10 * t, "samples_seen": 100 * t, "epochs": t / 4, "accuracy": 0.5 + t / 20,
              "batch_size": 32 * 2 ** (t // 3), "noise_scale": None if t == 0 else 40.0 * t} for t in range(8)]
    results = {"workload": "digits", "target_accuracy": 0.8, "runs": [
        {"policy": "noise-scale", "seed": 0, "time_to_target_s": 6, "steps_to_target": 60, "samples_to_target": 600,
         "final_accuracy": 0.85, "wall_s": 7, "batch_sizes": [{"step": 0, "samples_seen": 0, "time_s": 0.0,
                                                               "batch_size": 32}], "curve": curve}]}
    paths = write_report(results, tmp_path)
    assert paths["noise_scale"].stat().st_size > 1000
    assert "![noise scale over training](noise_scale.png)" in paths["report"].read_text()


def test_seqsum_tiny_run(tmp_path):
    results = run_benchmark(tiny("seqsum", 64, n_train=1024, n_test=256), "static:32,noise-scale", [0],
                            target_accuracy=0.55, budget_s=0.7, out_dir=tmp_path, eval_every=0.5, progress=False,
                            calibrate_steps=1)
    assert results["config"]["lr_rule"] == "sqrt" and results["config"]["train_samples"] == 1024
    assert [r["policy"] for r in results["runs"]] == ["static:32", "noise-scale"]
    from batchpilot.controllers import NoiseScale

    # NoiseScale's recommended rule (AdaScale since issue 21) where it has one, else the workload's.
    assert results["runs"][1]["lr_rule"] == (getattr(NoiseScale, "recommended_lr_rule", None) or "sqrt")
    assert results["targets"]["c"]["status"] == "N/A"  # no LR grid in this run


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    printed = capsys.readouterr().out
    for fragment in ("mnist1d", "digits", "seqsum", "synthetic", "[not in 'all']", "tuned-static:N",
                     "ramp-smith", "noise-scale", "goodput", "variance-rule", "threshold-rules", "default"):
        assert fragment in printed, fragment


def test_bench_all_workloads(tmp_path, monkeypatch, capsys):
    small = {"seqsum": tiny("seqsum", 64, n_train=512, n_test=256),
             "synthetic": replace(WORKLOADS["synthetic"], in_all=True, max_batch_size=128)}
    monkeypatch.setattr(workloads_module, "WORKLOADS", small)
    out = tmp_path / "all"
    code = main(["bench", "--workload", "all", "--policies", "static:32,goodput", "--seeds", "0", "--budget-s", "0.5",
                 "--target-accuracy", "0.5", "--calibrate-steps", "1", "--out", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "target (a):" in printed and "all workloads:" in printed
    for name in small:
        results = json.loads((out / name / "results.json").read_text())
        assert results["workload"] == name and (out / name / "report.md").exists()
    index = (out / "report.md").read_text()
    assert "## seqsum" in index and "## synthetic" in index and "(seqsum/report.md)" in index


# ------------------------------------------------------------------------------------------ workloads
def test_digits_data():
    pytest.importorskip("sklearn")
    train, test = digits_data(42)
    assert len(train) == 1198 * 9 * 3 and len(test) == 599
    x, y = train.tensors
    assert x.shape == (32346, 64) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert set(y.tolist()) == set(range(10))
    # The test images are untouched: pixel values are multiples of 1/16.
    xt = test.tensors[0].numpy()
    assert np.allclose(xt * 16, np.round(xt * 16))
    again, _ = digits_data(42)
    assert torch.equal(again.tensors[0], x)
    other_train, other_test = digits_data(7)
    assert not torch.equal(other_test.tensors[0], test.tensors[0])


def test_shift_fills_the_vacated_edge_with_zero():
    a = np.arange(9, dtype=np.float32).reshape(1, 3, 3)
    assert _shift(a, 1, 0)[0].tolist() == [[0, 0, 1], [0, 3, 4], [0, 6, 7]]
    assert _shift(a, 0, -1)[0].tolist() == [[3, 4, 5], [6, 7, 8], [0, 0, 0]]
    assert _shift(a, 0, 0)[0].tolist() == a[0].tolist()


def test_seqsum_data_labels():
    train, test = seqsum_data(3, n_train=4000, n_test=500)
    x, y = train.tensors
    assert x.shape == (4000, 16) and len(test) == 500
    diff = x[:, :8].sum(1) - x[:, 8:].sum(1)
    assert bool((diff != 0).all()) and torch.equal(y, (diff > 0).long())
    assert abs(float(y.float().mean()) - 0.5) < 0.03
    assert torch.equal(seqsum_data(3, n_train=4000, n_test=500)[0].tensors[0], x)


@pytest.mark.parametrize("name, x, params", [
    ("digits", torch.zeros(3, 64), 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10),
    ("seqsum", torch.zeros(3, 16, dtype=torch.long), None),
])
def test_new_workload_models(name, x, params):
    w = WORKLOADS[name]
    model = w.build_model(0)
    assert model(x).shape == (3, 10 if name == "digits" else 2)
    if params is not None:
        assert sum(p.numel() for p in model.parameters()) == params
    same, other = w.build_model(0), w.build_model(1)
    for a, b in zip(model.parameters(), same.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, c) for a, c in zip(model.parameters(), other.parameters()))


def test_an_evaluation_made_only_because_a_run_stopped_never_reaches_the_target():
    # The last evaluation of a run that stopped between evaluation points (at the budget) is off the grid:
    # it gives the final accuracy, but a target "reached" there would not be quantised like the others.
    from torch.utils.data import TensorDataset

    from batchpilot.bench.train import _Run

    x = torch.randn(20, 3)
    test = TensorDataset(x, torch.zeros(20, dtype=torch.long))
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([1.0, 0.0]))  # always class 0: accuracy 1.0
    run = _Run(model, test, 100, target=0.5, budget_s=1.0, eval_every=0.25, on_eval=lambda p, r: None,
               calibration=None, noise_every=None)
    run.evaluate(1.2, 7, 70, 10, final=True)
    assert run.reached is None and run.curve[-1]["accuracy"] == 1.0
    run.evaluate(0.5, 5, 50, 10)
    assert run.reached is not None and run.reached["step"] == 5


def _always_right_run(target=0.5, target_window=1):
    from torch.utils.data import TensorDataset

    from batchpilot.bench.train import _Run

    test = TensorDataset(torch.randn(20, 3), torch.zeros(20, dtype=torch.long))
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([1.0, 0.0]))  # always class 0: accuracy 1.0
    return _Run(model, test, 100, target=target, budget_s=1.0, eval_every=0.25, on_eval=lambda p, r: None,
                calibration=None, noise_every=None, target_window=target_window)


class _Pilot:
    batch_size = 10


def test_a_run_whose_untrained_model_meets_the_target_stops_before_training():
    run = _always_right_run()
    run.begin(10)
    assert run.done and run.stop_reason == "target" and run.stopped_at == 0.0 and run.reached["time_s"] == 0.0


def test_a_divergence_between_evaluation_points_does_not_reach_the_target():
    # A non-finite loss stops the run and is evaluated at once, off the quarter-epoch grid (at 10 of 25
    # samples): that evaluation records the accuracy but, like any off-grid one, cannot reach the target.
    run = _always_right_run(target=1.01)
    run.begin(10)
    run.target = 0.5
    run(_Pilot(), {"step": 1, "samples_seen": 10, "batch/global_size": 10, "loss": float("nan")})
    assert run.diverged and run.done and run.stop_reason == "diverged"
    assert run.reached is None and run.curve[-1]["samples_seen"] == 10


def test_results_json_is_standard_json(tmp_path):
    from batchpilot.bench.runner import write_json

    write_json(tmp_path / "r.json", {"targets": {"b": {"value": float("inf")}}, "x": [1.0, float("nan")]})
    text = (tmp_path / "r.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text) == {"targets": {"b": {"value": None}}, "x": [1.0, None]}


def test_target_window_counts_the_mean_of_the_last_evaluations_on_the_grid():
    # A fluctuating curve: one lucky evaluation reaches the target with a window of 1, but with a window
    # of 3 only the first grid point whose last three accuracies average at or above it does. Off-grid
    # evaluations (a run stopped between grid points) neither reach it nor enter the window.
    runs = {1: _always_right_run(target=0.9), 3: _always_right_run(target=0.9, target_window=3)}
    model = runs[3].model = runs[1].model
    accuracies = [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]  # evaluations 0..5
    for i, acc in enumerate(accuracies):
        with torch.no_grad():  # class 0 everywhere (accuracy 1) or class 1 (accuracy 0)
            model.bias.copy_(torch.tensor([1.0, 0.0] if acc else [0.0, 1.0]))
        for r in runs.values():
            r.evaluate(float(i), i, 10 * i, 10)
        if i == 4:
            for r in runs.values():
                r.evaluate(4.5, 45, 45, 10, final=True)  # off the grid: ignored by the window
    assert runs[1].reached["step"] == 1
    assert runs[3].reached["step"] == 5  # windows: [0,1,0], [1,0,1], [0,1,1], then [1,1,1]
    assert runs[3]._window == [1.0, 1.0, 1.0]
