"""One step's micro-batches, accumulated into the step's gradient.

Each micro-batch runs on the training device, under DDP's ``no_sync`` except where DDP is to all-reduce
(the step's last micro-batch, when DDP sums the gradients), and under autocast with AMP. Its loss is weighted
so that the accumulated gradient is the gradient of the mean loss over the global batch, whatever the split:
micro-batch ``j`` of ``n_j`` samples gets ``n_j / B`` (``N n_j / B`` when DDP averages over ``N`` ranks), which
stays exact when the ranks' shares differ (``rank_weights``) and for ghost micro-batches (``n_j = 0``).

With ``batch_unit="tokens"`` the same holds in tokens: ``n_j`` and ``B`` are the micro-batch's and the global
batch's tokens, so a ``loss_reduction="sum"`` loss (summed over the micro-batch's tokens) is weighted ``1 / T``
(``N / T`` under DDP), and a ``"mean"`` loss (its mean over the micro-batch's tokens) ``t_j / T``: the step's
gradient is that of the mean loss per token over the global batch (docs/tokens.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..data.loader import MicroBatch
from ..measure import StepMeter
from .config import PrecisionConfig
from .replay import StepReplay
from .step_end import StepEnd


class Accumulation:
    """Runs the micro-batches of a step and backpropagates their weighted losses.

    Args:
        ddp_model: The DDP wrapper, or ``None``.
        ddp_syncs: DDP all-reduces inside the step's last backward (else the engine does at the step's end).
        precision: ``amp`` (the autocast dtype) and ``loss_reduction`` (the loss given to :meth:`backward` is
            the mean or the sum over its micro-batch).
    """

    def __init__(self, *, device: torch.device, ddp_model: Any, ddp_syncs: bool, world_size: int,
                 precision: PrecisionConfig, meter: StepMeter, step_end: StepEnd, replay: StepReplay) -> None:
        self.device, self.ddp_model, self.ddp_syncs, self.world_size = device, ddp_model, ddp_syncs, world_size
        self.autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision.amp or "")
        self.mean_loss = precision.loss_reduction == "mean"
        self.scaler, self.noise = step_end.scaler, step_end.noise
        self.meter, self.step_end, self.replay = meter, step_end, replay
        self.balance: Any = None  # rank_weights="auto"'s timings (engine/rank_balance.py), or None
        self.micro: MicroBatch | None = None  # the micro-batch between its yield and the step's end
        self.step_open = False  # a step's first micro-batch was yielded and the step is not finished
        self._backward_done = False
        self._in_micro_step = False

    def run(self, micro: MicroBatch) -> Iterator[Any]:
        """Yield ``micro``'s data on the device, inside the contexts its forward and backward need."""
        self.micro = micro
        self.step_open = True
        self._backward_done = False
        if micro.micro_index == 0:
            self.replay.snapshot()  # (no forward ran since the loader fetched it: the step's start)
            if self.noise is not None:
                self.noise.begin_step(micro.step, small_batches=micro.accumulation_steps >= 2)
        data = to_device(micro.data, self.device)
        self.meter.begin_micro()
        if self.balance is not None:
            self.balance.forward_starts(micro.micro_index == 0)
        if self.ddp_model is None and self.autocast is None:
            yield data  # the common case, without context managers
        else:
            with contextlib.ExitStack() as stack:
                if self.ddp_model is not None and not (micro.is_last and self.ddp_syncs):
                    stack.enter_context(self.ddp_model.no_sync())
                if self.autocast is not None:
                    stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
                yield data
        if self.replay.failed_micro_batch_size is not None:
            return  # this step runs again (see micro_step)
        if not self._backward_done:
            raise RuntimeError(
                "pilot.backward(loss) was not called for the last micro-batch; call it exactly once per "
                "micro-batch yielded by pilot.batches()."
            )

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[None]:
        """See :meth:`Pilot.micro_step`: an out-of-memory error inside is handed to the replay."""
        micro = self.micro
        if micro is None:
            raise RuntimeError("pilot.micro_step() was used outside a `for batch in pilot.batches(...)` loop.")
        self._in_micro_step = True
        try:
            yield
        except Exception as exc:
            if not self.replay.caught(exc, len(micro.indices)):  # a ghost micro-batch holds one borrowed sample
                raise
        finally:
            self._in_micro_step = False

    def backward(self, loss: torch.Tensor) -> None:
        """See :meth:`Pilot.backward`."""
        micro = self.micro
        if micro is None:
            raise RuntimeError("pilot.backward() was called outside a `for batch in pilot.batches(...)` loop.")
        if self._backward_done:
            raise RuntimeError("pilot.backward() was called twice for one micro-batch; call it once per micro-batch.")
        if self.replay.oom_recovery and not self._in_micro_step:
            raise RuntimeError(
                "Pilot(oom_recovery=True) needs each micro-batch's forward and backward inside "
                "`with pilot.micro_step():` (an out-of-memory error outside it cannot be recovered)."
            )
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                f"pilot.backward() needs a scalar loss tensor, got {type(loss).__name__} "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; reduce it with .mean() first."
            )
        micro_batch_size = micro.units  # samples, or tokens with batch_unit="tokens"; 0 for a ghost micro-batch
        balance = self.balance if micro_batch_size else None
        if balance is not None:
            balance.before_backward(micro_batch_size)
        per_sample = (micro_batch_size if self.mean_loss else 1) if micro_batch_size else 0
        if per_sample:
            self.step_end.losses.append((loss.detach(), per_sample))
        weight = per_sample / micro.global_units
        if self.ddp_syncs:
            weight *= self.world_size  # DDP divides the summed gradients by the world size
        scaled = loss if weight == 1.0 else loss * weight
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        self._backward_done = True
        if balance is not None:
            balance.after_backward(micro_batch_size)  # (rank_weights="auto": compute time, without waits)
        if micro_batch_size:  # the micro-batch's time ends here: the noise probe's work below is not its cost
            self.meter.end_micro(micro_batch_size)
        if self.noise is not None and self.noise.measuring and micro_batch_size:
            # increment of .grad = weight * grad(loss); grad(loss) = g_j for a mean loss, n * g_j for a sum of n
            to_mean = weight * (1 if self.mean_loss else micro_batch_size)
            if self.scaler is not None:
                to_mean *= float(self.scaler.get_scale())
            # On one process DDP's all-reduce changes nothing: the last micro-batch's .grad is still its own.
            synced = self.ddp_syncs and micro.is_last and self.world_size > 1
            self.noise.after_backward(micro_batch_size, to_mean, synced=synced, last=micro.is_last)


def to_device(data: Any, device: torch.device) -> Any:
    """``data`` (tensors, possibly in dicts, lists, tuples and namedtuples) on ``device``."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True) if data.device != device else data
    if isinstance(data, dict):
        return {k: to_device(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        moved = [to_device(v, device) for v in data]
        if isinstance(data, tuple):
            return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)  # namedtuples keep fields
        return moved
    return data
