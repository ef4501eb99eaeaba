"""Gradient compression on gloo ranks: bytes on the wire, step time, accuracy, and the bandwidth where each wins.

Trains a workload's model with DDP on ``--world-sizes`` gloo processes (1 torch thread each) at a fixed global batch
for ``--steps`` steps under each method: ``allreduce`` (fp32), ``fp16``, ``powersgd:1/2/4`` (torch's hook, error
feedback), ``1bit`` (batchpilot's 1-bit hook with error feedback) and ``auto``
(:class:`batchpilot.distributed.adaptive_compression.AdaptiveCompression`). Every method runs through the
adaptive hook's accounting (a fixed method is ``AdaptiveCompression(levels=[method])``), so bytes are counted alike:
bytes a rank sends per step (a ring all-reduce counted as ``2 (N-1)/N`` of its input). Rank 0 evaluates the test
accuracy every ``--eval-every`` steps (not counted in the training time).

Three network regimes, labelled in the output:

* ``loopback``: the real loopback device, no shaping.
* ``delay:BW``: an emulated link of ``BW`` bytes/s: each bucket's result waits ``bytes / BW`` after its collectives
  (``link_delay`` of the hook), one transfer at a time per rank. Survives CPU contention.
* ``tc:RATE`` (``--tc``; root only): real traffic shaping, a ``tbf`` qdisc of ``RATE`` on the loopback of a private
  network namespace (``unshare -n``), so no other process on the machine is slowed.

Plus ``projected``: time to target against bandwidth, ``steps_to_target x (loopback step time + bytes / BW)``, from
the loopback runs; and ``simulator``: the same sweep with :mod:`batchpilot.sim.cluster`'s network model (ring
all-reduce, compression factors, no codec cost and no accuracy effect) on the shipped trace of the workload.

    PYTHONPATH=src python benchmarks/compression.py --out bench-out/compression [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

METHODS = ("allreduce", "fp16", "powersgd:1", "powersgd:2", "powersgd:4", "1bit", "auto")
BANDWIDTHS = (1e6, 3e6, 1e7, 3e7, 1e8, 3e8, 1e9, 1e10)


def _hook_state(method: str, link_delay: float, every: int, min_dwell: int, warmup: int):
    from batchpilot.distributed.adaptive_compression import AdaptiveCompression

    if method == "auto":
        return AdaptiveCompression(every=every, min_dwell=min_dwell, link_delay=link_delay, warmup_steps=warmup)
    return AdaptiveCompression(levels=["none" if method == "allreduce" else method], link_delay=link_delay,
                               warmup_steps=warmup)


def _accuracy(model: torch.nn.Module, test_set, limit: int = 4000) -> float:
    x, y = test_set.tensors[0][:limit], test_set.tensors[1][:limit]
    with torch.no_grad():
        model.eval()
        correct = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum()) for i in range(0, len(x), 1000))
        model.train()
    return correct / len(x)


def _worker(rank: int, world: int, init_file: str, out_file: str, cfg: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from batchpilot.bench.workloads import get_workload

    w = get_workload(cfg["workload"])
    train_set, test_set = w.build_data(w.data_seed)
    ddp = torch.nn.parallel.DistributedDataParallel(w.build_model(cfg["seed"]))
    state = _hook_state(cfg["method"], cfg["link_delay"], cfg["every"], cfg["min_dwell"], cfg["warmup"])
    state.register(ddp)
    batch = cfg["batch"]
    lr = w.base_lr * (batch / w.base_batch_size if w.lr_rule == "linear" else math.sqrt(batch / w.base_batch_size))
    opt = w.make_optimizer(ddp.parameters(), lr)
    gen = torch.Generator().manual_seed(cfg["seed"])
    order, at = torch.randperm(len(train_set), generator=gen), 0
    share = batch // world
    step_times, curve, train_s = [], [], 0.0
    for step in range(1, cfg["steps"] + 1):
        if at + batch > len(order):
            order, at = torch.randperm(len(train_set), generator=gen), 0
        idx = order[at + rank * share: at + (rank + 1) * share]
        at += batch
        x, y = train_set.tensors[0][idx], train_set.tensors[1][idx]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        w.loss_fn(ddp(x), y).backward()
        opt.step()
        seconds = time.perf_counter() - start
        step_times.append(seconds)
        train_s += seconds
        if rank == 0 and (step % cfg["eval_every"] == 0 or step == cfg["steps"]):
            curve.append((step, train_s, _accuracy(ddp.module, test_set)))
        if step % cfg["eval_every"] == 0:
            dist.barrier()  # the others wait for rank 0's evaluation outside their step timers
    if rank == 0:
        result = {"steps": cfg["steps"], "median_step_s": statistics.median(step_times[3:] or step_times),
                  "train_s": train_s, "wire_bytes_per_step": state.wire_bytes / cfg["steps"],
                  "full_bytes_per_step": state.full_bytes / cfg["steps"], "curve": curve,
                  "final_accuracy": curve[-1][2], "switches": state.switches, "levels_predicted": state.predicted}
        Path(out_file).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's finalisation: beside gloo's threads it can abort (tests/_dist_helpers.py)


def run(workload: str, method: str, world: int, *, steps: int, batch: int, link_delay: float = 0.0,
        eval_every: int = 50, seed: int = 0, every: int = 10, min_dwell: int = 20, warmup: int = 0) -> dict:
    """One training run on ``world`` gloo processes; rank 0's measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        cfg = {"workload": workload, "method": method, "steps": steps, "batch": batch, "link_delay": link_delay,
               "eval_every": eval_every, "seed": seed, "every": every, "min_dwell": min_dwell, "warmup": warmup}
        mp.start_processes(_worker, args=(world, init, out, cfg), nprocs=world, start_method="spawn")
        return json.loads(Path(out).read_text())


def time_to_target(curve: list, target: float) -> tuple[float, float]:
    """``(steps, training seconds)`` at the first evaluation reaching ``target`` (``inf`` if none)."""
    for step, seconds, acc in curve:
        if acc >= target:
            return float(step), float(seconds)
    return math.inf, math.inf


def simulated(workload: str, world: int, batch: int, methods: list[str]) -> dict:
    """Time to target of a static batch against bandwidth in the simulator's network model (no codec cost, no
    accuracy effect), on the workload's shipped trace; ``{}`` when there is none."""
    from batchpilot.sim import ClusterSpec, best_static, load_trace
    from batchpilot.sim.trace import shipped_traces

    if workload not in shipped_traces():
        return {}
    trace = load_trace(workload)
    table: dict[str, list[float]] = {}
    for method in methods:
        if method == "auto":
            continue
        comp = {"allreduce": "none"}.get(method, method)
        table[method] = [best_static(trace, ClusterSpec.parse(f"gpus={world},bandwidth={bw:g},compress={comp}"),
                                     [batch])[1].time_to_target_s for bw in BANDWIDTHS]
    return table


def _sweep(args: argparse.Namespace, regime: str, link_delay: float) -> list[dict]:
    rows = []
    for workload in args.workloads:
        for world in args.world_sizes:
            for method in args.methods:
                started = time.perf_counter()
                r = run(workload, method, world, steps=args.steps[workload], batch=args.batch[workload],
                        link_delay=link_delay, eval_every=args.eval_every[workload], every=args.every, min_dwell=args.min_dwell, warmup=args.warmup)
                r.update(workload=workload, world=world, method=method, regime=regime, wall_s=time.perf_counter() - started)
                rows.append(r)
                print(f"  {regime:14s} {workload:8s} N={world} {method:11s} {r['median_step_s'] * 1e3:8.1f} ms/step "
                      f"{r['wire_bytes_per_step']:12,.0f} B/step  acc {r['final_accuracy']:.4f}", flush=True)
    return rows


def _tc_rows(args: argparse.Namespace, rate: str) -> list[dict]:
    """Re-run this script inside a private network namespace whose loopback is shaped to ``rate``."""
    with tempfile.TemporaryDirectory() as tmp:
        inner = [sys.executable, os.path.abspath(__file__), "--inner-json", os.path.join(tmp, "rows.json"),
                 "--regime", f"tc:{rate}", *sys.argv[1:]]
        script = (f"ip link set lo mtu 1500 && ip link set lo up && tc qdisc add dev lo root tbf rate {rate} "
                  f"burst 32kb limit 4mb && GLOO_SOCKET_IFNAME=lo exec {shlex.join(inner)}")
        proc = subprocess.run(["unshare", "-n", "sh", "-c", script], check=False)
        path = Path(tmp) / "rows.json"
        if proc.returncode != 0 or not path.exists():
            print(f"tc:{rate} not available here (unshare/tc need root); skipped")
            return []
        return json.loads(path.read_text())


def summarize(rows: list[dict], target: float | None) -> None:
    """Add bytes ratios, accuracy loss and time to target against the allreduce run of the same regime, workload and
    world size; the target is ``target`` or, by default, 1 point under that allreduce run's final accuracy."""
    for r in rows:
        base = next((b for b in rows if b["method"] == "allreduce" and all(b[k] == r[k] for k in ("regime", "workload", "world"))), r)
        r["bytes_reduction"] = base["wire_bytes_per_step"] / max(r["wire_bytes_per_step"], 1e-9)
        r["accuracy_loss_points"] = 100 * (base["final_accuracy"] - r["final_accuracy"])
        r["target"] = base["final_accuracy"] - 0.01 if target is None else target
        r["steps_to_target"], r["time_to_target_s"] = time_to_target(r["curve"], r["target"])


def projected(rows: list[dict]) -> dict:
    """Time to target against bandwidth from the loopback runs: ``steps_to_target x (step time + bytes / BW)``."""
    out: dict = {}
    for r in rows:
        if r["regime"] == "loopback":
            key = f"{r['workload']} N={r['world']}"
            out.setdefault(key, {})[r["method"]] = [r["steps_to_target"] * (r["median_step_s"] + r["wire_bytes_per_step"] / bw)
                                                    for bw in BANDWIDTHS]
    return out


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [("projected (measured)", k, v) for k, v in result["projected"].items()]
    panels += [("simulator", k, v) for k, v in result["simulator"].items()]
    if not panels:
        return
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (label, key, table) in zip(axes.flat, panels):
        for method, times in table.items():
            color = plt.get_cmap("tab10")(METHODS.index(method) if method in METHODS else 9)
            reached = any(math.isfinite(t) for t in times)
            ax.loglog(BANDWIDTHS, [t if math.isfinite(t) else math.nan for t in times], marker="o", ms=3, color=color,
                      label=method if reached else f"{method} (not reached)")
        ax.legend(fontsize=5)
        ax.set_title(f"{key} ({label})", fontsize=8)
        ax.set_xlabel("link bandwidth (bytes/s)", fontsize=7)
        ax.set_ylabel("time to target (s)", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=72)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench-out/compression"))
    p.add_argument("--quick", action="store_true", help="mnist1d, 2 ranks, 4 methods, 120 steps: < 60 s")
    p.add_argument("--workloads", default="mnist1d,markov")
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: mnist1d 1500, markov 150)")
    p.add_argument("--eval-every", type=int, default=None, help="default: a tenth of the steps")
    p.add_argument("--target", type=float, default=None, help="test accuracy (default: allreduce's final - 1 point)")
    p.add_argument("--delay-bandwidths", default="3e6", help="emulated link bandwidths (bytes/s) to run; '' for none")
    p.add_argument("--tc", default="", help="tbf rates for real shaping in a private netns, e.g. 100mbit (root)")
    p.add_argument("--skip-loopback", action="store_true", help="only the delay and tc regimes")
    p.add_argument("--warmup", type=int, default=0, help="full-precision steps first (1-bit Adam's warm-up)")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--min-dwell", type=int, default=20)
    p.add_argument("--inner-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--regime", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.workloads, args.world_sizes, args.methods = "mnist1d", "2", "allreduce,powersgd:1,1bit,auto"
        args.steps, args.eval_every, args.delay_bandwidths, args.tc = 300, 50, "", ""
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.world_sizes = [int(n) for n in args.world_sizes.split(",") if n]
    args.methods = [m for m in args.methods.split(",") if m]
    args.steps = {w: args.steps or {"markov": 150}.get(w, 1500) for w in args.workloads}
    args.eval_every = {w: args.eval_every or max(1, args.steps[w] // 10) for w in args.workloads}
    args.batch = {w: 128 for w in args.workloads}
    if args.inner_json:  # inside the shaped namespace
        Path(args.inner_json).write_text(json.dumps(_sweep(args, args.regime, 0.0)))
        return
    rows = [] if args.skip_loopback else _sweep(args, "loopback", 0.0)
    for bw in [float(b) for b in args.delay_bandwidths.split(",") if b]:
        rows += _sweep(args, f"delay:{bw:g}", 1.0 / bw)
    for rate in [r for r in args.tc.split(",") if r]:
        rows += _tc_rows(args, rate)
    summarize(rows, args.target)
    result = {"rows": rows, "bandwidths": list(BANDWIDTHS), "target": args.target, "projected": projected(rows),
              "simulator": {f"{w} N={n}": table for w in args.workloads for n in args.world_sizes
                            if (table := simulated(w, n, args.batch[w], args.methods))},
              "quick": args.quick}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compression.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, args.out / "compression.png")
    print(f"\n{'regime':14s} {'workload':8s} {'N':>2s} {'method':11s} {'B/step':>11s} {'x fewer':>8s} {'ms/step':>8s} "
          f"{'acc':>7s} {'loss pt':>7s} {'t->tgt s':>8s}")
    for r in rows:
        print(f"{r['regime']:14s} {r['workload']:8s} {r['world']:2d} {r['method']:11s} {r['wire_bytes_per_step']:11,.0f} "
              f"{r['bytes_reduction']:8.1f} {r['median_step_s'] * 1e3:8.1f} {r['final_accuracy']:7.4f} "
              f"{r['accuracy_loss_points']:7.2f} {r['time_to_target_s']:8.2f}")
    png = args.out / "compression.png"
    print(f"wrote {args.out / 'compression.json'}" + (f" and {png}" if png.exists() else ""))


if __name__ == "__main__":
    main()
