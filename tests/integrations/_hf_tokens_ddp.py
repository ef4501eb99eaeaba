"""AdaptiveBatchSizeTrainer(batch_unit="tokens") under torchrun (gloo on CPU): writes what each rank did.

    torchrun --standalone --nproc-per-node 2 tests/integrations/_hf_tokens_ddp.py OUT_DIR [W0,W1 | auto]

OUT_DIR/rank<r>.json: per step the global size and tokens, this rank's sample ids and tokens, and the final
weights. Budgets include 3 tokens (a step of one sample: rank 1 then runs ghost micro-batches); ``W0,W1`` (or
``auto``) passes ``rank_weights``. Used by tests/integrations/test_hf_tokens_distributed.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from _dist_helpers import finish  # noqa: E402
from _hf_common import SizeList  # noqa: E402
from _hf_tokens_common import Sequences, TokenNet, pad  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer  # noqa: E402

BUDGETS = [30, 55, 3, 80, 12, 41]


def main(out: Path, rank_weights: list[float] | str | None) -> None:
    args = TrainingArguments(output_dir=str(out / "run"), use_cpu=True, report_to=[], disable_tqdm=True,
                             save_strategy="no", seed=0, num_train_epochs=2, gradient_accumulation_steps=2,
                             learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                             max_grad_norm=0.0, remove_unused_columns=False, logging_steps=1000)
    net = TokenNet()
    trainer = AdaptiveBatchSizeTrainer(batch_size_scheduler=SizeList(BUDGETS), model=net, train_dataset=Sequences(),
                                       data_collator=pad, batch_size=20, batch_unit="tokens", lengths="lengths",
                                       max_micro_batch_tokens=12, rank_weights=rank_weights, args=args)
    steps: list[dict] = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            s = trainer.batchpilot.last_step
            steps.append({"size": s.global_size, "tokens": s.global_tokens, "local_tokens": s.local_tokens,
                          "ids": s.indices.tolist(), "epoch": s.epoch, "ghosts": s.ghosts})

    trainer.add_callback(Record())
    trainer.train()
    rank = args.process_index
    result = {"world_size": args.world_size, "steps": steps, "tokens_seen": trainer.batchpilot.tokens_seen,
              "weights": [p.detach().tolist() for p in net.parameters()]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    finish()


if __name__ == "__main__":
    weights = sys.argv[2] if len(sys.argv) > 2 else None
    main(Path(sys.argv[1]), weights if weights in (None, "auto") else [float(w) for w in weights.split(",")])
