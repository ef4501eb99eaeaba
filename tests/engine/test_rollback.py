"""The rollback guard (engine/guard.py): a change of size followed by a non-finite step or a loss spike is undone
exactly (the run then equals one that never made the change), the controller backs off, two gloo ranks agree,
a kill -9 inside a watch window resumes exactly, bad settings are refused, the state round-trips."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import _rollback_helpers as h
import pytest
import torch
import torch.multiprocessing as mp

import batchpilot
from batchpilot.controllers import Goodput, NoiseScale, ThresholdRules, VarianceRule
from batchpilot.engine.guard import PATIENCE, SpikeRule

REPO = Path(__file__).resolve().parents[2]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("grow_at, fail_from", [(5, 7), (10, 13)])
def test_a_rollback_equals_a_run_that_never_made_the_change(tmp_path, grow_at, fail_from):
    # Grows 8 -> 16 after step 5 (or 10); the step after step 7 (13) has a NaN loss: 3 (4) steps are discarded. (With
    # 96 samples an epoch has 12 steps of 8: the second case's snapshot is in epoch 0, its failure in epoch 1.)
    failing, model, controller = h.build(grow_at, log_path=tmp_path / "log.jsonl")
    kept = h.train(failing, model, 30, fail_from=fail_from)
    plain, plain_model, _ = h.build(10**9)  # never grows
    reference = h.train(plain, plain_model, 30, fail_from=fail_from)
    assert failing.rollbacks == 1 and controller.told == [(16, 8, grow_at)]
    assert kept == reference  # the same sizes and samples, step by step
    assert _equal(h.weights(model), h.weights(plain_model))  # bitwise
    for epoch in (0, 1):  # exact coverage: every sample once per epoch
        ids = sorted(i for size, e, idx in kept.values() if e == epoch for i in idx)
        assert ids == list(range(h.N))
    failing.close()
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    rollbacks = [r for r in lines if r.get("decision/rollback")]
    assert len(rollbacks) == 1
    r = rollbacks[0]
    assert (r["step"], r["rollback/from_size"], r["rollback/to_size"], r["rollback/steps_discarded"]) == (
        grow_at, 16, 8, fail_from - grow_at + 1)
    assert r["rollback/reason"] == "non-finite step" and r["rollback/losses"][-1] == "nan"
    assert sum(1 for x in lines if x["type"] == "step" and x["step"] == grow_at + 1) == 2  # the discarded line stays
    refusals = [x for x in lines if x["type"] == "decision" and "back-off" in str(x.get("note"))]
    assert len(refusals) == 1  # the controller asked every step; one line says it was refused


def test_the_back_off_doubles_and_refuses_the_failed_size_inside_the_cooldown(tmp_path):
    failing, model, controller = h.build(5, cooldown=4, log_path=tmp_path / "log.jsonl")
    kept = h.train(failing, model, 40, fail_from=5)  # every step at 16 fails at once
    failing.close()
    rollbacks = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines() if "decision/rollback" in x]
    # Tries after steps 5, 5+4, 9+8, 17+16: each fails at once and is rolled back to where it was tried.
    assert [r["step"] for r in rollbacks] == [5, 9, 17, 33]
    assert [r["rollback/until_step"] for r in rollbacks] == [9, 17, 33, 65]
    assert failing.rollbacks == 4 and [t[2] for t in controller.told] == [5, 9, 17, 33]
    assert all(size == h.SIZE for size, _, _ in kept.values())  # no step at 16 was kept
    assert failing.driver.backoff is not None and failing.driver.backoff.until_step == 65


@pytest.mark.distributed
def test_two_gloo_ranks_agree_on_the_rollback_and_end_equal(tmp_path):
    mp.spawn(h.gloo_worker, args=(2, str(tmp_path / "init"), str(tmp_path), 24), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["rollbacks"] == r1["rollbacks"] == 1 and r0["weights"] == r1["weights"]
    assert r0["told"] == [[16, 8, 5]] and r1["told"] == []  # only rank 0's controller is asked and told
    assert r0["size"] == r1["size"] == h.SIZE
    plain, plain_model, _ = h.build(10**9)  # one process that never grew, same global batches
    reference = h.train(plain, plain_model, 24, fail_from=7)
    for step, (size, _, idx) in reference.items():
        a, b = r0["kept"][str(step)], r1["kept"][str(step)]
        assert a[0] == b[0] == size and sorted(a[2] + b[2]) == idx
    for w_ref, w0 in zip(h.weights(plain_model), r0["weights"]):
        torch.testing.assert_close(torch.tensor(w0, dtype=torch.float64), w_ref, rtol=1e-9, atol=1e-11)


def _script(out: Path, steps: int, kill_at: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(Path(h.__file__)), str(out), str(steps)] + ([] if kill_at is None else [str(kill_at)])
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=240)


def test_a_kill_inside_the_watch_window_resumes_exactly(tmp_path):
    # Grows after step 5; the step after step 8 fails. Killed after step 7 (the last checkpoint is step 6's,
    # taken inside the watch window), the resumed run must roll back as the uninterrupted one does.
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir(), killed.mkdir()
    assert _script(whole, 20).returncode == 0
    done = _script(killed, 20, kill_at=7)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    resumed = _script(killed, 20)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = (json.loads(p.read_text()) for p in (whole / "run.json", killed / "resumed.json"))
    assert a["rollbacks"] == b["rollbacks"] == 1
    assert a["weights"] == b["weights"]
    assert {k: v for k, v in a["kept"].items() if int(k) > 5} == b["kept"]  # (it rolled back to step 5)


def test_a_state_taken_in_a_watch_window_round_trips(tmp_path):
    pilot, model, _ = h.build(5)
    h.train(pilot, model, 7, fail_from=8)  # the window (opened after step 5) is open
    state = pilot.state_dict()
    assert state["guard"]["watch"] is not None and state["guard"]["watch"]["tried_size"] == h.GROWN
    h.train(pilot, model, 20, fail_from=8)
    other, other_model, _ = h.build(5)
    with torch.no_grad():  # other weights: all must come from the state
        for p in other_model.parameters():
            p.add_(1.0)
    other.load_state_dict(state)
    h.train(other, other_model, 20, fail_from=8)
    assert pilot.rollbacks == other.rollbacks == 1
    assert _equal(h.weights(model), h.weights(other_model))
    after = pilot.state_dict()  # after the rollback: the count and the back-off survive a round trip
    third, _, _ = h.build(5)
    third.load_state_dict(after)
    assert third.rollbacks == 1 and third.driver.backoff == pilot.driver.backoff
    assert third.state_dict()["guard"] == after["guard"]


def test_a_loss_spike_under_the_linear_rule_is_rolled_back(tmp_path):
    # Least squares, Hessian 2I: SGD at batch 8 and LR 0.5 contracts the error's second moment (x0.63 per step);
    # the linear rule doubles the LR at 16, where it grows (x2.25 per step: 1 - 4 lr + lr^2 E[H_b^2], E[H_b^2] = 5.25
    # at 16 for 4-dim Gaussian inputs), so the loss grows geometrically. The guard sees the spike and goes back;
    # without it the run blows up.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 4, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64) + 0.1 * torch.randn(512, generator=g,
                                                                                      dtype=torch.float64)
    data = torch.utils.data.TensorDataset(x, y)

    def run(rollback: bool) -> tuple[batchpilot.Pilot, list[float]]:
        model = torch.nn.Linear(4, 1, bias=False).double()
        torch.nn.init.zeros_(model.weight)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        pilot = batchpilot.Pilot(model, opt, data, batch_size=8, controller=h.GrowOnce(30, 16), lr_rule="linear",
                                 rollback=rollback, skip_nonfinite=False, log_path=tmp_path / f"{rollback}.jsonl")
        losses = []
        for xb, yb in pilot.batches(max_steps=60):
            loss = ((model(xb).view(-1) - yb) ** 2).mean()
            losses.append(loss.item())
            pilot.backward(loss)
        pilot.close()
        return pilot, losses

    guarded, losses = run(True)
    records = [json.loads(x) for x in (tmp_path / "True.jsonl").read_text().splitlines() if "decision/rollback" in x]
    assert guarded.rollbacks == len(records) == 1 and records[0]["rollback/reason"] == "loss spike"
    assert records[0]["rollback/steps_discarded"] <= 10
    assert math.isfinite(losses[-1]) and losses[-1] < 0.1
    unguarded, wild = run(False)
    assert unguarded.rollbacks == 0 and not wild[-1] < 10  # diverged: 1000x the guarded loss or more (or NaN)


def test_the_spike_rule_ignores_noise_and_catches_a_jump():
    rng = torch.Generator().manual_seed(0)
    reference = (1.0 + 0.1 * torch.randn(50, generator=rng)).tolist()  # around 1
    rule = SpikeRule.from_losses(reference, 64, 2.0)
    assert rule is not None and 0.9 < rule.median < 1.1
    assert rule.threshold(64) == pytest.approx(2.0 * rule.median)  # the factor wins over this noise
    collapse = SpikeRule.from_losses(reference, 64, 2.0, start=2.3)  # the run started at 2.3 (chance level)
    assert collapse is not None and collapse.threshold(64) == pytest.approx((rule.median + 2.3) / 2)
    noisy = SpikeRule.from_losses([0.1, 0.5, 0.05, 0.9, 0.2, 0.02, 0.6], 32, 2.0)  # late, small batch
    assert noisy is not None and noisy.threshold(32) > 2.0 * noisy.median  # the noise wins
    assert noisy.threshold(8) > noisy.threshold(32)  # a smaller batch is noisier: a higher bar
    assert noisy.threshold(256) == noisy.threshold(32)  # a larger one keeps the reference's bar
    assert SpikeRule.from_losses([1.0, float("nan"), 2.0], 64, 2.0) is None  # too few to judge


@pytest.mark.parametrize("bump_steps, rolled_back", [(3, False), (None, True)])
def test_a_short_bump_is_kept_and_a_sustained_rise_is_rolled_back(tmp_path, bump_steps, rolled_back):
    pilot, model, _ = h.build(10, log_path=tmp_path / "log.jsonl")
    for x, y in pilot.batches(max_steps=40):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        after = pilot.step - 10  # steps since the change (while at the grown size)
        if pilot.micro_batch.global_size == h.GROWN and after >= 2 and (bump_steps is None or after < 2 + bump_steps):
            loss = loss * 5.0  # finite: only the spike rule can see it
        pilot.backward(loss)
    pilot.close()
    records = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines() if "decision/rollback" in x]
    assert pilot.rollbacks == len(records) == int(rolled_back)
    if rolled_back:  # judged once 7 steps were watched: 2 fine, 5 high
        assert records[0]["rollback/reason"] == "loss spike"
        assert records[0]["rollback/steps_discarded"] == PATIENCE


@pytest.mark.parametrize("controller, on", [(NoiseScale(), True), (Goodput(), True), (VarianceRule(), True),
                                            (ThresholdRules(), True), (None, False),
                                            (lambda step, size: size, False)])
def test_rollback_is_on_by_default_for_adaptive_controllers_only(controller, on):
    data, model = h.make_problem()
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=8,
                             controller=controller)
    assert pilot._guard.enabled is on
    forced = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=8,
                              controller=controller, rollback=not on)
    assert forced._guard.enabled is not on


def test_noise_scale_and_goodput_default_to_adascale_and_other_controllers_to_none():
    data, model = h.make_problem()

    def rule(controller, **kw):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return batchpilot.Pilot(model, opt, data, batch_size=8, controller=controller, **kw).config.lr.lr_rule

    assert rule(NoiseScale()) == rule(Goodput()) == "adascale"
    assert rule(VarianceRule()) == "linear-then-sqrt"
    assert rule(None) == rule(ThresholdRules()) == "none"
    assert rule(Goodput(), lr_rule="linear") == "linear"  # an explicit rule wins


@pytest.mark.parametrize("settings, message", [
    ({"rollback": "yes"}, "rollback must be None"),
    ({"rollback_window": 0}, "rollback_window must be an int >= 1"),
    ({"rollback_cooldown": 2.5}, "rollback_cooldown must be an int >= 1"),
    ({"rollback_spike": 1.0}, "rollback_spike must be a finite number > 1"),
    ({"rollback_spike": float("nan")}, "rollback_spike must be a finite number > 1"),
])
def test_bad_rollback_settings_get_a_clear_error(settings, message):
    data, model = h.make_problem()
    with pytest.raises(ValueError, match=message):
        batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=8, **settings)


def test_the_back_off_refuses_the_failed_direction_only_and_keeps_the_tighter_bound():
    from batchpilot.engine.driver import BackOff

    grew = BackOff(failed_size=512, restored_size=256, until_step=100)
    assert grew.refuses(512, 50) and grew.refuses(1024, 50) and not grew.refuses(384, 50)
    assert not grew.refuses(128, 50) and not grew.refuses(1024, 100)  # shrinking is free; the cooldown ends
    shrank = BackOff(failed_size=64, restored_size=256, until_step=100)
    assert shrank.refuses(64, 0) and shrank.refuses(32, 0) and not shrank.refuses(128, 0)
    pilot, _, _ = h.build(5, cooldown=10)
    driver = pilot.driver
    assert driver.back_off(512, 256, 10).until_step == 10  # first rollback: the cooldown itself
    assert driver.back_off(1024, 256, 10) == BackOff(512, 256, 20)  # doubled; the tighter failed size stays
    assert driver.rollback_failures == 2
