"""LR coupling: the factor rules, composition with torch schedulers, sample-keyed schedules, state."""

from __future__ import annotations

import json
import math

import pytest
import torch
from harness import assert_state_roundtrip
from hypothesis import given
from hypothesis import strategies as st

from batchpilot.lr import LRCoupling, SampleLRSchedule, lr_factor, warmup_constant, warmup_cosine

# ----------------------------------------------------------------------------- lr_factor


@pytest.mark.parametrize(
    "rule, b, b0, knee, expected",
    [
        ("none", 1024, 32, 4096, 1.0),
        ("linear", 256, 32, 4096, 8.0),
        ("linear", 16, 32, 4096, 0.5),
        ("sqrt", 128, 32, 4096, 2.0),
        ("sqrt", 8, 32, 4096, 0.5),
        ("linear-then-sqrt", 2048, 256, 4096, 8.0),
        ("linear-then-sqrt", 4096, 256, 4096, 16.0),
        ("linear-then-sqrt", 16384, 256, 4096, 32.0),  # 16 * sqrt(16384 / 4096)
        ("linear-then-sqrt", 128, 256, 4096, 0.5),
        ("linear-then-sqrt", 400, 100, 200, 2 * math.sqrt(2)),  # knee 200: 2 * sqrt(2)
        ("linear-then-sqrt", 1024, 4096, 4096, 0.25),  # B0 == knee: linear below
        ("linear-then-sqrt", 16384, 4096, 4096, 2.0),  # ... sqrt above
        ("linear-then-sqrt", 32768, 8192, 4096, 2.0),  # B0 > knee: pure sqrt
        ("linear-then-sqrt", 2048, 8192, 4096, 0.5),
        (lambda ratio: ratio**0.25, 512, 32, 4096, 2.0),
    ],
)
def test_lr_factor_values(rule, b, b0, knee, expected):
    assert lr_factor(rule, b, b0, knee) == expected


@given(b0=st.integers(1, 4096), knee=st.integers(1, 8192))
def test_linear_then_sqrt_is_continuous_and_monotone_at_the_knee(b0, knee):
    below, at, above = (lr_factor("linear-then-sqrt", b, b0, knee) for b in (max(knee - 1, 1), knee, knee + 1))
    assert below <= at <= above
    assert above - at <= at / knee  # continuity: the step across the knee is at most one linear increment


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rule="cubic"), ValueError, r"unknown lr rule 'cubic'; use one of 'none', 'linear'"),
        (dict(rule=None), ValueError, "unknown lr rule None"),
        (dict(rule=lambda r: 0.0), ValueError, r"returned 0.0 for batch ratio 2.0; it must return a finite real"),
        (dict(rule=lambda r: math.nan), ValueError, "must return a finite real > 0"),
        (dict(rule=lambda r: "x"), ValueError, "returned 'x'"),
        (dict(rule=lambda r: True), ValueError, "returned True"),
        (dict(batch_size=0), ValueError, "batch_size must be >= 1, got 0"),
        (dict(base_batch_size=-4), ValueError, "base_batch_size must be >= 1"),
        (dict(batch_size=64.5), TypeError, "batch_size must be an int"),
        (dict(knee=0), ValueError, "knee must be >= 1"),
    ],
)
def test_lr_factor_errors(kwargs, error, match):
    args = dict(rule="linear", batch_size=64, base_batch_size=32, knee=4096) | kwargs
    with pytest.raises(error, match=match):
        lr_factor(**args)


# ----------------------------------------------------------------------------- LRCoupling

SIZES = [16, 16, 48, 64, 64, 128, 48, 256, 256, 16, 48, 48, 96, 80]
B0 = 16
SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.3),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-3),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + t)),
}
RULES = [("linear", 4096), ("sqrt", 4096), ("linear-then-sqrt", 64)]


def make_optimizer():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(2, dtype=torch.float64))
    # Two groups with different LRs: the factor applies to each.
    return torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.03}], lr=0.1)


def set_grads(opt):
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)


def reference_lrs(make_sched, steps):
    """The LRs each step uses without any coupling: what the scheduler alone produces."""
    opt = make_optimizer()
    sched = make_sched(opt)
    lrs = []
    for _ in range(steps):
        lrs.append([g["lr"] for g in opt.param_groups])
        set_grads(opt)
        opt.step()
        sched.step()
    return lrs


def coupled_step(opt, sched, coupling, next_size):
    """The engine's protocol for one step."""
    set_grads(opt)
    opt.step()
    coupling.unscale()
    sched.step()
    coupling.scale(next_size)


@pytest.mark.parametrize("rule, knee", RULES)
@pytest.mark.parametrize("sched_name", sorted(SCHEDULERS))
def test_coupling_composes_with_torch_schedulers(sched_name, rule, knee):
    make_sched = SCHEDULERS[sched_name]
    expected = reference_lrs(make_sched, len(SIZES))
    opt = make_optimizer()
    sched = make_sched(opt)
    reference_sched = make_sched(make_optimizer())
    coupling = LRCoupling(opt, B0, rule=rule, knee=knee)
    coupling.scale(SIZES[0])
    for t, size in enumerate(SIZES):
        factor = lr_factor(rule, size, B0, knee)
        used = [g["lr"] for g in opt.param_groups]
        assert used == [lr * factor for lr in expected[t]]  # exact: no drift from scale/unscale
        assert coupling.scaled_lrs() == used and coupling.factor == factor
        assert sched.get_last_lr() == reference_sched.get_last_lr()  # the scheduler never sees the factor
        before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
        coupled_step(opt, sched, coupling, SIZES[(t + 1) % len(SIZES)])
        reference_sched.optimizer.step()
        reference_sched.step()
        # Plain SGD with unit gradients: every parameter moved by exactly the LR in use.
        after = [p.detach() for g in opt.param_groups for p in g["params"]]
        moved = [float((b - a).mean()) for a, b in zip(after, before)]
        assert moved == pytest.approx(used, rel=1e-9)


@pytest.mark.parametrize("checkpoint_scaled", [True, False])
@pytest.mark.parametrize("sched_name", sorted(SCHEDULERS))
def test_coupling_state_round_trip_resumes_identically(sched_name, checkpoint_scaled):
    make_sched = SCHEDULERS[sched_name]

    def run(stop_at=None, resume_from=None):
        opt = make_optimizer()
        sched = make_sched(opt)
        coupling = LRCoupling(opt, B0, rule="linear")
        start = 0
        if resume_from is None:
            coupling.scale(SIZES[0])
        else:
            start, opt_state, sched_state, coupling_state = resume_from
            opt.load_state_dict(opt_state)
            sched.load_state_dict(sched_state)
            coupling.load_state_dict(json.loads(coupling_state))
            if not coupling.is_scaled:
                coupling.scale(SIZES[start])
        lrs = []
        for t in range(start, len(SIZES)):
            lrs.append([g["lr"] for g in opt.param_groups])
            set_grads(opt)
            opt.step()
            coupling.unscale()
            sched.step()
            if t + 1 == stop_at and not checkpoint_scaled:  # checkpoint between unscale and scale
                return lrs, (t + 1, opt.state_dict(), sched.state_dict(), json.dumps(coupling.state_dict()))
            coupling.scale(SIZES[(t + 1) % len(SIZES)])
            if t + 1 == stop_at:  # checkpoint where the engine does: after the decision
                return lrs, (t + 1, opt.state_dict(), sched.state_dict(), json.dumps(coupling.state_dict()))
        return lrs, None

    full, _ = run()
    head, checkpoint = run(stop_at=6)
    tail, _ = run(resume_from=checkpoint)
    assert head + tail == full
    state = json.loads(checkpoint[3])
    assert state["scaled"] is checkpoint_scaled and state["batch_size"] == (
        SIZES[6] if checkpoint_scaled else SIZES[5]
    )


@pytest.mark.parametrize("sched_name", sorted(SCHEDULERS))
def test_coupling_with_optimizer_and_scheduler_through_the_shared_harness(sched_name):
    """Optimizer + torch scheduler + coupling saved together between steps, as a checkpoint does."""
    make_sched = SCHEDULERS[sched_name]

    def make():
        opt = make_optimizer()
        sched = make_sched(opt)
        coupling = LRCoupling(opt, B0, rule="linear-then-sqrt", knee=64)
        coupling.scale(SIZES[0])
        return opt, sched, coupling

    def advance(trio, step):
        coupled_step(*trio, SIZES[(step + 1) % len(SIZES)])

    def observe(trio, step):
        opt, sched, coupling = trio
        lrs = []
        for t in range(step, step + 2 * len(SIZES)):
            lrs.append([g["lr"] for g in opt.param_groups] + [coupling.factor, sched.get_last_lr()])
            advance(trio, t)
        return lrs

    def get_state(trio):
        opt, sched, coupling = trio
        return {"opt": opt.state_dict(), "sched": sched.state_dict(), "coupling": coupling.state_dict()}

    def set_state(trio, state):
        opt, sched, coupling = trio
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        coupling.load_state_dict(state["coupling"])

    assert_state_roundtrip(
        make, advance, observe, steps=(0, 1, 5, 9), json_roundtrip=False, torch_roundtrip=True,
        get_state=get_state, set_state=set_state, advance_before_load=2,
    )


def test_unscale_divides_when_someone_else_changed_the_lr():
    opt = make_optimizer()
    coupling = LRCoupling(opt, 16, rule="linear")
    assert coupling.scale(32) == 2.0
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.06]
    opt.param_groups[0]["lr"] = 1.0  # e.g. a user callback
    coupling.unscale()
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.03]
    assert coupling.scaled_lrs() == [1.0, 0.06]  # unscaled: what the next step would use at B=32


def test_coupling_with_rule_none_leaves_lrs_alone():
    opt = make_optimizer()
    coupling = LRCoupling(opt, 16)
    coupling.scale(4096)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.03] and coupling.factor == 1.0


def test_coupling_updates_tensor_lrs_in_place():
    param = torch.nn.Parameter(torch.zeros(2))
    lr = torch.tensor(0.1, dtype=torch.float64)
    opt = torch.optim.SGD([param], lr=lr)
    tensor = opt.param_groups[0]["lr"]
    coupling = LRCoupling(opt, 8, rule="sqrt")
    coupling.scale(32)
    assert opt.param_groups[0]["lr"] is tensor and float(tensor) == 0.2
    coupling.unscale()
    assert opt.param_groups[0]["lr"] is tensor and float(tensor) == 0.1


def test_coupling_protocol_errors():
    opt = make_optimizer()
    coupling = LRCoupling(opt, 16, rule="linear")
    with pytest.raises(RuntimeError, match=r"unscale\(\) called while the LRs are not scaled"):
        coupling.unscale()
    coupling.scale(32)
    with pytest.raises(RuntimeError, match=r"scale\(64\) called while the LRs are already scaled by 2.0"):
        coupling.scale(64)
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        LRCoupling(object(), 16)
    with pytest.raises(ValueError, match="unknown lr rule 'cube'"):
        LRCoupling(opt, 16, rule="cube")
    with pytest.raises(ValueError, match="base_batch_size must be >= 1"):
        LRCoupling(opt, 0)
    # A cached factor is no way around the check: 64.0 and True equal the cached keys 64 and 1.
    coupling.unscale()
    assert coupling.factor_for(64) == 4.0 and coupling.factor_for(1) == 1 / 16
    for bad in (64.0, True):
        with pytest.raises(TypeError, match="batch_size must be an int"):
            coupling.factor_for(bad)


def test_coupling_state_dict_is_json_and_has_factor_and_flag():
    opt = make_optimizer()
    coupling = LRCoupling(opt, 16, rule="linear")
    assert coupling.state_dict()["factor"] == 1.0 and coupling.state_dict()["scaled"] is False
    coupling.scale(48)
    state = coupling.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state["factor"] == 3.0 and state["scaled"] is True and state["batch_size"] == 48
    assert (state["base_batch_size"], state["rule"]) == (16, "linear")


def test_coupling_state_of_another_anchor_or_rule_is_refused():
    # Resuming a run anchored at B0 = 16 with B0 = 48 would run at a third of the LR, silently.
    saved = LRCoupling(make_optimizer(), 16, rule="linear")
    saved.scale(48)
    state = saved.state_dict()
    for other, message in ((LRCoupling(make_optimizer(), 48, rule="linear"), "base_batch_size=16 there, 48 here"),
                           (LRCoupling(make_optimizer(), 16, rule="sqrt"), "rule='linear' there, 'sqrt' here")):
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(state)
    old = {k: v for k, v in state.items() if k not in ("base_batch_size", "rule", "knee")}
    LRCoupling(make_optimizer(), 48, rule="linear").load_state_dict(old)  # older checkpoints: nothing to check


def test_a_pilot_resumed_with_another_anchor_is_refused(tmp_path):
    import batchpilot

    def pilot(batch_size, **kw):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        return batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=batch_size,
                                lr_rule="linear", progress=False, **kw)

    run = pilot(8)
    for x, y in run.batches(max_steps=2):
        run.backward(torch.nn.functional.cross_entropy(run.model(x), y))
    path = run.save_checkpoint(tmp_path / "c.pt")
    with pytest.raises(batchpilot.CheckpointError, match="base_batch_size=8 there, 32 here"):
        pilot(32).load_checkpoint(path)  # B0 defaults to the first batch: 32 here, 8 in the run
    assert pilot(32, base_batch_size=8).load_checkpoint(path) == path


# ----------------------------------------------------------------------------- sample-keyed schedules


@pytest.mark.parametrize(
    "samples, expected",
    [
        (0, 0.01),  # (0 + 1) / 100
        (49, 0.5),
        (99, 1.0),
        (100, 1.0),  # cosine starts at 1
        (350, 0.8681980515339464),  # 0.1 + 0.9 * 0.5 * (1 + cos(pi / 4))
        (600, 0.55),  # halfway: 0.1 + 0.9 * 0.5
        (1100, 0.1),
        (5000, 0.1),
    ],
)
def test_warmup_cosine_values(samples, expected):
    assert warmup_cosine(100, 1100, min_ratio=0.1)(samples) == pytest.approx(expected, rel=1e-12, abs=0)


def test_warmup_cosine_without_warmup_and_warmup_constant():
    assert warmup_cosine(0, 100)(0) == 1.0
    assert warmup_cosine(0, 100)(50) == pytest.approx(0.5, rel=1e-12)
    assert warmup_cosine(0, 100)(100) == 0.0
    assert [warmup_constant(4)(s) for s in (0, 1, 3, 4, 10**9)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert warmup_constant(0)(0) == 1.0


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: warmup_cosine(100, 100), ValueError, "total_samples must be >= 101"),
        (lambda: warmup_cosine(-1, 100), ValueError, "warmup_samples must be >= 0"),
        (lambda: warmup_cosine(10, 100, min_ratio=1.5), ValueError, r"min_ratio must be a real in \[0, 1\]"),
        (lambda: warmup_cosine(10.0, 100), TypeError, "warmup_samples must be an int"),
        (lambda: warmup_constant(-5), ValueError, "warmup_samples must be >= 0"),
    ],
)
def test_warmup_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_sample_lr_schedule_sets_base_times_multiplier():
    opt = make_optimizer()
    sched = SampleLRSchedule(opt, warmup_constant(100))
    assert sched.base_lrs == [0.1, 0.03]
    assert sched.get_last_lr() == [0.1 * 0.01, 0.03 * 0.01]  # fn(0) applied at construction
    sched.step(49)
    assert [g["lr"] for g in opt.param_groups] == sched.get_last_lr() == [0.1 * 0.5, 0.03 * 0.5]
    sched.step(500)
    assert sched.get_last_lr() == [0.1, 0.03] and sched.samples_seen == 500


def test_sample_lr_schedule_uses_existing_initial_lr():
    opt = make_optimizer()
    torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5)  # sets initial_lr, lr = 0.5 * initial
    sched = SampleLRSchedule(opt, lambda s: 1.0)
    assert sched.base_lrs == [0.1, 0.03] and sched.get_last_lr() == [0.1, 0.03]


def test_sample_lr_schedule_errors():
    opt = make_optimizer()
    with pytest.raises(TypeError, match="needs a callable samples_seen -> multiplier"):
        SampleLRSchedule(opt, 3)
    with pytest.raises(ValueError, match=r"returned -1.0 at samples_seen=0; it must return a finite real >= 0"):
        SampleLRSchedule(opt, lambda s: -1.0)
    sched = SampleLRSchedule(opt, lambda s: 1.0 if s < 10 else math.inf)
    with pytest.raises(ValueError, match="returned inf at samples_seen=10"):
        sched.step(10)
    with pytest.raises(ValueError, match="samples_seen must be >= 0"):
        sched.step(-1)


def test_sample_lr_schedule_state_round_trip():
    fn = warmup_cosine(64, 1024, min_ratio=0.05)
    first = SampleLRSchedule(make_optimizer(), fn)
    first.step(300)
    assert first.state_dict() == {"base_lrs": [0.1, 0.03], "samples_seen": 300, "last_lr": first.get_last_lr()}

    def make():
        return SampleLRSchedule(make_optimizer(), fn)

    def make_restored():
        opt = make_optimizer()
        for group in opt.param_groups:
            group["lr"] = 9.0  # what the optimizer held at construction must not matter after loading
        return SampleLRSchedule(opt, fn)

    def advance(sched, step):
        sched.step(37 * (step + 1))

    def observe(sched, step):
        out = [sched.get_last_lr(), sched.samples_seen]
        for t in range(step, step + 40):
            advance(sched, t)
            out.append([g["lr"] for g in sched.optimizer.param_groups])
        return out

    assert_state_roundtrip(make, advance, observe, steps=(1, 2, 10, 30), make_restored=make_restored,
                           advance_before_load=3)


def test_sample_lr_schedule_composes_with_coupling():
    """Engine loop with a changing batch size: LR used = base * fn(samples_seen) * factor(B)."""
    fn = warmup_cosine(200, 2000)
    opt = make_optimizer()
    sched = SampleLRSchedule(opt, fn)
    coupling = LRCoupling(opt, 32, rule="sqrt")
    sizes = [32, 32, 128, 128, 512, 64, 64, 32, 512, 128]
    samples = 0
    coupling.scale(sizes[0])
    for t, size in enumerate(sizes):
        factor = math.sqrt(size / 32)
        assert [g["lr"] for g in opt.param_groups] == [0.1 * fn(samples) * factor, 0.03 * fn(samples) * factor]
        set_grads(opt)
        opt.step()
        samples += size
        coupling.unscale()
        sched.step(samples)
        coupling.scale(sizes[(t + 1) % len(sizes)])
