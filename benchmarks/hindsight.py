"""Where could a batch-size policy beat the tuned static batch? (a benchmark, not a test)

``batchpilot bench`` compares adaptive controllers that start from the workload's *untuned* recipe (base LR
at batch 32, scaled by the LR rule) with the best static batch, whose LR was tuned over a grid. This
benchmark asks the complementary question: given the tuned recipe itself (batch B at learning rate LR,
needing E epochs to the target), does changing the batch size during the run make it faster? These
variants hold the LR at the recipe's (``lr_rule="none"``), so a larger batch lowers the SGD noise
temperature LR/B exactly as an LR decay would (Smith et al. 2018, "Don't Decay the Learning Rate,
Increase the Batch Size") and a smaller one raises it:

* ``static`` — B throughout (the recipe; the baseline of every ratio).
* ``warm-start`` — B/4 for the first ``--warm`` x E epochs, then B (a batch warm-up at the held LR;
  Merrill et al. 2025 find the critical batch near zero at initialisation).
* ``anneal`` — B, then 2B from ``--anneal`` x E epochs on (one Smith-style growth in place of an LR decay).
* ``warm+anneal`` — both.
* ``goodput``, ``noise-scale`` — the adaptive controllers with their defaults (bounds 32 .. 4096, capped at
  the dataset size), started at B, LR held.
* ``noise-anneal`` — B + ``B_simple`` (growth only, decided every 50 steps), LR held: the batch grows with
  the noise scale in place of the LR decay that the ``curve`` variants below make (Smith et al.).

The first four are schedules fixed in hindsight (they use E, which only the grid search reveals): an
estimate of what *any* batch-size policy could gain around the recipe, not a policy to ship.

With ``--lr-max X`` (or ``auto``) four more variants let the LR follow McCandlish et al.'s optimal-LR curve
``lr_max / (1 + B_simple / B)`` instead of holding it (``lr_rule="adascale"`` anchored at ``--anchor``,
default 4096: ``lr = lr_max (1 + B_simple/anchor) / (1 + B_simple/B)``, see docs/lr.md):

* ``curve`` — B throughout, the LR on the curve (an LR schedule driven by the measured noise scale).
* ``curve-goodput``, ``curve-noise-scale`` — the controllers with defaults, started at their lower bound.
* ``curve-goodput-phi3`` — ``Goodput`` whose efficiency reads 3 x ``B_simple`` (an experiment on its model
  of statistical efficiency, not a library setting).

``--lr-max auto`` runs the LR range test (:func:`batchpilot.lr.lr_range_test`, 100 steps at ``--test-batch``,
default B) once per seed and takes its suggestion; its seconds are reported per run (``range_test_s``) and
not included in the time to target. Variants are interleaved seed by seed so drift hits all of them alike.
``--device cuda`` trains on a GPU (the data sets are moved there once, as ``batchpilot bench --device``).
Output: ``hindsight.json`` (every run and the medians) and ``hindsight.png`` (median time to target per
variant, one dot per seed; needs matplotlib).

    PYTHONPATH=src python benchmarks/hindsight.py --results bench-out/mnist1d/results.json --out bench-out/hindsight
    PYTHONPATH=src python benchmarks/hindsight.py --workload mnist1d --batch 512 --lr 0.16 --epochs 12.5
    PYTHONPATH=src python benchmarks/hindsight.py --workload mnist1d --batch 512 --lr 0.16 --epochs 12.5 \
        --lr-max 0.2 --variants static,curve,curve-goodput,curve-noise-scale,curve-goodput-phi3
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from batchpilot import controllers
from batchpilot.bench.runner import on_device, resolve_device
from batchpilot.bench.specs import RunSpec
from batchpilot.bench.train import train_one
from batchpilot.bench.workloads import Workload, get_workload
from batchpilot.lr import lr_range_test

HELD = ("static", "warm-start", "anneal", "warm+anneal", "goodput", "noise-scale", "noise-anneal")
CURVE = ("curve", "curve-goodput", "curve-noise-scale", "curve-goodput-phi3")
VARIANTS = HELD + CURVE


class NoiseAnneal:
    """Grow the batch to ``base + B_simple`` (never shrink), every ``interval`` steps, up to ``max_size``."""

    required_stats = ("stats/noise_scale",)

    def __init__(self, base: int, max_size: int, interval: int = 50) -> None:
        self.base, self.max_size, self.interval = base, max_size, interval
        self.name, self.reason = "NoiseAnneal", "no decision yet"

    def decide(self, obs: Any) -> int:
        noise = obs.stats.get("stats/noise_scale")
        if noise is None or not math.isfinite(noise) or noise <= 0 or obs.step % self.interval:
            return obs.batch_size
        return int(min(self.max_size, max(obs.batch_size, self.base + noise)))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ScaledNoiseGoodput(controllers.Goodput):
    """``Goodput`` whose statistical efficiency reads ``phi_factor`` x the measured noise scale."""

    def __init__(self, phi_factor: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.phi_factor = phi_factor

    def efficiency(self, batch_size: int, noise_scale: float) -> float:
        return super().efficiency(batch_size, self.phi_factor * noise_scale)


def recipe_from_results(path: Path) -> dict[str, Any]:
    """The best static of a ``batchpilot bench`` results.json: workload, batch, LR and median epochs."""
    try:
        results = json.loads(path.read_text())
        best = results["best_static"]
        # A tuned static names the cell it chose; a plain static:N is its own cell.
        chosen, lr, epochs = best.get("chosen") or best["policy"], best["lr"], best["median_epochs_to_target"]
        workload = results["workload"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--results {path}: not a readable batchpilot bench results.json with a best static ({exc}); "
                         "run `batchpilot bench` first or pass --workload/--batch/--lr/--epochs.") from exc
    match = re.fullmatch(r"(?:tuned-)?static:(\d+)(@lr=[^@]*)?(@lr-rule=.*)?", chosen)
    if match is None or epochs is None:
        raise SystemExit(f"--results {path}: best static {chosen!r} has no batch size or no median epochs to target.")
    return {"workload": workload, "batch": int(match.group(1)), "lr": float(lr), "epochs": float(epochs)}


def make_specs(batch: int, lr: float, epochs: float, warm: float, anneal: float,
               max_size: int, lr_max: float | None = None, anchor: int = 4096) -> dict[str, RunSpec]:
    """One RunSpec per variant: the held-LR ones at ``lr``; the curve ones (only with ``lr_max``) on
    ``lr_max (1 + B_simple/anchor) / (1 + B_simple/B)``."""
    small, big = max(1, batch // 4), 2 * batch
    t_warm, t_anneal = warm * epochs, anneal * epochs

    def piecewise(bounds: list[float], sizes: list[int]) -> Callable[[int], Any]:
        return lambda n: controllers.Piecewise(bounds, sizes, key="epoch")

    def spec(name: str, first: int, make: Callable[[int], Any], noise_every: int | None = None) -> RunSpec:
        return RunSpec(name, first, lr, "none", batch, lr, noise_every=noise_every, make_controller=make)

    bounds = {"min_size": min(32, batch), "max_size": max(max_size, batch)}
    return {
        "static": spec("static", batch, lambda n: None),
        "warm-start": spec("warm-start", small, piecewise([t_warm], [small, batch])),
        "anneal": spec("anneal", batch, piecewise([t_anneal], [batch, big])),
        "warm+anneal": spec("warm+anneal", small, piecewise([t_warm, t_anneal], [small, batch, big])),
        "goodput": spec("goodput", batch, lambda n: controllers.Goodput(**bounds), noise_every=16),
        "noise-scale": spec("noise-scale", batch, lambda n: controllers.NoiseScale(**bounds), noise_every=16),
        "noise-anneal": spec("noise-anneal", batch, lambda n: NoiseAnneal(batch, bounds["max_size"]), noise_every=16),
        **({} if lr_max is None else curve_specs(batch, lr_max, anchor, bounds)),
    }


def curve_specs(batch: int, lr_max: float, anchor: int, bounds: dict[str, int]) -> dict[str, RunSpec]:
    """The variants whose LR follows the noise scale (AdaScale anchored at ``anchor`` with LR ``lr_max``)."""
    def spec(name: str, first: int, make: Callable[[int], Any]) -> RunSpec:
        return RunSpec(name, first, lr_max, "adascale", anchor, lr_max, noise_every=16, make_controller=make)

    low = bounds["min_size"]
    return {
        "curve": spec("curve", batch, lambda n: None),
        "curve-goodput": spec("curve-goodput", low, lambda n: controllers.Goodput(**bounds)),
        "curve-noise-scale": spec("curve-noise-scale", low, lambda n: controllers.NoiseScale(**bounds)),
        "curve-goodput-phi3": spec("curve-goodput-phi3", low, lambda n: ScaledNoiseGoodput(3.0, **bounds)),
    }


def range_test_lr(workload: Workload, train: Any, seed: int, batch: int) -> tuple[float, float]:
    """The LR range test's suggestion for ``workload`` at ``batch`` (seeded batches), and its seconds."""
    tensors = train.tensors
    model = workload.build_model(seed).to(tensors[0].device)
    optimizer = workload.make_optimizer(model.parameters(), workload.base_lr)
    g = torch.Generator().manual_seed(seed)

    def batches():
        while True:
            idx = torch.randint(0, len(train), (batch,), generator=g).to(tensors[0].device)
            yield [t[idx] for t in tensors]

    result = lr_range_test(model, optimizer, batches(), lambda m, b: workload.loss_fn(m(b[0]), b[1]),
                           lr_min=workload.base_lr / 10, lr_max=workload.base_lr * 1000, steps=100)
    if result.suggestion is None:
        raise SystemExit(f"seed {seed}: the LR range test found no LR at which the loss fell; pass --lr-max.")
    return result.suggestion, result.seconds


def summarise(runs: list[dict[str, Any]], variants: list[str]) -> dict[str, dict[str, Any]]:
    """Median time / epochs to target per variant (a missed target counts as infinitely slow)."""
    out: dict[str, dict[str, Any]] = {}
    for name in variants:
        rows = [r for r in runs if r["variant"] == name]
        times = [r["time_to_target_s"] if r["time_to_target_s"] is not None else math.inf for r in rows]
        epochs = [r["epochs_to_target"] if r["epochs_to_target"] is not None else math.inf for r in rows]
        median = statistics.median(times)
        out[name] = {"reached": sum(t < math.inf for t in times), "runs": len(rows),
                     "median_time_to_target_s": median if median < math.inf else None,
                     "median_epochs_to_target": statistics.median(epochs) if median < math.inf else None,
                     "median_final_accuracy": statistics.median(r["final_accuracy"] for r in rows)}
    base = out["static"]["median_time_to_target_s"] if "static" in out else None
    for row in out.values():
        t = row["median_time_to_target_s"]
        row["ratio_vs_static"] = t / base if t is not None and base else None
    return out


def plot(runs: list[dict[str, Any]], summary: dict[str, dict[str, Any]], title: str, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[plot]').")
        return False
    names = list(summary)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    medians = [summary[n]["median_time_to_target_s"] or 0.0 for n in names]
    ax.bar(range(len(names)), medians, color="#9ecae1", label="median")
    for i, name in enumerate(names):
        ts = [r["time_to_target_s"] for r in runs if r["variant"] == name and r["time_to_target_s"] is not None]
        ax.plot([i] * len(ts), ts, "o", color="#08519c", ms=4, label="one seed" if i == 0 else None)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("seconds to target (training)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, help="a `batchpilot bench` results.json: take its best static as the recipe")
    p.add_argument("--workload", help="workload name (with --batch, --lr, --epochs instead of --results)")
    p.add_argument("--batch", type=int, help="the recipe's batch size B")
    p.add_argument("--lr", type=float, help="the recipe's learning rate (held in every variant)")
    p.add_argument("--epochs", type=float, help="epochs the recipe needs to the target (E)")
    p.add_argument("--warm", type=float, default=0.08, help="warm-start length as a fraction of E (default 0.08)")
    p.add_argument("--anneal", type=float, default=0.5, help="when anneal doubles B, as a fraction of E (default 0.5)")
    p.add_argument("--variants", default=",".join(HELD),
                   help=f"comma-separated subset of {', '.join(VARIANTS)} (default: {', '.join(HELD)})")
    p.add_argument("--lr-max", help="lr_max of the curve variants: a number, or auto (an LR range test per seed)")
    p.add_argument("--anchor", type=int, default=4096, help="the curve's anchor batch (default 4096)")
    p.add_argument("--test-batch", type=int, help="batch of the LR range test (default: the recipe's)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (default 0-4)")
    p.add_argument("--target", type=float, help="test accuracy to reach (default: the workload's)")
    p.add_argument("--budget", type=float, help="most training seconds per run (default: the workload's)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--device", default="cpu", help="where to train: cpu (default), cuda, cuda:N")
    p.add_argument("--out", type=Path, default=Path("bench-out/hindsight"), help="folder for hindsight.json/.png")
    args = p.parse_args()

    if args.results is not None:
        recipe = recipe_from_results(args.results)
    elif None in (args.workload, args.batch, args.lr, args.epochs):
        p.error("give --results, or all of --workload, --batch, --lr and --epochs")
    else:
        recipe = {"workload": args.workload, "batch": args.batch, "lr": args.lr, "epochs": args.epochs}
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "static" not in variants:
        p.error(f"--variants must name 'static' and only {', '.join(VARIANTS)}; got unknown {unknown}")
    lr_max: float | None = None
    if args.lr_max not in (None, "auto"):
        try:
            lr_max = float(args.lr_max)
        except ValueError:
            p.error(f"--lr-max must be a number or auto, got {args.lr_max!r}")
        if not (math.isfinite(lr_max) and lr_max > 0):
            p.error(f"--lr-max must be > 0, got {args.lr_max!r}")
    if args.lr_max is None and set(variants) & set(CURVE):
        p.error(f"the variants {', '.join(sorted(set(variants) & set(CURVE)))} need --lr-max (a number or auto)")
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        p.error(str(exc))

    workload = get_workload(recipe["workload"])
    train, test = (on_device(d, device) for d in workload.build_data(workload.data_seed))
    target = args.target if args.target is not None else workload.target_accuracy
    budget = args.budget if args.budget is not None else workload.budget_s
    print(f"recipe: {recipe['workload']} batch {recipe['batch']} at lr {recipe['lr']:g} (held), "
          f"{recipe['epochs']:g} epochs to {target}; {len(variants)} variants x {len(seeds)} seeds on {device}")

    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for seed in seeds:
        seed_lr_max, test_s = lr_max, None
        if args.lr_max == "auto":
            seed_lr_max, test_s = range_test_lr(workload, train, seed, args.test_batch or recipe["batch"])
            print(f"  seed {seed} LR range test: lr_max {seed_lr_max:.4g} ({test_s:.2f} s, not counted)")
        specs = make_specs(recipe["batch"], recipe["lr"], recipe["epochs"], args.warm, args.anneal,
                           min(4096, len(train)), lr_max=seed_lr_max, anchor=args.anchor)
        for name in variants:
            r = train_one(workload, specs[name], seed, train, test, target=target, budget_s=budget,
                          eval_every=0.25, on_eval=lambda point, run: None)
            row = {"variant": name, "seed": seed, **{k: r[k] for k in (
                "time_to_target_s", "epochs_to_target", "samples_to_target", "final_accuracy", "wall_s")},
                "batch_sizes": [(b["time_s"], b["batch_size"]) for b in r["batch_sizes"]],
                **({"lr_max": seed_lr_max, "range_test_s": test_s} if name in CURVE else {})}
            runs.append(row)
            t = row["time_to_target_s"]
            print(f"  seed {seed} {name:12s} {'missed' if t is None else f'{t:6.2f} s'}  "
                  f"[{time.perf_counter() - started:5.0f} s elapsed]", flush=True)

    summary = summarise(runs, variants)
    print(f"\n{'variant':12s} {'reached':>8s} {'median s':>9s} {'epochs':>7s} {'vs static':>9s}")
    for name, row in summary.items():
        t, e, q = row["median_time_to_target_s"], row["median_epochs_to_target"], row["ratio_vs_static"]
        print(f"{name:12s} {row['reached']:>4d}/{row['runs']:<3d} {'—' if t is None else f'{t:.2f}':>9s} "
              f"{'—' if e is None else f'{e:.2f}':>7s} {'—' if q is None else f'{q:.2f}x':>9s}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"recipe": recipe, "target": target, "budget_s": budget, "warm": args.warm, "anneal": args.anneal,
              "lr_max": args.lr_max, "anchor": args.anchor,
              "seeds": seeds, "threads": args.threads, "device": str(device), "machine": platform.platform(),
              "torch": torch.__version__,
              "summary": summary, "runs": runs}
    (args.out / "hindsight.json").write_text(json.dumps(result, indent=1))
    title = f"{recipe['workload']}: around batch {recipe['batch']} at lr {recipe['lr']:g} (held)"
    plotted = plot(runs, summary, title, args.out / "hindsight.png")
    print(f"wrote {args.out / 'hindsight.json'}" + (f" and {args.out / 'hindsight.png'}" if plotted else ""))


if __name__ == "__main__":
    main()
