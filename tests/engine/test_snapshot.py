"""engine/snapshot.py: a snapshot taken between steps and restored later puts back the weights, the optimizer
state, the data position and the RNG (the same next batches follow), and never truncates the log."""

from __future__ import annotations

import json

import torch
from _engine_helpers import make_problem

import batchpilot
from batchpilot.engine.snapshot import restore_snapshot, take_snapshot


def _pilot(tmp_path):
    data, model = make_problem(n=90)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    pilot = batchpilot.Pilot(model, opt, data, batch_size=8, controller=lambda step, size: (8, 13, 5, 21)[step % 4],
                             seed=3,
                             max_micro_batch_size=6, log_path=tmp_path / "log.jsonl")
    return pilot, model, opt


def _train(pilot, model, steps):
    seen = []
    for x, y in pilot.batches(max_steps=pilot.step + steps):
        seen.append(pilot.micro_batch.indices.tolist())
        dropped = torch.nn.functional.dropout(model(x), 0.2)  # draws from torch's RNG
        pilot.backward(torch.nn.functional.cross_entropy(dropped, y))
    return seen


def test_restore_puts_back_weights_optimizer_position_rng_and_the_same_next_batches(tmp_path):
    pilot, model, opt = _pilot(tmp_path)
    _train(pilot, model, 7)  # mid-epoch, with momentum in Adam's state
    snap = take_snapshot(pilot)
    assert snap["log_position"] is None
    weights = [p.detach().clone() for p in model.parameters()]
    adam = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    position, step = pilot.loader.position(), pilot.step
    first = _train(pilot, model, 6)
    after_first = [p.detach().clone() for p in model.parameters()]
    log_lines = (tmp_path / "log.jsonl").read_text().splitlines()

    restore_snapshot(pilot, snap)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    state = opt.state[next(iter(model.parameters()))]
    assert all(torch.equal(adam[k], state[k]) for k in adam)
    assert pilot.loader.position() == position and pilot.step == step
    second = _train(pilot, model, 6)
    assert second == first  # the same micro-batches, in the same order
    assert all(torch.equal(a, b) for a, b in zip(after_first, model.parameters()))  # dropout drew the same
    pilot.close()
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert lines[: len(log_lines)] == log_lines  # the discarded steps' lines stay in the log
    steps = [r["step"] for r in map(json.loads, lines) if "loss" in r and "old_size" not in r]
    assert steps.count(step + 1) == 2  # the step after the snapshot was logged twice: once discarded


def test_a_snapshot_stays_usable_after_a_restore(tmp_path):
    pilot, model, _ = _pilot(tmp_path)
    _train(pilot, model, 3)
    snap = take_snapshot(pilot)
    first = _train(pilot, model, 4)
    restore_snapshot(pilot, snap)
    second = _train(pilot, model, 4)
    restore_snapshot(pilot, snap)  # the first restore did not consume or change it
    assert _train(pilot, model, 4) == second == first
