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
the stage.

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
from typing import Any, Iterable, List, Tuple

from ddp_eval import sb_compat
from ddp_eval.state import _recording
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

    def note_rebound(self) -> None:
        """Notes the fields a batch bound another value to
        (:meth:`ddp_eval.state._recording.BatchNotes.rebound`)."""
        for _, owner, name, copy, of in self.held:
            if get_value(owner, name) is not copy:
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
        self.held = []


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
