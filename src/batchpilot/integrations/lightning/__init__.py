"""`AdaptiveBatchSize`: a Lightning callback whose controller sets the global batch size of every step.

::

    adaptive = AdaptiveBatchSize(LinearIncrease(start=32, increment=32, interval=100, max_size=512), batch_size=32)

    class Model(lightning.LightningModule):
        def train_dataloader(self):
            return adaptive.dataloader(train_set, num_workers=2)        # resumable, exact coverage
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss, batch_size=adaptive.local_batch_size)
            return adaptive.weight(loss)          # optional: the exact global-batch mean gradient

    lightning.Trainer(max_epochs=5, callbacks=[adaptive]).fit(Model())

Sizes are global (samples per optimizer step over all ranks); each rank gets its contiguous share, split
into ``accumulate_grad_batches`` micro-batches. Rank 0 decides after every optimizer step, every rank
applies the broadcast value, and the next step has exactly that size (the loader reports a length, an
upper bound of the epoch's batches, so Lightning does not read a batch ahead; the callback marks the
epoch's real last batch). The loader has ``state_dict``/``load_state_dict``, so a mid-epoch checkpoint
resumes with the same remaining samples and sizes; the controller is saved as the callback's state. A
checkpoint saved inside a step resumes from that step's first micro-batch, and one saved at the end of an
epoch that Lightning cut short (``max_steps``, a stop) resumes inside that epoch. Checkpoints also carry every
rank's generator states, which Lightning does not save, so dropout draws resume exactly too.

The modules: callback.py (the callback and its hooks), loader.py (the loader it hands out), step.py (a step's
end: loss, logs, the epoch's last batch), checks.py (trainer settings refused) and checkpoint.py (loop counters
and generator states in a checkpoint).
"""

from __future__ import annotations

from .._require import require

require("lightning", "lightning", what="batchpilot.integrations.lightning")

from .callback import AdaptiveBatchSize
from .loader import AdaptiveLoader

__all__ = ["AdaptiveBatchSize", "AdaptiveLoader"]
