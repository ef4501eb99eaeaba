"""AdaptiveBatchSizeTrainer on a real ``transformers.Trainer``: tiny models from configs, no downloads.

What is checked, each against a value derived independently of the trainer:
- seed 003's constructor and scheduler; training stops after exactly ``num_train_epochs`` passes, every
  sample once per pass; logs carry ``train_coverage``/``epoch`` as in the seed's example log;
- a size decided after step t is the size of step t+1, with dataloader workers and accelerate's look-ahead on,
  and the model sees exactly the planned samples;
- gradients: weights equal a plain full-batch-mean SGD loop on the same samples (accumulation, ghosts);
- the LR schedule runs on samples; LR coupling; TensorBoard receives the metrics; ``max_steps`` mode; bf16;
- resume from a checkpoint gives the same samples, sizes and bitwise-equal weights;
- gradient statistics: what a controller sees equals a by-hand two-batch noise-scale estimate (1 process
  and 2 gloo ranks), a NoiseScale controller acts on them, and they survive a resume;
- torchrun with 2 gloo ranks: equal sizes on every rank, exact coverage, weights equal a 1-process
  reference; a failed rank restarted by torchrun resumes to bitwise-equal weights.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import (
    FailingSizeList,
    PointSet,
    Recorder,
    SentimentText,
    SizeList,
    StatsSpy,
    check_noise_by_hand,
    tiny_bert,
)
from transformers import TrainerCallback, TrainingArguments

from batchpilot.controllers import Constant, LinearIncrease, linear_increase_scheduler
from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

REPO = Path(__file__).resolve().parents[2]
SAMPLING_STRATEGY = "train_sampling_strategy" in TrainingArguments.__dataclass_fields__  # newer 5.x releases
SIZES = [3, 7, 1, 12, 5, 9, 2, 20, 4, 11]  # 1 and 2 are smaller than accumulation x world size: ghosts


def quiet_args(out: Path, **overrides) -> TrainingArguments:
    settings = dict(
        output_dir=str(out), use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1000, save_strategy="no",
        seed=0,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def exact_sgd(**overrides) -> dict:
    """Plain SGD at a constant LR, no clipping, no weight decay: weights follow the gradients exactly."""
    return dict(learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                **overrides)


def record_steps(trainer: AdaptiveBatchSizeTrainer) -> list:
    """Append the StepRecord of every finished step to the returned list."""
    steps: list = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(trainer.batchpilot.last_step)

    trainer.add_callback(Record())
    return steps


def sgd_reference(data: PointSet, batches) -> tuple[Recorder, list[float]]:
    """Plain SGD (lr 0.1) of a fresh Recorder over ``batches`` (lists of sample ids), one full batch per
    step: the weights and losses an exact adaptive run must reproduce."""
    reference, losses = Recorder(), []
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for ids in batches:
        idx = torch.as_tensor(ids)
        optimizer.zero_grad()
        loss = reference(data.x[idx], data.y[idx])["loss"]
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return reference, losses


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


def collate_fn(samples: list[dict]) -> dict:
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}


# --------------------------------------------------------------------------------------------- seed 003
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


# --------------------------------------------------------------------------------------------- memory bound
@pytest.mark.parametrize("loss", ["mean", "num_items"])
def test_max_micro_batch_size_cuts_micro_batches_and_keeps_the_gradient_exact(tmp_path, loss):
    """Micro-batches of up to 7 rows (3 accumulation steps, sizes up to 20) run as passes of at most 2 rows;
    the weights are still those of full-batch SGD, with a mean loss (each pass weighted by its rows) and with
    a loss normalised by num_items_in_batch (the passes add up by themselves)."""
    data, model = PointSet(61), Recorder()

    def summed_loss(outputs, labels, num_items_in_batch):
        return torch.nn.functional.cross_entropy(outputs["logits"], labels, reduction="sum") / num_items_in_batch

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList(SIZES), model=model, train_dataset=data, max_micro_batch_size=2,
        args=quiet_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3, num_train_epochs=2,
                        **exact_sgd()),
        **({"compute_loss_func": summed_loss} if loss == "num_items" else {}),
    )
    steps = record_steps(trainer)
    trainer.train()
    assert max(len(ids) for ids in model.seen) == 2  # every forward: at most 2 rows ...
    assert len(model.seen) > 3 * len(steps)  # ... so micro-batches were cut into several passes
    reference, losses = sgd_reference(data, [s.indices for s in steps])
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    assert list(trainer.batchpilot.driver.losses) == pytest.approx(losses, rel=1e-12)


def test_max_micro_batch_size_passes_are_the_small_batches_and_goodput_learns_the_bound(tmp_path):
    """Each pass is a small batch of the noise scale (the estimate equals the by-hand one over the passes);
    the throughput model times each pass, and Goodput learns the bound."""
    data, model, spy = PointSet(64), Recorder(), StatsSpy([12, 9, 15, 6])
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=spy, model=model, train_dataset=data, noise_every=1, max_micro_batch_size=2,
        args=quiet_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, num_train_epochs=1,
                        **exact_sgd()),
    )
    steps = record_steps(trainer)
    trainer.train()
    passes = group_by_step(model.seen, [s.global_size for s in steps])
    assert max(len(p) for p in passes) > 3 and max(len(ids) for p in passes for ids in p) == 2
    reference = Recorder()
    check_noise_by_hand(passes, spy.seen_stats, reference, recorder_loss(reference, data), len(data))
    cut = spy.seen_stats
    assert cut[-1]["perf/max_micro_batch_size"] == 2
    assert cut[-1]["perf/micro_time_b_s"] >= 0 and cut[-1]["perf/accumulation_steps"] == 3
    with pytest.raises(ValueError, match="max_micro_batch_size"):
        AdaptiveBatchSizeTrainer(model=Recorder(), train_dataset=PointSet(8), args=quiet_args(tmp_path),
                                 max_micro_batch_size=0)


def test_split_rows_cuts_batch_first_tensors_evenly():
    from batchpilot.integrations._hf_parts import split_rows

    batch = {"x": torch.arange(10).view(5, 2), "labels": torch.arange(5), "scale": torch.tensor(2.0), "tag": "t"}
    pieces = split_rows(batch, 2)
    assert [n for _, n in pieces] == [2, 2, 1]
    assert torch.equal(torch.cat([p["x"] for p, _ in pieces]), batch["x"])
    assert all(p["scale"] is batch["scale"] and p["tag"] == "t" for p, _ in pieces)  # not batch-first: shared
    assert [n for _, n in split_rows((torch.zeros(7, 3), torch.zeros(7)), 3)] == [3, 2, 2]
    Pair = collections.namedtuple("Pair", "x y")
    pieces = split_rows(Pair(torch.arange(5), torch.arange(5) * 2), 2)
    assert all(isinstance(p, Pair) for p, _ in pieces) and torch.equal(pieces[2][0].y, torch.tensor([8]))
    assert split_rows(batch, 5) == [(batch, 5)] and split_rows(batch, None) == [(batch, 5)]
    with pytest.raises(TypeError, match="max_micro_batch_size=2"):
        split_rows(torch.zeros(4, 2), 2)


class _OutOfMemoryInBackward(torch.autograd.Function):
    """Identity whose backward raises the error CUDA raises, for more than ``limit`` rows."""

    @staticmethod
    def forward(ctx, x, limit):
        ctx.limit = limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if len(grad) > ctx.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(grad)} rows.")
        return grad, None


class FitsRows(Recorder):
    """A Recorder that 'fits' ``limit`` rows: more raise torch.OutOfMemoryError in the forward, or (``where=
    "backward"``) in the backward, after the output layer's gradients were accumulated. ``fail_at_call=k``:
    the k-th forward (from 0) runs out of memory whatever its rows (fragmented memory, say)."""

    def __init__(self, limit: int | None, where: str = "forward", fail_at_call: int | None = None) -> None:
        super().__init__()
        self.limit, self.where, self.fail_at_call, self.calls = limit, where, fail_at_call, 0

    def forward(self, x, labels=None, sample_id=None):
        self.calls += 1
        if self.calls - 1 == self.fail_at_call:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        if self.limit is not None and self.where == "forward" and len(x) > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(x)} rows.")
        if sample_id is not None:
            self.seen.append(sample_id.tolist())
        hidden = self.net[1](self.net[0](x))
        if self.limit is not None and self.where == "backward":  # the output layer's gradients come first
            hidden = _OutOfMemoryInBackward.apply(hidden, self.limit)
        logits = self.net[2](hidden)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def oom_trainer(tmp_path, model, spy, **kwargs):
    return AdaptiveBatchSizeTrainer(
        batch_size_scheduler=spy, model=model, train_dataset=PointSet(64), noise_every=1,
        args=quiet_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2,
                        **exact_sgd(), **kwargs.pop("args", {})),
        **kwargs,
    )


@pytest.mark.parametrize("where", ["forward", "backward", "second micro-batch"])
def test_oom_recovery_runs_the_step_again_with_smaller_passes(tmp_path, where):
    """The model 'fits' 3 rows: the first step's micro-batches of 4 rows run out of memory (in the forward, or
    in the backward after some gradients were accumulated), or its second micro-batch does (after the first
    one's gradient, loss and statistics were recorded). The step runs again from its first micro-batch in
    passes of half the rows that failed, and the run equals one that never ran out of memory and had that bound
    from the start: weights, losses, statistics (whose small batches are the passes)."""
    sizes = [8, 12, 6, 16, 10]
    plain_model, plain_spy = FitsRows(None), StatsSpy(sizes)
    plain = oom_trainer(tmp_path / "plain", plain_model, plain_spy, max_micro_batch_size=2)
    plain.train()
    model = FitsRows(None, fail_at_call=1) if where == "second micro-batch" else FitsRows(3, where)
    spy = StatsSpy(sizes)
    trainer = oom_trainer(tmp_path / "oom", model, spy, oom_recovery=True)
    trainer.train()
    run = trainer.batchpilot
    # First step: 4 rows fail -> passes of 2; nothing larger fails after that.
    assert run.oom_replays == 1 and run.max_micro_batch_size == 2
    assert max(len(ids) for ids in model.seen[2:]) == 2  # after the failed attempt (one or two forwards)
    assert run.samples_seen == 2 * 64
    for got, want in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    assert list(run.driver.losses) == pytest.approx(list(plain.batchpilot.driver.losses), rel=1e-12)
    for a, b in zip(plain_spy.seen_stats, spy.seen_stats):
        for key in ("stats/noise_scale", "stats/grad_sq_norm", "stats/trace_cov"):
            assert (key in a) == (key in b) and (key not in a or b[key] == pytest.approx(a[key], rel=1e-9)), key
    assert spy.seen_stats[-1]["perf/max_micro_batch_size"] == run.max_micro_batch_size


def test_oom_recovery_keeps_its_bound_across_a_resume(tmp_path):
    """The lowered bound is in batchpilot_state.json: a run resumed from a checkpoint starts with passes of 2
    and never runs out of memory again, and ends as the uninterrupted run."""
    sizes = [8, 12, 6, 16, 10]

    def run(resume):
        model = FitsRows(3)
        trainer = oom_trainer(tmp_path, model, StatsSpy(sizes), oom_recovery=True,
                              args=dict(save_strategy="steps", save_steps=4))
        trainer.train(resume_from_checkpoint=resume)
        return trainer.batchpilot, [p.detach().clone() for p in model.parameters()]

    full, full_weights = run(None)
    assert full.oom_replays == 1
    first = min(tmp_path.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    resumed, weights = run(str(first))
    assert resumed.oom_replays == 0 and resumed.max_micro_batch_size == 2
    assert all(torch.equal(a, b) for a, b in zip(full_weights, weights))


def test_oom_recovery_errors(tmp_path):
    # One row that does not fit: nothing left to split.
    trainer = oom_trainer(tmp_path / "one", FitsRows(0), SizeList([8]), oom_recovery=True)
    with pytest.raises(RuntimeError, match="one row ran out of memory"):
        trainer.train()
    # Other errors pass through; without oom_recovery, so does running out of memory.
    with pytest.raises(torch.OutOfMemoryError):
        oom_trainer(tmp_path / "off", FitsRows(3), SizeList([8])).train()
    with pytest.raises(TypeError, match="oom_recovery must be True or False"):
        oom_trainer(tmp_path / "type", Recorder(), SizeList([8]), oom_recovery="yes")


# --------------------------------------------------------------------------------------------- LR
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


# --------------------------------------------------------------------------------------------- gradient statistics
def recorder_loss(net: Recorder, data: PointSet):
    """``ids -> net's mean loss on those samples of data`` (for check_noise_by_hand)."""
    return lambda ids: net(data.x[torch.as_tensor(ids)], data.y[torch.as_tensor(ids)])["loss"]


def test_noise_scale_comes_from_the_micro_batches_exactly(tmp_path):
    """Every step measured: what the controller sees equals McCandlish et al.'s two-batch estimate computed by
    hand from the same micro-batches (small) and the whole step (big) along a plain SGD replay (float64)."""
    data, model = PointSet(64), Recorder()
    spy = StatsSpy([12, 9, 15, 6])
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=spy, model=model, train_dataset=data, noise_every=1,
        args=quiet_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, num_train_epochs=1,
                        **exact_sgd()),
    )
    steps = record_steps(trainer)
    trainer.train()

    micro = [model.seen[i:i + 3] for i in range(0, len(model.seen), 3)]  # 3 forwards (micro-batches) a step
    assert [sum(map(len, m)) for m in micro] == [s.global_size for s in steps]
    reference = Recorder()
    check_noise_by_hand(micro, spy.seen_stats, reference, recorder_loss(reference, data), len(data))
    assert [s["stats/noise_count"] for s in spy.seen_stats] == list(range(1, len(steps) + 1))
    assert "perf/micro_time_b_s" in spy.seen_stats[-1] and spy.seen_stats[-1]["perf/accumulation_steps"] == 3


def test_fp16_grad_scaler_changes_nothing_but_the_scaling(tmp_path, monkeypatch):
    """With fp16 on a GPU, accelerate scales the loss with a GradScaler, so .grad holds scaled gradients until
    its clip_grad_norm_ unscales them; the statistics must divide the scale out. accelerate makes no scaler on
    CPU, so this puts its accelerator in the state fp16 on a GPU gives it (native AMP, mixed precision
    "fp16", a real torch.amp.GradScaler at 2**16; tests/test_cuda.py runs the real thing): with a float64
    model autocast casts nothing, powers of two are exact, and the run must equal the unscaled one bit for
    bit. (accelerate's state is shared by every Accelerator: monkeypatch restores it.)"""
    def run(scaled: bool):
        data, model, spy = PointSet(64), Recorder(), StatsSpy([12, 9, 15, 6])
        trainer = AdaptiveBatchSizeTrainer(
            batch_size_scheduler=spy, model=model, train_dataset=data, noise_every=1,
            args=quiet_args(tmp_path / str(scaled), per_device_train_batch_size=4, gradient_accumulation_steps=3,
                            num_train_epochs=1, **exact_sgd()),
        )
        if scaled:
            accelerator = trainer.accelerator
            monkeypatch.setattr(accelerator.state, "_mixed_precision", "fp16")
            monkeypatch.setattr(accelerator, "native_amp", True)
            monkeypatch.setattr(accelerator, "scaler", torch.amp.GradScaler("cpu"))  # prepare() hands it on
        trainer.train()
        if scaled:
            assert trainer.accelerator.scaler.get_scale() == 2.0**16  # used, never overflowed
        stats = [{k: v for k, v in seen.items() if k.startswith(("stats/", "grad/"))} for seen in spy.seen_stats]
        return stats, [p.detach() for p in model.parameters()]

    plain_stats, plain_weights = run(False)
    scaled_stats, scaled_weights = run(True)
    assert scaled_stats == plain_stats and {"stats/trace_cov", "grad/norm"} <= set(scaled_stats[-1])
    assert all(torch.equal(a, b) for a, b in zip(scaled_weights, plain_weights))


def test_noise_scale_controller_trains_logs_and_resumes(tmp_path):
    """NoiseScale in the Trainer (default period: every 16th step): it decides from measured statistics, the
    log carries noise_scale, and the estimator's state is in each checkpoint."""
    from batchpilot.controllers import NoiseScale

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=NoiseScale(min_size=4, max_size=64, interval=8, min_measurements=2),
        model=Recorder(), train_dataset=PointSet(400),
        args=quiet_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=3,
                        logging_steps=5, save_strategy="epoch", **exact_sgd()),
    )
    steps = record_steps(trainer)
    trainer.train()
    assert trainer.batchpilot.stats.probe.every == 16
    assert trainer.batchpilot.stats.probe.estimator.count == math.ceil(len(steps) / 16)
    assert len({s.global_size for s in steps}) > 1  # it acted on the measurements
    assert any("noise_scale" in h for h in trainer.state.log_history)
    checkpoints = sorted(tmp_path.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    state = json.loads((checkpoints[-1] / "batchpilot_state.json").read_text())
    assert state["stats"]["probe"]["estimator"]["count"] == trainer.batchpilot.stats.probe.estimator.count

    resumed = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=NoiseScale(min_size=4, max_size=64, interval=8, min_measurements=2),
        model=Recorder(), train_dataset=PointSet(400),
        args=quiet_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=3,
                        save_strategy="no", **exact_sgd()),
    )
    resumed.train(resume_from_checkpoint=str(checkpoints[0]))
    assert resumed.batchpilot.stats.probe.estimator.count == trainer.batchpilot.stats.probe.estimator.count


def group_by_step(forwards: list[list[int]], sizes: list[int]) -> list[list[list[int]]]:
    """The forwards' sample ids (one list per forward/backward pass) grouped into steps of ``sizes`` samples."""
    groups, it = [], iter(forwards)
    for size in sizes:
        group: list[list[int]] = []
        while sum(map(len, group)) < size:
            group.append(next(it))
        groups.append(group)
    return groups


def test_one_micro_batch_per_step_is_split_on_measured_steps(tmp_path):
    """One process, gradient_accumulation_steps=1 (seed 003's setting): a measured step runs its micro-batch
    as two passes, the noise scale's small batches; the estimate equals the by-hand one and the weights stay
    those of full-batch SGD."""
    data, model = PointSet(64), Recorder()
    spy = StatsSpy([12, 9, 15, 6])
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=spy, model=model, train_dataset=data, noise_every=1,
        args=quiet_args(tmp_path, per_device_train_batch_size=8, num_train_epochs=1, **exact_sgd()),
    )
    steps = record_steps(trainer)
    trainer.train()
    passes = group_by_step(model.seen, [s.global_size for s in steps])
    assert all(len(p) == 2 for p in passes)  # every step measured, every step in two passes
    reference = Recorder()
    check_noise_by_hand(passes, spy.seen_stats, reference, recorder_loss(reference, data), len(data))
    assert spy.seen_stats[-1]["stats/noise_count"] == len(steps)
    sgd, _ = sgd_reference(data, [s.indices for s in steps])
    for got, want in zip(model.parameters(), sgd.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_gradient_statistics_settings(tmp_path):
    with pytest.raises(ValueError, match="noise_every"):
        AdaptiveBatchSizeTrainer(model=Recorder(), train_dataset=PointSet(20), noise_every=0,
                                 args=quiet_args(tmp_path, gradient_accumulation_steps=2))


# --------------------------------------------------------------------------------------------- resume
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


def test_sync_each_batch_is_refused_only_where_it_breaks_the_statistics(tmp_path):
    from batchpilot.integrations._hf_parts import sync_each_batch_problem

    args = quiet_args(tmp_path, accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}})
    assert "sync_each_batch" in sync_each_batch_problem(args, measure=True, world_size=2)
    assert sync_each_batch_problem(args, measure=False, world_size=2) is None  # no statistics: just slower
    assert sync_each_batch_problem(args, measure=True, world_size=1) is None  # nothing to all-reduce
    assert sync_each_batch_problem(quiet_args(tmp_path), measure=True, world_size=2) is None


class PackedRows(PointSet):
    """Items that a collator packs into one row per micro-batch (as a padding-free collator does)."""


def packed_collate(samples: list[dict]) -> dict:
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}
    return {**batch, "x": batch["x"].reshape(1, -1)}  # one row of n samples' features


class Unpacking(Recorder):
    def forward(self, x, labels=None, sample_id=None):
        return super().forward(x.reshape(-1, 5), labels, sample_id)


def test_the_statistics_count_samples_not_rows(tmp_path):
    # A padding-free collator gives a micro-batch of n samples as one row: the throughput model and the
    # noise scale must see n samples (the loss weights already use the sample count).
    from batchpilot.integrations._hf_parts import split_rows

    assert split_rows(packed_collate([PackedRows(6)[i] for i in range(6)]), None)[0][1] == 1  # 1 row, 6 samples
    trainer = AdaptiveBatchSizeTrainer(
        model=Unpacking(), train_dataset=PackedRows(48), data_collator=packed_collate, noise_every=1,
        args=quiet_args(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=6,
                        **exact_sgd()),
    )
    trainer.train()
    stats = trainer.batchpilot.stats
    assert set(stats.meter.throughput._sizes) == {3}  # micro-batches of 3 samples (each one row)
    assert stats.probe.estimator.count == 6  # every step measured, from two small batches of 3


def test_an_own_train_sampler_is_refused(tmp_path):
    class Weighted(AdaptiveBatchSizeTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.WeightedRandomSampler([1.0] * 20, 20)

    with pytest.raises(ValueError, match="Weighted overrides _get_train_sampler"):
        Weighted(model=Recorder(), train_dataset=PointSet(20), args=quiet_args(tmp_path))


def test_resume_from_a_foreign_checkpoint_fails_clearly(tmp_path):
    from transformers import Trainer

    Trainer(model=Recorder(), train_dataset=PointSet(20),
            args=quiet_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)).train()
    trainer = AdaptiveBatchSizeTrainer(model=Recorder(), train_dataset=PointSet(20), args=quiet_args(tmp_path))
    with pytest.raises(FileNotFoundError, match="has no batchpilot_state.json"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))



def test_a_corrupt_or_foreign_state_file_fails_clearly(tmp_path):
    from batchpilot.integrations._hf_parts import STATE_FILE, read_state, write_state

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


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(auto_find_batch_size=True), "auto_find_batch_size"),
        (dict(logging_steps=0.1), "logging_steps=0.1"),
        (dict(train_sampling_strategy="group_by_length") if SAMPLING_STRATEGY else dict(group_by_length=True),
         "train_sampling_strategy"),
    ],
)
def test_unsupported_arguments_are_rejected(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveBatchSizeTrainer(model=Recorder(), train_dataset=PointSet(20), args=quiet_args(tmp_path, **overrides))


def test_invalid_scheduler_settings_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="min_batch_size=8 is larger than max_batch_size=4"):
        AdaptiveBatchSizeTrainer(model=Recorder(), train_dataset=PointSet(20), args=quiet_args(tmp_path),
                                 min_batch_size=8, max_batch_size=4)
    with pytest.raises(ValueError, match="callable"):
        AdaptiveBatchSizeTrainer(batch_size_scheduler=42, model=Recorder(), train_dataset=PointSet(20),
                                 args=quiet_args(tmp_path))
    # Trainer's positional order would make the model (a callable nn.Module) the scheduler.
    with pytest.raises(TypeError, match="got a torch.nn.Module \\(Recorder\\); pass the model and the rest by keyword"):
        AdaptiveBatchSizeTrainer(Recorder(), quiet_args(tmp_path), train_dataset=PointSet(20))
    with pytest.raises(ValueError, match="must be an instance, got the class Constant"):
        AdaptiveBatchSizeTrainer(batch_size_scheduler=Constant, model=Recorder(), train_dataset=PointSet(20),
                                 args=quiet_args(tmp_path))


def test_a_scheduler_returning_nonsense_is_stopped(tmp_path):
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=lambda step, size: 0, model=Recorder(), train_dataset=PointSet(20),
        args=quiet_args(tmp_path, num_train_epochs=1),
    )
    with pytest.raises(ValueError, match="returned 0"):
        trainer.train()


@pytest.mark.parametrize("module, extra", [("transformers", "hf"), ("lightning", "lightning")])
def test_missing_framework_names_the_extra_and_the_core_never_imports_it(module, extra):
    integration = "hf" if extra == "hf" else "lightning"
    code = (
        "import sys\n"
        "import batchpilot, batchpilot.integrations, batchpilot.controllers, batchpilot.lr\n"
        f"assert {module!r} not in sys.modules, 'the core imported {module}'\n"
        f"sys.modules[{module!r}] = None\n"
        "try:\n"
        f"    import batchpilot.integrations.{integration}\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f'pip install -e ".[{extra}]"' in out.stdout and "which is not installed" in out.stdout


@pytest.mark.parametrize("package, fake, expected", [
    # transformers 5 turns Trainer into a placeholder under torch < 2.6: say so instead of failing later.
    ("torch", "2.5.1+cpu", "needs torch >= 2.6"),
    # The trainer overrides Trainer internals of transformers 5; a 4.x install must be told, not misbehave.
    ("transformers", "4.45.2", "needs transformers >= 5.0, < 6"),
])
def test_the_hf_integration_names_the_versions_it_needs(package, fake, expected):
    code = (f"import {package}\n{package}.__version__ = {fake!r}\ntry:\n    import batchpilot.integrations.hf\n"
            "except ImportError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout and fake in out.stdout


# --------------------------------------------------------------------------------------------- example
def test_example_runs_end_to_end(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "hf_text_classification.py"), "--output-dir", str(tmp_path),
         "--epochs", "2", "--train-samples", "120", "--eval-samples", "40", "--interval", "5", "--max-size", "16"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["samples_seen"] == 240 and summary["epochs"] == 2.0 and summary["final_batch_size"] > 4


# --------------------------------------------------------------------------------------------- torchrun
def torchrun(out: Path, *args: str, restarts: int = 0, env: dict | None = None) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           f"--max-restarts={restarts}", str(REPO / "tests" / "_hf_ddp.py"), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.distributed
def test_torchrun_two_ranks_match_a_single_process_reference(tmp_path):
    ranks = torchrun(tmp_path / "ddp")
    assert [r["world_size"] for r in ranks] == [2, 2]
    sizes = [[s["size"] for s in r["steps"]] for r in ranks]
    assert sizes[0] == sizes[1]  # every rank ran every step at the same global size
    assert any(s["ghosts"] for r in ranks for s in r["steps"])
    per_epoch = collections.defaultdict(list)
    for r in ranks:
        for s in r["steps"]:
            per_epoch[s["epoch"]].extend(s["ids"])
    assert sorted(per_epoch) == [0, 1] and all(sorted(ids) == list(range(61)) for ids in per_epoch.values())
    assert ranks[0]["weights"] == ranks[1]["weights"]
    global_batches = [s0["ids"] + s1["ids"] for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"])]
    reference, _ = sgd_reference(PointSet(61), global_batches)
    for got, want in zip(ranks[0]["weights"], reference.parameters()):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want.detach(), rtol=0, atol=1e-13)


@pytest.mark.distributed
@pytest.mark.parametrize("compiled", [False, True])
def test_torchrun_noise_scale_from_the_ranks_and_micro_batches(tmp_path, compiled):
    """2 gloo ranks x 2 micro-batches, every step measured: the four micro-batches of a step are the small
    batches (each rank's last one read inside DDP's all-reduce by the communication hook), the step the big
    one; what rank 0's controller saw equals the estimate computed by hand along a plain SGD replay. With
    ``torch_compile`` accelerate wraps the DDP model in a compiled module, where the hook must still go."""
    ranks = torchrun(tmp_path / "noise", "--noise", *(["--compile"] if compiled else []))
    assert ranks[0]["wrapped"] == ("OptimizedModule" if compiled else "DistributedDataParallel")
    data, steps = PointSet(64), ranks[0]["steps"]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    micro = [[ids for r in ranks for ids in r["micro"][2 * k:2 * k + 2]] for k in range(len(steps))]  # 2 per rank
    assert [sum(map(len, m)) for m in micro] == [s["size"] for s in steps]
    reference = Recorder()
    check_noise_by_hand(micro, ranks[0]["stats"], reference, recorder_loss(reference, data), len(data))


@pytest.mark.distributed
def test_torchrun_max_micro_batch_size_keeps_gradients_and_statistics(tmp_path):
    """2 gloo ranks, micro-batches of up to 4 rows run one row at a time: the passes but the last of each
    step accumulate under no_sync (else DDP's hook would see each pass and the statistics would be wrong),
    the statistics equal the by-hand estimate over every pass of both ranks, and the weights the uncut run's."""
    whole = torchrun(tmp_path / "whole", "--noise")
    cut = torchrun(tmp_path / "cut", "--noise", "--max-micro", "1")
    assert max(len(ids) for r in whole for ids in r["micro"]) == 4
    assert max(len(ids) for r in cut for ids in r["micro"]) == 1
    steps = cut[0]["steps"]
    assert [s["ids"] for s in steps] == [s["ids"] for s in whole[0]["steps"]]
    shares = [[len(s["ids"]) for s in r["steps"]] for r in cut]
    per_rank = [group_by_step(r["micro"], share) for r, share in zip(cut, shares)]
    data, reference = PointSet(64), Recorder()
    check_noise_by_hand([a + b for a, b in zip(*per_rank)], cut[0]["stats"], reference,
                        recorder_loss(reference, data), len(data))
    assert cut[0]["weights"] == cut[1]["weights"]
    for got, want in zip(cut[0]["weights"], whole[0]["weights"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-13)


@pytest.mark.distributed
def test_torchrun_refuses_oom_recovery_on_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests" / "_hf_ddp.py"), str(tmp_path), "--oom-recovery"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "oom_recovery=True needs one process (world size 2 here)" in proc.stderr


@pytest.mark.distributed
def test_torchrun_restart_after_a_failure_resumes_exactly(tmp_path):
    """Rank 1 dies after step 9 of the first attempt; torchrun restarts both ranks, which resume from
    checkpoint-8 (with init_torchrun and 2 dataloader workers) and finish like a run that never failed."""
    clean = torchrun(tmp_path / "clean", "--save-steps", "4")
    failed = torchrun(tmp_path / "failed", "--save-steps", "4", "--fail-at-step", "9", "--workers", "2",
                      restarts=1, env={"BATCHPILOT_INIT_TORCHRUN": "1"})
    assert failed[0]["resumed_from"].endswith("checkpoint-8")
    for a, b in zip(clean, failed):
        assert [(s["size"], s["ids"]) for s in a["steps"][8:]] == [(s["size"], s["ids"]) for s in b["steps"]]
        assert a["weights"] == b["weights"]

    # The same 2-rank checkpoint resumed by a single process: positions are global, so the rest is the same.
    model = Recorder()
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=SizeList(SIZES), model=model, train_dataset=PointSet(61),
        args=quiet_args(tmp_path / "one", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        num_train_epochs=2, seed=3, **exact_sgd()),  # the script's seed: the same data order
    )
    steps = record_steps(trainer)
    trainer.train(resume_from_checkpoint=str(tmp_path / "clean" / "ckpt" / "checkpoint-8"))
    rest = list(zip(clean[0]["steps"][8:], clean[1]["steps"][8:]))
    assert [s.global_size for s in steps] == [a["size"] for a, _ in rest]
    assert [sorted(s.indices.tolist()) for s in steps] == [sorted(a["ids"] + b["ids"]) for a, b in rest]
    for got, want in zip(model.parameters(), clean[0]["weights"]):
        torch.testing.assert_close(got.detach(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-13)
