"""A tiny Lightning fit driven by AdaptiveBatchSize; importable (tests/integrations/test_lightning*.py) and
runnable under torchrun (2 gloo ranks on CPU):

    torchrun --standalone --nproc-per-node 2 tests/_lightning_ddp.py OUT_DIR [--noise] [--manual]
        [--dropout] [--save CKPT_DIR] [--resume CKPT] [--rank-weights W0,W1|auto] [--slow-rank1 SECONDS]
        [--sizes S,S,...] [--samples N] [--max-steps N]

Writes OUT_DIR/rank<r>.json: per optimizer step the global size and this rank's sample ids, and the final
weights. ``--dropout``: a net with dropout, each rank's generator seeded apart; ``--save``: a checkpoint every
3 steps; ``--resume``: the fit resumes from that checkpoint. ``--rank-weights`` passes ``rank_weights`` (each
step then records the weights it was shared by); ``--slow-rank1 S`` makes rank 1's training step sleep S seconds
per sample (a slower node); ``--sizes``, ``--samples`` and ``--max-steps`` replace the sizes, the dataset size and
the step limit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dist_helpers import finish
from _hf_common import SizeList, StatsSpy

from batchpilot.integrations.lightning import AdaptiveBatchSize

SIZES = [3, 7, 1, 12, 5, 9, 2, 20, 4, 11]
NUM_SAMPLES = 61
# --noise: every step measured; sizes that are multiples of world size x accumulation (no ghosts), 64 samples.
NOISE_SIZES, NOISE_SAMPLES = [8, 12, 4, 16], 64


def make_data(n: int = NUM_SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x[:, 0] - x[:, 1] > 0).long(), torch.arange(n))


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


class Model(L.LightningModule):
    """Trains ``make_net()`` with SGD; weights each micro-batch with ``adaptive.loss_weight``; records what it saw."""

    def __init__(self, adaptive: AdaptiveBatchSize, data: TensorDataset, workers: int = 0, val: bool = True) -> None:
        super().__init__()
        self.adaptive, self.data, self.workers, self.val = adaptive, data, workers, val
        self.net = make_net()
        self.steps: list[dict] = []  # one per optimizer step: size and this rank's ids
        self.validations = 0
        self.slow = 0.0  # extra seconds per sample of each training step (a slower rank)

    def train_dataloader(self):
        return self.adaptive.dataloader(self.data, num_workers=self.workers, seed=1)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=16) if self.val else []

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        micro = self.adaptive.micro_batch
        if micro.micro_index == 0:
            self.steps.append({"size": micro.global_size, "ids": [], "epoch": micro.epoch, "micro": [],
                               "rank_weights": self.adaptive.rank_weights})
        time.sleep(self.slow * micro.size)
        if not micro.ghost:
            self.steps[-1]["ids"].extend(ids.tolist())
        self.steps[-1]["micro"].append([] if micro.ghost else ids.tolist())  # one list per micro-batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        # Logged per sample: the epoch mean of the ids must be the mean of range(N) exactly.
        self.log("id_mean", ids.double().mean(), on_step=False, on_epoch=True,
                 batch_size=self.adaptive.local_batch_size)
        return self.adaptive.weight(loss)

    def validation_step(self, batch, batch_idx):
        return None

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.validations += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DropoutModel(Model):
    """``Model`` with dropout; each rank draws its own masks (its generator seeded by rank at the fit's start)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Dropout(0.5), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 2)).double()

    def on_fit_start(self):
        torch.manual_seed(100 + self.global_rank)


class ManualModel(Model):
    """``Model`` with manual optimization: one ``manual_backward`` and one optimizer step per batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)  # already weighted by adaptive.weight
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def main() -> None:
    out, noise, manual = Path(sys.argv[1]), "--noise" in sys.argv[2:], "--manual" in sys.argv[2:]
    module = ManualModel if manual else Model  # manual optimization: no accumulation (Lightning's rule)
    if "--dropout" in sys.argv[2:]:
        module = DropoutModel
    option = {name: sys.argv[sys.argv.index(name) + 1] for name in
              ("--save", "--resume", "--rank-weights", "--slow-rank1", "--sizes", "--samples", "--max-steps")
              if name in sys.argv}
    weights = option.get("--rank-weights")
    if weights is not None and weights != "auto":
        weights = [float(w) for w in weights.split(",")]
    sizes = [int(s) for s in option["--sizes"].split(",")] if "--sizes" in option else SIZES
    if noise:
        controller = StatsSpy(NOISE_SIZES)
        adaptive = AdaptiveBatchSize(controller, batch_size=4, noise_every=1, rank_weights=weights)
        model = module(adaptive, make_data(NOISE_SAMPLES), val=False)
    else:
        controller = SizeList(sizes)
        adaptive = AdaptiveBatchSize(controller, batch_size=4, rank_weights=weights)
        model = module(adaptive, make_data(int(option.get("--samples", NUM_SAMPLES))), val=False)
    savers = [ModelCheckpoint(dirpath=option["--save"], every_n_train_steps=3, save_top_k=-1, filename="{step}")] \
        if "--save" in option else []
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", devices=2, strategy="ddp", accumulate_grad_batches=1 if manual else 2,
        callbacks=[adaptive, *savers], logger=False, enable_checkpointing=bool(savers), enable_progress_bar=False,
        enable_model_summary=False, max_steps=int(option.get("--max-steps", -1)),
    )
    if "--slow-rank1" in option and os.environ.get("RANK") == "1":
        model.slow = float(option["--slow-rank1"])
    trainer.fit(model, ckpt_path=option.get("--resume"))
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "steps": model.steps,
        "weights": [p.detach().tolist() for p in model.net.parameters()],
        "stats": getattr(controller, "seen_stats", None),  # what rank 0's controller saw (--noise)
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        finish()  # barrier, destroy the group, exit without finalising (see _dist_helpers.finish)


if __name__ == "__main__":
    main()
