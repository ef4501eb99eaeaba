"""The runs tests/engine/test_rollback.py compares: a controller that grows once, a step that fails at the grown
size, the 2-rank gloo worker, and (run as a script) a run that checkpoints every step and can SIGKILL itself."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _engine_helpers import make_problem  # noqa: E402

import batchpilot  # noqa: E402

N = 96  # samples
SIZE, GROWN = 8, 16  # the first size, and the one the controller grows to


class GrowOnce:
    """Asks for ``to`` from step ``at`` on (an adaptive controller: the rollback guard watches it by default)."""

    adaptive = True

    def __init__(self, at: int, to: int) -> None:
        self.at, self.to = at, to
        self.told: list[tuple[int, int, int]] = []  # the on_rollback calls

    def decide(self, obs: batchpilot.Observation) -> int:
        return self.to if obs.step >= self.at else obs.batch_size

    def on_rollback(self, from_size: int, to_size: int, step: int) -> None:
        self.told.append((from_size, to_size, step))

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = state["at"]


def build(grow_at: int, *, cooldown: int = 1000, **settings: Any):
    data, model = make_problem(n=N)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    controller = GrowOnce(grow_at, GROWN)
    pilot = batchpilot.Pilot(model, opt, data, batch_size=SIZE, controller=controller, seed=1,
                             rollback_cooldown=cooldown, **settings)
    return pilot, model, controller


def train(pilot, model, steps: int, *, fail_from: int | None, kill_at: int | None = None,
          trained: dict[int, Any] | None = None) -> dict[int, Any]:
    """Train to ``steps`` steps; a step at the grown size whose ``pilot.step`` (steps before it) is ``>= fail_from``
    gets a NaN loss. Return ``{step: (size, epoch, sorted local indices)}`` of the steps kept (a step that is
    rolled back is overwritten when its number is trained again)."""
    trained = {} if trained is None else trained
    if kill_at is not None:
        pilot.add_callback(lambda p, record: p.step == kill_at and os.kill(os.getpid(), signal.SIGKILL))
    current: list[int] = []
    for x, y in pilot.batches(max_steps=steps):
        m = pilot.micro_batch
        if m.micro_index == 0:
            current = []
        current.extend(m.indices.tolist())
        loss = torch.nn.functional.cross_entropy(model(x), y) if len(y) else model(x).sum() * 0.0
        if fail_from is not None and m.global_size == GROWN and pilot.step >= fail_from:
            loss = loss * float("nan")
        if m.is_last:
            trained[pilot.step + 1] = (m.global_size, m.epoch, sorted(current))
        pilot.backward(loss)
    return trained


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    module = model.module if hasattr(model, "module") else model
    return [p.detach().clone() for p in module.parameters()]


def gloo_worker(rank: int, world_size: int, init_file: str, out_dir: str, steps: int) -> None:
    """Both ranks train the failing run; write the kept steps, weights and rollbacks."""
    import torch.distributed as dist
    from _dist_helpers import finish

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        pilot, model, controller = build(5)
        kept = train(pilot, model, steps, fail_from=7)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
            "kept": {str(k): v for k, v in kept.items()}, "weights": [w.tolist() for w in weights(model)],
            "rollbacks": pilot.rollbacks, "told": controller.told, "size": pilot.batch_size}))
    except BaseException:
        dist.destroy_process_group()
        raise
    finish()


def script(out: Path, steps: int, kill_at: int | None) -> None:
    """Train with a checkpoint after every step, resuming from the newest one if there is one."""
    torch.use_deterministic_algorithms(True)
    pilot, model, _ = build(5, checkpoint_dir=out / "ckpt", checkpoint_every=1, log_path=out / "log.jsonl")
    resumed = pilot.load_checkpoint(out / "ckpt", missing_ok=True)
    kept = train(pilot, model, steps, fail_from=8, kill_at=None if resumed else kill_at)
    name = "resumed.json" if resumed else "run.json"
    (out / name).write_text(json.dumps({"kept": {str(k): v for k, v in kept.items()}, "rollbacks": pilot.rollbacks,
                                        "weights": [w.tolist() for w in weights(model)]}))
    pilot.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    script(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
