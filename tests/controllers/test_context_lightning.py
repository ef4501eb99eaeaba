"""ContextSchedule in a real ``lightning.Trainer`` fit: a DataScore attached to the loader the AdaptiveBatchSize
callback made decides from the difficulty of the samples the next step trains (sizes worked out by hand)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

pytest.importorskip("lightning")

import lightning as L
from _lightning_ddp import NUM_SAMPLES, Model, make_data

from batchpilot.controllers import ContextSchedule, DataScore, curriculum_scheduler
from batchpilot.data import AdaptiveBatchSampler
from batchpilot.integrations.lightning import AdaptiveBatchSize

RULE = functools.partial(curriculum_scheduler, threshold=0.5, min_size=2, max_size=12)


class Curriculum(Model):
    """The test model, whose loader also feeds the difficulty provider."""

    def __init__(self, adaptive, data, provider):
        super().__init__(adaptive, data, val=False)
        self.provider = provider

    def train_dataloader(self):
        loader = super().train_dataloader()
        self.provider.attach(loader)
        return loader


def test_a_lightning_fit_decides_from_the_difficulty_of_the_next_samples(tmp_path):
    scores = np.random.default_rng(5).random(NUM_SAMPLES)
    difficulty = DataScore(scores, key="difficulty")
    adaptive = AdaptiveBatchSize(ContextSchedule(RULE, difficulty, key="difficulty"), batch_size=4)
    model = Curriculum(adaptive, make_data(), difficulty)
    L.Trainer(max_epochs=2, accelerator="cpu", devices=1, callbacks=[adaptive], logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=str(tmp_path), num_sanity_val_steps=0).fit(model)
    order = AdaptiveBatchSampler(NUM_SAMPLES, 1, seed=1).order  # the model's loader uses seed=1
    expected, size, step = [], 4, 0
    for epoch in range(2):
        offset = 0
        while offset < NUM_SAMPLES:
            expected.append(min(size, NUM_SAMPLES - offset))
            offset += expected[-1]
            step += 1
            e, o = (epoch + 1, 0) if offset == NUM_SAMPLES else (epoch, offset)
            window = order(e)[o:o + size]
            size = RULE(step, size, float(np.mean(scores[window])))
    assert [s["size"] for s in model.steps] == expected
    assert len(set(expected)) > 4
