"""Worker functions for the FSDP2 tests (module level, so ``spawn`` can import them): the same training with DDP
and with ``fully_shard`` on 2 gloo ranks, and checkpoints through DCP saved on 2 ranks, loaded on 2 and on 1."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _dist_helpers as h  # noqa: E402
from _hf_common import SizeList  # noqa: E402

import batchpilot  # noqa: E402
from batchpilot.engine.snapshot import restore_snapshot, take_snapshot  # noqa: E402

STEPS = 20


def sharded(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` each Linear layer, then the root (FSDP2's usual recipe)."""
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def full_weights(model: torch.nn.Module) -> list[list]:
    """The full parameters (a collective for sharded ones: every rank calls it)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).tolist() for p in model.parameters()]


@contextlib.contextmanager
def group(rank: int, world_size: int, init_file: str, backend: str = "gloo") -> Iterator[str]:
    """A worker's body in the process group (:func:`_dist_helpers.worker_group`); yields the device this rank trains
    on (``cuda:<rank>`` under NCCL)."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    with h.worker_group(rank, world_size, init_file, backend):
        yield f"cuda:{rank}" if backend == "nccl" else "cpu"


def wrapped(mode: str, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` for ``mode``: in DDP (``"ddp"``), sharded (``"fsdp"``) or bare (``"plain"``)."""
    return torch.nn.parallel.DistributedDataParallel(model) if mode == "ddp" else \
        sharded(model) if mode == "fsdp" else model


def train_to(pilot: batchpilot.Pilot, forward: Any, steps: int) -> None:
    """Run ``pilot`` to ``steps`` steps with the cross-entropy of ``forward`` (the wrapped or compiled model)."""
    for x, y in pilot.batches(max_steps=steps):
        pilot.backward(torch.nn.functional.cross_entropy(forward(x), y))


def build(mode: str, rank: int, checkpoint_dir: str | None = None, device: str = "cpu", **settings):
    """The model (``"ddp"``, ``"fsdp"`` or ``"plain"``), its optimizer and a Pilot with changing sizes, accumulation
    (micro-batches of at most 4), clipping, and the gradient noise scale measured every 2nd step."""
    model = h.make_model().to(device)
    net = wrapped(mode, model)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    controller = SizeList(h.SIZES) if rank == 0 else SizeList([0])
    pilot = batchpilot.Pilot(net, opt, h.make_data(), batch_size=4, controller=controller, max_micro_batch_size=4,
                             seed=5, lr_rule="linear", base_batch_size=4, noise_every=2, grad_clip=0.5,
                             checkpoint_dir=checkpoint_dir, device=device, **settings)
    return model, net, pilot


def train_worker(rank: int, world_size: int, init_file: str, out_dir: str, modes: tuple[str, ...],
                 backend: str = "gloo") -> None:
    """Train ``STEPS`` steps with each of ``modes``; write the per-step sizes and norms, the noise statistics and the
    full weights of each."""
    with group(rank, world_size, init_file, backend) as device:
        for mode in modes:
            model, net, pilot = build(mode, rank, device=device)
            out: dict = {"sizes": [], "norms": [], "accumulation": []}
            pilot.add_callback(lambda p, r, out=out: (out["sizes"].append(r["batch/global_size"]),
                                                      out["norms"].append(r["grad/norm"])))
            for x, y in pilot.batches(max_steps=STEPS):
                m = pilot.micro_batch
                if m.is_last:
                    out["accumulation"].append(m.accumulation_steps)
                pilot.backward(torch.nn.functional.cross_entropy(net(x), y))
            out["noise"] = {k: v for k, v in pilot.last_record.items() if k.startswith("stats/")}
            out["weights"] = full_weights(model)
            out["grad_types"] = sorted({type(p.grad).__name__ for p in model.parameters()})
            Path(out_dir, f"{mode}{rank}.json").write_text(json.dumps(out))
            del pilot, net, model


def checkpoint_worker(rank: int, world_size: int, init_file: str, out_dir: str, backend: str = "gloo") -> None:
    """Train 20 steps with a checkpoint every 5 (through DCP); a new Pilot loads the step-10 one and trains to step
    20 again. Writes both runs' final weights and the weights at step 10."""
    with group(rank, world_size, init_file, backend) as device:
        ckpt = Path(out_dir, "ckpt")
        model, net, pilot = build("fsdp", rank, checkpoint_dir=str(ckpt), checkpoint_every=5, keep_checkpoints=10,
                                  device=device)
        at10: list = []
        pilot.add_callback(lambda p, r, m=model: at10.extend(full_weights(m)) if p.step == 10 else None)
        train_to(pilot, net, STEPS)
        first = full_weights(model)
        del pilot, net, model
        model, net, pilot = build("fsdp", rank, device=device)
        loaded = pilot.load_checkpoint(ckpt / "step-000000010.pt")
        at10_loaded = full_weights(model)
        train_to(pilot, net, STEPS)
        out = {"first": first, "at10": at10, "at10_loaded": at10_loaded, "resumed": full_weights(model),
               "step": pilot.step, "loaded": None if loaded is None else loaded.name,
               "files": sorted(p.name for p in ckpt.iterdir())}
        snapshot = take_snapshot(pilot)  # the rollback guard's in-memory state: this rank's DTensor shards
        runs = []
        for _ in range(2):
            train_to(pilot, net, STEPS + 3)
            runs.append(full_weights(model))
            restore_snapshot(pilot, snapshot)
        out["snapshot_runs"] = runs
        Path(out_dir, f"ckpt{rank}.json").write_text(json.dumps(out))
        del pilot, net, model


def reshard_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """1 rank: load the 2-rank checkpoint of step 10 into a 1-rank ``fully_shard`` model, then into the bare model,
    and train each to step 20."""
    with group(rank, world_size, init_file):
        pruned = Path(out_dir, "pruned")
        for mode in ("fsdp", "plain"):
            settings = dict(checkpoint_every=2, keep_checkpoints=2) if mode == "fsdp" else {}
            model, net, pilot = build(mode, rank, checkpoint_dir=str(pruned) if settings else None, **settings)
            pilot.load_checkpoint(Path(out_dir, "ckpt", "step-000000010.pt"))
            at10 = full_weights(model)
            if mode == "fsdp":  # a 1-rank checkpoint for reload_worker to reshard onto 2
                pilot.add_callback(lambda p, r: p.save_checkpoint(Path(out_dir, "one", "step-15.pt"))
                                   if p.step == 15 else None)
            train_to(pilot, net, STEPS)
            out = {"at10": at10, "final": full_weights(model), "step": pilot.step,
                   "kept": sorted(p.name for p in pruned.iterdir()) if settings else None}
            Path(out_dir, f"reshard_{mode}.json").write_text(json.dumps(out))
            del pilot, net, model


def reload_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """2 ranks: load the 1-rank checkpoint of step 15 (see reshard_worker) and train to step 20."""
    with group(rank, world_size, init_file):
        model, net, pilot = build("fsdp", rank)
        pilot.load_checkpoint(Path(out_dir, "one", "step-15.pt"))
        train_to(pilot, net, STEPS)
        out = {"final": full_weights(model), "step": pilot.step}
        Path(out_dir, f"reload{rank}.json").write_text(json.dumps(out))
        del pilot, net, model


def refuse_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """The settings FSDP2 refuses, and a model whose root is not sharded: the messages."""
    with group(rank, world_size, init_file):
        messages = {}
        for name, kwargs in (("oom", {"oom_recovery": True}), ("fp16", {"amp": "fp16"}),
                             ("compression", {"compression": "1bit"})):
            try:
                build("fsdp", rank, **kwargs)
            except ValueError as exc:
                messages[name] = str(exc)
        model = h.make_model()
        fully_shard(model[0])  # the last layer and the root are left unsharded
        try:
            batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), h.make_data(), batch_size=4)
        except ValueError as exc:
            messages["root"] = str(exc)
        # A checkpoint of another model is refused before anything loads; so is one whose DCP folder is gone.
        _, _, pilot = build("fsdp", rank)
        saved = pilot.save_checkpoint(Path(out_dir, "other", "step-1.pt"))
        other = sharded(torch.nn.Sequential(torch.nn.Linear(5, 13), torch.nn.Tanh(), torch.nn.Linear(13, 2)).double())
        other_pilot = batchpilot.Pilot(other, torch.optim.Adam(other.parameters(), lr=0.01), h.make_data(),
                                       batch_size=4, seed=5)
        before = full_weights(other)
        for name, target in (("other_model", other_pilot), ("no_dcp", pilot)):
            if name == "no_dcp":
                shutil.rmtree(Path(out_dir, "other", "step-1.dcp"))
            try:
                target.load_checkpoint(saved)
            except batchpilot.CheckpointError as exc:
                messages[name] = str(exc)
        messages["unchanged"] = full_weights(other) == before
        Path(out_dir, f"refuse{rank}.json").write_text(json.dumps(messages))


def features_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """With DDP and with fully_shard: unequal rank shares (fixed [1, 3], and "auto"), and the automatic mode (its
    probes' snapshot and restore are the rollback guard's); the full weights of each. Then fully_shard only:
    save_on_sigterm (:func:`_sigterm_run`) and a forward through ``torch.compile``."""
    from batchpilot.controllers import Auto

    with group(rank, world_size, init_file):
        out: dict = {}  # (Auto sweeps one size: the knee must not depend on the timings of two runs)
        for mode in ("ddp", "fsdp"):
            for name, settings in (("weights", {"rank_weights": [1, 3]}), ("auto_weights", {"rank_weights": "auto"})):
                model, net, pilot = build(mode, rank, **settings)
                train_to(pilot, net, 12)
                out[f"{name}/{mode}"] = full_weights(model)
                pilot.close()
            model = h.make_model()
            net = wrapped(mode, model)
            opt = torch.optim.SGD(net.parameters(), lr=0.05)
            pilot = batchpilot.Pilot(net, opt, h.make_data(), batch_size="auto", seed=5,
                                     controller=Auto(8, 8, lr_steps=12, timed_steps=1, max_valley_span=1e9))
            train_to(pilot, net, 6)
            probe = pilot.controller.probe
            out[f"auto/{mode}"] = full_weights(model)
            out[f"probe/{mode}"] = [probe.start_size, probe.lr, probe.steps]
            pilot.close()
        for mode in ("ddp", "fsdp"):
            out[f"rollback/{mode}"] = _rollback_run(mode)
        out["sigterm"] = _sigterm_run(rank, Path(out_dir, "sigterm"))
        model, net, pilot = build("fsdp", rank)
        forward = torch.compile(net)  # (graph breaks at FSDP2's hooks; the step stays the engine's)
        train_to(pilot, forward, 12)
        out["compiled"] = full_weights(model)
        pilot.close()
        Path(out_dir, f"features{rank}.json").write_text(json.dumps(out))


def _sigterm_run(rank: int, folder: Path) -> dict:
    """``save_on_sigterm`` with fully_shard: rank 1 gets a SIGTERM during step 5; every rank saves (through DCP) at
    that step's end and stops; a new Pilot resumes from the folder to step 12. And an uninterrupted run to 12."""
    import os
    import signal

    model, net, pilot = build("fsdp", rank, checkpoint_dir=str(folder), save_on_sigterm=True)
    for x, y in pilot.batches(max_steps=12):
        if rank == 1 and pilot.step == 4 and pilot.micro_batch.micro_index == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        pilot.backward(torch.nn.functional.cross_entropy(net(x), y))
    stopped, preempted = pilot.step, pilot.preempted
    pilot.close()
    model, net, pilot = build("fsdp", rank, checkpoint_dir=str(folder))
    loaded = pilot.load_checkpoint(folder)
    train_to(pilot, net, 12)
    resumed = full_weights(model)
    pilot.close()
    model, net, pilot = build("fsdp", rank)
    train_to(pilot, net, 12)
    pilot.close()
    return {"stopped": stopped, "preempted": preempted, "loaded": None if loaded is None else loaded.name,
            "resumed": resumed, "straight": full_weights(model)}


def _rollback_run(mode: str) -> dict:
    """The rollback guard: the controller grows 8 -> 16 at step 4, the first step at 16 gets a NaN loss; the guard
    restores its snapshot (the sharded model's DTensor shards with fully_shard) and goes back to 8."""
    from _rollback_helpers import GrowOnce

    model = h.make_model()
    net = wrapped(mode, model)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    controller = GrowOnce(4, 16)
    pilot = batchpilot.Pilot(net, opt, h.make_data(), batch_size=8, controller=controller, seed=5,
                             rollback_cooldown=1000)
    poisoned = False
    for x, y in pilot.batches(max_steps=12):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        if pilot.micro_batch.global_size == 16 and not poisoned:
            loss, poisoned = loss * float("nan"), pilot.micro_batch.is_last
        pilot.backward(loss)
    last = pilot.last_record["batch/global_size"]
    pilot.close()
    return {"weights": full_weights(model), "told": controller.told, "rollbacks": pilot.rollbacks, "last": last}
