"""Containers that note the operations a stage's batches call on them.

A list sorted after each append, a set an element is discarded from, a deque
with ``maxlen``: on one rank these may change nothing (a one-entry list is
sorted; the element is absent), while in one process, holding every rank's
entries, they reorder or remove. No look at the value can see them. So for the
stage, each container a watched attribute holds at stage start (``list``,
``dict``, ``set``, ``collections.deque``, ``Counter``, ``OrderedDict``,
``defaultdict``, ``bytearray``) is replaced by a *recording* copy: an instance
of a subclass whose methods note their names, then do what the type does. At
stage end (or when the stage is abandoned) its contents go back into the
original object, which the attribute holds again.

Which methods change a container is taken from the type itself: every method
its ``dir()`` lists, except those its immutable counterpart also has (a
tuple's, a frozenset's, bytes', a mapping proxy's) and the few that build a new
object (``copy``), with in-place operators (``__ior__``) always counted. A
method a future Python adds is therefore counted as a change. The changes the
merge replays (:data:`GROWS`: a list's appends, a dict's new and changed
entries, a set's additions) are not noted; any other is, and names the
attribute at stage end.

Example
-------
>>> scores = recording_copy([3.0])
>>> listen([scores], True)  # a batch runs
>>> scores.append(1.0); scores.sort()
>>> listen([scores], False)
>>> scores.ops, type(scores).__name__, scores == [1.0, 3.0]
(['sort'], 'RecordingList', True)
>>> plain_copy = restore(scores, original=[3.0])
>>> plain_copy, type(plain_copy) is list
([1.0, 3.0], True)
"""

import collections
import collections.abc
import io
import reprlib
import sys
import types
from typing import Any, Callable, Dict, FrozenSet, List, Optional

from ddp_eval.errors import DDPEvalError
from ddp_eval.state._numbers import PLAIN, is_probe, probe, unprobed
from ddp_eval.state._values import as_builtin

_FROZEN = {list: tuple, bytearray: bytes, set: frozenset, dict: types.MappingProxyType, collections.deque: tuple}
# methods that build a new object, never change this one
_BUILDS = frozenset({"copy", "__copy__", "__deepcopy__", "__reversed__", "fromkeys", "elements", "most_common",
                     "total", "__alloc__", "__reduce__", "__reduce_ex__", "__class_getitem__", "__missing__",
                     "__add__", "__sub__", "__and__", "__or__", "__xor__", "__neg__", "__pos__", "__mul__"})
# what the merge replays, by the builtin type it rests on
GROWS: Dict[type, FrozenSet[str]] = {
    list: frozenset({"append", "extend", "__iadd__", "__setitem__"}),
    bytearray: frozenset({"append", "extend", "__iadd__"}),
    dict: frozenset({"__setitem__", "setdefault", "update", "__ior__", "subtract"}),
    set: frozenset({"add", "update", "__ior__"}),  # merged as a union
    collections.deque: frozenset(),  # not merged: any change is named
}
# what to do instead of an operation the merge cannot replay, by the builtin type
REMEDY = {
    list: "ddp_eval merges a list that batches append to or extend; sort, insert or remove in on_stage_end",
    bytearray: "ddp_eval merges a bytearray that batches append to or extend; change its bytes in on_stage_end",
    dict: "ddp_eval merges a dict whose batches add or change entries; remove or reorder entries in on_stage_end",
    set: "ddp_eval merges a set that batches add to (add, update, |=) as a union; remove elements in on_stage_end",
    collections.deque: "append to a list and keep its last entries in on_stage_end",
}
ENABLED = True  # the operations seen and the stage-end checks by value; tests switch them off to show they matter
SHARE_COPIES = True  # every watched place holding a container holds its one recording copy (tests switch it off)
STEERABLE = True  # a container grown after a batch read it whole is named (tests switch it off)
TYPES = (list, dict, set, collections.deque, collections.Counter, collections.OrderedDict, collections.defaultdict,
         bytearray)


class BatchNotes:
    """What the batch under way does, for one stage: its attribute tracker makes
    one and hands it to each recording copy, probe factory and slot it makes.

    ``listening`` while a batch runs; ``read`` and ``indexed``: the recording copies
    the batch read (each once), and read by index; ``created``: the copies made
    for it; by top-level label, ``reads`` (values that went into another),
    ``whole`` (reads whose answer may steer the batch: ``len(items)``,
    ``t.sum()``), ``sets`` (values the batch set), ``operands`` (numbers it added
    other watched numbers to, ``n += self.m``) and ``shape`` (tensors and arrays whose
    length it read, ``len(x)``, ``x.shape``) (see
    :meth:`ddp_eval.state._attributes.AttributeTracker.after_batch`)."""

    __slots__ = ("listening", "read", "indexed", "created", "reads", "whole", "sets", "operands", "absent",
                 "entries", "fresh", "shape", "copies", "shared", "rebound_places", "made", "bound_new")

    def __init__(self) -> None:
        self.listening = False
        self.read: list = []
        self.indexed: list = []
        self.created: list = []
        self.reads: set = set()
        self.whole: set = set()
        self.sets: set = set()
        self.operands: dict = {}  # label of a number -> labels of watched numbers added to it (n += self.m)
        self.absent: set = set()  # dicts, sets and lists a batch found a key or index absent in
        self.entries: set = set()  # (label, key) of dict entries a batch read (d[k], d.get(k)) but had not set first
        self.fresh: dict = {}  # id(recording dict) -> keys the batch set before reading them: their reads are its own
        self.shape: set = set()
        self.copies: dict = {}  # id(container held at stage start) -> (container, its recording copy, label)
        self.shared: dict = {}  # id(recording copy) -> labels of the other places holding it (no probe stands in)
        self.rebound_places: dict = {}  # label of a shared container -> every place that held it (one was bound anew)
        self.made: dict = {}  # label of a dict entry a batch made a container for -> what else it did to it, each time
        self.bound_new: list = []  # slots a batch bound a new container to, where there was none

    def rebound(self, copy: Any, primary: str) -> None:
        """A place that held ``copy`` (the recording copy of ``primary``'s container) with
        other places was bound anew by a batch: if any rank changed the container in
        place or read it whole, every place that held it is named at the merge (in one
        process, what later batches did through the rebound place went elsewhere)."""
        self.rebound_places[primary] = sorted({primary, *self.shared[id(copy)]})

    def copied(self, labels: List[str]) -> None:
        """The batch stored the probes of ``labels`` (watched numbers) in another value
        (``items.append(self.n)``, ``d[k] = self.n``): their rank's own values went into
        it, a read of each whole."""
        read = {label.split("[")[0].split(".")[0] for label in labels if label}
        self.reads |= read
        self.whole |= read

    def start(self) -> None:
        """A batch starts: what the previous one noted is forgotten."""
        for recorded in self.read:
            recorded._read = recorded._whole = False
        for recorded in self.indexed:
            recorded._indexed = recorded.absent = False
        for noted in (self.read, self.indexed, self.reads, self.whole, self.sets, self.operands, self.absent,
                      self.entries, self.fresh, self.shape):
            noted.clear()
        self.listening = ENABLED


QUIET = BatchNotes()  # a copy's notes until a tracker hands it its own: never listening


def _builtin(kind: type) -> type:
    return next(base for base in kind.__mro__ if base in _FROZEN)


def changing_methods(kind: type) -> List[str]:
    """The methods of ``kind`` that may change an instance, from its ``dir()``.

    Example
    -------
    >>> changing_methods(list)
    ['__delitem__', '__iadd__', '__imul__', '__setitem__', 'append', 'clear', 'extend', 'insert', 'pop', 'remove', \
'reverse', 'sort']
    """
    frozen = set(dir(_FROZEN[_builtin(kind)])) | set(dir(object))
    return sorted(name for name in dir(kind) if callable(getattr(kind, name, None)) and name not in _BUILDS
                  and (name not in frozen or (name.startswith("__i") and name not in ("__init__", "__iter__",
                                                                                      "__init_subclass__"))))


def _noting(kind: type, name: str):
    method = getattr(kind, name)

    def noted(self, *args, **kwargs):
        if self._depth == 0 and name not in self._grows and name not in self.ops:
            self.ops.append(name)  # each name once: a sort per batch keeps one entry, not one a batch
        elif self._notes.listening and self._depth == 0 and self.steered is None and (self._whole or (
                self._indexed and name != "__setitem__")):
            self.steered = name  # a batch read the container's accumulated entries (or items[-1]), then grew it
        if name in ("__setitem__", "add", "setdefault") and self._indexed and args:  # the entry read is set again
            self.index_sets.add(_index_key(args[0]))
        if name == "__setitem__" and args and self._notes.listening and self._depth == 0 and isinstance(
                self, dict) and not _read_now(self, args[0]):  # d[k] = v before any read of d[k]
            self._notes.fresh.setdefault(id(self), set()).add(args[0])
        if self._notes.listening and self._depth == 0:  # items.append(self.n): the plain number, n read whole
            found: List[str] = []
            args = tuple(arg if type(arg) in PLAIN or _own_probe(self, arg) or _made_now(arg)
                         else unprobed(arg, found, depth=1) for arg in args)
            if found:
                self._notes.copied(found)
        self._depth += 1
        before = list.__len__(self) if self._depth == 1 and isinstance(self, list) else None
        try:
            return method(self, *args, **kwargs)
        except Exception as error:  # on this rank's entries; with every rank's, in one process, it may not raise
            if self._notes.listening and self._depth == 1 and self.raised is None and not isinstance(
                    error, TypeError):
                self.raised = f"{name}() raised {type(error).__name__}"
            raise
        finally:
            self._depth -= 1
            if before is not None:  # what its methods put in or took out: the rest, C code did (heapq)
                self.explained += list.__len__(self) - before
    noted.__name__ = name
    return noted


def _read_now(recorded: Any, key: Any) -> bool:
    """Whether the batch under way read ``recorded[key]`` (found or absent)."""
    return (recorded.label, key) in recorded._notes.entries or (
        recorded._indexed and _index_key(key) in recorded.index_reads)


def _made_now(value: Any) -> bool:
    """A container made for a dict's new key (d.setdefault(k, []), a factory's), on its way in: empty, no read."""
    return (isinstance(value, _Recording) and value.made) or getattr(getattr(value, "_ddp_record", None), "made", False)


def _own_probe(recorded: Any, value: Any) -> bool:
    """Whether ``value`` is the probe of one of ``recorded``'s own entries, or a tensor's
    or array's probe's result (``d[k] += 1``, ``d[k] += x`` set it back: the entry's slot
    follows it)."""
    if is_probe(value):
        label = value._origin._label
    elif type(value).__name__ not in _PROBE_CLASSES:
        return False
    else:
        record = getattr(value, "_ddp_record", None)
        label = getattr(getattr(record, "record", record), "label", "")
    return bool(label) and label.split("[")[0] == recorded.label.split("[")[0]


_PROBE_CLASSES = ("TensorProbe", "ArrayProbe")  # ddp_eval.state._rebuilt's (which imports this module)


class _Recording:
    """What every recording class shares: the names of the operations noted."""

    _depth = 0
    _notes = QUIET  # the stage's (see BatchNotes)
    _read = False  # read by the batch under way (see BatchNotes.read)
    _whole = False  # ... as a whole (len, iteration, a comparison): what the batch adds after may depend on it
    _indexed = False  # a list read by index (items[-1]): an append after it may depend on it, hist[i] += 1 not
    raised = None  # a changing method that raised during a batch
    absent = False  # the batch under way found a key or an index absent (k in d gave False, a KeyError)
    start_length = 0  # a list's length when the copy was made (entries from there on were appended by batches)
    steered = None  # the first growing operation a batch called after reading it
    label = ""  # the attribute it stands in for (set by the attribute tracker)
    made = False  # made by a batch as a dict's new entry (made_copy)
    explained = 0  # a list's change of length its own methods made (ddp_eval.state._watches.ListWatch)

    def __reduce_ex__(self, protocol):  # pickles, copies and saves as the plain container
        plain = _rebuild(self._kind, _contents(self), _extra(self))
        if type(plain) in (list, dict):  # their own pickle is an opcode, not a reduce: torch.load accepts this
            return as_builtin, (type(plain).__name__, plain)
        return plain.__reduce_ex__(protocol)

    def __reduce__(self):
        return self.__reduce_ex__(2)

    def __copy__(self):  # a deque's and a defaultdict's own copy() would keep the recording class
        return _rebuild(self._kind, _contents(self), _extra(self))

    @reprlib.recursive_repr("[...]")  # a container holding itself: the copy's repr comes back here
    def __repr__(self) -> str:  # a deque's, a Counter's, a defaultdict's repr names the class: the plain one
        return repr(self.__copy__())

    def __str__(self) -> str:  # a bytearray's names it too (for every recorded kind, str is repr)
        return repr(self)


def _contents(value: Any) -> Any:
    builtin = _builtin(type(value))
    return list(value.items()) if builtin is dict else list(builtin.__iter__(value))


def _extra(value: Any) -> Any:
    if isinstance(value, collections.defaultdict):  # the recipe's factory, not the one the stage wraps it in
        return getattr(value.default_factory, "original", value.default_factory)
    if isinstance(value, collections.deque):
        return value.maxlen
    return None


def _rebuild(kind: type, contents: list, extra: Any) -> Any:
    if kind is collections.defaultdict:
        return collections.defaultdict(extra, contents)
    if kind is collections.deque:
        return collections.deque(contents, extra)
    return kind(dict(contents)) if _builtin(kind) is dict else kind(contents)


def _handing_probe(method):
    """``get``/``setdefault`` of a dict kind: a number default for a missing key is
    handed out as a probe, so ``d[k] = d.get(k, 0) + 1`` is known to start from 0
    and add 1, and an empty container default is remembered, so that
    ``d.setdefault(k, []).append(x)`` is known to start empty, as a
    ``defaultdict``'s entry does (:meth:`ddp_eval.state._watches.DictWatch._made`),
    on any rank."""
    def handing(self, key, default=None):
        if not dict.__contains__(self, key):
            if self._notes.listening:  # a read of the key: what the batch sets it to next is not its own alone
                self._notes.entries.add((self.label, key))
            if default is None and method.__name__ == "get":  # d.get(k) is None: k absent here, maybe not in one
                _note_index(self, key, None)
            if type(default) in (int, float):
                default = probe(default)
                self.handed[id(default)] = default
            elif method.__name__ == "setdefault" and type(default) in _CLASSES:  # setdefault(k, []).append(x)
                default = made_copy(default, self._notes)
                self.handed[id(default)] = default
            elif type(default) in (list, dict, set) and not default:  # d.get(k, []): an empty container
                self.handed[id(default)] = default
        elif method.__name__ == "get":
            _note_entry(self, key, dict.__getitem__(self, key))
        return method(self, key, default)
    handing.__name__ = method.__name__
    return handing


# methods that build a new set from this one (s = s | {x}): their results are kept, to be told apart
_BUILDS_SET = ("__or__", "__ror__", "union", "__and__", "__rand__", "intersection", "__sub__", "__rsub__",
               "difference", "__xor__", "__rxor__", "symmetric_difference", "copy")


def _keeping_result(kind: type, name: str):
    method = getattr(kind, name)

    def keeping(self, *args, **kwargs):
        if self._notes.listening and not self._read:
            self._read = True
            self._notes.read.append(self)
        if self._notes.listening and STEERABLE:  # what it gives holds what earlier batches added
            self._whole = True
        result = method(self, *args, **kwargs)
        self.built.append(result)
        return result
    keeping.__name__ = name
    return keeping


# object plumbing, not a read of the contents
_PLUMBING = frozenset({"__class__", "__init__", "__new__", "__getattribute__", "__setattr__", "__delattr__",
                       "__init_subclass__", "__subclasshook__", "__class_getitem__", "__reduce__", "__reduce_ex__",
                       "__getstate__", "__sizeof__", "__dir__", "__hash__", "__format__", "__getnewargs__",
                       "__copy__", "__deepcopy__", "fromkeys", "__alloc__"})


# reads of one entry of a dict or a set, which the entry's own record follows (``if k not in d: d[k] = v``;
# a set is merged as a union); in a list, ``x in items`` reads every entry
_ENTRY_READS = frozenset({"__contains__"})


def _reading(kind: type, name: str):
    method = getattr(_Recording if name in ("__repr__", "__str__") else kind, name)
    whole = _builtin(kind) is list or name not in _ENTRY_READS

    def read(self, *args, **kwargs):
        notes = self._notes
        if notes.listening and not self._read:  # a batch read what batches accumulate
            self._read = True
            notes.read.append(self)
        if notes.listening and whole and STEERABLE:
            self._whole = True
        result = method(self, *args, **kwargs)
        if not whole and result is False:  # k absent on this rank, maybe not in one process
            _note_index(self, args[0], None)
        return result
    read.__name__ = name
    return read


def _setting_by_position(noted):
    """``list.__setitem__`` (``noted``) that notes, as an operation the merge cannot
    replay, a write by position from the start at or past the stage-start entries
    (``items[5] = x``, ``items[n:] = [...]``): in one process that position holds
    another batch's entry. ``items[-1] = x`` is checked by value at stage end."""
    def setitem(self, index, entry):
        if self._depth == 0 and "__setitem__" not in self.ops and _past_start(self, index):
            self.ops.append("__setitem__")
        return noted(self, index, entry)
    setitem.__name__ = "__setitem__"
    return setitem


def _past_start(recorded: Any, index: Any) -> bool:
    """Whether ``recorded[index] = x`` may write at or past ``recorded.start_length``, counting from the start."""
    if type(index) is int:
        return index >= recorded.start_length
    if type(index) is slice:
        return max(index.indices(len(recorded))[:2]) >= recorded.start_length
    return True


def _note_entry(recorded: Any, key: Any, entry: Any) -> None:
    """A dict's ``d[k]``: noted in ``entries`` unless the batch set ``d[k]`` before
    reading it (its own value); the value of an entry (a number, a string; not a probe,
    which replays its reads, nor a container, whose key is its path) is also noted as
    read, as ``k in d`` is: on a rank it is what its batches alone made of the entry.
    ``d[k] += 1`` sets it again: not a read."""
    notes = recorded._notes
    if not notes.listening or key in notes.fresh.get(id(recorded), ()):
        return
    notes.entries.add((recorded.label, key))
    if isinstance(entry, _VALUES) and not getattr(entry, "_ddp_probe", False):
        _note_index(recorded, key, entry)


def _entry_reading(kind: type, absent: type, note):
    """``kind.__getitem__`` that notes the entry read (``note``), or, where ``absent``
    (IndexError, KeyError) is raised, a read of an index or key this rank lacks: in one
    process, another rank's batches may have put it there (``try: items[2]``)."""
    method = kind.__getitem__

    def getitem(self, index):
        notes = self._notes
        if notes.listening and isinstance(self, dict) and index not in notes.fresh.get(id(self), ()):
            notes.entries.add((self.label, index))  # before the call: a defaultdict's __missing__ sets the key
        try:
            entry = method(self, index)
        except absent:
            _note_index(self, index, None)
            raise
        note(self, index, entry)
        return entry
    getitem.__name__ = "__getitem__"
    return getitem


def _note_index(recorded: Any, index: Any, entry: Any) -> None:
    """Notes ``recorded[index]`` read by the batch under way (``entry``; None if out of range);
    not a dict's entry the batch set before reading it (``d[utt] = x``, then ``d[utt]``): it
    reads what the batch itself put there."""
    fresh = recorded._notes.fresh.get(id(recorded))
    if fresh and index in fresh:
        return
    if recorded._notes.listening and STEERABLE:  # not a read of the whole (hist[i] += 1): not in read
        if not recorded._indexed:
            recorded._indexed, recorded.index_reads, recorded.index_sets = True, [], set()
            recorded._notes.indexed.append(recorded)
        recorded.absent = recorded.absent or entry is None
        if not (type(index) is int and 0 <= index < recorded.start_length and (getattr(
                entry, "_ddp_probe", False) or not isinstance(entry, _VALUES))):
            # a stage-start entry's probe replays its reads, nested[0].append(x) is its path; an entry batches
            # appended is another one on each rank
            recorded.index_reads.append(_index_key(index))


_VALUES = (int, float, complex, str, bytes, tuple, type(None))  # entries read for their value, not changed in place


def _index_key(index: Any) -> Any:
    return index if type(index) is int else repr(index)


def read_by_index(recorded: Any) -> bool:
    """Whether a batch read an entry of ``recorded`` (a list) by index other than to
    set it again (``hist[i] += 1``, ``hist[i] = hist[i] + 1``): ``if items[-1] > k``."""
    return any(key not in recorded.index_sets for key in recorded.index_reads)


def _recording_class(kind: type) -> type:
    grows = GROWS[_builtin(kind)]
    changing = changing_methods(kind)
    # reads of what the container holds as a whole (len, iteration, membership, comparison, copy); reading
    # one entry by key or index (d[k] += 1, d.get(k, 0) + 1) is the entry's own business
    namespace = {name: _reading(kind, name) for name in dir(kind) if callable(getattr(kind, name, None))
                 and name not in changing and name not in _PLUMBING and name not in ("get", "setdefault",
                                                                                   "__getitem__", "__missing__")}
    namespace.update({name: _noting(kind, name) for name in changing})
    if _builtin(kind) is list:
        namespace["__setitem__"] = _setting_by_position(namespace["__setitem__"])
        namespace["__getitem__"] = _entry_reading(kind, IndexError, _note_index)
    if _builtin(kind) is dict:
        namespace["__getitem__"] = _entry_reading(kind, KeyError, _note_entry)
        namespace["setdefault"] = _handing_probe(namespace["setdefault"])
        namespace["get"] = _handing_probe(kind.get)
    if _builtin(kind) is set:
        namespace.update({name: _keeping_result(kind, name) for name in _BUILDS_SET if hasattr(kind, name)})
    if _builtin(kind) is collections.deque:  # q[0]: which entry sits there is what batches left
        namespace["__getitem__"] = _reading(kind, "__getitem__")
    namespace["__module__"] = __name__
    name = kind.__name__[:1].upper() + kind.__name__[1:]
    # between batches a copy is of the quiet class (the type's own C methods: ddp_eval's reads cost
    # nothing); while a batch runs, of the listening one (every method noted), see listen()
    quiet = type("Recording" + name, (_Recording, kind), {"_kind": kind, "_grows": grows, "__module__": __name__})
    listening = type("Listening" + name, (quiet,), namespace)
    quiet._quiet = listening._quiet = quiet
    quiet._listening = listening._listening = listening
    return quiet, listening


_CLASSES = {kind: _recording_class(kind)[0] for kind in TYPES}
globals().update({cls.__name__: cls for quiet in _CLASSES.values() for cls in (quiet, quiet._listening)})


def listen(copies: list, on: bool) -> None:
    """Switches recording copies to noting what is called on them (a batch runs) or not."""
    for copy in copies:
        if not isinstance(copy, RecordingIterator):
            copy.__class__ = copy._listening if on else copy._quiet
            if on:
                copy.built.clear()  # sets built from it by the previous batch, already looked at


class RecordingIterator:
    """Stands in for an iterator (or generator) during the stage: it is the same
    iterator, advanced by each ``next()``, which it notes (a batch that consumes it
    reads what earlier batches left of it: it is named)."""

    __slots__ = ("_notes", "__dict__")  # the stage's notes out of its __dict__, which ddp_eval's watch reads
    _read = _whole = False  # a batch that consumes it is named (its own record), and what it steered
    label = ""

    def __init__(self, inner: Any, notes: BatchNotes) -> None:
        self.inner, self.consumed, self._notes = inner, False, notes

    def __iter__(self) -> "RecordingIterator":
        return self

    def __next__(self) -> Any:
        self.consumed = True
        self._note_read()
        return next(self.inner)

    def _note_read(self) -> None:
        if self._notes.listening and not self._read:  # what it gives is what earlier batches left: a read whole
            self._read = self._whole = True
            self._notes.read.append(self)

    def __getattr__(self, name: str) -> Any:  # send(), throw(), gi_frame, ...: a batch's is a read whole
        if self._notes.listening and not name.startswith("_ddp"):
            self.consumed = True
            self._note_read()
        return getattr(self.inner, name)

    def __reduce_ex__(self, protocol: int) -> Any:  # pickles as the iterator it stands for
        return self.inner.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return repr(self.inner)


def recording_copy(value: Any, notes: Optional[BatchNotes] = None) -> Optional[Any]:
    """A recording copy of a container of one of :data:`TYPES` (exactly that type), a
    :class:`RecordingIterator` for an iterator that is not a file, noting into
    ``notes`` (which keeps it in ``created``); else None."""
    if not ENABLED:
        return None
    notes = BatchNotes() if notes is None else notes
    cls = _CLASSES.get(type(value))
    if cls is None:
        if isinstance(value, collections.abc.Iterator) and not isinstance(value, io.IOBase):
            notes.created.append(RecordingIterator(value, notes))
            return notes.created[-1]
        return None
    copy = _new_copy(cls, value, notes)
    copy.start_length = len(value) if _builtin(type(value)) is list else 0
    notes.created.append(copy)
    return copy


def _new_copy(cls: type, value: Any, notes: BatchNotes) -> Any:
    if type(value) is collections.defaultdict:
        copy = cls(value.default_factory)
    elif _builtin(type(value)) is collections.deque:
        copy = cls((), value.maxlen)
        copy._grows = frozenset() if value.maxlen is not None else copy._grows  # appends drop entries: named
    else:
        copy = cls()
    copy.ops, copy.handed, copy.built, copy._notes = [], {}, [], notes
    _fill(copy, value, type(value))
    return copy


def made_copy(value: Any, notes: BatchNotes) -> Any:
    """``value``, a container a batch makes as a dict's new entry (a ``defaultdict``'s
    factory's, ``setdefault``'s default), as a recording copy listening at once, so that
    what the batch does to it is known (:func:`made_otherwise_than_grown`); ``value``
    itself where no copy is made. The dict's watch puts the plain container back after
    the batch (:func:`plain_made`)."""
    cls = _CLASSES.get(type(value))
    if cls is None or not ENABLED or not notes.listening:
        return value
    copy = _new_copy(cls, value, notes)  # quiet while filled (a Counter's update reads itself)
    copy.__class__ = cls._listening
    copy.made = True  # every entry, and every position, is the batch's (start_length 0)
    return copy


def _plain_entry(value: Any, depth: int) -> Any:
    """An entry of a made container: a default it handed out (``c[w] = c.get(w, 0) + 1``
    in a Counter's update) as the plain number, made containers plain."""
    return plain_made(unprobed(value, [], depth=1, handed=True), depth - 1)


def made_otherwise_than_grown(made: Any) -> Optional[str]:
    """What a batch did to a container it made (:func:`made_copy`) besides growing it
    (appends, new keys, additions), or read of it; None if nothing. In one process an
    earlier batch may have made that entry already: what such a call or read did there
    differs."""
    if made.ops or made.raised:
        return ", ".join(f"{name}()" for name in made.ops) or made.raised
    if made._whole or made.steered or made.absent or (made._indexed and read_by_index(made)) or any(
            getattr(default, "_used", False) for default in made.handed.values()):  # max(d.get(k, 0), x)
        return "a read of what it held"
    return None


def plain_made(value: Any, depth: int = 3) -> Any:
    """``value`` with every container :func:`made_copy` made (itself, or in its
    entries, ``depth`` levels down) replaced by the plain container."""
    if depth and isinstance(value, _Recording) and getattr(value, "made", False):
        contents = [(k, _plain_entry(v, depth)) for k, v in dict.items(value)] if isinstance(value, dict) else [
            _plain_entry(v, depth) for v in _builtin(value._kind).__iter__(value)]
        return _rebuild(value._kind, contents, _extra(value))
    return value


def listening_copy(value: list, label: str, notes: BatchNotes = QUIET) -> Any:
    """A recording copy of a list that notes its operations from now on, outside any
    attribute tracker (the lists of a metric object a ``defaultdict`` makes during
    the stage, ``label`` naming them where a batch reads them); ``list(copy)`` is
    the plain list back."""
    copy = _CLASSES[list]._listening(value)
    copy.ops, copy.handed, copy.built, copy.label, copy._notes = [], {}, [], label, notes
    copy.start_length = len(value)
    return copy


def announcing_copy(value: dict, on_set: Callable[[Any, Any], None], label: str = "",
                    notes: BatchNotes = QUIET, own_reads: FrozenSet[Any] = frozenset()) -> Any:
    """A copy of a plain dict that calls ``on_set(key, entry)`` after each ``d[k] = entry``
    (a MultiMetricStats's ``metrics``: a per-key object it makes gets recording copies
    in the batch that makes it). Its keys are its state: a batch's read of them (``k in
    d``, ``d[k]``, ``len``, iteration) is noted into ``notes`` as a read of ``label``
    whole, but ``k in d`` from code in ``own_reads`` (SpeechBrain's own ``if key not in
    self.metrics`` before it makes the key). It passes as the plain dict (``copy.copy``,
    pickle, yaml); ``dict(copy)`` is the plain dict back."""
    copy = _Announcing(value)
    copy.on_set, copy.own_reads, copy.label, copy._notes = on_set, own_reads, label, notes
    copy.ops, copy.handed, copy.built = [], {}, []
    return copy


class _Announcing(_CLASSES[dict]._listening):
    _grows = frozenset()  # a per-key object removed or replaced (pop, del, update) is noted: not merged

    def __setitem__(self, key, entry):
        if dict.__contains__(self, key) and dict.__getitem__(self, key) is not entry and "__setitem__" not in self.ops:
            self.ops.append("__setitem__")  # another object in place of a per-key object
        dict.__setitem__(self, key, entry)
        self.on_set(key, entry)

    def __contains__(self, key):
        present = dict.__contains__(self, key)
        if not present and sys._getframe(1).f_code not in self.own_reads:
            self._absent()
        return present

    def __getitem__(self, key):
        if not dict.__contains__(self, key):
            self._absent()
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        if not dict.__contains__(self, key):
            self._absent()
        return dict.get(self, key, default)

    def _absent(self):
        """A key this rank lacks was looked up: in one process another rank's batch may
        have made it. Noted as a read of the keys, whole (as ``len``)."""
        _CLASSES[dict]._listening.__len__(self)


def _fill(target: Any, source: Any, kind: type) -> None:
    """Adds ``source``'s contents to an empty ``target`` with ``kind``'s own methods
    (an OrderedDict keeps its order beside the dict's)."""
    if _builtin(kind) is dict:
        kind.update(target, source)
    else:
        (kind.update if kind is set else kind.extend)(target, _builtin(kind).__iter__(source))


def recordable(value: Any) -> bool:
    """Whether :func:`recording_copy` gives ``value`` a recording copy (a container of :data:`TYPES`)."""
    return ENABLED and type(value) in _CLASSES


def is_recording(value: Any) -> bool:
    return isinstance(value, _Recording)


def steered(kind: type, method: str) -> str:
    """Why a container a batch grew after reading its accumulated entries is named."""
    return (f"a batch read this {kind.__name__}'s accumulated entries (len, iteration, truthiness, a comparison"
            f"{', in, an index' if _builtin(kind) is list else ''}) and then called {method}() on it: in one "
            "process that read sees every earlier batch's entries, on a rank only its own batches', so what is "
            "added may differ; keep every entry and select in on_stage_end (e.g. the first five there), or keep "
            "the read out of the batch code")


_CALLED = {"__setitem__": "__setitem__() (items[i] = x with i counted from the start, past the stage-start "
                           "entries: in one process that position holds another batch's entry)"}


def unmergeable_operations(recorded: Any) -> Optional[str]:
    """Why the operations noted on ``recorded`` cannot be merged, and what to do; None if none were noted."""
    if isinstance(recorded, RecordingIterator):
        return ("batches consumed this iterator: in one process each batch reads the next item after every "
                "earlier batch's, on a rank after its own batches' only; iterate in on_stage_end, or keep the "
                "items in a list and index it by the batch") if recorded.consumed else None
    if recorded.raised is not None and not recorded.ops:
        return (f"during a batch {recorded.raised} on this {recorded._kind.__name__}: on a rank it holds only its "
                "own batches' entries, in one process every rank's, where the call may succeed; change it only "
                "in ways that cannot fail (append, d[k] = v), or in on_stage_end")
    if recorded.steered is not None and not recorded.ops:
        return steered(recorded._kind, recorded.steered)
    if not recorded.ops:
        return None
    kind = _builtin(recorded._kind)
    called = ", ".join(_CALLED.get(name, f"{name}()") if kind is list else f"{name}()"
                       for name in dict.fromkeys(recorded.ops))
    return (f"a batch called {called} on this {recorded._kind.__name__}, which ddp_eval cannot replay in one "
            f"process's order (on one rank it may change nothing, with every rank's entries it would): "
            f"{REMEDY[kind]}")


def restore(recorded: Any, original: Any) -> Any:
    """Puts what ``recorded`` holds into ``original`` (the object it stood for) and
    gives ``original``; a deque's and a defaultdict's settings are kept."""
    if isinstance(recorded, RecordingIterator):
        return original  # advanced in place: nothing to copy
    kind = type(original)
    try:
        kind.clear(original)
    except BufferError as error:  # a memoryview of a bytearray: what it wrote went around the recording copy
        raise DDPEvalError(f"ddp_eval cannot put the merged value back into {recorded.label!r}: {error} (a "
                           "memoryview of it is held); keep the view out of the Brain, or release it "
                           "(view.release()) in on_stage_start") from error
    _fill(original, recorded, kind)
    return original

