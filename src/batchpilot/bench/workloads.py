"""Built-in benchmark workloads: a dataset, a model, and the optimizer settings that go with them.

A :class:`Workload` is everything ``batchpilot bench`` needs to train one model under several batch-size
policies: how to build the data (a fixed function of a data seed), how to build the model (a function of
the run seed), the learning rate at the base batch size, the optimizer, and the default target accuracy.

* ``mnist1d`` (default): MNIST-1D (Greydanus 2020, "Scaling down deep learning"), generated locally and
  cached, and the paper's small 1D CNN (see :mod:`.mnist1d`).
* ``digits``: scikit-learn's bundled digits, augmented, and an MLP (see :mod:`.tasks`); cheap per sample,
  so throughput keeps rising with the batch size.
* ``seqsum``: a generated 16-digit sequence task and a 2-layer transformer trained with Adam and the
  square-root LR rule (see :mod:`.tasks`).
* ``markov``: which of ten similar Markov chains wrote a 64-symbol sequence, read by a GRU, trained with
  Adam and the square-root LR rule (see :mod:`.markov`); the long one: its best static batch needs about a
  minute on 2 CPU cores, so fixed costs (``auto``'s probes) do not dominate its times to target.
* ``synthetic``: nearly linearly separable Gaussian blobs and a tiny MLP, built instantly, for tests
  (left out of ``--workload all``).
* ``cifar10``, ``cifar100``: the real data sets, read from their python-pickle batches in a local folder
  (``get_workload(name, data_dir=...)``; on the command line ``--data-dir`` or ``$BATCHPILOT_DATA``; nothing is
  downloaded), and ResNet-8 (see :mod:`.cifar`). They
  are meant for a GPU; left out of ``--workload all``, and their targets and budgets are not calibrated by
  a measurement yet.

Targets were set so that the best static batch reaches them well within the budget on 2 CPU cores; the
budget bounds every run, so a run that would never reach the target costs at most ``budget_s``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from .cifar import CIFAR_FOLDERS, cifar_resnet, load_cifar
from .gpt import (
    GPT_QUICK_TARGET_SCORE,
    GPT_TARGET_SCORE,
    gpt_loss,
    gpt_model,
    gpt_optimizer,
    gpt_pilot_settings,
    gpt_score,
)
from .gpt_data import gpt_data
from .markov import markov_data, markov_gru
from .mnist1d import MNIST1D_NUM_SAMPLES, MNIST1DCNN, cache_dir, load_mnist1d, mnist1d_cnn, mnist1d_data
from .seeding import seeded_model
from .tasks import adam, digits_data, digits_mlp, seqsum_data, seqsum_transformer

__all__ = [
    "MNIST1DCNN",
    "MNIST1D_NUM_SAMPLES",
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
        grid: The batch sizes ``tuned-static:grid`` (in the ``default`` set) tunes: powers of two from the first
            to the second.
        evaluate: ``evaluate(model, test) -> float``, the metric the target is set in, higher is better (``None``:
            top-1 accuracy; ``gpt``: ``exp(-validation loss)``, :func:`~batchpilot.bench.gpt.gpt_score`).
        pilot_settings: ``pilot_settings(train) -> dict`` of further ``Pilot`` arguments for every run and the
            calibration (``gpt``: token budgets, :func:`~batchpilot.bench.gpt.gpt_pilot_settings`); ``None``: none.
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
    grid: tuple[int, int] = (32, 1024)
    evaluate: Callable[[nn.Module, TensorDataset], float] | None = None
    pilot_settings: Callable[[TensorDataset], dict[str, Any]] | None = None


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
    return seeded_model(seed, lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))


# -------------------------------------------------------------------------------------------- CIFAR
def _cifar_data(name: str, seed: int, root: str | os.PathLike | None = None) -> tuple[TensorDataset, TensorDataset]:
    """The real set ``name`` from ``root`` (the data seed is unused: the split is the published one)."""
    return load_cifar(name, root)


def _cifar_workload(name: str, title: str, classes: int, *, target: float, quick_target: float) -> Workload:
    """A CIFAR workload: the real set from a local folder, ResNet-8, SGD momentum 0.9 at lr 0.1 per 128
    samples (linear rule); meant for a GPU, and its targets are first guesses, not calibrated."""
    return Workload(
        name=name,
        description=f"{title} (50k train / 10k test, read from the python batches in $BATCHPILOT_DATA or "
        "--data-dir, not augmented) with ResNet-8; SGD momentum 0.9, lr 0.025 at batch 32 (0.1 at 128); meant "
        "for a GPU, target not calibrated",
        build_data=functools.partial(_cifar_data, name),
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
            build_data=mnist1d_data,
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
            name="markov",
            description="which of 10 similar Markov chains wrote a 64-symbol sequence (60k train / 4k test, "
            "generated; Bayes-optimal 96.6%) with a GRU (hidden 256); Adam, lr 0.001 at batch 32, sqrt LR rule",
            build_data=markov_data,
            build_model=markov_gru,
            base_lr=0.001,
            make_optimizer=adam,
            lr_rule="sqrt",
            target_accuracy=0.92,
            quick_target_accuracy=0.9,
            budget_s=180.0,
            quick_budget_s=90.0,
            max_batch_size=1024,  # the GRU's CPU throughput falls past a few hundred samples per step
            smith_every_epochs=1.5,
            grid=(64, 512),  # a minute per good run: 12 cells, not 18 (static:32 runs on its own in default)
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
        Workload(
            name="gpt",
            description="a byte-level GPT (2 pre-LN layers, width 64, context 64, ~121k params) on 48 Python "
            "standard-library modules' source (one document per module, 6 held out; 1.12M training tokens in "
            "variable-length blocks); batches in tokens; AdamW, lr 0.002 at 2048 tokens, sqrt LR rule; the "
            "metric is exp(-validation loss)",
            build_data=gpt_data,
            build_model=gpt_model,
            base_lr=0.002,
            base_batch_size=2048,
            make_optimizer=gpt_optimizer,
            loss_fn=gpt_loss,
            lr_rule="sqrt",
            evaluate=gpt_score,
            pilot_settings=gpt_pilot_settings,
            target_accuracy=GPT_TARGET_SCORE,
            quick_target_accuracy=GPT_QUICK_TARGET_SCORE,
            budget_s=180.0,
            quick_budget_s=60.0,
            min_batch_size=512,  # tokens, as every size of this workload
            max_batch_size=16384,
            grid=(512, 4096),  # from the lowest bound (where auto starts); 8192+ wasted tokens on dev seed 0
            smith_every_epochs=0.5,
            in_all=False,  # its sizes count tokens: the sample-sized named sets (static:32, ramp:32-512) do not fit
        ),
        _cifar_workload("cifar10", "CIFAR-10", 10, target=0.75, quick_target=0.6),
        _cifar_workload("cifar100", "CIFAR-100 (fine labels)", 100, target=0.40, quick_target=0.25),
    )
}


def all_workloads() -> list[str]:
    """The workloads of ``--workload all`` (every registered one except the test workload)."""
    return [w.name for w in WORKLOADS.values() if w.in_all]


def get_workload(name: str | Workload, *, data_dir: str | os.PathLike | None = None) -> Workload:
    """Return the registered workload ``name`` (a :class:`Workload` passes through).

    Args:
        name: A registered name, or a :class:`Workload`.
        data_dir: The folder a real data set (``cifar10``, ``cifar100``) is read from (default: that of
            :func:`~batchpilot.bench.cifar.load_cifar`); the generated workloads ignore it.

    Raises:
        ValueError: ``name`` is not registered; the message lists the registered names.
    """
    if isinstance(name, Workload):
        return name
    try:
        workload = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; choose one of: {', '.join(sorted(WORKLOADS))}."
        ) from None
    if data_dir is not None and name in CIFAR_FOLDERS:
        workload = replace(workload, build_data=functools.partial(_cifar_data, name, root=data_dir))
    return workload
