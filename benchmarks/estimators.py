"""How accurate and how cheap are batchpilot's statistics? (a benchmark, not a test)

(A) Noise scale on a problem whose truth is known in closed form. Linear regression with Gaussian inputs:

        x ~ N(0, C),  C = diag(c_1..c_d),   y = x.w* + e,  e ~ N(0, s^2) independent of x,
        per-example loss l(w) = (x.w - y)^2 / 2,  gradient g = x (x.w - y) = x (x.delta - e),  delta = w - w*.

    At a fixed w the per-example gradient has mean G = E[x x^T] delta = C delta. Its second moment, by
    Isserlis' theorem E[x_i x_j x_k x_l] = C_ij C_kl + C_ik C_jl + C_il C_jk and the independence of e, is

        E[g g^T] = E[x x^T (x.delta)^2] + s^2 E[x x^T] = (delta^T C delta) C + 2 C delta delta^T C + s^2 C,

    so the covariance Sigma = E[g g^T] - G G^T = (delta^T C delta + s^2) C + C delta delta^T C and

        |G|^2 = |C delta|^2,   tr(Sigma) = (delta^T C delta + s^2) tr(C) + |C delta|^2,   B_simple = tr(Sigma) / |G|^2.

    The estimator is fed exactly as the engine would feed it from an accumulated step: each step draws k
    fresh micro-batches of m samples, backpropagates ``mean loss * m / N`` (N = k m) into ``.grad`` of an
    ``nn.Linear`` (float32), takes each micro-batch's gradient as the increment of ``.grad`` (a snapshot
    before its backward), rescales the increment's squared norm by (N / m)^2, and passes
    ``small_big_from_micro(...)`` to ``NoiseScaleEstimator.update``. w is held fixed, so the truth is
    constant; the error of the smoothed estimates is measured after a warm-up of ``--warmup`` updates.
    k micro-batches on one process are the same arithmetic as k ranks under DDP.
(A') The one-micro-batch fallback that pairs consecutive steps: its bias as a function of the SGD step
    size between the two gradients (lr * c_max, c_max the largest curvature), from a fixed w.
(B) Per-sample gradient variance: ``per_sample_grad_variance`` (torch.func) against a brute-force loop over
    samples, on an MLP and the MNIST-1D CNN, in float64 and float32; and the micro-batch estimate
    against the exact value over random splits of the batch.
(C) Cost, on the MNIST-1D CNN: one forward/backward of a micro-batch versus what the statistics add
    (the per-micro-batch gradient snapshot and increment norm, an estimator update, one exact
    per-sample variance). All timings are the best of several repetitions.

    PYTHONPATH=src python benchmarks/estimators.py --out bench-out/estimators.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchpilot.stats import (
    NoiseScaleEstimator,
    micro_batch_grad_variance,
    per_sample_grad_variance,
    small_big_from_micro,
    two_batch_estimates,
)


# ----------------------------------------------------------------------------------------------- (A)
class LinearProblem:
    """The least-squares problem of the module docstring, at a fixed ``w = w* + delta``."""

    def __init__(self, d: int = 32, delta_norm: float = 1.0, noise_std: float = 1.0, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.gen = g
        self.c = torch.linspace(0.5, 1.5, d, dtype=torch.float64)
        self.w_star = torch.randn(d, generator=g, dtype=torch.float64)
        direction = torch.randn(d, generator=g, dtype=torch.float64)
        self.delta = direction / direction.norm() * delta_norm
        self.noise_std = noise_std

    def truth(self, delta: torch.Tensor | None = None) -> dict[str, float]:
        delta = self.delta if delta is None else delta
        cd = self.c * delta
        grad_sq = float(cd.dot(cd))
        trace = float((delta.dot(cd) + self.noise_std**2) * self.c.sum() + grad_sq)
        return {"grad_sq_norm": grad_sq, "trace_cov": trace, "b_simple": trace / grad_sq}

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, len(self.c), generator=self.gen, dtype=torch.float64) * self.c.sqrt()
        y = x @ self.w_star + self.noise_std * torch.randn(n, generator=self.gen, dtype=torch.float64)
        return x.float(), y.float()


def linear_model(problem: LinearProblem, delta: torch.Tensor | None = None) -> nn.Linear:
    model = nn.Linear(len(problem.c), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((problem.w_star + (problem.delta if delta is None else delta)).float()[None])
    return model


def accumulated_step(model: nn.Module, problem: LinearProblem, m: int, k: int) -> tuple[list[float], list[int], float]:
    """One accumulated step of k micro-batches of m samples; returns what ``small_big_from_micro`` takes.

    This is the engine's recipe: backward(mean loss * m / N) per micro-batch, read each micro-batch's
    gradient as the increment of .grad, rescale its squared norm by (N / m)^2."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    total = m * k
    sq_small = []
    for _ in range(k):
        x, y = problem.sample(m)
        before = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        loss = 0.5 * ((model(x).squeeze(1) - y) ** 2).mean()
        (loss * (m / total)).backward()
        inc = torch._foreach_sub([p.grad for p in params], before)
        sq_small.append(sum(float(n) ** 2 for n in torch._foreach_norm(inc)) * (total / m) ** 2)
    sq_big = sum(float(p.grad.norm()) ** 2 for p in params)
    return sq_small, [m] * k, sq_big


def rel_errors(values: list[float], truth: float) -> dict[str, float]:
    errs = sorted(abs(v / truth - 1) for v in values)  # inf (no estimate) sorts last
    return {
        "median_abs_rel_err": _finite_or_none(statistics.median(errs)),
        "p90_abs_rel_err": _finite_or_none(errs[int(0.9 * (len(errs) - 1))]),
        "frac_within_10pct": sum(e <= 0.10 for e in errs) / len(errs),
    }


def noise_scale_accuracy(configs: list[dict[str, Any]], decays: tuple[float, ...], warmup: int, steps: int,
                         seeds: int = 3) -> list[dict]:
    """Per config: errors of the smoothed estimates after warm-up, pooled over ``seeds`` runs (each its
    own w and data), and the bias of the mean of the raw (unsmoothed) per-step estimates."""
    rows = []
    for cfg in configs:
        track: dict[float, dict[str, list[float]]] = {d: {"b_simple": [], "grad_sq_norm": [], "trace_cov": []} for d in decays}
        raw: dict[str, list[float]] = {"grad_sq_norm": [], "trace_cov": []}  # relative to the seed's truth
        truths = []
        for seed in range(seeds):
            problem = LinearProblem(delta_norm=cfg["delta_norm"], seed=seed)
            truth = problem.truth()
            truths.append(truth)
            model = linear_model(problem)
            estimators = {d: NoiseScaleEstimator(ema_decay=d) for d in decays}
            for t in range(warmup + steps):
                args = small_big_from_micro(*accumulated_step(model, problem, cfg["m"], cfg["k"]))
                g_est, t_est = two_batch_estimates(*args)
                raw["grad_sq_norm"].append(g_est / truth["grad_sq_norm"])
                raw["trace_cov"].append(t_est / truth["trace_cov"])
                for d, est in estimators.items():
                    est.update(*args)
                    if t >= warmup:
                        for key in track[d]:
                            value = getattr(est, key)
                            track[d][key].append(math.inf if value is None else value / truth[key])
        row = {"config": cfg, "big_batch": cfg["m"] * cfg["k"], "seeds": seeds,
               "truth": {"b_simple": statistics.fmean(t["b_simple"] for t in truths), "per_seed": truths},
               "raw_estimate_bias": {key: _mean_rel(v, 1.0) for key, v in raw.items()},
               "by_decay": {}}
        for d in decays:
            row["by_decay"][str(d)] = {key: rel_errors(vals, 1.0) for key, vals in track[d].items()}
        rows.append(row)
    return rows


def pair_fallback_bias(trials: int, warmup: int, b: int = 64, steps_x_cmax: tuple[float, ...] = (0.0, 0.1, 0.5, 1.0, 1.5),
                       seed: int = 1) -> list[dict[str, Any]]:
    """(A') The consecutive-step fallback: the gradient of one batch at w, an SGD step of size lr, the
    gradient of a fresh batch at w - lr * g_a, paired as two "small" batches of b. Repeated from the same w
    (so the truth is fixed) for several step sizes, given as lr * c_max (c_max = the largest curvature,
    1.5 here; SGD on this problem is stable below 2). lr = 0 is the honest two-batch estimate."""
    rows = []
    for lr_c in steps_x_cmax:
        problem = LinearProblem(delta_norm=0.5, seed=seed)
        truth = problem.truth()
        lr = lr_c / float(problem.c.max())
        model = linear_model(problem)
        w0 = model.weight.detach().clone()
        est = NoiseScaleEstimator()
        raw_g, raw_t, b_err = [], [], []
        for t in range(warmup + trials):
            grads = []
            for _ in range(2):
                sq_small, _, _ = accumulated_step(model, problem, b, 1)
                grads.append(model.weight.grad.detach().reshape(-1).double().clone())
                with torch.no_grad():
                    model.weight -= lr * model.weight.grad
            with torch.no_grad():
                model.weight.copy_(w0)
            g_a, g_b = grads
            big = (g_a + g_b) / 2
            args = small_big_from_micro([float(g_a @ g_a), float(g_b @ g_b)], [b, b], float(big @ big))
            g_est, t_est = two_batch_estimates(*args)
            raw_g.append(g_est)
            raw_t.append(t_est)
            est.update(*args, biased=lr > 0)
            if t >= warmup:
                b_err.append(abs(est.b_simple / truth["b_simple"] - 1) if est.b_simple is not None else math.inf)
        rows.append({
            "lr_x_cmax": lr_c, "batch": b, "truth_b_simple": truth["b_simple"],
            "grad_sq_norm_bias": _mean_rel(raw_g, truth["grad_sq_norm"]),
            "trace_cov_bias": _mean_rel(raw_t, truth["trace_cov"]),
            "b_from_means_rel_err": (statistics.fmean(raw_t) / statistics.fmean(raw_g)) / truth["b_simple"] - 1
            if statistics.fmean(raw_g) > 0 else None,
            # None: at the median step the smoothed |G|^2 was <= 0 (no B_simple at all).
            "ema_b_simple_median_abs_rel_err": _finite_or_none(statistics.median(b_err)),
        })
    return rows


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _mean_rel(values: list[float], truth: float) -> dict[str, float]:
    """Relative bias of the mean of raw estimates, with its standard error."""
    return {"rel_bias": statistics.fmean(values) / truth - 1,
            "std_err": statistics.stdev(values) / math.sqrt(len(values)) / abs(truth)}


# ----------------------------------------------------------------------------------------------- (B)
def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 10))


def cnn() -> nn.Module:
    from batchpilot.bench.workloads import MNIST1DCNN

    return MNIST1DCNN()


def brute_force_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(n, P) per-sample gradients by one backward per sample."""
    rows = []
    for i in range(len(x)):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    return torch.stack(rows)


def variance_accuracy(n: int, partitions: int, reps: int = 3) -> list[dict]:
    rows = []
    for name, make, shape in (("mlp", mlp, (40,)), ("cnn", cnn, (1, 40))):
        for dtype in (torch.float64, torch.float32):
            torch.manual_seed(0)
            model = make().to(dtype)
            x, y = torch.randn(n, *shape, dtype=dtype), torch.randint(0, 10, (n,))
            exact = per_sample_grad_variance(model, nn.functional.cross_entropy, x, y)
            grads = brute_force_grads(model, x, y).double()
            # reps = 0 (--quick): accuracy only, no timings
            t_vmap = best_time(lambda m=model, x=x, y=y: per_sample_grad_variance(m, nn.functional.cross_entropy, x, y), reps) if reps else None
            t_loop = best_time(lambda m=model, x=x, y=y: brute_force_grads(m, x, y), reps) if reps else None
            brute = float(((grads - grads.mean(0)) ** 2).sum(1).mean())
            row = {"model": name, "dtype": str(dtype).replace("torch.", ""), "n": n, "params": grads.shape[1],
                   "sigma2": exact, "rel_err_vs_loop": abs(exact / brute - 1), "vmap_s": t_vmap, "loop_s": t_loop}
            if dtype == torch.float64:
                gen = torch.Generator().manual_seed(0)
                for k in (4, 16):
                    est = []
                    for _ in range(partitions):
                        chunks = torch.randperm(n, generator=gen).chunk(k)
                        est.append(micro_batch_grad_variance([grads[c].mean(0) for c in chunks], [len(c) for c in chunks]))
                    row[f"micro_k{k}"] = {"mean_rel_err": statistics.fmean(est) / brute - 1,
                                          "rel_std": statistics.pstdev(est) / brute}
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------- (C)
def best_time(fn: Callable[[], Any], reps: int) -> float:
    """Best of ``reps`` timings after one warm-up call (as timeit does): on a shared machine other
    processes only ever add time, so the minimum is the stable number."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def cost(micro: int, reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = cnn()
    params = list(model.parameters())
    x, y = torch.randn(micro, 1, 40), torch.randint(0, 10, (micro,))

    def fwd_bwd() -> None:
        nn.functional.cross_entropy(model(x), y).backward()

    def snapshot_and_norm() -> None:  # what the engine adds per micro-batch for the noise scale
        before = torch._foreach_mul([p.grad for p in params], 1.0)  # copy
        inc = torch._foreach_sub([p.grad for p in params], before)
        sum(float(n) ** 2 for n in torch._foreach_norm(inc))

    fwd_bwd()
    est = NoiseScaleEstimator()
    out = {
        "micro_batch": micro,
        "params": sum(p.numel() for p in params),
        "fwd_bwd_ms": 1000 * best_time(fwd_bwd, reps),
        "snapshot_and_norm_ms": 1000 * best_time(snapshot_and_norm, reps),
        "estimator_update_us": 1e6 * best_time(lambda: est.update(32.0, 2.0, 128.0, 1.0), reps),
        "per_sample_variance_ms": 1000 * best_time(
            lambda: per_sample_grad_variance(model, nn.functional.cross_entropy, x, y), max(3, reps // 5)),
    }
    out["snapshot_frac_of_fwd_bwd"] = out["snapshot_and_norm_ms"] / out["fwd_bwd_ms"]
    out["per_sample_variance_x_fwd_bwd"] = out["per_sample_variance_ms"] / out["fwd_bwd_ms"]
    return out


# ----------------------------------------------------------------------------------------------- main
CONFIGS = [  # delta_norm sets the true noise scale; m x k the batch sizes (k micro-batches or ranks)
    {"name": "low noise, 4x16", "delta_norm": 2.0, "m": 16, "k": 4},
    {"name": "mid noise, 4x16", "delta_norm": 0.5, "m": 16, "k": 4},
    {"name": "mid noise, 2x64", "delta_norm": 0.5, "m": 64, "k": 2},
    {"name": "mid noise, 8x32", "delta_norm": 0.5, "m": 32, "k": 8},
    {"name": "high noise, 4x64", "delta_norm": 0.15, "m": 64, "k": 4},
    {"name": "high noise, 8x128", "delta_norm": 0.15, "m": 128, "k": 8},
]


# EMA decays per update: 0.95 (the estimator's default), 0.99 ** 4 (the engine's default when it measures
# every 16th step: the same ~400-step memory as 0.99 every 4th step) and 0.99.
DECAYS = (0.95, round(0.99**4, 4), 0.99)


def run(quick: bool = False, warmup: int = 100, steps: int = 400) -> dict[str, Any]:
    torch.manual_seed(0)
    if quick:
        warmup, steps = 10, 20
    configs = CONFIGS[1:2] if quick else CONFIGS
    result: dict[str, Any] = {
        "config": {"quick": quick, "warmup": warmup, "steps": steps, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "python": platform.python_version()},
        "noise_scale": noise_scale_accuracy(configs, DECAYS, warmup, steps, seeds=1 if quick else 3),
        "pair_fallback": pair_fallback_bias(steps, warmup, steps_x_cmax=(0.0, 1.5) if quick else (0.0, 0.1, 0.5, 1.0, 1.5)),
        "grad_variance": variance_accuracy(8 if quick else 64, 5 if quick else 200, 0 if quick else 5),
    }
    if not quick:
        result["cost"] = [cost(m, 50) for m in (32, 128)]
    return result


def _ms(x: float | None) -> str:
    return "      -   " if x is None else f"{1000 * x:7.1f} ms"


def _pct(x: float | None) -> str:
    return "undefined" if x is None else f"{x:.1%}"


def print_tables(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(f"\n(A) noise scale vs closed form: |rel err| after {cfg['warmup']} warm-up updates, over {cfg['steps']} updates"
          " x seeds (pooled); bias of the mean raw estimate +- std err")
    print(f"  {'config':<20} {'B_true':>7} {'N':>5} {'decay':>5}  {'B med':>6} {'B p90':>6} {'B<=10%':>6}"
          f"  {'|G|2 med':>8} {'tr med':>6}  {'raw-estimate bias |G|2, tr':>26}")
    for row in result["noise_scale"]:
        for d, r in row["by_decay"].items():
            raw = row["raw_estimate_bias"]
            print(f"  {row['config']['name']:<20} {row['truth']['b_simple']:>7.1f} {row['big_batch']:>5} {d:>5}"
                  f"  {_pct(r['b_simple']['median_abs_rel_err']):>6} {_pct(r['b_simple']['p90_abs_rel_err']):>6}"
                  f" {r['b_simple']['frac_within_10pct']:>6.0%}  {_pct(r['grad_sq_norm']['median_abs_rel_err']):>8}"
                  f" {_pct(r['trace_cov']['median_abs_rel_err']):>6}  {raw['grad_sq_norm']['rel_bias']:>+6.1%}"
                  f"+-{raw['grad_sq_norm']['std_err']:.1%} {raw['trace_cov']['rel_bias']:>+5.1%}+-{raw['trace_cov']['std_err']:.1%}")
    print("\n(A') consecutive-step pairs (fallback) at a fixed w, batch 64: bias of the mean raw estimate (+- std err)")
    print(f"  {'lr*c_max':>8}  {'|G|^2 bias':>16}  {'tr bias':>16}  {'B from means':>12}  {'EMA B med |err|':>15}")
    for r in result["pair_fallback"]:
        g, t = r["grad_sq_norm_bias"], r["trace_cov_bias"]
        bm = "n/a (|G|^2<=0)" if r["b_from_means_rel_err"] is None else f"{r['b_from_means_rel_err']:+.1%}"
        print(f"  {r['lr_x_cmax']:>8.2f}  {g['rel_bias']:>+8.1%} +-{g['std_err']:>5.1%}  {t['rel_bias']:>+8.1%} +-{t['std_err']:>5.1%}"
              f"  {bm:>12}  {_pct(r['ema_b_simple_median_abs_rel_err']):>15}")
    print("\n(B) per-sample gradient variance: torch.func vs a loop over samples")
    for r in result["grad_variance"]:
        micro = "".join(f"  micro k={k[7:]}: bias {r[k]['mean_rel_err']:+.1%}, rel std {r[k]['rel_std']:.0%}"
                        for k in r if k.startswith("micro_k"))
        print(f"  {r['model']:<4} {r['dtype']:<8} n={r['n']:<3} P={r['params']:<5} rel err {r['rel_err_vs_loop']:.1e}"
              f"  vmap {_ms(r['vmap_s'])}  loop {_ms(r['loop_s'])}{micro}")
    for c in result.get("cost", []):
        print(f"\n(C) cost, MNIST-1D CNN ({c['params']} params), micro-batch {c['micro_batch']}: fwd+bwd {c['fwd_bwd_ms']:.2f} ms;"
              f" snapshot+norm {c['snapshot_and_norm_ms']:.3f} ms ({c['snapshot_frac_of_fwd_bwd']:.1%});"
              f" estimator update {c['estimator_update_us']:.1f} us; exact per-sample variance"
              f" {c['per_sample_variance_ms']:.1f} ms ({c['per_sample_variance_x_fwd_bwd']:.1f}x fwd+bwd)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out/estimators.json", help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="tiny budget (for the test suite)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    result = run(args.quick, args.warmup, args.steps)
    result["config"]["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, allow_nan=False))
    print_tables(result)
    print(f"\nwrote {out} ({result['config']['wall_s']:.1f} s)")


if __name__ == "__main__":
    main()
