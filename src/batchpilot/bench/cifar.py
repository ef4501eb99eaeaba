"""CIFAR-10 and CIFAR-100 read from the standard python-pickle batches in a local folder, and a small ResNet.

Nothing is downloaded: get ``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz`` from
https://www.cs.toronto.edu/~kriz/cifar.html, extract it, and pass the folder that holds
``cifar-10-batches-py`` / ``cifar-100-python`` (or that folder itself) as ``root`` (``batchpilot bench
--data-dir`` or ``$BATCHPILOT_DATA`` on the command line). The files are pickles; they are read with an unpickler that only rebuilds
dicts, lists, strings, numbers and numpy arrays, so a file that would run other code is refused.

The ResNet is He et al. 2016's CIFAR family (3x3 stem, three stages of basic blocks at 16/32/64 channels,
global average pooling) with one block per stage: ResNet-8, ~78k parameters. The data is not augmented, so
accuracy plateaus below the usual figures; the workloads' targets are set below that plateau.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from .seeding import seeded_model

__all__ = ["CIFAR_FOLDERS", "CifarResNet", "cifar_resnet", "data_dir", "load_cifar"]

# name -> (folder, training files, test file, label key)
CIFAR_FOLDERS = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch", b"labels"),
    "cifar100": ("cifar-100-python", ["train"], "test", b"fine_labels"),
}
CIFAR_CLASSES = {"cifar10": 10, "cifar100": 100}
# Per-channel mean and standard deviation of the CIFAR-10 training images (the usual normalisation).
_MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32).reshape(1, 3, 1, 1)
_STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32).reshape(1, 3, 1, 1)
# What the standard batches need to be rebuilt: numpy arrays (pickled by numpy 1 or 2) and their dtypes.
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("_codecs", "encode"),
}


def data_dir() -> Path:
    """Where real data sets are looked for without a ``root``: ``~/.cache/batchpilot/data``."""
    return Path.home() / ".cache" / "batchpilot" / "data"


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}: a CIFAR batch holds only arrays and lists")
        with warnings.catch_warnings():  # numpy 2 warns on the numpy.core path numpy-1 pickles name
            warnings.simplefilter("ignore", DeprecationWarning)
            return super().find_class(module, name)


def _read_batch(path: Path) -> dict[bytes, Any]:
    if not path.is_file():
        raise FileNotFoundError(path)
    try:
        with open(path, "rb") as f:
            batch = _SafeUnpickler(f, encoding="bytes").load()
    except Exception as exc:  # truncated, foreign or unsafe: name the file
        raise ValueError(f"{str(path)!r} is not a readable CIFAR python batch ({type(exc).__name__}: {exc}); "
                         "extract the archive again from https://www.cs.toronto.edu/~kriz/cifar.html.") from exc
    if not isinstance(batch, dict) or b"data" not in batch:
        raise ValueError(f"{str(path)!r} is not a CIFAR python batch (no b'data' entry).")
    return batch


def _whole_in(values: np.ndarray, end: int) -> bool:
    """Whether ``values`` are integers in ``[0, end)`` (an empty array is)."""
    return values.dtype.kind in "ui" and (not values.size or 0 <= values.min() <= values.max() < end)


def _describe(values: np.ndarray) -> str:
    """``of type T`` and, for numbers, ``from MIN to MAX``."""
    numeric = values.dtype.kind in "uif" and values.size
    return f"of type {values.dtype}" + (f" from {values.min()} to {values.max()}" if numeric else "")


def _images_and_labels(path: Path, label_key: bytes, classes: int) -> tuple[np.ndarray, np.ndarray]:
    batch = _read_batch(path)
    if label_key not in batch:
        raise ValueError(f"{str(path)!r} has no {label_key!r} entry (keys: {sorted(batch)}); is it the other CIFAR?")
    try:
        raw, labels = np.asarray(batch[b"data"]), np.asarray(batch[label_key])
    except Exception as exc:  # ragged lists and the like
        raise ValueError(f"{str(path)!r} holds data or labels that are no arrays ({type(exc).__name__}: {exc}).") from exc
    # Cast only what is whole numbers in range: a cast would wrap 300 to 44 and truncate 0.5 to 0 silently.
    if not _whole_in(raw, 256):
        raise ValueError(f"{str(path)!r} holds pixel data {_describe(raw)}; a CIFAR batch holds bytes 0-255.")
    if not _whole_in(labels, classes):
        raise ValueError(f"{str(path)!r} holds labels {_describe(labels)}; {label_key!r} must be class indices "
                         f"0-{classes - 1}. Is it the other CIFAR?")
    data, labels = raw.astype(np.uint8), labels.astype(np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise ValueError(f"{str(path)!r} holds data of shape {data.shape} and {len(labels)} labels; a CIFAR batch "
                         "has N rows of 3072 bytes (1024 red, 1024 green, 1024 blue) and N labels.")
    return data, labels


def load_cifar(name: str = "cifar10", root: str | os.PathLike | None = None) -> tuple[TensorDataset, TensorDataset]:
    """CIFAR-10 (``"cifar10"``, 50k/10k, 10 classes) or CIFAR-100 (``"cifar100"``, fine labels, 100 classes).

    Returns ``(train, test)`` as ``TensorDataset(x, y)``: ``x`` float32 ``(N, 3, 32, 32)`` normalised by the
    per-channel mean and standard deviation, ``y`` int64.

    Args:
        name: ``"cifar10"`` or ``"cifar100"``.
        root: The folder holding ``cifar-10-batches-py`` / ``cifar-100-python``, or that folder itself.
            Default: :func:`data_dir`.

    Raises:
        FileNotFoundError: a batch file is missing (names the file and where to get the data).
        ValueError: an unknown ``name``, or a file that is not a CIFAR python batch.
    """
    if name not in CIFAR_FOLDERS:
        raise ValueError(f"unknown CIFAR set {name!r}; choose one of: {', '.join(CIFAR_FOLDERS)}.")
    folder, train_files, test_file, label_key = CIFAR_FOLDERS[name]
    base = Path(root).expanduser() if root is not None else data_dir()
    if base.name != folder:
        base = base / folder

    def read(files: list[str]) -> TensorDataset:
        parts = []
        for file in files:
            try:
                parts.append(_images_and_labels(base / file, label_key, CIFAR_CLASSES[name]))
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"{str(base / file)!r} does not exist. Download the python version of {name} from "
                    f"https://www.cs.toronto.edu/~kriz/cifar.html, extract it so that {folder}/ is in one folder, "
                    "and pass that folder (load_cifar(name, root=DIR); batchpilot bench --data-dir DIR, or "
                    "BATCHPILOT_DATA=DIR)."
                ) from None
        data = np.concatenate([d for d, _ in parts])
        labels = np.concatenate([y for _, y in parts])
        x = (data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0 - _MEAN) / _STD
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(labels))

    return read(train_files), read([test_file])


class _Block(nn.Module):
    """A basic residual block (two 3x3 convolutions with BatchNorm); a 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


class CifarResNet(nn.Module):
    """He et al. 2016's CIFAR ResNet with ``blocks`` basic blocks per stage (1: ResNet-8, 3: ResNet-20)."""

    def __init__(self, num_classes: int = 10, blocks: int = 1, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for stage in range(3):
            cout = width * 2**stage
            for i in range(blocks):
                layers.append(_Block(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean(dim=(2, 3)))


def cifar_resnet(seed: int, num_classes: int = 10) -> nn.Module:
    """ResNet-8 for ``num_classes`` classes, with weights initialised from ``seed``."""
    return seeded_model(seed, lambda: CifarResNet(num_classes))
