"""Reports and plots: a bench results.json re-rendered, adjustment logs plotted, bad input, no matplotlib."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from _bench_helpers import assert_png

from batchpilot.bench.report import plot_log
from batchpilot.bench.workloads import WORKLOADS
from batchpilot.cli import main


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
