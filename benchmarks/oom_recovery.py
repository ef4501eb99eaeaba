"""What does ``oom_recovery=True`` cost when nothing runs out of memory? (A benchmark, not a test.)

On one process the recovery is a ``try`` around each micro-batch: nothing to measure. With several ranks
it adds one integer all-reduce per step (the ranks agree that no one failed), and under DDP it moves the
gradient all-reduce from inside the last backward (where DDP overlaps it with the backward) to the step's
end, plus a broadcast of the module buffers. This measures that on 2 gloo processes (1 torch thread each)
training a workload's model with DDP at a fixed batch: steps per second with and without recovery,
interleaved (A, B, A, B, ...) over ``--rounds`` rounds of ``--steps`` steps; reported: the median time per
step of each and the median of the per-round ratios. No step runs out of memory here.

    PYTHONPATH=src python benchmarks/oom_recovery.py --out bench-out/oom-recovery [--workload mnist1d]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import batchpilot
from batchpilot.bench.workloads import get_workload


def _time_steps(workload, train_set, recovery: bool, batch: int, steps: int, seed: int) -> float:
    """Seconds per step of ``steps`` DDP steps (after 3 untimed ones)."""
    model = torch.nn.parallel.DistributedDataParallel(workload.build_model(0))
    opt = workload.make_optimizer(model.parameters(), workload.base_lr)
    pilot = batchpilot.Pilot(model, opt, train_set, batch_size=batch, seed=seed, oom_recovery=recovery,
                             progress=False, system_every=None)
    start = None
    for x, y in pilot.batches(max_steps=steps + 3):
        if start is None and pilot.step == 3:
            start = time.perf_counter()
        with pilot.micro_step():
            pilot.backward(workload.loss_fn(model(x), y))
    seconds = (time.perf_counter() - start) / steps
    pilot.close()
    return seconds


def _worker(rank: int, init_file: str, out_file: str, workload_name: str, batch: int, steps: int, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        workload = get_workload(workload_name)
        train_set, _ = workload.build_data(workload.data_seed)
        times: dict[str, list[float]] = {"ddp": [], "ddp+oom_recovery": []}
        _time_steps(workload, train_set, False, batch, 3, 0)  # warm-up
        for r in range(rounds):
            for name, recovery in (("ddp", False), ("ddp+oom_recovery", True)):
                times[name].append(_time_steps(workload, train_set, recovery, batch, steps, r))
        if rank == 0:
            Path(out_file).write_text(json.dumps(times))
        gc.collect()  # the DDP models' reducers go before their process group
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    # gloo's worker thread may release the last collective's work (and a Python object it holds) while the
    # interpreter finalises, which aborts the process ("terminate called without an active exception");
    # the results are written, so leave without finalising.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mnist1d")
    parser.add_argument("--batch", type=int, default=256, help="global batch size (default 256)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--out", default="bench-out/oom-recovery")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "times.json")
        print(f"2 gloo ranks x 1 thread, {args.workload}, batch {args.batch}: {args.rounds} rounds of {args.steps} steps")
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), raw, args.workload, args.batch, args.steps, args.rounds),
                 nprocs=2, join=True)
        times = json.loads(Path(raw).read_text())
    ratios = [b / a for a, b in zip(times["ddp"], times["ddp+oom_recovery"])]
    result = {
        "workload": args.workload, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
        "torch": torch.__version__, "seconds_per_step": times,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "median_round_ratio": statistics.median(ratios),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    for name, value in result["median_s"].items():
        print(f"  {name:18s} {1000 * value:8.2f} ms/step")
    print(f"  recovery / plain: {result['median_round_ratio']:.3f} (median of per-round ratios)")
    print(f"wrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
