"""What the loss Hessian says about a changing batch: when a larger batch's LR is stable, and whether the
Hessian-weighted noise scale predicts the critical batch (a benchmark, not a test; experiments, not controllers).

``benchmarks/hindsight.py`` found that on mnist1d one doubling of the tuned static batch (512 -> 1024, the LR
following the linear rule 0.16 -> 0.32) beats the static if it comes after ~4 epochs, and breaks half the
runs after 2. This script measures the quantity that decides it: the largest eigenvalue ``lambda_max`` of
the training loss's Hessian (the sharpness), by power iteration on Hessian-vector products. Gradient
descent with heavy-ball momentum ``beta`` on a quadratic is stable only while ``lr * lambda_max < 2 (1 +
beta)`` (3.8 at 0.9); Cohen et al. 2021 ("Gradient Descent on Neural Networks Typically Occurs at the Edge
of Stability") show that training drives the sharpness up to that bound. Doubling the batch doubles the
LR under the linear rule, so it is safe only once ``2 lr lambda_max`` is well below the bound.

Two modes, both on an SGD workload's own data, model and optimizer (``--workload mnist1d`` or ``digits``):

* ``--mode trace``: the recipe's static batch (``--batch`` at ``--lr``), ``lambda_max`` and
  ``lr * lambda_max`` every ``--every`` epochs, for ``--epochs`` epochs.
* ``--mode gate``: per seed, the static recipe against *gated growth*: start at the recipe, and at every
  check (every ``--every`` epochs) double the batch and the LR if ``2 lr lambda_max < --margin x 2 (1 +
  beta)``, up to ``--max-batch`` (no checks once there). Time to ``--target`` (evaluated every 0.25 epoch,
  evaluation excluded); the probe's seconds are reported apart (``probe_s``) and counted in ``total_s``.
  Too few power iterations approach ``lambda_max`` from below (a Rayleigh quotient never exceeds it): that
  errs towards growing.

* ``--mode noise``: the recipe's static batch, and every ``--every`` epochs McCandlish et al.'s two noise
  scales: ``B_simple = tr(Sigma) / |G|^2`` (what the library measures) and the Hessian-weighted
  ``B_noise = tr(H Sigma) / (G' H G)`` (their Eq. 2.8, the one that predicts the critical batch on a
  quadratic). Both from the same two-batch estimators: ``--probe-samples`` random samples as the big batch,
  cut into small batches of 64, each quadratic form one Hessian-vector product with the big batch's Hessian;
  numerators and denominators summed over 4 draws. The ``B_simple`` estimates are unbiased; the ``B_noise``
  ones carry an O(1/N) bias from taking the Hessian on the samples whose gradients it weighs (about +4%
  on both numerator and denominator on digits at N = 2048, nearly cancelling in the ratio). Does ``B_noise`` sit nearer the critical batch the static grid implies?

Power iteration: ``--probe-samples`` random training samples per check, 3 x ``--iters`` iterations at the
first check, ``--iters`` warm-started from the last eigenvector afterwards. Output: ``sharpness.json``.

    PYTHONPATH=src python benchmarks/sharpness.py --mode trace --seeds 0,1,2 --epochs 6
    PYTHONPATH=src python benchmarks/sharpness.py --mode gate --seeds 0,1,2,3,4 --max-batch 1024 \
        --probe-samples 256 --iters 4
    PYTHONPATH=src python benchmarks/sharpness.py --mode noise --seeds 0,1 --epochs 12 --every 2 --probe-samples 2048
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from batchpilot.bench.train import evaluate
from batchpilot.bench.workloads import get_workload


def top_eigenvalue(model: torch.nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
                   vector: list[torch.Tensor] | None, iters: int) -> tuple[float, list[torch.Tensor]]:
    """``lambda_max`` of the Hessian of ``loss_fn(model(x), y)`` by power iteration on Hessian-vector products
    (double backward); returns it and the last (unit) iterate, to warm-start the next call.

    Power iteration finds the eigenvalue largest in magnitude: where that one is negative (an indefinite
    Hessian, near initialisation), the iteration runs again on ``H - value I``, whose largest eigenvalue is
    ``lambda_max - value`` (a shifted power iteration).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_fn(model(x), y), params, create_graph=True)

    def power(v: list[torch.Tensor], shift: float) -> tuple[float, list[torch.Tensor]]:
        norm = math.sqrt(sum(float((t * t).sum()) for t in v))
        v = [t / norm for t in v]
        value = 0.0
        for _ in range(iters):
            hv = [h - shift * t for h, t in zip(torch.autograd.grad(grads, params, v, retain_graph=True), v)]
            value = sum(float((a * b).sum()) for a, b in zip(hv, v))  # Rayleigh quotient, |v| = 1
            norm = math.sqrt(sum(float((t * t).sum()) for t in hv))
            if norm == 0.0:
                break
            v = [t / norm for t in hv]
        return value + shift, [t.detach() for t in v]

    value, v = power(vector if vector is not None else [torch.randn_like(p) for p in params], 0.0)
    if value < 0:
        value, v = power([torch.randn_like(p) for p in params], value)
    return value, v


def noise_scales(model: torch.nn.Module, loss_fn: Callable, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 small: int = 64) -> tuple[float, float]:
    """``(B_simple, B_noise)`` of McCandlish et al. 2018 from big batches, each cut into small ones.

    Per big batch of ``N`` samples (``n_s = small``): ``|G|^2 ~ (N |g_N|^2 - n_s mean|g_s|^2) / (N - n_s)`` and
    ``tr(Sigma) ~ (mean|g_s|^2 - |g_N|^2) / (1/n_s - 1/N)``, and the same with ``g' H g`` (Hessian-vector
    products with the big batch's Hessian) for ``G' H G`` and ``tr(H Sigma)``. Numerators and denominators are
    summed over the big batches before dividing (as the library's estimator smooths them).
    """
    params = [p for p in model.parameters() if p.requires_grad]

    def dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
        return sum(float((u * v).sum()) for u, v in zip(a, b))

    sums = {"G2": 0.0, "S": 0.0, "GHG": 0.0, "HS": 0.0}
    for x, y in batches:
        big = len(y)
        if big < 2 * small or big % small:
            raise ValueError(f"a big batch of {big} samples cannot be cut into small batches of {small}; "
                             "pass a multiple of it, at least twice as large.")
        grads = torch.autograd.grad(loss_fn(model(x), y), params, create_graph=True)
        g_big = [g.detach() for g in grads]
        q_big = dot(g_big, torch.autograd.grad(grads, params, g_big, retain_graph=True))
        sq_big = dot(g_big, g_big)
        qs, sqs = [], []
        for lo in range(0, big, small):
            g = torch.autograd.grad(loss_fn(model(x[lo : lo + small]), y[lo : lo + small]), params)
            qs.append(dot(g, torch.autograd.grad(grads, params, g, retain_graph=True)))
            sqs.append(dot(g, g))
        q_small, sq_small = sum(qs) / len(qs), sum(sqs) / len(sqs)
        spread = 1 / small - 1 / big
        sums["G2"] += (big * sq_big - small * sq_small) / (big - small)
        sums["S"] += (sq_small - sq_big) / spread
        sums["GHG"] += (big * q_big - small * q_small) / (big - small)
        sums["HS"] += (q_small - q_big) / spread
    return sums["S"] / sums["G2"], sums["HS"] / sums["GHG"]


def momentum_of(optimizer: torch.optim.Optimizer) -> float:
    """SGD's heavy-ball momentum (the stability bound is ``2 (1 + beta) / lr``); other optimizers refused."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise SystemExit(f"the sharpness bound 2(1+beta)/lr holds for SGD; this workload trains with "
                         f"{type(optimizer).__name__}. Use --workload mnist1d or digits.")
    group = optimizer.param_groups[0]
    if group.get("nesterov") or group.get("dampening", 0.0):
        raise SystemExit("the bound 2(1+beta)/lr is heavy-ball momentum's; this SGD uses Nesterov momentum or "
                         "dampening.")
    return float(group.get("momentum", 0.0))


class _Run:
    """One training run of the recipe, optionally with gated growth."""

    def __init__(self, args: argparse.Namespace, seed: int, gated: bool) -> None:
        self.wl = get_workload(args.workload)
        self.train, self.test = self.wl.build_data(self.wl.data_seed)
        self.x, self.y = self.train.tensors
        self.n = len(self.y)
        self.model = self.wl.build_model(seed)
        self.optimizer = self.wl.make_optimizer(self.model.parameters(), args.lr)
        self.bound = 2 * (1 + momentum_of(self.optimizer))
        self.args, self.seed, self.gated = args, seed, gated
        self.batch, self.lr = args.batch, args.lr
        self.order = torch.Generator().manual_seed(seed)
        self.probe_rng = torch.Generator().manual_seed(seed + 1000)
        self.vector: list[torch.Tensor] | None = None
        self.samples, self.train_s, self.probe_s = 0, 0.0, 0.0
        self.checks: list[dict[str, Any]] = []

    def probe(self) -> float:
        start = time.perf_counter()
        idx = torch.randint(0, self.n, (self.args.probe_samples,), generator=self.probe_rng)
        iters = self.args.iters if self.vector is not None else 3 * self.args.iters
        value, self.vector = top_eigenvalue(self.model, self.wl.loss_fn, self.x[idx], self.y[idx], self.vector, iters)
        self.probe_s += time.perf_counter() - start
        return value

    def check(self) -> None:
        """A scheduled check: record the sharpness, and (gated) double the batch if the doubled LR is stable;
        or (``--mode noise``) record the two noise scales."""
        if self.args.mode == "noise":
            start = time.perf_counter()
            draws = [torch.randperm(self.n, generator=self.probe_rng)[: self.args.probe_samples] for _ in range(4)]
            simple, noise = noise_scales(self.model, self.wl.loss_fn, [(self.x[i], self.y[i]) for i in draws])
            self.probe_s += time.perf_counter() - start
            self.checks.append({"epoch": round(self.samples / self.n, 3), "b_simple": simple, "b_noise": noise})
            return
        sharpness = self.probe()
        grow = self.gated and 2 * self.lr * sharpness < self.args.margin * self.bound
        self.checks.append({"epoch": round(self.samples / self.n, 3), "batch": self.batch, "lr": self.lr,
                            "lambda_max": sharpness, "lr_x_lambda": self.lr * sharpness, "grew": grow})
        if grow:
            self.batch, self.lr = 2 * self.batch, 2 * self.lr
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr

    def run(self, until_epochs: float | None) -> dict[str, Any]:
        args = self.args
        next_eval, next_check = 0.25, (0.0 if until_epochs is not None else args.every)
        while True:
            perm, pos = torch.randperm(self.n, generator=self.order), 0
            while pos < self.n:
                epoch = self.samples / self.n
                growing = self.gated and self.batch < args.max_batch  # no probe once at the largest batch
                if (until_epochs is not None or growing) and epoch >= next_check:
                    self.check()
                    next_check += args.every
                if until_epochs is not None and epoch >= until_epochs:
                    return self.result(None)
                start = time.perf_counter()
                idx = perm[pos : pos + self.batch]
                pos, self.samples = pos + len(idx), self.samples + len(idx)
                loss = self.wl.loss_fn(self.model(self.x[idx]), self.y[idx])
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                self.train_s += time.perf_counter() - start
                if not math.isfinite(loss.item()):
                    return self.result("diverged")
                if until_epochs is None and self.samples >= next_eval * self.n:
                    next_eval += 0.25
                    if evaluate(self.model, self.test) >= args.target:
                        return self.result("reached")
                    if self.train_s + self.probe_s >= args.budget_s:
                        return self.result("budget")

    def result(self, outcome: str | None) -> dict[str, Any]:
        return {"seed": self.seed, "variant": "gated" if self.gated else "static", "outcome": outcome,
                "epochs": self.samples / self.n, "train_s": self.train_s, "probe_s": self.probe_s,
                "total_s": self.train_s + self.probe_s, "final_batch": self.batch, "checks": self.checks}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("trace", "gate", "noise"), default="trace")
    p.add_argument("--workload", default="mnist1d")
    p.add_argument("--batch", type=int, default=512, help="the recipe's batch size")
    p.add_argument("--lr", type=float, default=0.16, help="the recipe's LR at --batch")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=float, default=6.0, help="trace: epochs to follow")
    p.add_argument("--every", type=float, default=0.5, help="epochs between sharpness checks")
    p.add_argument("--probe-samples", type=int, default=4096, help="training samples per sharpness check")
    p.add_argument("--iters", type=int, default=8, help="power iterations per check (3x at the first)")
    p.add_argument("--margin", type=float, default=0.7, help="gate: grow while 2 lr lambda < margin x 2(1+beta)")
    p.add_argument("--max-batch", type=int, default=1024, help="gate: largest batch to grow to")
    p.add_argument("--target", type=float, default=None, help="gate: test accuracy (default: the workload's)")
    p.add_argument("--budget-s", type=float, default=40.0, help="gate: most seconds per run (probe included)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--out", default="bench-out/sharpness", help="folder for sharpness.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.target is None:
        args.target = get_workload(args.workload).target_accuracy
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    for seed in seeds:
        variants = (False, True) if args.mode == "gate" else (False,)
        for gated in variants:  # interleaved seed by seed
            torch.manual_seed(seed)
            run = _Run(args, seed, gated).run(None if args.mode == "gate" else args.epochs)
            runs.append(run)
            if args.mode == "noise":
                for c in run["checks"]:
                    print(f"seed {seed}  epoch {c['epoch']:5.2f}  B_simple {c['b_simple']:8.1f}  "
                          f"B_noise {c['b_noise']:8.1f}  ratio {c['b_noise'] / c['b_simple']:5.2f}", flush=True)
            elif args.mode == "trace":
                for c in run["checks"]:
                    print(f"seed {seed}  epoch {c['epoch']:5.2f}  lambda_max {c['lambda_max']:7.2f}  "
                          f"lr x lambda {c['lr_x_lambda']:5.2f}", flush=True)
            else:
                grew = ", ".join(f"{c['batch'] * 2} at epoch {c['epoch']:g}" for c in run["checks"] if c["grew"])
                print(f"seed {seed} {run['variant']:6s} {run['outcome']:8s} {run['total_s']:6.2f} s "
                      f"(probe {run['probe_s']:.2f} s) {run['epochs']:5.2f} epochs  grew: {grew or '-'}", flush=True)
    medians = {}
    if args.mode == "gate":
        for variant in ("static", "gated"):
            done = [r for r in runs if r["variant"] == variant and r["outcome"] == "reached"]
            medians[variant] = {"reached": len(done), "runs": len(seeds),
                                "median_total_s": statistics.median(r["total_s"] for r in done) if done else None}
        print(json.dumps(medians))
    result = {"config": vars(args), "runs": runs, "medians": medians}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharpness.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'sharpness.json'}")
    return result


if __name__ == "__main__":
    main()
