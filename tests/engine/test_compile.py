"""A ``torch.compile``d model under a changing batch size: the same training as eager, no recompilation per
size, and checkpoints that move between compiled and eager models. (Two ranks: test_distributed.py.)

``backend="aot_eager"`` runs dynamo and AOTAutograd (the graph capture, guards and recompilation that meet a
changing batch) and executes the captured ATen graph eagerly, so the results can be compared bit for bit;
the slow test uses the default inductor backend, whose generated kernels round differently."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.stats import per_sample_grad_variance

SIZES = [8, 21, 5, 33, 10, 17, 6, 12]


def make_problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()
    return TensorDataset(x, y), model


def make_pilot(backend: str | None, **kwargs):
    ds, model = make_problem()
    net = model if backend is None else torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pilot = batchpilot.Pilot(
        net, opt, ds, batch_size=8, controller=lambda step, size: SIZES[step % len(SIZES)],
        max_micro_batch_size=10, seed=1, lr_rule="linear", noise_every=2, **kwargs,
    )
    return pilot, net, model


def train(pilot, net, steps: int) -> set[int]:
    sizes = set()
    for x, y in pilot.batches(max_steps=steps):
        sizes.add(len(y))
        pilot.backward(torch.nn.functional.cross_entropy(net(x), y))
    return sizes


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_compiled_model_trains_as_eager_without_a_graph_per_size():
    eager, eager_net, eager_model = make_pilot(None)
    train(eager, eager_net, 24)
    compiled, net, model = make_pilot("aot_eager")
    micro_sizes = train(compiled, net, 24)
    assert len(micro_sizes) == 9 and 1 in micro_sizes  # the forward met many micro-batch sizes ...
    # ... and was captured three times: at the first size, then with a dynamic batch dimension, and for
    # one-sample micro-batches (dynamo specialises sizes 0 and 1).
    assert counters["stats"]["unique_graphs"] <= 3
    for a, b in zip(eager_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert eager.last_record["stats/trace_cov"] == compiled.last_record["stats/trace_cov"]
    assert eager.last_record["batch/global_size"] == compiled.last_record["batch/global_size"]


@pytest.mark.parametrize("first,second", [("aot_eager", None), (None, "aot_eager")])
def test_checkpoints_move_between_compiled_and_eager_models(tmp_path, first, second):
    reference, ref_net, ref_model = make_pilot(None)
    train(reference, ref_net, 20)
    pilot, net, _ = make_pilot(first)
    train(pilot, net, 9)
    state = pilot.state_dict()
    assert list(state["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # no "_orig_mod." prefix
    pilot.save_checkpoint(tmp_path / "ckpt.pt")
    resumed, net, model = make_pilot(second)
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    train(resumed, net, 20)
    assert resumed.step == reference.step == 20
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_per_sample_variance_sees_through_torch_compile():
    ds, model = make_problem()
    x, y = ds.tensors[0][:32], ds.tensors[1][:32]
    bare = per_sample_grad_variance(model, torch.nn.functional.cross_entropy, x, y)
    compiled = per_sample_grad_variance(torch.compile(model, backend="aot_eager"), torch.nn.functional.cross_entropy, x, y)
    assert bare == compiled > 0


@pytest.mark.slow
def test_inductor_compiled_model_tracks_eager():
    eager, eager_net, eager_model = make_pilot(None)
    train(eager, eager_net, 16)
    compiled, net, model = make_pilot("inductor")
    train(compiled, net, 16)
    assert counters["stats"]["unique_graphs"] <= 3
    for a, b in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
