"""Other references to a container the stage watches hold its recording copy.

A recording copy stands in for a container held at stage start
(:mod:`ddp_eval.state._recording`). The recipe may reach the same container
another way: a second attribute (``self.all_ids = self.ids = []``), a field of an
object in ``hparams`` (``self.items = self.hparams.items``), one level deep as
:mod:`ddp_eval.state._outside` looks. Each such reference holds the same
recording copy for the stage, so what a batch does or reads through it is noted
on the one record, and gets the container back (with the merged contents) at the
end, as the attribute does. A reference a batch bound anew is named.

Example
-------
>>> import types
>>> brain = types.SimpleNamespace(ids=[], hparams=types.SimpleNamespace())
>>> brain.every_id = brain.hparams.ids = brain.ids
>>> watched, aliases = split_aliases({"every_id": (brain, "every_id"), "ids": (brain, "ids")})
>>> sorted(watched), aliases
(['every_id'], {'ids': 'every_id'})
"""

import itertools
from typing import Any, Dict, Iterable, List, Mapping, Tuple

from ddp_eval import sb_compat
from ddp_eval.state._outside import _attributes
from ddp_eval.state._recording import recordable
from ddp_eval.state._values import get_value, set_value

Place = Tuple[Any, Any]  # (owner, name)
SHARE_COPIES = True  # other references hold the recording copy (tests switch it off to show that it matters)


def split_aliases(targets: Mapping[str, Place]) -> Tuple[Dict[str, Place], Dict[str, str]]:
    """``(targets to watch, {label: label it aliases})``: of labels whose containers are
    one object, the first in sorted order is watched, the others alias it."""
    first: Dict[int, str] = {}
    watched, aliases = {}, {}
    for label in sorted(targets):
        value = get_value(*targets[label])
        if recordable(value) and id(value) in first and SHARE_COPIES:
            aliases[label] = first[id(value)]
        else:
            watched[label] = targets[label]
            if recordable(value):
                first[id(value)] = label
    return watched, aliases


def _outside_places(brain: Any) -> Iterable[Tuple[str, Any, str, Any]]:
    """``(label, owner, name, value)`` of the fields of ``brain.hparams``, one level deep."""
    hparams = getattr(brain, "hparams", None)
    for name, obj in _attributes(hparams) if hparams is not None else ():
        yield f"hparams.{name}", hparams, name, obj
        if not sb_compat.holds_scratch_state(obj):
            for inner, value in _attributes(obj):
                yield f"hparams.{name}.{inner}", obj, inner, value


class SharedCopies:
    """The references that hold a watched container's recording copy for the stage.

    Arguments
    ---------
    brain : object
        The recipe's Brain (its ``hparams`` are looked at).
    places : dict
        ``{alias label: (owner, name)}`` of the aliases :func:`split_aliases` found.
    copies : dict
        ``{id(original container): (original, recording copy, label)}`` of the containers watched.
    """

    def __init__(self, brain: Any, places: Mapping[str, Place], copies: Mapping[int, Tuple[Any, Any, str]]) -> None:
        self.brain, self.copies = brain, {id(copy): (original, copy) for original, copy, _ in copies.values()}
        self.held: List[Tuple[str, Any, Any, Any, Any, str]] = []  # (label, owner, name, original, copy, of)
        found = [(label, owner, name, get_value(owner, name)) for label, (owner, name) in places.items()]
        found += [place for place in _outside_places(brain) if recordable(place[3]) and SHARE_COPIES]
        for label, owner, name, original in found:
            original, copy, of = copies.get(id(original), (None, None, None))
            if copy is not None:
                _put(owner, name, copy)
                self.held.append((label, owner, name, original, copy, of))

    def rebound(self) -> Dict[str, str]:
        """``{label: why}`` of the references a batch bound another value to, and of the
        values they shared a container with (in one process, what a later batch did
        through the reference went to the new value, not to the container)."""
        found = {}
        for label, owner, name, _, copy, of in self.held:
            if get_value(owner, name) is not copy:
                for named in (label, of):
                    found[named] = (f"{label} held the same container as {of} at stage start (an alias), and a batch "
                                    "bound another value to it: ddp_eval keeps one record per container; bind the "
                                    "two apart in on_stage_start, or change the container in place only")
        return found

    def restore(self) -> None:
        """Each reference gets its container back (which holds the merged contents),
        and so does an attribute of the Brain or a field of ``hparams`` a batch bound to
        a recording copy (``self.current = self.items``): no stand-in outlives the stage."""
        places = [(owner, name, copy) for _, owner, name, _, copy, _ in self.held]
        places += [(owner, name, value) for owner, name, value in itertools.chain(
            ((self.brain, name, value) for name, value in _attributes(self.brain)),
            ((owner, name, value) for _, owner, name, value in _outside_places(self.brain)))
            if id(value) in self.copies]
        for owner, name, copy in places:
            original, expected = self.copies.get(id(copy), (None, None))
            if expected is copy and get_value(owner, name) is copy:
                _put(owner, name, original)
        self.held = []


def _put(owner: Any, name: Any, value: Any) -> None:
    """``owner.name = value`` without the owner's ``__setattr__`` (a module's), or an entry."""
    if isinstance(owner, (dict, list)) or not hasattr(owner, "__dict__"):
        set_value(owner, name, value)
    else:
        vars(owner)[name] = value
