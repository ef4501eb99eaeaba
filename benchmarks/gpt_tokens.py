"""Tokens and time to a validation-loss target on the ``gpt`` workload (issue 24 item 3).

Runs ``batchpilot bench --workload gpt`` with the policies of the comparison (the LR-tuned static token budgets,
the OLMo-style linear ramp, ``noise-scale``, ``goodput`` and ``auto``, all counted in tokens) and prints, per
policy, the median tokens, wall time and cost-model time to the target, and their ratios to the best LR-tuned
static budget (the bench's: the smallest median wall time). Writes the bench's ``results.json`` and ``gpt_tokens.json``
(the table), the bench's ``report.md`` and plots, and ``gpt_loss_vs_tokens.png`` to ``--out``.

    PYTHONPATH=src python benchmarks/gpt_tokens.py --seeds 100,101,102,103,104 --out bench-out/gpt
    PYTHONPATH=src python benchmarks/gpt_tokens.py --quick --out /tmp/gpt-quick   # < 60 s: a smoke test

Issue 24's targets: the best adaptive policy with defaults reaches the target in <= 0.9x the tokens of the best
LR-tuned static budget and <= 1.0x its time.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from batchpilot.bench import get_workload, run_benchmark, write_report
from batchpilot.bench.summary import is_static

POLICIES = "tuned-static:512-4096,warmup:512-8192@0+1,noise-scale,goodput,auto"
QUICK_POLICIES = "static:1024,warmup:512-2048@0+0.1,goodput,auto"
TOKENS_RATIO, TIME_RATIO = 0.9, 1.0


def table(results: dict) -> dict:
    """Per policy: median tokens / wall / cost-model time to target and ratios to the best static; the verdict."""
    summary, best = results["summary"], results["best_static_policy"]
    rows = {}
    for name, s in summary.items():
        rows[name] = {"chosen": s.get("chosen", name), "reached": f"{s['runs_reached']}/{s['runs']}",
                      "tokens": s.get("median_tokens_to_target"), "time_s": s["median_time_to_target_s"],
                      "cost_s": s["median_cost_model_time_to_target_s"]}
    ref = rows.get(best) if best else None
    for row in rows.values():
        for key in ("tokens", "time_s", "cost_s"):
            ok = ref is not None and row[key] is not None and ref[key]
            row[f"{key}_ratio"] = row[key] / ref[key] if ok else None
    adaptive = {n: r for n, r in rows.items() if not is_static(n) and not n.startswith("warmup") and r["time_s"]}
    judged = min(adaptive, key=lambda n: adaptive[n]["time_s"]) if adaptive else None
    verdict = None
    if judged is not None and ref is not None:
        r = rows[judged]
        verdict = {"policy": judged, "tokens_ratio": r["tokens_ratio"], "time_ratio": r["time_s_ratio"],
                   "cost_ratio": r["cost_s_ratio"],
                   "tokens_pass": r["tokens_ratio"] is not None and r["tokens_ratio"] <= TOKENS_RATIO,
                   "time_pass": r["time_s_ratio"] is not None and r["time_s_ratio"] <= TIME_RATIO}
    return {"best_static": best, "rows": rows, "verdict": verdict}


def _fmt(value, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def print_table(out: dict) -> None:
    print(f"best LR-tuned static: {out['best_static']}")
    print(f"{'policy':36} {'reached':>7} {'tokens':>9} {'x':>5} {'time s':>7} {'x':>5} {'cost s':>7} {'x':>5}")
    for name, r in out["rows"].items():
        label = name if r["chosen"] == name else f"{name} ({r['chosen']})"
        print(f"{label:36} {r['reached']:>7} {_fmt(r['tokens'], ',.0f'):>9} {_fmt(r['tokens_ratio'], '.2f'):>5} "
              f"{_fmt(r['time_s'], '.1f'):>7} {_fmt(r['time_s_ratio'], '.2f'):>5} {_fmt(r['cost_s'], '.1f'):>7} "
              f"{_fmt(r['cost_s_ratio'], '.2f'):>5}")
    v = out["verdict"]
    if v:
        print(f"best adaptive: {v['policy']}: tokens {_fmt(v['tokens_ratio'], '.2f')}x (<= {TOKENS_RATIO}: "
              f"{'PASS' if v['tokens_pass'] else 'MISS'}), time {_fmt(v['time_ratio'], '.2f')}x (<= {TIME_RATIO}: "
              f"{'PASS' if v['time_pass'] else 'MISS'}), cost model {_fmt(v['cost_ratio'], '.2f')}x")


def plot_tokens(results: dict, out: Path) -> Path:
    """``gpt_loss_vs_tokens.png``: each policy's validation loss against the tokens trained (its chosen LR cell for a
    tuned static), the first seed's run, left, and its global batch in tokens, right; the target as a line."""
    from batchpilot._plotting import figures, save

    seed = min(run["seed"] for run in results["runs"])
    chosen = {name: s.get("chosen") or name for name, s in results["summary"].items()}
    runs = {name: next(r for r in results["runs"] if r["policy"] == policy and r["seed"] == seed)
            for name, policy in chosen.items()}
    fig, (left, right) = figures().subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        curve = [c for c in run["curve"] if c["accuracy"] > 0]
        tokens = [c["tokens_seen"] / 1e6 for c in curve]
        left.plot(tokens, [-math.log(c["accuracy"]) for c in curve], lw=1.2, label=f"{name} ({chosen[name]})"
                  if chosen[name] != name else name)
        right.step(tokens, [c["batch_size"] for c in curve], where="post", lw=1.2, label=name)
    left.axhline(-math.log(results["target_accuracy"]), color="black", ls="--", lw=0.8, label="target")
    left.set_ylim(top=3.0)
    left.set(xlabel="tokens trained (millions)", ylabel="validation loss (nats/byte)", title=f"gpt, seed {seed}")
    right.set(xlabel="tokens trained (millions)", ylabel="global batch (tokens)", yscale="log", title="batch")
    left.legend(fontsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    path = out / "gpt_loss_vs_tokens.png"
    save(fig, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench-out/gpt")
    parser.add_argument("--quick", action="store_true", help="one seed, small budgets, the quick target: < 60 s")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    wl = get_workload("gpt")
    seeds = [int(s) for s in args.seeds.split(",")]
    policies, target, budget, steps = args.policies, None, args.budget_s, 4
    if args.quick:
        wl = replace(wl, max_batch_size=2048, grid=(1024, 2048))
        seeds, policies, target, budget, steps = seeds[:1], QUICK_POLICIES, wl.quick_target_accuracy, 15.0, 1
    # Evaluations every 1/16 epoch (~70k tokens): the bench's 1/4 would quantise tokens to target to ~25%.
    results = run_benchmark(wl, policies, seeds, target_accuracy=target, budget_s=budget, out_dir=args.out,
                            progress=False, calibrate_steps=steps, eval_every=0.0625)
    out = {"target_loss": -math.log(results["target_accuracy"]), "seeds": seeds, "policies": policies,
           "threads": args.threads, **table(results)}
    Path(args.out, "gpt_tokens.json").write_text(json.dumps(out, indent=1))
    write_report(results, args.out)  # report.md and the bench's plots (accuracy = exp(-loss) against time)
    plot_tokens(results, Path(args.out))
    print(f"target validation loss {out['target_loss']:.3f} nats/byte, seeds {seeds}")
    print_table(out)


if __name__ == "__main__":
    main()
