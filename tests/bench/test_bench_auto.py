"""Issue 21's bench: the ``auto`` policy (its probes inside the clock), rollbacks and collapsed runs in the report,
the cache of static runs, the ``markov`` workload."""

from __future__ import annotations

import json

import pytest
import torch

from batchpilot.bench.cache import BenchCache, code_hash
from batchpilot.bench.markov import bayes_accuracy, markov_data, markov_gru
from batchpilot.bench.policies import parse_policies, parse_policy, workload_grid
from batchpilot.bench.specs import Plan, expand
from batchpilot.bench.summary import collapse_floor, evaluate_targets, is_collapsed, summarize
from batchpilot.bench.train import rollbacks_in_log
from batchpilot.bench.workloads import WORKLOADS
from batchpilot.cli import main
from batchpilot.logs import AdjustmentLog

PLAN = Plan(base_lr=0.01, base_batch_size=32, lr_rule="linear", num_samples=48_000, min_size=32, max_size=4096,
            finder_size=2048)
TINY = ["bench", "--workload", "synthetic", "--seeds", "0", "--budget-s", "10", "--no-progress", "--calibrate-steps", "1"]


# ------------------------------------------------------------------------------------------ the policy
def test_auto_policy_parses_and_expands_to_the_automatic_mode():
    auto = parse_policy(" Auto ")
    assert (auto.name, auto.kind, auto.category) == ("auto", "auto", "adaptive")
    with pytest.raises(ValueError, match="auto takes no argument"):
        parse_policy("auto:512")
    ruled = parse_policy("auto@lr-rule=adascale")
    assert (ruled.name, ruled.lr_rule) == ("auto@lr-rule=adascale", "adascale")
    specs, members = expand(parse_policies("auto,auto@lr-rule=adascale,static:128"), PLAN)
    by_name = {s.name: s for s in specs}
    spec = by_name["auto"]
    # The Pilot's defaults (lr_rule "auto": range test + LR curve), the workload's bounds, the base LR to sweep around.
    assert spec.auto and spec.lr is None and spec.lr_rule is None and spec.optimizer_lr == 0.01
    assert not spec.static and by_name["static:128"].static
    from batchpilot.controllers import Auto

    controller = spec.make_controller(48_000)
    assert isinstance(controller, Auto) and (controller.min_size, controller.max_size) == (32, 4096)
    assert by_name["auto@lr-rule=adascale"].lr_rule == "adascale"
    assert members["auto"] == ["auto"]


def test_named_sets_put_auto_in_and_the_workload_grid_expands():
    assert "auto" in [p.name for p in parse_policies("default")] and "auto" in [p.name for p in parse_policies("quick")]
    assert not any("@lr-rule=" in p.name for p in parse_policies("default"))
    grid = [p.name for p in workload_grid(parse_policies("tuned-static:grid"), WORKLOADS["markov"].grid)]
    assert grid == ["tuned-static:64", "tuned-static:128", "tuned-static:256", "tuned-static:512"]
    ruled = workload_grid(parse_policies("tuned-static:grid@lr-rule=sqrt"), (32, 64))
    assert [p.name for p in ruled] == ["tuned-static:32@lr-rule=sqrt", "tuned-static:64@lr-rule=sqrt"]


# ------------------------------------------------------------------------------------------ summaries
def _run(policy, seed, t, acc=0.98, rollbacks=0):
    return {"policy": policy, "seed": seed, "time_to_target_s": t, "cost_model_time_to_target_s": t,
            "steps_to_target": None if t is None else 10, "samples_to_target": None if t is None else 100,
            "epochs_to_target": None if t is None else 1.0, "final_accuracy": acc, "wall_s": t or 30.0,
            "grid": False, "cost_model_s": t, "batch_sizes": [], "lr": 0.1, "rollbacks": rollbacks}


def test_collapsed_runs_are_judged_per_seed_against_static_32():
    runs = [_run("static:32", 0, None, acc=0.95), _run("static:32", 1, 20.0, acc=0.981),
            _run("goodput", 0, None, acc=0.10, rollbacks=2),  # diverged to chance: collapsed
            _run("goodput", 1, None, acc=0.975),  # missed, below static:32's 0.981 on seed 1: collapsed
            _run("noise-scale", 0, None, acc=0.96),  # missed, but above static:32 on seed 0 (0.95): not collapsed
            _run("noise-scale", 1, 5.0, acc=0.9805),  # reached the target: never collapsed
            _run("auto", 0, 4.0, rollbacks=1), _run("auto", 2, None, acc=0.5)]  # seed 2: no static:32 to judge by
    floor = collapse_floor(runs)
    assert floor == {0: 0.95, 1: 0.981}
    assert [is_collapsed(r, floor) for r in runs[2:]] == [True, True, False, False, False, None]
    summary, best = summarize(runs)
    assert (summary["goodput"]["collapsed"], summary["goodput"]["collapse_judged"]) == (2, 2)
    assert (summary["auto"]["collapsed"], summary["auto"]["collapse_judged"]) == (0, 1)
    assert summary["goodput"]["rollbacks"] == 2 and summary["auto"]["rollbacks"] == 1
    assert summary["goodput"]["runs_with_rollbacks"] == 1
    t = evaluate_targets(summary, best, {}, "static:32", stretch=False)
    assert t["best_adaptive"] == "auto"  # auto is judged when it ran, though noise-scale's median is not worse
    assert t["d"]["status"] == "MISS" and t["d"]["value"] == 2 and "goodput: 2" in t["d"]["text"]
    assert "3 rollbacks logged" in t["d"]["text"]
    healthy = [r for r in runs if r["policy"] != "goodput"]
    assert evaluate_targets(*summarize(healthy), {}, "static:32", stretch=False)["d"]["status"] == "PASS"


def test_rollbacks_are_read_from_the_adjustment_log(tmp_path):
    log = AdjustmentLog(tmp_path / "log.jsonl")
    log.write("step", {"step": 1, "loss": 2.0})
    log.write("decision", {"step": 7, "decision/batch_size": 256, "decision/source": "controller"})
    log.write("decision", {"step": 9, "decision/rollback": True, "decision/batch_size": 128,
                           "rollback/losses": list(range(40)), "other": 1})
    log.close()
    found = rollbacks_in_log(tmp_path / "log.jsonl")
    assert found == [{"step": 9, "decision/rollback": True, "decision/batch_size": 128,
                      "rollback/losses": list(range(24, 40))}]
    assert rollbacks_in_log(tmp_path / "missing.jsonl") == []


# ------------------------------------------------------------------------------------------ end to end
def test_tiny_auto_vs_static_bench_reports_probes_and_rollbacks(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*TINY, "--policies", "auto,static:128", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["summary"]) == {"auto", "static:128"}
    auto = next(r for r in results["runs"] if r["policy"] == "auto")
    probe = auto["probe"]
    assert probe["seconds"] > 0 and probe["steps"] > 0 and probe["start_size"] == auto["batch_sizes"][0]["batch_size"]
    # The probes ran inside the clock: the first evaluation after step 0 comes after them, and the cost model
    # counts their steps.
    assert auto["curve"][1]["time_s"] >= probe["seconds"]
    assert 0 < probe["cost_model_s"] <= auto["cost_model_s"]
    assert auto["lr"] == probe["lr"] and auto["rollbacks"] == len(auto["rollback_records"]) >= 0
    assert results["summary"]["auto"]["median_probe_s"] == probe["seconds"]
    assert results["targets"]["best_adaptive"] == "auto"
    report = (out / "report.md").read_text()
    assert "| rollbacks |" in report and "median probes" in report and "(d) collapsed" in report
    printed = capsys.readouterr().out
    assert "rollbacks" in printed and "target (d)" in printed


def test_the_cache_reuses_static_runs_and_misses_when_a_setting_changes(tmp_path, capsys):
    cache = tmp_path / "cache"
    bench = [*TINY, "--policies", "static:64,static:128,noise-scale", "--cache-dir", str(cache)]
    assert main([*bench, "--out", str(tmp_path / "a")]) == 0
    first = json.loads((tmp_path / "a" / "results.json").read_text())
    assert not any(r.get("cached") for r in first["runs"]) and not first["config"]["calibration_cached"]
    assert main([*bench, "--out", str(tmp_path / "b")]) == 0
    second = json.loads((tmp_path / "b" / "results.json").read_text())
    cached = {r["policy"]: bool(r.get("cached")) for r in second["runs"]}
    assert cached == {"static:64": True, "static:128": True, "noise-scale": False}  # adaptive runs always train
    assert second["config"]["calibration_cached"] and second["calibration"] == first["calibration"]
    for name in ("static:64", "static:128"):
        a, b = (next(r for r in res["runs"] if r["policy"] == name) for res in (first, second))
        assert {k: v for k, v in b.items() if k != "cached"} == a
    assert "2 of 3 runs read from the cache" in capsys.readouterr().out
    assert "(cached)" in (tmp_path / "b" / "report.md").read_text()
    # Another budget, another evaluation interval, or --no-cache: nothing is read.
    for change in (["--budget-s", "11"], ["--eval-every", "0.5"], ["--no-cache"]):
        out = tmp_path / f"c{len(change[0])}"
        assert main([*bench, *change, "--out", str(out)]) == 0
        again = json.loads((out / "results.json").read_text())
        assert not any(r.get("cached") for r in again["runs"]), change


def test_cache_keys_name_the_seed_the_spec_and_the_machine(tmp_path):
    wl = WORKLOADS["synthetic"]
    specs, _ = expand(parse_policies("static:64,static:128,noise-scale"), PLAN)
    cache = BenchCache(tmp_path, wl, {"budget_s": 10}, torch.device("cpu"))
    run = {"policy": "static:64", "seed": 0, "wall_s": 1.0}
    cache.put(specs[0], 0, run)
    assert cache.get(specs[0], 0) == {**run, "serves": ["static:64"], "grid": False, "cached": True}
    assert cache.get(specs[0], 1) is None and cache.get(specs[1], 0) is None
    cache.put(specs[2], 0, {"policy": "noise-scale", "seed": 0})  # adaptive: never kept
    assert cache.get(specs[2], 0) is None and len(list((tmp_path / "synthetic").glob("run-*.json"))) == 1
    other = BenchCache(tmp_path, wl, {"budget_s": 10}, torch.device("cpu"))
    torch_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(torch_threads + 1)
        busier = BenchCache(tmp_path, wl, {"budget_s": 10}, torch.device("cpu"))
    finally:
        torch.set_num_threads(torch_threads)
    assert other.get(specs[0], 0) is not None and busier.get(specs[0], 0) is None
    assert len(code_hash()) == 64


# ------------------------------------------------------------------------------------------ markov
def test_markov_data_shapes_determinism_and_bayes_rate():
    train, test = markov_data(3, n_train=2000, n_test=1000)
    x, y = train.tensors
    assert x.shape == (2000, 64) and x.dtype == torch.int64 and y.shape == (2000,) and y.dtype == torch.int64
    assert int(x.min()) >= 0 and int(x.max()) == 7 and set(y.tolist()) == set(range(10))
    again, _ = markov_data(3, n_train=2000, n_test=1000)
    assert torch.equal(again.tensors[0], x) and torch.equal(again.tensors[1], y)
    other, _ = markov_data(4, n_train=2000, n_test=1000)
    assert not torch.equal(other.tensors[0], x)
    # The chains are told apart by adding up weak evidence: the Bayes-optimal rule is good, far from perfect.
    assert 0.9 < bayes_accuracy(3, test) < 0.995


def test_markov_gru_trains_a_few_steps():
    train, _ = markov_data(0, n_train=256, n_test=16)
    model = markov_gru(0)
    assert model(train.tensors[0][:5]).shape == (5, 10)
    same = markov_gru(0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    optimizer = WORKLOADS["markov"].make_optimizer(model.parameters(), 3e-3)
    x, y = train.tensors[0][:64], train.tensors[1][:64]
    losses = []
    for _ in range(25):  # one batch, trained on again and again: the loss must come down
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
