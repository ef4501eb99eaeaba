"""A token-level task for the token-budget tests of AdaptiveBatchSizeTrainer (test_hf_tokens*.py and the torchrun
script _hf_tokens_ddp.py): variable-length sequences, a padding collator, a float64 per-token classifier."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

N, VOCAB = 40, 11


class Sequences(Dataset):
    """Variable-length token sequences (2 to 14 tokens), each token's label the next token mod VOCAB."""

    def __init__(self, n: int = N, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.seqs = [rng.integers(0, VOCAB, int(rng.integers(2, 15))) for _ in range(n)]
        self.lengths = [len(s) for s in self.seqs]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict:
        ids = torch.as_tensor(self.seqs[i])
        return {"input_ids": ids, "labels": (ids * 3 + 1) % VOCAB, "sample_id": torch.tensor(i)}


def pad(samples: list[dict]) -> dict:
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])] = s["input_ids"]
        labels[row, :len(s["labels"])] = s["labels"]
    batch = {"input_ids": ids, "labels": labels}
    if "sample_id" in samples[0]:  # (Trainer removed it where the model does not take it)
        batch["sample_id"] = torch.stack([s["sample_id"] for s in samples])
    return batch


class TokenNet(torch.nn.Module):
    """Per-token classifier, float64; its loss is the mean over the micro-batch's labelled tokens. Records the
    sample ids and the tokens of every forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 6).double()
        self.out = torch.nn.Linear(6, VOCAB).double()
        self.seen: list[list[int]] = []
        self.tokens: list[int] = []

    def forward(self, input_ids, labels=None, sample_id=None):
        if self.training and sample_id is not None:
            self.seen.append(sample_id.tolist())
            self.tokens.append(int((labels != -100).sum()))
        logits = self.out(torch.tanh(self.emb(input_ids)))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def sgd_reference(data: Sequences, steps: list[list[int]]) -> TokenNet:
    """Plain SGD (lr 0.1) on each global batch's mean loss per token (``steps``: each step's dataset indices)."""
    net = TokenNet()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for ids in steps:
        optimizer.zero_grad()
        batch = pad([data[i] for i in ids])
        batch.pop("sample_id")
        net(**batch)["loss"].backward()  # one forward over the whole global batch: the mean over all its tokens
        optimizer.step()
    return net
