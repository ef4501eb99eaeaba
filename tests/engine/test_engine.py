"""The Pilot engine in one process: exact gradients, decisions, LR coupling, AMP, clipping, errors."""

from __future__ import annotations

import collections
import json
import math

import pytest
import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import Constant, InvalidDecisionError, NoiseScale, Schedule


def make_problem(n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()
    return TensorDataset(x.double(), y), model


def full_batch_grads(model, ds, indices):
    model.zero_grad()
    x, y = ds.tensors[0][indices], ds.tensors[1][indices]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("micro", [None, 7, 10, 32])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_accumulated_gradient_equals_full_batch_gradient(micro, reduction):
    ds, model = make_problem()
    reference = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=33, max_micro_batch_size=micro, loss_reduction=reduction, seed=3)
    seen, accum = [], []
    for x, y in pilot.batches(max_steps=1):
        seen.append(pilot.micro_batch.indices.copy())
        accum.append(pilot.micro_batch.accumulation_steps)
        loss = torch.nn.functional.cross_entropy(model(x), y, reduction=reduction)
        pilot.backward(loss)
    indices = torch.from_numpy(torch.cat([torch.from_numpy(s) for s in seen]).numpy())
    assert len(indices) == 33
    assert accum[0] == (1 if micro is None else math.ceil(33 / micro))
    # Rebuild the pre-step weights and compare one SGD step (lr=1) with the full-batch gradient step.
    ref_model = make_problem()[1]
    with torch.no_grad():
        for p, r in zip(ref_model.parameters(), reference):
            p.copy_(r)
    grads = full_batch_grads(ref_model, ds, indices)
    for p, r, g in zip(model.parameters(), reference, grads):
        torch.testing.assert_close(p.detach(), r - g, rtol=1e-12, atol=1e-12)


def test_uneven_micro_batches_cover_the_step_exactly():
    ds, model = make_problem(50)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=23, max_micro_batch_size=5, shuffle=False)
    sizes = []
    for x, y in pilot.batches(max_steps=1):
        sizes.append(len(x))
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert sizes == [5, 5, 5, 4, 4]  # ceil(23/5) = 5 micro-batches, near-equal


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


def test_reduce_lr_on_plateau_is_refused_with_the_way_to_use_it():
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="ReduceLROnPlateau.*callback"):
        batchpilot.Pilot(model, opt, ds, batch_size=8, lr_schedulers=[torch.optim.lr_scheduler.ReduceLROnPlateau(opt)])


def test_nonfinite_loss_skips_the_step_and_keeps_weights(tmp_path):
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=8, log_path=tmp_path / "l.jsonl")
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in pilot.batches(max_steps=1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        pilot.backward(loss * float("nan"))
    assert pilot.skipped_steps == 1 and pilot.step == 1
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    pilot.close()
    events = [r for r in batchpilot.read_log(tmp_path / "l.jsonl") if r["type"] == "event"]
    assert events and events[0]["event"] == "skipped_step"


def test_sum_of_squares_is_the_same_on_the_one_copy_path():
    from batchpilot.clipping import _stacked_sum_of_squares, grad_norm, sum_of_squares

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.randn(2, 2, 2, generator=g)]
    want = sum(float((t.double() ** 2).sum()) for t in tensors)
    # The accelerator path (norms summed on the device, one copy) and the CPU path agree.
    assert sum_of_squares(tensors) == pytest.approx(want, rel=1e-6)
    assert float(_stacked_sum_of_squares(torch._foreach_norm(tensors))) == pytest.approx(want, rel=1e-6)
    assert sum_of_squares([]) == 0.0
    bad = tensors + [torch.tensor([float("inf")])]
    assert math.isinf(sum_of_squares(bad)) and math.isinf(float(_stacked_sum_of_squares(torch._foreach_norm(bad))))
    assert sum_of_squares(tensors, lazy=True) == sum_of_squares(tensors)  # on CPU always a float
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    assert grad_norm(model.parameters()) == pytest.approx(math.sqrt(sum_of_squares([p.grad for p in model.parameters()])))


def test_batches_keep_their_structure_namedtuples_included():
    import collections

    Batch = collections.namedtuple("Batch", "x y")
    ds, model = make_problem()
    collate = lambda items: Batch(torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items]))  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=8, collate_fn=collate)
    for batch in pilot.batches(max_steps=1):
        assert type(batch) is Batch and batch.x.shape == (8, 6)
        pilot.backward(torch.nn.functional.cross_entropy(model(batch.x), batch.y))


def test_fixed_gradient_clipping_bounds_the_update():
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=32, grad_clip=1e-3)
    for x, y in pilot.batches(max_steps=1):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y) * 100)
    delta = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert float(delta) == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("amp, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_on_cpu_runs_and_learns(amp, dtype):
    x = torch.randn(256, 8)
    ds = TensorDataset(x, (x[:, 0] > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=32, amp=amp, noise_every=4, max_micro_batch_size=16)
    dtypes = set()
    for xb, yb in pilot.batches(epochs=5):
        out = model(xb)
        dtypes.add(out.dtype)
        pilot.backward(torch.nn.functional.cross_entropy(out.float(), yb))
    assert dtypes == {dtype}
    assert pilot.last_record["loss"] < 0.4
    assert math.isfinite(pilot.last_record["stats/noise_scale"])  # statistics of the unscaled gradients
    assert (pilot.scaler is not None) == (amp == "fp16")


def fp16_run(amp, steps: int, blow_up_at: int | None = None, pilot_kw: dict | None = None, inf_at: int | None = None):
    """A float64 model (autocast leaves float64 alone, so fp16 changes only the loss scaling) trained with
    accumulation, AdaScale and gradient statistics on every step; returns the pilot and the step records."""
    ds, model = make_problem(n=200)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=48, max_micro_batch_size=16, lr_rule="adascale",
                             base_batch_size=16, noise_every=1, amp=amp, seed=3, **(pilot_kw or {}))
    records = []
    pilot.add_callback(lambda p, record: records.append(dict(record)))
    for x, y in pilot.batches(max_steps=steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if pilot.step == inf_at:
            loss = loss + float("inf")  # a value without a gradient
        pilot.backward(loss * 1e305 if pilot.step == blow_up_at else loss)
    return pilot, records


def test_fp16_grad_scaler_is_exact_on_cpu_when_nothing_is_cast():
    # The loss is scaled by 2**16 and the gradients unscaled before clipping, statistics and AdaScale: all of
    # it must match the same run without a scaler bit for bit (powers of two are exact in floating point).
    plain, want = fp16_run(None, 12)
    scaled, got = fp16_run("fp16", 12)
    assert scaled.scaler is not None and scaled.scaler.get_scale() == 2.0**16 and plain.scaler is None
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), scaled.model.parameters()))
    for key in ("loss", "grad/norm", "stats/noise_scale", "stats/trace_cov", "lr/adascale_gain"):
        assert [r.get(key) for r in got] == [r.get(key) for r in want], key
    assert "stats/noise_scale" in got[-1] and scaled.adascale.progress == plain.adascale.progress


def test_fp16_overflow_skips_the_step_lowers_the_scale_and_resumes(tmp_path):
    pilot, records = fp16_run("fp16", 4, blow_up_at=2, pilot_kw={"log_path": tmp_path / "l.jsonl"})
    before, after = records[1], records[2]  # step 3 (index 2) overflowed when scaled
    assert after["train/skipped_steps"] == 1 and before["train/skipped_steps"] == 0
    assert "lr/adascale_gain" not in after and "lr/adascale_gain" in records[3]  # a skipped step makes no progress
    assert pilot.adascale.progress == pytest.approx(sum(r["lr/adascale_gain"] for r in records if "lr/adascale_gain" in r))
    assert pilot.scaler.get_scale() == 2.0**15  # halved once
    events = [r for r in batchpilot.read_log(tmp_path / "l.jsonl") if r["type"] == "event"]
    assert [(e["step"], e["event"], e["reason"], e["loss_scale"]) for e in events] == [
        (3, "skipped_step", "fp16 overflow", 2.0**15)]
    # The weights did not move on the skipped step: replaying without it gives the same model.
    ref, _ = fp16_run(None, 2)
    skipped_once, _ = fp16_run("fp16", 3, blow_up_at=2)
    assert all(torch.equal(a, b) for a, b in zip(ref.model.parameters(), skipped_once.model.parameters()))
    # The scaler's state travels in the checkpoint.
    path = skipped_once.save_checkpoint(tmp_path / "ck.pt")
    fresh, _ = fp16_run("fp16", 0)
    fresh.load_checkpoint(path)
    assert fresh.scaler.get_scale() == 2.0**15 and fresh.step == 3


def test_backward_misuse_is_reported():
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=8)
    with pytest.raises(RuntimeError, match="outside"):
        pilot.backward(torch.tensor(1.0, requires_grad=True))
    with pytest.raises(RuntimeError, match="was not called"):
        for _x, _y in pilot.batches(max_steps=1):
            pass
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=8)
    with pytest.raises(RuntimeError, match="twice"):
        for x, y in pilot.batches(max_steps=1):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            pilot.backward(loss)
            pilot.backward(loss)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=8)
    with pytest.raises(ValueError, match="scalar"):
        for x, y in pilot.batches(max_steps=1):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y, reduction="none"))
    with pytest.raises(ValueError, match="stop condition"):
        next(iter(batchpilot.Pilot(model, opt, ds, batch_size=8).batches()))


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
    state = batchpilot.checkpoint.load_checkpoint(path)
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


def test_a_restart_before_the_first_checkpoint_appends_after_a_cut_record(tmp_path):
    # A run killed before its first checkpoint left a half-written last record; the restart (nothing to
    # resume) appends to the same log. Its first record must not be glued onto the half one.
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
    assert steps == [1, 2, 3, 1, 2]  # two runs, one after the other (an existing log is appended to)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a log, no final newline")
    batchpilot.logs.AdjustmentLog(notes).close()
    assert notes.read_text() == "not a log, no final newline"  # a file that is no adjustment log is not cut


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


def test_trainable_parameters_the_optimizer_does_not_hold_get_fresh_gradients_every_step():
    # Fine-tuning the head with the body's requires_grad left on: the body's .grad must not pile up from step
    # to step in the gradient norm (so in clipping and the noise scale). Each step's norm must equal that of a
    # run whose optimizer holds the body at LR 0 (its zero_grad clears the body's gradient every step).
    def run(hold_body: bool, amp=None):
        ds, model = make_problem()
        body, head = model[0], model[2]
        groups = [{"params": head.parameters()}] + ([{"params": body.parameters(), "lr": 0.0}] if hold_body else [])
        pilot = batchpilot.Pilot(model, torch.optim.SGD(groups, lr=0.1), ds, batch_size=8, grad_clip=0.5, amp=amp)
        norms = []
        pilot.add_callback(lambda p, r: norms.append(r["grad/norm"]))
        for x, y in pilot.batches(max_steps=12):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        assert all(p.grad is None for p in model.parameters())
        return norms, [p.detach().clone() for p in model.parameters()]

    (norms_free, weights_free), (norms_held, weights_held) = run(False), run(True)
    assert norms_free == norms_held
    assert all(torch.equal(a, b) for a, b in zip(weights_free, weights_held))
    # fp16: the GradScaler unscales only the optimizer's parameters; the body's gradient must be unscaled too
    # (the float64 model is not cast, so the scaled run is exact).
    norms_fp16, weights_fp16 = run(False, amp="fp16")
    assert norms_fp16 == norms_held
    assert all(torch.equal(a, b) for a, b in zip(weights_fp16, weights_held))


def test_fp16_a_non_finite_loss_over_finite_gradients_is_skipped():
    # An inf added to the loss has no gradient: the GradScaler sees finite gradients and would step.
    pilot, records = fp16_run("fp16", 3, pilot_kw={}, inf_at=2)
    assert records[2]["train/skipped_steps"] == 1 and not math.isfinite(records[2]["loss"])
    assert all(math.isfinite(v) for v in pilot.driver.losses)  # controllers never see the inf
    reference, _ = fp16_run(None, 2)
    assert all(torch.equal(a, b) for a, b in zip(reference.model.parameters(), pilot.model.parameters()))
    assert pilot.scaler.get_scale() == 2.0**16  # not an overflow of the scaled gradients: the scale stays


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


def test_gradients_left_over_before_training_do_not_reach_the_first_step():
    ds, model = make_problem()
    clean = [p.detach().clone() for p in model.parameters()]

    def train(dirty: bool):
        for p, c in zip(model.parameters(), clean):
            p.data.copy_(c)
            p.grad = torch.ones_like(p) if dirty else None  # e.g. the last step of an LR range test
        pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8, seed=1)
        for x, y in pilot.batches(max_steps=2):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False)))


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


def test_the_noise_statistics_follow_parameters_unfrozen_after_the_pilot_was_built():
    # The small batches' norms and the step's norm must cover the same parameters: with the body frozen when
    # the Pilot is built and unfrozen before the loop, the statistics are those of a run never frozen (they
    # used to mix a head-only small norm with a whole-model big norm: tr(Sigma) < 0, B_simple 0).
    def run(freeze_first):
        ds, model = make_problem()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if freeze_first:
            model[0].requires_grad_(False)
        pilot = batchpilot.Pilot(model, optimizer, ds, batch_size=16, noise_every=1, progress=False)
        model[0].requires_grad_(True)
        records = []
        pilot.add_callback(lambda p, record: records.append(record))
        for x, y in pilot.batches(max_steps=6):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        return [{k: v for k, v in r.items() if k.startswith("stats/")} for r in records]

    unfrozen, never_frozen = run(True), run(False)
    assert unfrozen[-1]["stats/trace_cov"] > 0 and unfrozen[-1]["stats/noise_scale"] > 0
    assert unfrozen == never_frozen


def test_a_tensor_lr_is_logged_as_a_number_and_adascale_does_not_compound_it():
    # The step record read the param group's LR tensor itself: under AdaScale "lr *= gain" multiplied the
    # optimizer's LR in place every step, and under any rule the record held a tensor changed afterwards.
    for rule, base in (("adascale", 16), ("linear", 16)):
        ds, model = make_problem()
        lr = torch.tensor(0.01, dtype=torch.float64)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        pilot = batchpilot.Pilot(model, optimizer, ds, batch_size=64, base_batch_size=base, lr_rule=rule,
                                 progress=False)
        logged = []
        pilot.add_callback(lambda p, record, logged=logged: logged.append(record["lr"]))
        for x, y in pilot.batches(max_steps=8):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        assert optimizer.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.01, rel=1e-12), rule
        assert all(type(v) is float for v in logged), rule
        if rule == "linear":
            assert logged == pytest.approx([0.04, 0.02] * 4)  # the LR the steps ran with (64 or the 32 left, / 16)


def test_parameters_unfrozen_during_training_are_measured_from_then_on():
    # Progressive unfreezing: the body is frozen when the Pilot is built and unfrozen (and given to the
    # optimizer) by a callback after step 4. Each step's grad/norm must cover every gradient the optimizer
    # steps with (the engine reduces, clips and measures the same list; under DDP a missing parameter was
    # never all-reduced).
    ds, model = make_problem()
    body, head = model[0], model[2]
    body.requires_grad_(False)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, optimizer, ds, batch_size=8)
    norms, recorded = [], []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: norms.append(float(torch.linalg.vector_norm(
        torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))))

    def callback(p, record):
        recorded.append(record["grad/norm"])
        if p.step == 4:
            body.requires_grad_(True)
            optimizer.add_param_group({"params": body.parameters()})

    pilot.add_callback(callback)
    for x, y in pilot.batches(max_steps=8):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert recorded == pytest.approx(norms, rel=1e-12)
    assert all(p.grad is None for p in model.parameters())


def test_an_unknown_lr_rule_names_every_rule_pilot_accepts():
    ds, model = make_problem()
    with pytest.raises(ValueError, match="unknown lr_rule 'adaScale'; use one of 'none', .*'adascale' or a callable"):
        batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8, lr_rule="adaScale")


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
