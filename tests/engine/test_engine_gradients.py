"""The Pilot's step in one process: accumulated gradients equal the full batch's, clipping, AMP and the
GradScaler, non-finite steps, misuse of backward(), and which parameters get gradients."""

from __future__ import annotations

import math

import pytest
import torch
from _engine_helpers import make_problem
from torch.utils.data import TensorDataset

import batchpilot


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
