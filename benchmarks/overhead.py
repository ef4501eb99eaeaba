"""What does batchpilot cost per step? Two measurements (a benchmark, not a test).

(a) Loader: one epoch of MNIST-1D (48k samples, x (1, 40)) at a fixed batch size through
    ``batchpilot.AdaptiveDataLoader`` versus ``torch.utils.data.DataLoader``, with ``num_workers`` 0 and 2.
    Two DataLoader baselines: torch's default (one ``dataset[i]`` per sample, then ``default_collate``) and
    a batched one (a ``BatchSampler`` handed over as the sampler, so each fetch is one tensor-indexing
    call, which is what AdaptiveDataLoader does for a TensorDataset). The second isolates batchpilot's own
    bookkeeping; the first is what a user switching from a plain loop actually compares against.
(b) Engine: the whole ``Pilot`` step (fetch, forward, backward, optimizer step, bookkeeping, record)
    versus a hand-written loop (shuffled tensor indexing, forward, backward, SGD step) at batch 128 on the
    MNIST-1D CNN. Two hand loops: ``x_all[idx]`` (advanced indexing) and one ``index_select`` per tensor
    (the fetch issue 21's target (e) names). Pilot runs with its defaults (which include the gradient-norm
    check that skips non-finite steps), with ``skip_nonfinite=False``, and with gradient statistics: the
    adaptive noise-scale period (what a controller that reads ``stats/noise_scale`` gets; the controller here
    keeps the size) and the old fixed period of 16. (b') repeats (b) with a single linear layer, whose step
    costs almost nothing, to expose the fixed cost per step in us.

Target (e) of issue 21, printed at the end: statistics overhead (adaptive period vs ``Pilot (defaults)``)
<= 3% per step, and ``Pilot (defaults)`` <= 1.03x the ``index_select`` hand loop.

Method: every variant runs once untimed (warm-up; worker start-up), then repetitions are interleaved
(A, B, C, A, B, C, ...) so drift and noise from other processes hit every variant alike. Reported: the
median time per batch/step and the ratio of medians to the baseline, plus the median of the per-round
ratios (robust to slow rounds). On a shared machine the absolute numbers move; the ratios are the result.

    PYTHONPATH=src python benchmarks/overhead.py --out bench-out/overhead [--rounds 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import batchpilot
from batchpilot.bench.workloads import get_workload
from batchpilot.controllers.base import Controller


class KeepSize(Controller):
    """Reads the gradient noise scale (so the engine measures it, at its default adaptive period) and keeps
    the batch size: the statistics' cost without a size change."""

    required_stats = ("stats/noise_scale",)

    def decide(self, obs) -> int:
        return obs.batch_size


class BatchedTensorDataset(TensorDataset):
    """A TensorDataset whose ``dataset[list_of_indices]`` returns a whole batch (for a batched DataLoader)."""

    def __getitem__(self, index):  # index: a list of ints from the BatchSampler
        idx = torch.as_tensor(index)
        return tuple(t.index_select(0, idx) for t in self.tensors)


# ------------------------------------------------------------------------------------------ (a)
def loader_variants(train: TensorDataset, batch_size: int, workers: int) -> dict[str, Callable[[], int]]:
    """name -> function that iterates one epoch and returns the number of batches."""
    kw = {"num_workers": workers, "persistent_workers": workers > 0}
    plain = DataLoader(train, batch_size=batch_size, shuffle=True, **kw)
    batched_ds = BatchedTensorDataset(*train.tensors)
    batched = DataLoader(
        batched_ds,
        sampler=BatchSampler(RandomSampler(batched_ds), batch_size=batch_size, drop_last=False),
        batch_size=None,  # the sampler already yields batches of indices
        **kw,
    )
    adaptive = batchpilot.AdaptiveDataLoader(train, batch_size, num_workers=workers)

    def run(loader) -> Callable[[], int]:
        def epoch() -> int:
            n = 0
            for _batch in loader:
                n += 1
            return n

        return epoch

    return {"DataLoader (per-sample fetch)": run(plain), "DataLoader (batched fetch)": run(batched),
            "AdaptiveDataLoader": run(adaptive)}


# ------------------------------------------------------------------------------------------ (b)
def linear_model(seed: int) -> torch.nn.Module:
    """A near-free model (flatten + one linear layer), so the per-step fixed costs dominate."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(40, 10))


def engine_variants(
    train: TensorDataset, batch_size: int, steps: int, build_model: Callable[[int], torch.nn.Module]
) -> dict[str, Callable[[], int]]:
    """name -> function that trains ``steps`` steps and returns the number of steps done."""
    wl = get_workload("mnist1d")
    x_all, y_all = train.tensors
    n = len(y_all)
    loss_fn = torch.nn.functional.cross_entropy

    model = build_model(0)
    opt = wl.make_optimizer(model.parameters(), wl.base_lr)
    gen = torch.Generator().manual_seed(0)
    state = {"perm": torch.randperm(n, generator=gen), "pos": 0}

    def hand() -> int:
        # The loop a user writes without batchpilot: shuffle once per epoch, slice, index, step.
        for _ in range(steps):
            if state["pos"] >= n:
                state["perm"], state["pos"] = torch.randperm(n, generator=gen), 0
            idx = state["perm"][state["pos"] : state["pos"] + batch_size]
            state["pos"] += batch_size
            x, y = x_all[idx], y_all[idx]
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return steps

    model_s = build_model(0)
    opt_s = wl.make_optimizer(model_s.parameters(), wl.base_lr)
    state_s = {"perm": torch.randperm(n, generator=torch.Generator().manual_seed(0)), "pos": 0}

    def hand_index_select() -> int:
        # The same loop, fetching each batch with one index_select per tensor (what Pilot's fetch does).
        for _ in range(steps):
            if state_s["pos"] >= n:
                state_s["perm"], state_s["pos"] = torch.randperm(n, generator=gen), 0
            idx = state_s["perm"][state_s["pos"] : state_s["pos"] + batch_size]
            state_s["pos"] += batch_size
            x, y = x_all.index_select(0, idx), y_all.index_select(0, idx)
            loss = loss_fn(model_s(x), y)
            opt_s.zero_grad(set_to_none=True)
            loss.backward()
            opt_s.step()
        return steps

    def pilot_loop(**kwargs) -> Callable[[], int]:
        m = build_model(0)
        o = wl.make_optimizer(m.parameters(), wl.base_lr)
        pilot = batchpilot.Pilot(m, o, train, batch_size=batch_size, progress=False, **kwargs)

        def run() -> int:
            start = pilot.step
            for x, y in pilot.batches(max_steps=start + steps):
                pilot.backward(loss_fn(m(x), y))
            return pilot.step - start

        run.pilot = pilot  # type: ignore[attr-defined]
        return run

    return {
        "hand-written loop": hand,
        "hand-written loop (index_select)": hand_index_select,
        "Pilot (defaults)": pilot_loop(),
        "Pilot (skip_nonfinite=False)": pilot_loop(skip_nonfinite=False),
        # The statistics on (noise scale, loss trend, throughput, system load): the adaptive period a
        # controller that reads the noise scale gets by default, and the old fixed period of 16.
        "Pilot (+ statistics, adaptive period)": pilot_loop(controller=KeepSize()),
        "Pilot (+ statistics, noise_every=16)": pilot_loop(noise_every=16),
    }


# ------------------------------------------------------------------------------------- harness
def measured_steps(variants: dict[str, Callable[[], int]]) -> dict[str, float]:
    """The noise-scale measurements each Pilot variant has made so far (0 without a probe)."""
    out = {}
    for name, fn in variants.items():
        pilot = getattr(fn, "pilot", None)
        if pilot is not None:
            out[name] = float(pilot.last_record.get("stats/noise_count", 0))
    return out


def interleaved(variants: dict[str, Callable[[], int]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per unit (batch or step) of every variant, ``rounds`` times, interleaved."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()  # warm-up: worker start-up, allocator, first-call costs (and the probe's start-up phase)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        names = list(variants)
        names = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
        for name in names:
            t0 = time.perf_counter()
            units = variants[name]()
            times[name].append((time.perf_counter() - t0) / units)
    return times


def summarize(times: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float]]:
    base = times[baseline]
    out = {}
    for name, ts in times.items():
        out[name] = {
            "median_ms": 1000 * statistics.median(ts),
            "min_ms": 1000 * min(ts),
            "ratio_of_medians": statistics.median(ts) / statistics.median(base),
            "median_paired_ratio": statistics.median(t / b for t, b in zip(ts, base)),
            "rounds": len(ts),
        }
    return out


def print_table(title: str, unit: str, summary: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    width = max(len(n) for n in summary)
    print(f"  {'variant':<{width}}  {'median ' + unit:>14}  {'min':>8}  {'ratio':>7}  {'paired':>7}  {'measured':>8}")
    for name, s in summary.items():
        measured = f"{s['measured_per_step']:>8.3f}" if "measured_per_step" in s else ""
        print(f"  {name:<{width}}  {s['median_ms']:>11.3f} ms  {s['min_ms']:>8.3f}  {s['ratio_of_medians']:>7.3f}"
              f"  {s['median_paired_ratio']:>7.3f}  {measured}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out/overhead", help="folder for overhead.json")
    p.add_argument("--rounds", type=int, default=15, help="interleaved repetitions per variant")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=200, help="(b): steps per repetition")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--skip-loader", action="store_true", help="only measure (b)")
    p.add_argument("--skip-linear", action="store_true", help="leave out (b'), the linear model")
    p.add_argument("--warmup-rounds", type=int, default=2,
                   help="untimed rounds first (the adaptive probe measures often until its estimate settles)")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    wl = get_workload("mnist1d")
    train, _ = wl.build_data(wl.data_seed)
    result = {
        "config": {"batch_size": args.batch_size, "rounds": args.rounds, "steps_per_round": args.steps,
                   "train_samples": len(train), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                   "python": platform.python_version(), "platform": platform.platform()},
        "loader": {},
    }
    if not args.skip_loader:
        for workers in (0, 2):
            t0 = time.perf_counter()
            variants = loader_variants(train, args.batch_size, workers)
            summary = summarize(interleaved(variants, args.rounds), "DataLoader (batched fetch)")
            result["config"][f"loader_workers{workers}_s"] = time.perf_counter() - t0
            result["loader"][f"num_workers={workers}"] = summary
            print_table(f"(a) one epoch at batch {args.batch_size}, num_workers={workers}: time per batch "
                        "(ratio vs the batched DataLoader)", "batch", summary)
    base = "hand-written loop (index_select)"
    if not args.skip_linear:
        fixed = summarize(interleaved(engine_variants(train, args.batch_size, args.steps, linear_model),
                                      args.rounds), base)
        result["engine_linear_model"] = fixed
        print_table(f"(b') a single linear layer, batch {args.batch_size}: the fixed cost per step", "step", fixed)
        extra_us = 1000 * (fixed["Pilot (defaults)"]["median_ms"] - fixed[base]["median_ms"])
        print(f"Fixed cost per step (linear model): {extra_us:+.0f} us.")
    variants = engine_variants(train, args.batch_size, args.steps, wl.build_model)
    interleaved(variants, 0, warmup=args.warmup_rounds)
    warm = measured_steps(variants)
    timed = interleaved(variants, args.rounds, warmup=0)
    engine = summarize(timed, base)
    for name, count in measured_steps(variants).items():  # measurements made during the timed rounds, per step
        engine[name]["measured_per_step"] = (count - warm[name]) / (args.rounds * args.steps)
    result["engine"] = engine
    print_table(f"(b) MNIST-1D CNN, batch {args.batch_size}: time per step (ratio vs {base})", "step", engine)
    d, a = engine["Pilot (defaults)"], engine["Pilot (+ statistics, adaptive period)"]
    stats_overhead = a["median_ms"] / d["median_ms"] - 1
    paired = statistics.median(t / b for t, b in zip(timed["Pilot (+ statistics, adaptive period)"],
                                                     timed["Pilot (defaults)"])) - 1
    result["target_e"] = {"statistics_overhead": stats_overhead, "statistics_overhead_paired": paired,
                          "engine_vs_index_select": d["ratio_of_medians"],
                          "engine_vs_index_select_paired": d["median_paired_ratio"]}
    print(f"\n(e) statistics overhead at batch {args.batch_size} (adaptive period vs Pilot defaults): "
          f"{100 * stats_overhead:+.1f}% (ratio of medians), {100 * paired:+.1f}% (median of paired rounds); "
          "target <= 3%.")
    print(f"(e) engine without statistics vs the index_select hand loop: {d['ratio_of_medians']:.3f}x (ratio of "
          f"medians), {d['median_paired_ratio']:.3f}x (median of paired rounds); target <= 1.03x.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'overhead.json'}")


if __name__ == "__main__":
    main()
