"""Models whose initial weights are a function of a seed alone, for every workload."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["seeded_model"]


def seeded_model(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` under a private copy of torch's CPU RNG seeded with ``seed``: building a model neither depends
    on nor disturbs the caller's global random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()
