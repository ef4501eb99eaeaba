"""Batch-size policies of the benchmark: the ``--policies`` language and what each policy trains.

A :class:`Policy` is what the user asks for (``"tuned-static:512"``, ``"noise-scale"``); a run spec
(:mod:`.specs`) is one concrete training configuration. Most policies are one run spec; ``tuned-static:N``
is three (its LR grid), and ``finder`` learns its batch size from the throughput calibration.

Every run trains the workload's optimizer with ``Pilot(lr_rule=..., base_batch_size=B0)``, where B0 is
the workload's base batch size (32) and the rule is the workload's (``linear`` for SGD, ``sqrt`` for Adam):
"the rule LR" of a size B is ``base_lr * factor(B / B0)``.

Policies:

* ``static:N`` — batch N throughout at the rule LR. ``static:N@lr=X`` — batch N at learning rate X.
* ``tuned-static:N`` — batch N with its LR tuned over ``rule LR x {0.5, 1, 2}`` (``tune_factors``): the
  three cells ``static:N@lr=X`` are all trained, and the cell with the best median time to target is
  picked after the fact. ``tuned-static:A-B`` is A, 2A, 4A, ... up to B; ``tuned-static:grid`` is the
  workload's own range (``Workload.grid``: 32-1024 for most, 64-512 for ``markov``; :func:`workload_grid`).
* ``finder`` — the batch a batch-size finder picks from the throughput calibration (the smallest size
  within 5% of the best measured throughput, up to the workload's largest batch; see
  :mod:`batchpilot.bench.calibrate`), trained statically at the rule LR.
* ``ramp`` (= ``ramp:32-512``) / ``ramp:START-END[@E]`` — :class:`~batchpilot.controllers.MultiplicativeStep`
  doubling every E epochs (default 0.25) with the LR following the rule (the Megatron / OLMo batch ramp).
* ``smith:START-END@E`` — Smith et al. 2018, "Don't Decay the Learning Rate, Increase the Batch Size":
  start at START with its rule LR, double every E epochs up to END, and hold the LR (the batch grows in
  place of an LR decay). ``ramp-smith`` is ``smith:512-4096@E`` with E the workload's
  ``smith_every_epochs``: a quarter of the epochs the best static needs, so the batch doubles a quarter,
  half and three quarters of the way, as Smith et al.'s batch increases replace LR decays at 30%, 60%
  and 80% of their CIFAR-10 schedule.
* ``warmup:SMALL-TARGET@W+R`` — :class:`~batchpilot.controllers.WarmupRamp` (seed 000, section 4.2).
* ``noise-scale``, ``goodput``, ``variance-rule``, ``threshold-rules`` — the adaptive controllers with
  their default settings; only the workload's bounds (``min_size``, ``max_size``, capped at the dataset
  size) are passed. They start at ``min_size`` with their recommended LR rule where they have one
  (``recommended_lr_rule``: AdaScale for ``NoiseScale`` and ``Goodput``, ``linear-then-sqrt`` for
  ``VarianceRule``), else the workload's rule, and the engine measures gradient statistics for them.
* ``auto`` — the automatic mode: ``Pilot(..., batch_size="auto", controller=Auto(min_size, max_size))`` with
  the workload's bounds and the default ``lr_rule`` (the LR range test at the knee, then the LR curve). Its
  start probes run inside the timed training (their time counts in every time to target).

Named sets: ``default`` (the comparison of issue 21: the untuned default, the LR-tuned static grid, the finder,
``noise-scale``, ``goodput`` and ``auto``), ``full`` (``default`` plus ``ramp``, ``ramp-smith``,
``variance-rule`` and ``threshold-rules``: issue 3's comparison), ``collapse`` (target (d): ``static:32`` and every
adaptive controller with its defaults), ``quick`` (``auto`` against the static grid's usual winner and the untuned
default), ``adaptive``, ``foundation``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..measure import DEFAULT_NOISE_EVERY

__all__ = ["ADAPTIVE", "AUTO", "NAMED_SETS", "NOISE_EVERY", "POLICY_HELP", "Policy", "parse_policies", "parse_policy",
           "workload_grid"]

NOISE_EVERY = DEFAULT_NOISE_EVERY  # gradient-noise measurement period (the engine's default)
TUNE_FACTORS = (0.5, 1.0, 2.0)
LR_RULES = ("none", "linear", "sqrt", "linear-then-sqrt", "adascale")
ADAPTIVE = ("noise-scale", "goodput", "variance-rule", "threshold-rules", "ppo")
AUTO = "auto"
ALIASES = {"ramp": "ramp:32-512"}
NAMED_SETS = {
    "default": "static:32,tuned-static:grid,finder,noise-scale,goodput,auto",
    "full": "static:32,tuned-static:grid,finder,ramp,ramp-smith," + ",".join(ADAPTIVE) + ",auto",
    "collapse": "static:32," + ",".join(ADAPTIVE) + ",auto",
    "quick": "static:32,static:512,auto",
    "adaptive": ",".join(ADAPTIVE) + ",auto",
    "foundation": "static:32,static:128,static:512,ramp",
}
POLICY_HELP = (
    "static:N[@lr=X], tuned-static:N, tuned-static:A-B or tuned-static:grid (the workload's range; LR tuned over rule "
    "LR x 0.5/1/2), finder, "
    "ramp (= ramp:32-512), ramp:START-END[@EPOCHS], ramp-smith (smith:512-4096 at the workload's interval), "
    "smith:START-END@EPOCHS, "
    "warmup:SMALL-TARGET@W+R, " + ", ".join(ADAPTIVE) + ", auto; any but smith and static@lr takes @lr-rule=RULE "
    "(" + ", ".join(LR_RULES) + "); named sets: " + ", ".join(NAMED_SETS)
)
DESCRIPTIONS = {
    "static": "fixed batch N at the rule LR (or @lr=X)",
    "tuned-static": "fixed batch N, LR tuned over rule LR x {0.5, 1, 2}; best cell picked after the fact",
    "finder": "static at the smallest batch within 5% of the best measured throughput (rule LR)",
    "ramp": "MultiplicativeStep doubling every EPOCHS epochs (default 0.25), LR follows the rule",
    "smith": "Smith et al. 2018: double every EPOCHS epochs with the LR held (batch growth instead of LR decay)",
    "warmup": "WarmupRamp: SMALL for W epochs, then linear to TARGET over R epochs",
    "noise-scale": "NoiseScale controller (McCandlish et al. 2018), defaults",
    "goodput": "Goodput controller (Pollux), defaults",
    "variance-rule": "VarianceRule controller (seed 002), defaults",
    "threshold-rules": "ThresholdRules controller (seed 000 section 4.2), defaults",
    "ppo": "PPOController: the shipped PPO policy (seed 000), Goodput out of its training distribution",
    "auto": "automatic mode: batch_size='auto' (throughput knee + LR range test, then goodput), probes timed",
}


# ------------------------------------------------------------------------------------------ policies
@dataclass(frozen=True)
class Policy:
    """A batch-size policy as written in ``--policies`` (canonical form in ``name``).

    Attributes:
        name: Canonical spec, e.g. ``"static:128"``, ``"ramp:32-512"``, ``"noise-scale"``.
        kind: ``static``, ``tuned-static``, ``finder``, ``ramp``, ``smith``, ``warmup`` or an adaptive name.
        batch_size: Size of the first step (0 where it is only known at run time: finder, adaptive).
        end: Largest size (ramps, warmup); ``batch_size`` for static.
        every_epochs: Ramps: epochs between doublings. Warmup: epochs at the small size.
        ramp_epochs: Warmup: epochs of the linear ramp.
        lr: Explicit learning rate (``static:N@lr=X``); ``None``: the rule LR.
        lr_rule: LR rule instead of the workload's (``...@lr-rule=RULE``); ``None``: the workload's.
    """

    name: str
    kind: str
    batch_size: int
    end: int
    every_epochs: float = 0.25
    ramp_epochs: float = 0.0
    lr: float | None = None
    lr_rule: str | None = None

    @property
    def category(self) -> str:
        """``static`` (static, tuned-static), ``finder``, ``schedule`` (ramps, warmup) or ``adaptive``."""
        if self.kind in ("static", "tuned-static"):
            return "static"
        if self.kind in ADAPTIVE or self.kind == AUTO:
            return "adaptive"
        return "finder" if self.kind == "finder" else "schedule"

    def make_controller(self, num_samples: int, min_size: int = 32, max_size: int = 4096) -> Any:
        """The controller of this policy for a dataset of ``num_samples`` (``None``: a static batch)."""
        from .. import controllers as c

        if self.kind in ("static", "tuned-static", "finder"):
            return None
        if self.kind == AUTO:
            return c.Auto(min_size=min_size, max_size=max_size)  # only the workload's bounds
        if self.kind in ("ramp", "smith"):
            every = max(1, round(self.every_epochs * num_samples))
            return c.MultiplicativeStep(self.batch_size, 2, every_samples=every, max_size=self.end)
        if self.kind == "warmup":
            return c.WarmupRamp(self.batch_size, self.end, warmup_epochs=self.every_epochs,
                                ramp_epochs=self.ramp_epochs)
        if self.kind == "ppo":
            from ..controllers.ppo import PPOController

            return PPOController(min_size=min_size, max_size=max_size)
        cls = {"noise-scale": c.NoiseScale, "goodput": c.Goodput, "variance-rule": c.VarianceRule,
               "threshold-rules": c.ThresholdRules}[self.kind]
        return cls(min_size=min_size, max_size=max_size)  # defaults: only the workload's bounds


def _bad(spec: str, why: str) -> ValueError:
    return ValueError(f"bad policy {spec!r}: {why}. Valid forms: {POLICY_HELP}.")


def _size(spec: str, text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:  # "²" and "٣" are digits to isdigit()
        raise _bad(spec, f"{what} {text!r} is not a whole number >= 1")
    return int(text)


def _number(spec: str, text: str, what: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _bad(spec, f"{what} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise _bad(spec, f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {text!r}")
    return value


def _range(spec: str, arg: str, form: str) -> re.Match[str]:
    m = re.fullmatch(r"(\w+)-(\w+)(?:@(.+))?", arg)
    if not m:
        raise _bad(spec, f"write it as {form}")
    return m


def parse_policy(spec: str) -> Policy:
    """Parse one policy spec (see the module docstring); ranges and named sets need :func:`parse_policies`.

    Raises:
        ValueError: the spec is malformed; the message lists the valid forms.
    """
    text = spec.strip().lower()
    text, marker, rule = text.partition("@lr-rule=")
    if marker:
        if rule not in LR_RULES:
            raise _bad(spec, f"lr-rule {rule!r} is not one of {', '.join(LR_RULES)}")
        policy = parse_policy(text)
        if policy.kind == "smith" or policy.lr is not None:
            raise _bad(spec, f"{policy.kind} fixes its LR; @lr-rule= does not apply to it")
        return replace(policy, name=f"{policy.name}@lr-rule={rule}", lr_rule=rule)
    text = ALIASES.get(text, text)
    if text == "ramp-smith":  # doubling interval: the workload's smith_every_epochs (every_epochs 0)
        return Policy("ramp-smith", "smith", 512, 4096, 0.0)
    kind, _, arg = text.partition(":")
    if kind in ADAPTIVE or kind in (AUTO, "finder"):
        if arg:
            raise _bad(spec, f"{kind} takes no argument (its bounds come from the workload)")
        return Policy(kind, kind, 0, 0)
    if kind == "static":
        size_text, _, opt = arg.partition("@")
        n = _size(spec, size_text, "batch size")
        if not opt:
            return Policy(f"static:{n}", "static", n, n)
        if not opt.startswith("lr="):
            raise _bad(spec, "the only option of static:N is @lr=X, e.g. static:512@lr=0.1")
        lr = _number(spec, opt[3:], "learning rate", allow_zero=False)
        return Policy(f"static:{n}@lr={lr:g}", "static", n, n, lr=lr)
    if kind == "tuned-static":
        if arg == "grid":  # the workload's range: workload_grid() expands it once the workload is known
            return Policy("tuned-static:grid", "tuned-static", 0, 0)
        n = _size(spec, arg, "batch size")
        return Policy(f"tuned-static:{n}", "tuned-static", n, n)
    if kind in ("ramp", "smith"):
        form = "ramp:START-END[@EPOCHS]" if kind == "ramp" else "smith:START-END@EPOCHS"
        m = _range(spec, arg, form)
        start, end = _size(spec, m[1], "start"), _size(spec, m[2], "end")
        if end <= start:
            raise _bad(spec, f"end {end} must be larger than start {start}")
        if kind == "smith" and m[3] is None:
            raise _bad(spec, f"write it as {form}")
        every = 0.25 if m[3] is None else _number(spec, m[3], "doubling interval", allow_zero=False)
        name = f"{kind}:{start}-{end}" + ("" if m[3] is None else f"@{every:g}")
        return Policy(name, kind, start, end, every)
    if kind == "warmup":
        w = re.fullmatch(r"(\w+)-(\w+)@([^+]+)\+(.+)", arg)
        if not w:
            raise _bad(spec, "a warmup is written warmup:SMALL-TARGET@W+R, e.g. warmup:32-512@1+2")
        small, target = _size(spec, w[1], "small size"), _size(spec, w[2], "target size")
        warm = _number(spec, w[3], "warmup epochs", allow_zero=True)
        ramp = _number(spec, w[4], "ramp epochs", allow_zero=True)
        return Policy(f"warmup:{small}-{target}@{warm:g}+{ramp:g}", "warmup", small, target, warm, ramp)
    raise _bad(spec, f"unknown policy kind {kind!r}")


def _expand_text(item: str) -> list[str]:
    """A named set or a ``tuned-static:A-B`` range as single specs; anything else as is."""
    text = item.strip().lower()
    if text in NAMED_SETS:
        return [s for part in NAMED_SETS[text].split(",") for s in _expand_text(part)]
    m = re.fullmatch(r"tuned-static:(\d+)-(\d+)(@lr-rule=[\w-]+)?", text)
    if m:
        lo, hi, suffix = int(m[1]), int(m[2]), m[3] or ""
        if lo < 1 or hi < lo:
            raise _bad(item, f"range {lo}-{hi} is empty; write tuned-static:A-B with 1 <= A <= B")
        sizes = []
        while lo <= hi:
            sizes.append(f"tuned-static:{lo}{suffix}")
            lo *= 2
        return sizes
    return [item]


def workload_grid(policies: Sequence[Policy], grid: tuple[int, int]) -> list[Policy]:
    """``policies`` with ``tuned-static:grid`` replaced by ``tuned-static:A-B`` for the workload's ``grid = (A, B)``."""
    out: list[Policy] = []
    for p in policies:
        if p.kind == "tuned-static" and p.batch_size == 0:
            suffix = "" if p.lr_rule is None else f"@lr-rule={p.lr_rule}"
            out += parse_policies(f"tuned-static:{grid[0]}-{grid[1]}{suffix}")
        else:
            out.append(p)
    return list({p.name: p for p in out}.values())


def parse_policies(specs: str | Sequence[str | Policy]) -> list[Policy]:
    """Parse a comma-separated string (or a list) of specs, named sets and ranges; :class:`Policy` passes.

    Raises:
        ValueError: a spec is malformed, the list is empty, or a policy appears twice (after expanding
            named sets, a policy listed again is an error only when written out twice by hand).
    """
    raw: Sequence[str | Policy] = specs.split(",") if isinstance(specs, str) else specs
    items: list[str | Policy] = [i.strip() if isinstance(i, str) else i for i in raw]
    items = [i for i in items if i != ""]
    if not items:
        raise ValueError(f"no policy given; pass at least one of: {POLICY_HELP}.")
    policies: list[Policy] = []
    explicit: list[str] = []
    for item in items:
        if isinstance(item, Policy):
            policies.append(item)
            explicit.append(item.name)
            continue
        expanded = _expand_text(item)
        parsed = [parse_policy(s) for s in expanded]
        if len(expanded) == 1 and expanded[0] is item:
            explicit.append(parsed[0].name)
        policies.extend(parsed)
    duplicates = sorted({n for n in explicit if explicit.count(n) > 1})
    if duplicates:
        raise ValueError(f"policy {', '.join(duplicates)} is listed twice; list each policy once.")
    return list({p.name: p for p in policies}.values())  # first occurrence wins, order kept
