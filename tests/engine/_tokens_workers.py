"""Token-budget problems and the 2-process gloo worker of tests/engine/test_tokens_distributed.py (module level, so
``spawn`` can import it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from _hf_common import SizeList  # a controller that replays a list of sizes
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.data.tokens import plan_token_batch

__all__ = ["plan_token_batch"]

NUM_SAMPLES, MAX_LEN = 83, 12
# Token budgets a controller replays: one below the longest sample (steps of one sample, a ghost on the other
# rank), ones across epoch ends.
BUDGETS = [40, 97, 5, 150, 64, 13, 220, 31, 77, 9]


class Sequences(TensorDataset):
    """Padded sequences (features, targets, mask) with every sample's token count in ``lengths``."""

    lengths: list[int]


def make_data(seed: int = 0) -> Sequences:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_LEN + 1, (NUM_SAMPLES,), generator=g)
    x = torch.randn(NUM_SAMPLES, MAX_LEN, 3, generator=g, dtype=torch.float64)
    y = torch.randn(NUM_SAMPLES, MAX_LEN, generator=g, dtype=torch.float64)
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).double()
    ds = Sequences(x, y, mask)
    ds.lengths = lengths.tolist()
    return ds


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def token_loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The squared error summed over the batch's real tokens (padding masked out)."""
    return (((model(x).squeeze(-1) - y) ** 2) * mask).sum()


class Budgets(SizeList):
    """A controller that replays token budgets (rank 0 only ever calls it); records what it observed; resumable."""

    def __init__(self, budgets: list[int]) -> None:
        super().__init__(budgets)
        self.seen: list[tuple[int, int, int]] = []
        self.stats: dict = {}

    def decide(self, obs: batchpilot.Observation) -> int:
        self.seen.append((obs.batch_size, obs.samples_seen, obs.num_samples))
        self.stats = dict(obs.stats)
        return super().decide(obs)


def train(pilot: batchpilot.Pilot, model: torch.nn.Module, steps: int) -> list[dict]:
    """Run ``pilot`` to ``steps`` steps with the token-sum loss; one record per step (this rank's indices)."""
    records: list[dict] = []
    for x, y, mask in pilot.batches(max_steps=steps):
        m = pilot.micro_batch
        if m.micro_index == 0:
            records.append({"indices": [], "tokens": m.global_tokens, "accumulation_steps": m.accumulation_steps,
                            "epoch": pilot.epoch, "micro_tokens": []})
        if not m.ghost:
            records[-1]["indices"].extend(m.indices.tolist())
        records[-1]["micro_tokens"].append(m.tokens)
        pilot.backward(token_loss_sum(model, x, y, mask))
    return records


def make_pilot(model: torch.nn.Module, **settings) -> batchpilot.Pilot:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    settings = {"batch_size": 50, "batch_unit": "tokens", "lengths": "lengths", "loss_reduction": "sum", "seed": 3,
                **settings}
    return batchpilot.Pilot(model, opt, make_data(), **settings)


def token_worker(rank: int, world_size: int, init_file: str, out_dir: str, ddp: bool, max_tokens: int | None,
                 rank_weights: list[float] | None, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = make_model()
        wrapped = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
        controller = Budgets(BUDGETS) if rank == 0 else Budgets([0])  # only rank 0's is asked
        pilot = make_pilot(wrapped, controller=controller, max_micro_batch_tokens=max_tokens,
                           rank_weights=rank_weights, noise_every=2)  # the noise scale's sums cross the ranks too
        records = train(pilot, wrapped, steps)
        out = {"records": records, "weights": [p.detach().tolist() for p in model.parameters()],
               "tokens_seen": pilot.tokens_seen, "samples_seen": pilot.samples_seen, "observed": controller.seen,
               "noise": {k: v for k, v in pilot.last_record.items() if k.startswith("stats/")}}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        del pilot, wrapped
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # (see tests/_dist_helpers.finish: no interpreter finalisation beside gloo's threads)


def reference_weights(steps_indices: list[list[int]]) -> list[list]:
    """One process, one big batch per step: the gradient of the mean token loss over the step's samples."""
    ds, model = make_data(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y, mask = ds.tensors
    for indices in steps_indices:
        index = torch.tensor(indices)
        tokens = sum(ds.lengths[i] for i in indices)
        opt.zero_grad()
        (token_loss_sum(model, x[index], y[index], mask[index]) / tokens).backward()
        opt.step()
    return [p.detach().tolist() for p in model.parameters()]
