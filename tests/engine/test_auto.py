"""The automatic mode, ``Pilot(..., batch_size="auto")``: the start probes run through the user's loop, keep exact
coverage and leave the run at its pre-probe state (bitwise the run a user would build by hand at the knee with the
found LR); the state round-trips; out of memory bounds the sweep; bad combinations are refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import Auto, Goodput
from batchpilot.lr.range_test import loss_fell, smoothed_losses, valley_lr


def problem(n: int = 240, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))
    return TensorDataset(x, y), model


def train(pilot: batchpilot.Pilot, model: torch.nn.Module, steps: int) -> dict:
    """Train; per training step its size and indices (probe micro-batches apart), the probes' micro-batches."""
    steps_seen: list[dict] = []
    probe_samples = 0
    current: list[int] = []
    for x, y in pilot.batches(max_steps=steps):
        micro = pilot.micro_batch
        if pilot.probing:
            probe_samples += micro.size
        else:
            current.extend(micro.indices.tolist())
            if micro.is_last:
                steps_seen.append({"epoch": micro.epoch, "size": micro.global_size, "indices": current})
                current = []
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    return {"steps": steps_seen, "probe_samples": probe_samples,
            "weights": [p.detach().clone() for p in model.parameters()]}


def auto_pilot(model, data, tmp_path=None, **kwargs) -> batchpilot.Pilot:
    controller = kwargs.pop("controller", Auto(16, 16, lr_steps=20))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    log = None if tmp_path is None else tmp_path / "log.jsonl"
    kwargs.setdefault("lr_rule", "auto")
    return batchpilot.Pilot(model, opt, data, batch_size="auto", controller=controller, log_path=log, **kwargs)


@pytest.mark.parametrize(("workers", "micro"), [(0, None), (2, 8)])
def test_probes_keep_exact_coverage_and_the_run_is_the_hand_built_run_at_the_knee(tmp_path, workers, micro):
    data, model = problem()
    pilot = auto_pilot(model, data, tmp_path, seed=3, num_workers=workers, max_micro_batch_size=micro)
    run = train(pilot, model, steps=45)  # 3 epochs of 240 at 16
    probe = pilot.controller.probe
    assert probe is not None and probe.start_size == 16 and probe.bound == "max_size"
    assert probe.lr is not None and probe.lr > 0 and probe.steps > 4
    assert run["probe_samples"] == 16 * probe.steps  # the loop saw the probe steps' micro-batches
    pilot.close()
    assert pilot.step == 45 and pilot.samples_seen == 45 * 16  # probe steps are no training steps
    per_epoch: dict[int, list[int]] = {}
    for step in run["steps"]:
        per_epoch.setdefault(step["epoch"], []).extend(step["indices"])
    assert sorted(per_epoch) == [0, 1, 2]
    for indices in per_epoch.values():
        assert sorted(indices) == list(range(len(data)))  # every sample once per epoch
    # The same run built by hand: the found LR at the knee, on AdaScale's curve anchored there.
    data2, model2 = problem()
    opt2 = torch.optim.SGD(model2.parameters(), lr=probe.lr, momentum=0.9)
    plain = batchpilot.Pilot(model2, opt2, data2, batch_size=16, controller=Goodput(16, 16), lr_rule="adascale",
                             seed=3, num_workers=workers, max_micro_batch_size=micro)
    ref = train(plain, model2, steps=45)
    assert [s["indices"] for s in ref["steps"]] == [s["indices"] for s in run["steps"]]
    for a, b in zip(run["weights"], ref["weights"]):
        assert torch.equal(a, b)
    assert pilot.optimizer.param_groups[0]["lr"] == probe.lr
    # The log holds the probe lines, then the run's steps.
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    phases = [r["phase"] for r in lines if r["type"] == "probe"]
    assert phases == ["throughput", "lr_range_test", "start"]
    assert [r["type"] for r in lines].index("step") > max(i for i, r in enumerate(lines) if r["type"] == "probe")


def test_the_sweep_stops_at_the_dataset_bound_and_anchors_the_lr_rule_at_the_knee():
    data, model = problem(n=512)
    pilot = auto_pilot(model, data, controller=Auto(8, 4096, min_gain=1.0001, min_epoch_steps=8, lr_steps=10,
                                                    timed_steps=1, warmup_steps=0))
    train(pilot, model, steps=1)
    probe = pilot.controller.probe
    sizes = [s for s, _ in probe.throughput]
    assert sizes[0] == 8 and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert sizes[-1] <= 512 // 8 and (probe.bound in ("knee", "dataset"))
    assert pilot.adascale.base_batch_size == probe.start_size == pilot.batch_size


def test_the_found_lr_can_be_anchored_at_the_top_of_the_curve():
    data, model = problem()
    pilot = auto_pilot(model, data, controller=Auto(16, 64, min_gain=100.0, lr_steps=10, lr_anchor="max_size"))
    train(pilot, model, steps=1)
    assert pilot.controller.probe.start_size == 16 and pilot.adascale.base_batch_size == 64
    assert pilot.optimizer.param_groups[0]["lr"] == pilot.controller.probe.lr


def test_the_default_lr_rule_is_auto_and_an_explicit_none_keeps_the_optimizers_lr():
    data, model = problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pilot = batchpilot.Pilot(model, opt, data, batch_size="auto", controller=Auto(16, 16, lr_steps=10))
    assert pilot.config.lr.lr_rule == "auto" and pilot.adascale is not None
    train(pilot, model, steps=1)
    assert pilot.controller.probe.lr is not None
    pilot = auto_pilot(model, data, lr_rule="none")
    train(pilot, model, steps=1)
    assert pilot.controller.probe.lr is None and pilot.optimizer.param_groups[0]["lr"] == 0.05


def test_an_explicit_lr_rule_skips_the_range_test_and_keeps_the_optimizers_lr():
    data, model = problem()
    pilot = auto_pilot(model, data, lr_rule="sqrt")
    train(pilot, model, steps=2)
    assert pilot.controller.probe.lr is None and pilot.optimizer.param_groups[0]["lr"] == 0.05
    assert pilot.coupling.base_batch_size == 16


def test_the_state_round_trips_and_a_resumed_run_does_not_probe_again():
    data, model = problem()
    # max_size == min_size: Goodput decides from measured step times, which a rerun does not repeat.
    pilot = auto_pilot(model, data, controller=Auto(16, 16, lr_steps=15, interval=5, min_measurements=0),
                       noise_every=2)
    train(pilot, model, steps=10)
    state = copy.deepcopy(pilot.state_dict())  # (a state_dict shares the live tensors)
    rest = train(pilot, model, steps=30)
    data2, model2 = problem()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)  # the state's weights replace these
    other = auto_pilot(model2, data2, controller=Auto(16, 16, lr_steps=15, interval=5, min_measurements=0),
                       noise_every=2)
    other.load_state_dict(state)
    assert other.controller.probe == pilot.controller.probe
    assert other.controller.state_dict() == state["controller"] and state["controller"]["goodput"]["period"] > 0
    assert other.adascale.base_batch_size == pilot.controller.probe.start_size
    resumed = train(other, model2, steps=30)
    assert resumed["probe_samples"] == 0
    assert [s["indices"] for s in resumed["steps"]] == [s["indices"] for s in rest["steps"]]
    for a, b in zip(rest["weights"], resumed["weights"]):
        assert torch.equal(a, b)


def test_a_loop_left_during_the_probes_leaves_the_pre_probe_state():
    data, model = problem()
    pilot = auto_pilot(model, data)
    before = copy.deepcopy(pilot.state_dict())
    for i, (x, y) in enumerate(pilot.batches(max_steps=5)):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        if i == 3:
            break
    after = pilot.state_dict()
    assert pilot.controller.probe is None and pilot.step == 0
    assert after["loader"] == before["loader"] and after["controller"] == before["controller"]
    for k, v in before["model"].items():
        assert torch.equal(v, after["model"][k])


class OutOfMemoryAbove(torch.nn.Module):
    """A model whose forward fails like an allocator when a micro-batch holds more than ``limit`` samples."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.net = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > self.limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.net(x)


def test_running_out_of_memory_ends_the_sweep_and_keeps_the_micro_batch_bound():
    data, _ = problem()
    torch.manual_seed(0)
    model = OutOfMemoryAbove(20)
    pilot = auto_pilot(model, data, controller=Auto(32, 128, lr_steps=10, min_epoch_steps=2), oom_recovery=True)
    for x, y in pilot.batches(max_steps=3):
        with pilot.micro_step():
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    probe = pilot.controller.probe
    assert probe.bound == "memory" and probe.throughput == () and probe.start_size == 32
    assert probe.max_micro_batch_size == 16 and pilot.loader.max_micro_batch_size == 16
    assert pilot.step == 3 and pilot.last_record["batch/accumulation_steps"] == 2


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"batch_size": "auto", "controller": Goodput()}, "batch_size='auto' starts the automatic mode"),
    ({"batch_size": 32, "controller": Auto()}, "the Auto controller needs batch_size='auto'"),
    ({"batch_size": 32, "lr_rule": "auto"}, "lr_rule='auto' belongs to the automatic mode"),
    ({"batch_size": "auto", "min_batch_size": 64}, "batch_size=32 lies outside"),
    ({"batch_size": "big"}, "batch_size"),
])
def test_bad_combinations_get_a_clear_error(kwargs, match):
    data, model = problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises((ValueError, TypeError), match=match):
        batchpilot.Pilot(model, opt, data, **kwargs)


def test_an_optimizer_without_an_lr_cannot_be_range_tested():
    data, model = problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pilot = batchpilot.Pilot(model, opt, data, batch_size="auto", controller=Auto(16, 16), lr_rule="auto")
    with pytest.raises(ValueError, match="relative to the optimizer's LR"):
        train(pilot, model, steps=1)
    assert pilot.controller.probe is None and pilot.step == 0


def test_the_range_tests_reading_valley_and_noise():
    lrs = [10 ** (-4 + i / 10) for i in range(50)]  # 1e-4 .. ~8
    curve = [2.3 - 0.3 * max(0.0, min(1.0, (i - 20) / 15)) + (0.9 if i > 44 else 0.0) for i in range(50)]
    smoothed = smoothed_losses(curve)
    assert loss_fell(curve, smoothed)
    assert lrs[30] < valley_lr(lrs, smoothed) < lrs[46]  # the middle of the flat bottom, below the blow-up
    g = torch.Generator().manual_seed(0)
    flat = [0.7 + 0.03 * float(torch.randn(1, generator=g)) for _ in range(50)]
    assert not loss_fell(flat, smoothed_losses(flat))  # noise only: the test says nothing about the LR


class CurveSteps:
    """A probe runner whose step ``i`` reports ``curve[i]`` (no training): the range test's reading alone."""

    count, memory_bound = 0, None

    def __init__(self, curve):
        self.curve = curve

    def run(self, size, steps, set_lr=None, stop=None):
        done = []
        for i in range(steps):
            set_lr(i)
            done.append((0.01, self.curve[i], size))
            if stop(done):
                break
        return done
        yield  # (a generator, as probe_core's phases expect)

    def keep_memory_bound(self):
        pass


@pytest.mark.parametrize("bottom, kept", [(6, False), (40, True)])
def test_a_valley_wider_than_max_valley_span_keeps_the_optimizers_lr(bottom, kept):
    """100 LRs over six decades (1e-3..1e3 x the optimizer's 0.01): the loss falls from step 30 to a flat bottom
    ``bottom`` steps wide, then blows up. With 6 the (smoothed) valley spans 3x in LR, so the test can tell; with 40
    it spans 270x, so it cannot."""
    from batchpilot.engine.probe_core import drive, range_test
    from batchpilot.integrations._auto import LocalContext

    curve = [3.0 - 2.0 * min(1.0, max(0.0, (i - 30) / 10)) + (5.0 if i > 40 + bottom else 0.0) for i in range(100)]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    lr, _ = drive(range_test(LocalContext(1000, opt), CurveSteps(curve), Auto(16, 16, lr_steps=100), 16))
    if kept:
        assert lr == 0.01
    else:
        assert 0.4 * 0.01 * 10 ** (-3 + 6 * 40 / 99) < lr < 0.4 * 0.01 * 10 ** (-3 + 6 * (41 + bottom) / 99)
    with pytest.raises(ValueError, match="max_valley_span"):
        Auto(max_valley_span=0.5)
