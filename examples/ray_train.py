"""Adaptive-batch training on Ray Train: batchpilot's Pilot inside a TorchTrainer, Ray's checkpoints for resume.

    pip install -e ".[ray]"
    python examples/ray_train.py --storage runs/ray --name demo --steps 40

Two CPU workers (``ScalingConfig(num_workers=2, use_gpu=False)``): Ray starts them and their gloo process
group; ``ray.train.torch.prepare_model`` wraps the model in DDP; the Pilot cuts each rank's share of every
global batch itself (no ``prepare_data_loader``: its ``DistributedSampler`` would split the data a second
time). Every ``--report-every`` steps the Pilot's checkpoint goes to Ray with ``ray.train.report``; a new
``fit()`` with the same ``--storage`` and ``--name`` (and, say, more ``--steps``) finds it through
``ray.train.get_checkpoint()`` and continues exactly: same remaining samples, same sizes, same weights as a
run that was never stopped. So does a worker group that Ray restarts after a failure
(``--max-failures``; ``--fail-at-step N`` makes rank 1 fail at step N of the first attempt to see it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.controllers import MultiplicativeStep


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """What every Ray worker runs (Ray has set up the process group: gloo on CPU)."""
    context = ray.train.get_context()
    rank = context.get_world_rank()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(config["samples"], 20, generator=g)
    y = (x[:, :5].sum(1) > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    ddp = ray.train.torch.prepare_model(model)  # DistributedDataParallel over Ray's group (2 workers)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    pilot = batchpilot.Pilot(
        ddp, optimizer, TensorDataset(x, y),
        batch_size=16,
        controller=MultiplicativeStep(16, 2.0, every_steps=8, max_size=128),  # 16 -> 32 -> 64 -> 128
        lr_rule="sqrt",
        max_micro_batch_size=32,
    )
    checkpoint = ray.train.get_checkpoint()  # the last one reported by this run (same storage and name)
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            pilot.load_checkpoint(folder)  # a collective: every rank loads the same file
    attempt = _attempt(config, rank)

    def report(p: batchpilot.Pilot, record: dict) -> None:  # runs on every rank after every step
        if p.step == config["fail_at_step"] and attempt == 0 and rank == 1:
            raise RuntimeError(f"rank 1 fails at step {p.step} (--fail-at-step)")
        if p.step % config["report_every"] and p.step != config["steps"]:
            return
        with tempfile.TemporaryDirectory() as folder:
            p.save_checkpoint(folder + os.sep)  # rank 0 writes step-<n>.pt; every rank must call it
            metrics = {"step": p.step, "loss": record["loss"], "batch_size": record["batch/global_size"],
                       "samples_seen": p.samples_seen}
            # Every worker reports (a barrier); only rank 0 hands over a checkpoint, which Ray copies to storage.
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder) if rank == 0 else None)

    pilot.add_callback(report)
    trace = None if config["trace"] is None else _open_trace(Path(config["trace"]) / f"rank{rank}.jsonl", pilot.step)
    for xb, yb in pilot.batches(max_steps=config["steps"]):
        if trace is not None:
            micro = pilot.micro_batch
            trace.write(json.dumps({"step": micro.step, "micro_index": micro.micro_index, "epoch": micro.epoch,
                                    "ghost": micro.ghost, "size": micro.global_size,
                                    "indices": micro.indices.tolist()}) + "\n")
        pilot.backward(torch.nn.functional.cross_entropy(ddp(xb), yb))
    if trace is not None:
        trace.close()
    pilot.close()


def _open_trace(path: Path, step: int) -> Any:
    """This rank's record of the micro-batches it trained (for the test), without those of steps after ``step``
    (the position restored: a restarted attempt trains them again)."""
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < step] if path.exists() else []
    path.write_text("".join(line + "\n" for line in kept))
    return path.open("a", buffering=1)  # line-buffered: a failing attempt leaves its lines written


def _attempt(config: dict[str, Any], rank: int) -> int:
    """How many times this rank started in this run before (a marker file per start; only for --fail-at-step)."""
    if config["fail_at_step"] is None:
        return 0
    marker = Path(config["storage"]) / config["name"] / f"starts-rank{rank}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    starts = int(marker.read_text()) if marker.exists() else 0
    marker.write_text(str(starts + 1))
    return starts


def fit(storage: Path, name: str, steps: int, *, report_every: int = 10, samples: int = 512,
        max_failures: int = 0, fail_at_step: int | None = None, trace: Path | None = None) -> ray.train.Result:
    """One ``TorchTrainer.fit()``; it continues the run ``storage/name`` when that run reported a checkpoint."""
    storage = storage.resolve()
    config = {"steps": steps, "report_every": report_every, "samples": samples, "fail_at_step": fail_at_step,
              "storage": str(storage), "name": name, "trace": None if trace is None else str(trace.resolve())}
    trainer = ray.train.torch.TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
        run_config=ray.train.RunConfig(
            name=name, storage_path=str(storage),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            failure_config=ray.train.FailureConfig(max_failures=max_failures)),
    )
    return trainer.fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", type=Path, required=True, help="Ray's storage_path (checkpoints)")
    parser.add_argument("--name", default="batchpilot", help="the run's name: the same name continues it")
    parser.add_argument("--steps", type=int, default=40, help="train until this many optimizer steps")
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--max-failures", type=int, default=0, help="worker-group restarts Ray may make")
    parser.add_argument("--fail-at-step", type=int, default=None)
    parser.add_argument("--trace", type=Path, default=None, help="a folder for each rank's trained indices")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False)
    result = fit(args.storage, args.name, args.steps, report_every=args.report_every,
                 max_failures=args.max_failures, fail_at_step=args.fail_at_step, trace=args.trace)
    print(f"done: {result.metrics}; last checkpoint {result.checkpoint.path if result.checkpoint else None}")
    ray.shutdown()


if __name__ == "__main__":
    main()
