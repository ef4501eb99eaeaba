"""Train with changing batch sizes, checkpointing every 3 steps; optionally SIGKILL itself at a given point.

    python _resume_script.py OUT_DIR [--kill-at STEP:MICRO | --kill-at epoch-start] [--workers N]

Writes OUT_DIR/ids.txt (one line per finished step: "step size ids..."), OUT_DIR/log.jsonl,
OUT_DIR/checkpoints/ and, at the end, OUT_DIR/weights.pt.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import batchpilot

SIZES = [8, 24, 5, 40, 16, 3, 31]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", default=None)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(150, 6, generator=g)
    ds = TensorDataset(x, (x[:, 0] * x[:, 1] > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
    pilot = batchpilot.Pilot(
        model, opt, ds, batch_size=12,
        controller=lambda step, size: SIZES[step % len(SIZES)],
        max_micro_batch_size=8, lr_rule="sqrt", lr_schedulers=[sched], num_workers=args.workers,
        log_path=args.out / "log.jsonl", checkpoint_dir=args.out / "checkpoints", checkpoint_every=3,
    )
    resumed = pilot.load_checkpoint(args.out / "checkpoints", missing_ok=True)
    (args.out / "started_at.txt").write_text(str(pilot.step))

    ids: list[int] = []
    with open(args.out / "ids.txt", "a") as out:
        def record(p: batchpilot.Pilot, rec: dict) -> None:
            out.write(f"{p.step} {rec['batch/global_size']} {' '.join(map(str, ids))}\n")
            out.flush()
            ids.clear()

        pilot.add_callback(record)
        for xb, yb in pilot.batches(max_steps=args.steps):
            micro = pilot.micro_batch
            ids.extend(micro.indices.tolist())
            if args.kill_at and resumed is None and _should_kill(args.kill_at, pilot):
                os.kill(os.getpid(), signal.SIGKILL)
            pilot.backward(torch.nn.functional.cross_entropy(model(xb), yb))
    pilot.close()
    torch.save([p.detach() for p in model.parameters()], args.out / "weights.pt")


def _should_kill(spec: str, pilot: batchpilot.Pilot) -> bool:
    micro = pilot.micro_batch
    if spec == "epoch-start":  # the first micro-batch of the first step of epoch 1
        return pilot.epoch == 1 and pilot.coverage == 0 and micro.micro_index == 0
    step, index = (int(v) for v in spec.split(":"))
    return pilot.step == step and micro.micro_index == index


if __name__ == "__main__":
    main()
