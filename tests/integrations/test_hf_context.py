"""ContextSchedule in AdaptiveBatchSizeTrainer: a DataScore attached to the trainer reads the samples the next step
trains (with dataloader workers and accelerate's look-ahead too), a resumed run decides from the same context
(bitwise weights), the context in token budgets, and a provider read before training fails clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _curriculum import RULE, expected_sizes
from _hf_common import PointSet, Recorder
from _hf_helpers import exact_sgd, quiet_args, record_steps

from batchpilot.controllers import ContextSchedule, DataMix, DataScore, task_aware_scheduler
from batchpilot.data import AdaptiveBatchSampler
from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

N = 61


def scores() -> np.ndarray:
    return np.random.default_rng(4).random(N)


def build(out, difficulty: DataScore, **overrides) -> AdaptiveBatchSizeTrainer:
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=ContextSchedule(RULE, difficulty, key="difficulty"), model=Recorder(),
        train_dataset=PointSet(N), args=quiet_args(out, per_device_train_batch_size=4, num_train_epochs=2,
                                                   **exact_sgd(), **overrides))
    difficulty.attach(trainer)
    return trainer


@pytest.mark.parametrize("workers", [0, 2])
def test_the_trainer_decides_from_the_difficulty_of_the_next_samples(tmp_path, workers):
    difficulty = DataScore(scores(), key="difficulty")
    trainer = build(tmp_path, difficulty, dataloader_num_workers=workers)
    steps = record_steps(trainer)
    trainer.train()
    assert [s.global_size for s in steps] == expected_sizes(4, 2, scores())
    assert len({s.global_size for s in steps}) > 4 and trainer.batchpilot.samples_seen == 2 * N
    assert trainer.batchpilot.driver.controller.reason.startswith("difficulty=")


def test_a_resumed_trainer_decides_from_the_same_context(tmp_path):
    full = build(tmp_path / "full", DataScore(scores(), key="difficulty"))
    full_steps = record_steps(full)
    full.train()
    part = build(tmp_path / "part", DataScore(scores(), key="difficulty"), save_strategy="steps", save_steps=9,
                 max_steps=9)
    part.train()
    rest = build(tmp_path / "part", DataScore(scores(), key="difficulty"))
    rest_steps = record_steps(rest)
    rest.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-9"))
    assert [s.global_size for s in rest_steps] == [s.global_size for s in full_steps[9:]]
    for a, b in zip(full.model.parameters(), rest.model.parameters()):
        assert torch.equal(a, b)


def test_in_token_budgets_the_mix_is_that_of_the_next_budgets_samples(tmp_path):
    lengths = np.random.default_rng(2).integers(1, 7, N)
    tasks = np.where(np.arange(N) % 2 == 0, "task_a", "task_b")
    mix, seen = DataMix(tasks, key="task_ratios"), []

    def rule(step, size, ratios):
        seen.append(ratios["task_a"])
        return task_aware_scheduler(step, size, ratios, min_size=8, max_size=40)

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=ContextSchedule(rule, mix, key="task_ratios"), model=Recorder(),
        train_dataset=PointSet(N), batch_size=20, batch_unit="tokens", lengths=lengths.tolist(),
        args=quiet_args(tmp_path, num_train_epochs=1, **exact_sgd()))
    mix.attach(trainer)
    steps = record_steps(trainer)
    trainer.train()
    order = AdaptiveBatchSampler(N, 1, seed=0).order(0)
    for share, step in zip(seen, steps[1:]):  # the decision after step k read step k+1's samples
        ids = order[step.offset:step.offset + step.global_size]
        assert sorted(ids.tolist()) == sorted(step.indices.tolist())
        assert share == pytest.approx(float(np.mean(tasks[ids] == "task_a")))


def test_a_provider_read_before_training_says_so(tmp_path):
    difficulty = DataScore(scores(), key="difficulty")
    build(tmp_path, difficulty)
    with pytest.raises(RuntimeError, match="no training run yet"):
        difficulty()
