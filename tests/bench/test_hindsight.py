"""benchmarks/hindsight.py: its schedules, its recipe reader, and a run on a tiny budget (no speed asserted)."""

import json
import sys
from pathlib import Path

import pytest
from _benchmarks import load_benchmark

from batchpilot.controllers.base import Observation

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("hindsight")


def test_schedules_hold_the_lr_and_change_the_batch_where_told(bench):
    specs = bench.make_specs(512, 0.16, 12.5, warm=0.08, anneal=0.5, max_size=4096)
    assert set(specs) == set(bench.HELD)
    for spec in specs.values():
        assert (spec.lr_rule, spec.optimizer_lr, spec.lr) == ("none", 0.16, 0.16)
    assert specs["static"].make_controller(100) is None and specs["static"].batch_size == 512
    warm = specs["warm-start"].make_controller(100)
    assert specs["warm-start"].batch_size == 128 and (warm.boundaries, warm.sizes) == ([1.0], [128, 512])
    anneal = specs["anneal"].make_controller(100)
    assert (anneal.boundaries, anneal.sizes) == ([6.25], [512, 1024])
    both = specs["warm+anneal"].make_controller(100)
    assert (both.boundaries, both.sizes, both.key) == ([1.0, 6.25], [128, 512, 1024], "epoch")
    grow = specs["noise-anneal"].make_controller(100)
    obs = lambda step, size, noise: Observation(step=step, samples_seen=0, epoch=0, coverage=0.0, batch_size=size,  # noqa: E731
                                                num_samples=100, stats={"stats/noise_scale": noise})
    assert (grow.decide(obs(50, 512, 100.0)), grow.decide(obs(50, 700, 100.0)), grow.decide(obs(51, 512, 100.0)),
            grow.decide(obs(100, 512, 9000.0))) == (612, 700, 512, 4096)  # base + B_simple, growth only, bounded
    goodput = specs["goodput"].make_controller(100)
    assert (goodput.min_size, goodput.max_size, specs["goodput"].noise_every) == (32, 4096, 16)


def test_recipe_comes_from_a_bench_results_file(bench, tmp_path):
    good = tmp_path / "results.json"
    good.write_text(json.dumps({"workload": "digits", "best_static": {
        "chosen": "static:128@lr=0.004", "lr": 0.004, "median_epochs_to_target": 1.25}}))
    assert bench.recipe_from_results(good) == {"workload": "digits", "batch": 128, "lr": 0.004, "epochs": 1.25}
    plain = tmp_path / "plain.json"  # a plain static:N best has no "chosen" (bench --policies quick, say)
    plain.write_text(json.dumps({"workload": "digits", "best_static": {
        "policy": "static:256", "lr": 0.08, "median_epochs_to_target": 2.0}}))
    assert bench.recipe_from_results(plain) == {"workload": "digits", "batch": 256, "lr": 0.08, "epochs": 2.0}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="bad.json.*batchpilot bench"):
        bench.recipe_from_results(bad)


def test_runs_on_a_tiny_budget(bench, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [
        "hindsight.py", "--workload", "synthetic", "--batch", "64", "--lr", "0.02", "--epochs", "2",
        "--variants", "static,warm+anneal,goodput", "--seeds", "0", "--budget", "1.5", "--threads", "1",
        "--device", "cpu", "--out", str(out)])
    bench.main()
    result = json.loads((out / "hindsight.json").read_text())
    assert result["device"] == "cpu"
    assert [r["variant"] for r in result["runs"]] == ["static", "warm+anneal", "goodput"]
    assert result["runs"][1]["batch_sizes"][0][1] == 16  # B/4 first
    static = result["summary"]["static"]
    if static["median_time_to_target_s"] is not None:
        assert static["ratio_vs_static"] == pytest.approx(1.0)
    pytest.importorskip("matplotlib")
    assert (out / "hindsight.png").stat().st_size > 0


def test_static_is_required(bench, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["hindsight.py", "--workload", "synthetic", "--batch", "64", "--lr", "0.02",
                                      "--epochs", "2", "--variants", "anneal"])
    with pytest.raises(SystemExit):
        bench.main()


@pytest.mark.parametrize("device", ["tpu", "cuda:99"])
def test_an_unusable_device_is_refused(bench, monkeypatch, capsys, device):
    monkeypatch.setattr(sys, "argv", ["hindsight.py", "--workload", "synthetic", "--batch", "64", "--lr", "0.02",
                                      "--epochs", "2", "--device", device])
    with pytest.raises(SystemExit):
        bench.main()
    assert f"device={device!r}" in capsys.readouterr().err


def test_curve_variants_put_the_lr_on_the_noise_scale_curve(bench):
    specs = bench.make_specs(512, 0.16, 12.5, warm=0.08, anneal=0.5, max_size=4096, lr_max=0.2, anchor=4096)
    assert set(specs) == set(bench.VARIANTS)
    for name in bench.CURVE:
        spec = specs[name]
        assert (spec.lr_rule, spec.base_batch_size, spec.optimizer_lr, spec.noise_every) == ("adascale", 4096, 0.2, 16)
    assert specs["curve"].make_controller(100) is None and specs["curve"].batch_size == 512
    assert specs["curve-goodput"].batch_size == 32 and type(specs["curve-goodput"].make_controller(100)).__name__ == "Goodput"
    phi3 = specs["curve-goodput-phi3"].make_controller(100)
    plain = specs["curve-goodput"].make_controller(100)
    phi3._b0 = plain._b0 = 32
    assert phi3.efficiency(512, 100.0) == pytest.approx(plain.efficiency(512, 300.0))


def test_curve_variants_need_lr_max_and_run_with_a_range_test(bench, tmp_path, monkeypatch):
    base = ["hindsight.py", "--workload", "synthetic", "--batch", "64", "--lr", "0.02", "--epochs", "2",
            "--seeds", "0", "--budget", "1.5", "--threads", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [*base, "--variants", "static,curve"])
    with pytest.raises(SystemExit):
        bench.main()
    monkeypatch.setattr(sys, "argv", [*base, "--variants", "static,curve,curve-goodput", "--lr-max", "auto"])
    bench.main()
    result = json.loads((tmp_path / "hindsight.json").read_text())
    assert [r["variant"] for r in result["runs"]] == ["static", "curve", "curve-goodput"]
    curve = result["runs"][1]
    assert curve["lr_max"] > 0 and curve["range_test_s"] > 0 and result["runs"][2]["lr_max"] == curve["lr_max"]
    assert "lr_max" not in result["runs"][0] and result["lr_max"] == "auto"
