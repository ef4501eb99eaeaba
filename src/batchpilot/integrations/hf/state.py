"""batchpilot's part of a Trainer checkpoint folder (``batchpilot_state.json``) and where a resume reads it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

STATE_FILE = "batchpilot_state.json"
_FORMAT = "batchpilot.integrations.hf"
_VERSION = 1


def checkpoint_folder(output_dir: str, global_step: int) -> str:
    """The folder Trainer saves step ``global_step`` to."""
    return os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")


def resolve_resume(resume_from_checkpoint: Any, output_dir: str) -> Any:
    """``train(resume_from_checkpoint=...)`` as Trainer takes it: a path as ``str`` (``True``: the last checkpoint
    in ``output_dir``; a ``Path`` too, since our state must come along), or ``None`` for no resume.

    Raises:
        ValueError: ``True`` and ``output_dir`` holds no checkpoint.
    """
    if isinstance(resume_from_checkpoint, os.PathLike):
        resume_from_checkpoint = os.fspath(resume_from_checkpoint)
    if resume_from_checkpoint is True:
        resume_from_checkpoint = get_last_checkpoint(output_dir)
        if resume_from_checkpoint is None:
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
    return resume_from_checkpoint or None  # False, None and "" mean no resume


def write_state(folder: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write batchpilot's state into a checkpoint folder atomically (temporary file, then rename)."""
    path = Path(folder) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": _FORMAT, "version": _VERSION, **state}
    tmp = path.with_name(f".{STATE_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_state(folder: str | os.PathLike) -> dict[str, Any]:
    """Read what :func:`write_state` wrote.

    Raises:
        FileNotFoundError: the folder has no batchpilot state (a checkpoint of another trainer).
        ValueError: the file is truncated or corrupt, or not a batchpilot state of a version this release
            reads.
    """
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} has no {STATE_FILE}: it was not written by AdaptiveBatchSizeTrainer, so the data "
            "position and batch size cannot be restored. Resume from a checkpoint this trainer saved."
        )
    try:
        payload = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{str(path)!r} is truncated or corrupt ({exc}); resume from another checkpoint folder of this run."
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT or payload.get("version") != _VERSION:
        found = payload if not isinstance(payload, dict) else \
            f"format={payload.get('format')!r}, version={payload.get('version')!r}"
        raise ValueError(f"{str(path)!r} is not a batchpilot Trainer state of version {_VERSION} ({str(found)[:100]}).")
    return payload
