"""2-rank gloo workers of tests/test_adaptive_compression.py (module level, so ``spawn`` can import them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from _dist_helpers import finish

from batchpilot.distributed.adaptive_compression import AdaptiveCompression


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 64, generator=g), torch.randint(0, 10, (size,), generator=g)


def _train(ddp, opt, state, steps: range, batch: int) -> list[str]:
    used = []
    for step in steps:
        x, y = _batch(step, dist.get_rank(), batch)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        used.append(state.level)  # the level of this step (decided at its first bucket)
    return used


def choice_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """A compute-heavy step on the real loopback (communication cheap), then a light step behind an emulated
    1 MB/s link (communication expensive): the level each step used, on every rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out = {}
    for name, batch, delay in (("cheap", 16384, 0.0), ("slow", 32, 1e-6)):
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        state = AdaptiveCompression(every=5, min_dwell=10, link_delay=delay)
        state.register(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        used = _train(ddp, opt, state, range(40), batch)
        out[name] = {"used": used, "switches": state.switches, "predicted": state.predicted,
                     "wire": state.wire_bytes, "full": state.full_bytes}
    Path(out_dir, f"choice{rank}.json").write_text(json.dumps(out))
    finish()  # (no interpreter finalisation beside gloo's threads: see _dist_helpers.finish)


def resume_worker(rank: int, world: int, init_file: str, out_dir: str, level: str) -> None:
    """Train 6 steps, save the model, optimizer and hook state, train 4 more; then rebuild everything from the saved
    states in a new DDP model and train the same 4 steps: the two final weights, and the state round trip."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    state = AdaptiveCompression(levels=[level])
    state.register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    _train(ddp, opt, state, range(6), 16)
    saved = {"model": {k: v.clone() for k, v in ddp.module.state_dict().items()},
             "opt": opt.state_dict(), "hook": state.state_dict()}
    torch.save(saved, Path(out_dir, f"saved{rank}.pt"))
    _train(ddp, opt, state, range(6, 10), 16)
    first = [p.detach().clone() for p in ddp.module.parameters()]
    loaded = torch.load(Path(out_dir, f"saved{rank}.pt"), weights_only=True)
    model = _model(seed=123)
    model.load_state_dict(loaded["model"])
    ddp2 = torch.nn.parallel.DistributedDataParallel(model)
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(loaded["opt"])
    state2 = AdaptiveCompression(levels=[level])
    state2.register(ddp2)
    state2.load_state_dict(loaded["hook"])
    again = state2.state_dict()
    same_state = _equal(again, loaded["hook"])
    _train(ddp2, opt2, state2, range(6, 10), 16)
    second = list(ddp2.module.parameters())
    result = {"equal": all(torch.equal(a, b) for a, b in zip(first, second)),
              "max_diff": max(float((a - b).abs().max()) for a, b in zip(first, second)),
              "same_state": same_state, "wire": state.wire_bytes, "full": state.full_bytes,
              "wire2": state2.wire_bytes, "has_error": loaded["hook"]["residual"] is not None or
              loaded["hook"]["one_bit"] is not None and loaded["hook"]["one_bit"]["worker_error"] is not None}
    Path(out_dir, f"resume{rank}.json").write_text(json.dumps(result))
    finish()  # (no interpreter finalisation beside gloo's threads: see _dist_helpers.finish)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _pilot_run(compression, steps: int, ckpt: str, *, resume: bool = False, save: bool = False) -> dict:
    import batchpilot

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] - 0.5 * x[:, 3] > 0).long())
    pilot = batchpilot.Pilot(ddp, opt, data, batch_size=32, compression=compression, seed=3, noise_every=4,
                             system_every=None)
    if resume:
        pilot.load_checkpoint(ckpt)
    for xb, yb in pilot.batches(max_steps=steps):
        pilot.backward(torch.nn.functional.cross_entropy(ddp(xb), yb))
    if save:
        pilot.save_checkpoint(ckpt)
    state = pilot._state.parts["compression"].state
    return {"weights": [p.detach().tolist() for p in model.parameters()], "kind": type(state).__name__,
            "level": state.level, "wire": state.wire_bytes, "full": state.full_bytes, "step": state.step}


def pilot_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Pilot(compression="auto"), and Pilot with a fixed PowerSGD level (the hook of an AdaptiveCompression): 12 steps
    at once, or 6, a checkpoint, a new Pilot and 6 more; the noise probe measures every 4th step (full precision)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ckpt = str(Path(out_dir, "ckpt.pt"))
    out = {"auto": _pilot_run("auto", 12, ckpt)}
    for name in ("straight", "first", "resumed"):
        hook = AdaptiveCompression(levels=["powersgd:2", "1bit"], initial="powersgd:2").hook
        steps = 6 if name == "first" else 12
        out[name] = _pilot_run(hook, steps, ckpt, resume=name == "resumed", save=name == "first")
    Path(out_dir, f"pilot{rank}.json").write_text(json.dumps(out))
    finish()  # (no interpreter finalisation beside gloo's threads: see _dist_helpers.finish)
