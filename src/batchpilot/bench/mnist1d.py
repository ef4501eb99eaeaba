"""The MNIST-1D workload's data and model (Greydanus 2020, "Scaling down deep learning").

The data is generated locally with the ``mnist1d`` package's ``make_dataset`` (never its download path) at
60,000 samples, split 48k train / 12k test. Generation takes ~20 s on one core, so the arrays are cached as
``.npz`` under ``$BATCHPILOT_CACHE`` (default ``~/.cache/batchpilot``), keyed by the generation args. The
model is the paper's small 1D CNN. The registry entry is in :mod:`.workloads`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .._extras import install_hint
from .seeding import seeded_model

__all__ = ["MNIST1DCNN", "MNIST1D_NUM_SAMPLES", "cache_dir", "load_mnist1d", "mnist1d_cnn", "mnist1d_data"]

MNIST1D_NUM_SAMPLES = 60_000


def cache_dir() -> Path:
    """Where generated datasets are cached: ``$BATCHPILOT_CACHE`` or ``~/.cache/batchpilot``."""
    env = os.environ.get("BATCHPILOT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchpilot"


def _import_mnist1d() -> tuple[Callable[..., dict], Callable[..., Any]]:
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the mnist1d workload needs the 'mnist1d' package, an optional extra of batchpilot; "
            f"install it with: {install_hint('bench')}"
        ) from exc
    return make_dataset, get_dataset_args


def load_mnist1d(
    num_samples: int = MNIST1D_NUM_SAMPLES, seed: int = 42, *, cache: bool = True
) -> dict[str, np.ndarray]:
    """Generate (or load from the cache) MNIST-1D with ``num_samples`` samples, 80/20 train/test split.

    Uses ``mnist1d.data.make_dataset`` with the package's default arguments except ``num_samples`` and
    ``seed``; nothing is downloaded. ``make_dataset`` reseeds the global ``random`` and ``numpy`` RNGs,
    so their states are saved and restored around it.

    Returns:
        A dict with float32 ``x`` (N_train, 40), int64 ``y``, ``x_test``, ``y_test``.

    Raises:
        ImportError: ``mnist1d`` is not installed (names the extra to install).
    """
    make_dataset, get_dataset_args = _import_mnist1d()
    args = get_dataset_args(as_dict=True)
    args.pop("url", None)  # only used by the download path, which we never take
    args.update(num_samples=int(num_samples), seed=int(seed))
    key = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"mnist1d-{num_samples}-{key}.npz"
    if cache and path.exists():
        try:
            with np.load(path) as data:
                return {k: data[k] for k in ("x", "y", "x_test", "y_test")}
        except Exception:  # a damaged cache file (empty: EOFError, truncated: BadZipFile, ...): regenerate it
            pass

    from mnist1d.utils import ObjectView

    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        raw = make_dataset(ObjectView(dict(args)))
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    data = {
        "x": raw["x"].astype(np.float32),
        "y": raw["y"].astype(np.int64),
        "x_test": raw["x_test"].astype(np.float32),
        "y_test": raw["y_test"].astype(np.int64),
    }
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        except OSError as exc:  # a read-only home, say: the data is made, only not kept
            warnings.warn(f"cannot cache MNIST-1D in {str(path.parent)!r} ({exc.strerror}); it will be generated "
                          "again next time. Set BATCHPILOT_CACHE to a writable folder.", stacklevel=2)
            return data
        # Atomic write: a concurrent reader sees either no file or a complete one.
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return data


def mnist1d_data(seed: int, num_samples: int = MNIST1D_NUM_SAMPLES) -> tuple[TensorDataset, TensorDataset]:
    """The workload's ``(train, test)``: :func:`load_mnist1d` as ``TensorDataset(x, y)``."""
    d = load_mnist1d(num_samples, seed)
    # Shapes: x (N, 1, 40) float32 — one input channel of length 40 for Conv1d; y (N,) int64.
    train = TensorDataset(torch.from_numpy(d["x"]).unsqueeze(1), torch.from_numpy(d["y"]))
    test = TensorDataset(torch.from_numpy(d["x_test"]).unsqueeze(1), torch.from_numpy(d["y_test"]))
    return train, test


class MNIST1DCNN(nn.Module):
    """The 1D CNN of the MNIST-1D paper (Greydanus 2020): three strided convolutions and a linear head.

    Input (N, 1, 40) -> conv(k5, s2, p1) -> (N, 25, 19) -> conv(k3, s2, p1) -> (N, 25, 10)
    -> conv(k3, s2, p1) -> (N, 25, 5) -> flatten (N, 125) -> linear -> (N, 10) logits. ~5k parameters.
    """

    def __init__(self, channels: int = 25, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, kernel_size=5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, kernel_size=3, stride=2, padding=1)
        self.head = nn.Linear(channels * 5, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = torch.relu(self.conv3(x))
        return self.head(x.flatten(1))


def mnist1d_cnn(seed: int) -> nn.Module:
    """The MNIST-1D CNN with weights initialised from ``seed``."""
    return seeded_model(seed, MNIST1DCNN)
