"""Worker functions for the 2-process gloo tests (module level, so ``spawn`` can import them)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from _hf_common import SizeList  # a controller that replays a list of sizes
from torch.utils.data import TensorDataset

import batchpilot

NUM_SAMPLES = 101
# Sizes chosen so that epoch ends produce final batches of 1 sample (smaller than the world size),
# which exercises ghost micro-batches on the second rank.
SIZES = [8, 21, 5, 33, 10, 17, 6, 1, 12, 40, 3, 9, 25, 2, 30, 7]


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 5, generator=g, dtype=torch.float64)
    y = (x[:, 0] - x[:, 2] > 0).long()
    return TensorDataset(x, y)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2)).double()


def train(steps: int, rank: int, world_size: int, wrap_ddp: bool, micro: int | None, amp: str | None = None) -> dict:
    """Train ``steps`` steps; return the per-step (global size, local indices) and the final weights."""
    model = make_model()
    if wrap_ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # Rank 1's controller returns nonsense: only rank 0 decides, so it must never be consulted.
    controller = SizeList(SIZES) if rank == 0 else SizeList([0])
    pilot = batchpilot.Pilot(
        model, opt, make_data(), batch_size=4, controller=controller, max_micro_batch_size=micro, seed=5,
        lr_rule="linear", base_batch_size=4, noise_every=2, amp=amp,
    )
    records: list[dict] = []
    current: list[int] = []
    for x, y in pilot.batches(max_steps=steps):
        m = pilot.micro_batch
        if not m.ghost:
            current.extend(m.indices.tolist())
        if m.micro_index == 0:
            records.append({"global_size": m.global_size, "accumulation_steps": m.accumulation_steps,
                            "epoch": pilot.epoch})
        last = m.is_last
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        if last:
            records[-1]["indices"] = current
            current = []
    module = model.module if wrap_ddp else model
    noise = {k: v for k, v in pilot.last_record.items() if k.startswith("stats/")}
    return {"records": records, "weights": [p.detach().tolist() for p in module.parameters()], "noise": noise}


def finish() -> None:
    """Leave a worker after its results are written: every rank done, the group gone, no finalisation.

    Now and then (5 runs in 90 of tests/_hf_ddp.py beside a busy process) a gloo worker aborted at exit with
    "terminate called without an active exception" after writing its results. A core dump shows why: the
    main thread is finalising the interpreter while a ProcessGroupGloo worker thread (the group object
    outlives destroy_process_group when something still refers to it) drops its last collective's work,
    whose thread-local state holds a Python object; the decref needs the GIL, which a finalising
    interpreter refuses by exiting the thread, and the unwind through a noexcept destructor terminates
    (pytorch/pytorch#179291 describes the same). ``os._exit(0)`` skips the finalisation."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def worker_group(rank: int, world_size: int, init_file: str, backend: str = "gloo") -> Iterator[None]:
    """A worker's body inside the process group: joined before it; after it every rank leaves through
    :func:`finish`, or on an error the group is destroyed and the error raised (so the spawn reports it)."""
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()


def worker(rank: int, world_size: int, init_file: str, out_dir: str, steps: int, wrap_ddp: bool, micro,
           amp: str | None = None) -> None:
    with worker_group(rank, world_size, init_file):
        result = train(steps, rank, world_size, wrap_ddp, micro, amp)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_reference(steps: int, micro) -> dict:
    """The same training in one process (world size 1)."""
    return train(steps, 0, 1, False, micro)


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def noise_worker(rank: int, world_size: int, init_file: str, out_dir: str, micro, wrap_ddp: bool = True,
                 own_hook: bool = False) -> None:
    """Measure the gradient noise scale of a least-squares problem (weights frozen), with or without DDP
    (``own_hook``: the user registered a DDP communication hook before batchpilot could)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    sys.path.insert(0, str(Path(__file__).parent))
    from test_engine_stats import least_squares

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        ds, model, true_g2, true_tr = least_squares(n=60_000)
        ddp = torch.nn.parallel.DistributedDataParallel(model) if wrap_ddp else model
        if own_hook:
            ddp.register_comm_hook(None, allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
        pilot = batchpilot.Pilot(ddp, opt, ds, batch_size=256, noise_every=1, max_micro_batch_size=micro)
        accumulation = set()
        small = set()  # small batches (micro-batches read on this rank) per measured step
        pilot.add_callback(lambda p, record: small.add(len(p._noise._sizes)))
        # 1000 steps: enough for the EMA (decay 0.99 ** (1 / 4) per measurement) to settle.
        for x, y in pilot.batches(max_steps=1000):
            accumulation.add(pilot.micro_batch.accumulation_steps)
            pilot.backward(0.5 * ((ddp(x).view(-1) - y) ** 2).mean())
        out = {k: v for k, v in pilot.last_record.items() if k.startswith("stats/")}
        out.update(true_g2=true_g2, true_tr=true_tr, accumulation=sorted(accumulation), small=sorted(small))
        Path(out_dir, f"noise{rank}.json").write_text(json.dumps(out))
        del pilot, ddp, model  # the DDP model goes before its process group (see oom_worker)
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()


class _CountRows(torch.nn.Module):
    """Counts the rows it sees in a buffer: ranks disagree on it unless buffers are broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rows", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += len(x)
        return x


class _OutOfMemoryAbove(torch.nn.Module):
    """Raises the error CUDA raises for more than ``limit`` rows (``None``: never)."""

    def __init__(self, limit: int | None) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.limit is not None and len(x) > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(x)} rows.")
        return x


def oom_worker(rank: int, world_size: int, init_file: str, out_dir: str, wrap_ddp: bool, limit0: int | None,
               micro: int | None, recovery: bool) -> None:
    """Train 8 steps (40 samples, then 64) where rank 0 'fits' at most ``limit0`` rows per micro-batch."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(_OutOfMemoryAbove(limit0 if rank == 0 else None), _CountRows(),
                                    torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2)).double()
        net = torch.nn.parallel.DistributedDataParallel(model) if wrap_ddp else model
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        pilot = batchpilot.Pilot(net, opt, make_data(), batch_size=40, seed=5, noise_every=2, lr_rule="linear",
                                 controller=lambda step, size: 40 if step < 3 else 64, max_micro_batch_size=micro,
                                 oom_recovery=recovery)
        steps: dict[int, list[int]] = {}
        for x, y in pilot.batches(max_steps=8):
            m = pilot.micro_batch
            if m.micro_index == 0:
                steps[m.step] = []  # a step that runs again starts again
            steps[m.step].extend(m.indices.tolist())
            with pilot.micro_step():
                pilot.backward(torch.nn.functional.cross_entropy(net(x), y))
        result = {
            "indices": list(steps.values()),
            "weights": [p.detach().tolist() for p in model.parameters()],
            "rows": float(model[1].rows),
            "replays": pilot.oom_replays,
            "micro": pilot.loader.max_micro_batch_size,
            "noise": {k: v for k, v in pilot.last_record.items() if k.startswith("stats/")},
        }
        Path(out_dir, f"oom{rank}.json").write_text(json.dumps(result))
        del pilot, net, model  # the DDP model (its reducer holds the process group) goes first
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()


def compile_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Train the same 40 steps with eager DDP, ``torch.compile(DDP(model))`` and ``DDP(torch.compile(model))``
    (backend ``aot_eager``), the first also with ``oom_recovery`` (the engine then reduces); count DDP's
    gradient all-reduces with a communication hook."""
    import torch._dynamo
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        results = {}
        for mode in ("eager", "compile(ddp)", "ddp(compile)", "compile(ddp)+oom_recovery"):
            torch._dynamo.reset()
            model = make_model()
            inner = torch.compile(model, backend="aot_eager") if mode == "ddp(compile)" else model
            ddp = torch.nn.parallel.DistributedDataParallel(inner)
            net = torch.compile(ddp, backend="aot_eager") if mode.startswith("compile(ddp)") else ddp
            calls = [0]

            def hook(state, bucket, calls=calls):  # type: ignore[no-untyped-def]
                calls[0] += 1
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            pilot = batchpilot.Pilot(net, opt, make_data(), batch_size=4, max_micro_batch_size=4, seed=5,
                                     controller=SizeList(SIZES) if rank == 0 else SizeList([0]), lr_rule="linear",
                                     base_batch_size=4, noise_every=2, oom_recovery=mode.endswith("oom_recovery"))
            micro = 0
            for x, y in pilot.batches(max_steps=40):
                micro += 1
                with pilot.micro_step():
                    pilot.backward(torch.nn.functional.cross_entropy(net(x), y))
            results[mode] = {
                "weights": [p.detach().tolist() for p in model.parameters()],
                "allreduces": calls[0], "micro_batches": micro,
                "keys": list(pilot.state_dict()["model"]),
                "noise": {k: v for k, v in pilot.last_record.items() if k.startswith("stats/")},
            }
            del pilot, net, ddp, inner, model, opt
            gc.collect()
        Path(out_dir, f"compile{rank}.json").write_text(json.dumps(results))
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()


def set_size_worker(rank: int, world_size: int, init_file: str, out_dir: str, broadcast: bool) -> None:
    """Rank 0 alone picks a new size in a callback (after a rank-0-only evaluation, say). Passed through
    ``broadcast_int`` on every rank, both ranks train it; set on rank 0 only, the ranks' next step differs
    and every rank must stop with an error at that step's end instead of diverging or hanging."""
    import batchpilot
    from batchpilot import distributed as bpdist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = make_model()
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.05), make_data(), batch_size=4)

    def callback(p: batchpilot.Pilot, record: dict) -> None:
        if p.step == 2:
            if broadcast:
                p.set_batch_size(bpdist.broadcast_int(8 if rank == 0 else -1))
            elif rank == 0:
                p.set_batch_size(8)

    pilot.add_callback(callback)
    sizes, error = [], None
    try:
        for x, y in pilot.batches(max_steps=5):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
            if pilot.micro_batch.is_last:
                sizes.append(pilot.micro_batch.global_size)
    except RuntimeError as err:
        error = str(err)
    Path(out_dir, f"set{rank}.json").write_text(json.dumps({"sizes": sizes, "error": error, "step": pilot.step}))
    finish()


def refuse_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Rank 0's adjustment log was replaced by a shorter file: rank 0 refuses the checkpoint, and so must the
    other ranks (else they load and go on while rank 0 stops)."""
    import batchpilot

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    out = Path(out_dir)

    def build(log: Path) -> batchpilot.Pilot:
        model = make_model()
        return batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.05), make_data(), batch_size=8,
                                checkpoint_dir=out / "ckpt", checkpoint_every=2, log_path=log)

    first = build(out / "log.jsonl")
    for x, y in first.batches(max_steps=2):
        first.backward(torch.nn.functional.cross_entropy(first._module(x), y))
    first.close()
    if rank == 0:
        (out / "short.jsonl").write_text('{"type": "step"}\n')
    dist.barrier()
    second = build(out / "short.jsonl")
    try:
        second.load_checkpoint(out / "ckpt" / "step-000000002.pt")
        result = {"error": None, "step": second.step}
    except batchpilot.CheckpointError as err:
        result = {"error": str(err), "step": second.step}
    Path(out_dir, f"refuse{rank}.json").write_text(json.dumps(result))
    finish()


def plain_env_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """init_torchrun under a launcher that sets only RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (no
    torchrun agent serving the store): rank 0 must serve it."""
    from batchpilot.distributed import init_torchrun

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    from datetime import timedelta

    got = init_torchrun("gloo", timeout=timedelta(seconds=60))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"init": list(got), "sum": total.item()}))
    finish()


def unused_branch_worker(rank: int, world_size: int, init_file: str, out_dir: str, oom_recovery: bool) -> None:
    """Without DDP (or with oom_recovery) the engine sums the gradients: a branch no rank used must keep no
    gradient, so AdamW's weight decay leaves it alone, as on one process."""
    import batchpilot

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    class WithUnused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.unused = make_model(), torch.nn.Linear(5, 2).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)  # self.unused is never called

    model = WithUnused()
    before = [p.detach().clone() for p in model.unused.parameters()]
    wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if oom_recovery else model
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.5)
    pilot = batchpilot.Pilot(wrapped, opt, make_data(), batch_size=8, oom_recovery=oom_recovery)
    for x, y in pilot.batches(max_steps=4):
        with pilot.micro_step() if oom_recovery else contextlib.nullcontext():
            pilot.backward(torch.nn.functional.cross_entropy(wrapped(x), y))
    same = all(torch.equal(a, b) for a, b in zip(before, model.unused.parameters()))
    moved = not all(torch.equal(a, b) for a, b in zip(make_model().parameters(), model.net.parameters()))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"unused_same": same, "used_moved": moved}))
    del pilot, wrapped, model, opt  # a DDP model goes before its process group (see finish)
    finish()


def hook_handover_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """A second probe on the same DDP model (a second train()) takes the communication hook over, and a
    framework's StepStats hooks a new DDP wrapper of the same module (a second fit())."""
    from batchpilot.integrations._step_stats import StepStats
    from batchpilot.measure import GradientNoiseProbe

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    params = list(model.parameters())
    first, second = GradientNoiseProbe(params, every=1), GradientNoiseProbe(params, every=1)
    attached = [first.attach_ddp(ddp), second.attach_ddp(ddp)]
    data = make_data()
    x, y = data.tensors[0][rank * 8:(rank + 1) * 8], data.tensors[1][rank * 8:(rank + 1) * 8]
    for probe in (first, second):
        probe.begin_step(0)  # a measured step
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    read = [first._hook_sq is not None, second._hook_sq is not None]
    stats = StepStats(params, world_size=world_size, accumulation_steps=1)
    stats.attach(ddp)
    again = torch.nn.parallel.DistributedDataParallel(model)  # the next fit's wrapper
    stats.attach(again)
    hooked = [getattr(ddp, "_batchpilot_probe", None) is stats.probe,
              getattr(again, "_batchpilot_probe", None) is stats.probe]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"attached": attached, "read": read, "hooked": hooked}))
    del stats, ddp, again, model
    finish()


def group_setup_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """What a Pilot does with the process group it finds: a plain model starts from rank 0's weights; a DDP
    model over a subgroup and rank/world_size that disagree with the group are refused; world_size=1 trains
    the rank on its own (its own decisions, no collectives); a DDP model with its own communication hook and
    one micro-batch per step cannot measure the noise scale in the integrations."""
    from batchpilot.integrations._step_stats import StepStats

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    result: dict = {}
    torch.manual_seed(rank)  # different initial weights per rank, as with per-rank seeding for augmentation
    model = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2)).double()
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(), batch_size=8)
    result["initial"] = [p.detach().tolist() for p in model.parameters()]
    for x, y in pilot.batches(max_steps=3):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
    result["trained"] = [p.detach().tolist() for p in model.parameters()]

    own = dist.new_group([rank]) if rank == 0 else None
    own = dist.new_group([1]) if rank == 1 else own  # every rank takes part in creating every group
    sub = torch.nn.parallel.DistributedDataParallel(make_model(), process_group=own)
    try:
        batchpilot.Pilot(sub, torch.optim.SGD(sub.parameters(), lr=0.1), make_data(), batch_size=8)
        result["subgroup"] = None
    except ValueError as err:
        result["subgroup"] = str(err)
    try:
        batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(), batch_size=8,
                         rank=1 - rank, world_size=2)
        result["swapped"] = None
    except ValueError as err:
        result["swapped"] = str(err)
    whole = torch.nn.parallel.DistributedDataParallel(make_model())  # over the default group of 2
    try:  # it would average weights while each rank decides alone, and hang when their step counts differ
        batchpilot.Pilot(whole, torch.optim.SGD(whole.parameters(), lr=0.1), make_data(), batch_size=8, world_size=1)
        result["ddp_alone"] = None
    except ValueError as err:
        result["ddp_alone"] = str(err)
    del whole

    alone = make_model()
    solo = batchpilot.Pilot(alone, torch.optim.SGD(alone.parameters(), lr=0.1), make_data(), batch_size=4,
                            world_size=1, controller=SizeList([3 + rank]), oom_recovery=True)  # rank 0 of 1
    sizes = []
    for x, y in solo.batches(max_steps=3 + 2 * rank):  # unequal lengths: no collective may be waiting
        if solo.micro_batch.micro_index == 0:
            sizes.append(solo.micro_batch.global_size)
        with solo.micro_step():
            solo.backward(torch.nn.functional.cross_entropy(alone(x), y))
    solo.save_checkpoint(Path(out_dir, f"solo{rank}.pt"))
    result["solo_sizes"] = sizes

    def averaging_hook(_, bucket):  # DDP's own reduction, as a compression hook would replace it
        future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return future.then(lambda done: done.value()[0] / world_size)

    hooked = torch.nn.parallel.DistributedDataParallel(make_model())
    hooked.register_comm_hook(None, averaging_hook)
    stats = StepStats(list(hooked.parameters()), world_size=world_size, accumulation_steps=1)
    try:
        stats.attach(hooked)
        result["hook"] = None
    except ValueError as err:
        result["hook"] = str(err)
    Path(out_dir, f"group{rank}.json").write_text(json.dumps(result))
    finish()


def failing_controller_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Rank 0's controller fails at step 3: every rank stops, and the finished step is saved once, together."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    model = make_model()
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), make_data(), batch_size=8,
                             controller=lambda step, size: 0 if step == 3 else size,
                             checkpoint_dir=Path(out_dir, "ckpt"), checkpoint_every=50)
    try:
        for x, y in pilot.batches(max_steps=10):
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        error = None
    except Exception as exc:  # rank 0: the controller's error; rank 1: told by rank 0
        error = f"{type(exc).__name__}: {exc}"
    Path(out_dir, f"failing{rank}.json").write_text(json.dumps({"error": error, "step": pilot.step}))
    finish()
