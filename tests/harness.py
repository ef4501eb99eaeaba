"""One state round-trip harness for every stateful class (in the spirit of torchdata's save/load tests).

The non-negotiable it checks (DESIGN.md): stopping an object at any step, saving ``state_dict()``, and
loading it into a *fresh* object gives exactly the future the original would have had.

    A = make();  advance A by k steps;  state = A.state_dict()
    state -> json.dumps -> json.loads                      (or a deep copy / torch.save round trip)
    B = make_restored();  B.load_state_dict(state)
    observe(A, k) == observe(B, k)                          (compared exactly, tensors included)

``k`` runs over ``steps``: pick restore points that matter for the class under test (0 = before anything
happened, mid-epoch, exactly at an epoch boundary, one step after it, past the end, ...). For an object
iterated in loops, drive it with the user's loop and restore inside it right after an epoch's last item,
before the loop's StopIteration (:func:`epoch_ends` finds those points): the live loop ends there, and so
must the first loop after loading.

Besides the futures, it checks the things that make resume bugs silent:

* the state survives a strict JSON round trip (no NaN/inf tokens, no numpy scalars, no int dict keys
  that would come back as str), unless ``json_roundtrip=False``; then it is deep-copied, and with ``torch_roundtrip``
  also passed through ``torch.save``/``torch.load(weights_only=True)``, as a checkpoint would be;
* ``state_dict()`` is a snapshot: advancing A afterwards does not change the dict already returned
  (no aliasing of internal lists, arrays or tensors), and B advancing does not change the dict it loaded;
* ``state_dict()`` is pure: calling it twice gives equal dicts;
* (``check_reloaded_state``) B's own ``state_dict()`` right after loading equals the state it loaded;
* (``advance_before_load``) loading also works into an object that was already used, i.e.
  ``load_state_dict`` overwrites every field rather than relying on a fresh object's defaults.

Usage, for a class whose future depends on the step number (a controller, a schedule)::

    def make():
        return LinearIncrease(start=32, increment=32, interval=10, max_size=1024)

    def advance(ctrl, step):                 # one step; ``step`` is its 0-based index
        ctrl.decide(obs_at(step))

    def observe(ctrl, step):                 # the future from ``step`` on, as a comparable value
        return [ctrl.decide(obs_at(s)) for s in range(step, step + 20)]

    assert_state_roundtrip(make, advance, observe, steps=(0, 1, 9, 10, 11, 50))

``advance`` and ``observe`` receive the step index so that inputs can depend on it deterministically;
they must not share mutable state between the two objects (build inputs from the step number only).
For groups of objects (one sampler per rank, a model plus its optimizer), let ``make`` return the group
and pass ``get_state``/``set_state``.
"""

from __future__ import annotations

import copy
import io
import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")

__all__ = ["assert_same", "assert_state_roundtrip", "epoch_ends", "json_roundtrip", "torch_roundtrip"]


# ------------------------------------------------------------------------------------------- equality
def assert_same(a: Any, b: Any, path: str = "value", *, strict_sequences: bool = True) -> None:
    """Assert that ``a`` and ``b`` are exactly equal, recursively; the error names the first difference.

    Dicts (same keys), lists/tuples (same type and length), tensors (same dtype, shape and values,
    ``torch.equal``; NaNs at the same places are equal), numpy arrays and scalars, floats (NaN equals
    NaN, ``0.0 == -0.0``) and everything else with ``==``. Ints and floats are not interchangeable (``32``
    vs ``32.0`` is a difference), numpy and Python scalars of the same kind are. With
    ``strict_sequences=False`` a tuple equals a list with the same items (what JSON does to tuples).
    No tolerance: a resumed run must be identical.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (
            f"{path}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}"
        )
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        a_c, b_c = a.detach().cpu(), b.detach().cpu()
        if a_c.is_floating_point() or a_c.is_complex():
            same_nan = torch.equal(torch.isnan(a_c), torch.isnan(b_c))
            equal = same_nan and torch.equal(torch.nan_to_num(a_c), torch.nan_to_num(b_c))
        else:
            equal = torch.equal(a_c, b_c)
        assert equal, f"{path}: tensors differ:\n{a_c}\n!=\n{b_c}"
        return
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), (
            f"{path}: ndarray vs {type(b if isinstance(a, np.ndarray) else a).__name__}"
        )
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), f"{path}: arrays differ:\n{a}\n!=\n{b}"
        return
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (
            f"{path}: keys differ: only left {sorted(map(str, a.keys() - b.keys()))}, "
            f"only right {sorted(map(str, b.keys() - a.keys()))}"
        )
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]", strict_sequences=strict_sequences)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if strict_sequences:
            assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}\n{a!r}\n!=\n{b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", strict_sequences=strict_sequences)
        return
    kind_a, kind_b = _kind(a), _kind(b)
    if kind_a is float and kind_b is float and math.isnan(a) and math.isnan(b):
        return
    assert kind_a == kind_b, f"{path}: {type(a).__name__} {a!r} != {type(b).__name__} {b!r}"
    assert a == b, f"{path}: {a!r} != {b!r}"


def _kind(x: Any) -> Any:
    """Type used for comparison: numpy and Python scalars of one kind count as the same type."""
    if isinstance(x, (bool, np.bool_)):
        return bool
    if isinstance(x, (int, np.integer)):
        return int
    if isinstance(x, (float, np.floating)):
        return float
    return type(x)


# ------------------------------------------------------------------------------------------- round trips
def json_roundtrip(state: Any) -> Any:
    """``json.loads(json.dumps(state))`` in strict mode: NaN/inf and non-JSON types fail here.

    Also fails when the round trip changes the state (an int key that comes back as a str): what is saved
    to disk must be what is loaded. Tuples coming back as lists are accepted.
    """
    try:
        text = json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise AssertionError(f"state is not strictly JSON-serialisable: {err}\nstate = {state!r}") from err
    back = json.loads(text)
    # Tuples come back as lists (harmless); anything else that changes (int keys that come back as
    # str, ...) would make the loaded state differ from the saved one.
    assert_same(back, state, "json round trip of state", strict_sequences=False)
    return back


def torch_roundtrip(state: Any) -> Any:
    """Pass ``state`` through ``torch.save`` / ``torch.load(weights_only=True)``, as a checkpoint would."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ------------------------------------------------------------------------------------------- the harness
def _default_get_state(obj: Any) -> Any:
    return obj.state_dict()


def _default_set_state(obj: Any, state: Any) -> None:
    obj.load_state_dict(state)


def assert_state_roundtrip(
    make: Callable[[], T],
    advance: Callable[[T, int], Any],
    observe: Callable[[T, int], Any],
    *,
    steps: Iterable[int] = (0, 1, 3),
    json_roundtrip: bool = True,
    torch_roundtrip: bool = False,
    make_restored: Callable[[], T] | None = None,
    get_state: Callable[[T], Any] = _default_get_state,
    set_state: Callable[[T, Any], None] = _default_set_state,
    check_reloaded_state: bool = True,
    check_snapshot: bool = True,
    advance_before_load: int = 0,
    compare: Callable[[Any, Any], None] | None = None,
) -> list[tuple[int, Any]]:
    """Check that saving at step ``k`` and loading into a fresh object reproduces the future exactly.

    Args:
        make: Builds the original object A (fresh, at step 0). Called once per restore point.
        advance: ``advance(obj, step)`` moves ``obj`` forward by one step; ``step`` is its 0-based index.
        observe: ``observe(obj, step)`` runs ``obj`` on from step ``step`` and returns what it produced (a
            list of outputs, counters, ...), compared with ``compare``. It may advance ``obj``.
        steps: Restore points ``k``: the number of steps A takes before its state is saved.
        json_roundtrip: Require the state to survive a strict JSON round trip (and load that copy).
            Otherwise the state is deep-copied, so B never shares objects with A.
        torch_roundtrip: Also pass the state through ``torch.save``/``torch.load(weights_only=True)``.
        make_restored: Builds B (default: ``make``), e.g. with another world size or rank.
        get_state: Takes the state of an object (default ``obj.state_dict()``).
        set_state: Loads a state into an object (default ``obj.load_state_dict(state)``).
        check_reloaded_state: Require ``get_state(B)`` right after loading to equal the loaded state.
            Turn off when part of the state legitimately depends on how B was built.
        check_snapshot: Require the returned state to be a snapshot (see the module docstring). Turn off
            only for states that hold live tensors by torch's convention (``Module.state_dict()``).
        advance_before_load: Advance B by this many steps before loading, to check that loading
            overwrites everything instead of relying on a fresh object.
        compare: ``compare(from_A, from_B)`` raises on a mismatch (default :func:`assert_same`).

    Returns:
        ``[(k, observe(A, k)), ...]`` for further checks by the caller.

    Raises:
        AssertionError: naming the restore point and the first difference.
    """
    compare = compare or (lambda x, y: assert_same(x, y, "observed future (A = original, B = restored)"))
    make_restored = make_restored or make
    steps = _as_sorted_steps(steps)
    results: list[tuple[int, Any]] = []
    for k in steps:
        try:
            results.append((k, _roundtrip_once(
                make, advance, observe, k,
                use_json=json_roundtrip, use_torch=torch_roundtrip, make_restored=make_restored,
                get_state=get_state, set_state=set_state, check_reloaded_state=check_reloaded_state,
                check_snapshot=check_snapshot,
                advance_before_load=advance_before_load, compare=compare,
            )))
        except AssertionError as err:
            raise AssertionError(f"state round trip after {k} step(s): {err}") from err
    return results


def epoch_ends(epochs: Sequence[Any]) -> list[int]:
    """Restore points right after the last step of each epoch, from the epoch of each step in order: a state
    saved there sits after the epoch's last batch, before the loop that yielded it ends."""
    return [k + 1 for k in range(len(epochs) - 1) if epochs[k] != epochs[k + 1]]


def _as_sorted_steps(steps: Iterable[int]) -> Sequence[int]:
    out = sorted(set(int(k) for k in steps))
    if not out or out[0] < 0:
        raise ValueError(f"steps must be a non-empty collection of ints >= 0, got {out!r}")
    return out


def _roundtrip_once(
    make, advance, observe, k, *, use_json, use_torch, make_restored, get_state, set_state,
    check_reloaded_state, check_snapshot, advance_before_load, compare,
):
    a = make()
    for step in range(k):
        advance(a, step)

    original = get_state(a)
    snapshot = copy.deepcopy(original)
    assert_same(get_state(a), snapshot, "state_dict() called twice")  # taking the state changes nothing
    state = original
    if use_torch:
        state = torch_roundtrip(state)
    state = json_roundtrip(state) if use_json else copy.deepcopy(state)
    loaded = copy.deepcopy(state)

    b = make_restored()
    for step in range(advance_before_load):
        advance(b, step)
    set_state(b, state)
    if check_reloaded_state:
        assert_same(
            get_state(b), loaded, "state_dict() of the restored object vs the state it loaded",
            strict_sequences=not use_json,
        )

    future_a = observe(a, k)
    future_b = observe(b, k)
    compare(future_a, future_b)

    if check_snapshot:
        # The dict A returned must not change as A goes on (no aliasing of internal lists, arrays or
        # tensors), and the dict B loaded must not change as B goes on.
        assert_same(original, snapshot, "state_dict() of A after A went on (it must be a snapshot)")
        assert_same(state, loaded, "the state B loaded, after B went on (load must copy, not alias)")
    return future_a
