"""What does counting the batch in tokens cost per step? (A benchmark, not a test.)

Two measurements on variable-length sequences (token ids padded to ``--max-len``, lengths drawn from a
log-normal, ``--samples`` of them), one process, one torch thread:

1. **Planning alone.** The loader's work per step without a model: ``AdaptiveDataLoader`` iterated for ``--steps``
   steps with a batch of ``--batch`` samples, and with a budget of ``--batch`` x the mean length in tokens
   (``batch_unit="tokens"``), for world sizes 1 and 4 (rank 0's loader: the planning computes every rank's share)
   and with ``max_micro_batch_tokens`` (a quarter of the budget: token-balanced micro-batches; the samples run then
   has ``max_micro_batch_size`` a quarter of its batch, so both fetch about as many micro-batches). The difference
   per step is the planning's cost (fetching, the same indexing in both, cancels out).
2. **Training.** A ``Pilot`` trains a small token model (embedding, 2-layer MLP per token, masked token-sum loss)
   for ``--steps`` steps in each mode, interleaved over ``--rounds`` rounds. Reported: the median step time
   (``perf/step_time_s``) of each mode, and the planning's cost from (1) as a fraction of the step time in
   tokens, the number the 2% target is about. The end-to-end time per token of both modes is printed too (it
   includes the different padding of differently sized steps, so it is context, not the target).

    PYTHONPATH=src python benchmarks/token_planning.py --out bench-out/token-planning [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot import AdaptiveDataLoader


def make_data(samples: int, max_len: int, seed: int) -> tuple[TensorDataset, list[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(max_len / 4), 0.6, size=samples)), 1, max_len).astype(int)
    ids = torch.from_numpy(rng.integers(1, 256, size=(samples, max_len)))
    mask = torch.arange(max_len)[None, :] < torch.from_numpy(lengths)[:, None]
    return TensorDataset(ids * mask, mask.float()), lengths.tolist()


class TokenModel(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 256))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids))


def loss_sum(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the real tokens."""
    logits = model(ids[:, :-1])
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return (losses * mask[:, 1:]).sum()


def planning_seconds(ds: TensorDataset, lengths: list[int], *, unit: str, size: int, steps: int, world_size: int,
                     micro_tokens: int | None = None, micro_samples: int | None = None) -> float:
    """Seconds per step of the loader alone (rank 0 of ``world_size``), over ``steps`` steps."""
    extra = {"batch_unit": "tokens", "lengths": lengths, "max_micro_batch_tokens": micro_tokens} if unit == "tokens" \
        else {"max_micro_batch_size": micro_samples}
    loader = AdaptiveDataLoader(ds, size, world_size=world_size, rank=0, seed=1, **extra)
    done, start = 0, time.perf_counter()
    while done < steps:
        for micro in loader:
            if micro.is_last:
                done += 1
                if done == steps:
                    break
    return (time.perf_counter() - start) / steps


def train_step_times(ds: TensorDataset, lengths: list[int], *, unit: str, size: int, steps: int) -> dict[str, float]:
    """Seconds per step and per token of ``steps`` training steps (after 3 untimed ones)."""
    torch.manual_seed(0)
    model = TokenModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra = {"batch_unit": "tokens", "lengths": lengths} if unit == "tokens" else {}
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=size, loss_reduction="sum", seed=2, progress=False,
                             system_every=None, **extra)
    tokens, start = 0, None
    for ids, mask in pilot.batches(max_steps=steps + 3):
        if pilot.step == 3 and start is None:
            start = time.perf_counter()
        if pilot.step >= 3:
            tokens += int(mask.sum())
        pilot.backward(loss_sum(model, ids, mask))  # the same compute in both modes (only the weight differs)
    total = time.perf_counter() - (start or time.perf_counter())
    pilot.close()
    return {"seconds_per_step": total / steps, "seconds_per_token": total / max(tokens, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/token-planning"))
    parser.add_argument("--quick", action="store_true", help="a small run (< 60 s)")
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="samples per step (the token budget: x mean length)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.steps, args.rounds = 4000, 40, 3
    torch.set_num_threads(1)
    ds, lengths = make_data(args.samples, args.max_len, seed=0)
    budget = int(round(args.batch * float(np.mean(lengths))))

    planning: dict[str, dict[str, float]] = {}
    for world_size in (1, 4):
        for micro_tokens in (None, budget // 4):
            name = f"world={world_size}" + ("" if micro_tokens is None else f", micro<={micro_tokens} tokens")
            samples_s, tokens_s = [], []
            for _ in range(args.rounds):
                samples_s.append(planning_seconds(ds, lengths, unit="samples", size=args.batch, steps=args.steps,
                                                  world_size=world_size,
                                                  micro_samples=None if micro_tokens is None else args.batch // 4))
                tokens_s.append(planning_seconds(ds, lengths, unit="tokens", size=budget, steps=args.steps,
                                                 world_size=world_size, micro_tokens=micro_tokens))
            planning[name] = {"samples_s_per_step": statistics.median(samples_s),
                              "tokens_s_per_step": statistics.median(tokens_s),
                              "extra_s_per_step": statistics.median(t - s for t, s in zip(tokens_s, samples_s))}

    training: dict[str, list[dict[str, float]]] = {"samples": [], "tokens": []}
    train_step_times(ds, lengths, unit="tokens", size=budget, steps=3)  # warm-up
    for _ in range(args.rounds):
        for unit, size in (("samples", args.batch), ("tokens", budget)):
            training[unit].append(train_step_times(ds, lengths, unit=unit, size=size, steps=args.steps))
    step = {unit: statistics.median(r["seconds_per_step"] for r in runs) for unit, runs in training.items()}
    per_token = {unit: statistics.median(r["seconds_per_token"] for r in runs) for unit, runs in training.items()}
    overhead = {name: p["extra_s_per_step"] / step["tokens"] for name, p in planning.items()}
    result = {
        "settings": {"samples": args.samples, "max_len": args.max_len, "mean_len": float(np.mean(lengths)),
                     "batch_samples": args.batch, "budget_tokens": budget, "steps": args.steps, "rounds": args.rounds,
                     "quick": args.quick, "torch_threads": 1},
        "planning": planning, "step_seconds": step, "seconds_per_token": per_token,
        "planning_overhead_fraction_of_step": overhead,
        "target": "planning overhead <= 2% of a step",
        "meets_target": all(v <= 0.02 for v in overhead.values()),
        "step_seconds_where_2_percent": max(p["extra_s_per_step"] for p in planning.values()) / 0.02,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "token_planning.json").write_text(json.dumps(result, indent=2))
    print(f"budget {budget} tokens = {args.batch} samples x mean length {np.mean(lengths):.1f}")
    print(f"{'loader alone':<34} {'samples us/step':>16} {'tokens us/step':>15} {'extra us':>9} {'% of step':>10}")
    for name, p in planning.items():
        print(f"{name:<34} {p['samples_s_per_step'] * 1e6:>16.1f} {p['tokens_s_per_step'] * 1e6:>15.1f} "
              f"{p['extra_s_per_step'] * 1e6:>9.1f} {overhead[name] * 100:>9.2f}%")
    print(f"training: median step {step['samples'] * 1e3:.2f} ms (samples) / {step['tokens'] * 1e3:.2f} ms (tokens); "
          f"per token {per_token['samples'] * 1e6:.3f} / {per_token['tokens'] * 1e6:.3f} us")
    worst = max(p["extra_s_per_step"] for p in planning.values())
    print(f"target (planning <= 2% of a step): {'met' if result['meets_target'] else 'NOT met'} here; the largest "
          f"extra, {worst * 1e6:.0f} us, is 2% of a {worst / 0.02 * 1e3:.1f} ms step")


if __name__ == "__main__":
    main()
