"""AdaptiveBatchSizeTrainer(batch_size_scheduler=Auto()): the start probes run with the trainer's compute_loss
before Trainer's loop, the run starts from the pre-probe weights at the knee with the found LR, the first epoch
covers every sample once, the probe result lives in the checkpoint (a resume does not probe again), and bad
combinations are refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import PointSet, Recorder
from _hf_helpers import collate_fn, quiet_args, record_steps
from transformers import TrainerCallback

from batchpilot.controllers import Auto
from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer


def small_auto() -> Auto:
    return Auto(8, 64, timed_steps=1, min_epoch_steps=4, lr_steps=40, interval=1000)


class WeightsAtStart(TrainerCallback):
    """The model's weights and the optimizer's LR when Trainer's loop starts (after batchpilot's probes)."""

    def __init__(self, trainer) -> None:
        self.trainer, self.weights, self.lr = trainer, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.weights = [p.detach().clone() for p in self.trainer.model.parameters()]
        self.lr = [g["lr"] for g in self.trainer.optimizer.param_groups]


def make(tmp_path, data, **overrides):
    model = Recorder()
    args = dict(per_device_train_batch_size=4, num_train_epochs=1, learning_rate=0.05, optim="sgd",
                lr_scheduler_type="constant", weight_decay=0.0)
    args.update(overrides)
    trainer = AdaptiveBatchSizeTrainer(batch_size_scheduler=small_auto(), model=model, train_dataset=data,
                                       data_collator=collate_fn, args=quiet_args(tmp_path, **args))
    return model, trainer


def test_auto_probes_then_trains_from_the_pre_probe_state_at_the_knee(tmp_path):
    data = PointSet(256)
    model, trainer = make(tmp_path, data)
    before = [p.detach().clone() for p in model.parameters()]
    start = WeightsAtStart(trainer)
    trainer.add_callback(start)
    steps = record_steps(trainer)
    trainer.train()

    run = trainer.batchpilot
    probe = run.probe
    assert probe is not None and probe.steps > 0 and probe.lr is not None and probe.lr > 0
    assert probe.start_size in [size for size, _ in probe.throughput]
    assert probe.bound in ("knee", "max_size", "dataset")
    phases = [r["phase"] for r in run.probe_records]
    assert phases[0] == "throughput" and "lr_range_test" in phases and phases[-1] == "start"
    # The probes ran forwards, but the loop starts from the weights before them, with the found LR.
    assert len(model.seen) > len(steps)
    for a, b in zip(before, start.weights):
        assert torch.equal(a, b)
    assert start.lr == [pytest.approx(probe.lr)] * len(start.lr) and probe.lr != 0.05  # the range test found one
    # The run starts at the knee, and its (only) epoch covers every sample exactly once.
    assert steps[0].global_size == probe.start_size
    seen = sorted(int(i) for s in steps for i in s.indices)
    assert seen == list(range(len(data)))
    assert trainer.state.global_step == len(steps)


def test_auto_resume_after_the_probes_does_not_probe_again(tmp_path):
    data = PointSet(256)

    def run(resume, out):
        model, trainer = make(out, data, save_strategy="steps", save_steps=3)
        steps = record_steps(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, steps, [p.detach().clone() for p in model.parameters()]

    full, full_steps, full_weights = run(None, tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert checkpoint.is_dir()
    resumed, resumed_steps, resumed_weights = run(str(checkpoint), tmp_path / "a")
    assert resumed.batchpilot.probe_records == []  # no probe ran
    assert resumed.batchpilot.probe == full.batchpilot.probe
    assert [(s.global_size, s.indices.tolist()) for s in resumed_steps] == \
        [(s.global_size, s.indices.tolist()) for s in full_steps[3:]]
    for a, b in zip(full_weights, resumed_weights):
        assert torch.equal(a, b)


@pytest.mark.parametrize("switch", ["auto", Auto()])
def test_auto_refuses_the_linear_rules(tmp_path, switch):
    for rule in ("linear", "linear-then-sqrt"):
        with pytest.raises(ValueError, match=f"lr_rule='{rule}' with batch_size_scheduler=Auto"):
            AdaptiveBatchSizeTrainer(batch_size_scheduler=switch, model=Recorder(), train_dataset=PointSet(16),
                                     data_collator=collate_fn, lr_rule=rule, args=quiet_args(tmp_path))


def test_auto_run_is_the_run_started_by_hand_at_the_knee_with_the_found_lr(tmp_path):
    """The probes leave no trace: the auto run trains the same steps as a constant-size run at the knee with
    the found LR from the same weights, to the same weights (to rounding: the second param group's LR is the
    first's scaled by the found ratio)."""
    data = PointSet(256)
    model, trainer = make(tmp_path / "a", data, gradient_accumulation_steps=2)
    steps = record_steps(trainer)
    trainer.train()
    probe = trainer.batchpilot.probe
    reference = Recorder()
    by_hand = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=None, model=reference, train_dataset=data, data_collator=collate_fn,
        args=quiet_args(tmp_path / "b", per_device_train_batch_size=probe.start_size // 2,
                        gradient_accumulation_steps=2, num_train_epochs=1, learning_rate=probe.lr, optim="sgd",
                        lr_scheduler_type="constant", weight_decay=0.0))
    reference_steps = record_steps(by_hand)
    by_hand.train()
    assert [(s.global_size, s.indices.tolist()) for s in steps] == \
        [(s.global_size, s.indices.tolist()) for s in reference_steps]
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_auto_with_a_warm_up_schedule_probes_at_the_base_lr_and_rescales_the_schedule(tmp_path):
    """A linear warm-up sets the first step's LR to 0: the probes run at the schedule's base LR, and afterwards
    the schedule's base LRs (and every group's initial_lr) are the found LR; two epochs cover every sample twice."""
    data = PointSet(256)
    _, trainer = make(tmp_path, data, lr_scheduler_type="linear", warmup_steps=2, num_train_epochs=2)
    steps = record_steps(trainer)
    trainer.train()
    probe = trainer.batchpilot.probe
    assert probe.lr is not None and probe.lr != 0.05
    assert trainer.lr_scheduler.base_lrs == [pytest.approx(probe.lr)] * 2
    assert [g["initial_lr"] for g in trainer.optimizer.param_groups] == [pytest.approx(probe.lr)] * 2
    assert sorted(int(i) for s in steps for i in s.indices) == sorted(list(range(len(data))) * 2)
