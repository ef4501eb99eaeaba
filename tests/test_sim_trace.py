"""Traces: the Trace dataclass, its files, the shipped traces, record_trace on a real Pilot run, `batchpilot trace`."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

import batchpilot
from batchpilot.cli import main
from batchpilot.logs import read_log
from batchpilot.sim.trace import (
    Trace,
    crossing,
    fit_compute,
    fit_noise_scale_factor,
    load_trace,
    record_trace,
    samples_to_progress,
    shipped_traces,
    smoothed,
)


def make_trace(**changes) -> Trace:
    values = dict(workload="toy", base_batch_size=32, num_samples=1000, metric="accuracy", target=0.7,
                  progress=[0.0, 100.0, 200.0, 400.0], metric_values=[0.1, 0.5, 0.9, 0.95],
                  loss=[2.0, 1.0, 0.5, 0.4], noise_scale=[50.0, 100.0, 200.0, 400.0], grad_sq=[2.0, 1.0, 0.5, 0.25],
                  grad_var=[100.0, 100.0, 100.0, 100.0], step_sizes=(32, 64, 128), step_seconds=(0.01, 0.012, 0.016),
                  compute=(0.008, 6.25e-5), max_micro_batch_size=128, grad_bytes=4000, source="by hand")
    values.update(changes)
    return Trace(**values)


def test_at_interpolates_and_clamps():
    t = make_trace()
    assert t.at(150.0) == {"metric": 0.7, "loss": 0.75, "noise_scale": 150.0, "grad_sq": 0.75, "grad_var": 100.0}
    assert t.at(-5.0)["metric"] == 0.1 and t.at(1e9)["noise_scale"] == 400.0


def test_efficiency_is_pollux_formula_with_the_noise_scale_at_that_progress():
    t = make_trace()
    assert t.efficiency(32, 0.0) == 1.0
    assert t.efficiency(128, 100.0) == pytest.approx((100 + 32) / (100 + 128))
    assert t.efficiency(1024, 300.0) == pytest.approx((300 + 32) / (300 + 1024))  # phi interpolated: 300
    assert t.efficiency(16, 0.0) == pytest.approx(82 / 66)  # a smaller batch than B0 is more efficient per sample
    with pytest.raises(ValueError, match="batch_size must be > 0"):
        t.efficiency(0, 1.0)


def test_noise_scale_factor_scales_the_efficiency_and_the_samples_to_target():
    t = make_trace(noise_scale_factor=3.0)
    assert t.efficiency(128, 100.0) == pytest.approx((300 + 32) / (300 + 128))
    np.testing.assert_allclose(t.efficiencies(128, np.array([0.0, 100.0])), [(150 + 32) / (150 + 128), 332 / 428])
    flat = make_trace(noise_scale=[100.0] * 4, grad_var=[100.0] * 4, grad_sq=[1.0] * 4)  # E constant: 132 / 228
    assert flat.samples_to_target(128) == pytest.approx(150.0 * 228 / 132, rel=1e-9)
    assert flat.samples_to_target(32) == pytest.approx(150.0)
    assert Trace.from_json({k: v for k, v in t.to_json().items() if k != "noise_scale_factor"}).noise_scale_factor == 1
    with pytest.raises(ValueError, match="noise_scale_factor must be a finite number > 0"):
        make_trace(noise_scale_factor=0.0)


def test_fitted_matches_the_static_runs_and_round_trips(tmp_path):
    flat = make_trace(noise_scale=[100.0] * 4, grad_var=[100.0] * 4, grad_sq=[1.0] * 4,
                      static_samples_to_target={512: 150.0 * 1212 / 732})  # what k = 7 gives at 512
    fitted = flat.fitted()
    assert fitted.noise_scale_factor == pytest.approx(7.0, rel=1e-2) and fitted.samples_to_target(512) == \
        pytest.approx(150.0 * 1212 / 732, rel=1e-3)
    assert Trace.load(fitted.save(tmp_path / "f.json")) == fitted
    assert Trace.load(fitted.save(tmp_path / "f.json")).static_samples_to_target == {512: 150.0 * 1212 / 732}
    with pytest.raises(ValueError, match="no static_samples_to_target to fit to"):
        make_trace().fitted()
    with pytest.raises(ValueError, match="static_samples_to_target must map batch sizes >= 1 to samples > 0"):
        make_trace(static_samples_to_target={512: -1.0})


def test_smoothing_crossing_and_the_factor_fit_by_hand():
    np.testing.assert_allclose(smoothed([0, 3, 0, 3, 0], 3), [1.5, 1, 2, 1, 1.5])  # centred, shrinking at the ends
    np.testing.assert_allclose(smoothed([1, 2], 1), [1, 2])
    assert crossing([0, 10, 20], [0.1, 0.5, 0.9], 0.7) == pytest.approx(15.0)
    assert crossing([0, 10], [0.1, 0.5], 0.7) is None and crossing([5, 10], [0.8, 0.9], 0.7) == 5.0
    progress, phi = np.array([0.0, 1e5]), np.array([100.0, 100.0])
    # constant phi: a static run at B needs P (k phi + B) / (k phi + B0) samples
    assert samples_to_progress(progress, phi, 32, 512, 1e5, 7.0) == pytest.approx(1e5 * 1212 / 732, rel=1e-9)
    measured = {512: 1e5 * 1212 / 732, 2048: 1e5 * 2748 / 732}  # what k = 7 gives
    assert fit_noise_scale_factor(progress, phi, 32, 1e5, measured) == pytest.approx(7.0, rel=1e-2)
    with pytest.raises(ValueError, match="no batch size other than B0 = 32"):
        fit_noise_scale_factor(progress, phi, 32, 1e5, {32: 1e5})


def test_target_progress_interpolates_the_first_crossing():
    assert make_trace().target_progress() == pytest.approx(150.0)  # 0.5 at 100, 0.9 at 200 -> 0.7 at 150
    assert make_trace(target=0.05).target_progress() == 0.0
    assert make_trace(target=0.9).target_progress() == pytest.approx(200.0)
    with pytest.raises(ValueError, match=r"never reaches its target 0.99 \(best accuracy 0.95\)"):
        make_trace(target=0.99).target_progress()


@pytest.mark.parametrize("changes, message", [
    ({"progress": [], "metric_values": [], "loss": [], "noise_scale": [], "grad_sq": [], "grad_var": []},
     "progress must be a non-empty"),
    ({"progress": [0.0, 100.0, 100.0, 400.0]}, "strictly ascend; index 2 is 100.0"),
    ({"progress": [1.0, 100.0, 200.0, 400.0]}, "must start at 0"),
    ({"noise_scale": [50.0, 0.0, 1.0, 1.0]}, "noise_scale must be > 0 samples; index 1"),
    ({"loss": [1.0, 2.0]}, "loss has 2 points but progress has 4"),
    ({"grad_sq": [1.0, float("nan"), 1.0, 1.0]}, "non-finite value at index 1"),
    ({"step_sizes": (64, 32, 128)}, "ascending whole numbers"),
    ({"step_seconds": (0.01, 0.0, 0.02)}, "finite and > 0"),
    ({"step_seconds": (0.01,)}, "same length"),
    ({"compute": (-1.0, 0.1)}, "compute"),
    ({"base_batch_size": 0}, "base_batch_size must be a whole number >= 1"),
])
def test_bad_traces_are_refused_with_the_value_and_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        make_trace(**changes)


def test_arrays_are_read_only_and_equality_compares_values():
    t = make_trace()
    with pytest.raises(ValueError):
        t.progress[1] = 5.0
    assert t == make_trace() and t != make_trace(target=0.8)


def test_json_round_trip_and_files(tmp_path):
    t = make_trace()
    data = json.loads(json.dumps(t.to_json()))
    assert data["format"] == "batchpilot-trace" and data["version"] == 1
    assert Trace.from_json(data) == t
    back = Trace.load(t.save(tmp_path / "sub" / "toy.json"))
    assert back == t and back.compute == t.compute and back.step_sizes == (32, 64, 128)
    assert load_trace(str(tmp_path / "sub" / "toy.json")) == t


def test_corrupt_and_foreign_files_are_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json' is not JSON"):
        Trace.load(bad)
    bad.write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match=r"bad.json': not a batchpilot trace \(format None"):
        Trace.load(bad)
    data = make_trace().to_json()
    with pytest.raises(ValueError, match="version 99 is not 1"):
        Trace.from_json({**data, "version": 99})
    with pytest.raises(ValueError, match="lacks noise_scale"):
        Trace.from_json({k: v for k, v in data.items() if k != "noise_scale"})
    with pytest.raises(ValueError, match="no shipped trace named 'nope'"):
        load_trace("nope")


def test_perturbed_is_seeded_and_scales_what_it_documents():
    t = make_trace()
    assert t.perturbed(np.random.default_rng(0), scale=0.0) == t
    p1, p2 = t.perturbed(np.random.default_rng(3)), t.perturbed(np.random.default_rng(3))
    assert p1 == p2 and p1 != t
    f_noise, f_progress, f_a, f_b = np.exp(0.3 * np.random.default_rng(3).standard_normal(4))
    np.testing.assert_allclose(p1.noise_scale, t.noise_scale * f_noise)
    np.testing.assert_allclose(p1.grad_var / p1.grad_sq, t.noise_scale * f_noise)  # still the noise scale
    assert p1.target_progress() == pytest.approx(150.0 * f_progress)
    assert p1.compute == pytest.approx((0.008 * f_a, 6.25e-5 * f_b))
    shift = [t.step_seconds[i] + (f_a - 1) * 0.008 + (f_b - 1) * 6.25e-5 * s for i, s in enumerate(t.step_sizes)]
    assert p1.step_seconds == pytest.approx(shift)
    with pytest.raises(ValueError, match="scale must be a finite number >= 0"):
        t.perturbed(np.random.default_rng(0), scale=-1.0)


def test_fit_and_compute_seconds():
    assert fit_compute([32, 64, 128], [0.01 + 1e-4 * 32, 0.01 + 1e-4 * 64, 0.01 + 1e-4 * 128]) == pytest.approx(
        (0.01, 1e-4))
    a, b = fit_compute([1, 2, 3], [0.5, 1.5, 2.6])  # the line would cross below 0: refit through the origin
    x, y = np.array([1.0, 2.0, 3.0]), np.array([0.5, 1.5, 2.6])
    assert a == 0.0 and b == pytest.approx((x / y).sum() / (x * x / y / y).sum())  # relative least squares
    t = make_trace()
    assert t.compute_seconds(64) == 0.012 and t.compute_seconds(96) == pytest.approx(0.014)
    assert t.compute_seconds(256) == pytest.approx(0.016 + (0.016 - 0.012) / 64 * 128)  # last segment's slope
    assert t.compute_seconds(16) == pytest.approx(0.01 - 6.25e-5 * 16)


def test_every_shipped_trace_loads_and_reaches_its_target():
    names = shipped_traces()
    assert {"mnist1d", "digits", "seqsum"} <= set(names)
    for name in names:
        t = load_trace(name)
        reach = t.target_progress()
        assert 0 < reach <= t.progress[-1] and len(t.progress) <= 200
        assert t.workload == name and "batchpilot trace" in t.source and t.grad_bytes > 0
        assert (t.noise_scale > 0).all() and t.metric_values[0] < t.target
        assert t.step_sizes[0] <= t.base_batch_size <= t.step_sizes[-1]


def _pilot_run(path, steps=48, noise_every=1):
    torch.manual_seed(0)
    x = torch.randn(1024, 8)
    y = (x @ torch.randn(8, 3)).argmax(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.TensorDataset(x, y),
                             batch_size=32, noise_every=noise_every, log_path=path, progress=False)

    def accuracy():
        with torch.no_grad():
            return float((model(x).argmax(1) == y).float().mean())

    evaluations = [(0, accuracy())]
    for xb, yb in pilot.batches(max_steps=steps):
        pilot.backward(torch.nn.functional.cross_entropy(model(xb), yb))
        if pilot.samples_seen % 256 == 0 and pilot.samples_seen != evaluations[-1][0]:
            evaluations.append((pilot.samples_seen, accuracy()))
    pilot.close()
    return evaluations, 4 * sum(p.numel() for p in model.parameters())


def test_record_trace_from_a_real_pilot_log(tmp_path):
    log = tmp_path / "run.jsonl"
    evaluations, grad_bytes = _pilot_run(log)
    kw = dict(workload="toy", target=0.6, num_samples=1024, grad_bytes=grad_bytes)
    t = record_trace(log, evaluations, [32, 64, 128], [0.001, 0.0014, 0.0022], **kw)
    assert t.base_batch_size == 32 and t.max_micro_batch_size == 128 and t.grad_bytes == grad_bytes
    # A static run at B0: every step has efficiency 1, so progress == samples at each evaluation.
    np.testing.assert_allclose(t.progress, [s for s, _ in evaluations])
    np.testing.assert_allclose(t.metric_values, [m for _, m in evaluations])
    steps = [r for r in read_log(log) if r["type"] == "step"]
    at_256 = next(r for r in steps if r["samples_seen"] == 256)
    assert t.noise_scale[1] == pytest.approx(at_256["stats/noise_scale"]) == t.noise_scale[0]
    assert t.grad_var[1] == pytest.approx(at_256["stats/trace_cov"])
    assert t.grad_sq[1] == pytest.approx(at_256["stats/grad_sq_norm"])
    assert t.loss[1] == pytest.approx(np.mean([r["loss"] for r in steps if 0 < r["samples_seen"] <= 256]))
    assert t.compute == pytest.approx(fit_compute([32, 64, 128], [0.001, 0.0014, 0.0022]))
    assert t.target_progress() > 0

    thin = record_trace(log, evaluations, [32, 64, 128], [0.001, 0.0014, 0.0022], max_points=6, **kw)
    first_hit = next(s for s, m in evaluations if m >= 0.6)
    assert len(thin.progress) <= 6 and thin.progress[0] == 0 and thin.progress[-1] == evaluations[-1][0]
    assert first_hit in thin.progress and thin.target_progress() == pytest.approx(t.target_progress())
    smooth = record_trace(log, evaluations, [32, 64, 128], [0.001, 0.0014, 0.0022], smooth=3, **kw)
    np.testing.assert_allclose(smooth.metric_values, smoothed([m for _, m in evaluations], 3))
    k3 = record_trace(log, evaluations, [32], [0.001], noise_scale_factor=3.0, **kw)
    assert k3.noise_scale_factor == 3.0 and np.allclose(k3.progress, t.progress)  # at B0 progress is samples anyway
    with pytest.raises(ValueError, match="max_points must be a whole number >= 6"):
        record_trace(log, evaluations, [32], [0.001], max_points=2, **kw)

    # With B0 = 16 the same run counts sum 32 (phi + 16) / (phi + 32) per step: computed here by hand from the log.
    t16 = record_trace(log, evaluations, [32, 64, 128], [0.001, 0.0014, 0.0022], base_batch_size=16, **kw)
    phis, last = [], None
    for r in steps:
        v = r.get("stats/noise_scale")
        last = v if isinstance(v, float) and v > 0 else last
        phis.append(last)
    first = next(p for p in phis if p is not None)
    by_hand = np.cumsum([32 * ((p or first) + 16) / ((p or first) + 32) for p in phis])
    last_eval_step = int(evaluations[-1][0]) // 32 - 1  # the step whose samples_seen is the last evaluation's
    assert t16.progress[-1] == pytest.approx(by_hand[last_eval_step]) and t16.progress[-1] < t.progress[-1]


def test_record_trace_refuses_a_log_without_statistics(tmp_path):
    log = tmp_path / "plain.jsonl"
    evaluations, grad_bytes = _pilot_run(log, steps=8, noise_every=None)
    with pytest.raises(ValueError, match=r"noise_every"):
        record_trace(log, evaluations, [32], [0.001], workload="toy", target=0.5, num_samples=1024,
                     grad_bytes=grad_bytes)
    with pytest.raises(ValueError, match="no step records"):
        record_trace([], evaluations, [32], [0.001], workload="toy", target=0.5, num_samples=1024, grad_bytes=4)


def test_the_trace_command_writes_a_loadable_trace(tmp_path, capsys):
    start = time.perf_counter()
    status = main(["trace", "--workload", "synthetic", "--out", str(tmp_path), "--budget-s", "3", "--max-size", "64",
                   "--calibrate-steps", "1", "--calibrate-rounds", "1", "--eval-every", "0.1", "--target-window", "3",
                   "--fit-sizes", "128", "--no-progress"])
    assert status == 0 and time.perf_counter() - start < 60
    t = Trace.load(tmp_path / "synthetic.json")
    assert t.workload == "synthetic" and t.step_sizes == (32, 64) and t.base_batch_size == 32
    assert ("batchpilot trace --workload synthetic --seed 0 --budget-s 3.0 --eval-every 0.1 --max-size 64 "
            "--calibrate-steps 1 --calibrate-rounds 1 --target-window 3 --fit-sizes 128:") in t.source
    assert list(t.static_samples_to_target) == [128] and t.noise_scale_factor == 1.0
    assert "static_samples_to_target from static:128" in t.source
    assert 0 < t.static_samples_to_target[128] and 0.01 <= t.fitted().noise_scale_factor <= 1.1e4
    assert math.isfinite(t.target_progress())
    assert str(tmp_path / "synthetic.json") in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--workload", "nope"], "unknown workload 'nope'"),
    (["--budget-s", "0"], "--budget-s must be a positive number"),
    (["--noise-every", "0"], "--noise-every must be a whole number >= 1"),
    (["--target", "1.5"], "--target must be an accuracy"),
    (["--fit-sizes", "big"], "--fit-sizes 'big' must list whole batch sizes"),
])
def test_the_trace_command_refuses_bad_input(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["trace", "--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_replace_keeps_validation():
    with pytest.raises(ValueError, match="noise_scale must be > 0"):
        replace(make_trace(), noise_scale=np.zeros(4))
