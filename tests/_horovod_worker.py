"""Train with batchpilot.integrations.horovod under horovodrun (gloo) and write what each rank did.

    horovodrun --gloo -np 2 -H localhost:2 python tests/_horovod_worker.py OUT_DIR [--rank-weights W0,W1]
        [--max-steps N] [--save PATH] [--resume PATH] [--sum]

Writes OUT_DIR/rank<r>.json: per step its global size, this rank's sample ids (ghosts excluded) and micro-batches,
and the final weights. ``--save`` writes the model, optimizer and HorovodSteps state (rank 0) after the run;
``--resume`` starts from such a file. Used by tests/integrations/test_horovod.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import horovod.torch as hvd
import torch
from _hf_common import PointSet, Recorder, SizeList

from batchpilot.integrations.horovod import HorovodSteps

SIZES = [3, 7, 1, 12, 5, 9, 2, 20, 4, 11]  # 1 and 2 leave a rank a ghost micro-batch with weights 1:3
NUM_SAMPLES = 61


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--rank-weights", default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--save", type=Path, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--sum", action="store_true", help="the DistributedOptimizer sums (op=hvd.Sum)")
    opts = parser.parse_args()
    hvd.init()
    weights = None if opts.rank_weights is None else [float(w) for w in opts.rank_weights.split(",")]
    model = Recorder()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         op=hvd.Sum if opts.sum else hvd.Average)
    steps = HorovodSteps(optimizer, PointSet(NUM_SAMPLES), batch_size=4, controller=SizeList(SIZES),
                         max_micro_batch_size=3, rank_weights=weights, seed=3)
    if opts.resume is not None:
        saved = torch.load(opts.resume, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        steps.load_state_dict(saved["steps"])
        steps.driver.controller.load_state_dict(saved["controller"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    record: list[dict] = []
    for micro in steps.batches(epochs=2, max_steps=opts.max_steps):
        if micro.micro_index == 0:
            record.append({"step": steps.step + 1, "size": micro.global_size, "ids": [], "micro": []})
        if not micro.ghost:
            record[-1]["ids"].extend(micro.indices.tolist())
        record[-1]["micro"].append(micro.size)
        steps.weight(model(**micro.data)["loss"]).backward()
        if micro.is_last:
            optimizer.step()
            optimizer.zero_grad()
            steps.end_step()
    if opts.save is not None and hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "steps": steps.state_dict(),
                    "controller": steps.driver.controller.state_dict()}, opts.save)
    opts.out.mkdir(parents=True, exist_ok=True)
    result = {"steps": record, "weights": [p.detach().tolist() for p in model.parameters()],
              "samples_seen": steps.samples_seen}
    (opts.out / f"rank{hvd.rank()}.json").write_text(json.dumps(result))
    hvd.shutdown()


if __name__ == "__main__":
    main()
