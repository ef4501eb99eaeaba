"""The ``markov`` workload: which Markov chain wrote this sequence? A GRU reads 64 symbols and answers.

Data (generated locally from the data seed, nothing downloaded, ~2 s): ten classes, each a Markov chain over
8 symbols. The chains share most of their transitions: class ``c``'s transition matrix is
``(1 - eps) T_0 + eps T_c`` with ``T_0`` and ``T_c`` random stochastic matrices (rows drawn uniformly from the
simplex) and ``eps = 0.5``; the first symbol is uniform. A sequence is 64 steps of its class's chain, so
every step carries a little evidence and a classifier has to add it up over the whole sequence. The
Bayes-optimal classifier (the chains' log-likelihoods, :func:`bayes_accuracy`) gets 96.6% on the test set of
data seed 42; the workload's target, 0.92, asks for most of the way there.

Model: embedding (8 -> 16), one GRU layer (hidden 256), a linear head on the last hidden state; ~213k
parameters. Trained with Adam and the square-root LR rule from lr 0.001 at batch 32, like ``seqsum``.

Why it is here: the other workloads reach their targets in seconds, so a fixed cost such as ``auto``'s
start probes weighs heavily in their times to target; here a good static batch needs most of a minute on 2
CPU cores. And a recurrent model has its own throughput curve: 64 sequential cell steps per sample make a
step mostly fixed cost at small batches, and past a few hundred samples the CPU's throughput falls again.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from .seeding import seeded_model

__all__ = ["MARKOV_CLASSES", "MARKOV_LENGTH", "MARKOV_SYMBOLS", "MarkovGRU", "bayes_accuracy", "markov_chains",
           "markov_data", "markov_gru"]

MARKOV_CLASSES, MARKOV_SYMBOLS, MARKOV_LENGTH = 10, 8, 64


def _simplex_rows(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Rows drawn uniformly from the probability simplex (normalised exponentials: Dirichlet(1, ..., 1))."""
    x = -torch.log1p(-torch.rand(*shape, generator=g, dtype=torch.float64))
    return x / x.sum(-1, keepdim=True)


def markov_chains(g: torch.Generator, classes: int = MARKOV_CLASSES, symbols: int = MARKOV_SYMBOLS,
                  eps: float = 0.5) -> torch.Tensor:
    """Transition matrices ``(classes, symbols, symbols)``: a shared part and ``eps`` of each class's own."""
    shared = _simplex_rows(g, symbols, symbols)
    return (1 - eps) * shared + eps * _simplex_rows(g, classes, symbols, symbols)


def _sample(g: torch.Generator, chains: torch.Tensor, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences: a class each (uniform), a uniform first symbol, then the class's chain."""
    classes, symbols, _ = chains.shape
    y = torch.randint(0, classes, (n,), generator=g)
    u = torch.rand(n, length, generator=g, dtype=torch.float64)
    cdf = chains.cumsum(-1).reshape(classes * symbols, symbols)
    cdf[:, -1] = 1.0  # rounding must not leave a u above the last bin
    x = torch.empty(n, length, dtype=torch.long)
    x[:, 0] = (u[:, 0] * symbols).long().clamp_max(symbols - 1)
    rows = y * symbols
    for t in range(1, length):  # inverse-CDF sampling, all sequences at once
        x[:, t] = (u[:, t : t + 1] > cdf[rows + x[:, t - 1]]).sum(1).clamp_max(symbols - 1)
    return x, y


def markov_data(seed: int, n_train: int = 60_000, n_test: int = 4_096, length: int = MARKOV_LENGTH,
                eps: float = 0.5) -> tuple[TensorDataset, TensorDataset]:
    """The workload's ``(train, test)``, a deterministic function of ``seed`` (``eps``: each class's own share of
    its transition matrix; smaller is harder).

    Shapes: x (N, length) int64 symbols 0..7, y (N,) int64 classes 0..9.
    """
    g = torch.Generator().manual_seed(seed)
    chains = markov_chains(g, eps=eps)
    return TensorDataset(*_sample(g, chains, n_train, length)), TensorDataset(*_sample(g, chains, n_test, length))


def bayes_accuracy(seed: int, data: TensorDataset, eps: float = 0.5) -> float:
    """Accuracy of the Bayes-optimal classifier on ``data`` (made by :func:`markov_data` with ``seed`` and ``eps``):
    the class whose chain gives the sequence the highest likelihood (the first symbol is uniform, so it does not
    count)."""
    chains = markov_chains(torch.Generator().manual_seed(seed), eps=eps).log()
    x, y = data.tensors
    score = torch.stack([chains[:, x[:, t - 1], x[:, t]] for t in range(1, x.shape[1])]).sum(0)  # (classes, N)
    return float((score.argmax(0) == y).double().mean())


class MarkovGRU(nn.Module):
    """Symbols (N, L) -> embedding (N, L, 16) -> GRU (hidden 256) -> last hidden state -> (N, 10) logits."""

    def __init__(self, hidden: int = 256, embed: int = 16, symbols: int = MARKOV_SYMBOLS,
                 classes: int = MARKOV_CLASSES) -> None:
        super().__init__()
        self.embed = nn.Embedding(symbols, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, last = self.gru(self.embed(x))
        return self.head(last[-1])


def markov_gru(seed: int) -> nn.Module:
    """The workload's GRU with weights initialised from ``seed``."""
    return seeded_model(seed, MarkovGRU)
