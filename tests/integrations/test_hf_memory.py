"""AdaptiveBatchSizeTrainer's memory bound: ``max_micro_batch_size`` cuts micro-batches into passes with
exact gradients and statistics; ``oom_recovery`` runs a step that ran out of memory again in smaller passes,
and the run equals one that had that bound from the start (also across a resume).
"""

from __future__ import annotations

import collections

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import PointSet, Recorder, SizeList, StatsSpy, check_noise_by_hand
from _hf_helpers import SIZES, exact_sgd, group_by_step, quiet_args, record_steps, recorder_loss, sgd_reference

from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer


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
    from batchpilot.integrations.hf.data import split_rows

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

