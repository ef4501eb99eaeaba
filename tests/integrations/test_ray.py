"""examples/ray_train.py on a local Ray cluster (2 CPUs): Ray Train's TorchTrainer with 2 workers and the Pilot.

One Ray session runs three fits: an uninterrupted one, and the same run in two fits: the first stops at a
reported checkpoint after Ray restarted its worker group (a worker failed), the second continues from that
checkpoint (``ray.train.get_checkpoint``). Both must train the same samples with the same sizes into the same
weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

import batchpilot  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ray_train.py"
SAMPLES = 512


def _example():
    spec = importlib.util.spec_from_file_location("ray_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ray_train"] = module  # Ray's workers import it by name: see PYTHONPATH below
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    # The workers are processes started by the local Ray cluster; they inherit this environment.
    paths = [str(REPO / "examples"), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]
    settings = {"PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1",
                # Ray Train's controller polls its workers every 2 s by default: each fit would end up to 2 s late.
                "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
                # Starting the workers (torch imports) can take over the default 60 s on a busy 2-core machine.
                "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300"}
    saved = {k: os.environ.get(k) for k in [*settings, "RAY_TRAIN_V2_ENABLED"]}
    os.environ.update(settings)
    os.environ.pop("RAY_TRAIN_V2_ENABLED", None)  # the example uses Train V2 (the default since Ray 2.51)
    # ray.init installs a SIGTERM handler in this (the driver's) process that calls sys.exit; later tests that
    # send themselves SIGTERM (save_on_sigterm) must find the handler they found before.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield _example()
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _trace(folder: Path) -> dict[int, list[dict]]:
    return {r: [json.loads(line) for line in (folder / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}


def _weights(result) -> dict[str, torch.Tensor]:
    files = sorted(Path(result.checkpoint.path).glob("step-*.pt"))
    assert len(files) == 1, files
    return batchpilot.read_checkpoint(files[0])["model"]


@pytest.mark.slow
@pytest.mark.distributed
def test_ray_train_resumes_from_its_reported_checkpoints_exactly(example, tmp_path):
    storage = tmp_path / "storage"
    traces = {name: tmp_path / name for name in ("clean", "continued")}
    for folder in traces.values():
        folder.mkdir()

    clean = example.fit(storage, "clean", 40, trace=traces["clean"])
    # Rank 1 raises after step 15: Ray restarts the worker group, which resumes from the step-10 checkpoint.
    first = example.fit(storage, "continued", 20, max_failures=1, fail_at_step=15, trace=traces["continued"])
    second = example.fit(storage, "continued", 40, trace=traces["continued"])  # same name: continues at 20

    assert (storage / "continued" / "starts-rank1").read_text() == "2"  # Ray did restart the first fit's workers
    assert first.metrics["step"] == 20 and second.metrics["step"] == 40 and clean.metrics["step"] == 40
    clean_trace, continued_trace = _trace(traces["clean"]), _trace(traces["continued"])
    # The interrupted run trained what the clean run trained, in the same steps at the same sizes.
    assert [m["step"] for m in continued_trace[0]] == [m["step"] for m in clean_trace[0]]
    assert continued_trace == clean_trace
    sizes = [m["size"] for m in clean_trace[0] if m["micro_index"] == 0]
    assert sizes == [16] * 8 + [32] * 8 + [64] * 8 + [128] * 16, sizes  # doubling every 8 steps, up to 128
    # Coverage: each complete epoch saw every sample exactly once over both ranks (shares cut by the Pilot).
    per_epoch: dict[int, list[int]] = {}
    for rank in (0, 1):
        for micro in clean_trace[rank]:
            if not micro["ghost"]:
                per_epoch.setdefault(micro["epoch"], []).extend(micro["indices"])
    complete = [e for e in per_epoch if e < max(per_epoch)]
    assert len(complete) == 5
    for epoch in complete:
        assert sorted(per_epoch[epoch]) == list(range(SAMPLES)), epoch
    # The same weights, bit for bit.
    reference, weights = _weights(clean), _weights(second)
    assert weights.keys() == reference.keys()
    for key in reference:
        assert torch.equal(weights[key], reference[key]), key
