"""The `batchpilot bench` command end to end: resume, interruption, device, target window, bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _bench_helpers import assert_png

from batchpilot.bench.workloads import WORKLOADS
from batchpilot.cli import main

# ------------------------------------------------------------------------------------------ bench
RUN_KEYS = {"policy", "seed", "time_to_target_s", "steps_to_target", "samples_to_target", "final_accuracy",
            "wall_s", "batch_sizes"}


def test_bench_resume_trains_only_the_missing_runs(tmp_path, capsys, monkeypatch):
    bench = ["bench", "--workload", "synthetic", "--policies", "static:32,noise-scale", "--seeds", "0,1",
             "--budget-s", "20", "--no-progress", "--calibrate-steps", "1"]
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    assert main([*bench, "--out", str(full_dir)]) == 0
    full = json.loads((full_dir / "results.json").read_text())
    # An interrupted bench: results.json holds the first two of its four runs (written after every run).
    cut = dict(full, runs=full["runs"][:2])
    cut_dir.mkdir()
    (cut_dir / "results.json").write_text(json.dumps(cut))
    capsys.readouterr()
    import batchpilot.bench.runner as runner

    warmed = []  # the real warm-up, recorded: the first session's calibration was its warm-up
    monkeypatch.setattr(runner, "warm_up", lambda wl, train, sizes, _real=runner.warm_up: (
        warmed.extend(sizes), _real(wl, train, sizes)))
    assert main([*bench, "--out", str(cut_dir), "--resume"]) == 0
    assert warmed == full["calibration"]["sizes"]
    resumed = json.loads((cut_dir / "results.json").read_text())
    assert resumed["runs"][:2] == full["runs"][:2]  # kept as they were, not retrained
    assert [(r["policy"], r["seed"]) for r in resumed["runs"]] == [(r["policy"], r["seed"]) for r in full["runs"]]
    for a, b in zip(resumed["runs"][2:], full["runs"][2:]):  # the same training: same steps and samples
        assert (a["steps_to_target"], a["samples_to_target"]) == (b["steps_to_target"], b["samples_to_target"])
    assert resumed["calibration"] == full["calibration"]  # the cost model of the first session
    assert [r["after_runs"] for r in resumed["config"]["resumed"]] == [2]
    assert set(resumed["summary"]) == set(full["summary"]) and (cut_dir / "report.md").exists()
    # Nothing left to train: a second resume adds no run.
    assert main([*bench, "--out", str(cut_dir), "--resume"]) == 0
    again = json.loads((cut_dir / "results.json").read_text())
    assert again["runs"] == resumed["runs"] and [r["after_runs"] for r in again["config"]["resumed"]] == [2, 4]


def test_an_interrupted_bench_says_whether_its_results_json_holds_finished_runs(tmp_path, capsys, monkeypatch):
    import batchpilot.bench.runner as runner

    bench = ["bench", "--workload", "synthetic", "--policies", "static:32,static:64", "--seeds", "0",
             "--budget-s", "20", "--no-progress", "--calibrate-steps", "1", "--out", str(tmp_path)]

    def interrupt_at(n):
        calls = []

        def train(*args, _real=runner.train_one, **kwargs):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return _real(*args, **kwargs)
        monkeypatch.setattr(runner, "train_one", train)

    interrupt_at(2)  # after the first run, which wrote results.json
    with pytest.raises(SystemExit) as exc:
        main(bench)
    assert exc.value.code == 130 and "finished runs are in" in capsys.readouterr().err
    interrupt_at(1)  # a new bench into the same folder, stopped before its first run: the old file is no progress
    with pytest.raises(SystemExit) as exc:
        main([*bench[:-2], "--budget-s", "30", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 130 and "no run had finished;" in err and "is as it was before" in err, err


def test_bench_resume_refuses_other_settings_or_a_damaged_file(tmp_path, capsys):
    bench = ["bench", "--workload", "synthetic", "--policies", "static:32", "--budget-s", "20", "--no-progress",
             "--calibrate-steps", "1", "--out", str(tmp_path), "--resume"]
    assert main([*bench, "--seeds", "0"]) == 0  # no results.json yet: starts afresh
    with pytest.raises(SystemExit) as exc:
        main([*bench, "--seeds", "0,1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "other settings (seeds: [0] there, [0, 1] now)" in err and "another --out" in err
    good = json.loads((tmp_path / "results.json").read_text())
    # Damaged runs are refused with a message, not a traceback (a KeyError used to escape from the summary).
    for damage, says in [(lambda r: r.pop("policy"), "run 0 lacks policy"), (lambda r: r.pop("seed"), "run 0 lacks seed"),
                         (lambda r: r.pop("time_to_target_s"), "run 0 lacks time_to_target_s"),
                         (lambda r: r.update(seed="0"), "run 0 has policy 'static:32' and seed '0'")]:
        broken = json.loads(json.dumps(good))
        damage(broken["runs"][0])
        (tmp_path / "results.json").write_text(json.dumps(broken))
        with pytest.raises(SystemExit) as exc:
            main([*bench, "--seeds", "0"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "not a complete bench results.json" in err and says in err, err
    (tmp_path / "results.json").write_text('{"runs": [')
    with pytest.raises(SystemExit):
        main([*bench, "--seeds", "0"])
    assert "not a complete bench results.json" in capsys.readouterr().err


def test_bench_device_is_recorded_and_an_unusable_one_is_refused(tmp_path, capsys):
    from batchpilot.bench import run_benchmark

    assert main(["bench", "--workload", "synthetic", "--policies", "static:64", "--seeds", "0", "--budget-s", "20",
                 "--calibrate-steps", "1", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "cpu")]) == 0
    results = json.loads((tmp_path / "cpu" / "results.json").read_text())
    assert results["config"]["device"] == "cpu" and results["runs"][0]["time_to_target_s"] is not None
    assert "- device: cpu" in (tmp_path / "cpu" / "report.md").read_text()
    with pytest.raises(ValueError, match="not a torch device"):
        run_benchmark("synthetic", "static:64", [0], out_dir=tmp_path / "x", progress=False, device="gpu0")
    with pytest.raises(ValueError, match="runs on 'cpu' or 'cuda'"):
        run_benchmark("synthetic", "static:64", [0], out_dir=tmp_path / "x", progress=False, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--workload", "synthetic", "--device", "cuda", "--out", str(tmp_path / "x")])
        assert exc.value.code == 2
        assert "torch.cuda.is_available() is False" in capsys.readouterr().err
    # A results.json from before the device was recorded resumes as a CPU bench.
    old = json.loads((tmp_path / "cpu" / "results.json").read_text())
    del old["config"]["device"]
    (tmp_path / "cpu" / "results.json").write_text(json.dumps(old))
    resumed = run_benchmark("synthetic", "static:64", [0], budget_s=20, out_dir=tmp_path / "cpu", progress=False,
                            calibrate_steps=1, resume=True)
    assert resumed["runs"] == results["runs"]


def test_bench_target_window_is_recorded_resumed_and_validated(tmp_path, capsys):
    from batchpilot.bench import run_benchmark

    bench = ["bench", "--workload", "synthetic", "--policies", "static:64", "--seeds", "0", "--budget-s", "20",
             "--calibrate-steps", "1", "--no-progress", "--out", str(tmp_path)]
    assert main([*bench, "--target-window", "3"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["target_window"] == 3
    run = results["runs"][0]
    grid = run["curve"][: run["curve"].index(next(p for p in run["curve"] if p["step"] == run["steps_to_target"])) + 1]
    assert len(grid) >= 3 and sum(p["accuracy"] for p in grid[-3:]) / 3 >= results["target_accuracy"]
    assert "the mean of the last 3 evaluations reaches it" in (tmp_path / "report.md").read_text()
    with pytest.raises(SystemExit) as exc:  # another window is another measurement: no resume across it
        main([*bench, "--resume"])
    assert exc.value.code == 2 and "target_window: 3 there, 1 now" in capsys.readouterr().err
    # A results.json from before the window was recorded resumes as window 1.
    assert main(bench) == 0
    old = json.loads((tmp_path / "results.json").read_text())
    del old["config"]["target_window"]
    (tmp_path / "results.json").write_text(json.dumps(old))
    assert main([*bench, "--resume"]) == 0
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"target_window must be a positive int .*got {bad!r}"):
            run_benchmark("synthetic", "static:64", [0], out_dir=tmp_path / "x", progress=False, target_window=bad)


def test_bench_cli_synthetic_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "--workload", "synthetic", "--policies", "static:32,ramp:16-128", "--seeds", "0",
                 "--budget-s", "20", "--out", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "static:32" in printed and "ramp:16-128" in printed and "report.md" in printed

    results = json.loads((out / "results.json").read_text())
    assert results["workload"] == "synthetic"
    assert results["target_accuracy"] == WORKLOADS["synthetic"].target_accuracy == 0.97
    assert [r["policy"] for r in results["runs"]] == ["static:32", "ramp:16-128"]  # seed 0: no rotation
    n = results["config"]["train_samples"]
    assert n == 4096
    for run in results["runs"]:
        assert RUN_KEYS <= set(run)
        assert run["seed"] == 0
        # The target is reachable well within the budget; stopping happens at the first eval that hits it.
        assert run["time_to_target_s"] is not None
        assert 0 < run["time_to_target_s"] <= run["wall_s"]
        assert run["samples_to_target"] % 1024 == 0  # evaluations every quarter epoch = 1024 samples
        assert run["epochs_to_target"] == run["samples_to_target"] / n
        reached = [p for p in run["curve"] if p["accuracy"] >= 0.97]
        assert reached and reached[0]["samples_seen"] == run["samples_to_target"]
        assert run["curve"][0]["samples_seen"] == 0 and run["curve"][0]["time_s"] == 0.0
        assert run["final_accuracy"] == run["curve"][-1]["accuracy"] >= 0.97
        times = [p["time_s"] for p in run["curve"]]
        assert times == sorted(times)
    static, ramp = results["runs"]
    assert static["samples_to_target"] == 32 * static["steps_to_target"]
    assert static["batch_sizes"] == [{"step": 0, "samples_seen": 0, "time_s": 0.0, "batch_size": 32}]
    sizes = [p["batch_size"] for p in ramp["batch_sizes"]]
    assert sizes[0] == 16 and sizes == sorted(sizes) and len(sizes) >= 2 and max(sizes) <= 128
    # Doubling every quarter epoch (1024 samples): 16 for 64 steps, then 32 for 32 steps, ...
    assert ramp["batch_sizes"][1] == {**ramp["batch_sizes"][1], "step": 64, "samples_seen": 1024, "batch_size": 32}

    summary = results["summary"]
    assert set(summary) == {"static:32", "ramp:16-128"}
    assert summary["static:32"]["median_time_to_target_s"] == static["time_to_target_s"]
    assert summary["static:32"]["ratio_vs_best_static"] == 1.0
    assert results["best_static_policy"] == "static:32"
    assert math.isclose(summary["ramp:16-128"]["ratio_vs_best_static"],
                        ramp["time_to_target_s"] / static["time_to_target_s"])

    report = (out / "report.md").read_text()
    assert "| policy |" in report and "static:32 (best static)" in report and "ramp:16-128" in report
    assert "accuracy_vs_time.png" in report
    assert_png(out / "accuracy_vs_time.png")
    assert_png(out / "batch_size_vs_time.png")

@pytest.mark.parametrize("argv, fragment", [
    (["bench", "--policies", "static:32,bogus"], "unknown policy kind 'bogus'"),
    (["bench", "--workload", "imagenet"],
     "unknown workload 'imagenet'; choose one of: cifar10, cifar100, digits, gpt, markov, mnist1d, seqsum, synthetic, or all."),
    (["bench", "--workload", "synthetic", "--tune-factors", "1,x"], "--tune-factors '1,x' is not"),
    (["bench", "--workload", "synthetic", "--tune-factors", "0,1"], "must list positive numbers"),
    (["bench", "--workload", "synthetic", "--tune-factors", "1,0.5,1.0000001"], "lists 1 twice"),
    (["bench", "--workload", "synthetic", "--policies", "noise-scale:5"], "takes no argument"),
    (["bench", "--workload", "synthetic", "--seeds", "0,x"], "'x' is not a whole number"),
    (["bench", "--workload", "synthetic", "--seeds", "\u00b2"], "'\u00b2' is not a whole number"),
    (["bench", "--workload", "synthetic", "--seeds", str(2**64)], "is not a whole number in [0, 2**63)"),
    (["bench", "--workload", "synthetic", "--target-accuracy", "1.5"], "--target-accuracy must be in (0, 1]"),
    (["bench", "--workload", "synthetic", "--budget-s", "0"], "--budget-s must be a positive"),
    (["bench", "--workload", "synthetic", "--target-window", "0"], "--target-window must be >= 1 evaluations, got 0"),
])
def test_cli_bad_input_exits_2_with_a_message(argv, fragment, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(argv + ["--out", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "results.json").exists()


def test_cli_version(capsys):
    import batchpilot

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"batchpilot {batchpilot.__version__}"


def test_cli_out_that_is_a_file_exits_2(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(SystemExit) as info:
        main(["bench", "--workload", "synthetic", "--out", str(not_a_folder)])
    assert info.value.code == 2 and "cannot be used as the output folder" in capsys.readouterr().err


def test_python_dash_m_batchpilot(tmp_path):
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "batchpilot", "bench", "--policies", "nope:1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "unknown policy kind 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_refuses_sizes_beyond_the_training_set(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--workload", "synthetic", "--policies", "static:99999", "--quick", "--seeds", "1",
              "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "static:99999 (99999)" in err and "Use sizes up to 4096" in err
