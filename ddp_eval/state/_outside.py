"""Noticing state that a sharded stage changes outside the Brain.

A recipe may accumulate into objects it reaches through ``self.hparams`` or
the checkpointer, e.g. SpeechBrain's ``HMMAligner`` keeps the alignments it
computes in ``self.hparams.aligner.align_dict``. Under sharding each rank then
holds only its own batches' share. :func:`outside_markers` records, cheaply,
the values of ``self.hparams`` and of the checkpointer's recoverables and their
attributes one level deep (lengths, values, a tensor's identity and ``_version``,
the identities of a dict's values) and, for containers and the recipe's own
objects, a fingerprint of what they hold (``align_dict[k].append(x)``,
``tracker.inner.n += 1``); :func:`changed_outside` names what differs between
stage start and end.
SpeechBrain's decoders are left out: what they keep is per-call scratch. The
globals of the recipe's modules and the class attributes of its classes that the
batch code uses (:func:`reached_outside`) are marked the same way.

Example
-------
>>> import types
>>> aligner = types.SimpleNamespace(align_dict={})
>>> brain = types.SimpleNamespace(hparams=types.SimpleNamespace(aligner=aligner, lr=0.1))
>>> start = outside_markers(brain)
>>> aligner.align_dict["utt1"] = [0, 1]
>>> changed_outside(start, outside_markers(brain))
{'hparams.aligner.align_dict': 'dict gained 1 key(s) (0 -> 1)'}
"""

import collections
import functools
import types
from typing import Any, Dict, Iterable, Mapping, Tuple

import torch

from ddp_eval import sb_compat
from ddp_eval.state._c_reads import of_a_library, reach
from ddp_eval.state._explain import Fingerprint, holds_fields
from ddp_eval.state._values import is_array, is_number

Marker = Tuple[Any, ...]

def _marker(value: Any) -> Any:
    if isinstance(value, list):
        return ("list", id(value), len(value))
    if isinstance(value, dict):
        return ("dict", id(value), len(value), hash(tuple(map(id, value.values()))))
    if is_number(value):
        return ("number", value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    return None


class _Contents:
    """A container's or a recipe object's marker with a fingerprint of what it holds
    (the objects it names by identity kept alive); equal to another of the same."""

    __slots__ = ("key", "fingerprint")

    def __init__(self, shallow: Any, value: Any) -> None:
        self.fingerprint = Fingerprint.of(value)
        self.key = (shallow, self.fingerprint.digest)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Contents) and self.key == other.key

    __hash__ = None


def _by_contents(value: Any) -> bool:
    """Containers and the recipe's own objects (not modules, functions, classes or a
    library's objects, whose fields change as they work)."""
    if isinstance(value, (list, dict, set, tuple, collections.deque, bytearray)) or is_array(value):
        return True
    return holds_fields(value) and not sb_compat.holds_scratch_state(value)


def _full_marker(value: Any) -> Any:
    marker = _marker(value)
    if marker is None and isinstance(value, (str, bytes, bool, complex, type(None))):
        marker = ("value", value)
    return _Contents(marker, value) if _by_contents(value) else marker


def _attributes(obj: Any) -> Iterable[Tuple[str, Any]]:
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType, functools.partial)):
        return ()
    try:
        return list(vars(obj).items())
    except TypeError:  # no __dict__ (builtins, C extension objects)
        return ()


def _roots(brain: Any) -> Iterable[Tuple[str, Any]]:
    hparams = getattr(brain, "hparams", None)
    if hparams is not None:
        yield from ((f"hparams.{k}", v) for k, v in sorted(_attributes(hparams)))
    checkpointer = getattr(brain, "checkpointer", None)
    for name, obj in sorted(getattr(checkpointer, "recoverables", {}).items()):
        yield f"checkpointer.recoverables.{name}", obj
    yield from reached_outside(brain).items()  # globals and class attributes the batch code uses


def reached_outside(brain: Any) -> Dict[str, Any]:
    """State outside the Brain the code its batches run may change: the globals of
    the recipe's modules it names (``global RESULTS``), and the class attributes of
    the recipe's classes it uses (``class ASR.cache``), by label. Functions, classes,
    modules and a library's objects (a logger) are left out.

    Example
    -------
    >>> SEEN = []
    >>> class Recipe:
    ...     cache = {}
    ...     def compute_objectives(self, predictions, batch, stage):
    ...         SEEN.append(batch)
    >>> sorted(reached_outside(Recipe()))
    ['class Recipe.cache', 'global SEEN']
    """
    _, owners, named = reach(brain)
    found = {}
    classes = [cls for owner in owners for cls in type(owner).__mro__]
    for function, name in sorted(named, key=lambda each: (each[0].__module__ or "", each[1])):
        value, module = function.__globals__.get(name), function.__module__
        if isinstance(value, type):
            classes.append(value)
        elif _is_state(value):
            found[f"global {name}" if module == type(brain).__module__ else f"global {module}.{name}"] = value
    for cls in dict.fromkeys(classes):
        if of_a_library(cls):
            continue
        for name, value in vars(cls).items():
            if not name.startswith("__") and _is_state(value):
                found[f"class {cls.__qualname__}.{name}"] = value
    return found


def _is_state(value: Any) -> bool:
    """A value a batch may change: a container, a number, a string, a tensor, an array,
    an object of the recipe's own (not a function, class, module or descriptor, nor
    a library's object)."""
    if value is None or isinstance(value, (list, dict, set, bytearray, collections.deque, int, float, complex, str,
                                           bytes, tuple, torch.Tensor)) or type(value).__module__ == "numpy":
        return True
    return not isinstance(value, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                                  types.MethodType, staticmethod, classmethod, property)) \
        and not of_a_library(type(value))


def outside_markers(brain: Any, skip_ids: Iterable[int] = ()) -> Dict[str, Marker]:
    """``{dotted path: marker}`` of the state reachable from ``brain.hparams``
    and its checkpointer's recoverables, one attribute level deep, and of the
    globals and class attributes the batch code uses
    (:func:`reached_outside`).

    Objects in ``skip_ids`` (e.g. the Brain's own attributes) are left out.
    """
    markers: Dict[str, Marker] = {}
    skipped = set(skip_ids) | {id(brain)}
    seen = set()
    for label, obj in _roots(brain):
        if id(obj) in skipped or sb_compat.holds_scratch_state(obj):
            continue
        if not (obj is None or isinstance(obj, (int, float, complex, str, bytes, tuple))):  # a value: by its place
            if id(obj) in seen:
                continue  # an object two places hold: marked once
            seen.add(id(obj))
        if _marker(obj) is not None or obj is None or isinstance(obj, (
                set, tuple, str, bytes, bool, complex, collections.deque, bytearray)) or is_array(obj):  # itself
            markers[label] = _full_marker(obj)
            continue
        mark = _full_marker if _by_contents(obj) else _marker  # a library's object, a module: as before
        for name, value in _attributes(obj):
            marker = mark(value)
            if marker is not None and id(value) not in skipped:
                markers[f"{label}.{name}"] = marker
    return markers


def _describe(before: Any, after: Any) -> str:
    if isinstance(before, _Contents):
        shallow = after.key[0] if isinstance(after, _Contents) else None
        if before.key[0] is not None and before.key[0] != shallow:
            return _describe(before.key[0], shallow)
        if not isinstance(after, _Contents):
            return "replaced by another object"
        return "what it holds changed (an entry or a field, below what its length shows)"
    if before[0] == "value" and after is not None and after[0] == "value":
        return f"value changed ({before[1]!r} -> {after[1]!r})"
    kind = before[0]
    if after is None or after[0] != kind or (kind != "number" and before[1] != after[1]):
        return "replaced by another object"
    if kind == "list":
        return f"list grew or shrank ({before[2]} -> {after[2]} entries)"
    if kind == "dict":
        if after[2] == before[2]:
            return f"dict values replaced ({after[2]} keys)"
        verb = "gained" if after[2] > before[2] else "lost"
        return f"dict {verb} {abs(after[2] - before[2])} key(s) ({before[2]} -> {after[2]})"
    if kind == "number":
        return f"number changed ({before[1]!r} -> {after[1]!r})"
    return "tensor modified in place"


def changed_outside(start: Mapping[str, Marker], end: Mapping[str, Marker]) -> Dict[str, str]:
    """``{dotted path: what changed}`` between two :func:`outside_markers`."""
    return {label: _describe(marker, end.get(label))
            for label, marker in sorted(start.items()) if end.get(label) != marker}
