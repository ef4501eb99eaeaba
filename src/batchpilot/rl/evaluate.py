"""Evaluate a PPO policy on held-out simulated jobs against the goodput oracle, Goodput and the best static batch.

Each held-out case (:func:`batchpilot.sim.env.held_out_cases`: perturbed traces, random clusters and seeds drawn
from a seed stream training never uses, every job starting at the trace's base batch) is run by:

* ``ppo``: :class:`~batchpilot.controllers.ppo.PPOController` itself (its out-of-distribution fallback included);
* ``oracle``: :func:`batchpilot.sim.oracle.goodput_oracle` (knows the true model);
* ``goodput``: the Goodput controller (:func:`batchpilot.sim.oracle.goodput_policy`);
* ``static``: the fastest static batch of :func:`batchpilot.sim.oracle.static_sizes`, found by search;
* ``greedy``: the oracle restricted to PPO's situation: it starts where PPO starts, decides at PPO's decision steps,
  and picks among the policy's actions (clamped) the one with the highest *true* goodput. It shows what the action
  set and the schedule allow (the bound a policy over them can hope for); the gap from it to ``oracle`` is the cost
  of starting at the base batch and moving by at most the largest factor per decision.

Times are simulated seconds to the trace's target; every result is also given as a ratio to the oracle's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from ..controllers.ppo import PPOController
from ..controllers.ppo_policy import PolicyMeta, PolicyMLP

__all__ = ["evaluate_policy", "format_evaluation"]


def evaluate_policy(
    policy: tuple[PolicyMLP, PolicyMeta] | str | None = None,
    cases: Sequence[Any] | None = None,
    n: int = 20,
    *,
    interval: int | None = None,
    min_size: int = 32,
    max_size: int = 4096,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``{"rows": [one dict per case], "summary": {...}}`` for ``policy`` (default: the shipped one) on ``cases``
    (default: ``held_out_cases(n=n)`` over the shipped traces). Every policy decides on the policy's schedule (its
    metadata's ``first_interval`` and ``interval``; ``interval`` overrides both), the oracle and the best static at
    ``interval``. Needs gymnasium (the case generator lives in :mod:`batchpilot.sim.env`) unless ``cases`` are
    given."""
    from ..sim.episode import drive, make_job, run_policy
    from ..sim.oracle import best_static, goodput_oracle, true_goodput
    from ..sim.oracle import goodput_policy as goodput_run

    probe = PPOController(min_size, max_size, policy=policy, interval=interval)
    first, every, factors = probe.first_interval, probe.interval, tuple(probe.meta.actions)

    if cases is None:
        from ..sim.env import held_out_cases

        cases = held_out_cases(n=n, min_size=min_size, max_size=max_size)
    rows = []
    for i, case in enumerate(cases):
        kw = {"min_size": min_size, "max_size": max_size, "interval": every, "seed": case.seed}
        ppo = PPOController(min_size, max_size, policy=policy, interval=interval)
        ppo_run = run_policy(ppo, case.trace, case.spec, start_size=case.start_size, first_interval=first, **kw)
        oracle = goodput_oracle(case.trace, case.spec, **kw)
        goodput = goodput_run(case.trace, case.spec, start_size=case.start_size, **kw)
        size, static = best_static(case.trace, case.spec, **kw)
        job = make_job(case.trace, case.spec, start_size=case.start_size, min_size=min_size, max_size=max_size,
                       seed=case.seed)

        def choose_greedy(j: Any) -> int:
            options = {min(max(round(j.batch_size * f), min_size), max_size) for f in factors}
            return max(sorted(options), key=lambda b: true_goodput(j, b))

        greedy = drive(job, choose_greedy, interval=every, first_interval=first, name="greedy")
        row = {
            "case": i, "workload": case.trace.workload, "devices": case.spec.size, "start_size": case.start_size,
            "oracle_s": oracle.time_to_target_s, "ppo_s": ppo_run.time_to_target_s,
            "goodput_s": goodput.time_to_target_s, "static_s": static.time_to_target_s, "static_size": size,
            "greedy_s": greedy.time_to_target_s,
            "ppo_fallbacks": ppo.fallbacks, "ppo_decisions": ppo.fallbacks + ppo.policy_decisions,
        }
        for key in ("ppo", "goodput", "static", "greedy"):
            row[f"{key}_ratio"] = row[f"{key}_s"] / oracle.time_to_target_s
        rows.append(row)
        if progress is not None:
            progress(f"  case {i + 1}/{len(cases)}: {case.trace.workload} on {case.spec.size} devices: ppo/oracle "
                     f"{row['ppo_ratio']:.3f}, goodput/oracle {row['goodput_ratio']:.3f}, static:{size}/oracle "
                     f"{row['static_ratio']:.3f}")
    return {"rows": rows, "summary": _summary(rows)}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows) if rows else math.nan

    def share(test: Callable[[dict[str, Any]], bool]) -> float:
        return sum(map(test, rows)) / len(rows) if rows else math.nan

    decisions = sum(r["ppo_decisions"] for r in rows)
    return {
        "episodes": len(rows),
        "median_ppo_over_oracle": median("ppo_ratio"),
        "median_goodput_over_oracle": median("goodput_ratio"),
        "median_static_over_oracle": median("static_ratio"),
        "median_greedy_over_oracle": median("greedy_ratio"),
        "ppo_faster_than_goodput": share(lambda r: r["ppo_s"] < r["goodput_s"]),
        "ppo_faster_than_best_static": share(lambda r: r["ppo_s"] < r["static_s"]),
        "ppo_no_slower_than_goodput": share(lambda r: r["ppo_s"] <= r["goodput_s"]),
        "ppo_reached": share(lambda r: math.isfinite(r["ppo_s"])),
        "fallback_share": sum(r["ppo_fallbacks"] for r in rows) / decisions if decisions else 0.0,
    }


def format_evaluation(result: dict[str, Any]) -> str:
    """The summary as a few lines of text (simulated times, ratios to the oracle)."""
    s = result["summary"]
    return "\n".join([
        f"held-out simulated episodes: {s['episodes']} (simulated time to target, ratio to the goodput oracle)",
        f"  median ppo/oracle {s['median_ppo_over_oracle']:.3f}, goodput/oracle {s['median_goodput_over_oracle']:.3f}, "
        f"best static/oracle {s['median_static_over_oracle']:.3f}, true-model greedy over the policy's actions/oracle "
        f"{s['median_greedy_over_oracle']:.3f}",
        f"  ppo faster than goodput on {s['ppo_faster_than_goodput']:.0%} (no slower on "
        f"{s['ppo_no_slower_than_goodput']:.0%}), faster than the best static on {s['ppo_faster_than_best_static']:.0%}; "
        f"reached the target on {s['ppo_reached']:.0%}; fallback decisions {s['fallback_share']:.0%}",
    ])
