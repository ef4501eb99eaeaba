"""Sizes in one process: schedules and controllers, decisions checked at the boundary, set_batch_size(), the
LR that follows the size, and settings refused when the Pilot is built."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _engine_helpers import make_problem
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import Constant, InvalidDecisionError, NoiseScale, Schedule


def test_schedule_drives_sizes_and_every_epoch_is_covered_once():
    ds, model = make_problem(100)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sizes = iter([7, 30, 1, 64, 13, 100, 5] * 50)
    pilot = batchpilot.Pilot(
        model, opt, ds, batch_size=10, controller=lambda step, size: next(sizes), max_micro_batch_size=16
    )
    per_epoch: dict[int, list[int]] = {}
    step_sizes = []
    current: list[int] = []
    for x, y in pilot.batches(epochs=3):
        if pilot.micro_batch.micro_index == 0:
            epoch_of_step = pilot.epoch  # position of the step being consumed
        current.extend(pilot.micro_batch.indices.tolist())
        last = pilot.micro_batch.is_last
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        if last:
            per_epoch.setdefault(epoch_of_step, []).extend(current)
            step_sizes.append(len(current))
            current = []
    assert sorted(per_epoch) == [0, 1, 2]
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(100)), epoch
    assert step_sizes[0] == 10 and step_sizes[1:4] == [7, 30, 1]
    assert pilot.epoch == 3 and pilot.samples_seen == 300


def test_decisions_are_validated_at_the_boundary():
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (0, -4, float("nan"), 2.5, "64", True):
        pilot = batchpilot.Pilot(model, opt, ds, batch_size=8, controller=lambda s, b, bad=bad: bad)
        with pytest.raises(InvalidDecisionError, match="must be a whole number >= 1"):
            for x, y in pilot.batches(max_steps=3):
                pilot.backward(torch.nn.functional.cross_entropy(model(x), y))


def test_invalid_decision_can_be_kept_and_bounds_clamp(tmp_path, caplog):
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    decisions = iter([0, 500, 1, 12, 12])
    pilot = batchpilot.Pilot(
        model, opt, ds, batch_size=8, controller=lambda s, b: next(decisions), on_invalid="keep",
        min_batch_size=4, max_batch_size=32, log_path=tmp_path / "log.jsonl",
    )
    sizes = []
    for x, y in pilot.batches(max_steps=5):
        if pilot.micro_batch.micro_index == 0:
            sizes.append(pilot.micro_batch.global_size)
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    pilot.close()
    assert sizes == [8, 8, 32, 4, 12]
    records = batchpilot.read_log(tmp_path / "log.jsonl")
    notes = [r["note"] for r in records if r["type"] == "decision"]
    assert notes[0].startswith("invalid value 0") and "clamped 500 down to max_size=32" in notes[1]
    assert "clamped 1 up to min_size=4" in notes[2]
    assert [r["new_size"] for r in records if r["type"] == "decision"][:4] == [8, 32, 4, 12]


def test_lr_coupling_follows_the_batch_size_on_top_of_a_scheduler():
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sizes = iter([16, 64, 64, 8, 8, 8])
    pilot = batchpilot.Pilot(
        model, opt, ds, batch_size=16, controller=lambda s, b: next(sizes), lr_rule="sqrt", base_batch_size=16,
        lr_schedulers=[sched],
    )
    used = []
    for x, y in pilot.batches(max_steps=5):
        if pilot.micro_batch.micro_index == 0:
            used.append((pilot.micro_batch.global_size, opt.param_groups[0]["lr"]))
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    expected_sched = [0.1, 0.1, 0.05, 0.05, 0.025]
    for (size, lr), base in zip(used, expected_sched):
        assert lr == pytest.approx(base * math.sqrt(size / 16), rel=1e-12)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)  # unscaled again after the loop


def test_lr_factor_follows_the_samples_a_step_really_has():
    # 10 samples at a decided size of 8: every epoch's second step has 2 samples, and its LR is scaled for 2.
    ds, model = make_problem(n=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=8, base_batch_size=2, lr_rule="linear")
    used = []
    for x, y in pilot.batches(max_steps=4):
        if pilot.micro_batch.micro_index == 0:
            used.append((pilot.micro_batch.global_size, opt.param_groups[0]["lr"]))
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert used == [(8, pytest.approx(0.4)), (2, pytest.approx(0.1))] * 2
    assert pilot.last_record["batch/global_size"] == 2 and pilot.last_record["lr"] == pytest.approx(0.1)


def test_set_batch_size_between_steps_is_bounded_logged_and_rescales_the_lr(tmp_path):
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=8, lr_rule="linear", max_batch_size=32,
                             log_path=tmp_path / "log.jsonl")

    def grow(p, record):
        if p.step == 2:
            p.set_batch_size(500)  # from a callback: between steps, inside batches()

    pilot.add_callback(grow)
    used = []
    for x, y in pilot.batches(max_steps=4):
        if pilot.micro_batch.micro_index == 0:
            used.append((pilot.micro_batch.global_size, opt.param_groups[0]["lr"]))
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert used == [(8, pytest.approx(0.1)), (8, pytest.approx(0.1)), (32, pytest.approx(0.4)), (32, pytest.approx(0.4))]
    pilot.close()
    decisions = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    decisions = [d for d in decisions if d["type"] == "decision"]
    assert [(d["step"], d["old_size"], d["new_size"], d["controller"], d["note"]) for d in decisions] == [
        (2, 8, 32, "user", "clamped 500 down to max_size=32")]
    pilot.set_batch_size(1)  # outside the loop too
    assert pilot.batch_size == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_reduce_lr_on_plateau_is_refused_with_the_way_to_use_it():
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="ReduceLROnPlateau.*callback"):
        batchpilot.Pilot(model, opt, ds, batch_size=8, lr_schedulers=[torch.optim.lr_scheduler.ReduceLROnPlateau(opt)])


def test_constructor_reports_every_problem_at_once():
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as info:
        batchpilot.Pilot(
            model, opt, ds, batch_size=0, decide_every=0, min_batch_size=64, max_batch_size=8, amp="fp8",
            grad_clip=-1.0, controller=42, base_batch_size=0,
        )
    message = str(info.value)
    for fragment in ("batch_size must be >= 1", "decide_every", "min_batch_size=64 is larger than max_batch_size=8", "amp",
                     "grad_clip", "controller must be", "base_batch_size must be >= 1"):
        assert fragment in message
    with pytest.raises(ValueError, match="0 samples"):
        batchpilot.Pilot(model, opt, TensorDataset(torch.zeros(0, 6)), batch_size=4)
    # A controller class (the parentheses forgotten) is callable and passes the Protocol check: refused here,
    # not at the first step.
    with pytest.raises(ValueError, match=r"got the class NoiseScale; call it: controller=NoiseScale\(...\)"):
        batchpilot.Pilot(model, opt, ds, batch_size=8, controller=NoiseScale)
    with pytest.raises(ValueError, match="outside"):
        batchpilot.Pilot(model, opt, ds, batch_size=4, min_batch_size=8)


def test_a_model_with_nothing_to_train_or_an_optimizer_of_other_parameters_is_an_error():
    ds, model = make_problem()
    other = torch.nn.Linear(6, 2).double()
    with pytest.raises(ValueError, match="the optimizer holds none of the model's trainable parameters"):
        batchpilot.Pilot(model, torch.optim.SGD(other.parameters(), lr=0.1), ds, batch_size=8)
    # Some of the model's parameters (others frozen or extra ones) is a choice, not an error.
    batchpilot.Pilot(model, torch.optim.SGD(list(model[0].parameters()) + list(other.parameters()), lr=0.1), ds,
                     batch_size=8, progress=False)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8)


def test_drop_last_with_a_batch_larger_than_the_data_is_an_error():
    ds, model = make_problem(10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=16, drop_last=True)
    with pytest.raises(RuntimeError, match="exceeds the dataset size"):
        for x, y in pilot.batches(epochs=1):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))


def test_seed_003_scheduler_via_partial_and_constant_controller():
    from functools import partial

    from batchpilot.controllers import linear_increase_scheduler

    ds, model = make_problem(1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = partial(linear_increase_scheduler, interval=5, max_size=24, increment=4)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=4, controller=sched)
    assert isinstance(pilot.controller, Schedule)
    sizes = []
    for x, y in pilot.batches(max_steps=30):
        if pilot.micro_batch.micro_index == 0:
            sizes.append(pilot.micro_batch.global_size)
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    # decisions after steps 5, 10, 15, 20, 25 add 4 each (seed 003's rule), capped at 24
    assert sizes == [4] * 5 + [8] * 5 + [12] * 5 + [16] * 5 + [20] * 5 + [24] * 5
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=4, controller=Constant(16))
    for x, y in pilot.batches(max_steps=2):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert pilot.last_record["batch/global_size"] == 16


def test_a_param_group_added_in_a_callback_gets_the_lr_factor_from_its_first_step():
    ds, model = make_problem()
    body, head = model[0], model[2]
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=32, lr_rule="linear", base_batch_size=8)
    body.requires_grad_(False)
    seen = []

    def unfreeze(p, record):
        if record["step"] == 2:
            body.requires_grad_(True)
            opt.add_param_group({"params": body.parameters(), "lr": 0.05})

    pilot.add_callback(unfreeze)
    for x, y in pilot.batches(max_steps=4):
        seen.append([g["lr"] for g in opt.param_groups])  # the LRs this step trains with
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert seen == [[0.4], [0.4], [0.4, 0.2], [0.4, 0.2]]  # x4 (32 / 8) for both groups
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.05]  # the schedule's own LRs between loops


def test_an_unknown_lr_rule_names_every_rule_pilot_accepts():
    ds, model = make_problem()
    with pytest.raises(ValueError, match="unknown lr_rule 'adaScale'; use one of 'none', .*'adascale' or a callable"):
        batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8, lr_rule="adaScale")
