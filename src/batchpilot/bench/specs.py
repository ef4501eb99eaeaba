"""Run specs: what each policy trains, concretely (batch size, learning rate, LR rule, controller).

:func:`expand` turns :class:`~batchpilot.bench.policies.Policy` objects into :class:`RunSpec` objects,
deduplicated by name: ``static:32`` and the middle cell of ``tuned-static:32``'s LR grid are one
configuration, trained once per seed and counted for both. What each policy means is documented in
:mod:`batchpilot.bench.policies`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..lr import lr_factor
from .policies import ADAPTIVE, AUTO, TUNE_FACTORS, Policy

__all__ = ["Plan", "RunSpec", "expand", "policy_specs"]


@dataclass(frozen=True)
class RunSpec:
    """One concrete training configuration (what a run trains).

    Attributes:
        name: Run policy name in ``results.json`` (``static:512``, ``static:512@lr=0.32``, ``noise-scale``).
        batch_size: Size of the first step.
        optimizer_lr: LR given to the optimizer (the LR at ``base_batch_size``).
        lr_rule: The Pilot's ``lr_rule``.
        base_batch_size: The Pilot's ``base_batch_size``.
        lr: The LR of the first step (``optimizer_lr`` x the rule's factor at ``batch_size``).
        noise_every: The Pilot's ``noise_every`` (``None``, every built-in policy: the engine's default, which
            measures gradient statistics at its adaptive period where the controller or AdaScale needs them).
        make_controller: ``num_samples -> controller`` (returns ``None`` for a static batch).
        policies: The requested policies this run serves.
        grid: Whether it is a cell of an LR grid (its time counts in ``grid_search_total_s``).
        auto: The automatic mode: ``Pilot(batch_size="auto", controller=make_controller(n))``; ``batch_size`` is
            then the probes' first size, ``lr`` is ``None`` (the range test finds it) and ``lr_rule`` is ``None``
            (the Pilot's default, ``"auto"``) unless the policy named one.
    """

    name: str
    batch_size: int
    optimizer_lr: float
    lr_rule: str | None
    base_batch_size: int
    lr: float | None
    noise_every: int | None = None
    make_controller: Callable[[int], Any] = field(default=lambda n: None, compare=False, repr=False)
    policies: tuple[str, ...] = ()
    grid: bool = False
    auto: bool = False

    @property
    def static(self) -> bool:
        """A fixed batch without a controller (what the bench's cache may keep: :mod:`.cache`)."""
        return not self.auto and self.make_controller(1) is None


@dataclass(frozen=True)
class Plan:
    """What :func:`expand` needs to know about the workload and the calibration."""

    base_lr: float
    base_batch_size: int
    lr_rule: str
    num_samples: int
    min_size: int
    max_size: int
    finder_size: int | None = None
    tune_factors: tuple[float, ...] = TUNE_FACTORS
    smith_every_epochs: float = 2.0

    def rule_lr(self, batch_size: int, rule: str | None = None) -> float:
        """``base_lr`` x the rule's factor at ``batch_size`` (AdaScale: its gain is 1 before any statistics)."""
        rule = rule or self.lr_rule
        return self.base_lr * (1.0 if rule == "adascale" else lr_factor(rule, batch_size, self.base_batch_size))


def _static(plan: Plan, n: int, lr: float | None, policy: str, grid: bool = False) -> RunSpec:
    rule_lr = plan.rule_lr(n)
    if lr is None or math.isclose(lr, rule_lr, rel_tol=1e-9):
        return RunSpec(f"static:{n}", n, plan.base_lr, plan.lr_rule, plan.base_batch_size, rule_lr,
                       policies=(policy,), grid=grid)
    if plan.lr_rule == "adascale":  # its gain changes during the run: a fixed LR would be another policy
        return RunSpec(f"static:{n}@lr={lr:g}", n, lr, "adascale", plan.base_batch_size, lr, policies=(policy,),
                       grid=grid)
    return RunSpec(f"static:{n}@lr={lr:g}", n, lr, "none", n, lr, policies=(policy,), grid=grid)


def _adaptive_spec(plan: Plan, policy: Policy) -> RunSpec:
    lo, hi = plan.min_size, plan.max_size
    controller = policy.make_controller(plan.num_samples, lo, hi)
    rule = policy.lr_rule or getattr(controller, "recommended_lr_rule", None) or plan.lr_rule
    # noise_every None: the engine's default (it measures gradient statistics, at its adaptive period, where the
    # controller reads them or the rule is AdaScale), as a user who leaves it alone gets.
    return RunSpec(policy.name, lo, plan.base_lr, rule, plan.base_batch_size, plan.rule_lr(lo, rule),
                   make_controller=functools.partial(policy.make_controller, min_size=lo, max_size=hi),
                   policies=(policy.name,))


def _auto_spec(plan: Plan, policy: Policy) -> RunSpec:
    """``auto``: the optimizer gets the workload's base LR (the range test sweeps around it); no
    ``base_batch_size`` (the LR curve is anchored at the knee the probes find)."""
    lo, hi = plan.min_size, plan.max_size
    return RunSpec(policy.name, lo, plan.base_lr, policy.lr_rule, plan.base_batch_size, None,
                   make_controller=functools.partial(policy.make_controller, min_size=lo, max_size=hi),
                   policies=(policy.name,), auto=True)


def policy_specs(plan: Plan, policy: Policy) -> list[RunSpec]:
    """The run specs of one policy (several for ``tuned-static``)."""
    if policy.kind == AUTO:
        return [_auto_spec(plan, policy)]
    if policy.lr_rule is not None and policy.kind not in ADAPTIVE:
        base = replace(policy, name=policy.name.partition("@lr-rule=")[0], lr_rule=None)
        specs = policy_specs(replace(plan, lr_rule=policy.lr_rule), base)
        suffix = f"@lr-rule={policy.lr_rule}"
        # An explicit-LR cell does not depend on the rule: it keeps its name (and is shared). AdaScale measures
        # gradient statistics at the engine's default period; the cost model sees which steps measured.
        return [replace(s, name=s.name if s.lr_rule == "none" and "@lr=" in s.name else s.name + suffix,
                        policies=(policy.name,)) for s in specs]
    if policy.kind == "static":
        return [_static(plan, policy.batch_size, policy.lr, policy.name)]
    if policy.kind == "tuned-static":
        n = policy.batch_size
        return [_static(plan, n, plan.rule_lr(n) * f, policy.name, grid=True) for f in plan.tune_factors]
    if policy.kind == "finder":
        if plan.finder_size is None:
            raise ValueError("the finder policy needs the throughput calibration (Plan.finder_size).")
        return [_static(plan, plan.finder_size, None, policy.name)]
    if policy.kind in ADAPTIVE:
        return [_adaptive_spec(plan, policy)]
    if policy.kind == "smith" and policy.every_epochs == 0:  # ramp-smith: the workload's interval
        policy = replace(policy, every_epochs=plan.smith_every_epochs)
    start = policy.batch_size
    make = lambda n, p=policy: p.make_controller(n)  # noqa: E731
    if policy.kind == "smith":  # the LR of START, held: rule "none" at base START
        lr = plan.rule_lr(start)
        return [RunSpec(policy.name, start, lr, "none", start, lr, make_controller=make, policies=(policy.name,))]
    return [RunSpec(policy.name, start, plan.base_lr, plan.lr_rule, plan.base_batch_size, plan.rule_lr(start),
                    make_controller=make, policies=(policy.name,))]


def expand(policies: Sequence[Policy], plan: Plan) -> tuple[list[RunSpec], dict[str, list[str]]]:
    """Run specs for ``policies``, deduplicated by name, and ``{policy: [run spec names]}``.

    A configuration asked for by several policies (``static:32`` and ``tuned-static:32``; ``finder`` and
    the static of the size it picks) is trained once; its ``policies`` lists them all, and it counts as a
    grid cell if any policy uses it as one.
    """
    specs: dict[str, RunSpec] = {}
    members: dict[str, list[str]] = {}
    for policy in policies:
        members[policy.name] = []
        for spec in policy_specs(plan, policy):
            members[policy.name].append(spec.name)
            old = specs.get(spec.name)
            if old is None:
                specs[spec.name] = spec
            else:
                specs[spec.name] = replace(old, policies=old.policies + spec.policies, grid=old.grid or spec.grid)
    return list(specs.values()), members
