"""Built-in benchmark workloads: a dataset, a model, and the optimizer settings that go with them.

A :class:`Workload` is everything ``batchpilot bench`` needs to train one model under several batch-size
policies: how to build the data (a fixed function of a data seed), how to build the model (a function of
the run seed), the learning rate at the base batch size, the optimizer, and the default target accuracy.

* ``mnist1d`` (default): MNIST-1D (Greydanus 2020, "Scaling down deep learning"), generated locally with
  the ``mnist1d`` package's ``make_dataset`` (never its download path) at 60,000 samples, split 48k train /
  12k test, and the paper's small 1D CNN. Generation takes ~20 s on one core, so the arrays are cached as
  ``.npz`` under ``$BATCHPILOT_CACHE`` (default ``~/.cache/batchpilot``), keyed by the generation args.
* ``digits``: scikit-learn's bundled digits, augmented, and an MLP (see :mod:`.tasks`); cheap per sample,
  so throughput keeps rising with the batch size.
* ``seqsum``: a generated 16-digit sequence task and a 2-layer transformer trained with Adam and the
  square-root LR rule (see :mod:`.tasks`).
* ``synthetic``: nearly linearly separable Gaussian blobs and a tiny MLP, built instantly, for tests
  (left out of ``--workload all``).
* ``cifar10``, ``cifar100``: the real data sets, read from their python-pickle batches in a local folder
  (``$BATCHPILOT_DATA`` or ``--data-dir``; nothing is downloaded), and ResNet-8 (see :mod:`.cifar`). They
  are meant for a GPU; left out of ``--workload all``, and their targets and budgets are not calibrated by
  a measurement yet.

Targets were set so that the best static batch reaches them well within the budget on 2 CPU cores; the
budget bounds every run, so a run that would never reach the target costs at most ``budget_s``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .._extras import install_hint
from .cifar import cifar_resnet, load_cifar
from .tasks import adam, digits_data, digits_mlp, seqsum_data, seqsum_transformer

__all__ = [
    "WORKLOADS",
    "Workload",
    "all_workloads",
    "cache_dir",
    "get_workload",
    "load_mnist1d",
    "mnist1d_cnn",
    "sgd_momentum",
]


def sgd_momentum(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The default benchmark optimizer: SGD with momentum 0.9, no weight decay."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


@dataclass(frozen=True)
class Workload:
    """One benchmark task.

    Attributes:
        name: Registry key (``--workload``).
        description: One line for ``--help`` and the report.
        build_data: ``build_data(seed) -> (train, test)``, two ``TensorDataset`` of ``(x, y)``; ``seed``
            is the *data* seed (the dataset is part of the workload, so the runner passes ``data_seed``).
        build_model: ``build_model(seed) -> nn.Module``; the weights are a function of ``seed`` alone.
        base_lr: Learning rate at ``base_batch_size`` (the LR rule rescales it for other sizes).
        base_batch_size: The batch size ``base_lr`` was tuned for.
        make_optimizer: ``make_optimizer(params, lr) -> Optimizer``.
        target_accuracy: Default test accuracy that counts as "trained".
        quick_target_accuracy: Target used by ``batchpilot bench --quick`` (reachable in its budget).
        data_seed: Seed the runner passes to ``build_data``.
        loss_fn: ``loss_fn(logits, y) -> scalar`` mean loss.
        lr_rule: How the LR follows the batch size (``"linear"`` for SGD, ``"sqrt"`` for Adam).
        budget_s: Default most training seconds per run; ``quick_budget_s`` with ``--quick``.
        min_batch_size, max_batch_size: Bounds of the adaptive controllers and of the calibration grid
            (``max_batch_size`` stands for the memory bound; it is capped at the training set size).
        in_all: Whether ``--workload all`` includes it.
        smith_every_epochs: Doubling interval of ``ramp-smith``: about a quarter of the epochs the best
            static batch needs to reach the target (measured once), so the batch doubles at 1/4, 1/2
            and 3/4 of the run, where Smith et al. 2018 would have decayed the LR.
    """

    name: str
    description: str
    build_data: Callable[[int], tuple[TensorDataset, TensorDataset]]
    build_model: Callable[[int], nn.Module]
    base_lr: float
    target_accuracy: float
    quick_target_accuracy: float
    base_batch_size: int = 32
    make_optimizer: Callable[[Iterable[torch.nn.Parameter], float], torch.optim.Optimizer] = sgd_momentum
    data_seed: int = 42
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(
        default=nn.functional.cross_entropy
    )
    lr_rule: str = "linear"
    budget_s: float = 120.0
    quick_budget_s: float = 30.0
    min_batch_size: int = 32
    max_batch_size: int = 4096
    in_all: bool = True
    smith_every_epochs: float = 2.0


def _seeded_model(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    # Seed a private copy of torch's CPU RNG so building a model neither depends on nor disturbs the
    # caller's global random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


# ----------------------------------------------------------------------------------------- MNIST-1D
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


def _mnist1d_data(seed: int, num_samples: int = MNIST1D_NUM_SAMPLES) -> tuple[TensorDataset, TensorDataset]:
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
    return _seeded_model(seed, MNIST1DCNN)


# ---------------------------------------------------------------------------------------- synthetic
def _blobs(seed: int, n_train: int = 4096, n_test: int = 1024, dim: int = 16, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    # Random class means with unit-variance noise: a nearest-mean classifier gets ~99%, and a small
    # learning rate makes SGD need a few hundred samples per class, so a curve has several points.
    means = torch.randn(classes, dim, generator=g)

    def draw(n: int) -> TensorDataset:
        y = torch.randint(0, classes, (n,), generator=g)
        x = means[y] + torch.randn(n, dim, generator=g)
        return TensorDataset(x, y)

    return draw(n_train), draw(n_test)


def _tiny_mlp(seed: int) -> nn.Module:
    return _seeded_model(seed, lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))


# -------------------------------------------------------------------------------------------- CIFAR
def _cifar_workload(name: str, title: str, classes: int, *, target: float, quick_target: float) -> Workload:
    """A CIFAR workload: the real set from a local folder, ResNet-8, SGD momentum 0.9 at lr 0.1 per 128
    samples (linear rule); meant for a GPU, and its targets are first guesses, not calibrated."""
    return Workload(
        name=name,
        description=f"{title} (50k train / 10k test, read from the python batches in $BATCHPILOT_DATA or "
        "--data-dir, not augmented) with ResNet-8; SGD momentum 0.9, lr 0.025 at batch 32 (0.1 at 128); meant "
        "for a GPU, target not calibrated",
        build_data=lambda seed: load_cifar(name),
        build_model=lambda seed: cifar_resnet(seed, num_classes=classes),
        base_lr=0.025,
        target_accuracy=target,
        quick_target_accuracy=quick_target,
        budget_s=600.0,
        quick_budget_s=120.0,
        in_all=False,
        smith_every_epochs=2.0,
    )


# ----------------------------------------------------------------------------------------- registry
WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="mnist1d",
            description="MNIST-1D (60k samples, 48k train / 12k test, generated locally) with the "
            "paper's 1D CNN; SGD momentum 0.9, lr 0.01 at batch 32",
            build_data=_mnist1d_data,
            build_model=mnist1d_cnn,
            base_lr=0.01,
            target_accuracy=0.98,
            quick_target_accuracy=0.97,
            budget_s=60.0,
            smith_every_epochs=3.0,
        ),
        Workload(
            name="digits",
            description="sklearn digits (1,198 train images x 9 shifts x 3 noisy copies = 32k, 599 test) "
            "with a 64-256-256-10 MLP; SGD momentum 0.9, lr 0.01 at batch 32",
            build_data=digits_data,
            build_model=digits_mlp,
            base_lr=0.01,
            target_accuracy=0.965,
            quick_target_accuracy=0.95,
            budget_s=30.0,
            quick_budget_s=15.0,
            smith_every_epochs=1.25,
        ),
        Workload(
            name="seqsum",
            description="16-digit sequences, is the first half's sum larger (32k train / 4k test) with a "
            "2-layer transformer (d_model 32); Adam, lr 0.001 at batch 32, sqrt LR rule",
            build_data=seqsum_data,
            build_model=seqsum_transformer,
            base_lr=0.001,
            make_optimizer=adam,
            lr_rule="sqrt",
            target_accuracy=0.985,
            quick_target_accuracy=0.97,
            budget_s=60.0,
            max_batch_size=2048,  # throughput rises only ~15% from 512 to 4096; 4096 would slow the calibration
            smith_every_epochs=0.5,
        ),
        Workload(
            name="synthetic",
            description="Gaussian blobs (4 classes, 16 dims, 4096 train / 1024 test) with a tiny MLP; "
            "instant, for tests",
            build_data=_blobs,
            build_model=_tiny_mlp,
            base_lr=0.005,
            target_accuracy=0.97,
            quick_target_accuracy=0.95,
            data_seed=0,
            budget_s=20.0,
            quick_budget_s=10.0,
            max_batch_size=1024,
            in_all=False,
            smith_every_epochs=0.25,
        ),
        _cifar_workload("cifar10", "CIFAR-10", 10, target=0.75, quick_target=0.6),
        _cifar_workload("cifar100", "CIFAR-100 (fine labels)", 100, target=0.40, quick_target=0.25),
    )
}


def all_workloads() -> list[str]:
    """The workloads of ``--workload all`` (every registered one except the test workload)."""
    return [w.name for w in WORKLOADS.values() if w.in_all]


def get_workload(name: str | Workload) -> Workload:
    """Return the registered workload ``name`` (a :class:`Workload` passes through).

    Raises:
        ValueError: ``name`` is not registered; the message lists the registered names.
    """
    if isinstance(name, Workload):
        return name
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; choose one of: {', '.join(sorted(WORKLOADS))}."
        ) from None
