"""Out-of-memory recovery in one process: a step that runs out of memory runs again with half the
micro-batch and ends exactly as a run that used the smaller micro-batch from the start.

A device's memory limit is played by a model that raises ``torch.OutOfMemoryError`` (the class CUDA raises)
for more rows than it "fits", in the forward or in the backward; HF's trainer tests its OOM path the same
way, by raising the error without a GPU."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import Schedule
from batchpilot.engine import is_out_of_memory


class MemoryLimited(torch.nn.Module):
    """A small MLP that 'runs out of memory' above ``limit`` rows, in the forward or the backward, and
    records the rows of every forward."""

    def __init__(self, limit: int | None = None, in_backward: bool = False, fail_calls: tuple[int, ...] = ()):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()
        self.limit, self.in_backward, self.fail_calls = limit, in_backward, fail_calls
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(len(x))
        fail = (self.limit is not None and len(x) > self.limit) or len(self.rows) in self.fail_calls
        if fail and not self.in_backward:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(x)} rows.")
        hidden = self.net[1](self.net[0](x))
        if fail:
            def raise_oom(grad: torch.Tensor) -> None:  # after the last layer's gradients were accumulated
                raise torch.OutOfMemoryError("CUDA out of memory in the backward.")
            hidden.register_hook(raise_oom)
        return self.net[2](hidden)


def make_data(n: int = 150) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())


def grow(step: int, size: int) -> int:
    return 40 if step < 4 else 64


def train(model: MemoryLimited, steps: int, *, wrap: bool = True, log_path=None, on_step=None, **kwargs) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pilot = batchpilot.Pilot(model, opt, make_data(), batch_size=40, controller=Schedule(grow), seed=3,
                             lr_rule="linear", base_batch_size=40, noise_every=2, log_path=log_path, **kwargs)
    if on_step is not None:
        pilot.add_callback(on_step)
    steps_seen: dict[int, list[int]] = {}
    losses: list[float] = []
    pilot.add_callback(lambda p, record: losses.append(record["loss"]))
    for x, y in pilot.batches(max_steps=steps):
        micro = pilot.micro_batch
        if micro.micro_index == 0:
            steps_seen[micro.step] = []  # a step that runs again starts again
        steps_seen[micro.step].extend(micro.indices.tolist())
        if wrap:
            with pilot.micro_step():
                pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        else:
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    return {"pilot": pilot, "weights": [p.detach().clone() for p in model.parameters()], "losses": losses,
            "indices": list(steps_seen.values()), "noise": {k: v for k, v in pilot.last_record.items() if k.startswith("stats/")}}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_step_that_runs_out_of_memory_runs_again_with_half_the_micro_batch(tmp_path, num_workers):
    # The device "fits" 6 rows. Step 1 (40 samples) is a noise-measuring step, split in two halves of 20:
    # it fails at 20 and at 10, then runs as 8 micro-batches of 5.
    model = MemoryLimited(limit=6)
    run = train(model, 8, oom_recovery=True, num_workers=num_workers, log_path=tmp_path / "log.jsonl")
    pilot = run["pilot"]
    assert pilot.oom_replays == 2 and pilot.loader.max_micro_batch_size == 5
    assert model.rows[:2] == [20, 10] and max(model.rows[2:]) == 5
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    ooms = [e for e in events if e.get("event") == "out_of_memory"]
    assert [(e["step"], e["max_micro_batch_size"], e["new_max_micro_batch_size"]) for e in ooms] == [
        (1, None, 10), (1, 10, 5)]
    assert "CUDA out of memory" in ooms[0]["error"]

    # Exactly the run that used micro-batches of 5 from the start: same samples per step (the failed
    # attempts are not counted), same losses, noise statistics and weights, bit for bit.
    reference = train(MemoryLimited(), 8, wrap=False, max_micro_batch_size=5, num_workers=num_workers)
    assert run["indices"] == reference["indices"]
    assert [len(i) for i in run["indices"]] == [40, 40, 40, 30, 64, 64, 22, 64]  # epochs of 150 samples
    assert pilot.samples_seen == reference["pilot"].samples_seen == 364
    assert run["losses"] == reference["losses"]
    assert run["noise"] == reference["noise"] and "stats/trace_cov" in run["noise"]
    for a, b in zip(run["weights"], reference["weights"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("fail_call", "step", "cap", "rows"), [
    (11, 5, 16, [32, 32, 16, 16, 16]),  # the 6th step (calls 10-11: 64 = 2 x 32), its second micro-batch
    (13, 6, 5, [11, 11, 5, 5, 4]),      # the 7th, an epoch's last (22 samples: 2 x 11 for the noise, then 5 x 4-5)
])
def test_running_out_of_memory_in_the_backward_drops_the_gradients_already_accumulated(fail_call, step, cap, rows):
    # A failure in the backward of a step's *second* micro-batch: the first micro-batch's gradients and part
    # of the second's are in .grad and must be dropped.
    model = MemoryLimited(in_backward=True, fail_calls=(fail_call,))
    run = train(model, 8, oom_recovery=True, max_micro_batch_size=32)
    assert run["pilot"].oom_replays == 1 and run["pilot"].loader.max_micro_batch_size == cap
    assert model.rows[fail_call - 2:fail_call + 3] == rows

    def shrink_after_the_failed_step(pilot, record):
        if pilot.step == step:
            pilot.loader.set_max_micro_batch_size(cap)

    reference = train(MemoryLimited(), 8, wrap=False, max_micro_batch_size=32, on_step=shrink_after_the_failed_step)
    assert run["indices"] == reference["indices"]
    # The throughput model saw the micro-batches that counted, not the failed attempt's first one.
    timed = [[(m, n) for m, n, *_ in r["pilot"]._meter.throughput.state_dict()["sizes"]] for r in (run, reference)]
    assert timed[0] == timed[1]
    assert run["losses"] == reference["losses"]
    for a, b in zip(run["weights"], reference["weights"]):
        assert torch.equal(a, b)


def test_the_smaller_micro_batch_is_kept_in_checkpoints(tmp_path):
    model = MemoryLimited(limit=6)
    run = train(model, 3, oom_recovery=True, checkpoint_dir=tmp_path, checkpoint_every=3)
    assert run["pilot"].loader.max_micro_batch_size == 5
    resumed_model = MemoryLimited(limit=6)
    opt = torch.optim.SGD(resumed_model.parameters(), lr=0.1, momentum=0.9)
    resumed = batchpilot.Pilot(resumed_model, opt, make_data(), batch_size=40, controller=Schedule(grow), seed=3,
                               lr_rule="linear", base_batch_size=40, noise_every=2, oom_recovery=True)
    resumed.load_checkpoint(tmp_path)
    assert resumed.loader.max_micro_batch_size == 5
    for x, y in resumed.batches(max_steps=8):
        with resumed.micro_step():
            resumed.backward(torch.nn.functional.cross_entropy(resumed_model(x), y))
    assert resumed.oom_replays == 0 and max(resumed_model.rows) == 5  # no second failure after the resume
    uninterrupted = train(MemoryLimited(limit=6), 8, oom_recovery=True)
    for a, b in zip(resumed_model.parameters(), uninterrupted["weights"]):
        assert torch.equal(a.detach(), b)


def test_micro_step_without_oom_recovery_changes_nothing_and_lets_errors_through():
    plain = train(MemoryLimited(), 5, wrap=False)
    wrapped = train(MemoryLimited(), 5)
    for a, b in zip(plain["weights"], wrapped["weights"]):
        assert torch.equal(a, b)
    with pytest.raises(torch.OutOfMemoryError):
        train(MemoryLimited(limit=6), 2)  # recovery is off: the error reaches the user


def test_errors_that_are_not_out_of_memory_are_not_swallowed():
    model = MemoryLimited()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, make_data(), batch_size=10, oom_recovery=True)
    with pytest.raises(ValueError, match="shape"):
        for _x, _y in pilot.batches(max_steps=1):
            with pilot.micro_step():
                raise ValueError("a shape mismatch in the user's code")
    assert pilot.oom_replays == 0


def test_out_of_memory_with_one_sample_per_micro_batch_is_a_clear_error():
    model = MemoryLimited(limit=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pilot = batchpilot.Pilot(model, opt, make_data(), batch_size=4, oom_recovery=True)
    with pytest.raises(RuntimeError, match="micro-batches of 1 sample.*amp="):
        for x, y in pilot.batches(max_steps=1):
            with pilot.micro_step():
                pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    assert model.rows == [4, 2, 1]


def test_misuse_is_reported():
    model = MemoryLimited()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="oom_recovery must be True or False, got 'yes'"):
        batchpilot.Pilot(model, opt, make_data(), batch_size=4, oom_recovery="yes")
    pilot = batchpilot.Pilot(model, opt, make_data(), batch_size=4, oom_recovery=True)
    with pytest.raises(RuntimeError, match="outside a `for batch in pilot.batches"):
        with pilot.micro_step():
            pass
    with pytest.raises(RuntimeError, match="inside `with pilot.micro_step"):
        for x, y in pilot.batches(max_steps=1):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))


def test_what_counts_as_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory."))  # older torch, other backends
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only allocator errors (RuntimeError) count


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_the_retry_runs_without_the_failed_attempts_activations(where):
    # The tensors the failed attempt saved for its backward (its activations) must be free before the retry's
    # forward: nothing in the engine may keep its graph. Saved tensors are tracked through autograd's
    # saved-tensor hooks (each packed into an object we hold a weak reference to).
    class Packed:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t.detach()  # not the tensor itself: saving an output with its grad_fn makes a cycle

    packed: list = []

    def pack(t):
        p = Packed(t)
        packed.append(weakref.ref(p))
        return p

    alive_at_forward: list[int] = []

    class Model(torch.nn.Linear):
        def forward(self, x):
            alive_at_forward.append(sum(r() is not None for r in packed))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p.t):
                out = super().forward(x).exp()
            if len(x) > 8:
                if where == "forward":
                    raise torch.OutOfMemoryError("CUDA out of memory.")
                out.register_hook(lambda g: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory.")))
            return out

    model = Model(4, 1)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=16,
                             oom_recovery=True, shuffle=False)
    for x, y in pilot.batches(max_steps=1):
        with pilot.micro_step():
            pilot.backward(torch.nn.functional.mse_loss(model(x), y))
    assert pilot.oom_replays == 1
    assert alive_at_forward == [0, 0, 0]  # the 16-row attempt, then the two 8-row micro-batches of the retry


class DropoutLimited(MemoryLimited):
    """MemoryLimited with dropout before the layer that runs out of memory: each attempt draws masks."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__(limit)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.drop(x))


def test_a_step_run_again_draws_the_same_dropout_masks():
    # The failed attempts drew dropout masks; the replay must draw the masks a run that fitted would have.
    torch.manual_seed(5)
    recovered = train(DropoutLimited(limit=24), 6, oom_recovery=True)
    torch.manual_seed(5)
    reference = train(DropoutLimited(), 6, max_micro_batch_size=20)
    assert recovered["pilot"].oom_replays >= 1
    assert recovered["indices"] == reference["indices"]
    for a, b in zip(recovered["weights"], reference["weights"]):
        assert torch.equal(a, b)


class BatchNormLimited(MemoryLimited):
    """MemoryLimited with BatchNorm before the layer that runs out of memory: each attempt's forward moves
    the running statistics."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__(limit)
        self.bn = torch.nn.BatchNorm1d(6).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.bn(x))


def test_a_step_run_again_starts_from_the_buffers_it_started_with():
    recovered = train(BatchNormLimited(limit=24), 6, oom_recovery=True)
    reference = train(BatchNormLimited(), 6, max_micro_batch_size=20)
    assert recovered["pilot"].oom_replays >= 1 and recovered["indices"] == reference["indices"]
    model, ref = recovered["pilot"].model, reference["pilot"].model
    for a, b in zip(model.buffers(), ref.buffers()):
        assert torch.equal(a, b)  # running mean, variance and num_batches_tracked
    for a, b in zip(recovered["weights"], reference["weights"]):
        assert torch.equal(a, b)


class NoisyData(torch.utils.data.Dataset):
    """make_data() with random augmentation drawn in __getitem__ (in the main process: no workers)."""

    def __init__(self) -> None:
        self.base = make_data()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x + 0.1 * torch.randn(x.shape, dtype=x.dtype), y


def test_a_step_run_again_fetches_with_the_same_random_augmentation():
    def run(**kwargs):
        torch.manual_seed(2)
        model = MemoryLimited(**({"limit": 24} if kwargs.get("oom_recovery") else {}))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pilot = batchpilot.Pilot(model, opt, NoisyData(), batch_size=40, seed=3, **kwargs)
        for x, y in pilot.batches(max_steps=4):
            with pilot.micro_step():
                pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        return pilot, [p.detach().clone() for p in model.parameters()]

    recovered, weights = run(oom_recovery=True)
    _, reference = run(max_micro_batch_size=20)
    assert recovered.oom_replays == 1
    assert all(torch.equal(a, b) for a, b in zip(weights, reference))
