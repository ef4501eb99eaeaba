"""AdaptiveBatchSizeTrainer's gradient statistics: what a controller sees equals a by-hand two-batch
noise-scale estimate (micro-batches, or a measured step's two passes), under an fp16 GradScaler too; a
NoiseScale controller acts on them, and they survive a resume.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import PointSet, Recorder, StatsSpy, check_noise_by_hand
from _hf_helpers import exact_sgd, group_by_step, quiet_args, record_steps, recorder_loss, sgd_reference

from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer


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


def test_sync_each_batch_is_refused_only_where_it_breaks_the_statistics(tmp_path):
    from batchpilot.integrations.hf.checks import sync_each_batch_problem

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
    from batchpilot.integrations.hf.data import split_rows

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

