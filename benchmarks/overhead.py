"""What does batchpilot cost per step? Two measurements (a benchmark, not a test).

(a) Loader: one epoch of MNIST-1D (48k samples, x (1, 40)) at a fixed batch size through
    ``batchpilot.AdaptiveDataLoader`` versus ``torch.utils.data.DataLoader``, with ``num_workers`` 0 and 2.
    Two DataLoader baselines: torch's default (one ``dataset[i]`` per sample, then ``default_collate``) and
    a batched one (a ``BatchSampler`` handed over as the sampler, so each fetch is one tensor-indexing
    call, which is what AdaptiveDataLoader does for a TensorDataset). The second isolates batchpilot's own
    bookkeeping; the first is what a user switching from a plain loop actually compares against.
(b) Engine: the whole ``Pilot`` step (fetch, forward, backward, optimizer step, bookkeeping, record)
    versus a hand-written loop (shuffled tensor indexing, forward, backward, SGD step) at batch 128 on the
    MNIST-1D CNN. Pilot runs with its defaults (which include the gradient-norm check that skips
    non-finite steps) and, to show what that check costs, with ``skip_nonfinite=False``. (b') repeats (b)
    with a single linear layer, whose step costs almost nothing, to expose the fixed cost per step in us.

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

    def pilot_loop(**kwargs) -> Callable[[], int]:
        m = build_model(0)
        o = wl.make_optimizer(m.parameters(), wl.base_lr)
        pilot = batchpilot.Pilot(m, o, train, batch_size=batch_size, progress=False, **kwargs)

        def run() -> int:
            start = pilot.step
            for x, y in pilot.batches(max_steps=start + steps):
                pilot.backward(loss_fn(m(x), y))
            return pilot.step - start

        return run

    return {
        "hand-written loop": hand,
        "Pilot (defaults)": pilot_loop(),
        "Pilot (lr_rule=linear, as in bench)": pilot_loop(lr_rule="linear", base_batch_size=32),
        "Pilot (skip_nonfinite=False)": pilot_loop(skip_nonfinite=False),
        # Issue 3: the statistics left on (noise scale every N-th step, 16 being the engine's default when a
        # controller needs it; loss trend, throughput, system load).
        "Pilot (+ statistics, noise_every=4)": pilot_loop(noise_every=4),
        "Pilot (+ statistics, noise_every=8)": pilot_loop(noise_every=8),
        "Pilot (+ statistics, noise_every=16)": pilot_loop(noise_every=16),
        "Pilot (+ statistics, noise_every=32)": pilot_loop(noise_every=32),
    }


# ------------------------------------------------------------------------------------- harness
def interleaved(variants: dict[str, Callable[[], int]], rounds: int) -> dict[str, list[float]]:
    """Seconds per unit (batch or step) of every variant, ``rounds`` times, interleaved."""
    for fn in variants.values():
        fn()  # warm-up: worker start-up, allocator, first-call costs
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
    print(f"  {'variant':<{width}}  {'median ' + unit:>14}  {'min':>8}  {'ratio':>7}  {'paired':>7}")
    for name, s in summary.items():
        print(f"  {name:<{width}}  {s['median_ms']:>11.3f} ms  {s['min_ms']:>8.3f}  {s['ratio_of_medians']:>7.3f}"
              f"  {s['median_paired_ratio']:>7.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out/overhead", help="folder for overhead.json")
    p.add_argument("--rounds", type=int, default=15, help="interleaved repetitions per variant")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=200, help="(b): steps per repetition")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--skip-loader", action="store_true", help="only measure (b)")
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
    fixed = summarize(interleaved(engine_variants(train, args.batch_size, args.steps, linear_model), args.rounds),
                      "hand-written loop")
    result["engine_linear_model"] = fixed
    print_table(f"(b') a single linear layer, batch {args.batch_size}: the fixed cost per step", "step", fixed)
    engine = summarize(interleaved(engine_variants(train, args.batch_size, args.steps, wl.build_model), args.rounds),
                       "hand-written loop")
    result["engine"] = engine
    print_table(f"(b) MNIST-1D CNN, batch {args.batch_size}: time per step (ratio vs the hand-written loop)",
                "step", engine)
    d, f = engine["Pilot (defaults)"], fixed["Pilot (defaults)"]
    extra_us = 1000 * (f["median_ms"] - fixed["hand-written loop"]["median_ms"])
    print(f"\nPilot overhead on the MNIST-1D CNN: {100 * (d['ratio_of_medians'] - 1):+.1f}% (ratio of medians), "
          f"{100 * (d['median_paired_ratio'] - 1):+.1f}% (median of paired rounds); target <= 3%.")
    print(f"Fixed cost per step (linear model): {extra_us:+.0f} us.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'overhead.json'}")


if __name__ == "__main__":
    main()
