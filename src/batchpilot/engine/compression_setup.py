"""``Pilot(..., compression=...)``: a DDP communication hook that compresses the gradients (docs/distributed.md,
"Gradient compression").

The hook goes behind the noise probe's reading of the local gradient (:func:`~batchpilot.measure.noise_probe.
attach_comm_hook`): on the steps the probe measures, the gradient is reduced in full precision, so the gradient
statistics are those of an uncompressed run. The hook's state (error buffers, step counter) is a part of the
Pilot's checkpoint; with an fp16 ``GradScaler`` its error buffers follow the loss scale.
"""

from __future__ import annotations

from typing import Any

from ..distributed.compression import OneBitState
from ..measure.noise_probe import attach_comm_hook

__all__ = ["COMPRESSIONS", "CompressionPart", "check_compression", "setup_compression"]

COMPRESSIONS = ("1bit", "auto")
"""The compressions named by a string: 1-bit signs with error feedback, and the adaptive choice."""

_USE = ("use '1bit', 'auto', a DDP communication hook hook(state, bucket) (e.g. OneBitState(warmup_steps=50).hook), "
        "or None")


def check_compression(value: Any) -> None:
    """Check the ``compression`` setting (``TypeError``/``ValueError`` naming the value and the choices)."""
    if value is None or callable(value):
        return
    if isinstance(value, str):
        if value not in COMPRESSIONS:
            raise ValueError(f"compression={value!r} is not a known compression; {_USE}.")
        return
    raise TypeError(f"compression must be a string, a callable or None, got {value!r} ({type(value).__name__}); "
                    f"{_USE}.")


class CompressionPart:
    """The compression's part of a Pilot: the hook state in checkpoints, and its error buffers kept in step with
    an fp16 GradScaler's loss scale (``after_step``, a Pilot callback).

    Args:
        state: The hook's state (``state_dict``/``load_state_dict``).
        scaler: The Pilot's GradScaler (``amp="fp16"``), or ``None``.
    """

    def __init__(self, state: Any, scaler: Any) -> None:
        self.state, self.scaler = state, scaler
        self.loss_scale = None if scaler is None else float(scaler.get_scale())

    def after_step(self, pilot: Any, record: dict[str, Any]) -> None:
        """The gradients' scale changed with the loss scale: scale the error buffers alike (they hold residuals of
        scaled gradients), so the next step adds them in the new units."""
        if self.scaler is None:
            return
        scale = float(self.scaler.get_scale())
        if self.loss_scale is not None and scale != self.loss_scale and hasattr(self.state, "rescale_errors"):
            self.state.rescale_errors(scale / self.loss_scale)
        self.loss_scale = scale

    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self.state).__name__, "state": self.state.state_dict(), "loss_scale": self.loss_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a state saved by another kind of hook is refused: ``ValueError``)."""
        kind = type(self.state).__name__
        if state.get("kind") != kind:
            raise ValueError(f"the checkpoint's compression state is a {state.get('kind')}, this Pilot's hook has a "
                             f"{kind}; resume with the compression that saved it.")
        self.state.load_state_dict(state["state"])
        self.loss_scale = state.get("loss_scale", self.loss_scale)


def _hook_of(value: Any, ddp_model: Any) -> tuple[Any, Any]:
    """``(state, hook)`` for the setting: a named compression's state and its bound ``hook``; a bound method
    ``obj.hook`` keeps ``obj`` as its state; any other callable gets DDP's process group as its state."""
    group = ddp_model.process_group
    if value == "1bit":
        state: Any = OneBitState(group)
        return state, state.hook
    if value == "auto":
        from ..distributed.adaptive_compression import AdaptiveCompression  # (imported when used: PowerSGD's hooks)

        state = AdaptiveCompression(group)
        return state, state.hook
    owner = getattr(value, "__self__", None)
    if owner is not None and hasattr(owner, "state_dict"):
        return owner, value
    return group, value


def setup_compression(pilot: Any) -> CompressionPart | None:
    """Register the Pilot's ``compression`` on its DDP model; return the checkpoint part (``None``: no
    compression).

    Raises:
        ValueError: the model is not DDP, one rank, ``oom_recovery=True`` (the engine then reduces the gradients
            itself and DDP's hook never runs), or the model already has a communication hook of its own.
    """
    value = pilot.config.distributed.compression
    if value is None:
        return None
    name = value if isinstance(value, str) else getattr(value, "__qualname__", type(value).__name__)
    ddp_model = pilot._ddp_model
    if ddp_model is None:
        raise ValueError(f"compression={name!r} compresses inside DistributedDataParallel's all-reduce, but the model "
                         "is not a DDP model; wrap it (torch.nn.parallel.DistributedDataParallel(model)) or drop "
                         "compression.")
    if pilot.world_size < 2:
        raise ValueError(f"compression={name!r} needs 2 or more ranks, but this Pilot trains on 1 (there is nothing "
                         "to send); drop compression or train over the process group.")
    if pilot.oom_recovery:
        raise ValueError(f"compression={name!r} cannot be combined with oom_recovery=True: under OOM recovery the "
                         "engine reduces the gradients itself at the step's end, so DDP's communication hook never "
                         "runs; drop one of them.")
    state, hook = _hook_of(value, ddp_model)
    if hasattr(state, "bind"):
        state.bind(pilot._module)  # names the parameters for the checkpoint
    try:
        attach_comm_hook(ddp_model, state, hook)
    except RuntimeError as exc:
        raise ValueError(f"compression={name!r} needs DDP's communication hook, but the model already has one of its "
                         "own (DDP allows one); build the DDP model without register_comm_hook, or leave "
                         "compression None.") from exc
    if not hasattr(state, "state_dict"):  # a hook without a state of its own (DDP's process group)
        return None
    part = CompressionPart(state, pilot.scaler)
    if pilot.scaler is not None:
        pilot.add_callback(part.after_step)
    return part
