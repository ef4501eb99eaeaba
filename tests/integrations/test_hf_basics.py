"""AdaptiveBatchSizeTrainer on a real ``transformers.Trainer``: seed 003's flow, sizes, coverage and gradients.

What is checked, each against a value derived independently of the trainer:
- seed 003's constructor and scheduler; training stops after exactly ``num_train_epochs`` passes, every
  sample once per pass; logs carry ``train_coverage``/``epoch`` as in the seed's example log;
- a size decided after step t is the size of step t+1, with dataloader workers and accelerate's look-ahead on,
  and the model sees exactly the planned samples;
- gradients: weights equal a plain full-batch-mean SGD loop on the same samples (accumulation, ghosts, a loss
  normalised by ``num_items_in_batch``).
"""

from __future__ import annotations

import collections
import functools
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import PointSet, Recorder, SentimentText, SizeList, tiny_bert
from _hf_helpers import SIZES, collate_fn, exact_sgd, quiet_args, record_steps, sgd_reference
from transformers import TrainerCallback, TrainingArguments

from batchpilot.controllers import linear_increase_scheduler
from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer


def expected_sizes(first: int, decide, num_samples: int, epochs: int) -> list[int]:
    """Replay a controller by hand: the size of each step, an epoch's last step truncated to what is left."""
    sizes, size, step = [], first, 0
    for _ in range(epochs):
        left = num_samples
        while left:
            sizes.append(min(size, left))
            left -= sizes[-1]
            step += 1
            size = decide(step, size)
    return sizes


def check_coverage(steps: list, num_samples: int, epochs: int) -> None:
    per_epoch = collections.defaultdict(list)
    for s in steps:
        per_epoch[s.epoch].extend(s.indices.tolist())
    assert sorted(per_epoch) == list(range(epochs))
    for ids in per_epoch.values():
        assert sorted(ids) == list(range(num_samples))  # every sample exactly once per epoch


def test_seed003_trainer_grows_the_batch_and_stops_after_the_epochs(tmp_path):
    batch_scheduler = functools.partial(linear_increase_scheduler, interval=4, max_size=24, increment=4)
    training_args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,  # the first step's size
        num_train_epochs=2,
        max_steps=-1,
        dataloader_drop_last=False,
        eval_strategy="epoch",
        logging_steps=3,
        use_cpu=True, report_to=[], disable_tqdm=True, save_strategy="no", learning_rate=3e-3,
    )
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=batch_scheduler,
        model=tiny_bert(),
        args=training_args,
        train_dataset=SentimentText(90, seed=1),
        eval_dataset=SentimentText(20, seed=2),
        data_collator=collate_fn,
    )
    steps = record_steps(trainer)
    result = trainer.train()

    assert [s.global_size for s in steps] == expected_sizes(4, batch_scheduler, 90, 2)
    check_coverage(steps, 90, 2)
    assert result.global_step == len(steps)
    assert trainer.batchpilot.samples_seen == 180 and trainer.state.epoch == 2.0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and {"loss", "learning_rate", "train_coverage", "epoch", "batch_size"} <= set(logs[0])
    for log in logs:  # seed 003: epoch = passes by samples, train_coverage = fraction of the current pass
        seen = sum(s.global_size for s in steps[: log["step"]])
        assert log["epoch"] == seen / 90
        assert log["train_coverage"] == pytest.approx(seen % 90 / 90, abs=1e-6)
        assert log["batch_size"] == steps[log["step"] - 1].global_size
    assert sum("eval_loss" in h for h in trainer.state.log_history) == 2  # one evaluation per epoch


def test_any_controller_and_exact_sizes_with_workers_and_lookahead(tmp_path):
    """Workers prefetch and accelerate reads one batch ahead; a decision still applies to the next step."""
    sizes = [3, 7, 12, 5, 9, 20, 4, 11]  # all >= accumulation steps: no ghost micro-batches here
    model = Recorder()
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList(sizes), model=model, train_dataset=PointSet(62),
        args=quiet_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2,
                        dataloader_num_workers=2, **exact_sgd()),
    )
    steps = record_steps(trainer)
    trainer.train()
    decided = iter(sizes * 3)
    assert [s.global_size for s in steps] == expected_sizes(4, lambda step, size: next(decided), 62, 2)
    check_coverage(steps, 62, 2)
    assert not any(s.ghosts for s in steps)  # (62 samples: no epoch tail smaller than the accumulation)
    seen = [i for call in model.seen for i in call]  # what the model's forward received, in order
    assert seen == [i for s in steps for i in s.indices.tolist()]
    assert trainer.batchpilot.loader.rewinds > 0  # batches prefetched at an old size were discarded


def test_gradients_equal_a_full_batch_mean_sgd_loop(tmp_path):
    """Uneven micro-batches and ghost micro-batches (size 1 or 2 over 3 accumulation steps) still give the
    gradient of the mean loss over the global batch."""
    data, model = PointSet(61), Recorder()
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList(SIZES), model=model, train_dataset=data,
        args=quiet_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3, num_train_epochs=2,
                        **exact_sgd()),
    )
    steps = record_steps(trainer)
    trainer.train()
    assert any(s.ghosts for s in steps)
    reference, losses = sgd_reference(data, [s.indices for s in steps])
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    assert list(trainer.batchpilot.driver.losses) == pytest.approx(losses, rel=1e-12)  # what a controller sees


def train_with_num_items(tmp_path, data, model=None) -> tuple[Recorder, AdaptiveBatchSizeTrainer, list]:
    """One epoch of SIZES over 3 accumulation steps (sizes 1 and 2 give ghosts) with compute_loss_func
    normalised by num_items_in_batch; returns the model, the trainer and the steps."""
    model = model or Recorder()

    def summed_loss(outputs, labels, num_items_in_batch):
        return torch.nn.functional.cross_entropy(outputs["logits"], labels, reduction="sum") / num_items_in_batch

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList(SIZES), model=model, train_dataset=data, compute_loss_func=summed_loss,
        args=quiet_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3, num_train_epochs=1,
                        **exact_sgd()),
    )
    steps = record_steps(trainer)
    trainer.train()
    assert any(s.ghosts for s in steps)
    return model, trainer, steps


def test_a_loss_normalised_by_num_items_keeps_trainers_item_counting(tmp_path):
    """With compute_loss_func (sum / num_items_in_batch) Trainer counts the items itself; ghost micro-batches
    get labels -100, so the gradient is still the global-batch mean."""
    data = PointSet(61)
    model, trainer, steps = train_with_num_items(tmp_path, data)
    reference, losses = sgd_reference(data, [s.indices for s in steps])
    assert trainer.batchpilot.last_loss == pytest.approx(losses[-1], rel=1e-12)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


class ShiftLabels(PointSet):
    """PointSet whose items also carry ``shift_labels`` (as a padding-free collator gives them): Trainer then
    counts those for num_items_in_batch instead of ``labels``."""

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "shift_labels": self.y[i]}


class ShiftRecorder(Recorder):
    def forward(self, x, labels=None, sample_id=None, shift_labels=None):
        return super().forward(x, labels, sample_id)


def test_ghosts_shift_labels_are_left_out_of_the_item_count(tmp_path):
    data = ShiftLabels(61)
    model, _, steps = train_with_num_items(tmp_path, data, ShiftRecorder())
    reference, _ = sgd_reference(data, [s.indices for s in steps])
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


class SoftLabels(PointSet):
    """PointSet with float labels (one-hot class probabilities), which cannot be masked with -100."""

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        return {**item, "labels": torch.nn.functional.one_hot(self.y[i], 2).double()}


def test_ghost_micro_batches_add_nothing_with_float_labels_and_num_items(tmp_path):
    # Ghosts (sizes 1 and 2 over 3 accumulation steps) carry a borrowed row whose float labels -100 cannot
    # hide from the forward: its loss must be multiplied by 0 and its labels left out of the item count.
    data = SoftLabels(61)
    model, _, steps = train_with_num_items(tmp_path, data)  # num_items counts both label columns of a row
    reference = Recorder()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for s in steps:  # the mean over the step's rows of CE / 2 (two label entries per row)
        idx = torch.as_tensor(s.indices)
        optimizer.zero_grad()
        (reference(data.x[idx], data.y[idx])["loss"] / 2).backward()
        optimizer.step()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_a_fractional_epoch_count_stops_at_exactly_that_many_samples(tmp_path):
    data, model = PointSet(61), Recorder()
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList([16]), model=model, train_dataset=data,
        args=quiet_args(tmp_path, per_device_train_batch_size=16, num_train_epochs=1.5, **exact_sgd()),
    )
    steps = record_steps(trainer)
    trainer.train()
    total = math.ceil(1.5 * 61)  # 92
    assert [s.global_size for s in steps] == [16, 16, 16, 13, 16, 15]  # an epoch's tail, then the 92nd sample
    assert trainer.batchpilot.samples_seen == total and sum(len(c) for c in model.seen) == total
    assert trainer.state.epoch == pytest.approx(total / 61)


def test_user_callbacks_see_the_step_counted_and_each_train_call_starts_the_controller_afresh(tmp_path):
    seen = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((trainer.batchpilot.samples_seen, state.epoch, trainer.batchpilot.batch_size))

    controller = SizeList([8, 12, 16])
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=controller, model=Recorder(), train_dataset=PointSet(40), callbacks=[Watch()],
        args=quiet_args(tmp_path, per_device_train_batch_size=4, num_train_epochs=1, **exact_sgd()),
    )
    trainer.train()
    assert seen == [(4, 0.1, 8), (12, 0.3, 12), (24, 0.6, 16), (40, 1.0, 8)]
    first = list(seen)
    seen.clear()
    trainer.train()  # again, not resumed: the same sizes (the controller starts from its state at construction)
    assert seen == first and controller.i == 4

