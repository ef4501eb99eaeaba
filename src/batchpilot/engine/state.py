"""A `Pilot` state in and out of checkpoints: where files go, whether a state fits, and what a load keeps.

A state saved by another run (another model, optimizer, data order, schedulers, controller) is refused as a
whole before anything changes; every problem is listed at once.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import distributed as bpdist
from ..checkpoint import (
    CheckpointError,
    checkpoint_path,
    class_name,
    fit_problems,
    load_latest_checkpoint,
    prune_checkpoints,
    read_checkpoint,
    save_checkpoint,
)
from ..controllers.boundary import validate_decision
from ..data.loader import AdaptiveDataLoader
from ..logs import AdjustmentLog
from ..lr import LRCoupling
from ..measure import GradientNoiseProbe, StepMeter
from ..rng import gather_rng_states, restore_rng_states
from .config import PilotConfig
from .driver import SizeDriver
from .replay import keep_finished_step
from .sharded import dcp_problems, is_sharded, load_dcp, prune_dcp, resolve_dcp, save_dcp
from .step_end import StepEnd, StepLog

logger = logging.getLogger("batchpilot")

_STATE_KEYS = ("pilot", "model", "optimizer", "loader", "lr_schedulers", "rng", "log_position")
_PILOT_KEYS = ("step", "samples_seen", "skipped_steps", "losses", "throughput")


class PilotState:
    """Saves and restores everything a `Pilot` needs to resume exactly: its parts' states (model, optimizer,
    scaler, LR rules, data position, controller, statistics), the LR schedulers, the step counters, the RNG
    states of every rank and the log's position.

    Args:
        log_clamp: ``log_clamp(global_batch_size, bounded, note)`` logs a saved global batch size clamped to this
            Pilot's bounds.
    """

    def __init__(self, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer, coupling: LRCoupling,
                 loader: AdaptiveDataLoader, driver: SizeDriver, step_end: StepEnd, meter: StepMeter, log: StepLog,
                 config: PilotConfig, rank: int, world_size: int, device: torch.device,
                 log_clamp: Callable[[int, int, str], None]) -> None:
        self.parts: dict[str, Any] = {  # by checkpoint key, in loading order (None where a feature is off)
            "model": module, "optimizer": optimizer, "scaler": step_end.scaler, "coupling": coupling,
            "adascale": step_end.adascale, "loader": loader, "controller": driver.controller,
            "stats_clip": step_end.stats_clip, "noise": step_end.noise, "meter": meter,
        }
        self.lr_schedulers, self.noise = step_end.lr_schedulers, step_end.noise
        self.driver, self.log, self.loader, self.coupling = driver, log, loader, coupling
        self.config, self.log_clamp = config, log_clamp
        self.rank, self.world_size, self.device = rank, world_size, device

    def state_dict(self, *, skipped_steps: int, override: int | None) -> dict[str, Any]:
        """The state (every rank must call this: the RNG states are gathered)."""
        return {
            "pilot": {
                "step": self.driver.step,
                "samples_seen": self.driver.samples_seen,
                "skipped_steps": skipped_steps,
                "losses": list(self.driver.losses),
                "throughput": self.driver.samples_per_s,
                "world_size": self.world_size,
                "optimizer_class": class_name(self.parts["optimizer"]),
                "lr_scheduler_classes": [class_name(s) for s in self.lr_schedulers],
                "override": override,  # a set_batch_size() made in a step the loop then left unfinished
            },
            **{key: None if obj is None else obj.state_dict() for key, obj in self.parts.items()},
            "lr_schedulers": [s.state_dict() for s in self.lr_schedulers],
            "rng": gather_rng_states(self.world_size, self.device),
            "log_position": None if self.log.log is None else self.log.log.position(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, int | None]:
        """Check that ``state`` fits (every rank must call this), load it, keep this Pilot's own settings;
        return the state's ``skipped_steps`` and pending ``set_batch_size()`` override."""
        loader, dec = self.loader, self.config.decisions
        check_fit(state, components=self.parts, schedulers=self.lr_schedulers, loader=loader, log=self.log.log,
                  world_size=self.world_size)
        in_loop = self.coupling.is_scaled  # loaded between steps of batches() (from a callback)
        drop_last, max_micro_batch_size = loader.sampler.drop_last, loader.max_micro_batch_size  # this Pilot's
        noise_every = None if self.noise is None or self.noise.adaptive else self.noise.every
        if in_loop:
            self.coupling.unscale()
        try:
            p = state["pilot"]
            self.driver.restore_counters(int(p["step"]), int(p["samples_seen"]), p["losses"], p["throughput"])
            counters = int(p["skipped_steps"]), p.get("override")
            parts = self.parts
            if state.get("sharded") is not None:  # saved by FSDP2: model and optimizer from DCP, resharded
                load_dcp(state, self.parts["model"], self.parts["optimizer"])
                parts = {k: v for k, v in parts.items() if k not in ("model", "optimizer")}
            load_parts(state, parts, self.lr_schedulers)
            restore_rng_states(state["rng"], self.rank, self.world_size, self.device)
        except Exception as exc:  # the checks above passed, so this is a damaged state: say what it did
            raise partly_loaded(exc) from exc
        if self.log.log is not None and state["log_position"] is not None:
            self.log.log.truncate(state["log_position"])  # before keep_own_settings logs what it changes
        keep_own_settings(loader, self.noise, drop_last=drop_last, max_micro_batch_size=max_micro_batch_size,
                          noise_every=noise_every,
                          min_batch_size=dec.min_batch_size, max_batch_size=dec.max_batch_size,
                          log_clamp=self.log_clamp)
        if self.log.tensorboard is not None:
            tokens = self.loader.sampler.token_plan is not None  # (the driver then counts tokens; the x axis samples)
            self.log.tensorboard.resume_after(self.loader.position()[2] if tokens else self.driver.samples_seen)
        if in_loop or self.coupling.is_scaled:
            # The loop goes on with the loaded position (or a state_dict() taken between steps holds a scaled
            # coupling): the factor of its next step's real size, which this Pilot's bounds may have changed.
            rescale_lr(self.coupling, loader)
        return counters

    def save(self, path: str | os.PathLike | None, state_dict: Callable[[], dict[str, Any]]) -> Path | None:
        """Write ``state_dict()`` to :func:`checkpoint_file` (rank 0 writes; every rank must call this), pruning
        ``checkpoint_dir``; return the path on rank 0, ``None`` elsewhere."""
        ckpt = self.config.checkpoints
        path = checkpoint_file(path, ckpt.checkpoint_dir, self.driver.step)
        scaled = self.coupling.is_scaled
        if scaled:  # store the schedule's own LR: batches() re-applies the factor of the loaded batch size
            self.coupling.unscale()
        try:
            state = state_dict()
            if is_sharded(self.parts["model"]):  # FSDP2: model and optimizer through DCP (engine/sharded.py)
                save_dcp(state, path, self.parts["model"], self.parts["optimizer"])  # (the schedule's own LR)
                if self.world_size > 1:
                    bpdist.barrier()  # every rank's shards are written before the .pt names them complete
        finally:
            if scaled:
                self.coupling.scale(self.loader.next_step_size())
        written = None
        if self.rank == 0:
            written = save_checkpoint(path, state)
            if ckpt.checkpoint_dir is not None and path.parent == ckpt.checkpoint_dir:
                prune_checkpoints(ckpt.checkpoint_dir, ckpt.keep_checkpoints, written)
                prune_dcp(ckpt.checkpoint_dir)
        if self.world_size > 1:
            bpdist.barrier()
        return written


    def keep_finished_step(self, error: BaseException, state_dict: Callable[[], dict[str, Any]]) -> None:
        """The controller failed after a finished step (on every rank, so the save's collectives match): with a
        ``checkpoint_dir``, save that step before the error stops the run, so nothing trained is lost. The
        checkpoint continues at the current size; a resumed run asks the controller again when next due."""
        if self.config.checkpoints.checkpoint_dir is not None:
            keep_finished_step(lambda: self.save(None, state_dict), error, step=self.driver.step, lead=self.rank == 0,
                               resume_hint="load_checkpoint(checkpoint_dir)")


def rescale_lr(coupling: LRCoupling, loader: AdaptiveDataLoader) -> None:
    """Put in the LR factor of the next step's real size (in place of any factor in now)."""
    if coupling.is_scaled:
        coupling.unscale()
    coupling.scale(loader.next_step_size())


def checkpoint_file(path: str | os.PathLike | None, checkpoint_dir: str | os.PathLike | None, step: int) -> Path:
    """Where :meth:`Pilot.save_checkpoint` writes: ``path``, or ``step-<step>.pt`` in ``path`` when it is a folder
    (one that exists, or a string ending in a separator; ``pathlib`` drops a trailing one) or in ``checkpoint_dir``
    when ``path`` is ``None``."""
    if path is None:
        if checkpoint_dir is None:
            raise ValueError("save_checkpoint() needs a path, or a Pilot built with checkpoint_dir=...")
        return checkpoint_path(checkpoint_dir, step)
    if Path(path).is_dir() or str(path).endswith((os.sep, "/")):
        return checkpoint_path(path, step)
    return Path(path)


def find_checkpoint(path: str | os.PathLike, missing_ok: bool) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint file ``path`` and its state, or the newest loadable one in the folder ``path`` (``None``:
    the folder holds none and ``missing_ok``).

    Raises:
        CheckpointError: see :meth:`Pilot.load_checkpoint`.
    """
    path = Path(path)
    if path.is_dir() or (missing_ok and not path.exists()):
        found = load_latest_checkpoint(path)  # the newest file that loads, read once; raises if none does
        if found is None and not missing_ok:
            raise CheckpointError(f"no checkpoint in {str(path)!r} (no step-*.pt files); pass missing_ok=True "
                                  "to start from step 0 when there is none.")
    else:
        found = path, read_checkpoint(path)
    if found is not None:
        resolve_dcp(found[1], found[0])  # FSDP2: the DCP folder beside the file
    return found


def state_shape_problem(state: Any) -> str | None:
    """Why ``state`` is not a :meth:`Pilot.state_dict` at all (``None``: it has the keys one has)."""
    if not isinstance(state, dict):
        return (f"a Pilot state is a dict from Pilot.state_dict(), got {type(state).__name__}; "
                "pass what Pilot.state_dict() returned (or use load_checkpoint(path)).")
    missing = [k for k in _STATE_KEYS if k not in state]
    pilot = state.get("pilot")
    missing += [f"pilot.{k}" for k in _PILOT_KEYS if isinstance(pilot, dict) and k not in pilot]
    if missing or not isinstance(pilot, dict):
        return (f"this is not a Pilot state (it lacks {', '.join(missing) or 'a pilot dict'}; keys: "
                f"{sorted(map(str, state))[:8]}); pass what Pilot.state_dict() returned, not a model's or "
                "optimizer's state_dict.")
    return None


def check_fit(state: Any, *, components: dict[str, Any], schedulers: list[Any], loader: AdaptiveDataLoader,
              log: AdjustmentLog | None, world_size: int) -> None:
    """Refuse a state that does not fit (every rank calls this: the ranks agree), then warn about features
    the two runs do not share.

    Raises:
        CheckpointError: ``state`` is no Pilot state, or does not fit (every problem listed).
    """
    shape = state_shape_problem(state)
    if shape is not None:
        raise CheckpointError(shape)
    problems = load_problems(state, components=components, schedulers=schedulers, loader=loader, log=log)
    if world_size > 1 and bpdist.all_reduce_min_int(0 if problems else 1) == 0 and not problems:
        problems.append("another rank refused it (rank 0 checks the adjustment log; see its error)")
    if problems:
        raise CheckpointError("the checkpoint does not fit this Pilot (nothing was loaded):\n  - "
                              + "\n  - ".join(problems))
    warn_about_features(state, components)


def load_problems(state: dict[str, Any], *, components: dict[str, Any], schedulers: list[Any],
                  loader: AdaptiveDataLoader, log: AdjustmentLog | None) -> list[str]:
    """Why ``state`` does not fit a Pilot with these parts (empty: it fits): the model, optimizer and data order
    (:func:`~batchpilot.checkpoint.fit_problems`), the adjustment log, the LR schedulers, and the controller's
    and the LR rules' states, loaded into copies first."""
    model, optimizer = components["model"], components["optimizer"]
    problems = fit_problems(state, model=model, optimizer=optimizer, sampler=loader.sampler) + dcp_problems(state)
    if state.get("sharded") is None and is_sharded(model) and not _holds_shards(state.get("model")):
        problems.append("it was saved without fully_shard (full weights), and this model is sharded (FSDP2); load it "
                        "into the model before fully_shard, or resume without FSDP2")
    if log is not None and state["log_position"] is not None:
        problem = log.resume_problem(state["log_position"])
        if problem is not None:
            problems.append(problem)
    shared = {id(optimizer): optimizer, id(model): model}
    problems += _scheduler_problems(state, schedulers, shared)
    for key in ("controller", "coupling", "adascale"):  # one saved by another controller (or AdaScale's B0)
        obj = components[key]
        if obj is None or state.get(key) is None:
            continue
        failure = _trial_load(obj, state[key], shared)
        if failure is not None:
            problems.append(f"its {key} state does not load into this Pilot's {type(obj).__name__} ({failure})")
    return problems


def _holds_shards(model_state: Any) -> bool:
    """Whether a model state holds DTensors (an in-memory state of an FSDP2 model), or nothing to load."""
    values = list(model_state.values()) if isinstance(model_state, dict) else []
    return not values or any(hasattr(v, "to_local") for v in values)


def _scheduler_problems(state: dict[str, Any], here: list[Any], shared: dict[int, Any]) -> list[str]:
    """Why the checkpoint's LR scheduler states do not fit these schedulers (empty: they do): another
    number or class (recorded since this check exists), or a state that does not load into a copy."""
    saved = state["lr_schedulers"]
    if len(saved) != len(here):
        return [f"the checkpoint has {len(saved)} LR schedulers but this Pilot has {len(here)}; build the "
                "Pilot with the same lr_schedulers."]
    classes = state["pilot"].get("lr_scheduler_classes")
    names = [class_name(s) for s in here]
    if classes is not None and list(classes) != names:
        return [f"the checkpoint's LR schedulers are {list(classes)}, this Pilot's {names}; build the Pilot "
                "with the same lr_schedulers, in the same order."]
    problems = []
    for i, (scheduler, s) in enumerate(zip(here, saved)):
        # torch's schedulers take any dict (__dict__.update): the keys this scheduler saves must be there.
        missing = sorted(k for k in scheduler.state_dict() if k not in s)
        if missing:
            problems.append(f"LR scheduler {i} ({names[i]}): the checkpoint's state lacks {missing}; build the "
                            "Pilot with the schedulers of the run that saved it.")
            continue
        failure = _trial_load(scheduler, s, shared)
        if failure is not None:
            problems.append(f"LR scheduler {i} ({names[i]}) does not load its state ({failure})")
    return problems


def _trial_load(obj: Any, state: Any, shared: dict[int, Any]) -> str | None:
    """Load ``state`` into a copy of ``obj``; ``"Type: message"`` if that fails, else ``None`` (also when
    ``obj`` cannot be copied: it is then loaded for real only). The copy shares the ``shared`` objects (the
    optimizer and the model: their states are not what is tried here; a bound method's owner may hold them),
    and it gets a copy of ``state``: some loaders pop keys from the dict they load (CyclicLR), and the real
    load needs it whole."""
    try:
        trial = copy.deepcopy(obj, dict(shared))
    except Exception:
        return None
    try:
        trial.load_state_dict(copy.deepcopy(state))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def warn_about_features(state: dict[str, Any], components: dict[str, Any]) -> None:
    """Warn when the checkpoint's run had a feature this Pilot lacks, or the other way round (fp16 loss
    scaling, AdaScale, statistics-based clipping): the resumed run then trains differently."""
    for key, what in (("scaler", "amp='fp16' (a GradScaler)"), ("adascale", "lr_rule='adascale'"),
                      ("stats_clip", "grad_clip='stats'")):
        saved, here = state.get(key) is not None, components[key] is not None
        if saved != here:
            logger.warning("the checkpoint was saved %s %s, this Pilot runs %s it; the resumed run trains "
                           "differently from the one that saved it", "with" if saved else "without", what,
                           "with" if here else "without")


def load_parts(state: dict[str, Any], components: dict[str, Any], schedulers: list[Any]) -> None:
    """Load every part's state (in the order of ``components``), then the LR schedulers'. A part with
    ``loads_missing_state`` gets ``{}`` from a checkpoint saved before it existed (to apply its own setting)."""
    for key, obj in components.items():
        if obj is not None and state.get(key) is not None:
            obj.load_state_dict(state[key])
        elif obj is not None and getattr(obj, "loads_missing_state", False):
            obj.load_state_dict({})
    for scheduler, s in zip(schedulers, state["lr_schedulers"]):
        scheduler.load_state_dict(s)


def partly_loaded(exc: Exception) -> CheckpointError:
    """The error for a state that passed every check but failed while loading (a damaged state)."""
    return CheckpointError(
        f"the checkpoint passed every check but failed while loading ({type(exc).__name__}: {exc}); this "
        "Pilot is now partly loaded: build it again and load an earlier checkpoint."
    )


def keep_own_settings(loader: AdaptiveDataLoader, noise: GradientNoiseProbe | None, *, drop_last: bool,
                      max_micro_batch_size: int | None, noise_every: int | None, min_batch_size: int | None,
                      max_batch_size: int | None, log_clamp: Callable[[int, int, str], None]) -> None:
    """After loading: ``drop_last`` and the batch size bounds are this Pilot's (a clamped size is passed to
    ``log_clamp(global_batch_size, bounded, note)``), the micro-batch bound the smaller of this Pilot's and the
    checkpoint's (which out-of-memory recovery may have lowered), and the noise-scale period the checkpoint's (its
    estimate's smoothing was built for it); a change is logged."""
    sampler = loader.sampler
    if noise is not None and noise_every is not None and noise.every != noise_every:
        logger.warning("this Pilot has noise_every=%d, but the checkpoint's run measured the noise scale every %d "
                       "steps; continuing with %d, so its estimate goes on as it was saved",
                       noise_every, noise.every, noise.every)
    if noise is not None:
        loader.split_every = noise.split_every  # the checkpoint's period
    global_batch_size = loader.batch_size
    bounded, note = validate_decision(global_batch_size, current=global_batch_size, min_size=min_batch_size,
                                      max_size=max_batch_size, source="the checkpoint's batch size")
    if bounded != global_batch_size:
        logger.warning("the checkpoint's batch size %d lies outside this Pilot's [min_batch_size=%s, "
                       "max_batch_size=%s]; continuing with %d", global_batch_size, min_batch_size, max_batch_size,
                       bounded)
        log_clamp(global_batch_size, bounded, note or "clamped to the bounds after loading")
        loader.set_batch_size(bounded)
    if sampler.drop_last != drop_last:
        logger.warning("the checkpoint was saved with drop_last=%s; continuing with this Pilot's drop_last=%s",
                       sampler.drop_last, drop_last)
        sampler.drop_last = drop_last
    saved = loader.max_micro_batch_size
    bounds = [b for b in (max_micro_batch_size, saved) if b is not None]
    bound = min(bounds) if bounds else None
    if bound != saved:
        logger.warning("the checkpoint's max_micro_batch_size is %s; continuing with this Pilot's %s", saved, bound)
    elif bound != max_micro_batch_size:
        logger.warning("max_micro_batch_size=%s, but the checkpoint's run had lowered it to %s (after running "
                       "out of memory); continuing with %s", max_micro_batch_size, saved, bound)
    loader.max_micro_batch_size = bound

