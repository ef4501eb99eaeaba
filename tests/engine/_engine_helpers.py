"""The small classification problem the engine's test files share."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def make_problem(n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()
    return TensorDataset(x.double(), y), model
