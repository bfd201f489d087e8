"""Watching what a sharded stage's batches do to plain attributes, on one rank.

Recipes keep state on the Brain itself (``self.acc_metric.append(acc)``,
``self.outcome[utt_id] = ...``, ``self.n_correct += ...``, ``self.last_batch =
batch``) and sometimes on objects it holds (``self.hparams.aligner.align_dict``,
named by a dotted path in ``ddp_eval: attributes_include``). An
:class:`AttributeTracker` watches them during one stage. After every batch it
tells, for each attribute, what that batch did, from the attribute's identity,
its value and a tensor's ``_version`` (numbers: from a probe, see
:mod:`ddp_eval.state._probes`), at a cost that follows what the batch changed, not
what the attributes hold:

=====================  =========================================  ===============
what a batch did       told by                                    merged as
=====================  =========================================  ===============
list grew              same object, longer                        ``APPEND``
dict gained or changed same object; its entries watched like      ``KEYS``
entries                attributes (dicts over 64 entries: keys)
number ``+=``, ``=``   a probe in its place during the batch      ``FOLD``
tensor changed in      same object, ``_version``                  ``SUM`` (ints),
place                                                             ``ACCUMULATE``
NumPy array changed    same object, contents                      as tensors
in place
a new object bound     identity                                   ``LAST``
=====================  =========================================  ===============

At stage end each rank sends its :class:`Change` per attribute, tagged with
global batch positions; :mod:`ddp_eval.state.attribute_merge` rebuilds what one
process would hold and :meth:`AttributeTracker.apply` writes it back. What
cannot be told or merged (entries removed, a number computed from its previous
value by ``max``, a new object then changed in place) is reported by name.

Example
-------
>>> import types
>>> holder = types.SimpleNamespace(hits=[], n=0, last=None)
>>> tracker = AttributeTracker({name: (holder, name) for name in vars(holder)})
>>> tracker.before_batch()
>>> holder.hits.append("a"); holder.n += 2; holder.last = "u1"
>>> tracker.after_batch()
>>> changes, unmergeable = tracker.finish(positions=[5])
>>> [(label, change.kind.value) for label, change in sorted(changes.items())]
[('hits', 'append'), ('last', 'last'), ('n', 'fold')]
>>> changes["n"].data
[(5, '+', 2)]
"""

import collections
import itertools
import logging
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ddp_eval.errors import ConfigError
from ddp_eval.state import _recording
from ddp_eval.state._explain import Fingerprint, unexplained
from ddp_eval.state._numbers import PROBED_TYPES, plain, probe, probed, reusable
from ddp_eval.state._probes import UNSET, replay, replays_to
from ddp_eval.state._rebuilt import handed_back, make_probe
from ddp_eval.state._recording import BatchNotes, RecordingIterator, recording_copy, restore, unmergeable_operations
from ddp_eval.state._slot_changes import Bindings, ProbeReadings, own_entries
from ddp_eval.state._values import (
    ABSENT,
    ELSEWHERE,
    OVER_NONE_ONCE,
    Budget,
    Change,
    Kind,
    Op,
    get_value,
    is_array,
    is_mutable,
    is_number,
    numpy,
    set_value,
    top_label,
)
from ddp_eval.state._watches import (
    ArrayWatch,
    DictWatch,
    ListWatch,
    ObjectWatch,
    SetWatch,
    SharingWatch,
    StreamWatch,
    TensorWatch,
    make_watch,
)

logger = logging.getLogger(__name__)


def resolve(root: Any, path: str) -> Tuple[Any, str]:
    """``(owner, name)`` of a dotted attribute path below ``root``.

    Mappings on the way are indexed by key, other objects by attribute.

    Example
    -------
    >>> import types
    >>> brain = types.SimpleNamespace(hparams=types.SimpleNamespace(aligner={"d": 1}))
    >>> resolve(brain, "hparams.aligner.d")
    ({'d': 1}, 'd')
    """
    *parents, name = path.split(".")
    owner, walked = root, []
    for part in parents:
        child = owner.get(part, ABSENT) if isinstance(owner, Mapping) else getattr(owner, part, ABSENT)
        if child is ABSENT:
            where = ".".join(walked) or "the Brain"
            raise ConfigError(
                f"ddp_eval: attributes_include path '{path}' cannot be followed: {where} has "
                f"no '{part}'. Expected a dotted path to an attribute that exists at stage "
                "start, e.g. hparams.aligner.align_dict."
            )
        owner = child
        walked.append(part)
    return owner, name


class Slot(ProbeReadings, Bindings):
    """One watched attribute (or dict entry) on this rank during one stage: the
    object it holds, the new objects batches bound to it, and a watch of the
    current object's in-place changes (:mod:`ddp_eval.state._watches`). What one
    batch did is told by its two halves in :mod:`ddp_eval.state._slot_changes`
    (a probe's report, a new object bound); this class keeps the slot's life over
    the stage: probes placed, the end checked, the merge written back.

    Numbers are told by their probes: ``events`` holds ``(batch, op, operand)``
    with op ``+``, ``-``, ``=``, or ``~`` (created where there was none: an
    initial value, or an assignment, which the merge tells apart). An entry of
    a dict that gained many keys in the stage gets its probes only once it
    changes again (most never do: one per utterance, set once); that change,
    seen without a probe, is ``?`` with ``(before, after)``, an addend or an
    assignment as its other changes, on any rank, tell.
    """

    def __init__(self, label: str, owner: Any, name: Any, budget: Budget, start: Any = None,
                 depth: int = 0, notes: Optional[BatchNotes] = None) -> None:
        self.label, self.owner, self.name, self.budget, self.depth = label, owner, name, budget, depth
        self.notes = BatchNotes() if notes is None else notes  # the stage's: what the batch under way does
        self.start = get_value(owner, name) if start is None else start
        # another place (an attribute, an entry) already holds this container: its recording copy, one record
        self.shared_from = self.notes.copies.get(id(self.start)) if _recording.recordable(
            self.start) and _recording.SHARE_COPIES else None
        if self.shared_from is not None:
            self.original, self.recorded, self.start = None, None, self.shared_from[1]
            self.notes.shared.setdefault(id(self.start), []).append(label)
            set_value(owner, name, self.start)
        elif (recorded := recording_copy(self.start, self.notes)) is None:
            self.original = self.recorded = None
        else:  # a container held at stage start: a recording copy stands in for it until restore()
            self.original, self.recorded = self.start, recorded
            self.notes.copies[id(self.original)] = (self.original, self.recorded, label)
            self.original_mark = None if isinstance(self.recorded, RecordingIterator) else Fingerprint.of(
                own_entries(self.original), depth=1)  # changed through another reference?
            self.recorded.label = top_label(label)
            self.start = self.recorded
            set_value(owner, name, self.recorded)
        self.obj = self.start  # held, so that an identity check cannot meet a reused id
        self.why: Optional[str] = None  # why it cannot be merged
        self.assigned_at: Optional[int] = None  # batch that bound the newest object
        self.assignments = 0
        self.created = False  # the first change bound an object where there was none
        self.events: List[Tuple[int, str, Any]] = []
        # probes before every batch: an attribute, a dict entry there at stage start or
        # one of a dict's first new keys; other entries (one per utterance, set once) once
        # they change again (see watches.EAGER_NEW_KEYS)
        self.hot = depth == 0 or self.start is not ABSENT
        self.changed_batches = 0
        self.quiet = 0  # batches in a row that did not change it (a dict entry)
        self.probe = None
        self.rebuilt_probe = None  # a tensor's or array's probe during a batch (ddp_eval.state._rebuilt)
        self.compared = False  # a batch compared it (if it is named, what the comparison steered may differ)
        self.over_none = False  # the first binding was over None (an assignment, not a creation)
        self.told_set = False  # this batch's probe saw a new value bound, the old one unused
        self.data_read = False  # a batch read .data of it: a rebuilt value is replayed at any size
        self.watch = make_watch(self, self.start) if self.shared_from is None else SharingWatch(self, self.start)
        self._probed_for, self._probed_answer = ABSENT, False  # probed(obj) of the object held (_probed)
        self.spare: Optional[Tuple[Any, Any]] = None  # (value, its probe no batch used): placed again

    def fail(self, why: str) -> None:
        if self.why is None:
            self.why = why

    def busy(self) -> bool:
        """Whether it needs a look at every batch (a number with probes, a container,
        a tensor or an array); otherwise its identity tells whether a batch changed it."""
        if self.why is not None:  # named, left rank-local: a batch that reads it still reads a rank's value
            return type(self.obj) in PROBED_TYPES or type(self.obj) in _PROBED_ARRAYS
        return ((self.hot and self._probed()) or is_mutable(self.obj)
                                     or isinstance(self.watch, (ObjectWatch, StreamWatch))
                                     or (type(self.obj) is tuple and not self.obj))  # an empty tuple's probe

    def _probed(self) -> bool:
        """``probed(self.obj)``, once per object held: a tuple's answer reads every entry (a tuple of 100k
        labels would cost that every batch)."""
        if self._probed_for is not self.obj:
            self._probed_for, self._probed_answer = self.obj, probed(self.obj)
        return self._probed_answer

    def _spare_probe(self) -> Any:
        """The probe the last batch left untouched, if it still stands for the value held (a tuple's or
        a long string's probe copies it: remade every batch, its cost would grow with the value)."""
        spare, self.spare = self.spare, None
        if spare is None or spare[0] is not self.obj:
            return None
        held = spare[1]
        del spare
        return held if reusable(held) else None

    def before_batch(self) -> None:
        """Puts a probe in place of a number (or lets dict entries do so)."""
        if self.why is not None:  # named: its probe only tells whether the batch read it
            current = get_value(self.owner, self.name)
            self.obj = self.obj if current is ABSENT else current  # the rank's own: what the last batch left
            self.probe = probe(self.obj, self.label) if type(self.obj) in PROBED_TYPES else None
            self.rebuilt_probe = None if self.probe is not None or self._shared() else make_probe(
                self.obj, self.notes, self.label)
            if self.probe is not None or self.rebuilt_probe is not None:
                set_value(self.owner, self.name, self.rebuilt_probe if self.probe is None else self.probe)
            return
        if self.hot and self._probed():
            spare = self._spare_probe()
            self.probe = probe(self.obj, self.label) if spare is None else spare  # no truth test: it is a read
            set_value(self.owner, self.name, self.probe)
        else:
            if not self._shared() and (type(self.obj) in _PROBED_CONTAINERS or (
                    self.obj is self.recorded and isinstance(self.obj, list))):
                self.rebuilt_probe = make_probe(self.obj, self.notes, self.label)
                if self.rebuilt_probe is not None:
                    set_value(self.owner, self.name, self.rebuilt_probe)
            self.watch.before_batch()

    def observe(self, batch: int) -> None:
        """Notes what batch ``batch`` did (O(1) for all but changed tensors and small dicts)."""
        if self.why is not None:
            self._observe_reads()
            return
        value = get_value(self.owner, self.name)
        if value is ABSENT:
            if self.obj is not ABSENT:
                self.fail("it was deleted during the stage")
            return
        changed = self._observe_number(batch, value) if self.probe is not None else None
        if self.rebuilt_probe is not None:
            changed, value = self._observe_rebuilt(batch, value)
        if changed is None:
            changed = self.watch.observe(batch, value) if value is self.obj else self._bind(batch, value)
        self.changed_batches += bool(changed)

    def adopt(self, batch: int, value: Any, initial: Any, ops: List[Tuple[str, Any]], factory: Any = None) -> None:
        """A new dict entry its defaultdict's factory made (``d[k] += 1``,
        ``d[k].append(x)``) or a Counter's new count: it starts from the
        factory's value, as in one process, instead of being bound."""
        if is_number(initial):
            self.events = [(batch, Op.INITIAL, initial)] + [(batch, op, x) for op, x in ops]
            self.hot = True  # a factory's count (d[k] += 1): probes from the next batch
            self.obj = plain(value)
            set_value(self.owner, self.name, self.obj)
        else:
            self.obj = value
            self.watch = make_watch(self, value, created_at=batch, factory=factory)
        self.changed_batches += 1

    def release(self) -> None:
        """Takes probes and factories out of the user's objects (at stage end, or
        when the stage is abandoned by an exception)."""
        if self.probe is not None:  # placed for a batch that did not come
            set_value(self.owner, self.name, plain(self.probe))
            self.probe = None
        if self.rebuilt_probe is not None:
            handed_back(self.rebuilt_probe, self.obj)
            if get_value(self.owner, self.name) is self.rebuilt_probe:
                set_value(self.owner, self.name, self.obj)
            self.rebuilt_probe = None
        self.watch.release()

    def finish(self, batch: int) -> None:
        """What changed after the last batch (at position ``inf``); probes taken away."""
        self.observe(batch)
        self.release()
        self.check_shared()
        if self.recorded is not None:
            self.fail(unmergeable_operations(self.recorded) or "")
            if self.why == "":
                self.why = None
            if self.original is not None and unexplained(self.original_mark, own_entries(self.original)):
                self.fail("it was changed through another reference to the object it held at stage start (an "
                          "alias, e.g. in hparams), which ddp_eval does not watch; change it through the Brain "
                          "attribute only")
        if self.why is None:
            self.watch.finish()
        if self.assigned_at is not None and self.watch.changes_after(self.assigned_at) and not self.created:
            self.fail(f"a batch bound a new {type(self.obj).__name__} to it and later ones changed that in place")
        if self.events and not is_number(self.obj) and self.watch.changes_after(-1):
            self.fail(f"a batch rebuilt it as a new {type(self.obj).__name__} and later ones changed that in place")
        if self.why is None and self.events and (self.data_read or _replay_is_cheap(self.obj, len(self.events))) \
                and _recording.ENABLED and not replays_to(self.start, self.events, self.obj):
            self.fail("replaying what its batches did (x = x + y, torch.cat) from its stage-start value does not "
                      "give the value it holds: something changed it unseen (a write through .data of a rebuilt "
                      "value); rebuild it or change it in place, not both, or compute it in on_stage_end")

    def restore(self) -> None:
        """The container held at stage start back in place of its recording copy,
        with the copy's contents (merged, or this rank's); entries first."""
        for entry in getattr(self.watch, "entries", {}).values():
            entry.restore()
        if self.shared_from is not None:
            original, copy, _ = self.shared_from
            if get_value(self.owner, self.name) is copy:
                set_value(self.owner, self.name, original)
            for holder, name in ((self, "start"), (self, "obj"), (self.watch, "obj")):
                if getattr(holder, name) is copy:
                    setattr(holder, name, original)
            return
        if self.original is None:
            return
        recorded, original, self.original = self.recorded, self.original, None
        restore(recorded, original)
        if get_value(self.owner, self.name) is recorded:
            set_value(self.owner, self.name, original)
        for name in ("start", "obj"):
            if getattr(self, name) is recorded:
                setattr(self, name, original)
        if self.watch.obj is recorded:
            self.watch.obj = original

    def kind(self) -> Optional[Kind]:
        """How this attribute's change merges; None if unchanged or unmergeable (no side effects)."""
        if self.why is not None:
            return None
        if self.events:
            return Kind.FOLD
        if self.assignments and not (self.created and self.assignments == 1):
            return Kind.LAST
        if self.assignments and self.start is None and not self.watch.changes_after(self.assigned_at):
            return Kind.LAST  # bound once over the None it held at stage start, unchanged since: x = value
        return self.watch.kind() or (Kind.LAST if self.assignments else None)

    def change(self, positions: Sequence[float], from_batch: int = 0, piece: bool = False) -> Optional[Change]:
        """This rank's :class:`Change`, None if unchanged; with ``piece``, what the
        batches from ``from_batch`` on did, for a journal (bound objects included)."""
        kind = self.kind()
        if kind is None:
            return None
        if kind is Kind.FOLD:
            events = [(positions[b], op, x) for b, op, x in self.events if b >= from_batch]
            return Change(kind, events) if events or not piece else None
        last = None
        if self.assigned_at is not None and not self.watch.changes_after(self.assigned_at):
            last = positions[self.assigned_at]
        value = None if last is None else (plain(self.obj) if piece else ELSEWHERE)  # the object, in a piece
        if kind is Kind.LAST:
            if piece and self.assigned_at < from_batch:
                return None
            once = self.created and self.start is None and self.assignments == 1  # x = [...] or x = []; x.append()
            return Change(kind, OVER_NONE_ONCE if once else None, last, value)
        data = self.watch.state(positions, from_batch, piece)
        return None if data is None else Change(kind, data, last, value)

    def apply(self, kind: Kind, data: Any, last_value: Callable[[], Any]) -> None:
        """Writes a merged change (:func:`ddp_eval.state.attribute_merge.merge_changes`)."""
        if kind is Kind.REDUCE:
            set_value(self.owner, self.name, data)
        elif kind is Kind.FOLD:
            start = UNSET if self.start is ABSENT or self.start is None else plain(self.start)
            set_value(self.owner, self.name, replay(start, data))
        elif kind is Kind.LAST:
            value = data if data is not ELSEWHERE else last_value()
            if value is not ELSEWHERE:  # ELSEWHERE: this rank's own object won
                set_value(self.owner, self.name, value)
        elif isinstance(self.watch, _WATCHES[kind]) and self.watch.holds(get_value(self.owner, self.name)):
            self.watch.apply(kind, data, last_value)
        else:
            _apply_from_nothing(self, kind, data, last_value)


# a rebuilt tensor or array is replayed at stage end (replay equality) while batches x elements stays
# below this: about 20 ms of additions; a larger one only if a batch read its .data (a change through it
# moves no _version), else it is checked by _version (docs/exactness.md)
REPLAY_ELEMENTS = 2 ** 24
# the distinct keys of one dict whose reads a rank reports (entry_reads); past them, a read of any key
MOST_ENTRY_READS = 64


def _replay_is_cheap(value: Any, events: int) -> bool:
    size = value.numel() if isinstance(value, torch.Tensor) else (value.size if is_array(value) else None)
    return size is not None and size * events <= REPLAY_ELEMENTS


_PROBED_ARRAYS = {torch.Tensor} | ({numpy.ndarray} if numpy is not None else set())
_PROBED_CONTAINERS = _PROBED_ARRAYS | {list, tuple}

_WATCHES = {Kind.UNION: SetWatch, Kind.APPEND: (ListWatch, StreamWatch), Kind.ITEMS: ListWatch, Kind.KEYS: DictWatch,
            Kind.SUM: (TensorWatch, ArrayWatch), Kind.ACCUMULATE: (TensorWatch, ArrayWatch)}


def _apply_from_nothing(slot: Slot, kind: Kind, data: Any, last_value: Callable[[], Any]) -> None:
    """A merged change on a rank that never held the object (it had no batch)."""
    if kind is Kind.APPEND:
        set_value(slot.owner, slot.name, list(data))
    elif kind is Kind.UNION:
        set_value(slot.owner, slot.name, set(data))
    elif kind is Kind.KEYS:
        factory = getattr(slot.owner, "default_factory", None)  # an entry of a defaultdict: made as one process did
        created = factory() if factory is not None else {}
        set_value(slot.owner, slot.name, created)
        (DictWatch(slot, created) if isinstance(created, dict) else ObjectWatch(slot, created)).apply(
            kind, data, last_value)
    else:
        value = None
        for increment in (data if kind is Kind.ACCUMULATE else [data]):
            value = increment.clone() if value is None and hasattr(increment, "clone") else (
                increment.copy() if value is None else value + increment)
        set_value(slot.owner, slot.name, value)


class AttributeTracker:
    """Watches attributes during one sharded stage on this rank.

    Arguments
    ---------
    targets : dict
        ``{label: (owner, name)}`` of the attributes to watch from now on.
    budget_mb : float
        Memory for copies of tensors and arrays on this rank.
    """

    def __init__(self, targets: Mapping[str, Tuple[Any, str]], budget_mb: float = 64.0) -> None:
        self.budget = Budget(budget_mb)
        self.notes = BatchNotes()  # what the batch under way does, noted by slots, copies and factories
        self.batches = 0
        self._piece_from = 0  # where the next journal piece starts
        self.tracks: Dict[str, Slot] = {label: Slot(label, owner, name, self.budget, notes=self.notes)
                                        for label, (owner, name) in targets.items()}
        self._copies = self.notes.created  # the recording copies its slots made (at stage start, and since)
        self.read_then_set: Dict[str, set] = {}  # label set by a batch -> labels that batch read
        self.whole_reads: set = set()  # labels batches read whole: what a read steered may be a change not made
        # labels a batch found a key absent in, then maybe set it (if k not in d: self.n += 1; d[k] = 1): if the
        # value is named, its record did not replay alike, and what the read steered may differ too
        self.absent_reads: set = set()
        # label -> keys of dict entries batches read other than right after setting them (d[k] += 1; if
        # d[k] == 1): if ranks set the entry apart (a key not watched one by one), each read a rank's value.
        # Past MOST_ENTRY_READS keys of one dict, None: any of its keys (names more, keeps the report small)
        self.entry_reads: Dict[str, Optional[set]] = {}
        self.shape_reads: set = set()  # tensors and arrays whose length batches read: a read whole if it changed
        self._busy: List[Slot] = []  # the slots prepared for the batch under way
        self._idle: List[Slot] = []  # the others: their identity tells whether a batch changed them
        self._added: List[Slot] = []  # watched since the batch began (created by it): seen after it

    @property
    def used_bytes(self) -> int:
        return self.budget.used

    def add(self, targets: Mapping[str, Tuple[Any, str]]) -> None:
        """Watches ``targets`` not watched yet: created during the stage, so
        absent at its start (their value is a change of the batch just run,
        seen by the next :meth:`after_batch`)."""
        for label, (owner, name) in targets.items():
            if label not in self.tracks:
                self.tracks[label] = Slot(label, owner, name, self.budget, start=ABSENT, notes=self.notes)
                self._added.append(self.tracks[label])

    def before_batch(self) -> None:
        """Before a batch: numbers, tensors, arrays and empty lists get their probes;
        the attributes a look at every batch is needed for are noted."""
        self._busy, self._idle, self._added = [], [], []
        for slot in self.tracks.values():
            (self._busy if slot.busy() else self._idle).append(slot)
        for slot in self._busy:
            slot.before_batch()
        self.notes.start()
        _recording.listen(self._copies, True)

    def stop_listening(self) -> None:
        """The batch is over: reads of the recording containers from here on are ddp_eval's own."""
        notes = self.notes
        if notes.listening:
            notes.listening = False
            _recording.listen(self._copies, False)
            notes.reads.update(recorded.label for recorded in notes.read)
            notes.whole.update(recorded.label for recorded in notes.read if recorded._whole)
            indexed = {recorded.label for recorded in notes.indexed if _recording.read_by_index(recorded)}
            notes.reads.update(indexed)  # self.last = items[-1], if items[-1] > k: ...
            notes.whole.update(indexed)
            notes.absent.update(recorded.label for recorded in notes.indexed if recorded.absent)

    def after_batch(self) -> None:
        """Notes what the batch just evaluated did: a look at the busy attributes,
        an identity check of the others (a string, a bool, a tuple, an object);
        which attributes it set after reading others, and what batches read whole
        (see :func:`ddp_eval.state.bookkeeping.name_values_read_from_partial_state`)."""
        self.stop_listening()
        for slot in self._busy:
            slot.observe(self.batches)
        for slot in itertools.chain(self._idle, self._added):
            if get_value(slot.owner, slot.name) is not slot.obj:
                slot.observe(self.batches)
        reads = self.notes.reads
        for label in self.notes.sets:
            if reads - {label}:
                self.read_then_set.setdefault(label, set()).update(reads - {label})
        for label, operands in self.notes.operands.items():  # added from them, not set after every read
            if operands - {label}:
                self.read_then_set.setdefault(label, set()).update(operands - {label})
        self.whole_reads |= self.notes.whole
        self.absent_reads |= self.notes.absent
        for label, key in self.notes.entries:
            keys = self.entry_reads.setdefault(label, set())
            if keys is not None:
                keys.add(key)
                if len(keys) > MOST_ENTRY_READS:
                    self.entry_reads[label] = None
        self.shape_reads |= self.notes.shape
        self._added = []
        self._record_created()
        self.batches += 1

    def _record_created(self) -> None:
        """Containers batches created where there was none get recording copies
        (:meth:`Slot.record_from_now`), but one another watched place holds too."""
        created, self.notes.bound_new = self.notes.bound_new, []
        if not created:
            return
        held = collections.Counter(id(slot.obj) for slot in self.tracks.values())
        for slot in created:
            if held[id(slot.obj)] == 1 and id(slot.obj) not in self.notes.copies:
                slot.record_from_now()

    def finish(self, positions: Sequence[int]) -> Tuple[Dict[str, Change], Dict[str, str]]:
        """``(changes, unmergeable)`` at stage end; ``positions`` are the global
        positions of this rank's batches, in order."""
        self.stop_listening()  # the reads and writes from here on are ddp_eval's
        for slot in self.tracks.values():
            slot.finish(self.batches)
        unmergeable = self.unmergeable()
        positions = list(positions[: self.batches]) + [math.inf]
        changes = {}
        for label in sorted(self.tracks.keys() - unmergeable.keys()):
            change = self.tracks[label].change(positions)
            if change is not None:
                changes[label] = change
        return changes, unmergeable

    def unmergeable(self) -> Dict[str, str]:
        """``{label: why}`` of the values named so far; one a batch compared before it
        was named is a read that steered (:attr:`whole_reads`): its replay is unchecked."""
        named = {label: slot.why for label, slot in sorted(self.tracks.items()) if slot.why is not None}
        self.whole_reads.update(top_label(label) for label in named if getattr(self.tracks[label], "compared", False)
                                or getattr(getattr(self.tracks[label], "watch", None), "read_unseen", False))
        return named

    def piece(self, positions: Sequence[int]) -> Dict[str, Change]:
        """What the batches since the previous piece did, for a journal
        (:meth:`finish` is unaffected); bound objects travel in the piece."""
        changes = {}
        for label in sorted(self.tracks):
            slot = self.tracks[label]
            change = slot.change(positions, self._piece_from, piece=True) if slot.why is None else None
            if change is not None:
                changes[label] = change
        self._piece_from = self.batches
        return changes

    def bound_objects(self) -> Dict[str, Any]:
        """``{label: object}`` of every attribute and watched dict entry a batch
        bound an object to: what this rank sends if its binding is the last."""
        found = {}
        stack = list(self.tracks.values())
        while stack:
            slot = stack.pop()
            if slot.assigned_at is not None and slot.why is None:
                found[slot.label] = plain(slot.obj)
            if isinstance(slot.watch, (DictWatch, ListWatch)):
                stack.extend(slot.watch.entries.values())
        return found

    def release(self) -> None:
        """Takes probes and factories out of the watched objects (see :meth:`Slot.release`)."""
        self.notes.listening = False
        _recording.listen(self._copies, False)
        for slot in self.tracks.values():
            slot.release()

    def restore(self) -> None:
        """The containers held at stage start back in place of their recording
        copies (after the merge is applied, or when the stage is abandoned)."""
        for slot in self.tracks.values():
            slot.restore()

    def drop(self, labels) -> None:
        """Stops watching ``labels`` (they came to hold metric objects, merged as such)."""
        for label in labels:
            slot = self.tracks.pop(label, None)
            if slot is not None:
                slot.observe(self.batches)  # the batch under way took its probes: what it wrote stays
                slot.release()
                slot.restore()
                for prepared in (self._busy, self._idle, self._added):
                    if slot in prepared:
                        prepared.remove(slot)

    def changed_batches(self) -> Dict[str, int]:
        """``{label: number of this rank's batches that changed it}`` of attributes
        that existed at stage start, for the cross-rank check of main-process-only effects."""
        return {label: slot.changed_batches for label, slot in self.tracks.items()
                if slot.changed_batches and slot.start is not ABSENT}

    def apply(self, merged: Mapping[str, Tuple[Kind, Any]], locate: Callable[[str], Tuple[Any, str]],
              last_value: Callable[[str], Any]) -> None:
        """Writes ``merged`` into the attributes, on top of what they held at
        stage start; ``locate(label)`` gives ``(owner, name)`` of a label this
        rank never watched, ``last_value(label)`` the value a ``LAST`` merge chose."""
        for label, (kind, data) in merged.items():
            slot = self.tracks.get(label)
            if slot is None:
                owner, name = locate(label)
                slot = Slot(label, owner, name, self.budget, start=ABSENT, notes=self.notes)
            if slot.why is None:  # an unmergeable one stays rank-local (and is reported)
                slot.apply(kind, data, lambda label=label: last_value(label))
