"""Trainer settings and plain-SGD references shared by the tests of AdaptiveBatchSizeTrainer (test_hf_*.py).

Import it after ``pytest.importorskip("transformers")``: it imports transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from _hf_common import PointSet, Recorder
from transformers import TrainerCallback, TrainingArguments

from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

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


def collate_fn(samples: list[dict]) -> dict:
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}


def recorder_loss(net: Recorder, data: PointSet):
    """``ids -> net's mean loss on those samples of data`` (for check_noise_by_hand)."""
    return lambda ids: net(data.x[torch.as_tensor(ids)], data.y[torch.as_tensor(ids)])["loss"]


def group_by_step(forwards: list[list[int]], sizes: list[int]) -> list[list[list[int]]]:
    """The forwards' sample ids (one list per forward/backward pass) grouped into steps of ``sizes`` samples."""
    groups, it = [], iter(forwards)
    for size in sizes:
        group: list[list[int]] = []
        while sum(map(len, group)) < size:
            group.append(next(it))
        groups.append(group)
    return groups

