"""Run AdaptiveBatchSizeTrainer under torchrun (gloo on CPU) and write what each rank did.

    torchrun --standalone --nproc-per-node 2 [--max-restarts 1] tests/_hf_ddp.py OUT_DIR [--workers N]
        [--save-steps K] [--fail-at-step S] [--noise] [--compile] [--max-micro N] [--oom-recovery]
        [--rank-weights W0,W1|auto] [--slow-rank1 SECONDS] [--sizes S,S,...] [--samples N]

Writes OUT_DIR/rank<r>.json: per step of this attempt the global size and this rank's sample ids (ghost
micro-batches excluded), and the final weights. ``--fail-at-step S`` makes rank 1 exit after step S of the
first attempt; every attempt resumes from the newest checkpoint in OUT_DIR/ckpt if there is one.
``--noise`` measures the noise scale on every step and also writes each forward's sample ids and what rank
0's controller saw. ``--compile`` trains a ``torch.compile``d model (TrainingArguments' torch_compile,
backend aot_eager); ``--max-micro N`` passes ``max_micro_batch_size=N``; ``--oom-recovery`` passes
``oom_recovery=True`` (refused with more than one process). ``--rank-weights`` passes ``rank_weights``;
``--slow-rank1 S`` makes rank 1's training forward sleep S seconds per sample (a slower node, for "auto");
``--sizes`` and ``--samples`` replace the size list and the dataset size.
Set BATCHPILOT_INIT_TORCHRUN=1 to create the process group with batchpilot's init_torchrun (safe across
torchrun restarts with gloo) before accelerate. Used by tests/integrations/test_hf_distributed.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dist_helpers import finish
from _hf_common import PointSet, Recorder, SizeList, StatsSpy
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

# Sizes include 1 (smaller than world size x accumulation: ghost micro-batches) and an epoch tail of 1.
SIZES = [3, 7, 1, 12, 5, 9, 2, 20, 4, 11]
NUM_SAMPLES = 61
# --noise: every step measured; sizes that are multiples of world size x accumulation (no ghosts), 64 samples.
NOISE_SIZES, NOISE_SAMPLES = [8, 12, 4, 16], 64


class SlowRecorder(Recorder):
    """A Recorder whose training forward takes ``seconds`` more per sample (rank 1 of a slow cluster)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x, labels=None, sample_id=None):
        if self.training and sample_id is not None:
            time.sleep(self.seconds * len(sample_id))
        return super().forward(x, labels, sample_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fail-at-step", type=int, default=None)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--noise", action="store_true", help="measure the noise scale on every step")
    parser.add_argument("--compile", action="store_true", help="torch_compile=True (backend aot_eager)")
    parser.add_argument("--max-micro", type=int, default=None, help="max_micro_batch_size")
    parser.add_argument("--oom-recovery", action="store_true", help="oom_recovery=True")
    parser.add_argument("--rank-weights", default=None, help="rank_weights: 'auto' or comma-separated weights")
    parser.add_argument("--slow-rank1", type=float, default=0.0, help="rank 1's extra forward seconds per sample")
    parser.add_argument("--sizes", default=None, help="comma-separated global sizes (the SizeList)")
    parser.add_argument("--samples", type=int, default=NUM_SAMPLES)
    opts = parser.parse_args()
    weights = opts.rank_weights
    if weights is not None and weights != "auto":
        weights = [float(w) for w in weights.split(",")]
    sizes = SIZES if opts.sizes is None else [int(s) for s in opts.sizes.split(",")]
    if os.environ.get("BATCHPILOT_INIT_TORCHRUN"):
        from batchpilot.distributed import init_torchrun

        init_torchrun("gloo")  # accelerate then uses this process group
    slow = opts.slow_rank1 and os.environ.get("RANK") == "1"
    model = SlowRecorder(opts.slow_rank1) if slow else Recorder()
    args = TrainingArguments(
        output_dir=str(Path(opts.out) / "ckpt"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=opts.epochs, use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1000,
        save_strategy="steps" if opts.save_steps else "no", save_steps=opts.save_steps or 500,
        dataloader_num_workers=opts.workers, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, seed=3, ddp_find_unused_parameters=False,
        **(dict(torch_compile=True, torch_compile_backend="aot_eager") if opts.compile else {}),
    )
    if opts.noise:
        controller = StatsSpy(NOISE_SIZES)
        trainer = AdaptiveBatchSizeTrainer(batch_size_scheduler=controller, model=model, args=args, noise_every=1,
                                           train_dataset=PointSet(NOISE_SAMPLES), max_micro_batch_size=opts.max_micro,
                                           rank_weights=weights)
    else:
        controller = SizeList(sizes)
        trainer = AdaptiveBatchSizeTrainer(batch_size_scheduler=controller, model=model, args=args,
                                           train_dataset=PointSet(opts.samples), max_micro_batch_size=opts.max_micro,
                                           oom_recovery=opts.oom_recovery, rank_weights=weights)
    steps: list[dict] = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            s = trainer.batchpilot.last_step
            steps.append({"step": state.global_step, "size": s.global_size, "ids": s.indices.tolist(),
                          "ghosts": s.ghosts, "epoch": s.epoch, "rank_weights": trainer.batchpilot.rank_weights})
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if state.global_step == opts.fail_at_step and args.process_index == 1 and first_attempt:
                os._exit(1)  # a crash, not an exception: no cleanup, no final checkpoint

    trainer.add_callback(Record())
    ckpt = Path(args.output_dir)
    resume = get_last_checkpoint(str(ckpt)) if ckpt.is_dir() else None
    trainer.train(resume_from_checkpoint=resume)
    rank = trainer.args.process_index
    out = {
        "rank": rank,
        "world_size": trainer.args.world_size,
        "steps": steps,
        "weights": [p.detach().tolist() for p in model.parameters()],
        "global_step": trainer.state.global_step,
        "resumed_from": resume,
        "micro": model.seen,  # sample ids of every training forward (micro-batch), in order
        "stats": getattr(controller, "seen_stats", None),  # what rank 0's controller saw (--noise)
        "wrapped": type(trainer.model_wrapped).__name__,
    }
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    Path(opts.out, f"rank{rank}.json").write_text(json.dumps(out))
    finish()  # barrier, destroy the group, exit without finalising (see _dist_helpers.finish)


if __name__ == "__main__":
    main()
