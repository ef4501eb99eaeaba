"""Does the LR range test's LR grow with the batch? (A benchmark, not a test.)

McCandlish et al. 2018 predict the best LR ``lr_opt(B) = lr_max / (1 + B_noise / B)``: if the range test followed it,
the ratio of its LRs at two sizes would give ``B_noise`` and with it a start size that weighs epochs, not only
throughput. This runs the automatic mode's range test (``Auto(min_size=K, max_size=K)``: the sweep is one size)
from the same initial weights at each ``--sizes`` and prints the LR it picks (``lr``: ``lr_fraction`` x the valley
centre) and the LR at the smoothed loss's minimum. Measured on dev seed 0 (docs/auto.md): the LRs do not move
with the batch; the range test finds the curvature edge, which does not depend on it.

    python benchmarks/range_test_by_size.py --workload mnist1d --seed 0 --sizes 128,256,512,1024,2048
"""

from __future__ import annotations

import argparse
import json

import torch

from batchpilot import Pilot
from batchpilot.bench.workloads import get_workload
from batchpilot.controllers import Auto


def range_test_lr(workload_name: str, seed: int, size: int) -> tuple[float, float]:
    """``(the LR the range test picks, the LR at its loss minimum)`` at ``size`` from seed ``seed``'s weights."""
    workload = get_workload(workload_name)
    train, _ = workload.build_data(workload.data_seed)
    torch.manual_seed(seed)
    model = workload.build_model(seed)
    optimizer = workload.make_optimizer(model.parameters(), workload.base_lr)
    pilot = Pilot(model, optimizer, train, batch_size="auto", controller=Auto(min_size=size, max_size=size), seed=seed)
    batches = pilot.batches(epochs=1)
    try:
        for x, y in batches:
            if pilot.controller.probe is not None:  # the probes are done: the first training step would follow
                break
            pilot.backward(workload.loss_fn(model(x), y))
    finally:
        batches.close()
        pilot.close()
    probe = pilot.controller.probe
    if probe is None or probe.lr is None or probe.lr_at_min is None:
        raise RuntimeError(f"the range test at {size} did not finish (dataset too small for one probe epoch?)")
    return probe.lr, probe.lr_at_min


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mnist1d")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", default="128,256,512,1024,2048")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = {}
    for size in (int(s) for s in args.sizes.split(",")):
        lr, at_min = range_test_lr(args.workload, args.seed, size)
        rows[size] = {"lr": lr, "lr_at_min": at_min}
        print(f"{args.workload} seed {args.seed} batch {size:5d}: lr {lr:.4g}  lr at the loss minimum {at_min:.4g}",
              flush=True)
    print(json.dumps({"workload": args.workload, "seed": args.seed, "sizes": rows}))


if __name__ == "__main__":
    main()
