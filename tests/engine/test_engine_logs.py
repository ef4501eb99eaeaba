"""What a Pilot writes: the adjustment log (resumed, replaced, non-finite values), TensorBoard, the progress
bar and the dropped tail of a drop_last epoch."""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import make_problem

import batchpilot


def test_tensorboard_and_progress_bar(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ds, model = make_problem(64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=8, controller=lambda s, b: 16, tensorboard_dir=tmp_path,
                             progress=True)
    for x, y in pilot.batches(epochs=2):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    pilot.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    sizes = events.Scalars("batch/global_size")
    # epoch 0: 8 + 3 * 16, then the 8 samples left; epoch 1: 4 * 16
    assert [e.value for e in sizes] == [8.0, 16.0, 16.0, 16.0, 8.0, 16.0, 16.0, 16.0, 16.0]
    assert [e.step for e in sizes][:3] == [8, 24, 40]  # x axis: samples_seen
    assert "loss" in events.Tags()["scalars"]
    err = capsys.readouterr().err
    assert "sample" in err and "B=16" in err  # the tqdm bar: samples, with the batch size in its postfix


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def pilot_for(model):
        return batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8,
                                tensorboard_dir=tmp_path / "tb", checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2)

    ds, model = make_problem(64)
    first = pilot_for(model)
    for x, y in first.batches(max_steps=5):  # a crash after step 5: steps 3-5 are redone from step 2's checkpoint
        first.backward(torch.nn.functional.cross_entropy(model(x), y))
    first.close()
    _, model = make_problem(64)
    resumed = pilot_for(model)
    assert resumed.load_checkpoint(tmp_path / "ckpt" / "step-000000002.pt") is not None
    for x, y in resumed.batches(max_steps=6):
        resumed.backward(torch.nn.functional.cross_entropy(model(x), y))
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [8, 16, 24, 32, 40, 48]


def test_drop_last_reports_the_dropped_tail(tmp_path):
    ds, model = make_problem(50)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=16, drop_last=True, log_path=tmp_path / "log.jsonl")
    seen = 0
    for x, y in pilot.batches(epochs=2):
        seen += len(x)
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    # 3 x 16 per epoch, 2 left each time; training stops at epoch 1's last full step. Its tail is dropped only
    # when a next step starts (a size small enough for it could still take it), which keeps the position in
    # memory and in a checkpoint saved at that step the same.
    assert seen == 96 and pilot.epoch == 2 and pilot.coverage == 0.0 and pilot.loader.sampler.dropped_samples == 2
    for x, y in pilot.batches(epochs=3):  # goes on: epoch 1's tail is dropped as the loop starts
        seen += len(x)
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    pilot.close()
    assert seen == 144 and pilot.loader.sampler.dropped_samples == 4
    events = [r for r in batchpilot.read_log(tmp_path / "log.jsonl") if r["type"] == "event"]
    assert [(e["event"], e["samples"], e["epoch"]) for e in events] == [("dropped_last", 2, 0), ("dropped_last", 2, 1)]


# ------------------------------------------------------------------ found by probing as a user (second round)
def test_a_drop_last_run_stopped_at_an_epoch_end_does_not_train_into_the_next_epoch():
    ds, model = make_problem(n=10)
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=4, drop_last=True)
    for x, y in pilot.batches(max_steps=2):  # 4 + 4 samples; the last 2 are a tail to drop
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert pilot.epoch == 1 and pilot.coverage == 0.0
    for x, y in pilot.batches(epochs=1):  # epoch 0 is done: nothing to train (it used to train step 3)
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert pilot.step == 2


def test_resuming_into_a_fresh_log_works_and_a_replaced_log_is_refused_before_loading(tmp_path):
    def pilot_for(log):
        ds, model = make_problem()
        return batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8,
                                checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, log_path=log)

    first = pilot_for(tmp_path / "run1.jsonl")
    for x, y in first.batches(max_steps=4):
        first.backward(torch.nn.functional.cross_entropy(first._module(x), y))
    first.close()
    fresh = pilot_for(tmp_path / "run2.jsonl")  # a log_path that does not exist yet: logging starts anew
    assert fresh.load_checkpoint(tmp_path / "ckpt") is not None and fresh.step == 4
    fresh.close()
    (tmp_path / "short.jsonl").write_text('{"type": "step"}\n')  # something else, shorter than the checkpoint's
    other = pilot_for(tmp_path / "short.jsonl")
    before = [p.detach().clone() for p in other._module.parameters()]
    with pytest.raises(batchpilot.CheckpointError, match="was it replaced"):
        other.load_checkpoint(tmp_path / "ckpt" / "step-000000004.pt")
    assert other.step == 0 and all(torch.equal(a, p) for a, p in zip(before, other._module.parameters()))
    other.close()


def test_a_restart_before_the_first_checkpoint_starts_a_fresh_log_after_a_cut_record(tmp_path):
    # A run killed before its first checkpoint left a half-written last record; the restart (nothing to
    # resume) cuts it, then moves that run's log aside to log.1.jsonl and logs anew (issue 20).
    log = tmp_path / "log.jsonl"
    ds, model = make_problem()
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8, log_path=log)
    for x, y in pilot.batches(max_steps=3):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    pilot.close()
    whole = log.read_bytes()
    log.write_bytes(whole + whole.splitlines(keepends=True)[-1][:25])  # a record cut off by the kill
    ds, model = make_problem()
    again = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8, log_path=log)
    assert log.read_bytes() == whole  # the half record is gone, the whole ones are kept
    for x, y in again.batches(max_steps=2):
        again.backward(torch.nn.functional.cross_entropy(model(x), y))
    again.close()
    steps = [r["step"] for r in batchpilot.read_log(log) if r["type"] == "step"]
    assert steps == [1, 2]  # a fresh log (it was [1, 2, 3, 1, 2]: two runs in one file)
    assert [r["step"] for r in batchpilot.read_log(tmp_path / "log.1.jsonl") if r["type"] == "step"] == [1, 2, 3]
    notes = tmp_path / "notes.txt"
    notes.write_text("not a log, no final newline")
    batchpilot.logs.AdjustmentLog(notes).close()
    assert notes.read_text() == "not a log, no final newline"  # a file that is no adjustment log is not cut


def test_the_log_writes_non_finite_values_as_strings_also_when_nested(tmp_path):
    # A decision's "inputs" carry the step's loss and grad/norm, NaN/inf on a skipped or overflowing step:
    # json.dumps wrote them as NaN/Infinity, which strict JSON readers (jq, JSON.parse) refuse.
    import json as jsonlib

    path = tmp_path / "log.jsonl"
    log = batchpilot.logs.AdjustmentLog(path)
    log.write("decision", {"step": 3, "inputs": {"loss": float("nan"), "grad/norm": float("inf")},
                           "sizes": [1.0, float("-inf")]})
    log.close()
    line = path.read_text().strip()
    record = jsonlib.loads(line, parse_constant=lambda name: pytest.fail(f"non-JSON constant {name} in {line}"))
    assert record["inputs"] == {"loss": "nan", "grad/norm": "inf"} and record["sizes"] == [1.0, "-inf"]
