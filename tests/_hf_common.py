"""Tiny models, datasets and controllers shared by the HF and Lightning tests and the torchrun scripts.

Nothing here downloads anything: models are built from configs, text is generated from a hand-made vocabulary.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

import batchpilot


class PointSet(Dataset):
    """``n`` float64 points with a binary label and their own index (``sample_id``), as dicts."""

    def __init__(self, n: int, dim: int = 5, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g, dtype=torch.float64)
        self.y = (self.x[:, 0] - self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i], "sample_id": torch.tensor(i)}


class Recorder(torch.nn.Module):
    """A float64 MLP that records which samples each training forward saw (``seen``: one list per call)."""

    def __init__(self, dim: int = 5, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
        self.seen: list[list[int]] = []

    def forward(self, x, labels=None, sample_id=None):
        if self.training and sample_id is not None:
            self.seen.append(sample_id.tolist())
        logits = self.net(x)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


class SizeList:
    """A controller that replays ``sizes`` (rank 0 only ever calls it); resumable."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes, self.i = list(sizes), 0

    def decide(self, obs: batchpilot.Observation) -> int:
        size = self.sizes[self.i % len(self.sizes)]
        self.i += 1
        return size

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, state: dict) -> None:
        self.i = state["i"]


class FailingSizeList(SizeList):
    """Replays ``sizes``, but its decision number ``fail_at`` raises (the count does not advance)."""

    def __init__(self, sizes: list[int], fail_at: int) -> None:
        super().__init__(sizes)
        self.fail_at = fail_at

    def decide(self, obs: batchpilot.Observation) -> int:
        if self.i == self.fail_at:
            raise RuntimeError("controller failure")
        return super().decide(obs)


class StatsSpy(SizeList):
    """Replays ``sizes`` and records the statistics every decision saw; it reads the noise scale."""

    required_stats = ("stats/noise_scale",)

    def __init__(self, sizes: list[int]) -> None:
        super().__init__(sizes)
        self.seen_stats: list[dict] = []

    def decide(self, obs):
        self.seen_stats.append(dict(obs.stats))
        return super().decide(obs)


VOCAB = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "good", "great", "fine", "nice", "bad", "awful", "poor", "sad",
         "the", "a", "movie", "film", "was", "is", "very", "plot", "acting", "story", "quite", "really"]


class SentimentText(Dataset):
    """Generated sentences over :data:`VOCAB`, tokenised by hand; label 1 when positive words outnumber
    negative ones. Items are dicts of ``input_ids``, ``attention_mask`` (padded to ``length``) and ``labels``."""

    def __init__(self, n: int, length: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        neutral = torch.arange(12, len(VOCAB))
        self.ids = torch.zeros(n, length, dtype=torch.long)
        self.mask = torch.zeros(n, length, dtype=torch.long)
        self.labels = torch.zeros(n, dtype=torch.long)
        for i in range(n):
            words = int(torch.randint(4, length - 1, (1,), generator=g))
            sentiment = torch.randint(0, 2, (1,), generator=g).item()
            tokens = neutral[torch.randint(0, len(neutral), (words,), generator=g)]
            polar = torch.randint(4, 8, (2,), generator=g) if sentiment else torch.randint(8, 12, (2,), generator=g)
            tokens[torch.randperm(words, generator=g)[:2]] = polar
            row = torch.cat([torch.tensor([1]), tokens, torch.tensor([2])])
            self.ids[i, : len(row)] = row
            self.mask[i, : len(row)] = 1
            self.labels[i] = sentiment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def tiny_bert(seed: int = 0):
    """A 1-layer BERT classifier built from a config (no download)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=2,
    )
    return BertForSequenceClassification(config)


def check_noise_by_hand(micro_per_step: list, seen_stats: list[dict], net: torch.nn.Module, loss_of,
                        population: int) -> None:
    """Replay plain SGD (lr 0.1) of ``net``; at each step feed McCandlish et al.'s two-batch estimate by hand
    (small: the micro-batches' gradients, big: the step's) and compare it with what the controller saw after
    that step. ``micro_per_step[k]`` lists step k's micro-batches as sample ids (empty: a ghost);
    ``loss_of(ids)`` is the mean loss of those samples under ``net``; ``population``: the dataset's size
    (steps are drawn from it without replacement, and the estimate is corrected for that)."""
    import pytest

    from batchpilot.stats import NoiseScaleEstimator

    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    estimator = NoiseScaleEstimator(ema_decay=0.99 ** (1 / 4))  # the probe's decay at noise_every=1

    def grad(ids: list[int]) -> torch.Tensor:
        net.zero_grad()
        loss_of(ids).backward()
        return torch.cat([p.grad.flatten() for p in net.parameters()]).clone()

    assert len(seen_stats) == len(micro_per_step)
    for k, parts in enumerate(micro_per_step):
        parts = [ids for ids in parts if ids]
        small = [grad(ids) for ids in parts]
        big = grad([i for ids in parts for i in ids])  # left in .grad for the SGD step below
        sizes = [len(ids) for ids in parts]
        b_small = len(sizes) / sum(1 / n for n in sizes)
        if sum(sizes) > b_small:  # a step with one non-empty micro-batch has no second size: not measured
            estimator.update(b_small, sum(float(g @ g) for g in small) / len(sizes), sum(sizes), float(big @ big),
                             population=population if sum(sizes) <= population else None)
        want, got = estimator.metrics(), seen_stats[k]
        for key in ("stats/noise_scale", "stats/grad_sq_norm", "stats/trace_cov"):
            assert (key in got) == (key in want), (k, key)
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-9), (k, key)
        optimizer.step()
    assert "stats/noise_scale" in seen_stats[-1]
