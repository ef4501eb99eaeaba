"""Step-time cost of token budgets in the Hugging Face trainer: the same global batches counted in samples and in
tokens.

Every sample has the same number of tokens (12), so a budget of ``16 x 12`` tokens cuts exactly the batches of 16
samples: the difference between the two runs is the token planning (cumulative sums per epoch, token shares and
micro-batches, token weights), nothing else. A tiny BERT, 2 micro-batches per step, ``max_steps`` steps; runs are
interleaved and repeated, and the table shows the median wall time and the median CPU time of this process
(``time.process_time``: one thread, no workers, so it is the work done, and survives a busy machine better than wall
time) of ``trainer.train()`` per mode; the overhead is computed on both.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/hf_token_overhead.py --out bench-out/hf-tokens
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/hf_token_overhead.py --quick --out /tmp/hf-tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

LENGTH, SAMPLES_PER_STEP = 12, 16


class Reviews(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(4, 30, (n, LENGTH), generator=g)
        self.labels = (self.ids[:, 1] > 16).long()
        self.lengths = [LENGTH] * n

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def collate(samples: list[dict]) -> dict:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def one_run(unit: str, steps: int, out: str) -> tuple[float, float, list[int]]:
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=2))
    tokens = dict(batch_unit="tokens", lengths="lengths", batch_size=SAMPLES_PER_STEP * LENGTH) if unit == "tokens" \
        else {}
    trainer = AdaptiveBatchSizeTrainer(
        model=model, train_dataset=Reviews(4096), data_collator=collate,
        args=TrainingArguments(output_dir=out, per_device_train_batch_size=SAMPLES_PER_STEP // 2,
                               gradient_accumulation_steps=2, max_steps=steps, report_to="none", use_cpu=True,
                               save_strategy="no", disable_tqdm=True, logging_steps=10_000,
                               remove_unused_columns=False),
        **tokens,
    )
    sizes: list[int] = []
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    sizes.append(trainer.batchpilot.last_step.global_size)
    return seconds, cpu, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="40 steps, 3 repeats (< 60 s)")
    args = parser.parse_args()
    steps, repeats = (40, 3) if args.quick else (args.steps, args.repeats)
    times: dict[str, list[float]] = {"samples": [], "tokens": []}
    cpu: dict[str, list[float]] = {"samples": [], "tokens": []}
    with tempfile.TemporaryDirectory() as tmp:
        one_run("samples", 5, tmp)  # warm-up: imports, first allocations
        for _ in range(repeats):
            for unit in times:  # interleaved, so that a busy moment hits both modes
                seconds, cpu_s, sizes = one_run(unit, steps, tmp)
                assert sizes == [SAMPLES_PER_STEP], sizes  # the same global batches in both modes
                times[unit].append(seconds)
                cpu[unit].append(cpu_s)
    median = {unit: statistics.median(t) for unit, t in times.items()}
    median_cpu = {unit: statistics.median(t) for unit, t in cpu.items()}
    result = {"steps": steps, "repeats": repeats, "samples_per_step": SAMPLES_PER_STEP, "tokens_per_sample": LENGTH,
              "seconds": times, "cpu_seconds": cpu, "median_s": median, "median_cpu_s": median_cpu,
              "overhead": median["tokens"] / median["samples"] - 1,
              "cpu_overhead": median_cpu["tokens"] / median_cpu["samples"] - 1,
              "torch_threads": torch.get_num_threads()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_token_overhead.json").write_text(json.dumps(result, indent=2))
    print(f"{'unit':<8} {'wall s':>8} {'CPU s':>8} {'CPU ms/step':>12}")
    for unit, m in median.items():
        print(f"{unit:<8} {m:>8.3f} {median_cpu[unit]:>8.3f} {1000 * median_cpu[unit] / steps:>12.2f}")
    print(f"token planning overhead: wall {100 * result['overhead']:+.1f}%, CPU {100 * result['cpu_overhead']:+.1f}% "
          f"({steps} steps, median of {repeats})")


if __name__ == "__main__":
    main()
