"""The stats package as a whole: its public names, the metric names the docs list, and the accuracy
benchmark on a tiny budget (benchmarks/estimators.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _benchmarks import load_benchmark

import batchpilot.stats as stats
from batchpilot.stats import LossTrend, NoiseScaleEstimator, ThroughputModel

REPO = Path(__file__).resolve().parents[2]


def test_all_is_sorted_and_complete():
    assert stats.__all__ == sorted(stats.__all__)
    for name in stats.__all__:
        assert hasattr(stats, name), name
    public = {n for n in dir(stats) if not n.startswith("_")} - {
        "grad_variance", "loss_trend", "noise_scale", "system", "throughput"}  # the submodules
    assert public == set(stats.__all__)


def produced_metric_names() -> set[str]:
    ns = NoiseScaleEstimator()
    ns.update(2, 5.0, 8, 2.0)
    trend = LossTrend(2)
    trend.update(2.0)
    trend.update(1.0)
    tp = ThroughputModel(warmup=0)
    tp.observe_step([4, 8], [0.1, 0.2], 0.5)
    system = {"system/cpu_util", "system/mem_used_frac", "system/gpu_util", "system/gpu_mem_frac"}
    return set(ns.metrics()) | set(trend.metrics()) | set(tp.metrics()) | system | {"stats/grad_variance"}


def test_docs_list_every_metric_name():
    text = (REPO / "docs" / "statistics.md").read_text()
    listed = set(re.findall(r"`((?:stats|perf|system)/[a-z_]+)`", text))
    missing = produced_metric_names() - listed
    assert not missing, f"docs/statistics.md does not list {sorted(missing)}"
    for name in produced_metric_names():
        assert re.fullmatch(r"(stats|perf|system)/[a-z_]+", name), name


def test_linear_problem_truth_matches_its_definition():
    # The closed form against a Monte Carlo estimate from per-example gradients (float64, 200k samples).
    bench = load_benchmark("estimators")

    problem = bench.LinearProblem(d=4, delta_norm=1.0, noise_std=0.7, seed=3)
    x, y = problem.sample(200_000)
    x, y = x.double(), y.double()
    w = problem.w_star + problem.delta
    g = x * (x @ w - y)[:, None]  # per-example gradients
    mean = g.mean(0)
    truth = problem.truth()
    assert float(mean @ mean) == pytest.approx(truth["grad_sq_norm"], rel=0.03)
    assert float(((g - mean) ** 2).sum(1).mean()) == pytest.approx(truth["trace_cov"], rel=0.02)


def test_benchmark_runs_on_a_tiny_budget(tmp_path):
    bench = load_benchmark("estimators")
    result = bench.run(quick=True)
    json.dumps(result, allow_nan=False)
    bench.print_tables(result)
    (row,) = result["noise_scale"]
    assert row["truth"]["b_simple"] == pytest.approx(141.47, rel=1e-3)
    for r in result["grad_variance"]:
        assert r["rel_err_vs_loop"] < (1e-12 if r["dtype"] == "float64" else 1e-5)
    honest, fast = result["pair_fallback"]
    assert honest["lr_x_cmax"] == 0.0 and fast["lr_x_cmax"] == 1.5
    # Pairing consecutive steps at a large step size wrecks |G|^2 (the gradients anti-correlate).
    assert fast["grad_sq_norm_bias"]["rel_bias"] < -0.5
