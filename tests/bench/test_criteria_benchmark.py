"""benchmarks/criteria.py: its reading of time to target, checked against the bench's own, on a tiny budget
(no speed asserted)."""

import json
import sys

import pytest
from _benchmarks import load_benchmark


@pytest.fixture(scope="module")
def crit():
    return load_benchmark("criteria")


def _point(samples, accuracy, step=None):
    return {"samples_seen": samples, "accuracy": accuracy, "step": samples if step is None else step,
            "epochs": samples / 100, "time_s": samples / 10, "cost_s": samples / 20}


def test_grid_points_and_the_window(crit):
    # Grid of 10 samples: a step from 20 to 35 crossed slot 3 (one point), 45 is an off-grid final evaluation.
    curve = [_point(0, 0.1), _point(10, 0.95), _point(20, 0.5), _point(35, 0.9), _point(40, 0.95), _point(45, 1.0)]
    assert [p["samples_seen"] for p in crit.on_grid(curve, 10)] == [0, 10, 20, 35, 40]
    assert [p["samples_seen"] for p in crit.on_grid(curve, 20)] == [0, 20, 40]
    assert crit.reach(curve, 0.9, 10, 1)["samples_seen"] == 10  # the lucky evaluation
    assert crit.reach(curve, 0.9, 10, 2)["samples_seen"] == 40  # (0.9 + 0.95) / 2; 45 is off the grid
    assert crit.reach(curve, 0.9, 20, 1)["samples_seen"] == 40
    assert crit.reach(curve, 0.99, 10, 1) is None


def test_a_run_is_read_as_stopped_where_the_criterion_is_met(crit):
    run = {"policy": "static:32", "seed": 0, "wall_s": 9.0, "cost_model_s": 4.0, "final_accuracy": 1.0,
           "stop_reason": "budget", "curve": [_point(0, 0.1), _point(10, 0.5), _point(20, 0.95), _point(30, 0.99)]}
    read = crit.read_run(run, 0.9, 10, 2)
    assert (read["steps_to_target"], read["time_to_target_s"], read["cost_model_time_to_target_s"]) == (30, 3.0, 1.5)
    assert (read["wall_s"], read["cost_model_s"], read["final_accuracy"], read["stop_reason"]) == (3.0, 1.5, 0.99, "target")
    missed = crit.read_run(run, 0.999, 10, 1)
    assert missed["time_to_target_s"] is None and missed["wall_s"] == 9.0 and missed["curve"] == []


def test_its_window_reading_is_the_bench_target_window(crit, tmp_path, monkeypatch):
    # Training is deterministic (static and noise-scale read no timings): the runs this benchmark trains past
    # the target, read with a window of 2 on the grid, reach it at the step `batchpilot bench --target-window 2`
    # stops at.
    from batchpilot.bench import run_benchmark

    out = tmp_path / "crit"
    policies = "static:32,static:128,noise-scale"
    monkeypatch.setattr(sys, "argv", [
        "criteria.py", "--workload", "synthetic", "--policies", policies, "--seeds", "0", "--epochs", "3",
        "--eval-every", "0.25", "--strides", "1,2", "--windows", "1,2", "--threads", "1", "--out", str(out)])
    crit.main()
    result = json.loads((out / "criteria.json").read_text())
    assert [(c["eval_every_epochs"], c["window"]) for c in result["criteria"]] == [(0.25, 1), (0.25, 2), (0.5, 1), (0.5, 2)]
    assert {r["curve"][-1]["epochs"] >= 3 for r in result["runs"]} == {True}  # trained past the target
    for window in (1, 2):
        bench = run_benchmark("synthetic", policies, [0], out_dir=tmp_path / f"bench{window}", progress=False,
                              eval_every=0.25, calibrate_steps=1, target_window=window)
        reading = result["criteria"][window - 1]["summary"]
        for name in policies.split(","):
            assert reading[name]["median_steps_to_target"] == bench["summary"][name]["median_steps_to_target"]
    # Read again under other windows, without training.
    monkeypatch.setattr(sys, "argv", ["criteria.py", "--reread", str(out / "criteria.json"), "--strides", "1",
                                      "--windows", "3", "--out", str(tmp_path / "again")])
    crit.main()
    again = json.loads((tmp_path / "again" / "criteria.json").read_text())
    assert [(c["eval_every_epochs"], c["window"]) for c in again["criteria"]] == [(0.25, 3)]
    assert again["runs"] == result["runs"]
    pytest.importorskip("matplotlib")
    assert (out / "criteria.png").stat().st_size > 0


def test_bad_arguments_and_files_are_refused(crit, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["criteria.py", "--workload", "synthetic", "--epochs", "1", "--windows", "0"])
    with pytest.raises(SystemExit, match="both list ints >= 1"):
        crit.main()
    monkeypatch.setattr(sys, "argv", ["criteria.py", "--workload", "synthetic"])
    with pytest.raises(SystemExit, match="--epochs is required"):
        crit.main()
    bad = tmp_path / "bad.json"
    for text in ("{}", '{"settings": {"eval_every": 0.25}, "runs": []}', "not json"):
        bad.write_text(text)
        monkeypatch.setattr(sys, "argv", ["criteria.py", "--reread", str(bad)])
        with pytest.raises(SystemExit, match="not a criteria.json"):
            crit.main()
