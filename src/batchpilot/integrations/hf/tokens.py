"""Token budgets in the Hugging Face trainer (``batch_unit="tokens"``): the settings, the lengths (read once, from
the dataset before Trainer removes unused columns), and a micro-batch's rows cut into passes bounded in tokens.

Global batches, rank shares and the ``gradient_accumulation_steps`` micro-batches of each rank are planned by
:mod:`batchpilot.data.tokens` (the same rule as ``Pilot``): a step takes the next samples of the epoch order while
their tokens stay within the budget, never splitting or skipping one, and every micro-batch's loss is weighted by
its tokens over the global batch's (:meth:`~batchpilot.integrations.hf.run.HFRun.begin_step`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._validation import check_batch_size
from ...controllers.auto import Auto
from ...data.tokens import check_batch_unit, count_micro_batches, split_tokens, token_lengths


def check_token_settings(batch_unit: Any, lengths: Any, max_micro_batch_tokens: Any, batch_size: Any,
                         auto: bool) -> None:
    """Check the trainer's unit settings together.

    Raises:
        ValueError, TypeError: an unknown unit, a token setting without ``batch_unit="tokens"``, tokens without a
            first budget (``batch_size=``, which ``batch_size_scheduler="auto"`` does without: its probes start at
            ``Auto``'s ``min_size``), or a budget that is not an int >= 1.
    """
    check_batch_unit(batch_unit, lengths, max_micro_batch_tokens)
    if batch_size is not None:
        check_batch_size(batch_size, "batch_size")
    if batch_unit != "tokens":
        return
    if lengths is None:
        raise ValueError("batch_unit='tokens' needs lengths=: every sample's token count (a sequence), or the name of "
                         "a dataset attribute or column holding it (e.g. lengths='input_ids').")
    if batch_size is None and not auto:
        raise ValueError("batch_unit='tokens' needs the first step's token budget: batch_size=<tokens over all ranks> "
                         "(per_device_train_batch_size counts samples).")


def count_auto_tokens(controller: Any, lengths: np.ndarray | None) -> None:
    """With ``batch_size_scheduler=Auto()`` and token budgets (``lengths`` given), before its start probes: the
    bounds left at their defaults become token counts (:meth:`~batchpilot.controllers.Auto.count_tokens`), so
    that the probes sweep token budgets from ``min_size``."""
    if lengths is not None and isinstance(controller, Auto) and controller.probe is None:
        controller.count_tokens(float(np.mean(lengths)))


def resolve_lengths(dataset: Any, lengths: Any, batch_unit: str) -> np.ndarray | None:
    """Every sample's tokens (``None`` when batches count samples), read once from the training dataset as given
    (an attribute or column that Trainer would remove as unused still counts)."""
    if batch_unit != "tokens":
        return None
    return token_lengths(dataset, lengths, len(dataset))


def token_pieces(row_tokens: np.ndarray, max_rows: int | None, max_tokens: int | None) -> list[int] | None:
    """Rows per forward/backward pass of a micro-batch whose rows hold ``row_tokens`` tokens: the fewest contiguous
    passes of at most ``max_tokens`` tokens (a longer row alone) and ``max_rows`` rows, balanced in tokens
    (:func:`batchpilot.data.tokens.split_tokens`); ``None`` when it runs whole."""
    if len(row_tokens) <= 1 or (max_tokens is None and (max_rows is None or len(row_tokens) <= max_rows)):
        return None
    cumulative = np.concatenate([[0], np.cumsum(row_tokens)])
    parts = count_micro_batches(cumulative, max_tokens, max_rows)
    if parts <= 1:
        return None
    return [stop - start for start, stop in split_tokens(cumulative, parts, max_rows) if stop > start]
