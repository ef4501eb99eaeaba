"""AdaptiveBatchSizeTrainer's LR and logs: the LR schedule runs on samples, LR coupling scales it,
``max_steps`` keeps Trainer's step schedule, TensorBoard receives the metrics; bf16 on CPU.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import PointSet, Recorder, SentimentText, SizeList, tiny_bert
from _hf_helpers import SIZES, collate_fn, quiet_args, record_steps
from transformers import TrainerCallback

from batchpilot.controllers import LinearIncrease
from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer


def test_lr_schedule_runs_on_samples_and_lr_coupling_scales_it(tmp_path):
    total, warmup_steps = 2 * 61, 2
    lrs_used: list[tuple[float, int]] = []
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList(SIZES), model=Recorder(), train_dataset=PointSet(61), lr_rule="sqrt",
        args=quiet_args(tmp_path, per_device_train_batch_size=4, num_train_epochs=2, learning_rate=0.1,
                        lr_scheduler_type="linear", warmup_steps=warmup_steps, logging_steps=1),
    )

    class Spy(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            lrs_used.append((trainer.optimizer.param_groups[0]["lr"], trainer.batchpilot.inflight.global_size))

    trainer.add_callback(Spy())
    steps = record_steps(trainer)
    trainer.train()

    warmup = warmup_steps * 4  # warm-up steps count batches of the first step's size

    def schedule(seen: int) -> float:  # transformers' linear schedule, in samples
        return 0.1 * (seen / warmup if seen < warmup else max(0.0, (total - seen) / (total - warmup)))

    logs = [h for h in trainer.state.log_history if "learning_rate" in h]
    assert len(logs) == len(lrs_used) == len(steps)
    assert any(s.global_size < d for s, d in zip(steps, [4] + SIZES * 2))  # epoch ends cut a step short
    seen = 0
    for s, log, (lr, size) in zip(steps, logs, lrs_used):
        factor = math.sqrt(s.global_size / 4)  # "sqrt": LR x sqrt(B / B0), B the step's samples, B0 the first's
        assert log["learning_rate"] == pytest.approx(schedule(seen), rel=1e-12)  # the schedule at this step
        assert log["lr_factor"] == pytest.approx(factor, rel=1e-12)
        assert size == s.global_size and lr == pytest.approx(schedule(seen) * factor, rel=1e-12)
        seen += s.global_size
    assert seen == total and trainer.lr_scheduler.get_last_lr()[0] == 0.0  # the schedule ends with the data


def test_max_steps_bounds_training_with_the_step_schedule(tmp_path):
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=LinearIncrease(start=4, increment=4, interval=2, max_size=32), model=Recorder(),
        train_dataset=PointSet(61),
        args=quiet_args(tmp_path, per_device_train_batch_size=4, max_steps=9, learning_rate=0.1,
                        lr_scheduler_type="linear"),
    )
    steps = record_steps(trainer)
    trainer.train()
    assert [s.global_size for s in steps] == [4, 4, 8, 8, 12, 12, 13, 16, 20]  # 13: the first epoch's tail
    assert trainer.state.global_step == 9 and trainer.lr_scheduler.get_last_lr()[0] == 0.0
    assert type(trainer.lr_scheduler).__name__ == "LambdaLR"  # Trainer's own: the step count is exact


def test_tensorboard_receives_coverage_epoch_and_batch_size(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # transformers 5.x: no logging_dir
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList(SIZES), model=Recorder(), train_dataset=PointSet(61),
        args=quiet_args(tmp_path, per_device_train_batch_size=4, num_train_epochs=1, logging_steps=2,
                        report_to=["tensorboard"]),
    )
    trainer.train()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert sum("loss" in h for h in trainer.state.log_history) == 4  # steps 2, 4, 6, 8 of 9
    for key in ("train_coverage", "epoch", "batch_size", "samples_seen"):
        logs = [h for h in trainer.state.log_history if key in h]  # `epoch` is in the final summary too
        scalars = events.Scalars(f"train/{key}")
        assert [e.step for e in scalars] == [h["step"] for h in logs]
        assert [e.value for e in scalars] == pytest.approx([h[key] for h in logs], rel=1e-6)


def test_bf16_autocast_on_cpu(tmp_path):
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList([6, 10]), model=tiny_bert(), train_dataset=SentimentText(40),
        data_collator=collate_fn,
        args=quiet_args(tmp_path, per_device_train_batch_size=4, num_train_epochs=1, bf16=True, learning_rate=1e-3),
    )
    steps = record_steps(trainer)
    result = trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16"
    assert [s.global_size for s in steps] == [4, 6, 10, 6, 10, 4] and math.isfinite(result.training_loss)

