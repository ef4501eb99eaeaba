"""In-memory snapshots of a `Pilot`: the whole training state at a step boundary, to go back to later.

The rollback guard (:mod:`.guard`) takes one before the first step at a size a controller changed to; the automatic
mode's start probes (:mod:`.probes`) take one before probing. A snapshot is a :meth:`Pilot.state_dict` (model,
optimizer, LR rules, data position, controller, statistics, counters, every rank's RNG states) copied deeply, so
training on does not change it, with the log position left out: restoring goes back in training, never in the log,
which keeps the lines of the steps it discards.

The copy lives where the state lives (a GPU model's weights stay on the GPU): a snapshot costs one copy of the
model and optimizer state in memory, and a :func:`copy.deepcopy` of it in time.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["restore_snapshot", "take_snapshot"]


def take_snapshot(pilot: Any) -> dict[str, Any]:
    """A deep copy of ``pilot.state_dict()`` with ``"log_position"`` set to ``None``.

    Call it between steps. Under DDP every rank must call it at the same point (the RNG states are gathered).
    """
    snap = copy.deepcopy(pilot.state_dict())
    snap["log_position"] = None  # restoring must never truncate the JSONL log
    return snap


def restore_snapshot(pilot: Any, snap: dict[str, Any]) -> None:
    """Load a :func:`take_snapshot` back into ``pilot`` (a deep copy of it: the snapshot stays usable).

    Call it between steps. Under DDP every rank must call it at the same point, with its own snapshot.
    """
    pilot.load_state_dict(copy.deepcopy(snap))
