"""The automatic mode, checkpointing every 2 steps; optionally SIGKILLs itself once, during the start probes or
after them (for tests/engine/test_auto_processes.py).

    python _auto_script.py OUT_DIR [--kill-at probe:N | --kill-at step:N] [--steps S]

Writes OUT_DIR/ids.txt (one line per finished training step: "step size ids..."), OUT_DIR/started_at.txt (the step
it resumed from), OUT_DIR/probe.json and, at the end, OUT_DIR/weights.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import Auto


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", default=None)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(160, 6, generator=g)
    ds = TensorDataset(x, (x[:, 0] * x[:, 1] > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # min_size == max_size: the knee is forced, so the probes' outcome does not depend on timings.
    pilot = batchpilot.Pilot(
        model, opt, ds, batch_size="auto", controller=Auto(16, 16, lr_steps=12), lr_rule="auto", max_micro_batch_size=8,
        checkpoint_dir=args.out / "checkpoints", checkpoint_every=2, log_path=args.out / "log.jsonl",
    )
    resumed = pilot.load_checkpoint(args.out / "checkpoints", missing_ok=True)
    (args.out / "started_at.txt").write_text(str(pilot.step))
    marker = args.out / "killed"
    probe_micro = 0
    ids: list[int] = []
    with open(args.out / "ids.txt", "a") as out:
        def record(p: batchpilot.Pilot, rec: dict) -> None:
            out.write(f"{p.step} {rec['batch/global_size']} {' '.join(map(str, ids))}\n")
            out.flush()
            ids.clear()

        pilot.add_callback(record)
        for xb, yb in pilot.batches(max_steps=args.steps):
            if pilot.probing:
                probe_micro += 1
            else:
                ids.extend(pilot.micro_batch.indices.tolist())
            if args.kill_at and not marker.exists() and _should_kill(args.kill_at, pilot, probe_micro):
                marker.write_text(str(resumed))
                os.kill(os.getpid(), signal.SIGKILL)
            pilot.backward(torch.nn.functional.cross_entropy(model(xb), yb))
    pilot.close()
    (args.out / "probe.json").write_text(json.dumps(pilot.controller.probe.to_dict()))
    torch.save([p.detach() for p in model.parameters()], args.out / "weights.pt")


def _should_kill(spec: str, pilot: batchpilot.Pilot, probe_micro: int) -> bool:
    where, n = spec.split(":")
    if where == "probe":
        return pilot.probing and probe_micro == int(n)
    return not pilot.probing and pilot.step == int(n) and pilot.micro_batch.micro_index == 1


if __name__ == "__main__":
    main()
