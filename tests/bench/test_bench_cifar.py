"""CIFAR-10/100 from the standard python-pickle batches, on small generated files in the real format."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from batchpilot.bench.cifar import cifar_resnet, load_cifar
from batchpilot.cli import main


def write_batch(path, rows: int, label_key: bytes, classes: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    batch = {b"batch_label": b"generated", label_key: rng.integers(0, classes, rows).tolist(),
             b"data": rng.integers(0, 256, (rows, 3072), dtype=np.uint8),
             b"filenames": [f"img{i}.png".encode() for i in range(rows)]}
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)  # as the published files: Python 2 pickles with bytes keys
    return batch


def fake_cifar10(root, rows: int = 20) -> list[dict]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = [write_batch(folder / f"data_batch_{i}", rows, b"labels", 10, i) for i in range(1, 6)]
    batches.append(write_batch(folder / "test_batch", rows, b"labels", 10, 9))
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [b"airplane"] * 10, b"num_cases_per_batch": rows}, f, protocol=2)
    return batches


def test_cifar10_reads_every_batch_in_order_as_normalised_images(tmp_path):
    batches = fake_cifar10(tmp_path)
    train, test = load_cifar("cifar10", tmp_path)
    assert train.tensors[0].shape == (100, 3, 32, 32) and train.tensors[0].dtype == torch.float32
    assert test.tensors[0].shape == (20, 3, 32, 32) and test.tensors[1].dtype == torch.int64
    assert train.tensors[1].tolist() == sum((b[b"labels"] for b in batches[:5]), [])
    # Row layout: 1024 red, 1024 green, 1024 blue bytes, each a 32x32 image row by row.
    raw = batches[0][b"data"][3]
    pixel = raw[[0 * 1024 + 2 * 32 + 5, 1 * 1024 + 2 * 32 + 5, 2 * 1024 + 2 * 32 + 5]] / 255.0
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    np.testing.assert_allclose(train.tensors[0][3, :, 2, 5].numpy(), (pixel - mean) / std, rtol=1e-5)
    same, _ = load_cifar("cifar10", tmp_path / "cifar-10-batches-py")  # the folder itself works too
    assert torch.equal(same.tensors[0], train.tensors[0])


def test_cifar100_uses_the_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    train_batch = write_batch(folder / "train", 30, b"fine_labels", 100, 1)
    write_batch(folder / "test", 10, b"fine_labels", 100, 2)
    train, test = load_cifar("cifar100", tmp_path)
    assert train.tensors[1].tolist() == train_batch[b"fine_labels"] and len(test) == 10
    wrong = tmp_path / "cifar-10-batches-py"  # CIFAR-100's batch under CIFAR-10's name
    wrong.mkdir()
    (wrong / "data_batch_1").write_bytes((folder / "train").read_bytes())
    with pytest.raises(ValueError, match=r"has no b'labels' entry .* the other CIFAR"):
        load_cifar("cifar10", tmp_path)


class Evil:
    def __reduce__(self):
        import os

        return os.system, ("echo pwned",)


def test_missing_damaged_or_unsafe_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_batch_1' does not exist.*--data-dir"):
        load_cifar("cifar10", tmp_path)
    fake_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    (folder / "data_batch_3").write_bytes((folder / "data_batch_3").read_bytes()[:500])
    with pytest.raises(ValueError, match="data_batch_3' is not a readable CIFAR python batch"):
        load_cifar("cifar10", tmp_path)
    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": Evil()}, f, protocol=2)
    with pytest.raises(ValueError, match="refused to load posix.system|refused to load os.system"):
        load_cifar("cifar10", tmp_path)
    with pytest.raises(ValueError, match="unknown CIFAR set 'cifar1000'"):
        load_cifar("cifar1000", tmp_path)


@pytest.mark.parametrize("key, value, says", [
    (b"labels", [10] * 20, "labels of type int64 from 10 to 10; b'labels' must be class indices 0-9"),
    (b"labels", [-1] * 20, "from -1 to -1; b'labels' must be class indices 0-9"),
    (b"labels", [b"cat"] * 20, "labels of type |S3; b'labels' must be class indices"),
    (b"data", [[300] * 3072] * 20, "pixel data of type int64 from 300 to 300; a CIFAR batch holds bytes 0-255"),
    (b"data", np.full((20, 3072), 0.5), "pixel data of type float64 from 0.5 to 0.5"),
    (b"data", None, "pixel data of type object"),
    (b"data", [[1, 2], [3]], "holds data or labels that are no arrays"),
])
def test_a_batch_with_bad_pixels_or_labels_is_refused_by_name(tmp_path, key, value, says):
    # Before: labels 10 failed at the first training step, 300 raised OverflowError, 0.5 became black images.
    fake_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    with open(path, "rb") as f:
        batch = pickle.load(f)
    batch[key] = value
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)
    with pytest.raises(ValueError) as info:
        load_cifar("cifar10", tmp_path)
    assert "data_batch_2' holds" in str(info.value) and says in str(info.value), str(info.value)


def test_resnet8_is_a_function_of_its_seed():
    a, b, c = cifar_resnet(0), cifar_resnet(0), cifar_resnet(1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert sum(p.numel() for p in a.parameters()) == 78042
    assert cifar_resnet(0, num_classes=100)(torch.zeros(2, 3, 32, 32)).shape == (2, 100)


def test_bench_trains_cifar10_from_a_data_dir(tmp_path, capsys):
    fake_cifar10(tmp_path / "data")
    code = main(["bench", "--workload", "cifar10", "--data-dir", str(tmp_path / "data"), "--policies",
                 "static:32,ramp:32-64", "--seeds", "0", "--budget-s", "1", "--target-accuracy", "0.99",
                 "--calibrate-steps", "1", "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["workload"] == "cifar10" and {r["policy"] for r in results["runs"]} == {"static:32", "ramp:32-64"}
    assert all(len(r["curve"]) >= 2 for r in results["runs"])
    with pytest.raises(SystemExit) as info:
        main(["bench", "--workload", "cifar10", "--data-dir", str(tmp_path / "out"), "--out", str(tmp_path / "o2")])
    assert info.value.code == 2 and "data_batch_1' does not exist" in capsys.readouterr().err


def test_the_data_folder_reaches_the_loader_as_an_argument_and_batchpilot_data_is_read_by_the_cli(tmp_path, monkeypatch):
    import os

    from batchpilot.bench import get_workload
    from batchpilot.cli import _data_dir

    batches = fake_cifar10(tmp_path / "data")
    monkeypatch.delenv("BATCHPILOT_DATA", raising=False)
    train, _ = get_workload("cifar10", data_dir=tmp_path / "data").build_data(0)
    assert len(train) == 5 * len(batches[0][b"labels"])
    assert get_workload("mnist1d", data_dir=tmp_path) is get_workload("mnist1d")  # generated: nothing to read
    assert _data_dir(None) is None
    monkeypatch.setenv("BATCHPILOT_DATA", str(tmp_path / "data"))
    assert _data_dir(None) == tmp_path / "data" and _data_dir(str(tmp_path)) == tmp_path
    monkeypatch.delenv("BATCHPILOT_DATA")
    assert main(["bench", "--workload", "cifar10", "--data-dir", str(tmp_path / "data"), "--policies", "static:32",
                 "--seeds", "0", "--budget-s", "1", "--calibrate-steps", "1", "--out", str(tmp_path / "out"),
                 "--no-progress"]) == 0
    assert "BATCHPILOT_DATA" not in os.environ  # the folder did not travel through the environment
