"""Atomic, self-checking checkpoint files.

A checkpoint is written to a temporary file in the same folder, flushed to disk, then renamed over the
target (``os.replace`` is atomic on POSIX), so a crash mid-write never leaves a half-written file under
the real name and the previous checkpoint stays usable. Each file carries a format marker and a
completion marker; a truncated or foreign file raises :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import time
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .data.sampler import AdaptiveBatchSampler

FORMAT = "batchpilot-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d+)\.pt$")
ORPHAN_AGE_S = 60.0  # a temporary checkpoint file unchanged this long, of a process that is gone, is an orphan
_TMP = re.compile(r"^\.step-\d+\.pt\.tmp-(\d+)$")  # save_checkpoint's file while it writes


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt, not a batchpilot checkpoint, or of another run."""


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, "state": state, "complete": True}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_folder(path.parent)  # the rename itself survives a power loss too
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _sync_folder(folder: Path) -> None:
    """fsync a folder, so renames and deletions in it are on disk (POSIX; a no-op elsewhere)."""
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):  # some file systems refuse to fsync a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _load_failure(exc: Exception) -> str:
    """What ``torch.load`` said, in one line. The safe loader's own message mostly suggests
    ``weights_only=False`` (which would run arbitrary code from the file): keep only its diagnosis."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        detail = " ".join(text.split(marker, 1)[1].split("Check the documentation", 1)[0].split())
        return f"the safe loader (weights_only=True) refused it: {detail}"
    return f"{type(exc).__name__}: {' '.join(text.split())[:200]}"


def _failed_crc(path: Path) -> str | None:
    """The first part of a zip checkpoint (torch.save's format) whose data fails its CRC-32, else ``None``.
    torch.load does not check the CRCs, so a flipped bit would load as a changed number."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return None  # not a readable zip: torch.load says why


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` and return its state (a dict; to restore a run from
    it use :meth:`Pilot.load_checkpoint`).

    Raises:
        CheckpointError: the file does not exist, is truncated or corrupt, or is not a batchpilot file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; check the path or the checkpoint_dir.")
    damaged = _failed_crc(path)
    if damaged is not None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: its part {damaged!r} fails the archive's CRC check (a damaged "
            "disk or copy). Load an earlier one (see latest_checkpoint)."
        )
    try:
        # Our own files hold only tensors, containers and numbers, so the safe loader suffices.
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign data
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({_load_failure(exc)}); it is truncated, "
            "corrupt or not a batchpilot checkpoint. Load an earlier one (see latest_checkpoint)."
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not a batchpilot checkpoint (no {FORMAT!r} marker); "
            "pass a file written by Pilot.save_checkpoint."
        )
    if payload.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {payload.get('version')!r}; this batchpilot reads version "
            f"{VERSION}. Use the batchpilot version that wrote it."
        )
    if payload.get("complete") is not True or "state" not in payload:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete; load an earlier one.")
    return payload["state"]


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Deprecated name of :func:`read_checkpoint` (it returns a state; :meth:`Pilot.load_checkpoint` restores)."""
    warnings.warn("batchpilot.load_checkpoint(path) is deprecated: it returns a state dict, while "
                  "Pilot.load_checkpoint(path) restores a run; use batchpilot.read_checkpoint(path), the same "
                  "function.", DeprecationWarning, stacklevel=2)
    return read_checkpoint(path)


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """The file name used for the checkpoint of ``step`` in ``directory``."""
    return Path(directory) / f"step-{step:09d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoint files in ``directory``, oldest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint in ``directory`` that loads cleanly, or ``None`` when the folder holds none.

    A newer file that fails to load (truncated by a crash outside our atomic write, say) is skipped with a
    warning naming it, so the previous checkpoint is used instead.

    Raises:
        CheckpointError: the folder holds checkpoint files but none of them loads (each one and why is named).
    """
    found = load_latest_checkpoint(directory)
    return None if found is None else found[0]


def load_latest_checkpoint(directory: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
    """:func:`latest_checkpoint` and its loaded state (read once), or ``None`` when the folder holds none."""
    failures: list[str] = []
    for path in reversed(list_checkpoints(directory)):
        try:
            state = read_checkpoint(path)
        except CheckpointError as exc:
            failures.append(str(exc))
            continue
        if failures:
            warnings.warn(f"skipped {len(failures)} newer checkpoint(s) that do not load, resuming from "
                          f"{str(path)!r}:\n  - " + "\n  - ".join(failures), stacklevel=3)
        return path, state
    if failures:  # files are there, but none loads: never treat that as a first start
        raise CheckpointError(
            f"none of the {len(failures)} checkpoint(s) in {str(directory)!r} loads, so the run cannot resume:\n  - "
            + "\n  - ".join(failures) + "\nRestore a good file, or move these away to start from step 0 on purpose."
        )
    return None


def prune_checkpoints(directory: str | os.PathLike, keep: int, written: str | os.PathLike | None = None) -> None:
    """Delete all but the ``keep`` newest checkpoints in ``directory``, and the half-written files of
    writers that were killed (their process is gone).

    With ``written`` (the file just saved, a ``step-N.pt``), that file is always kept, and only checkpoints
    of earlier steps are deleted: files of later steps belong to a run this one does not continue (it
    loaded an older checkpoint, or started afresh), so they are left alone, with a warning that resuming
    from the folder would pick them.
    """
    files = list_checkpoints(directory) if keep > 0 else []
    if files and written is not None and _NAME.match(Path(written).name):
        step = _step_of(Path(written))
        later = [p for p in files if _step_of(p) > step]
        if later:
            warnings.warn(f"{str(directory)!r} holds checkpoints of later steps than this run has reached: "
                          f"{', '.join(p.name for p in later)}. Resuming from the folder would pick them; remove "
                          "them if their run is abandoned.", stacklevel=3)
        files = [p for p in files if _step_of(p) < step]
        keep -= 1  # the written file is one of the kept
    for path in files[: max(len(files) - keep, 0)]:
        path.unlink(missing_ok=True)
    for path in Path(directory).iterdir():
        match = _TMP.match(path.name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            with contextlib.suppress(OSError):  # removed meanwhile
                if time.time() - path.stat().st_mtime > ORPHAN_AGE_S:  # not one being written (on another host)
                    path.unlink()
    _sync_folder(Path(directory))


def _step_of(path: Path) -> int:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def _alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there: go by the file's age alone
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def class_name(obj: Any) -> str:
    """``module.QualifiedName`` of ``obj``'s class, as checkpoints record it."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _listed(items: list[str], most: int = 3) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def fit_problems(state: Mapping[str, Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 sampler: AdaptiveBatchSampler) -> list[str]:
    """Why a ``Pilot`` state cannot be loaded into this model, optimizer and sampler (empty: it fits).

    Checked before anything is loaded, so that a checkpoint of another run changes nothing: the model's
    parameter and buffer names and shapes, the optimizer's class (recorded since this check exists) and
    parameter groups, and the dataset size, seed and shuffling of the sampler."""
    problems = []
    saved, current = state.get("model") or {}, model.state_dict()
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    shapes = [f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)} here" for k, v in current.items()
              if k in saved and isinstance(saved[k], torch.Tensor) and isinstance(v, torch.Tensor)
              and saved[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = ([f"missing {_listed(missing)}"] if missing else []) + \
                ([f"unexpected {_listed(unexpected)}"] if unexpected else []) + \
                ([f"other shapes: {_listed(shapes)}"] if shapes else [])
        fix = "build the same model as the run that saved it"
        if {k.replace("_orig_mod.", "") for k in saved} == {k.replace("_orig_mod.", "") for k in current}:
            fix = ("only torch.compile's '_orig_mod.' in the names differs: a submodule was compiled in one run and "
                   "not in the other; compile the same submodules, or compile the whole model (torch.compile(model) "
                   "or model.compile()), whose checkpoints hold the bare names either way")
        problems.append(f"the model differs ({'; '.join(parts)}); {fix}.")
    written = (state.get("pilot") or {}).get("optimizer_class")
    if written is not None and written != class_name(optimizer):
        problems.append(f"the checkpoint was written with optimizer {written}, this Pilot has "
                        f"{class_name(optimizer)}; build the Pilot with the same optimizer class.")
    groups = (state.get("optimizer") or {}).get("param_groups", [])
    sizes, here = [len(g.get("params", ())) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes != here:
        problems.append(f"the optimizer's parameter groups differ (parameters per group: {sizes} in the "
                        f"checkpoint, {here} here); pass the optimizer the same parameter groups.")
    for key, saved_value, here_value in sampler.order_mismatches(state.get("loader") or {}):
        problems.append(f"the data differs: the checkpoint has {key}={saved_value!r}, this Pilot "
                        f"{key}={here_value!r}; resume with the same dataset, seed and shuffle setting.")
    return problems
