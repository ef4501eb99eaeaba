"""One worker of the elastic / SIGTERM / multi-node tests and of benchmarks/elastic.py.

    torchrun --nproc-per-node=N _elastic_script.py OUT [--steps S] [--kill RANK:POINT:STEP] [--save-on-sigterm]

Started by torchrun, or by hand with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (rank 0 then serves the
store). Trains a float64 MLP with a size that changes at every step (micro-batches of at most 8, so steps
accumulate), checkpointing every 4 steps into OUT/checkpoints, and resumes from there when a checkpoint exists.

Each attempt (a process group: one torchrun attempt, or one launch) writes, per rank,
OUT/steps-<tag>-r<rank>.jsonl: one line per finished step with its size, epoch and the sample ids this rank trained
in it; OUT/start-<tag>.json (the step it resumed at, the world size) and, at the end, OUT/end-<tag>-r<rank>.json
(the final step, ``pilot.preempted``) and, on rank 0, OUT/weights-<tag>.pt. ``<tag>`` is ``--tag`` plus torchrun's
restart count and the world size.

``--kill RANK:POINT:STEP`` SIGKILLs rank RANK of a fresh (not resumed) attempt at STEP, at one POINT:
``step`` (the first micro-batch of the step after STEP steps), ``micro`` (the second micro-batch of a step that
accumulates), ``decision`` (in a callback right after STEP's decision, before its checkpoint) or ``write`` (inside
the checkpoint write of step STEP, after the temporary file is written and synced, before the atomic rename).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.distributed import init_torchrun

NUM_SAMPLES = 157
SIZES = [8, 24, 5, 40, 16, 3, 31, 12]


def sizes(step: int, size: int) -> int:
    """The controller: a new size after every step."""
    return SIZES[step % len(SIZES)]


def build(out: Path, save_on_sigterm: bool, checkpoint_every: int) -> tuple[torch.nn.Module, batchpilot.Pilot]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 6, generator=g, dtype=torch.float64)
    data = TensorDataset(x, (x[:, 0] * x[:, 1] > 0).long())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)).double()
    ddp = torch.nn.parallel.DistributedDataParallel(model) if dist.get_world_size() > 1 else model
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    pilot = batchpilot.Pilot(ddp, opt, data, batch_size=12, controller=sizes, max_micro_batch_size=8, seed=3,
                             lr_rule="sqrt", log_path=out / "log.jsonl", checkpoint_dir=out / "checkpoints",
                             checkpoint_every=checkpoint_every, keep_checkpoints=3, save_on_sigterm=save_on_sigterm)
    return ddp, pilot


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill", default=None, help="RANK:POINT:STEP")
    parser.add_argument("--save-on-sigterm", action="store_true")
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--tag", default="a")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (time to send a signal)")
    parser.add_argument("--hold-at", type=int, default=None,
                        help="a fresh attempt waits after this step (at most 120 s) for a SIGTERM")
    args = parser.parse_args()
    terminated = []  # this handler of the script's own is chained by the Pilot's (engine/preemption.py)
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))

    rank, world_size = init_torchrun("gloo")
    # torchrun's restart count stays the same when a node joins: the world size tells those attempts apart
    tag = f"{args.tag}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}w{world_size}"
    out = args.out
    ddp, pilot = build(out, args.save_on_sigterm, args.checkpoint_every)
    resumed = pilot.load_checkpoint(out / "checkpoints", missing_ok=True)
    if rank == 0:
        (out / f"start-{tag}.json").write_text(json.dumps({"step": pilot.step, "world_size": world_size,
                                                           "resumed": resumed is not None}))
    kill_rank, point, kill_step = _kill_spec(args.kill)
    armed = resumed is None and kill_rank == rank
    if armed and point == "write":
        _die_inside_the_write_of(kill_step)

    ids: list[int] = []
    lines = open(out / f"steps-{tag}-r{rank}.jsonl", "a")  # noqa: SIM115 (closed below)

    def record(p: batchpilot.Pilot, rec: dict) -> None:
        lines.write(json.dumps({"step": p.step, "size": rec["batch/global_size"], "epoch": rec["epoch"],
                                "ids": ids, "loss": rec["loss"]}) + "\n")
        lines.flush()
        ids.clear()
        if armed and point == "decision" and p.step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)  # the decision is made (and logged), its checkpoint not yet
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if p.step == args.hold_at and resumed is None:
            deadline = time.monotonic() + 120
            while not terminated and time.monotonic() < deadline:
                time.sleep(0.02)

    pilot.add_callback(record)
    for x, y in pilot.batches(max_steps=args.steps):
        micro = pilot.micro_batch
        if armed and point == "step" and pilot.step == kill_step and micro.micro_index == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if armed and point == "micro" and pilot.step >= kill_step and micro.micro_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if not micro.ghost:
            ids.extend(micro.indices.tolist())
        pilot.backward(torch.nn.functional.cross_entropy(ddp(x), y))
    pilot.close()
    lines.close()
    module = ddp.module if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) else ddp
    if rank == 0:
        torch.save([p.detach() for p in module.parameters()], out / f"weights-{tag}.pt")
    (out / f"end-{tag}-r{rank}.json").write_text(json.dumps({"step": pilot.step, "preempted": pilot.preempted}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter shutdown: see docs/distributed.md, "An abort at exit with gloo"


def _kill_spec(spec: str | None) -> tuple[int | None, str, int]:
    if spec is None:
        return None, "", -1
    rank, point, step = spec.split(":")
    if point not in ("step", "micro", "decision", "write"):
        raise SystemExit(f"unknown kill point {point!r}")
    return int(rank), point, int(step)


def _die_inside_the_write_of(step: int) -> None:
    """SIGKILL this process in the checkpoint write of ``step``: the temporary file is complete and synced, the
    rename has not happened (``batchpilot.checkpoint`` calls ``os.replace`` through the ``os`` module)."""
    real_replace = os.replace

    def replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
        if Path(dst).name == f"step-{step:09d}.pt":
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    os.replace = replace  # type: ignore[assignment]


if __name__ == "__main__":
    main()
