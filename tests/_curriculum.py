"""Seed 003's curriculum rule as the context tests use it, and the sizes it must give, computed by hand (shared by
tests/integrations/test_hf_context.py and tests/controllers/test_context_lightning.py)."""

from __future__ import annotations

import functools

import numpy as np

from batchpilot.controllers import curriculum_scheduler
from batchpilot.data import AdaptiveBatchSampler

RULE = functools.partial(curriculum_scheduler, threshold=0.5, min_size=2, max_size=12)


def expected_sizes(first: int, epochs: int, difficulty: np.ndarray, seed: int = 0) -> list[int]:
    """By hand: after each step, the curriculum rule on the mean difficulty of the next `size` samples (the
    sampler's order with ``seed``, over ``len(difficulty)`` samples)."""
    n = len(difficulty)
    order = AdaptiveBatchSampler(n, 1, seed=seed).order
    sizes, size, step = [], first, 0
    for epoch in range(epochs):
        offset = 0
        while offset < n:
            sizes.append(min(size, n - offset))
            offset += sizes[-1]
            step += 1
            e, o = (epoch + 1, 0) if offset == n else (epoch, offset)
            window = order(e)[o:o + size]
            size = RULE(step, size, float(np.mean(difficulty[window])))
    return sizes
