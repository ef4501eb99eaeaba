"""Data and models of the ``digits`` and ``seqsum`` workloads (the registry is in :mod:`.workloads`).

* ``digits``: scikit-learn's bundled ``load_digits`` (1,797 8x8 greyscale digits, shipped with the
  package: nothing is downloaded) and an MLP. A third of the images (599, split by the data seed) is the
  test set, untouched. The other 1,198 are augmented so that an epoch has enough steps at large batch
  sizes: every image is shifted by -1, 0 and +1 pixel in x and y (9 versions, the vacated row/column
  set to 0) and each version is copied ``copies`` times with Gaussian pixel noise (sigma ``noise`` on the
  0..1 scale, clipped): 1,198 x 9 x 3 = 32,346 training samples by default. An MLP on 64 pixels is cheap
  per sample, so the time of a step is mostly fixed cost and throughput keeps rising with the batch
  size well past 512: the opposite of the MNIST-1D CNN.
* ``seqsum``: a generated sequence task for a small transformer. Each input is 16 digits drawn uniformly;
  the label says whether the first 8 sum to more than the last 8 (ties are redrawn, so the classes are
  balanced). The model embeds tokens and learned positions (d_model 32), runs two
  ``nn.TransformerEncoderLayer`` (4 heads, feed-forward 64, no dropout), mean-pools and classifies. It
  is trained with Adam and the square-root LR rule (Malladi et al. 2022), unlike the SGD workloads.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .._extras import install_hint
from .seeding import seeded_model

__all__ = ["DigitsMLP", "SeqSumTransformer", "digits_data", "digits_mlp", "seqsum_data", "seqsum_transformer"]


# ------------------------------------------------------------------------------------------- digits
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the digits workload needs scikit-learn (its bundled load_digits data), an optional extra of "
            f"batchpilot; install it with: {install_hint('bench')}"
        ) from exc
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int64)


def _shift(images: np.ndarray, dx: int, dy: int) -> np.ndarray:
    """Shift (N, 8, 8) images by dx columns and dy rows, filling the vacated edge with 0."""
    out = np.zeros_like(images)
    h, w = images.shape[1:]
    out[:, max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        images[:, max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


def digits_data(seed: int, copies: int = 3, noise: float = 0.15, shift: int = 1, test_fraction: float = 1 / 3
                ) -> tuple[TensorDataset, TensorDataset]:
    """The augmented digits training set and the untouched test set (see the module docstring).

    ``(2 * shift + 1) ** 2`` shifted versions of each training image, ``copies`` noisy copies of each
    (``shift=0, copies=1``: the 1,198 training images with noise, for quick tests).
    Shapes: x (N, 64) float32 in [0, 1], y (N,) int64 in 0..9.
    """
    x, y = _load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test_idx, train_idx = order[:n_test], order[n_test:]
    images = x[train_idx].reshape(-1, 8, 8)
    xs, ys = [], []
    offsets = range(-shift, shift + 1)
    for dx in offsets:
        for dy in offsets:
            shifted = _shift(images, dx, dy)
            for _ in range(copies):
                noisy = shifted + rng.normal(0.0, noise, shifted.shape).astype(np.float32)
                xs.append(np.clip(noisy, 0.0, 1.0).reshape(-1, 64))
                ys.append(y[train_idx])
    train = TensorDataset(torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)))
    test = TensorDataset(torch.from_numpy(x[test_idx]), torch.from_numpy(y[test_idx]))
    return train, test


class DigitsMLP(nn.Module):
    """(N, 64) pixels -> 256 -> 256 -> (N, 10) logits, ReLU; ~85k parameters."""

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def digits_mlp(seed: int) -> nn.Module:
    return seeded_model(seed, DigitsMLP)


# ------------------------------------------------------------------------------------------- seqsum
SEQ_LEN = 16


def _sequences(g: torch.Generator, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys, have = [], [], 0
    while have < n:
        x = torch.randint(0, 10, (2 * (n - have) + 16, length), generator=g)
        diff = x[:, : length // 2].sum(1) - x[:, length // 2 :].sum(1)
        keep = diff != 0  # ties redrawn: the two classes are equally likely by symmetry
        xs.append(x[keep])
        ys.append((diff[keep] > 0).long())
        have += int(keep.sum())
    return torch.cat(xs)[:n], torch.cat(ys)[:n]


def seqsum_data(seed: int, n_train: int = 32_768, n_test: int = 4_096, length: int = SEQ_LEN
                ) -> tuple[TensorDataset, TensorDataset]:
    """Sequences of ``length`` digits; label 1 when the first half sums to more than the second half.

    Shapes: x (N, length) int64 tokens 0..9, y (N,) int64 in {0, 1}.
    """
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(*_sequences(g, n_train, length)), TensorDataset(*_sequences(g, n_test, length))


class SeqSumTransformer(nn.Module):
    """Tokens (N, L) -> embedding + learned position (N, L, d) -> 2 encoder layers -> mean over L -> 2 logits."""

    def __init__(self, length: int = SEQ_LEN, d_model: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, d_model)
        self.position = nn.Parameter(0.1 * torch.randn(length, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x) + self.position[: x.shape[1]])
        return self.head(h.mean(dim=1))


def seqsum_transformer(seed: int) -> nn.Module:
    return seeded_model(seed, SeqSumTransformer)


def adam(params, lr: float) -> torch.optim.Optimizer:
    """Adam with torch's defaults (betas 0.9/0.999), for the transformer workload."""
    return torch.optim.Adam(params, lr=lr)
