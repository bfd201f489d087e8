"""In-place changes of one object held by a watched attribute, one watch per kind.

A :class:`~ddp_eval.state._attributes.Slot` follows an attribute's identity; its watch
follows what batches do to the object it holds without rebinding it: a list
that grows, a dict whose keys and entries change, a tensor whose ``_version``
moves, a NumPy array whose contents change. Each watch records per batch only
what that batch changed (lengths, increments), gives this rank's state at
stage end or for a journal piece, and writes a merged state back.

A watch created for an object that a batch bound where there was none
(``created_at``) counts what that object holds as that batch's change.

Example
-------
>>> import types
>>> from ddp_eval.state._attributes import Slot
>>> from ddp_eval.state._values import Budget
>>> holder = types.SimpleNamespace(ids=[])
>>> slot = Slot("ids", holder, "ids", Budget(1))
>>> holder.ids += ["u1", "u2"]
>>> slot.observe(0)
>>> slot.watch.state([7.0, float("inf")], 0, False)
([7.0], [2], ['u1', 'u2'])
"""

import array
import collections
import functools
import io
import itertools
import logging
import operator
import types
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ddp_eval import sb_compat
from ddp_eval.state import _recording
from ddp_eval.state._explain import SCALAR_TYPES, Fingerprint, captured_state, of_a_framework, unexplained
from ddp_eval.state._numbers import PROBED_TYPES, is_probe, origin_of, plain, unprobed
from ddp_eval.state._order import as_chunks, growth_since, packed
from ddp_eval.state._probes import Factory
from ddp_eval.state._rebuilt import BYPASSED, in_place_writes, plain_value, read_from
from ddp_eval.state._recording import made_otherwise_than_grown, plain_made
from ddp_eval.state._values import (
    ABSENT,
    MAX_DEPTH,
    SMALL_DICT,
    Budget,
    Kind,
    Op,
    cpu_copy,
    exact_dtype,
    get_value,
    is_array,
    is_metric_object,
    is_mutable,
    nbytes,
    numpy,
    set_value,
    top_label,
)

logger = logging.getLogger(__name__)
# New entries of a dict that gained at most this many keys in the stage get probes from
# the next batch on (counters, stats); later ones (one per utterance, set once) once
# they change again.
EAGER_NEW_KEYS = 16
# A dict entry whose number did not change for this many batches (with probes) is watched
# by identity again; a later change is then seen without a probe (see Slot).
QUIET_BATCHES = 8
_warned_over_budget = set()  # labels warned about once per process

# an entry set anew where entries are not watched one by one (self.x[a][b][c] += 1) sends its dict's record up
# to the attribute's, so the merge sees it (tests switch it off to show that it matters)
SETS_BELOW_GO_UP = True


class Watch:
    """No in-place changes seen (numbers, strings, tuples, other objects)."""

    compared = False  # an entry a batch compared (a dict's or list's): its record is merged even if unchanged
    read_unseen = False  # changed in place by calls ddp_eval cannot see, which may also have read it

    def __init__(self, slot: Any, obj: Any, created_at: Optional[int] = None) -> None:
        self.slot, self.obj = slot, obj
        self.last_change: int = -1  # the newest batch that changed the object in place
        # what must still hold at stage end (see finish); the other watches record changes themselves
        self.marker = _marker(obj) if type(self) is Watch else None

    def before_batch(self) -> None:
        pass

    def holds(self, value: Any) -> bool:
        """Whether the attribute's ``value`` is the object this watch follows."""
        return value is self.obj

    def observe(self, batch: int, value: Any) -> bool:
        return False

    def release(self) -> None:
        """Takes away what the watch put in the user's objects (a dict's factory)."""

    def changes_after(self, batch: int) -> bool:
        return self.last_change > batch

    def kind(self) -> Optional[Kind]:
        return None

    def state(self, positions: Sequence[float], from_batch: int, piece: bool) -> Any:
        return None

    def finish(self) -> None:
        """At stage end: an object whose contents changed although nothing was recorded is named."""
        if unexplained(self.marker, self.obj) and isinstance(self.obj, io.IOBase):
            self.slot.fail(f"a {type(self.obj).__name__} that batches wrote to or moved in, which ddp_eval cannot "
                           "merge (each rank holds its own batches' lines); append the lines to a list (merged in "
                           "batch order) and write them in on_stage_end, or write a file opened as "
                           "open(self.stage_output(path), 'a')")
        elif self.marker is not None and self.marker.unread() and self.marker.matches(self.obj):
            self.read_unseen = True  # whether a batch changed or read it is unknown: what it may have steered too
            self.slot.fail(f"a {type(self.obj).__name__} ddp_eval cannot read (it cannot be pickled and keeps its "
                           "state out of reach), so whether batches changed or read it is unknown, and what they "
                           "computed from it may be each rank's own; keep it out of the batches (list it in "
                           "ddp_eval: attributes_exclude if no batch uses it), or keep what batches compute in a list")
        elif unexplained(self.marker, self.obj) and is_metric_object(self.obj):
            self.slot.fail(f"a {type(self.obj).__name__} held where ddp_eval does not look for metric objects, "
                           "which batches changed; hold it as an attribute, in a dict attribute (two levels down "
                           "at most: self.metrics[stage]['wer']) or in a field of an object of the recipe's own "
                           "(self.trackers.wer), created in on_stage_start")
        elif unexplained(self.marker, self.obj):
            self.read_unseen = True  # a random generator: what batches drew from it went elsewhere unseen
            held = " (what its closure, defaults, arguments or object hold)" if captured_state(self.obj) else ""
            self.slot.fail(f"a {type(self.obj).__name__} whose contents{held} changed in place, which ddp_eval does "
                           "not record (it merges lists that grow, dicts, numbers, tensors and NumPy arrays); "
                           "keep the state in one of those, as an attribute, or compute it in on_stage_end")

    def apply(self, kind: Kind, data: Any, last_value: Callable[[], Any]) -> None:
        raise AssertionError(f"no in-place merge for {kind}")  # a Slot applies FOLD and LAST itself


def _marker(obj: Any, depth: int = 4) -> Optional[Fingerprint]:
    """The fingerprint of an object no watch follows (tuples, sets, plain objects),
    checked at stage end; None for what cannot change or is watched otherwise."""
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, type, torch.nn.Module)):
        return None
    if sb_compat.holds_scratch_state(obj) or (callable(obj) and captured_state(obj) is None
                                              and not is_plain_object(obj)):  # len, a class, a C function
        return None
    return Fingerprint.of(obj, depth)


class SharingWatch(Watch):
    """A place that holds, at stage start, a container another watched place holds
    (``self.every_id = self.ids``, ``{"valid": self.ids}``): the other place's record
    follows its changes, whichever place they go through; this one only whether a
    batch binds another value to it (:meth:`ddp_eval.state._attributes.Slot.finish`)."""

    def __init__(self, slot: Any, obj: Any, created_at: Optional[int] = None) -> None:
        super().__init__(slot, obj)
        self.marker = None

    def finish(self) -> None:
        pass


class BoundWatch(Watch):
    """An object a batch bound anew (``self.last_batch = ...``): all that matters
    is whether a later batch changes it in place (then it cannot be merged), so
    only its size (a container's length, a tensor's ``_version``) is kept."""

    def __init__(self, slot: Any, obj: Any, created_at: Optional[int] = None) -> None:
        super().__init__(slot, obj)
        self.size = _size(obj)
        # a tuple: its entries' identities and lengths; a holder object: its own attributes, one level deep
        self.marker = (_entries_marker(obj) if type(obj) is tuple else _marker(obj, depth=1)) if self.size is None \
            else None

    def finish(self) -> None:
        if type(self.obj) is tuple:
            if self.marker != _entries_marker(self.obj):
                self.slot.fail("a tuple a batch bound to it, whose entries later changed in place")
        else:
            super().finish()

    def observe(self, batch: int, value: Any) -> bool:
        size = _size(value)
        if size == self.size:
            return False
        self.size, self.last_change = size, batch
        return True


def _entries_marker(obj: tuple) -> tuple:
    """A tuple's entries by identity, and the lengths of those that are containers."""
    return tuple((id(x), len(x) if isinstance(x, (list, dict, set)) else -1) for x in obj)


def _size(obj: Any) -> Any:
    """What an in-place change of a bound object changes: a container's length, a
    tensor's ``_version``, a NumPy array's checksum (it has no version)."""
    if isinstance(obj, (list, dict, set)):
        return len(obj)
    if is_array(obj):
        return zlib.crc32(numpy.ascontiguousarray(obj).data)
    return obj._version if isinstance(obj, torch.Tensor) else None


class ListWatch(Watch):
    """A list that grows: its new entries, cut per batch (``APPEND``). A list that
    held at most :data:`~ddp_eval.state._values.SMALL_DICT` entries at stage start
    (``[0] * n_classes``, ``[[]]``) also has those entries watched one by one,
    as a dict's are (``hist[label] += 1``, ``targets[0].extend(refs)``):
    ``ITEMS``, its growth and its entries' changes."""

    def __init__(self, slot: Any, obj: list, created_at: Optional[int] = None) -> None:
        super().__init__(slot, obj)
        self.start_len = 0 if created_at is not None else len(obj)
        self.length = self.start_len
        self.changes = array.array("q")  # batch, length after it, batch, length, ...
        self.pieces: list = []  # what batches appended, read right after each (checked at stage end)
        watched = created_at is None and 0 < len(obj) <= SMALL_DICT and slot.depth < MAX_DEPTH and \
            isinstance(obj, list)
        self.entries = {i: _entry(self, i, obj[i]) for i in range(len(obj))} if watched else {}
        self.active = {i for i, entry in self.entries.items() if entry.busy()}
        self.idle = None  # the entries not in active, and their objects (see _idle_moved)
        self.at_batch_start: Optional[Tuple[int, int]] = None  # (length, explained) of a recording copy
        # entries held at stage start and not watched one by one: they must stay as they were
        self.kept = Fingerprint.of(obj) if created_at is None and obj and not watched else None
        if created_at is not None and obj:
            self.observe(created_at, obj)

    def before_batch(self) -> None:
        for i in self.active:
            self.entries[i].before_batch()
        obj = self.obj  # a recording copy: how long it is, and what its methods explain of that
        self.at_batch_start = (list.__len__(obj), obj.explained) if isinstance(obj, list) and \
            _recording.is_recording(obj) else None

    def release(self) -> None:
        for entry in self.entries.values():
            entry.release()
        _without_moved_probes(self)

    def observe(self, batch: int, value: list) -> bool:
        changed = False
        start, self.at_batch_start = self.at_batch_start, None
        if start is not None and value is self.obj and len(value) - start[0] != value.explained - start[1]:
            self.slot.fail(f"its length changed by {BYPASSED}, not by its own methods: on a rank it holds that "
                           f"rank's batches' entries in that rank's order; {_recording.REMEDY[list]}")
            return True
        if len(value) < self.length:
            self.slot.fail("entries were removed from the list")
            return True
        if len(value) > self.length:
            self.pieces.extend(value[self.length:])
            self.length = len(value)
            self.changes.extend((batch, self.length))
            changed = True
        if self.entries:
            changed = _look_at_entries(self, batch, value, set()) or changed
        if changed:
            self.last_change = batch
        return changed

    def kind(self) -> Optional[Kind]:
        if self.last_change < 0 and not self.compared:
            return None
        return Kind.ITEMS if self.entries else Kind.APPEND

    def finish(self) -> None:
        """Replay equality: the list must hold its stage-start entries (as the record
        says) followed by what each batch appended, read right after it (by identity)."""
        _finish_entries(self)
        if self.slot.why is None and _recording.ENABLED and (len(self.obj) != self.start_len + len(self.pieces) or any(
                map(operator.is_not, itertools.islice(self.obj, self.start_len, None), self.pieces))):
            self.slot.fail("the entries batches appended were later reordered or replaced in place, which "
                           "ddp_eval cannot replay in one process's order; append only, and sort or edit the "
                           "list in on_stage_end")
        if self.slot.why is None and unexplained(self.kept, self.obj[: self.start_len]):
            why = _why_not_one_by_one(self.slot, f"more than {SMALL_DICT}")
            self.slot.fail(f"entries it held at stage start ({why}, so not watched one by one) were changed in "
                           "place, which ddp_eval does not record for such lists; keep per-class counts in a tensor "
                           "or a dict, or compute them in on_stage_end")

    def state(self, positions: Sequence[float], from_batch: int, piece: bool) -> Any:
        batches, bounds = growth_since(self.changes, from_batch, self.start_len)
        added = as_chunks(positions, batches, bounds, packed([plain(x) for x in self.obj[bounds[0]: bounds[-1]]])
                          ) if batches else None
        if not self.entries:
            return added
        entries = {}
        for i, entry in self.entries.items():
            change = entry.change(positions, from_batch, piece)
            if change is not None:
                entries[i] = change
        return {"added": added, "entries": entries} if added or entries else None

    def apply(self, kind: Kind, merged: Any, last_value: Callable[[], Any]) -> None:
        items, entries = merged if kind is Kind.ITEMS else (merged, {})
        current = get_value(self.slot.owner, self.slot.name)
        if not isinstance(current, (list, bytearray)):
            current = []
            set_value(self.slot.owner, self.slot.name, current)
        del current[self.start_len if current is self.obj else 0:]
        current.extend(items)
        for i, (entry_kind, data) in entries.items():
            entry = self.entries[i]
            entry.apply(entry_kind, data, lambda label=entry.label: last_value(label))


def _without_moved_probes(watch: Any) -> None:
    """An entry's probe a batch moved to another place of the container (``insert``,
    ``d[k2] = d.pop(k1)``), which its own slot does not hold, and one a ``get`` default
    or a factory handed out that no slot took (the dict was named first: ``d.clear()``,
    then ``d[k] = d.get(k, 0) + 1``): the plain number back."""
    held = get_value(watch.slot.owner, watch.slot.name)
    if not isinstance(held, (list, dict)) or holds_stand_ins(
            dict.values(held) if isinstance(held, dict) else list.__iter__(held)):
        unprobed(held, [], depth=1, handed=True)


_PLAIN = SCALAR_TYPES | {list, dict, tuple, set, frozenset, torch.Tensor} | (
    {numpy.ndarray} if numpy is not None else set())


def _types_of(values: Iterable[Any]) -> set:
    """The exact types of ``values``, gathered at C speed (a large dict's values at
    the stage edges)."""
    return set(map(type, values))


def holds_stand_ins(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` may be a stand-in (a probe, a recording copy: no
    plain type), so that a stage-end sweep of a large container looks only where one is."""
    return not _types_of(values) <= _PLAIN


def _entry(watch: Watch, key: Any, start: Any) -> Any:
    """A slot for one entry of a watched dict or list."""
    slot = watch.slot
    return type(slot)(f"{slot.label}[{key!r}]", watch.obj, key, slot.budget, start=start, depth=slot.depth + 1,
                      notes=slot.notes)


def _idle_moved(watch: Any, value: Any) -> bool:
    """Whether an entry not looked at every batch holds another object now: one
    identity comparison per entry, at C speed (``watch.idle`` caches the keys and
    objects, dropped whenever they may change)."""
    if watch.idle is None:
        keys = tuple(k for k in watch.entries if k not in watch.active)
        watch.idle = (keys, [watch.entries[k].obj for k in keys])
    keys, objects = watch.idle
    now = map(value.get, keys, itertools.repeat(ABSENT)) if isinstance(value, dict) else map(value.__getitem__, keys)
    return any(map(operator.is_not, now, objects))  # dict.get: no defaultdict factory


def _look_at_entries(watch: Any, batch: int, value: Any, adopted: set) -> bool:
    """Observes the entries of a dict or list watch that need a look: those with
    probes or containers, and the others whose object changed."""
    changed, active = False, watch.active
    looked = [(k, watch.entries[k]) for k in active if k not in adopted]
    if _idle_moved(watch, value):
        watch.idle = None  # the entries observed below hold new objects
        if isinstance(value, dict):
            get = value.get  # dict.get: no defaultdict factory
            looked += [(k, e) for k, e in watch.entries.items() if k not in active and get(k, ABSENT) is not e.obj]
        else:
            looked += [(k, e) for k, e in watch.entries.items() if k not in active and value[k] is not e.obj]
    for key, entry in looked:
        before = entry.changed_batches
        entry.observe(batch)
        watch.compared = watch.compared or entry.compared  # its record goes to the merge, which checks it
        if entry.why is not None:
            watch.slot.fail(f"its entry {key!r}: {entry.why}")
            return True
        if entry.changed_batches != before:
            changed, entry.quiet = True, 0
        else:
            entry.quiet += 1
        if entry.busy() and not (entry.depth and entry.quiet > QUIET_BATCHES and not is_mutable(entry.obj)):
            if key not in active:
                active.add(key)
                watch.idle = None
        elif key in active:  # a number that stopped changing (one per utterance) is watched by identity again
            active.discard(key)
            entry.hot = entry.hot and not entry.quiet > QUIET_BATCHES
            watch.idle = None
        else:
            entry.hot = entry.hot and not entry.quiet > QUIET_BATCHES
    if adopted:
        active.update(adopted)
        watch.idle = None
    return changed


def _why_not_one_by_one(slot: Any, otherwise: str) -> str:
    """Why a container's entries are not watched one by one, for an error: its depth, or ``otherwise``."""
    return f"{slot.depth} levels below the attribute" if slot.depth >= MAX_DEPTH else otherwise


def _finish_entries(watch: Any) -> None:
    for key, entry in watch.entries.items():
        entry.watch.finish()
        if entry.why is not None:
            watch.slot.fail(f"its entry {key!r}: {entry.why}")
        elif SETS_BELOW_GO_UP and (entry.watch.compared or (isinstance(entry.watch, DictWatch)
                                                            and entry.watch._replaced())):
            watch.compared = True  # below it, a key past those watched one by one set anew: its record goes up


class DictWatch(Watch):
    """A dict: keys it gains, in insertion order, and what batches do to its
    entries, each watched as an attribute of its own (``KEYS``). Entries past
    the first :data:`~ddp_eval.state._values.SMALL_DICT` are taken as they are at stage
    end (per-utterance results, set once); entries present at stage start and
    not watched are checked for a new value once, at stage end."""

    def __init__(self, slot: Any, obj: dict, created_at: Optional[int] = None) -> None:
        super().__init__(slot, obj)
        self.start_len = 0 if created_at is not None else len(obj)
        self.length = self.start_len
        self.added = array.array("q")  # batch, length after it, ...: new keys, as a list of keys
        self.room = SMALL_DICT if slot.depth < MAX_DEPTH else 0  # entries watched one by one
        keys = list(itertools.islice(obj, self.room)) if created_at is None else []
        self.entries = {key: _entry(self, key, obj[key]) for key in keys}
        self.active = {key for key, entry in self.entries.items() if entry.busy()}  # looked at every batch
        self.idle = None  # the entries not in active, and their objects (see _idle_moved)
        # entries past the first ones: (key, value) compared by identity at stage end, and the
        # fingerprints of those that could change in place (none for numbers and strings)
        self.later_keys = list(itertools.islice(obj, self.room, None)) if created_at is None else []
        self.later_starts = list(map(dict.__getitem__, itertools.repeat(obj), self.later_keys))
        self.marked = [] if _types_of(self.later_starts) <= SCALAR_TYPES else [
            (key, value, marker) for key, value in zip(self.later_keys, self.later_starts)
            if (marker := _marker(value)) is not None]
        self.factory = None
        if isinstance(obj, collections.defaultdict) and obj.default_factory is not None:
            holder = slot.label.split("[")[0].split(".")[0]  # what a read of a list the factory made reads
            self.factory = obj.default_factory = Factory(obj.default_factory, slot.notes, holder)
        if created_at is not None and obj:
            self.observe(created_at, obj)

    def before_batch(self) -> None:
        if self.factory is not None:
            self.factory.unprobe()  # fields of objects it made that no watch took over
            self.factory.made.clear()
        if getattr(self.obj, "handed", None):
            self.obj.handed.clear()
        for key in self.active:  # the others hold what they held: nothing to prepare
            self.entries[key].before_batch()

    def release(self) -> None:
        for key, held in list(dict.items(self.obj)) if holds_stand_ins(dict.values(self.obj)) else ():
            if _recording.is_recording(held) and held.made:  # made this batch, where no look took it back
                dict.__setitem__(self.obj, key, plain_made(held))
            elif getattr(getattr(held, "_ddp_record", None), "made", False):
                dict.__setitem__(self.obj, key, plain_value(held))
        if self.factory is not None:
            self.factory.unprobe()
        if self.factory is not None and self.obj.default_factory is self.factory:
            self.obj.default_factory = self.factory.original
        for entry in self.entries.values():
            entry.release()
        _without_moved_probes(self)

    def observe(self, batch: int, value: dict) -> bool:
        changed, adopted = False, set()
        if len(value) < self.length:
            self.slot.fail("keys were removed from the dict")
            return True
        if len(value) > self.length:
            new = list(itertools.islice(reversed(value), len(value) - self.length))[::-1]
            self.length = len(value)
            self.added.extend((batch, self.length))
            room = max(self.room - len(self.entries), 0)
            handed = getattr(self.obj, "handed", None)  # max(d.get(k, 0.0), x): the default read, not just added to
            read_default = "a read of the default d.get(k, default) gave" if handed and any(
                getattr(default, "_used", False) for default in handed.values()) else None
            for index, key in enumerate(new):
                held = dict.__getitem__(value, key)
                kept, did = self._plain_made(held)  # a container made for it this batch: the plain one back
                if kept is not held:
                    dict.__setitem__(value, key, kept)
                if index >= room:
                    continue
                self.idle = None
                entry = self.entries[key] = _entry(self, key, ABSENT)
                entry.hot = self.length - self.start_len <= EAGER_NEW_KEYS  # few new keys: counters, stats
                made = self._made(held)
                if did is not None or read_default:
                    self.slot.notes.made.setdefault(entry.label, []).append(did or read_default)
                if made is not None:
                    entry.adopt(batch, kept, kept if made[0] is held else made[0], made[1], factory=self.factory)
                    adopted.add(key)
            changed = True
        changed = _look_at_entries(self, batch, value, adopted) or changed
        if changed:
            self.last_change = batch
        return changed

    def _plain_made(self, held: Any) -> Tuple[Any, Optional[str]]:
        """``(held, None)``, or for a container, tensor or array made for a new key this
        batch (setdefault's default, the factory's) its plain value and what the batch
        did to it besides growing it ("": nothing)."""
        if _recording.is_recording(held) and held.made:
            return plain_made(held), made_otherwise_than_grown(held) or ""
        if self.factory is not None and hasattr(type(held), "_ddp_plain") and id(held) in self.factory.made:
            did = ", ".join(in_place_writes(held)) or ("a read of what it held" if read_from(held, False) else "")
            return plain_value(held), did
        return held, None

    def _made(self, value: Any) -> Any:
        """``(initial value, ops)`` of a new entry its defaultdict's factory made, or
        of a new count of a Counter (which counts from 0); else None."""
        if self.factory is not None:
            made = self.factory.origin(value)
            if made is not None:
                return made
        handed = getattr(self.obj, "handed", None)  # d.get(k, 0) + 1, d.setdefault(k, []): a recording dict's
        if handed and is_probe(value) and id(value._origin) in handed:
            return origin_of(handed[id(value._origin)], value)
        if handed and handed.get(id(value)) is value:
            return value, []
        if isinstance(self.obj, collections.Counter) and type(value) in PROBED_TYPES:
            return 0, [(Op.ADD, value)]
        return None

    def kind(self) -> Optional[Kind]:
        return Kind.KEYS if self.last_change >= 0 or self.compared or self._replaced() else None

    def _replaced(self) -> Dict[Any, Any]:
        now = map(dict.get, itertools.repeat(self.obj), self.later_keys, itertools.repeat(ABSENT))
        return {key: self.obj[key] for key in itertools.compress(  # compared at C speed
            self.later_keys, map(operator.is_not, now, self.later_starts))}

    def finish(self) -> None:
        self.release()
        _finish_entries(self)
        for key, start, marker in self.marked:  # entries past the first 64: replaced, or as they were
            if self.slot.why is None and dict.get(self.obj, key, ABSENT) is start and unexplained(marker, start):
                why = _why_not_one_by_one(self.slot, f"past the first {SMALL_DICT}")
                self.slot.fail(f"its entry {key!r} ({why}, so not watched one by one) changed in place; ddp_eval "
                               "takes such entries as set once: keep per-key state that grows in a dict of at most "
                               f"{SMALL_DICT} keys, at most two levels below the attribute (self.x[a][b], "
                               "self.x.d[a]), or compute it in on_stage_end")

    def state(self, positions: Sequence[float], from_batch: int, piece: bool) -> Any:
        batches, bounds = growth_since(self.added, from_batch, self.start_len)
        keys = list(itertools.islice(self.obj, bounds[0], bounds[-1])) if batches else []
        entries = {}
        for key, entry in self.entries.items():
            change = entry.change(positions, from_batch, piece)
            if change is not None:
                entries[key] = change
        taken = {key: plain(self.obj[key]) for key in keys if key not in entries}  # set once, or made empty
        replaced = {} if piece else self._replaced()
        if not (keys or entries or replaced):
            return None
        return {"added": as_chunks(positions, batches, bounds, keys), "entries": entries,
                "taken": taken, "replaced": replaced}

    def apply(self, kind: Kind, merged: Any, last_value: Callable[[str], Any]) -> None:
        """``merged``: the new keys in merged order, the merged changes of watched
        entries, and the values of the others (new, or replaced at start keys)."""
        order, entries, taken = merged
        current = self.obj
        held = {key: current.pop(key) for key in list(itertools.islice(current, self.start_len, None))}
        for key in order:  # new keys in one process's insertion order; this rank's objects kept
            if key in held or key in taken or key in entries:
                current[key] = held[key] if key in held else taken.get(key)
        for key, value in taken.items():
            if key not in held:
                current[key] = value
        for key, (entry_kind, data) in entries.items():
            entry = self.entries.get(key) or _entry(self, key, ABSENT)
            entry.apply(entry_kind, data, lambda label=entry.label: last_value(label))


class ObjectWatch(DictWatch):
    """A plain object of the recipe's own (a dataclass, a ``SimpleNamespace``, any
    object with a ``__dict__`` that is not a module, a metric object or code): its
    fields, watched and merged as a dict's entries are (``KEYS`` of its
    ``__dict__``). One a ``defaultdict``'s factory made during the stage starts
    from what the factory made, its number fields probed from the start."""

    def __init__(self, slot: Any, obj: Any, created_at: Optional[int] = None, factory: Any = None) -> None:
        self.target, self.maker = obj, factory
        super().__init__(slot, vars(obj), created_at)

    def holds(self, value: Any) -> bool:
        return value is self.target

    def observe(self, batch: int, value: Any) -> bool:
        return super().observe(batch, value if value is self.obj else vars(value))

    def _made(self, value: Any) -> Any:
        """``(initial value, ops)`` of a number field of an object the factory made this batch."""
        return None if self.maker is None else self.maker.field_origin(self.target, value)


def is_plain_object(value: Any) -> bool:
    """Whether ``value`` is an object of the recipe's own whose fields ddp_eval watches
    (see :class:`ObjectWatch`)."""
    own = getattr(value, "__dict__", None)
    return (isinstance(own, dict) and not isinstance(value, _CONTAINERS) and captured_state(value) is None
            and not isinstance(value, (type, torch.nn.Module, types.FunctionType))
            and (not callable(value) or _calls_python(type(value)))
            and not sb_compat.holds_scratch_state(value) and not is_metric_object(value)
            and not of_a_framework(value)
            and all(cls in _DICT_ONLY or cls.__dictoffset__ or cls.__dict__.get("__slots__") == ()
                    for cls in type(value).__mro__))


def _calls_python(kind: type) -> bool:
    """Whether ``kind``'s ``__call__`` is a Python function (a recipe's own class), not a
    C slot (a ``functools`` cache)."""
    own = next((vars(cls)["__call__"] for cls in kind.__mro__ if "__call__" in vars(cls)), None)
    return isinstance(own, types.FunctionType)


# a base class whose instances have no __dict__ keeps state the __dict__ does not show (random.Random's
# generator, in C): such an object is compared whole, by a digest of its pickled state (_explain)
_DICT_ONLY = (object, types.SimpleNamespace)


_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque, bytearray, str, bytes, int, float, complex)


class SetWatch(Watch):
    """A set that batches add elements to (``add``, ``update``, ``|=``; other
    operations are named by its recording copy): the elements it gained,
    merged as a union (``UNION``)."""

    def __init__(self, slot: Any, obj: set, created_at: Optional[int] = None) -> None:
        super().__init__(slot, obj)
        self.length = 0 if created_at is not None else len(obj)
        self.start = set() if created_at is not None else set(obj)  # elements, not a copy of what they hold
        # made during the stage, it has no recording copy: its elements, to see one removed (O(len) a batch)
        self.elements = set(obj) if created_at is not None else None
        if created_at is not None and obj:
            self.last_change = created_at

    def observe(self, batch: int, value: Any) -> bool:
        if self.elements is not None and self.slot.why is None:
            if set.__eq__(self.elements, value):
                return False
            if not self.elements <= value:
                self.slot.fail("elements were removed from the set")
            self.elements = set(value)
        elif len(value) == self.length:
            return False
        if len(value) < self.length:
            self.slot.fail("elements were removed from the set")
        self.length, self.last_change = len(value), batch
        return True

    def kind(self) -> Optional[Kind]:
        return Kind.UNION if self.last_change >= 0 else None

    def state(self, positions: Sequence[float], from_batch: int, piece: bool) -> Any:
        return {plain(x) for x in self.obj if x not in self.start}

    def apply(self, kind: Kind, merged: Any, last_value: Callable[[], Any]) -> None:
        self.obj |= merged


class TensorWatch(Watch):
    """A tensor of fixed shape changed in place (``_version``): integers as one
    increment per rank (``SUM``), floats as per-batch increments within the
    memory budget, else one total per rank (``ACCUMULATE``)."""

    def __init__(self, slot: Any, obj: Any, created_at: Optional[int] = None) -> None:
        super().__init__(slot, obj)
        self.spec = (obj.shape, obj.dtype)
        self.version = obj._version
        self.base = None  # the start value on the CPU; None with a zero start
        self.zero_start = created_at is not None or not _any(obj)
        self.previous = None  # the value after the previous change (float increments)
        self.batches: List[int] = []
        self.increments: Optional[bytearray] = bytearray()
        self.totals = False  # over budget: one total per rank
        self.mark: Any = None  # the value at the previous journal piece
        self.changed = False
        if not self.zero_start and slot.budget.reserve(nbytes(obj)):
            self.base = cpu_copy(obj)
        if created_at is not None:
            self._changed(created_at, obj)

    def observe(self, batch: int, value: Any) -> bool:
        if value._version == self.version:
            return False  # unchanged: no copy, no comparison
        if (value.shape, value.dtype) != self.spec:
            self.slot.fail("a tensor that changed shape or dtype in place")
            return True
        if self.base is None and not self.zero_start:
            mb = nbytes(value) / 2**20
            self.slot.fail(f"a {mb:.0f} MB tensor changed in place, and ddp_eval: attribute_memory_mb "
                           f"({self.slot.budget.total / 2**20:g} MB) had no room for its start copy; raise it, "
                           "or list the attribute in attributes_exclude")
            return True
        self.version = value._version
        self._changed(batch, value)
        return True

    def look_by_value(self) -> None:
        """The next :meth:`observe` compares values: the tensor may have changed
        without moving its ``_version`` (through ``.data``)."""
        if not torch.equal(self.obj.detach().cpu(), self._last_value()):
            self.version = None

    def _last_value(self) -> torch.Tensor:
        """What the record says the tensor holds now (its value after the last change seen)."""
        if self.previous is not None:
            return self.previous
        if self.base is not None and not self.changed:
            return self.base
        return torch.zeros(self.spec[0], dtype=self.spec[1]) if self.zero_start and not self.changed else \
            self.obj.detach().cpu()  # an exact dtype changed before, or over budget: totals at stage end

    def finish(self) -> None:
        """Replay equality: a tensor whose ``_version`` did not move since the last
        change seen must hold what the record says (a write through ``.data`` or
        ``.numpy()`` moves no version)."""
        if self.obj._version != self.version or (self.base is None and not self.zero_start) or not _recording.ENABLED:
            return
        if self.changed and (exact_dtype(self.obj) or self.totals):
            return  # one increment per rank, read from the value at stage end
        if not torch.equal(self.obj.detach().cpu(), self._last_value()):
            self.slot.fail("it changed in place without moving its _version (a write through .data or "
                           ".numpy()), which ddp_eval does not see batch by batch; change it with +=, add_() or "
                           "index_add_(), or compute it in on_stage_end")

    def _changed(self, batch: int, value: Any) -> None:
        self.changed, self.last_change = True, batch
        if exact_dtype(value) or self.totals:
            return  # one increment per rank, taken at stage end
        current = value.detach().cpu()
        before = self.previous if self.previous is not None else self.base
        increment = current.clone() if before is None else current - before
        if not self.slot.budget.reserve(nbytes(increment)):
            self._switch_to_totals()
            return
        self.increments += increment.contiguous().reshape(-1).view(torch.uint8).numpy().data
        self.batches.append(batch)
        if self.previous is None:
            self.previous = cpu_copy(value)
        else:
            self.previous.copy_(current)

    def _switch_to_totals(self) -> None:
        self.slot.budget.release(len(self.increments))
        self.increments, self.previous, self.totals = None, None, True
        _warn_over_budget(self.slot.label, self.slot.budget)

    def kind(self) -> Optional[Kind]:
        if not self.changed:
            return None
        return Kind.SUM if exact_dtype(self.obj) else Kind.ACCUMULATE

    def _stacked(self, first: int) -> torch.Tensor:
        count = len(self.batches) - first
        row = len(self.increments) // max(len(self.batches), 1)
        part = self.increments[first * row:]
        flat = torch.frombuffer(part, dtype=torch.uint8) if part else torch.empty(0, dtype=torch.uint8)
        return flat.view(self.spec[1]).reshape(count, *self.spec[0]).clone()

    def state(self, positions: Sequence[float], from_batch: int, piece: bool) -> Any:
        kind = self.kind()
        if kind is Kind.SUM or self.totals:
            end = cpu_copy(self.obj)
            before = self.mark if piece and self.mark is not None else self.base
            if piece:
                self.mark = end
            delta = end if before is None else end - before
            return delta if kind is Kind.SUM else ("total", delta)
        if piece:
            self.mark = cpu_copy(self.obj)  # where a later total (over budget) starts
        first = next((i for i, b in enumerate(self.batches) if b >= from_batch), len(self.batches))
        if piece and first == len(self.batches):
            return None
        return ("batches", [positions[b] for b in self.batches[first:]], self._stacked(first))

    def apply(self, kind: Kind, data: Any, last_value: Callable[[], Any]) -> None:
        value = self.base if self.base is not None else (None if self.zero_start else cpu_copy(self.obj))
        for increment in (data if kind is Kind.ACCUMULATE else [data]):
            value = increment.clone() if value is None else value + increment
        current = get_value(self.slot.owner, self.slot.name)
        if isinstance(current, torch.Tensor) and (current.shape, current.dtype) == (value.shape, value.dtype):
            with torch.no_grad():
                current.copy_(value)  # in place: other holders of the tensor see it too
        else:
            set_value(self.slot.owner, self.slot.name, value)


def _warn_over_budget(label: str, budget: Budget) -> None:
    """Once per process and attribute: per-batch increments no longer fit."""
    if label not in _warned_over_budget:
        _warned_over_budget.add(label)
        logger.warning(
            f"ddp_eval: the per-batch increments of float tensor attribute '{label}' "
            f"exceed ddp_eval: attribute_memory_mb ({budget.total / 2**20:g} MB) on "
            "this rank; from now on each rank sends one total, added in rank order. The "
            "merged value then equals one process up to about 2 (n + N) eps max|value| "
            "(n batches, N ranks, eps = 2**-53 for float64, 2**-24 for float32) instead of "
            "2 n eps max|value|. Raise attribute_memory_mb to keep per-batch order."
        )


def _any(tensor: torch.Tensor) -> bool:
    try:
        return bool(tensor.detach().any())
    except RuntimeError:  # a dtype without any()
        return True


class ArrayWatch(Watch):
    """A NumPy array changed in place (``+=`` of a confusion matrix): found by
    comparing with a copy after each batch; merged as tensors are (``SUM`` for
    integers and bools, ``ACCUMULATE`` for floats)."""

    def __init__(self, slot: Any, obj: Any, created_at: Optional[int] = None) -> None:
        super().__init__(slot, obj)
        self.spec = (obj.shape, obj.dtype)
        self.zero_start = created_at is not None
        self.base = numpy.zeros_like(obj) if self.zero_start else None
        self.crc = None
        if not self.zero_start:
            if slot.budget.reserve(obj.nbytes):
                self.base = obj.copy()
            else:
                self.crc = zlib.crc32(numpy.ascontiguousarray(obj).data)
        self.previous = self.base
        self.batches: List[int] = []
        self.increments: List[Any] = []
        if created_at is not None:
            self.observe(created_at, obj)

    def observe(self, batch: int, value: Any) -> bool:
        if self.previous is None or (value.shape, value.dtype) != self.spec:
            if (value.shape, value.dtype) != self.spec:
                self.slot.fail("a NumPy array that changed shape or dtype in place")
                return True
            return False  # no copy to compare with: checked at stage end
        if numpy.array_equal(value, self.previous):
            return False
        if not exact_dtype(value):
            increment = value - self.previous
            if self.slot.budget.reserve(increment.nbytes):
                self.increments.append(increment)
                self.batches.append(batch)
            else:
                self.slot.fail("a NumPy array whose per-batch increments exceed ddp_eval: attribute_memory_mb; "
                               "raise it, or keep the array as a torch tensor")
                return True
        self.previous = value.copy() if self.previous is self.base else self.previous
        numpy.copyto(self.previous, value)
        self.last_change = batch
        return True

    def finish(self) -> None:
        if self.crc is not None and zlib.crc32(numpy.ascontiguousarray(self.obj).data) != self.crc:
            self.slot.fail(f"a {self.obj.nbytes / 2**20:.0f} MB NumPy array changed in place, and ddp_eval: "
                           "attribute_memory_mb had no room for its start copy; raise it")

    def kind(self) -> Optional[Kind]:
        if self.last_change < 0:
            return None
        return Kind.SUM if exact_dtype(self.obj) else Kind.ACCUMULATE

    def state(self, positions: Sequence[float], from_batch: int, piece: bool) -> Any:
        if exact_dtype(self.obj):
            before = getattr(self, "mark", None) if piece else None
            before = self.base if before is None else before
            if piece:
                self.mark = self.obj.copy()
            return self.obj - before
        first = next((i for i, b in enumerate(self.batches) if b >= from_batch), len(self.batches))
        if piece and first == len(self.batches):
            return None
        return ("batches", [positions[b] for b in self.batches[first:]], self.increments[first:])

    def apply(self, kind: Kind, data: Any, last_value: Callable[[], Any]) -> None:
        value = self.base.copy()
        for increment in (data if kind is Kind.ACCUMULATE else [data]):
            value = value + numpy.asarray(increment)
        current = get_value(self.slot.owner, self.slot.name)
        if is_array(current) and current.shape == value.shape and current.dtype == value.dtype:
            numpy.copyto(current, value)
        else:
            set_value(self.slot.owner, self.slot.name, value.astype(self.spec[1], copy=False))


# what reads a stream's accumulated contents or position (a batch that reads it back, then writes, is named)
_STREAM_READS = ("getvalue", "getbuffer", "read", "read1", "readinto", "readinto1", "readline", "readlines", "tell",
                 "seek", "truncate", "__getstate__")


class StreamWatch(Watch):
    """An ``io.StringIO`` or ``io.BytesIO`` that batches write to at its end (a log of
    predictions): each batch's text, merged in global batch order as ``s += x`` is
    (``APPEND`` of one piece per batch). During a batch its read methods are hooked
    on the instance (``getvalue``, ``read``, ``tell``, ``seek``, ...; pickling it
    leaves them out): a batch that reads it back and writes to it, a write before its
    end or a change of what it held at stage start is named."""

    def __init__(self, slot: Any, obj: Any, created_at: Optional[int] = None) -> None:
        super().__init__(slot, obj)
        kind = type(obj)
        self.start = self.length = kind.tell(obj)
        self.head = zlib.crc32(_as_bytes(kind.getvalue(obj)[: self.start]))  # what it held at stage start
        self.pieces: List[tuple] = []  # (batch, position after it)
        self.read = False  # a hooked read during the batch under way

    def before_batch(self) -> None:
        kind, own = type(self.obj), vars(self.obj)
        for name in _STREAM_READS:
            if hasattr(kind, name):
                own[name] = functools.partial(self._reading, name, getattr(kind, name))

    def _reading(self, name: str, method: Callable, *args: Any, **kwargs: Any) -> Any:
        self.read = True
        result = method(self.obj, *args, **kwargs)
        if name == "__getstate__" and isinstance(result, tuple) and isinstance(result[-1], dict):
            result = result[:-1] + ({k: v for k, v in result[-1].items() if k not in _STREAM_READS} or None,)
        return result

    def release(self) -> None:
        own = vars(self.obj)
        for name in _STREAM_READS:
            if isinstance(own.get(name), functools.partial):
                del own[name]

    def observe(self, batch: int, value: Any) -> bool:
        self.release()
        kind, read, self.read = type(self.obj), self.read, False
        if read:  # what the batch computed from it holds its rank's text only (len(log.getvalue()))
            self.slot.notes.whole.add(top_label(self.slot.label))
        if self.obj.closed:
            self.slot.fail(_CLOSED)
            return True
        position = kind.tell(self.obj)
        if position == self.length and not read:
            return False
        end = kind.seek(self.obj, 0, io.SEEK_END)
        kind.seek(self.obj, position)
        if position < self.length or end != position:
            self.slot.fail("a batch moved back in it or wrote before its end, which ddp_eval cannot replay in one "
                           "process's order; write only at its end, or write it in on_stage_end")
        elif read:
            self.slot.fail("a batch read it back (getvalue(), read(), tell() or seek()) and wrote to it: in one "
                           "process that read sees every earlier batch's text, on a rank only its own batches'; "
                           "keep what the batch needs in a list, or write the stream in on_stage_end")
        else:
            self.pieces.append((batch, position))
            self.length, self.last_change = position, batch
        return True

    def kind(self) -> Optional[Kind]:
        return Kind.APPEND if self.pieces and self.slot.why is None else None

    def finish(self) -> None:
        self.release()
        kind = type(self.obj)
        if self.slot.why is None and self.obj.closed:
            self.slot.fail(_CLOSED)
        if self.slot.why is None and (kind.tell(self.obj) != self.length or zlib.crc32(_as_bytes(
                kind.getvalue(self.obj)[: self.start])) != self.head):
            self.slot.fail("what it held at stage start, or its position, changed outside a batch's writes at its "
                           "end; write only at its end during the stage")

    def state(self, positions: Sequence[float], from_batch: int, piece: bool) -> Any:
        value = type(self.obj).getvalue(self.obj)
        bounds = [self.start] + [position for _, position in self.pieces]
        chunks = [(positions[b], value[a:end]) for (b, end), a in zip(self.pieces, bounds) if b >= from_batch]
        return ([p for p, _ in chunks], [1] * len(chunks), [text for _, text in chunks]) if chunks else None

    def apply(self, kind: Kind, merged: Any, last_value: Callable[[], Any]) -> None:
        stream, methods = self.obj, type(self.obj)
        methods.seek(stream, self.start)
        methods.truncate(stream)
        methods.write(stream, ("" if isinstance(stream, io.StringIO) else b"").join(merged))


_CLOSED = ("it was closed during the stage, so its text cannot be merged; close it in on_stage_end, or write the "
           "lines to a list")


def _as_bytes(text: Any) -> bytes:
    return text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)


def _appends_at_end(obj: Any) -> bool:
    """An open in-memory stream positioned at its end (where batches will append)."""
    if type(obj) not in (io.StringIO, io.BytesIO) or obj.closed:
        return False
    position = type(obj).tell(obj)
    end = type(obj).seek(obj, 0, io.SEEK_END)
    type(obj).seek(obj, position)
    return position == end


def make_watch(slot: Any, obj: Any, created_at: Optional[int] = None, bound: bool = False,
               factory: Any = None) -> Watch:
    """The watch of ``obj``'s in-place changes, by its kind (``bound``: an object a
    batch bound anew, whose in-place changes are not merged; ``factory``: the
    defaultdict factory that made ``obj`` during the batch ``created_at``)."""
    if bound:
        return BoundWatch(slot, obj)
    made = created_at is None or factory is not None  # held at stage start, or made by a factory
    if obj is not ABSENT and made and slot.depth < MAX_DEPTH and is_plain_object(obj):
        return ObjectWatch(slot, obj, created_at, factory)
    if isinstance(obj, (list, bytearray)):
        return ListWatch(slot, obj, created_at)
    if isinstance(obj, dict):
        return DictWatch(slot, obj, created_at)
    if isinstance(obj, set):
        return SetWatch(slot, obj, created_at)
    if isinstance(obj, torch.Tensor):
        return TensorWatch(slot, obj, created_at)
    if is_array(obj):
        return ArrayWatch(slot, obj, created_at)
    if created_at is None and _appends_at_end(obj):
        return StreamWatch(slot, obj)
    return Watch(slot, obj)
