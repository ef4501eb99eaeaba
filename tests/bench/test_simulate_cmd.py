"""Issue 22, item 8: ``batchpilot simulate`` (policies on a trace and a simulated cluster, against the oracle)."""

from __future__ import annotations

import json

import pytest

from batchpilot.bench.simulate_cmd import simulate
from batchpilot.cli import main
from batchpilot.sim.cluster import ClusterSpec
from batchpilot.sim.trace import load_trace


def test_no_policy_beats_the_oracle_on_a_shipped_trace():
    trace = load_trace("digits")
    results = simulate(trace, ClusterSpec.parse("gpus=4,speedup=10"), ["best-static", "goodput", "static:64"])
    assert list(results) == ["oracle", "best-static", "goodput", "static:64"]
    oracle = results["oracle"]
    assert oracle.reached
    for run in results.values():
        # The oracle is greedy on the true goodput: nothing is faster in this model (up to its candidate grid).
        assert run.time_to_target_s >= oracle.time_to_target_s * 0.995
    assert results["best-static"].time_to_target_s <= results["static:64"].time_to_target_s


def test_simulate_cli_prints_the_table_and_writes_json_and_plot(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "--trace", "digits", "--cluster", "gpus=2", "--policies", "oracle,static:128,goodput",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "SIMULATED" in printed and "ratio to oracle" in printed and "static:128" in printed
    data = json.loads((out / "simulate.json").read_text())
    assert data["simulated"] is True and data["devices"] == 2
    assert data["policies"]["oracle"]["ratio_to_oracle"] == pytest.approx(1.0)
    assert data["policies"]["static:128"]["ratio_to_oracle"] >= 0.995
    assert data["policies"]["goodput"]["history"][0]["batch_size"] >= 32
    pytest.importorskip("matplotlib")
    assert (out / "simulate.png").stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["--policies", "oracle,bogus"], "unknown policy 'bogus'"),
    (["--policies", "static:7"], "static:7"),
    (["--cluster", "gpus=0"], "gpus"),
    (["--trace", "no-such-trace"], "no-such-trace"),
])
def test_simulate_cli_refuses_bad_input_with_the_fix(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", *args, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
