"""Helpers shared by the bench tests (importable as ``_bench_helpers``: pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

import struct
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path, min_width: int = 300) -> None:
    """A real PNG: the signature, then an IHDR chunk with a plausible size."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= min_width and height >= 200, (width, height)
