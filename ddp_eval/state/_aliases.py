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
the stage. So do the places outside the Brain its code reaches
(:func:`_places_outside`): a closure's variable or a ``functools.partial``'s
argument of a function the Brain or ``hparams`` holds, a dict, list or object
``hparams`` holds, a global its batch code names, and below them, dicts', lists'
and recipe objects' entries; a tuple there is replaced by one like it holding the
copies. A tuple the Brain or ``hparams`` holds cannot be: its container, if batches
change it, is named with it.

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

import collections
import functools
import itertools
import types
from typing import Any, Dict, Iterable, List, Mapping, Set, Tuple

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
    unwatched : set
        Brain attributes no watch follows (those holding metric objects): their entries
        and fields are places too.
    """

    def __init__(self, brain: Any, notes: BatchNotes, unwatched: Set[str] = frozenset()) -> None:
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
        self.elsewhere, self.unseen = (_hold_copies_elsewhere(brain, notes, unwatched) if _recording.SHARE_COPIES
                                       and notes.copies else ([], {}))
        for label, _, _, _, copy, of in self.elsewhere:
            if of is not None:  # of None: a tuple holding copies (its entries are noted)
                notes.shared.setdefault(id(copy), []).append(label)  # no per-batch probe in its place: the copy

    def note_rebound(self) -> None:
        """Notes the fields a batch bound another value to
        (:meth:`ddp_eval.state._recording.BatchNotes.rebound`)."""
        for _, owner, name, copy, of in self.held:
            if get_value(owner, name) is not copy:
                self.notes.rebound(copy, of)
        for _, place, key, _, copy, of in self.elsewhere:
            if of is not None and _held(place, key) is not copy:  # of None: a tuple holding copies
                self.notes.rebound(copy, of)

    def places(self) -> Dict[str, List[str]]:
        """``{label: the other places holding it}`` of each watched container several
        places held at stage start (``{"kept": ["hparams.lists['kept']"]}``)."""
        return {label: sorted(set(self.notes.shared[id(copy)])) for _, copy, label in self.notes.copies.values()
                if id(copy) in self.notes.shared}

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


Swapped = List[Tuple[str, Any, Any, Any, Any, str]]


def _hold_copies_elsewhere(brain: Any, notes: BatchNotes, unwatched: Set[str]) -> Tuple[Swapped, Dict[str, List[str]]]:
    """Each place outside the Brain its code may read a watched container through
    (:func:`_places_outside`) gets the container's recording copy for the stage, so
    that a batch's read through it sees what batches added, and is on the record:
    ``(label, place, key, original, copy, label of the container)``. With them, the
    places that cannot take the copy (a tuple's entries), by the container's label."""
    originals = {id(original): (original, copy, of) for original, copy, of in notes.copies.values()}
    swapped, unseen = [], {}
    places, tuples = _places_outside(brain, originals, unwatched)
    for label, place, key in places:
        held = _held(place, key)
        if id(held) in originals and originals[id(held)][0] is held:
            original, copy, of = originals[id(held)]
            _put(place, key, copy)
            swapped.append((label, place, key, original, copy, of))
    rebuilt: Dict[int, Any] = {}  # id(tuple) -> a tuple like it holding the recording copies, for the stage
    for label, held, at, place, key in tuples:
        if id(held) not in rebuilt:
            rebuilt[id(held)] = _same_kind(held, [originals[id(e)][1] if id(e) in originals and originals[id(e)][0]
                                                  is e else e for e in held])
        like = rebuilt[id(held)] if place is not None else None
        if like is None:  # the Brain's own tuple (its watch holds it), or a kind rebuilt otherwise: named
            unseen.setdefault(originals[id(held[at])][2], []).append(f"{label}[{at}]")
            continue
        if _held(place, key) is held:
            _put(place, key, like)  # a tuple like it, holding the recording copies, for the stage
            swapped.append((label, place, key, held, like, None))
        notes.shared.setdefault(id(like[at]), []).append(f"{label}[{at}]")
    return swapped, unseen


def _same_kind(held: tuple, entries: list) -> Any:
    """A tuple of ``held``'s kind (a namedtuple's too) holding ``entries``, or None."""
    if type(held) is tuple:
        return tuple(entries)
    make = getattr(type(held), "_make", None)
    try:
        return make(entries) if make is not None else None
    except Exception:  # a namedtuple subclass that checks its fields
        return None


_DEPTH = 3  # places below a function's cell or a global the batch code names, looked into
_MOST_ENTRIES = 256  # a larger dict, list or tuple outside the Brain is not looked into
_MOST_PLACES = 10_000  # the walk stops there: a stage start stays cheap
_DICTS = (dict, collections.OrderedDict, collections.defaultdict)


def _places_outside(brain: Any, originals: Mapping[int, Any], unwatched: Set[str] = frozenset()
                    ) -> Tuple[List[Tuple[str, Any, Any]], List[Tuple[str, tuple, int, Any, Any]]]:
    """``(label, place, key)`` of the places outside the Brain its code may read a
    container through, and ``(label, tuple, index, place, key)`` of the tuples'
    entries holding a watched container (``originals``, by id), with the place that
    holds the tuple (None: the Brain or ``hparams``, whose watch holds it). A place is
    a cell (``key`` None), a dict or list and its key, or a :class:`_PartialArgs`.
    The walk starts at the cells, arguments and keywords of the functions and
    partials the Brain and ``hparams`` hold (``self.count = lambda: len(ids)``,
    ``functools.partial(f, ids)``), at the dicts, lists and objects ``hparams``
    holds (``self.hparams.lists["kept"]``) and at the globals the batch code names; it goes
    :data:`_DEPTH` places down through functions, partials, dicts, lists and tuples
    of at most :data:`_MOST_ENTRIES` entries, objects of the recipe's own and (one
    level down) a recipe module's globals, :data:`_MOST_PLACES` places at most;
    never into a watched container. The Brain's ``unwatched`` attributes (holders of
    metric objects) are walked from their entries and fields too."""
    found: List[Tuple[str, Any, Any]] = []
    tuples: List[Tuple[str, tuple, int, Any, Any]] = []
    seen = {id(brain)} | set(originals)

    def note_tuple(label: str, value: Any, place: Any, key: Any) -> None:  # every place holding it
        if isinstance(value, tuple) and len(value) <= _MOST_ENTRIES:
            tuples.extend((label, value, at, place, key) for at, held in enumerate(value)
                          if id(held) in originals and originals[id(held)][0] is held)

    def look_into(label: str, value: Any, depth: int, objects: bool = True) -> None:
        if id(value) in seen or depth > _DEPTH or len(found) > _MOST_PLACES:
            return
        seen.add(id(value))
        if isinstance(value, tuple) and len(value) <= _MOST_ENTRIES:  # no place to put a copy in: looked through
            for at, held in enumerate(value):
                note_tuple(f"{label}[{at}]", held, None, None)  # a tuple in a tuple: named
                look_into(f"{label}[{at}]", held, depth + 1)
        for place_label, place, key in _places_in(label, value, objects, depth <= 1):
            found.append((place_label, place, key))
            note_tuple(place_label, _held(place, key), place, key)
            look_into(place_label, _held(place, key), depth + 1)

    for name, value in _attributes(brain):  # the Brain's own containers and objects are watched: their cells only
        note_tuple(name, value, None, None)
        look_into(name, value, 0, objects=name in unwatched)  # a holder of metric objects: its entries too
    for label, _, _, value in _hparams_fields(brain):  # hparams' dicts, lists and objects are outside the Brain
        note_tuple(label, value, None, None)  # a field of hparams: the Brain's watch may hold it too
        look_into(label, value, 0, objects=not sb_compat.holds_scratch_state(value))
    for function, name in reach(brain)[2]:
        label = f"global {function.__module__}.{name}"
        found.append((label, function.__globals__, name))
        note_tuple(label, function.__globals__.get(name), function.__globals__, name)
        look_into(label, function.__globals__.get(name), 1)
    return found, tuples


def _places_in(label: str, value: Any, objects: bool, modules: bool) -> List[Tuple[str, Any, Any]]:
    """The places ``value`` holds (see :func:`_places_outside`): with ``objects``, a
    dict's, list's and object's of the recipe's own; with ``modules``, a module's."""
    function = getattr(value, "__func__", value)  # a bound method: its function's cells
    places: List[Tuple[str, Any, Any]] = []
    if isinstance(value, functools.partial):
        places += [(f"{label}.args[{at}]", _PartialArgs(value), at) for at in range(len(value.args))]
        places += [(f"{label}.keywords[{key!r}]", value.keywords, key) for key in list(value.keywords)]
        function = value.func
    cells = getattr(function, "__closure__", None) if isinstance(function, types.FunctionType) else None
    places += [(f"{function.__qualname__}'s variable {at}", cell, None) for at, cell in enumerate(cells or ())]
    if not objects:
        return places
    if type(value) in _DICTS and len(value) <= _MOST_ENTRIES:
        places += [(f"{label}[{key!r}]", value, key) for key in list(value)]
    elif type(value) is list and len(value) <= _MOST_ENTRIES:
        places += [(f"{label}[{at}]", value, at) for at in range(len(value))]
    elif isinstance(value, types.ModuleType):
        if modules and value.__name__.split(".")[0] not in LIBRARIES | {"ddp_eval"}:
            places += [(f"global {value.__name__}.{name}", vars(value), name) for name in list(vars(value))]
    elif _of_the_recipe(value) and not hasattr(value, "_ddp_brain_attributes"):
        places += [(f"{label}.{name}", _fields_of(value), name) for name in list(_fields_of(value))]
    return places


class _PartialArgs:
    """The positional arguments of a ``functools.partial`` as a place: an argument is
    set through the partial's ``__setstate__`` (its ``args`` is a tuple)."""

    def __init__(self, partial: functools.partial) -> None:
        self.partial = partial

    def get(self, at: int) -> Any:
        args = self.partial.args
        return args[at] if at < len(args) else None

    def __setitem__(self, at: int, value: Any) -> None:
        func, args, keywords, fields = self.partial.__reduce__()[2]
        self.partial.__setstate__((func, (*args[:at], value, *args[at + 1:]), keywords, fields))


def _of_the_recipe(value: Any) -> bool:
    """Whether ``value`` is an object of the recipe's own class, with a ``__dict__``."""
    return type(_fields_of(value)) is dict and not isinstance(value, type) and not of_a_library(type(value))


def _fields_of(value: Any) -> Any:
    if isinstance(value, (functools.partial, types.FunctionType)):
        return None  # asking makes them one, which a pickle of it then holds
    try:
        return object.__getattribute__(value, "__dict__")  # no __getattr__ of the object's own runs
    except Exception:  # none
        return None


def _held(place: Any, key: Any) -> Any:
    """What a cell (``key`` None), a dict, a list or a :class:`_PartialArgs` holds at ``key``."""
    if key is None:
        try:
            return place.cell_contents
        except ValueError:  # a cell not filled yet
            return None
    if type(place) is list:
        return place[key] if key < len(place) else None
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
