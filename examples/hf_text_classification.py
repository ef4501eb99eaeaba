"""Seed 003's flow end to end: a Hugging Face ``Trainer`` whose batch size grows while it trains.

    python examples/hf_text_classification.py --epochs 3
    torchrun --standalone --nproc-per-node 2 examples/hf_text_classification.py --epochs 3

A tiny BERT (built from a config: nothing is downloaded) learns a generated sentiment task: short
sentences over a 24-word vocabulary, positive when their two opinion words are positive. The batch size
follows seed 003's ``linear_increase_scheduler``: +``--increment`` samples every ``--interval`` steps, up
to ``--max-size`` (sizes are global: samples per optimizer step over all ranks). Training stops after
exactly ``--epochs`` passes over the data; logs carry ``train_coverage`` and a coverage-based ``epoch``.
``--resume`` continues from the newest checkpoint in ``--output-dir`` with the same samples and sizes.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from batchpilot.controllers import linear_increase_scheduler
from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

# A hand-built vocabulary: ids 0-3 special, 4-7 positive, 8-11 negative, the rest neutral.
VOCAB = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "good", "great", "fine", "nice", "bad", "awful", "poor", "sad",
         "the", "a", "movie", "film", "was", "is", "very", "plot", "acting", "story", "quite", "really"]
TOKEN_ID = {word: i for i, word in enumerate(VOCAB)}


def tokenize(text: str, length: int) -> tuple[list[int], list[int]]:
    """Whitespace tokenizer over VOCAB: [CLS] words [SEP], padded to ``length``; returns (ids, mask)."""
    ids = [TOKEN_ID["[CLS]"]] + [TOKEN_ID.get(w, TOKEN_ID["[UNK]"]) for w in text.split()][: length - 2]
    ids.append(TOKEN_ID["[SEP]"])
    mask = [1] * len(ids) + [0] * (length - len(ids))
    return ids + [TOKEN_ID["[PAD]"]] * (length - len(ids)), mask


class GeneratedReviews(Dataset):
    """``n`` generated one-line reviews with labels, tokenized once (1 = positive)."""

    def __init__(self, n: int, seed: int, length: int = 14) -> None:
        g = torch.Generator().manual_seed(seed)
        neutral, positive, negative = VOCAB[12:], VOCAB[4:8], VOCAB[8:12]
        self.texts, self.items = [], []
        for _ in range(n):
            words = [neutral[int(i)] for i in torch.randint(len(neutral), (int(torch.randint(4, length - 2, ())),), generator=g)]
            label = int(torch.randint(2, (), generator=g))
            pool = positive if label else negative
            for slot in torch.randperm(len(words), generator=g)[:2].tolist():
                words[slot] = pool[int(torch.randint(len(pool), (), generator=g))]
            text = " ".join(words)
            ids, mask = tokenize(text, length)
            self.texts.append(text)
            self.items.append({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": label})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def collate_fn(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack the pre-tokenized samples into a batch."""
    return {
        "input_ids": torch.stack([s["input_ids"] for s in samples]),
        "attention_mask": torch.stack([s["attention_mask"] for s in samples]),
        "labels": torch.tensor([s["labels"] for s in samples]),
    }


def accuracy(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/hf_text_classification")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--train-samples", type=int, default=2000)
    parser.add_argument("--eval-samples", type=int, default=400)
    parser.add_argument("--per-device-batch-size", type=int, default=4, help="first step's per-device size")
    parser.add_argument("--interval", type=int, default=50)
    parser.add_argument("--increment", type=int, default=4)
    parser.add_argument("--max-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--report-to", default="none", help="e.g. tensorboard")
    opts = parser.parse_args()

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config)
    train_dataset, eval_dataset = GeneratedReviews(opts.train_samples, seed=1), GeneratedReviews(opts.eval_samples, seed=2)

    batch_scheduler = partial(linear_increase_scheduler, interval=opts.interval, max_size=opts.max_size,
                              increment=opts.increment)
    training_args = TrainingArguments(
        output_dir=opts.output_dir,
        per_device_train_batch_size=opts.per_device_batch_size,  # initial batch size
        num_train_epochs=opts.epochs,
        max_steps=-1,  # training length comes from data coverage
        dataloader_drop_last=False,
        dataloader_num_workers=opts.workers,
        learning_rate=3e-3,
        warmup_steps=10,
        eval_strategy="epoch",
        logging_steps=max(1, opts.interval // 2),
        save_strategy="steps" if opts.save_steps else "no",
        save_steps=opts.save_steps or 500,
        report_to=opts.report_to,
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=batch_scheduler,
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=collate_fn,
        compute_metrics=accuracy,
    )
    result = trainer.train(resume_from_checkpoint=True if opts.resume else None)
    metrics = trainer.evaluate()
    run = trainer.batchpilot
    summary = {
        "steps": result.global_step,
        "samples_seen": run.samples_seen,
        "epochs": run.virtual_epoch,
        "final_batch_size": run.last_step.global_size,
        "eval_accuracy": metrics["eval_accuracy"],
    }
    if trainer.is_world_process_zero():
        Path(opts.output_dir).mkdir(parents=True, exist_ok=True)
        Path(opts.output_dir, "summary.json").write_text(json.dumps(summary))
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
