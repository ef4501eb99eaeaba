"""ContextSchedule in a real ``lightning.Trainer`` fit: a DataScore attached to the loader the AdaptiveBatchSize
callback made decides from the difficulty of the samples the next step trains (sizes worked out by hand)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("lightning")

import lightning as L
from _curriculum import RULE, expected_sizes
from _lightning_ddp import NUM_SAMPLES, Model, make_data

from batchpilot.controllers import ContextSchedule, DataScore
from batchpilot.integrations.lightning import AdaptiveBatchSize


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
    expected = expected_sizes(4, 2, scores, seed=1)  # the model's loader uses seed=1
    assert [s["size"] for s in model.steps] == expected
    assert len(set(expected)) > 4
