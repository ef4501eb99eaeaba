"""Issue 22, item 6: ``batchpilot bench --clock cluster:SPEC``, the same runs timed by the simulated cluster."""

from __future__ import annotations

import json

import pytest

from batchpilot.bench.calibrate import Calibration
from batchpilot.bench.cluster_clock import MeasuredDevice, add_cluster_clock, parse_clock, run_cluster_seconds
from batchpilot.cli import main

CAL = Calibration(sizes=[32, 64, 128, 256], step_s=[0.010, 0.012, 0.016, 0.024], probe_step_s=[0.02, 0.02, 0.03, 0.05])
DEVICE = MeasuredDevice.from_calibration(CAL, grad_bytes=4_000_000, max_micro_batch_size=256)


def _run(policy: str, seed: int, sizes: list[tuple[int, int]], steps: int | None, probe: dict | None = None) -> dict:
    return {"policy": policy, "seed": seed, "steps_to_target": steps, "probe": probe,
            "batch_sizes": [{"step": s, "samples_seen": 0, "time_s": 0.0, "batch_size": b} for s, b in sizes]}


def test_one_device_is_the_cost_model():
    # On "cpu" (one device, the calibrated machine) a step costs its calibrated time: 10 steps at 64, 5 at 128.
    run = _run("ramp", 0, [(0, 64), (10, 128)], steps=15)
    assert run_cluster_seconds(run, parse_clock("cluster:cpu"), DEVICE) == pytest.approx(10 * 0.012 + 5 * 0.016)
    # A target never reached has no time; steps past the target are not counted.
    assert run_cluster_seconds(_run("x", 0, [(0, 64)], steps=None), parse_clock("cluster:cpu"), DEVICE) is None
    assert run_cluster_seconds(_run("x", 0, [(0, 64), (20, 256)], steps=20), parse_clock("cluster:cpu"),
                               DEVICE) == pytest.approx(20 * 0.012)


def test_sixteen_devices_split_the_batch_and_pay_the_all_reduce():
    # 16 devices, batch 256: 16 samples each; 16 < the table's first size, so c(16) = max(t0 - b (32 - 16),
    # t0 * 16 / 32) with b the fit's slope; the ring all-reduce moves 2 (N-1)/N x 4 MB at 1e9 B/s plus 2 (N-1)
    # latencies, and the two overlap with g = 1 (they add).
    spec = parse_clock("cluster:gpus=16,bandwidth=1e9,latency=1e-5,overlap=1")
    slope = DEVICE.compute[1]
    compute = max(0.010 - slope * 16, 0.010 * 16 / 32)
    network = 2 * 15 * 1e-5 + 2 * 15 / 16 * 4_000_000 / 1e9
    run = _run("static:256", 0, [(0, 256)], steps=3)
    assert run_cluster_seconds(run, spec, DEVICE) == pytest.approx(3 * (compute + network))


def test_auto_probes_are_counted_and_the_best_static_is_picked_again():
    probe = {"throughput": [[32, 1.0], [64, 1.0]], "start_size": 64, "steps": 12 + 20}
    runs = [_run("static:32", 0, [(0, 32)], steps=100), _run("static:256", 0, [(0, 256)], steps=30),
            _run("static:256@lr=0.1", 0, [(0, 256)], steps=20), _run("auto", 0, [(0, 64)], steps=10, probe=probe)]
    results = {"runs": runs, "members": {"static:32": ["static:32"],
                                         "tuned-static:256": ["static:256@lr=0.1", "static:256"], "auto": ["auto"]}}
    clock = add_cluster_clock(results, "cluster:cpu", DEVICE)
    medians = clock["median_time_to_target_s"]
    assert medians["static:32"] == pytest.approx(100 * 0.010)
    assert medians["tuned-static:256"] == pytest.approx(20 * 0.024)  # its best LR cell under this clock
    # auto: 6 probe steps at 32 and at 64, the other 20 probe steps (the range test) at the knee, then 10 steps.
    assert medians["auto"] == pytest.approx(6 * 0.010 + 6 * 0.012 + 20 * 0.012 + 10 * 0.012)
    assert clock["best_static_policy"] == "tuned-static:256" and clock["simulated"] is True
    assert clock["ratio_to_best_static"]["static:32"] == pytest.approx(1.0 / 0.48)
    assert results["cluster_clock"] is clock


@pytest.mark.parametrize("text", ["cpu", "cluster:", "wall:gpus=2", "cluster:gpus=zero"])
def test_a_bad_clock_is_refused_with_the_accepted_form(text):
    with pytest.raises(ValueError, match="cluster"):
        parse_clock(text)


def test_bench_cli_reports_the_simulated_clock(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["bench", "--workload", "synthetic", "--seeds", "0", "--budget-s", "5", "--no-progress", "--calibrate-steps",
            "1", "--no-cache", "--policies", "static:32,static:128", "--clock", "cluster:gpus=16,speedup=10",
            "--out", str(out)]
    assert main(args) == 0
    clock = json.loads((out / "results.json").read_text())["cluster_clock"]
    assert clock["devices"] == 16 and set(clock["median_time_to_target_s"]) == {"static:32", "static:128"}
    assert "Simulated cluster clock" in (out / "report.md").read_text()
    assert "Simulated cluster clock" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args[:-4], "--clock", "cluster:gpus=-1", "--out", str(out)])
