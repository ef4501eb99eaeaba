"""Adaptive-batch DDP training under torchrun, with checkpoints that survive a worker failure.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 examples/ddp_train.py --out runs/ddp

Each restart resumes from the newest checkpoint in ``--out``: same remaining samples, same batch sizes,
same weights as a run that never failed. ``--fail-at-step N`` makes rank 1 exit at step N of the first
attempt, to see that happen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import MultiplicativeStep
from batchpilot.distributed import init_torchrun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fail-at-step", type=int, default=None)
    args = parser.parse_args()

    # Like dist.init_process_group("gloo"), but safe across torchrun restarts (see its docstring).
    rank, _ = init_torchrun("gloo")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 20, generator=g)
    y = (x[:, :5].sum(1) > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    pilot = batchpilot.Pilot(
        ddp, optimizer, TensorDataset(x, y),
        batch_size=16,
        controller=MultiplicativeStep(16, 2.0, every_steps=15, max_size=256),  # 16 -> 32 -> 64 -> 128
        lr_rule="sqrt",
        max_micro_batch_size=32,
        log_path=args.out / "log.jsonl",
        checkpoint_dir=args.out / "checkpoints",
        checkpoint_every=10,
    )
    resumed = pilot.load_checkpoint(args.out / "checkpoints", missing_ok=True)
    if rank == 0:
        print(f"attempt {restarts}: starting at step {pilot.step} ({'from ' + str(resumed) if resumed else 'fresh'})")

    if args.fail_at_step is not None and restarts == 0 and rank == 1:
        def crash(p: batchpilot.Pilot, record: dict) -> None:
            if p.step == args.fail_at_step:
                os._exit(1)  # simulate a crashed worker, right after the step's optimizer update

        pilot.add_callback(crash)

    for xb, yb in pilot.batches(max_steps=args.steps):
        pilot.backward(torch.nn.functional.cross_entropy(ddp(xb), yb))
    pilot.close()

    if rank == 0:
        sizes = [r["batch/global_size"] for r in batchpilot.read_log(args.out / "log.jsonl") if r["type"] == "step"]
        result = {"restarts": restarts, "sizes": sizes, "weights": [p.detach().tolist() for p in model.parameters()]}
        (args.out / "result.json").write_text(json.dumps(result))
        print(f"done: {pilot.step} steps, sizes {sorted(set(sizes))}, final loss {pilot.last_record['loss']:.4f}")
    dist.barrier()
    dist.destroy_process_group()
    # With gloo the interpreter's shutdown can, rarely, abort ("terminate called without an active exception")
    # after all this is done, which torchrun would count as a failure: leave without it (docs/distributed.md).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
