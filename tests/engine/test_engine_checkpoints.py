"""Checkpoints and resume in one process: exact resume, workers, damaged and foreign files, pruning, a step the
loop left unfinished, and what a resumed Pilot keeps of its own."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from _engine_helpers import make_problem
from torch.utils.data import TensorDataset

import batchpilot


def test_load_checkpoint_from_a_callback_rolls_back_with_the_right_lr(tmp_path):
    # Roll back to the last checkpoint when the loss spikes: the loop goes on from the loaded position with
    # the LR factor of its next step (it used to train at the unscaled LR, then fail in unscale()).
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=32, base_batch_size=8, lr_rule="linear",
                             checkpoint_dir=tmp_path, checkpoint_every=2)
    rolled = []

    def rollback(p, record):
        if p.step == 3 and not rolled:
            rolled.append(p.load_checkpoint(tmp_path))

    pilot.add_callback(rollback)
    used = []
    for x, y in pilot.batches(max_steps=5):
        if pilot.micro_batch.micro_index == 0:
            used.append((pilot.step, opt.param_groups[0]["lr"]))
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert rolled and rolled[0].name == "step-000000002.pt"
    assert [s for s, _ in used] == [0, 1, 2, 2, 3, 4]
    assert all(lr == pytest.approx(0.4) for _, lr in used)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def _train(num_workers: int, steps: int, tmp_path=None):
    torch.manual_seed(0)
    x = torch.randn(300, 5)
    ds = TensorDataset(x, (x.sum(1) > 0).long())
    model = torch.nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sizes = iter([9, 40, 3, 3, 77, 12, 50, 1, 31] * 20)
    pilot = batchpilot.Pilot(
        model, opt, ds, batch_size=16, controller=lambda s, b: next(sizes), max_micro_batch_size=8,
        num_workers=num_workers,
    )
    ids = []
    for xb, yb in pilot.batches(max_steps=steps):
        ids.extend(pilot.micro_batch.indices.tolist())
        pilot.backward(torch.nn.functional.cross_entropy(model(xb), yb))
    return ids, [p.detach().clone() for p in model.parameters()], pilot


def test_workers_give_the_same_samples_sizes_and_weights_as_no_workers():
    ids0, w0, _ = _train(0, 25)
    ids2, w2, pilot = _train(2, 25)
    assert ids0 == ids2
    for a, b in zip(w0, w2):
        assert torch.equal(a, b)
    assert pilot.loader.rewinds > 0  # prefetched micro-batches of the old size were really discarded


@pytest.mark.parametrize("num_workers", [0, 2])
def test_several_batches_calls_and_an_in_process_load_keep_data_and_indices_together(num_workers, tmp_path):
    """Each micro-batch's data is dataset[indices] however the loop is split: batches() called again (the
    workers had prefetched ahead), a checkpoint loaded into the live Pilot, a loop left mid-step. Before the
    fix a second batches() with workers paired the planned indices with data prefetched further ahead."""
    torch.manual_seed(0)
    x = torch.randn(300, 5)
    ds = TensorDataset(x, (x.sum(1) > 0).long())
    model = torch.nn.Linear(5, 2)
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ds, batch_size=16,
                             max_micro_batch_size=8, num_workers=num_workers, progress=False)
    ids = []

    def loop(limit, leave_mid_step=False):
        for xb, yb in pilot.batches(max_steps=limit):
            micro = pilot.micro_batch
            assert torch.equal(xb, x[torch.as_tensor(micro.indices.tolist())])
            ids.append((pilot.step, micro.indices.tolist()))
            pilot.backward(torch.nn.functional.cross_entropy(model(xb), yb))
            if leave_mid_step and pilot.step == limit - 1 and micro.micro_index == 0:
                break

    loop(5)
    pilot.save_checkpoint(tmp_path / "five.pt")
    loop(9)
    pilot.set_batch_size(24)
    loop(14, leave_mid_step=True)
    redo = len(ids)
    pilot.load_checkpoint(tmp_path / "five.pt")  # back to step 5, with workers alive and data prefetched
    loop(20)
    # After the load, steps 5-8 repeat the first pass exactly (the first pass changed the size at step 9).
    first = [i for i in ids[:redo] if 5 <= i[0] < 9]
    assert ids[redo : redo + len(first)] == first
    assert pilot.step == 20


def test_checkpoint_resume_in_process_is_exact(tmp_path):
    def build():
        torch.manual_seed(1)
        x = torch.randn(200, 5)
        ds = TensorDataset(x, (x[:, 0] > 0).long())
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.9)
        ctrl = batchpilot.controllers.MultiplicativeStep(8, 2.0, every_steps=5, max_size=64)
        pilot = batchpilot.Pilot(model, opt, ds, batch_size=8, controller=ctrl, lr_rule="sqrt", lr_schedulers=[sched],
                                 max_micro_batch_size=16, log_path=tmp_path / "log.jsonl")
        return model, pilot

    def run(model, pilot, steps, ids):
        for x, y in pilot.batches(max_steps=steps):
            ids.append(pilot.micro_batch.indices.tolist())
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))

    model, pilot = build()
    full_ids: list = []
    run(model, pilot, 30, full_ids)
    full_weights = [p.detach().clone() for p in model.parameters()]
    pilot.close()
    (tmp_path / "log.jsonl").unlink()

    model, pilot = build()
    part_ids: list = []
    run(model, pilot, 12, part_ids)
    pilot.save_checkpoint(tmp_path / "ck.pt")
    run(model, pilot, 14, part_ids)  # steps that the resumed run will redo; the log must forget them
    pilot.close()
    model, pilot = build()
    pilot.load_checkpoint(tmp_path / "ck.pt")
    assert pilot.step == 12
    after: list = []
    run(model, pilot, 30, after)
    pilot.close()
    n_before = len(full_ids) - len(after)
    assert part_ids[:n_before] + after == full_ids
    for a, b in zip(full_weights, model.parameters()):
        assert torch.equal(a, b.detach())
    steps = [r["step"] for r in batchpilot.read_log(tmp_path / "log.jsonl") if r["type"] == "step"]
    assert steps == list(range(1, 31))
    json.dumps(pilot.loader.state_dict())


def test_corrupt_and_foreign_checkpoints_give_clear_errors_and_older_ones_stay_usable(tmp_path):
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=8, checkpoint_dir=tmp_path, checkpoint_every=2)
    for x, y in pilot.batches(max_steps=4):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    files = batchpilot.checkpoint.list_checkpoints(tmp_path)
    assert [f.name for f in files] == ["step-000000002.pt", "step-000000004.pt"]
    data = files[-1].read_bytes()
    files[-1].write_bytes(data[: len(data) // 2])  # a truncated newest file
    with pytest.raises(batchpilot.CheckpointError, match="truncated, corrupt"):
        pilot.load_checkpoint(files[-1])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"garbage")
    with pytest.raises(batchpilot.CheckpointError, match="truncated, corrupt") as info:
        pilot.load_checkpoint(garbage)
    # torch's diagnosis, without its advice to load with weights_only=False (which runs code from the file)
    assert "refused it: Unsupported operand" in str(info.value) and "weights_only` set to `False" not in str(info.value)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    with pytest.raises(batchpilot.CheckpointError, match="not a batchpilot checkpoint"):
        pilot.load_checkpoint(foreign)
    with pytest.raises(batchpilot.CheckpointError, match="does not exist"):
        pilot.load_checkpoint(tmp_path / "nope.pt")
    with pytest.warns(UserWarning, match="(?s)skipped 1 newer checkpoint.*step-000000004.pt.*truncated"):
        assert pilot.load_checkpoint(tmp_path) == files[0]  # the folder falls back to the previous checkpoint
    with pytest.warns(UserWarning, match="skipped 1 newer"):
        assert pilot.step == 2 and batchpilot.latest_checkpoint(tmp_path) == files[0]
    # When every checkpoint is damaged the folder is no first start, even with missing_ok: each file is named.
    files[0].write_bytes(b"")
    for call in (lambda: pilot.load_checkpoint(tmp_path, missing_ok=True), lambda: batchpilot.latest_checkpoint(tmp_path)):
        with pytest.raises(batchpilot.CheckpointError, match=r"none of the 2 checkpoint\(s\).*cannot resume") as info:
            call()
        assert "step-000000002.pt" in str(info.value) and "step-000000004.pt" in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert pilot.load_checkpoint(empty, missing_ok=True) is None
    with pytest.raises(batchpilot.CheckpointError, match="no checkpoint in .*missing_ok=True"):
        pilot.load_checkpoint(empty)


def test_a_checkpoint_with_a_flipped_bit_is_refused_and_the_folder_falls_back(tmp_path):
    # torch.load does not check the zip's CRCs: one flipped bit in the pickle loaded step 2 as step 6.
    ds, model = make_problem()
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8,
                             checkpoint_dir=tmp_path, checkpoint_every=2)
    for x, y in pilot.batches(max_steps=4):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    older, newer = batchpilot.checkpoint.list_checkpoints(tmp_path)
    raw = bytearray(newer.read_bytes())
    at = raw.index(b"K\x04", raw.index(b"step"))  # the pickled int 4 right after the "step" key
    raw[at + 1] ^= 0x02  # 4 -> 6
    newer.write_bytes(bytes(raw))
    with pytest.raises(batchpilot.CheckpointError, match="step-000000004.pt' is corrupt: its part '.*data.pkl' fails"):
        pilot.load_checkpoint(newer)
    with pytest.warns(UserWarning, match="(?s)skipped 1 newer checkpoint.*step-000000004.pt.*CRC"):
        assert pilot.load_checkpoint(tmp_path) == older and pilot.step == 2


def test_pruning_keeps_the_checkpoint_just_written_and_leaves_later_steps_alone(tmp_path):
    from batchpilot.checkpoint import list_checkpoints

    def train(pilot, model, steps):
        for x, y in pilot.batches(max_steps=steps):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))

    ds, model = make_problem()
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8, progress=False,
                             checkpoint_dir=tmp_path, checkpoint_every=2, keep_checkpoints=1)
    train(pilot, model, 6)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000006.pt"]
    (tmp_path / "step-000000040.pt").write_bytes(b"damaged")  # a later step, of another (dead) run
    ds, model = make_problem()
    again = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8, progress=False,
                             checkpoint_dir=tmp_path, checkpoint_every=2, keep_checkpoints=1)
    with pytest.warns(UserWarning, match="skipped 1 newer"):
        again.load_checkpoint(tmp_path)
    with pytest.warns(UserWarning, match="later steps than this run has reached: step-000000040.pt"):
        train(again, model, 10)
    # keep_checkpoints=1 kept the file just written (it used to delete it, keeping the damaged step 40).
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000010.pt", "step-000000040.pt"]
    with pytest.warns(UserWarning, match="skipped 1 newer"):
        assert batchpilot.latest_checkpoint(tmp_path).name == "step-000000010.pt"


def test_a_checkpoint_of_another_run_is_refused_whole_and_changes_nothing(tmp_path):
    ds, model = make_problem()
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8, progress=False)
    for x, y in pilot.batches(max_steps=3):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    path = pilot.save_checkpoint(tmp_path / "run.pt")

    def fresh(n=96, width=16, optimizer=torch.optim.SGD, schedulers=0):
        ds2, net = make_problem(n)
        if width != 16:
            net[2] = torch.nn.Linear(width, 2).double()
            net[0] = torch.nn.Linear(6, width).double()
        opt = optimizer(net.parameters(), lr=0.1)
        scheds = [torch.optim.lr_scheduler.StepLR(opt, 10) for _ in range(schedulers)]
        return batchpilot.Pilot(net, opt, ds2, batch_size=4, progress=False, lr_schedulers=scheds), net

    cases = [
        (dict(width=8), r"the model differs \(other shapes: 0.weight \(16, 6\) vs \(8, 6\) here, 0.bias"),
        (dict(optimizer=torch.optim.Adam), "written with optimizer torch.optim.sgd.SGD, this Pilot has torch.optim.adam.Adam"),
        (dict(n=50), "the checkpoint has num_samples=96, this Pilot num_samples=50"),
        (dict(schedulers=1), "the checkpoint has 0 LR schedulers but this Pilot has 1"),
    ]
    for kwargs, message in cases:
        other, net = fresh(**kwargs)
        before = [p.detach().clone() for p in net.parameters()]
        position = other.loader.sampler.state_dict()
        with pytest.raises(batchpilot.CheckpointError, match=message) as info:
            other.load_checkpoint(path)
        assert "nothing was loaded" in str(info.value)
        assert other.step == 0 and other.samples_seen == 0 and other.batch_size == 4
        assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
        assert other.loader.sampler.state_dict() == position
    # Every problem at once, one per line.
    other, _ = fresh(n=50, optimizer=torch.optim.Adam)
    with pytest.raises(batchpilot.CheckpointError) as info:
        other.load_checkpoint(path)
    assert str(info.value).count("\n  - ") == 2
    # A model with other names (a renamed layer) is named too.
    ds3, net3 = make_problem()
    renamed = torch.nn.Sequential(collections.OrderedDict(
        [("inp", net3[0]), ("act", net3[1]), ("out", net3[2])]))
    third = batchpilot.Pilot(renamed, torch.optim.SGD(renamed.parameters(), lr=0.1), ds3, batch_size=8, progress=False)
    with pytest.raises(batchpilot.CheckpointError, match=r"missing inp.weight, inp.bias, out.weight and 1 more; "
                                                        r"unexpected 0.weight, 0.bias, 2.weight and 1 more"):
        third.load_checkpoint(path)
    # Another controller (or AdaScale with another B0): refused before the model or the position change.
    _, net4 = make_problem()
    before = [p.detach().clone() for p in net4.parameters()]
    saved = batchpilot.Pilot(net4, torch.optim.SGD(net4.parameters(), lr=0.1), make_problem()[0], batch_size=8,
                             progress=False, controller=batchpilot.controllers.ThresholdRules(min_size=4, max_size=64))
    ctrl_path = saved.save_checkpoint(tmp_path / "threshold.pt")
    ds5, net5 = make_problem()
    weights = [p.detach().clone() for p in net5.parameters()]
    other = batchpilot.Pilot(net5, torch.optim.SGD(net5.parameters(), lr=0.1), ds5, batch_size=4, progress=False,
                             controller=batchpilot.controllers.NoiseScale(min_size=4, max_size=64))
    with pytest.raises(batchpilot.CheckpointError, match="its controller state does not load into this Pilot's "
                                                         "NoiseScale .*saved by controller 'ThresholdRules'"):
        other.load_checkpoint(ctrl_path)
    assert other.step == 0 and other.batch_size == 4
    assert all(torch.equal(a, b) for a, b in zip(weights, net5.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before, net4.parameters()))
    adascale = dict(lr_rule="adascale", base_batch_size=8)
    ds6, net6 = make_problem()
    saved = batchpilot.Pilot(net6, torch.optim.SGD(net6.parameters(), lr=0.1), ds6, batch_size=8, progress=False,
                             **adascale)
    ada_path = saved.save_checkpoint(tmp_path / "adascale.pt")
    ds7, net7 = make_problem()
    other = batchpilot.Pilot(net7, torch.optim.SGD(net7.parameters(), lr=0.1), ds7, batch_size=8, progress=False,
                             lr_rule="adascale", base_batch_size=16)
    with pytest.raises(batchpilot.CheckpointError, match="its adascale state does not load.*base_batch_size=8"):
        other.load_checkpoint(ada_path)
    assert other.step == 0
    fresh_run, _ = fresh()  # the same run's shape loads
    assert fresh_run.load_checkpoint(path) == path and fresh_run.step == 3
    # Checkpoints from before the optimizer class was recorded still load.
    state = batchpilot.checkpoint.read_checkpoint(path)
    del state["pilot"]["optimizer_class"]
    older, _ = fresh()
    older.load_state_dict(state)
    assert older.step == 3


@pytest.mark.parametrize("leave, workers", [("break-after-first-micro", 0), ("break-after-last-micro", 0),
                                            ("break-after-last-micro", 2), ("exception", 0), ("checkpoint", 0)])
def test_leaving_the_loop_inside_a_step_drops_its_gradients_and_runs_it_again(leave, workers, tmp_path):
    """The step runs when the loop asks for the next micro-batch; leaving before (break, an exception in the
    loop body) must not leave partial gradients for the next batches() to count twice."""

    def build(num_workers):
        ds, model = make_problem()
        return model, batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ds,
                                       batch_size=12, max_micro_batch_size=4, progress=False, seed=2,
                                       num_workers=num_workers)

    def run(interrupt):
        model, pilot = build(workers if interrupt else 0)
        seen = []
        if interrupt:
            try:
                for x, y in pilot.batches(max_steps=6):
                    pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
                    micro = pilot.micro_batch
                    if pilot.step == 2 and micro.micro_index == (micro.accumulation_steps - 1
                                                                 if leave == "break-after-last-micro" else 0):
                        if leave == "exception":
                            raise KeyError("a bug in the loop body")
                        break
            except KeyError:
                pass
            assert pilot.step == 2 and all(p.grad is None for p in model.parameters())
            if leave == "checkpoint":  # leaving, saving and resuming in a new Pilot gives the same run
                pilot.save_checkpoint(tmp_path / "mid.pt")
                model, pilot = build(0)
                pilot.load_checkpoint(tmp_path / "mid.pt")
        for x, y in pilot.batches(max_steps=6):
            seen.append((pilot.step, pilot.micro_batch.indices.tolist()))
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        return [p.detach().clone() for p in model.parameters()], seen, pilot.samples_seen

    weights, seen, samples = run(False)
    weights2, seen2, samples2 = run(True)
    assert samples2 == samples == 72
    assert seen2 == [s for s in seen if s[0] >= 2]  # step 3 (index 2) runs again from its first micro-batch
    assert all(torch.equal(a, b) for a, b in zip(weights, weights2))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_rolling_back_from_a_callback_with_workers_keeps_training(tmp_path, num_workers):
    ds, model = make_problem(n=10)
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=5,
                             num_workers=num_workers, checkpoint_dir=tmp_path, checkpoint_every=1, keep_checkpoints=5)
    rolled = []

    def rollback(p, record):
        if p.step == 3 and not rolled:
            rolled.append(p.load_checkpoint(tmp_path / "step-000000001.pt"))

    pilot.add_callback(rollback)
    for x, y in pilot.batches(max_steps=6):  # it used to stop with a false "epoch produced no step" error
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert rolled and pilot.step == 6
    pilot.close()


def test_a_resumed_pilot_keeps_its_own_drop_last_and_the_smaller_micro_batch_bound(tmp_path, caplog):
    def pilot_for(**kwargs):
        ds, model = make_problem()
        return batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8,
                                checkpoint_dir=tmp_path, checkpoint_every=2, **kwargs)

    first = pilot_for(max_micro_batch_size=8)
    for x, y in first.batches(max_steps=2):
        first.backward(torch.nn.functional.cross_entropy(first._module(x), y))
    resumed = pilot_for(max_micro_batch_size=2, drop_last=True)  # after running out of memory, say
    with caplog.at_level("WARNING", logger="batchpilot"):
        resumed.load_checkpoint(tmp_path)
    assert resumed.loader.max_micro_batch_size == 2 and resumed.loader.sampler.drop_last is True
    assert "drop_last=False" in caplog.text and "max_micro_batch_size is 8" in caplog.text
    rows = []
    for x, y in resumed.batches(max_steps=3):
        rows.append(len(x))
        resumed.backward(torch.nn.functional.cross_entropy(resumed._module(x), y))
    assert rows == [2, 2, 2, 2]


def test_a_resumed_run_reports_the_loss_trend_the_uninterrupted_one_did(tmp_path):
    # The trend (a window of 50 losses) is refreshed every 10 steps; between refreshes the value reported,
    # and read by controllers, must survive a resume.
    def run(resume=False):
        ds, model = make_problem()
        pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8,
                                 checkpoint_dir=tmp_path, checkpoint_every=53)
        if resume:
            pilot.load_checkpoint(tmp_path / "step-000000053.pt")
        trends = {}
        pilot.add_callback(lambda p, r: trends.__setitem__(r["step"], r.get("stats/loss_trend")))
        for x, y in pilot.batches(max_steps=58):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        return trends

    full = run()
    resumed = run(resume=True)
    assert full[54] is not None and [resumed[s] for s in range(54, 59)] == [full[s] for s in range(54, 59)]


def test_a_half_written_checkpoint_of_a_killed_writer_is_removed(tmp_path):
    import os
    import subprocess
    import sys
    import time

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # its pid now belongs to no process
    orphan = tmp_path / f".step-000000009.pt.tmp-{done.pid}"
    orphan.write_bytes(b"half a checkpoint")
    os.utime(orphan, (time.time() - 120, time.time() - 120))  # unchanged for two minutes: not being written
    ds, model = make_problem()
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8,
                             checkpoint_dir=tmp_path, checkpoint_every=1, keep_checkpoints=1)
    for x, y in pilot.batches(max_steps=2):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000002.pt"]
