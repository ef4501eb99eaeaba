"""The built-in workloads: registry, MNIST-1D data and cache, seeded models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchpilot.bench import get_workload
from batchpilot.bench.workloads import WORKLOADS, mnist1d_cnn


# -------------------------------------------------------------------------------------- workloads
def test_get_workload_lists_the_names():
    assert get_workload("synthetic") is WORKLOADS["synthetic"]
    with pytest.raises(ValueError, match="choose one of: cifar10, cifar100, digits, gpt, markov, mnist1d, seqsum, synthetic"):
        get_workload("mnist")

def test_mnist1d_cnn_shapes_and_seeding():
    model = mnist1d_cnn(0)
    assert model(torch.zeros(3, 1, 40)).shape == (3, 10)
    # conv 1*25*5+25, conv 25*25*3+25 (twice), linear 125*10+10: the paper's model.
    assert sum(p.numel() for p in model.parameters()) == 150 + 1900 + 1900 + 1260
    same, other = mnist1d_cnn(0), mnist1d_cnn(1)
    for a, b, c in zip(model.parameters(), same.parameters(), other.parameters()):
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_workload_model_building_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    WORKLOADS["mnist1d"].build_model(5)
    assert torch.equal(torch.rand(3), expected)


def test_mnist1d_generation_and_cache(tmp_path, monkeypatch):
    pytest.importorskip("mnist1d")
    from batchpilot.bench.mnist1d import load_mnist1d, mnist1d_data

    monkeypatch.setenv("BATCHPILOT_CACHE", str(tmp_path))
    np.random.seed(7)
    expected_draw = np.random.rand()
    np.random.seed(7)
    data = load_mnist1d(num_samples=1000, seed=3)
    assert np.random.rand() == expected_draw  # make_dataset reseeds numpy; we restore the state
    assert data["x"].shape == (800, 40) and data["x_test"].shape == (200, 40)
    assert data["x"].dtype == np.float32 and data["y"].dtype == np.int64
    assert set(np.unique(data["y"])) == set(range(10))
    cached = list(tmp_path.glob("mnist1d-1000-*.npz"))
    assert len(cached) == 1
    again = load_mnist1d(num_samples=1000, seed=3)  # from the cache now
    for key in data:
        np.testing.assert_array_equal(data[key], again[key])
    other = load_mnist1d(num_samples=1000, seed=4)  # another key, another file
    assert len(list(tmp_path.glob("mnist1d-1000-*.npz"))) == 2
    assert not np.array_equal(other["x"], data["x"])

    train, test = mnist1d_data(3, num_samples=1000)
    assert train.tensors[0].shape == (800, 1, 40) and train.tensors[0].dtype == torch.float32
    assert test.tensors[1].shape == (200,) and test.tensors[1].dtype == torch.int64
    logits = mnist1d_cnn(0)(train.tensors[0][:4])
    assert logits.shape == (4, 10)
    # A damaged cache file (empty, or a truncated zip) is generated again.
    for damage in (b"", cached[0].read_bytes()[:100]):
        cached[0].write_bytes(damage)
        for key, value in load_mnist1d(num_samples=1000, seed=3).items():
            np.testing.assert_array_equal(value, data[key])
    # A cache folder that cannot be written: the data is still made, with a warning that names the fix.
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("BATCHPILOT_CACHE", str(blocked / "sub"))
    with pytest.warns(UserWarning, match="cannot cache MNIST-1D.*BATCHPILOT_CACHE"):
        fresh = load_mnist1d(num_samples=1000, seed=3)
    np.testing.assert_array_equal(fresh["x"], data["x"])
