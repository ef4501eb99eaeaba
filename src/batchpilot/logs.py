"""Where step metrics and batch-size decisions go: a JSONL adjustment log, TensorBoard, a progress bar.

The JSONL log is the full record seed 000 asks for ("keep the complete adjustment log"): one line per
step (``"type": "step"``) and one per decision (``"type": "decision"``). Its byte position is part of every
checkpoint, so a resumed run truncates the lines written after the checkpoint and the file reads as if
the run had never been interrupted; a start with nothing to resume moves an earlier run's file aside.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, TextIO

from ._extras import install_hint

logger = logging.getLogger("batchpilot")


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings so every line stays valid JSON (also inside a decision's
    ``inputs`` and other nested values)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class AdjustmentLog:
    """Append-only JSONL log of steps and decisions, buffered and resumable.

    A log holds one run. A resumed run (:meth:`truncate` to its checkpoint's position) appends after the
    checkpoint's records; a fresh start (a record or :meth:`position` before any :meth:`truncate`) moves an
    earlier run's records aside to ``<stem>.<n><suffix>`` (``log.1.jsonl``, the first free ``n``) with a warning,
    so a run restarted after a crash before its first checkpoint does not log its steps twice. Later records of
    the same object, also after :meth:`close`, append.

    Args:
        path: The ``.jsonl`` file, created with its folder if missing (a last record that a killed run left half
            written is cut).
        flush_every: Lines kept in memory before writing (everything is flushed on checkpoint and close).

    Attributes:
        rotated_to: Where the fresh start moved the earlier run's records (``None``: it found none).
    """

    def __init__(self, path: str | os.PathLike, flush_every: int = 100) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_cut_last_line(self.path)
        if not self.path.exists():
            self.path.touch()
        self._file: TextIO | None = None  # None until this run claims the file: fresh start or resume
        self._buffer: list[str] = []
        self.flush_every = flush_every
        self.rotated_to: Path | None = None

    def write(self, kind: str, record: dict[str, Any]) -> None:
        """Add one record of type ``kind`` ("step", "decision", "event")."""
        line = json.dumps({"type": kind, **{k: _clean(v) for k, v in record.items()}}, default=str)
        self._opened()
        self._buffer.append(line)
        if len(self._buffer) >= self.flush_every:
            self.flush()

    def _opened(self) -> TextIO:
        """The file for appending; on first use a fresh log, and opened again if :meth:`close` closed it."""
        if self._file is None:
            if self._size() > 0:
                self.rotated_to = _free_name(self.path)
                os.replace(self.path, self.rotated_to)
                logger.warning("%s holds the records of a run that left no checkpoint to resume; moved them to %s "
                               "and started a new log", self.path, self.rotated_to)
            self._file = open(self.path, "a", encoding="utf-8")
        elif self._file.closed:
            self._file = open(self.path, "a", encoding="utf-8")
        return self._file

    def _size(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def flush(self) -> None:
        """Write buffered lines to disk."""
        if self._buffer:
            self._opened().write("\n".join(self._buffer) + "\n")
            self._buffer.clear()
        if self._file is not None and not self._file.closed:
            self._file.flush()

    def position(self) -> int:
        """Byte offset after the last record (flushes and syncs first): stored in checkpoints, so the records
        it counts are on disk before the checkpoint is."""
        self.flush()
        file = self._opened()
        os.fsync(file.fileno())
        return file.tell()

    def resume_problem(self, position: int) -> str | None:
        """Why the log cannot be cut back to ``position`` (a checkpoint's), or ``None``: a log with at least
        that many bytes is cut back, an empty one (a fresh ``log_path``) starts anew."""
        self.flush()
        size = self._size()
        if 0 < size < position:
            return (f"the checkpoint says the log {str(self.path)!r} had {position} bytes but it has {size}; was it "
                    "replaced? Resume with the run's own log, or pass a log_path that does not exist yet.")
        return None

    def truncate(self, position: int) -> None:
        """Drop everything after ``position`` (records of steps that a resumed run will redo) and append from
        there; an empty log (a fresh ``log_path``) is left as it is."""
        problem = self.resume_problem(position)
        if problem is not None:
            raise ValueError(problem)
        empty = self._size() == 0
        if self._file is None or self._file.closed:  # the resumed run's records up to its checkpoint stay
            self._file = open(self.path, "a", encoding="utf-8")
        if not empty:
            self._file.truncate(position)
            self._file.seek(position)

    def close(self) -> None:
        """Flush and close the file (a later record opens it again)."""
        if self._file is not None and not self._file.closed:
            self.flush()
            self._file.close()


def _free_name(path: Path) -> Path:
    """``<stem>.<n><suffix>`` beside ``path`` for the first ``n`` >= 1 not taken (``log.jsonl`` -> ``log.1.jsonl``)."""
    n = 1
    while (candidate := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    return candidate


_RECORD_START = b'{"type": '  # how every line of an adjustment log begins


def _drop_cut_last_line(path: Path) -> None:
    """Cut a last record that a killed run left half written (no final newline), so the records appended
    next start on a line of their own; the half record could not be read anyway."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        if f.read(len(_RECORD_START)) != _RECORD_START:  # not an adjustment log: leave it as it is
            return
        pos, cut = f.seek(0, os.SEEK_END), 0
        while pos > 0:  # the last newline, reading backwards in blocks
            start = max(0, pos - 65536)
            f.seek(start)
            found = f.read(pos - start).rfind(b"\n")
            if found >= 0:
                cut = start + found + 1
                break
            pos = start
        f.truncate(cut)


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read an adjustment log back as a list of records.

    A last line cut off by a crash (a record half written) is skipped with a warning.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is empty, not UTF-8 text, or a line other than the last is not JSON (the message
            names the line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"adjustment log {str(path)!r} does not exist.")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); is this a "
                         "batchpilot log?") from exc
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if index == last and records:
                warnings.warn(f"{str(path)!r}: skipped its last line, which is not JSON ({exc.msg}): a record cut "
                              "off when the run stopped.", stacklevel=2)
                continue
            raise ValueError(f"{str(path)!r} line {index + 1} is not JSON ({exc.msg}); is this a batchpilot log?") from exc
    if not records:
        raise ValueError(f"adjustment log {str(path)!r} is empty.")
    return records


class TensorBoardSink:
    """Writes numeric step metrics to TensorBoard, with ``samples_seen`` as the x axis.

    Raises:
        ImportError: tensorboard is not installed (names the extra to install).
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(f"tensorboard_dir needs TensorBoard: {install_hint('tensorboard')}") from exc
        self._writer_class, self._log_dir = SummaryWriter, str(log_dir)
        self._writer = SummaryWriter(log_dir=self._log_dir)

    def resume_after(self, samples_seen: int) -> None:
        """Continue after a resume from ``samples_seen``: TensorBoard hides the points a crashed run wrote
        beyond it (the resumed run writes them again), as the JSONL log truncates its records."""
        self._writer.close()
        self._writer = self._writer_class(log_dir=self._log_dir, purge_step=int(samples_seen) + 1)

    def write(self, record: dict[str, Any]) -> None:
        x = int(record["samples_seen"])
        for key, value in record.items():
            if key not in ("step", "samples_seen") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, global_step=x)

    def close(self) -> None:
        self._writer.close()


class ProgressBar:
    """A tqdm bar over samples (falls back to nothing when tqdm is missing or output is not a terminal)."""

    def __init__(self, total: int | None, enabled: bool | None) -> None:
        asked = enabled is True
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                if asked:  # progress=None (the default) goes without a bar quietly
                    import warnings

                    warnings.warn(f"progress=True needs tqdm: {install_hint('progress')}", stacklevel=3)
                return
            self._bar = tqdm(total=total, unit="sample", unit_scale=True, dynamic_ncols=True)

    def update(self, samples: int, record: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(samples)
            self._bar.set_postfix(
                step=record["step"], B=record["batch/global_size"], loss=f"{record['loss']:.4g}", refresh=False
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
