"""The fields of ``hparams`` that hold a watched container hold its recording copy.

A recording copy stands in for a container held at stage start
(:mod:`ddp_eval.state._recording`); a second watched place that holds the same
container (another attribute, a dict's or list's entry) shares it
(:class:`ddp_eval.state._attributes.Slot`). The recipe may also reach it through a
field of ``hparams``, one level deep as :mod:`ddp_eval.state._outside` looks
(``self.hparams.ids``, ``self.hparams.holder.ids``): such a field holds the same
recording copy for the stage, so what a batch does or reads through it is on the
container's one record, and gets the container back (with the merged contents) at
the end. A field a batch bound anew is noted, and named with every place that
held the container if batches changed or read it
(:func:`ddp_eval.state.bookkeeping._name_places_bound_apart`). At the end, an
attribute of the Brain or a field of ``hparams`` a batch bound to a recording copy
(``self.current = self.items``) gets the container back too: no stand-in outlives
the stage. So do the places outside the Brain its code reaches: a closure's
variable of a function the Brain or ``hparams`` holds, a global its batch code
names, and a field of an object of the recipe's own (or a module's global) one
level below (:func:`_places_outside`).

Example
-------
>>> import types
>>> from ddp_eval.state._recording import BatchNotes, recording_copy
>>> ids = []
>>> brain = types.SimpleNamespace(ids=ids, hparams=types.SimpleNamespace(ids=ids))
>>> notes = BatchNotes()
>>> brain.ids = recording_copy(ids, notes)
>>> notes.copies[id(ids)] = (ids, brain.ids, "ids")
>>> shared = SharedCopies(brain, notes)
>>> brain.hparams.ids is brain.ids
True
>>> brain.ids.append("u1"); shared.restore(); brain.hparams.ids is ids
True
"""

import itertools
import types
from typing import Any, Iterable, List, Tuple

from ddp_eval import sb_compat
from ddp_eval.state import _recording
from ddp_eval.state._c_reads import LIBRARIES, of_a_library, reach
from ddp_eval.state._outside import _attributes
from ddp_eval.state._recording import BatchNotes, recordable
from ddp_eval.state._values import get_value


def _hparams_fields(brain: Any) -> Iterable[Tuple[str, Any, str, Any]]:
    """``(label, owner, name, value)`` of the fields of ``brain.hparams``, one level deep."""
    hparams = getattr(brain, "hparams", None)
    for name, obj in _attributes(hparams) if hparams is not None else ():
        yield f"hparams.{name}", hparams, name, obj
        if not sb_compat.holds_scratch_state(obj):
            for inner, value in _attributes(obj):
                yield f"hparams.{name}.{inner}", obj, inner, value


class SharedCopies:
    """The fields of ``hparams`` that hold a watched container's recording copy for the stage.

    Arguments
    ---------
    brain : object
        The recipe's Brain.
    notes : BatchNotes
        The stage's notes, whose ``copies`` are the containers watched and their recording copies.
    """

    def __init__(self, brain: Any, notes: BatchNotes) -> None:
        self.brain = brain
        self.copies = {id(copy): (original, copy) for original, copy, _ in notes.copies.values()}
        self.held: List[Tuple[str, Any, Any, Any, str]] = []  # (label, owner, name, copy, of)
        for label, owner, name, value in _hparams_fields(brain) if _recording.SHARE_COPIES else ():
            if recordable(value) and id(value) in notes.copies:
                original, copy, of = notes.copies[id(value)]
                vars(owner)[name] = copy  # not the owner's __setattr__ (a module's)
                notes.shared.setdefault(id(copy), []).append(label)
                self.held.append((label, owner, name, copy, of))
        self.notes = notes
        self.restored: List[Tuple[str, Any, Any, Any, Any, str]] = []  # given their container back
        self.elsewhere = _hold_copies_elsewhere(brain, notes) if _recording.SHARE_COPIES and notes.copies else []
        for label, _, _, _, copy, _ in self.elsewhere:
            notes.shared.setdefault(id(copy), []).append(label)  # no per-batch probe in its place: the copy

    def note_rebound(self) -> None:
        """Notes the fields a batch bound another value to
        (:meth:`ddp_eval.state._recording.BatchNotes.rebound`)."""
        for _, owner, name, copy, of in self.held:
            if get_value(owner, name) is not copy:
                self.notes.rebound(copy, of)
        for _, place, key, _, copy, of in self.elsewhere:
            if _held(place, key) is not copy:
                self.notes.rebound(copy, of)

    def touched(self) -> List[str]:
        """Labels of the containers several places hold that this rank's batches changed in place."""
        return sorted(label for original, copy, label in self.notes.copies.values()
                      if id(copy) in self.notes.shared and _changed(original, copy))

    def restore(self) -> None:
        """Each field gets its container back (which holds the merged contents), and so
        does any attribute of the Brain or field of ``hparams`` that holds a recording copy."""
        places = itertools.chain(((self.brain, name, value) for name, value in _attributes(self.brain)),
                                 ((owner, name, value) for _, owner, name, value in _hparams_fields(self.brain)))
        for owner, name, value in places:
            original, copy = self.copies.get(id(value), (None, None))
            if copy is not None and value is copy:
                vars(owner)[name] = original
        self.restore_elsewhere()
        for _, place, key, original, _, of in self.restored:  # as in one process: the Brain's container itself
            current = vars(self.brain).get(of, original)
            if current is not original and _held(place, key) is original:
                _put(place, key, current)
        self.held, self.restored = [], []

    def restore_elsewhere(self) -> None:
        """Each cell, global and field outside the Brain gets its container back (a
        function holding it is as at stage start); one a batch bound another value
        to keeps that value."""
        for _, place, key, original, copy, _ in self.elsewhere:
            if _held(place, key) is copy:
                _put(place, key, original)
        self.restored, self.elsewhere = self.restored + self.elsewhere, []


def _hold_copies_elsewhere(brain: Any, notes: BatchNotes) -> List[Tuple[str, Any, Any, Any, Any, str]]:
    """Each closure's cell, module's global and field of an object of the recipe's own
    outside the Brain (:func:`_places_outside`) that holds a watched container gets
    its recording copy for the stage, so that a batch's read through it sees what
    batches added, and is on the record: ``(label, place, key, original, copy, label
    of the container)``."""
    originals = {id(original): (original, copy, of) for original, copy, of in notes.copies.values()}
    swapped = []
    for label, place, key in _places_outside(brain):
        held = _held(place, key)
        if id(held) in originals and originals[id(held)][0] is held:
            original, copy, of = originals[id(held)]
            _put(place, key, copy)
            swapped.append((label, place, key, original, copy, of))
    return swapped


def _places_outside(brain: Any) -> List[Tuple[str, Any, Any]]:
    """``(label, cell or dict, key)`` of the places outside the Brain its code may read
    a container through: the cells of the functions the Brain and ``hparams`` hold
    (``self.count = lambda: len(ids)``), the globals its batch code names, and one level
    down, the fields of an object of the recipe's own or the globals of a module such a
    place holds."""
    found: List[Tuple[str, Any, Any]] = []
    values = [value for _, value in _attributes(brain)] + [value for *_, value in _hparams_fields(brain)]
    for value in values:
        function = getattr(value, "__func__", value)  # a bound method: its function's cells
        for at, cell in enumerate(getattr(function, "__closure__", None) or ()):
            found.append((f"{getattr(function, '__qualname__', 'a function')}'s variable {at}", cell, None))
    for function, name in reach(brain)[2]:
        found.append((f"global {function.__module__}.{name}", function.__globals__, name))
    for label, place, key in list(found):  # one level down
        held = _held(place, key)
        if isinstance(held, types.ModuleType) and held.__name__.split(".")[0] not in LIBRARIES | {"ddp_eval"}:
            found += [(f"global {held.__name__}.{name}", vars(held), name) for name in list(vars(held))]
        elif _of_the_recipe(held) and not hasattr(held, "_ddp_brain_attributes"):
            found += [(f"{label}.{name}", _fields_of(held), name) for name in list(_fields_of(held))]
    return found


def _of_the_recipe(value: Any) -> bool:
    """Whether ``value`` is an object of the recipe's own class, with a ``__dict__``."""
    return type(_fields_of(value)) is dict and not isinstance(value, type) and not of_a_library(type(value))


def _fields_of(value: Any) -> Any:
    try:
        return object.__getattribute__(value, "__dict__")  # no __getattr__ of the object's own runs
    except Exception:  # none
        return None


def _held(place: Any, key: Any) -> Any:
    """What a cell (``key`` None) or a dict holds."""
    if key is None:
        try:
            return place.cell_contents
        except ValueError:  # a cell not filled yet
            return None
    return place.get(key)


def _put(place: Any, key: Any, value: Any) -> None:
    if key is None:
        place.cell_contents = value
    else:
        place[key] = value


def _changed(original: Any, copy: Any) -> bool:
    """Whether the recording ``copy`` holds other contents than the container it stands for
    (still as at stage start: the merged contents are written into it afterwards), by
    value (a ``defaultdict`` as a dict)."""
    if copy.ops or len(copy) != len(original):
        return True
    plain = dict if isinstance(original, dict) else type(original)
    try:
        return bool(plain(copy) != plain(original))
    except Exception:  # entries that do not compare to one bool (tensors): by identity
        if isinstance(original, dict):
            return any(key not in original or value is not dict.__getitem__(original, key)
                       for key, value in dict.items(copy))
        return any(a is not b for a, b in zip(copy, original))
