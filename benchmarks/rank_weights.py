"""Rank weights on an uneven cluster: 2 gloo ranks, one slowed (a benchmark, not a test).

Workload: the MNIST-1D CNN (``batchpilot.bench.workloads``), DDP over 2 gloo processes on this machine, one
thread each, global batch 128, SGD momentum with the linear LR rule from lr 0.01 at batch 32. The CNN costs only
~20 us per sample, less than a step's fixed costs on a shared machine, so each node's compute is emulated on top
of it by a sleep per sample in the forward, which survives CPU contention from other processes (a sleep does not
compete for a core): rank 0 sleeps ``work`` (``--work-us``, default 100 us) per sample, rank 1, the slow node,
``slowdown * work + (slowdown - 1) * t_cnn`` (``--slowdown``, default 3; ``t_cnn``: the CNN's forward+backward
per sample, measured here first), so rank 1's time per sample is ``slowdown`` times rank 0's. ``--work-us 0``
slows rank 1 alone, by a fixed extra delay per sample.

Three ways to share each global batch, all training the same global batches with exact loss weighting (so the
same model trajectory, step for step, up to float summation order):

* ``even``: ``rank_weights=None`` (64 + 64 samples);
* ``ideal``: the static weights from the calibration, ``1 / t_i`` per sample (what an oracle would set);
* ``auto``: ``rank_weights="auto"`` (RankBalancer: compute time per sample, re-estimated every 10 steps).

Reported per mode (median over ``--repeats``): the median step time on rank 0 after the first 30 steps (auto's
warm-up excluded there; included in the time to target), the training time to reach ``--target`` test accuracy
(evaluated on rank 0 every ``--eval-every`` steps, outside the timed steps), the final accuracy, the speed-up
over ``even``, and auto's final weights. Also the decision synchronisation: the cost of one size broadcast plus
the balancer's one small all-reduce (rates and weights), timed back to back on ready ranks, as a share of the
median step time: if both ran every step, and as run (the size every step, as with a controller deciding every
step, and the balancer's all-reduce as often as it re-estimated: 10 steps after a change, the period doubling
while the weights hold).

    PYTHONPATH=src python benchmarks/rank_weights.py --out bench-out/rank_weights [--quick] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import batchpilot
from batchpilot import distributed as bpdist
from batchpilot.bench.workloads import get_workload
from batchpilot.engine.rank_balance import RankBalancer


class SlowNode(torch.nn.Module):
    """The workload's model, whose forward sleeps ``delay`` seconds per sample (a slower node)."""

    def __init__(self, inner: torch.nn.Module, delay: float) -> None:
        super().__init__()
        self.inner, self.delay = inner, delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay * len(x))
        return self.inner(x)


def per_sample_seconds(workload: Any, rounds: int = 30) -> float:
    """Median forward+backward seconds per sample of the workload's model at 64 samples (one thread)."""
    train, _ = workload.build_data(workload.data_seed)
    model = workload.build_model(0)
    x, y = train.tensors[0][:64], train.tensors[1][:64]
    times = []
    for i in range(rounds + 5):
        start = time.perf_counter()
        workload.loss_fn(model(x), y).backward()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return statistics.median(times) / 64


def accuracy(model: torch.nn.Module, test: Any) -> float:
    with torch.no_grad():
        x, y = test.tensors
        return float((model(x).argmax(1) == y).float().mean())


def run_rank(rank: int, world_size: int, init_file: str, out: str, cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    workload = get_workload("mnist1d")
    train, test = workload.build_data(workload.data_seed)
    inner = workload.build_model(cfg["seed"])
    model = SlowNode(inner, cfg["delays"][rank])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = workload.make_optimizer(ddp.parameters(), workload.base_lr)
    pilot = batchpilot.Pilot(ddp, opt, train, batch_size=cfg["batch"], lr_rule="linear",
                             base_batch_size=workload.base_batch_size, seed=cfg["seed"], system_every=None,
                             rank_weights=cfg["weights"])
    evals: list[tuple[int, float, float]] = []  # (step, training seconds so far, accuracy)
    step_times: list[float] = []
    weights: list[Any] = []

    def callback(p: batchpilot.Pilot, record: dict) -> None:
        step_times.append(record["perf/step_time_s"])
        weights.append(p.rank_weights)
        if rank == 0 and p.step % cfg["eval_every"] == 0:
            evals.append((p.step, sum(step_times), accuracy(inner, test)))

    pilot.add_callback(callback)
    for x, y in pilot.batches(max_steps=cfg["steps"]):
        pilot.backward(workload.loss_fn(ddp(x), y))
    sync = sync_cost(rank, world_size, cfg["batch"])
    result = {"evals": evals, "step_times": step_times, "final_weights": pilot.rank_weights, "sync": sync,
              "balancer_sync_s": None if pilot._ranks.balancer is None else pilot._ranks.balancer.sync_seconds,
              "changes": None if pilot._ranks.balancer is None else pilot._ranks.balancer.changes,
              "estimates": None if pilot._ranks.balancer is None else pilot._ranks.balancer.estimates}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    del pilot, ddp
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see tests/_dist_helpers.finish: no interpreter finalisation after gloo


def sync_cost(rank: int, world_size: int, batch: int, rounds: int = 200) -> dict[str, float]:
    """Median seconds of one decision synchronisation on ready ranks: the size broadcast alone, and with the
    balancer's all-reduce (forced due at every round)."""
    balancer = RankBalancer(world_size, rank, every=1, max_every=1)
    size_only, both = [], []
    for _ in range(rounds):  # noqa: B007
        dist.barrier()
        start = time.perf_counter()
        bpdist.broadcast_int(batch)
        size_only.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        bpdist.broadcast_int(batch)
        balancer.record(64, 0.01)
        balancer.maybe_update(_ + 1)
        both.append(time.perf_counter() - start)
    return {"size_s": statistics.median(size_only), "size_and_weights_s": statistics.median(both)}


def run_mode(cfg: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        mp.spawn(run_rank, args=(2, str(Path(tmp, "init")), tmp, cfg), nprocs=2, join=True)
        wall = time.perf_counter() - started
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    r0 = ranks[0]
    skip = min(30, len(r0["step_times"]) // 2)
    reached = next(((step, t, acc) for step, t, acc in r0["evals"] if acc >= cfg["target"]), None)
    return {
        "median_step_s": statistics.median(r0["step_times"][skip:]),
        "train_s": sum(r0["step_times"]),
        "time_to_target_s": None if reached is None else reached[1],
        "step_at_target": None if reached is None else reached[0],
        "final_accuracy": r0["evals"][-1][2] if r0["evals"] else None,
        "final_weights": r0["final_weights"], "changes": r0["changes"], "estimates": r0["estimates"],
        "steps": len(r0["step_times"]),
        "balancer_sync_s": r0["balancer_sync_s"], "sync": r0["sync"], "wall_s": wall, "evals": r0["evals"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/rank_weights"))
    parser.add_argument("--quick", action="store_true", help="fewer steps, a lower target, 1 repeat (< 60 s)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--slowdown", type=float, default=3.0, help="rank 1's time per sample over rank 0's")
    parser.add_argument("--work-us", type=float, default=100.0, help="emulated compute per sample on rank 0 (us)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.steps or (150 if args.quick else 1000)
    target = args.target or (0.4 if args.quick else 0.9)
    eval_every = args.eval_every or (25 if args.quick else 50)
    torch.set_num_threads(1)
    workload = get_workload("mnist1d")
    t0 = per_sample_seconds(workload)
    work = args.work_us * 1e-6
    delays = [work, args.slowdown * work + (args.slowdown - 1) * t0]
    ideal = [1 / (t0 + d) for d in delays]
    ideal = [w / min(ideal) for w in ideal]
    modes = {"even": None, "ideal": ideal, "auto": "auto"}
    print(f"CNN forward+backward {t0 * 1e6:.1f} us per sample; the ranks sleep {[round(d * 1e6, 1) for d in delays]} "
          f"us per sample (slowdown {args.slowdown:g}); ideal weights {[round(w, 3) for w in ideal]}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(repeats):  # interleaved: drift from other processes hits every mode alike
        for mode, weights in modes.items():
            cfg = {"batch": args.batch, "seed": args.seed, "delays": delays, "weights": weights, "steps": steps, "target": target,
                   "eval_every": eval_every}
            runs[mode].append(run_mode(cfg))
            r = runs[mode][-1]
            print(f"  repeat {rep} {mode:5s}: step {r['median_step_s'] * 1e3:.1f} ms, to target "
                  f"{r['time_to_target_s']} s, final acc {r['final_accuracy']}", flush=True)

    def med(mode: str, key: str) -> float | None:
        values = [r[key] for r in runs[mode] if r[key] is not None]
        return statistics.median(values) if values else None

    summary: dict[str, Any] = {}
    for mode in modes:
        summary[mode] = {"median_step_s": med(mode, "median_step_s"), "time_to_target_s": med(mode, "time_to_target_s"),
                         "final_accuracy": med(mode, "final_accuracy"), "step_at_target": med(mode, "step_at_target"),
                         "final_weights": runs[mode][-1]["final_weights"]}
    for mode in modes:
        s, e = summary[mode], summary["even"]
        s["step_speedup"] = e["median_step_s"] / s["median_step_s"]
        s["target_speedup"] = (e["time_to_target_s"] / s["time_to_target_s"]
                               if e["time_to_target_s"] and s["time_to_target_s"] else None)
    step_s = summary["auto"]["median_step_s"]
    size_s = statistics.median(r["sync"]["size_s"] for m in modes for r in runs[m])
    both_s = statistics.median(r["sync"]["size_and_weights_s"] for m in modes for r in runs[m])
    estimates_per_step = statistics.median(r["estimates"] / r["steps"] for r in runs["auto"])
    sync = {"size_broadcast_s": size_s, "size_and_weights_s": both_s,
            "share_of_step_every_step": both_s / step_s,
            "balancer_estimates_per_step": estimates_per_step,
            "share_of_step_as_run": (size_s + (both_s - size_s) * estimates_per_step) / step_s,
            "in_situ_balancer_share": statistics.median(r["balancer_sync_s"] / r["train_s"] for r in runs["auto"])}
    result = {"config": {"workload": "mnist1d", "batch": args.batch, "ranks": 2, "threads_per_rank": 1, "steps": steps,
                         "target": target, "eval_every": eval_every, "slowdown": args.slowdown, "repeats": repeats,
                         "cnn_per_sample_s": t0, "sleep_per_sample_s": delays, "ideal_weights": ideal,
                         "quick": args.quick, "python": sys.version.split()[0], "torch": torch.__version__,
                         "machine": platform.machine(), "cpus": os.cpu_count()},
              "summary": summary, "sync": sync, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rank_weights.json").write_text(json.dumps(result, indent=1))
    print(f"\n{'mode':6s} {'step ms':>8s} {'speed-up':>8s} {'to target s':>11s} {'speed-up':>8s} {'final acc':>9s}  "
          "weights")
    for mode, s in summary.items():
        ttt = "-" if s["time_to_target_s"] is None else f"{s['time_to_target_s']:.1f}"
        ts = "-" if s["target_speedup"] is None else f"{s['target_speedup']:.2f}x"
        acc = "-" if s["final_accuracy"] is None else f"{s['final_accuracy']:.3f}"
        w = s["final_weights"]
        print(f"{mode:6s} {s['median_step_s'] * 1e3:8.1f} {s['step_speedup']:7.2f}x {ttt:>11s} {ts:>8s} {acc:>9s}  "
              f"{None if w is None else [round(v, 3) for v in w]}")
    print(f"\ndecision sync at batch {args.batch}: size broadcast {size_s * 1e6:.0f} us, size + weights "
          f"{both_s * 1e6:.0f} us = {100 * sync['share_of_step_every_step']:.2f}% of a step if both every step; "
          f"as run (size every step, the balancer's all-reduce {estimates_per_step:.3f} times per step): "
          f"{100 * sync['share_of_step_as_run']:.2f}%; the balancer's collectives in the auto runs, waits included: "
          f"{100 * sync['in_situ_balancer_share']:.2f}% of training time")
    print(f"wrote {args.out / 'rank_weights.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
