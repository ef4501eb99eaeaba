"""AdaptiveBatchSizeTrainer's checkpoints: a resumed run gives the same samples, sizes and bitwise-equal
weights as the uninterrupted one (mid-epoch, at an epoch's end, with drop_last, from the final checkpoint,
after a failing controller saved its finished step); foreign or corrupt states fail clearly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import FailingSizeList, PointSet, Recorder, SentimentText, SizeList, tiny_bert
from _hf_helpers import SIZES, collate_fn, exact_sgd, quiet_args, record_steps
from transformers import TrainerCallback

from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer


@pytest.mark.parametrize("save, workers_after", [("steps", 0), ("steps", 2), ("epoch", 0)])
def test_resume_from_checkpoint_is_exact(tmp_path, save, workers_after):
    """Interrupting mid-epoch (after step 7, mid-accumulation plan) or at the first epoch's end and resuming
    gives the same samples, sizes and (bitwise) weights, with dropout (RNG), a linear LR schedule on
    samples and LR coupling."""

    def run(resume: str | None, workers: int):
        model = tiny_bert()
        trainer = AdaptiveBatchSizeTrainer(
            batch_size_scheduler=SizeList(SIZES), model=model, train_dataset=SentimentText(61),
            data_collator=collate_fn, lr_rule="sqrt",
            args=quiet_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                            num_train_epochs=2, save_strategy=save, save_steps=7,
                            dataloader_num_workers=workers, learning_rate=3e-3, lr_scheduler_type="linear",
                            warmup_steps=2),
        )
        steps = record_steps(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return steps, [p.detach().clone() for p in model.parameters()]

    full, full_weights = run(None, 0)
    first = min(tmp_path.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert (first / "batchpilot_state.json").is_file()
    done = int(first.name.split("-")[1])
    assert done == (7 if save == "steps" else 9)  # epoch 0 has 9 steps
    resumed, resumed_weights = run(str(first), workers_after)
    assert [(s.global_size, s.indices.tolist()) for s in resumed] == [
        (s.global_size, s.indices.tolist()) for s in full[done:]
    ]
    assert all(torch.equal(a, b) for a, b in zip(full_weights, resumed_weights))


@pytest.mark.parametrize("save", ["steps", "no"])
def test_a_failing_controller_saves_the_finished_step_and_the_resumed_run_loses_nothing(tmp_path, save):
    """The controller fails after step 5's update: the trainer saves checkpoint-5 (unless save_strategy="no")
    before the error stops it, and the run resumed from it (with a working controller) continues at the
    current size and asks the controller at the next step's end: the same samples, sizes and weights as a run
    whose controller kept the size at that decision. Before, the steps since the last save were lost."""
    sizes, fail_at = SIZES * 3, 4  # decision 4 comes after step 5 (steps 1-5 at 4, 3, 7, 1, 12)

    def run(controller, out: Path, resume: str | None = None):
        model = tiny_bert()
        trainer = AdaptiveBatchSizeTrainer(
            batch_size_scheduler=controller, model=model, train_dataset=SentimentText(61), data_collator=collate_fn,
            lr_rule="sqrt", args=quiet_args(out, per_device_train_batch_size=4, num_train_epochs=2,
                                            save_strategy=save, save_steps=100, learning_rate=3e-3),
        )
        steps = record_steps(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return steps, [p.detach().clone() for p in model.parameters()]

    with pytest.raises(RuntimeError, match="controller failure") as failure:
        run(FailingSizeList(sizes, fail_at), tmp_path / "failed")
    saved = sorted(p.name for p in (tmp_path / "failed").glob("checkpoint-*"))
    if save == "no":
        assert saved == []
        return
    assert saved == ["checkpoint-5"]
    if sys.version_info >= (3, 11):  # exception notes
        assert "saved the finished step 5" in "".join(failure.value.__notes__)
    kept = sizes[:fail_at] + [sizes[fail_at - 1]] + sizes[fail_at:]  # decision 4 keeps the size
    full, full_weights = run(SizeList(kept), tmp_path / "full")
    resumed, resumed_weights = run(SizeList(sizes), tmp_path / "failed", str(tmp_path / "failed" / "checkpoint-5"))
    assert [(s.global_size, s.indices.tolist()) for s in resumed] == [
        (s.global_size, s.indices.tolist()) for s in full[5:]
    ]
    assert all(torch.equal(a, b) for a, b in zip(full_weights, resumed_weights))


@pytest.mark.parametrize("drop_last, epochs", [(False, 2), (True, 2), (True, 1)])
def test_resume_with_drop_last_or_from_the_final_checkpoint_trains_nothing_extra(tmp_path, drop_last, epochs):
    """Trainer counts the epochs left by steps (global_step // len(dataset)), so on resume its epoch loop
    runs more often than the data needs: with drop_last the epoch whose tail is still to be dropped, and after
    the final checkpoint every epoch, must end training, not start another step."""

    def run(resume, out):
        model = Recorder()
        trainer = AdaptiveBatchSizeTrainer(
            model=model, train_dataset=PointSet(100),
            args=quiet_args(out, per_device_train_batch_size=32, num_train_epochs=epochs, dataloader_drop_last=drop_last,
                            save_strategy="steps", save_steps=2, **exact_sgd()),
        )
        steps = record_steps(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return steps, [p.detach().clone() for p in model.parameters()]

    full, weights = run(None, tmp_path / "full")
    # (One epoch with drop_last: the final tail used to be trained as a short step of 4.)
    assert [s.global_size for s in full] == ([32, 32, 32] * epochs if drop_last else [32, 32, 32, 4] * epochs)
    checkpoints = sorted(tmp_path.glob("full/checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for checkpoint in (checkpoints[1], checkpoints[-1]):  # mid-run (step 4), and the final one
        done = int(checkpoint.name.split("-")[1])
        # Trainer takes a path as str or pathlib.Path; the batchpilot state must come along either way.
        resume = checkpoint if checkpoint == checkpoints[1] else str(checkpoint)
        resumed, resumed_weights = run(resume, tmp_path / f"from-{done}")
        assert [(s.global_size, s.indices.tolist()) for s in resumed] == [
            (s.global_size, s.indices.tolist()) for s in full[done:]]
        assert all(torch.equal(a, b) for a, b in zip(weights, resumed_weights))


@pytest.mark.parametrize("epochs, sizes, saved, evaluations", [
    (2, [32] * 6, ["checkpoint-4", "checkpoint-6"], [4, 6]),  # 3 steps of 32 per epoch, 4 samples dropped each time
    (1, [32] * 3, ["checkpoint-3"], [3]),
    # The scheduler decides 64 with 36 samples left in the last epoch: they are dropped, not trained as a step of 36.
    (1, [32, 32], ["checkpoint-2"], [2]),
])
def test_a_run_whose_last_tail_is_dropped_still_saves_and_evaluates_at_its_end(tmp_path, epochs, sizes, saved,
                                                                                evaluations):
    """With a "steps" strategy Trainer saves and evaluates after the last step; with drop_last the run ends
    before every sample is counted (the tail is dropped), and must end the same way (also in a run of one
    epoch, where the samples left in the run are exactly that tail)."""
    evaluated = []

    class Evaluations(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            evaluated.append(state.global_step)

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=(lambda step, size: 64 if step >= 2 else 32) if sizes == [32, 32] else None,
        model=Recorder(), train_dataset=PointSet(100), eval_dataset=PointSet(20, seed=1), callbacks=[Evaluations()],
        args=quiet_args(tmp_path, per_device_train_batch_size=32, num_train_epochs=epochs, dataloader_drop_last=True,
                        save_strategy="steps", save_steps=4, eval_strategy="steps", eval_steps=4, **exact_sgd()),
    )
    steps = record_steps(trainer)
    trainer.train()
    assert [s.global_size for s in steps] == sizes and trainer.state.global_step == len(sizes)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == saved
    assert evaluated == evaluations


def test_resume_from_a_foreign_checkpoint_fails_clearly(tmp_path):
    from transformers import Trainer

    Trainer(model=Recorder(), train_dataset=PointSet(20),
            args=quiet_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)).train()
    trainer = AdaptiveBatchSizeTrainer(model=Recorder(), train_dataset=PointSet(20), args=quiet_args(tmp_path))
    with pytest.raises(FileNotFoundError, match="has no batchpilot_state.json"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_a_corrupt_or_foreign_state_file_fails_clearly(tmp_path):
    from batchpilot.integrations.hf.state import STATE_FILE, read_state, write_state

    write_state(tmp_path, {"step": 3})
    assert read_state(tmp_path)["step"] == 3
    path = tmp_path / STATE_FILE
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # a truncated file
    with pytest.raises(ValueError, match="is truncated or corrupt .*resume from another checkpoint folder"):
        read_state(tmp_path)
    path.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match="is truncated or corrupt"):
        read_state(tmp_path)
    for foreign, shown in (([1, 2], r"\[1, 2\]"), ({"format": "other", "version": 1}, "format='other'")):
        path.write_text(json.dumps(foreign))
        with pytest.raises(ValueError, match=f"is not a batchpilot Trainer state of version .*{shown}"):
            read_state(tmp_path)

