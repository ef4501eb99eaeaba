"""The benchmark: workloads, policy parsing, the runner's results.json, reports, plots and the CLI."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from batchpilot.bench import get_workload, parse_policies, parse_policy, summarize
from batchpilot.bench.report import plot_log
from batchpilot.bench.workloads import WORKLOADS, mnist1d_cnn
from batchpilot.cli import main
from batchpilot.controllers.base import Observation

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path, min_width: int = 300) -> None:
    """A real PNG: the signature, then an IHDR chunk with a plausible size."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= min_width and height >= 200, (width, height)


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


def test_report_rerenders_results_json(tmp_path):
    results = {
        "workload": "synthetic", "target_accuracy": 0.9,
        "runs": [
            {"policy": "static:32", "seed": 0, "time_to_target_s": 1.0, "steps_to_target": 10,
             "samples_to_target": 320, "final_accuracy": 0.95, "wall_s": 1.5,
             "batch_sizes": [32] * 5, "curve": [{"time_s": 0.0, "accuracy": 0.1}, {"time_s": 1.0, "accuracy": 0.95}]},
        ],
        "summary": {"static:32": {"median_time_to_target_s": 1.0, "ratio_vs_best_static": 1.0}},
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert main(["report", str(path), "--out", str(tmp_path / "r")]) == 0
    assert "static:32 (best static)" in (tmp_path / "r" / "report.md").read_text()
    assert_png(tmp_path / "r" / "batch_size_vs_time.png")  # a plain list of sizes is plotted too


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
            _run("noise-scale", 4.0)]
    members = {"tuned-static:32": ["static:32@lr=0.005", "static:32", "static:32@lr=0.02"],
               "noise-scale": ["noise-scale"]}
    results = finish_results({"runs": runs, "members": members,
                              "config": {"policies": ["tuned-static:32", "noise-scale"]}})
    b = results["targets"]["b"]
    assert b["status"] == "PASS" and b["value"] == 2.5, b  # static:32 (10 s) / noise-scale (4 s)
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


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "--policies", "static:32,bogus"], "unknown policy kind 'bogus'"),
    (["bench", "--workload", "imagenet"],
     "unknown workload 'imagenet'; choose one of: cifar10, cifar100, digits, mnist1d, seqsum, synthetic, or all."),
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


def test_get_workload_lists_the_names():
    assert get_workload("synthetic") is WORKLOADS["synthetic"]
    with pytest.raises(ValueError, match="choose one of: cifar10, cifar100, digits, mnist1d, seqsum, synthetic"):
        get_workload("mnist")


def test_python_dash_m_batchpilot(tmp_path):
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "batchpilot", "bench", "--policies", "nope:1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "unknown policy kind 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ log plots
def _write_log(path: Path, steps: int = 60) -> None:
    lines = []
    size, seen = 32, 0
    for step in range(1, steps + 1):
        seen += size
        lines.append({"type": "step", "step": step, "samples_seen": seen, "batch/global_size": size,
                      "loss": 2.0 / step if step != 7 else "nan", "lr": 0.01 * size / 32,
                      "perf/step_time_s": 0.002})
        if step % 20 == 0:
            lines.append({"type": "decision", "step": step, "old_size": size, "new_size": size * 2,
                          "controller": "MultiplicativeStep", "note": None, "inputs": {}})
            size *= 2
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")


@pytest.mark.parametrize("x", ["samples", "time"])
def test_report_plots_a_log(tmp_path, capsys, x):
    log = tmp_path / "run.jsonl"
    _write_log(log)
    out = tmp_path / "plots"
    assert main(["report", str(log), "--out", str(out), "--x", x]) == 0
    printed = capsys.readouterr().out.split()
    for name in ("batch_size.png", "loss.png", "lr.png"):
        assert_png(out / name)
        assert str(out / name) in printed
    assert sorted(p.name for p in out.iterdir()) == ["batch_size.png", "loss.png", "lr.png"]


def test_plot_log_of_a_real_pilot_run(tmp_path):
    from batchpilot import Pilot
    from batchpilot.controllers.schedules import MultiplicativeStep

    w = WORKLOADS["synthetic"]
    train, _ = w.build_data(0)
    model = w.build_model(0)
    log = tmp_path / "pilot.jsonl"
    pilot = Pilot(model, torch.optim.SGD(model.parameters(), lr=0.01), train, batch_size=16,
                  controller=MultiplicativeStep(16, 2, every_steps=5, max_size=64), log_path=log, progress=False)
    for x, y in pilot.batches(max_steps=20):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    pilot.close()
    paths = plot_log(log, tmp_path / "plots", x="time")
    assert [p.name for p in paths] == ["batch_size.png", "loss.png", "lr.png"]
    for p in paths:
        assert_png(p)


@pytest.mark.parametrize("content, fragment", [
    (None, "does not exist"),
    ("", "is empty"),
    ("hello world\n", "line 1 is not JSON"),
    ('{"type": "decision", "step": 1}\n', "none of type 'step'"),
    ('[1, 2]\n', "not objects"),
])
def test_report_bad_log_exits_2(tmp_path, capsys, content, fragment):
    log = tmp_path / "log.jsonl"
    if content is not None:
        log.write_text(content)
    with pytest.raises(SystemExit) as info:
        main(["report", str(log), "--out", str(tmp_path / "o")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


@pytest.mark.parametrize("results, fragment", [
    ({"runs": 5}, "'runs' must be a list of objects"),
    ({"runs": [{}]}, "run 0 lacks policy"),
    ({"runs": [{"policy": "static:32", "seed": 0}]}, "run 0 lacks time_to_target_s"),
])
def test_report_on_a_malformed_results_json_exits_2(tmp_path, capsys, results, fragment):
    path = tmp_path / "results.JSON"  # the suffix in any case
    path.write_text(json.dumps(results))
    with pytest.raises(SystemExit) as info:
        main(["report", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and fragment in err and "Traceback" not in err


@pytest.mark.parametrize("case, fragment", [
    ("log_missing_key", "not a well-formed adjustment log (KeyError"),
    ("log_list_step", "not a well-formed adjustment log (TypeError"),
    ("log_deep", "not a well-formed adjustment log (RecursionError"),
    ("json_zero_step_time", "not a well-formed bench results.json (ZeroDivisionError"),
    ("json_deep", "is not JSON (RecursionError"),
])
def test_report_on_hand_damaged_input_exits_2_without_a_traceback(tmp_path, capsys, case, fragment):
    if case.startswith("log"):
        path = tmp_path / "log.jsonl"
        _write_log(path, steps=5)
        extra = {"log_missing_key": '{"type": "step", "step": 6, "batch/global_size": 32, "loss": 1.0, "lr": 0.01}',
                 "log_list_step": '{"type": "decision", "step": [1], "old_size": 32, "new_size": 64}',
                 "log_deep": "[" * 200_000}[case]
        path.write_text(path.read_text() + extra + "\n" + '{"type": "step", "step": 7, "samples_seen": 999}\n')
    else:
        path = tmp_path / "results.json"
        run = {"policy": "static:32", "seed": 0, "time_to_target_s": 1.0, "steps_to_target": 10,
               "samples_to_target": 320, "final_accuracy": 0.95, "wall_s": 1.5, "batch_sizes": [32],
               "curve": [{"time_s": 0.0, "accuracy": 0.1}]}
        path.write_text("[" * 200_000 if case == "json_deep" else json.dumps(
            {"runs": [run], "calibration": {"sizes": [32], "step_s": [0.0], "probe_step_s": [0.0]}}))
    with pytest.raises(SystemExit) as info:
        main(["report", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and fragment in err and "Traceback" not in err, err


def test_losses_at_or_below_zero_keep_a_linear_axis_and_nan_steps_do_not_pull_the_mean_down(tmp_path, monkeypatch):
    import batchpilot.bench.plots as plots

    pytest.importorskip("matplotlib")
    log = tmp_path / "log.jsonl"
    losses = [6.0 - 0.09 * i for i in range(100)]  # 6 down to -2.9: a log axis would hide 34 of them
    losses[60] = math.nan
    log.write_text("".join(json.dumps({"type": "step", "step": i + 1, "samples_seen": 32 * (i + 1),
                                       "batch/global_size": 32, "loss": "nan" if math.isnan(v) else v, "lr": 0.01})
                           + "\n" for i, v in enumerate(losses)))
    seen = {}
    real = plots.finish

    def finish(fig, ax, target, *args, **kwargs):
        seen[target.name] = (ax.get_yscale(), [line.get_ydata() for line in ax.get_lines()])
        return real(fig, ax, target, *args, **kwargs)

    monkeypatch.setattr(plots, "finish", finish)
    plots.plot_log(log, tmp_path / "plots")
    scale, (raw, mean) = seen["loss.png"]
    assert scale == "linear"
    # The mean of the 5 steps around the NaN is the mean of the 4 finite ones (a NaN counted as 0 pulled it down).
    assert mean[62] == pytest.approx(sum(losses[i] for i in (58, 59, 61, 62)) / 4)


def test_a_log_cut_off_by_a_crash_is_plotted_and_a_foreign_file_named(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    _write_log(log, steps=6)
    log.write_text(log.read_text() + '{"type": "step", "step": 7, "samp')  # the record being written
    with pytest.warns(UserWarning, match="skipped its last line"):
        paths = plot_log(log, tmp_path / "plots")
    assert len(paths) == 3
    log.write_text('{"type": "step"\n' + log.read_text())  # a broken line that is not the last one
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        plot_log(log, tmp_path / "plots")
    log.write_bytes(b"\xff\xfe binary")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        plot_log(log, tmp_path / "plots")


def test_the_batch_size_plot_holds_each_size_over_the_samples_of_its_step(tmp_path, monkeypatch):
    # x is samples_seen after a step: its size must span (previous x, x], starting from 0.
    import matplotlib.axes

    drawn = []
    original = matplotlib.axes.Axes.step
    monkeypatch.setattr(matplotlib.axes.Axes, "step",
                        lambda self, x, y, *a, **k: drawn.append((list(x), list(y), k.get("where"))) or original(
                            self, x, y, *a, **k))
    log = tmp_path / "run.jsonl"
    rows = [(100, 100), (200, 100), (300, 100), (700, 400), (1100, 400)]
    log.write_text("\n".join(json.dumps({"type": "step", "step": i + 1, "samples_seen": seen, "batch/global_size": b,
                                          "loss": 1.0, "lr": 0.1}) for i, (seen, b) in enumerate(rows)) + "\n")
    plot_log(log, tmp_path / "plots")
    assert drawn == [([0, 100, 200, 300, 700, 1100], [100, 100, 100, 100, 400, 400], "pre")]


def test_bench_refuses_sizes_beyond_the_training_set(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--workload", "synthetic", "--policies", "static:99999", "--quick", "--seeds", "1",
              "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "static:99999 (99999)" in err and "Use sizes up to 4096" in err


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    log = tmp_path / "run.jsonl"
    _write_log(log, steps=3)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[plot\]"'):
        plot_log(log, tmp_path)


def test_without_matplotlib_the_bench_report_is_its_tables(monkeypatch, tmp_path):
    from batchpilot.bench import run_benchmark
    from batchpilot.bench.report import write_report

    results = run_benchmark("synthetic", "static:64", [0], budget_s=5, out_dir=tmp_path / "bench", progress=False,
                            calibrate_steps=1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    written = write_report(results, tmp_path / "report")
    assert list(written) == ["report"] and not list((tmp_path / "report").glob("*.png"))
    text = written["report"].read_text()
    assert "## Median time to target" in text and 'No plots: ' in text and 'pip install -e ".[plot]"' in text


# -------------------------------------------------------------------------------------- workloads
def test_mnist1d_cnn_shapes_and_seeding():
    model = mnist1d_cnn(0)
    assert model(torch.zeros(3, 1, 40)).shape == (3, 10)
    # conv 1*25*5+25, conv 25*25*3+25 (twice), linear 125*10+10: the paper's model.
    assert sum(p.numel() for p in model.parameters()) == 150 + 1900 + 1900 + 1260
    same, other = mnist1d_cnn(0), mnist1d_cnn(1)
    for a, b, c in zip(model.parameters(), same.parameters(), other.parameters()):
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_workload_model_building_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    WORKLOADS["mnist1d"].build_model(5)
    assert torch.equal(torch.rand(3), expected)


def test_mnist1d_generation_and_cache(tmp_path, monkeypatch):
    pytest.importorskip("mnist1d")
    from batchpilot.bench.workloads import _mnist1d_data, load_mnist1d

    monkeypatch.setenv("BATCHPILOT_CACHE", str(tmp_path))
    np.random.seed(7)
    expected_draw = np.random.rand()
    np.random.seed(7)
    data = load_mnist1d(num_samples=1000, seed=3)
    assert np.random.rand() == expected_draw  # make_dataset reseeds numpy; we restore the state
    assert data["x"].shape == (800, 40) and data["x_test"].shape == (200, 40)
    assert data["x"].dtype == np.float32 and data["y"].dtype == np.int64
    assert set(np.unique(data["y"])) == set(range(10))
    cached = list(tmp_path.glob("mnist1d-1000-*.npz"))
    assert len(cached) == 1
    again = load_mnist1d(num_samples=1000, seed=3)  # from the cache now
    for key in data:
        np.testing.assert_array_equal(data[key], again[key])
    other = load_mnist1d(num_samples=1000, seed=4)  # another key, another file
    assert len(list(tmp_path.glob("mnist1d-1000-*.npz"))) == 2
    assert not np.array_equal(other["x"], data["x"])

    train, test = _mnist1d_data(3, num_samples=1000)
    assert train.tensors[0].shape == (800, 1, 40) and train.tensors[0].dtype == torch.float32
    assert test.tensors[1].shape == (200,) and test.tensors[1].dtype == torch.int64
    logits = mnist1d_cnn(0)(train.tensors[0][:4])
    assert logits.shape == (4, 10)
    # A damaged cache file (empty, or a truncated zip) is generated again.
    for damage in (b"", cached[0].read_bytes()[:100]):
        cached[0].write_bytes(damage)
        for key, value in load_mnist1d(num_samples=1000, seed=3).items():
            np.testing.assert_array_equal(value, data[key])
    # A cache folder that cannot be written: the data is still made, with a warning that names the fix.
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("BATCHPILOT_CACHE", str(blocked / "sub"))
    with pytest.warns(UserWarning, match="cannot cache MNIST-1D.*BATCHPILOT_CACHE"):
        fresh = load_mnist1d(num_samples=1000, seed=3)
    np.testing.assert_array_equal(fresh["x"], data["x"])


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


@pytest.mark.parametrize("case", ["out_is_a_file", "log_is_a_folder"])
def test_report_on_a_path_it_cannot_use_exits_2(tmp_path, capsys, case):
    log = tmp_path / "run.jsonl"
    _write_log(log)
    out = tmp_path / "o"
    if case == "out_is_a_file":
        out.write_text("a file, not a folder")
    else:
        log = tmp_path / "a_folder.json"  # a results.json path that is a folder
        log.mkdir()
    with pytest.raises(SystemExit) as info:
        main(["report", str(log), "--out", str(out)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert ("File exists" in err and str(out) in err) if case == "out_is_a_file" else "Is a directory" in err
