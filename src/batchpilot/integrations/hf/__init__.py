"""`AdaptiveBatchSizeTrainer`: a ``transformers.Trainer`` whose global batch size changes while it trains.

Seed 003's API, done exactly::

    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=partial(linear_increase_scheduler, interval=50, max_size=64, increment=4),
        model=model, args=TrainingArguments(..., per_device_train_batch_size=4, num_train_epochs=3),
        train_dataset=train_set, eval_dataset=eval_set, data_collator=collate_fn,
    )
    trainer.train()

Sizes are *global*: samples per optimizer step over all ranks. The first step has
``per_device_train_batch_size * world_size * gradient_accumulation_steps`` samples; after every step rank 0
asks the scheduler (or any batchpilot controller) for the next size and every rank applies the broadcast
value. Each rank runs exactly ``gradient_accumulation_steps`` micro-batches per step, so the per-device
micro-batch is ``global_batch_size / (world_size * gradient_accumulation_steps)`` (shares differ by at most one
sample).

How it fits the Trainer (transformers 5.x, accelerate 1.x), and where each part lives:

- Data (``data.py``): a :class:`~batchpilot.AdaptiveDataLoader` (exact coverage; size changes rewind whatever
  workers and accelerate's one-batch look-ahead prefetched) fetches through ``accelerator.prepare``'s
  DataLoader, whose ``BatchSamplerShard`` is made a pass-through (our sampler already hands each rank its share).
- Loop length (``data.py``): ``len()`` is an upper bound; an epoch ends when the sampler has covered the data,
  and training ends after ``num_train_epochs`` passes (or ``max_steps`` steps).
- Loss (``step.py``): each micro-batch's mean loss is weighted by its share of the global batch, so the step's
  gradient is the mean over the B samples whatever the split.
- Memory (``step.py``): with ``max_micro_batch_size`` a micro-batch with more rows runs as several
  forward/backward passes inside ``training_step`` (all but the last under DDP's ``no_sync``), each weighted by
  its rows; ``oom_recovery`` runs a step that ran out of memory again with smaller passes.
- LR (``schedule.py``): with ``max_steps=-1`` the schedule runs on samples (``num_train_epochs *
  len(train_dataset)`` long, ``warmup_steps`` counted in first-step batches); optional LR coupling
  ``lr_rule="sqrt"`` etc. (kept by :class:`HFRun`, ``run.py``).
- Logs (``callbacks.py``): ``train_coverage``, a coverage-based ``epoch``, ``batch_size`` and ``samples_seen``.
- Resume (``state.py``): ``batchpilot_state.json`` in each checkpoint folder; ``ignore_data_skip`` is forced on.

``trainer.py`` holds the Trainer subclass, whose overrides delegate to these; ``checks.py`` the settings it
refuses.
"""

from __future__ import annotations

from ..._extras import install_hint
from .._require import require

transformers = require("transformers", "hf", what="batchpilot.integrations.hf")
require("accelerate", "hf", what="batchpilot.integrations.hf")

import torch

if tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
    raise ImportError(  # transformers 5 disables PyTorch below 2.6 (Trainer becomes a placeholder)
        f"batchpilot.integrations.hf needs torch >= 2.6 (transformers 5 requires it); this is torch "
        f"{torch.__version__}. Upgrade torch, or use Pilot, which works with torch >= 2.3."
    )
if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(  # the trainer overrides Trainer internals of transformers 5 (get_batch_samples, ...)
        f"batchpilot.integrations.hf needs transformers >= 5.0, < 6; this is transformers {transformers.__version__}. "
        f"Upgrade it with: {install_hint('hf')}"
    )

from .run import HFRun, StepRecord
from .trainer import AdaptiveBatchSizeTrainer

__all__ = ["AdaptiveBatchSizeTrainer", "HFRun", "StepRecord"]
