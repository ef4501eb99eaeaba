"""AdaptiveBatchSize: checkpoints saved where Lightning's loop counters and the data position could disagree.

Each test resumes a real ``lightning.Trainer`` fit (CPU, the tiny float64 model of ``_lightning_ddp``) from
such a checkpoint and checks it against the uninterrupted run: the same steps (sizes and samples per
micro-batch) and bitwise-equal weights. Covered: checkpoints saved inside an accumulated step (a save from
any micro-batch, an exception in any micro-batch with ``OnExceptionCheckpoint``, a stop requested inside a
step as ``Timer`` does), at the end of an epoch Lightning cut short (``max_steps``, a stop) or after such a
fit but not at one ended by ``limit_train_batches``, and later fits of the same callback (another dataset, a
checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

from _hf_common import FailingSizeList, SizeList  # noqa: E402 (after the skip: these import lightning)
from _lightning_ddp import NUM_SAMPLES, SIZES, Model, make_data  # noqa: E402
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402

from batchpilot.integrations.lightning import AdaptiveBatchSize  # noqa: E402


def run(tmp_path: Path, *callbacks: Callback, ckpt_path: str | None = None, model_class: type = Model,
        workers: int = 0, controller: SizeList | None = None, **overrides) -> tuple[Model, AdaptiveBatchSize, L.Trainer]:
    """One fit of ``model_class`` driven by ``controller`` (``SizeList(SIZES)``; 2 epochs unless overridden)."""
    adaptive = AdaptiveBatchSize(controller or SizeList(SIZES), batch_size=4)
    model = model_class(adaptive, make_data(), workers=workers, val=False)
    settings = dict(
        max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
    )
    settings.update(overrides)
    if any(isinstance(c, Checkpoint) for c in callbacks):
        settings["enable_checkpointing"] = True
    trainer = L.Trainer(callbacks=[adaptive, *callbacks], **settings)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, adaptive, trainer


def assert_same_run(full: tuple, resumed: tuple, steps_before: int) -> None:
    """``resumed`` trained exactly the steps of ``full`` from step ``steps_before`` on, to the same weights."""
    (full_model, full_adaptive, full_trainer), (model, adaptive, trainer) = full, resumed
    assert [(s["size"], s["micro"]) for s in model.steps] == \
        [(s["size"], s["micro"]) for s in full_model.steps[steps_before:]]
    assert trainer.global_step == full_trainer.global_step and trainer.current_epoch == full_trainer.current_epoch
    assert adaptive.samples_seen == full_adaptive.samples_seen
    assert all(torch.equal(a, b) for a, b in zip(full_model.net.parameters(), model.net.parameters()))


class SaveEachBatch(Callback):
    """Saves ``b<total batch index>.ckpt`` at the end of every micro-batch (after AdaptiveBatchSize's hook)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trainer.save_checkpoint(self.folder / f"b{trainer.fit_loop.epoch_loop.total_batch_idx}.ckpt")


def test_a_checkpoint_saved_inside_a_step_resumes_that_step_from_its_start(tmp_path):
    # 3 micro-batches per step: total batch 4 is the 2nd micro-batch of step 1, 5 the last one (the step is
    # counted before the save), 6 the 1st of step 2; 25 is inside epoch 0's last step (9 steps, 27 batches),
    # 40 inside epoch 1. A save inside a step used to resume at that micro-batch, one micro-batch out of step
    # with the data: every later optimizer step mixed two steps' samples.
    full = run(tmp_path, SaveEachBatch(tmp_path), accumulate_grad_batches=3)
    assert [len(s["micro"]) for s in full[0].steps] == [3] * len(full[0].steps)
    for batch in (4, 5, 6, 25, 40):
        resumed = run(tmp_path, ckpt_path=str(tmp_path / f"b{batch}.ckpt"), accumulate_grad_batches=3)
        assert_same_run(full, resumed, steps_before=(batch + 1) // 3)


class FailAt(Model):
    """Raises in ``training_step`` of total batch ``fail_at`` (class attribute; ``None``: never)."""

    fail_at: int | None = None

    def training_step(self, batch, batch_idx):
        if self.trainer.fit_loop.epoch_loop.total_batch_idx == self.fail_at:
            raise RuntimeError("injected failure")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("accumulation, fail_at, workers", [(3, 4, 0), (2, 7, 0), (1, 3, 0), (2, 7, 2)])
def test_a_checkpoint_saved_on_an_exception_inside_a_step_is_exact(tmp_path, accumulation, fail_at, workers):
    # OnExceptionCheckpoint saves wherever the exception happened: inside a step (batch 4, the middle one of
    # A=3), or in a step's last micro-batch (batch 7 with A=2; every batch with A=1), where the data position
    # was already past the step whose optimizer update never ran: the resumed run skipped its samples. With
    # workers, later steps were planned (prefetched) too.
    FailAt.fail_at = fail_at
    with pytest.raises(RuntimeError, match="injected failure"):
        run(tmp_path, OnExceptionCheckpoint(str(tmp_path), filename="failed"), model_class=FailAt,
            workers=workers, accumulate_grad_batches=accumulation)
    FailAt.fail_at = None
    full = run(tmp_path, accumulate_grad_batches=accumulation)
    resumed = run(tmp_path, ckpt_path=str(tmp_path / "failed.ckpt"), workers=workers,
                  accumulate_grad_batches=accumulation)
    assert_same_run(full, resumed, steps_before=fail_at // accumulation)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_a_failing_controller_with_an_exception_checkpoint_loses_no_step(tmp_path, accumulation):
    # The controller fails after its step's optimizer update: the exception checkpoint holds that finished
    # step, and the fit resumed from it (with a working controller) continues at the current size and asks
    # the controller at the next step's end. The same as a run whose controller kept the size at that
    # decision. The step used to count as unfinished there: the resumed fit trained it a second time.
    sizes, fail_at = SIZES * 3, 4
    with pytest.raises(RuntimeError, match="controller failure"):
        run(tmp_path, OnExceptionCheckpoint(str(tmp_path), filename="failed"),
            controller=FailingSizeList(sizes, fail_at), accumulate_grad_batches=accumulation)
    kept = sizes[:fail_at] + [sizes[fail_at - 1]] + sizes[fail_at:]  # decision fail_at keeps the size
    full = run(tmp_path, controller=SizeList(kept), accumulate_grad_batches=accumulation)
    resumed = run(tmp_path, ckpt_path=str(tmp_path / "failed.ckpt"), controller=SizeList(sizes),
                  accumulate_grad_batches=accumulation)
    assert_same_run(full, resumed, steps_before=fail_at + 1)


class DropoutModel(Model):
    """``Model`` with dropout: its fits resume exactly only when the checkpoint restores the generators."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        torch.manual_seed(0)  # the same weights and the same draws in every fit
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Dropout(0.5), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 2)).double()


def test_dropout_resumes_exactly_from_saves_inside_steps_at_their_ends_and_on_exceptions(tmp_path):
    # Lightning saves no generator states, so a resumed fit drew other dropout masks (the data and sizes were
    # already exact, the weights not). Saves inside a step (batches 4, 25) restore torch's generator as of the
    # step's start, as the step runs again.
    full = run(tmp_path, SaveEachBatch(tmp_path), model_class=DropoutModel, accumulate_grad_batches=3)
    for batch in (4, 5, 25, 40):
        resumed = run(tmp_path, ckpt_path=str(tmp_path / f"b{batch}.ckpt"), model_class=DropoutModel,
                      accumulate_grad_batches=3)
        assert_same_run(full, resumed, steps_before=(batch + 1) // 3)

    class FailingDropout(FailAt, DropoutModel):
        fail_at = 7

    with pytest.raises(RuntimeError, match="injected failure"):
        run(tmp_path, OnExceptionCheckpoint(str(tmp_path), filename="failed"), model_class=FailingDropout,
            accumulate_grad_batches=3)
    resumed = run(tmp_path, ckpt_path=str(tmp_path / "failed.ckpt"), model_class=DropoutModel,
                  accumulate_grad_batches=3)
    assert_same_run(full, resumed, steps_before=2)


class StopAt(Callback):
    """Asks the trainer to stop after total batch ``batch``, as ``Timer(duration=...)`` does when time is up
    (it checks after every batch, so the stop can fall inside an accumulated step)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.fit_loop.epoch_loop.total_batch_idx == self.batch:
            trainer.should_stop = True


@pytest.mark.parametrize("stop_after", [6, 7, 8])
def test_a_stop_then_the_epoch_end_checkpoint_resumes_exactly(tmp_path, stop_after):
    # The epoch ends at the stop and ModelCheckpoint saves there: at the end of an epoch Lightning cut short,
    # inside a step (after batch 6 or 8, the first of an A=2 step) or at a step's end (batch 7). Resumed,
    # Lightning started the next epoch while the data continued the old pass (and a step was out of line):
    # the fit ended a pass short.
    saver = ModelCheckpoint(dirpath=str(tmp_path), filename="stopped", save_on_train_epoch_end=True)
    run(tmp_path, StopAt(stop_after), saver, accumulate_grad_batches=2)
    full = run(tmp_path, accumulate_grad_batches=2)
    resumed = run(tmp_path, ckpt_path=str(tmp_path / "stopped.ckpt"), accumulate_grad_batches=2)
    assert_same_run(full, resumed, steps_before=(stop_after + 1) // 2)
    assert resumed[1].samples_seen == 2 * NUM_SAMPLES


@pytest.mark.parametrize("where", ["epoch_end", "after_fit"])
def test_a_fit_cut_by_max_steps_resumes_inside_its_epoch(tmp_path, where):
    # max_steps=3 ends the fit inside epoch 0; ModelCheckpoint saves at that epoch's end (save_last), or the
    # user saves once fit() returns. Both said "epoch 0 done" while the data was inside epoch 0: resumed
    # without max_steps, 3 epochs trained only 2 passes over the data (122 samples instead of 183).
    saver = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    _, _, cut = run(tmp_path, saver, max_epochs=3, max_steps=3)
    path = tmp_path / "last.ckpt"
    if where == "after_fit":
        path = tmp_path / "after.ckpt"
        cut.save_checkpoint(path)
    full = run(tmp_path, max_epochs=3)
    resumed = run(tmp_path, ckpt_path=str(path), max_epochs=3)
    assert_same_run(full, resumed, steps_before=3)
    assert resumed[1].samples_seen == 3 * NUM_SAMPLES


def test_epochs_limited_by_limit_train_batches_resume_at_the_next_epoch(tmp_path):
    # limit_train_batches ends Lightning's epochs inside the data's pass, which is not an epoch cut short: an
    # epoch-end checkpoint must resume with the next epoch (and the data where it stopped).
    saver = ModelCheckpoint(dirpath=str(tmp_path), filename="end-{step}", save_top_k=-1,
                            save_on_train_epoch_end=True)
    full = run(tmp_path, saver, max_epochs=3, limit_train_batches=6, accumulate_grad_batches=2)
    assert full[2].global_step == 9
    resumed = run(tmp_path, ckpt_path=str(tmp_path / "end-step=3.ckpt"), max_epochs=3, limit_train_batches=6,
                  accumulate_grad_batches=2)
    assert_same_run(full, resumed, steps_before=3)


def test_a_later_fit_on_another_dataset_starts_its_first_epoch(tmp_path):
    # The same callback fits again with a new Trainer on a dataset of another length (a second training
    # stage): it used to refuse, asking for "a new fit", which this is.
    adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
    settings = dict(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    first = Model(adaptive, make_data(), val=False)
    L.Trainer(callbacks=[adaptive], **settings).fit(first)
    decided = adaptive.batch_size
    second = Model(adaptive, make_data(40), val=False)
    L.Trainer(callbacks=[adaptive], **settings).fit(second)
    assert sorted(i for s in second.steps for i in s["ids"]) == list(range(40))  # each sample once
    assert second.steps[0]["size"] == decided and second.steps[0]["epoch"] == 0
    assert adaptive.samples_seen == NUM_SAMPLES + 40
    # The loader handed to fit() directly, made between the fits, starts its dataset's first epoch as well.
    loader = adaptive.dataloader(make_data(25), seed=1)
    third = Model(adaptive, make_data(25), val=False)
    L.Trainer(callbacks=[adaptive], **settings).fit(third, train_dataloaders=loader)
    assert sorted(i for s in third.steps for i in s["ids"]) == list(range(25))
    # A later fit on a dataset of the same length continues the data where the last fit left it.
    fourth = Model(adaptive, make_data(25), val=False)
    L.Trainer(callbacks=[adaptive], **settings).fit(fourth)
    assert {s["epoch"] for s in fourth.steps} == {1}


def test_a_later_fit_of_the_same_callback_resumes_a_checkpoint_exactly(tmp_path):
    # The callback object of an earlier fit (on another dataset) resumes a checkpoint: the checkpoint's data
    # position wins over the earlier fit's.
    saver = ModelCheckpoint(dirpath=str(tmp_path), filename="{step}", every_n_train_steps=5, save_top_k=-1)
    full = run(tmp_path, saver)
    adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
    settings = dict(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    L.Trainer(callbacks=[adaptive], **{**settings, "max_epochs": 1}).fit(Model(adaptive, make_data(40), val=False))
    model = Model(adaptive, make_data(), val=False)
    trainer = L.Trainer(callbacks=[adaptive], **settings)
    trainer.fit(model, ckpt_path=str(tmp_path / "step=5.ckpt"))
    assert_same_run(full, (model, adaptive, trainer), steps_before=5)


def test_a_save_between_a_steps_update_and_its_count_warns(tmp_path):
    # A callback listed before AdaptiveBatchSize saves at the end of a step's last micro-batch: the weights are
    # updated, the step is not counted yet, so the checkpoint cannot be exact; it says so.
    adaptive = AdaptiveBatchSize(SizeList(SIZES), batch_size=4)
    early = SaveEachBatch(tmp_path)
    trainer = L.Trainer(max_epochs=1, max_steps=2, accumulate_grad_batches=2, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path), callbacks=[early, adaptive])
    with pytest.warns(UserWarning, match="after the optimizer updated the weights for the step in flight"):
        trainer.fit(Model(adaptive, make_data(), val=False))
