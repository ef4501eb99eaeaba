"""The ``gpt`` workload's model, loss and metric: a small decoder-only transformer on bytes.

Model (:class:`TinyGPT`, nanoGPT-like, after Radford et al. 2019's GPT-2 layout): token and learned position
embeddings, ``layers`` pre-LayerNorm blocks (causal self-attention through ``torch.nn.functional.
scaled_dot_product_attention(is_causal=True)``, then a 4x GELU MLP, each added to the residual stream), a final
LayerNorm, and the output projection tied to the token embedding (Press & Wolf 2017). The defaults, 2 layers,
width 64, 4 heads, context 64, have ~121k parameters: sized for 2 CPU cores (~60k tokens/s on one busy core). The embedding has one row more
than the vocabulary, the padding input :data:`~batchpilot.bench.gpt_data.PAD`; the tied output covers the 256
bytes only, so padding is never predicted. Padding sits after a sample's last byte and attention is causal, so a
real position never sees it. ``forward`` drops the columns that are padding in every row of the batch, so a
batch of short samples costs what its longest sample costs, not the full context.

Loss (:func:`gpt_loss`): next-byte cross-entropy over the positions whose target is not
:data:`~batchpilot.bench.gpt_data.IGNORE`, summed over tokens (``Pilot(batch_unit="tokens", loss_reduction="sum")``
divides by the tokens of the global batch) or averaged (:func:`gpt_mean_loss`).

Metric (:func:`gpt_score`): the validation loss ``L`` (mean cross-entropy per validation token, nats) reported as
``exp(-L)``, the geometric-mean probability the model gives the true next byte (1 / perplexity). It rises as the
loss falls, so the bench's "accuracy" machinery (the target is reached at the first evaluation at or above it)
applies unchanged: a validation-loss target ``L*`` is the score target ``exp(-L*)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from .gpt_data import GPT_CONTEXT, IGNORE, PAD, VOCAB, token_lengths
from .seeding import seeded_model

__all__ = ["TinyGPT", "gpt_loss", "gpt_mean_loss", "gpt_model", "gpt_optimizer", "gpt_pilot_settings", "gpt_score",
           "validation_loss", "GPT_TARGET_LOSS", "GPT_TARGET_SCORE", "GPT_QUICK_TARGET_LOSS", "GPT_QUICK_TARGET_SCORE"]

GPT_TARGET_LOSS = 1.8
"""The workload's target: validation loss (nats per byte) set from dev-seed runs (docs/benchmark.md, gpt)."""
GPT_QUICK_TARGET_LOSS = 2.1
GPT_TARGET_SCORE = math.exp(-GPT_TARGET_LOSS)
GPT_QUICK_TARGET_SCORE = math.exp(-GPT_QUICK_TARGET_LOSS)


class _Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, c / heads)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Bytes (N, T) int64 (padded with ``PAD``) -> next-byte logits (N, T', 256), ``T'`` the longest sample."""

    def __init__(self, layers: int = 2, width: int = 64, heads: int = 4, context: int = GPT_CONTEXT) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} is not divisible by heads={heads}; pick a width that is.")
        self.context = context
        self.embed = nn.Embedding(VOCAB + 1, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        for name, p in self.named_parameters():  # GPT-2's initialisation: N(0, 0.02), residual outputs / sqrt(2L)
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.context:
            raise ValueError(f"a sequence of {x.shape[1]} tokens is longer than the context ({self.context}).")
        real = (x != PAD).any(dim=0).nonzero()
        x = x[:, : int(real[-1]) + 1] if len(real) else x[:, :1]  # drop the all-padding columns
        h = self.embed(x) + self.position(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.ln(h) @ self.embed.weight[:VOCAB].T  # tied output, padding never predicted


def gpt_model(seed: int) -> nn.Module:
    """The workload's :class:`TinyGPT` with weights initialised from ``seed``."""
    return seeded_model(seed, TinyGPT)


def gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum over the real tokens of the next-byte cross-entropy (``y`` padded with ``IGNORE``; ``logits`` may have
    fewer columns than ``y``: the padding ``TinyGPT`` dropped)."""
    y = y[:, : logits.shape[1]]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE, reduction="sum")


def gpt_mean_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """:func:`gpt_loss` divided by the micro-batch's real tokens (the mean per token)."""
    return gpt_loss(logits, y) / (y != IGNORE).sum().clamp_min(1)


def validation_loss(model: nn.Module, data: TensorDataset, chunk: int = 512) -> float:
    """Mean cross-entropy per token (nats) of ``model`` on ``data`` (eval mode, no gradients)."""
    x, y = data.tensors
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(y), chunk):
            total += float(gpt_loss(model(x[i : i + chunk]), y[i : i + chunk]))
            tokens += int((y[i : i + chunk] != IGNORE).sum())
    model.train(was_training)
    return total / max(tokens, 1)


def gpt_score(model: nn.Module, data: TensorDataset) -> float:
    """The bench's metric for ``gpt``: ``exp(-validation loss)`` (module docstring)."""
    return math.exp(-validation_loss(model, data))


def gpt_optimizer(params, lr: float) -> torch.optim.Optimizer:
    """AdamW with GPT-style betas (0.9, 0.95) and no weight decay (the runs are a few epochs at most)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def gpt_pilot_settings(train: TensorDataset) -> dict[str, Any]:
    """The ``Pilot`` arguments of every ``gpt`` run: global batches counted in tokens (each sample's count from
    :func:`~batchpilot.bench.gpt_data.token_lengths`), and the loss given as a sum over tokens, which the Pilot
    divides by the global batch's tokens (the exact per-token mean of the step)."""
    return {"batch_unit": "tokens", "lengths": token_lengths(train), "loss_reduction": "sum"}
