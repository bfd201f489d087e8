"""What one batch did to a watched attribute, told from its probe or from a new
object bound to it: the two halves of :class:`ddp_eval.state._attributes.Slot`'s
per-batch work, kept apart from the slot's life over the stage (start, merge,
restore).

:class:`ProbeReadings` reads what a number's, tuple's, tensor's or list's probe saw
(``n += 1``, ``max(x, v)``, ``t = t + y``, ``x.sort()``); :class:`Bindings` tells
what a new object bound by ``=`` means (grown from the previous one, set anew, or
computed from it) and follows a container created where there was none. Both read
and write the slot's own fields; neither is used alone.
"""

import collections
from typing import Any, List, Optional, Tuple

import torch

from ddp_eval.state import _recording
from ddp_eval.state._explain import Fingerprint
from ddp_eval.state._numbers import (
    PROBED_TYPES,
    is_probe,
    plain,
    probed,
    read_changes,
    scalars_only,
    unprobed,
    untouched,
)
from ddp_eval.state._probes import UNSET
from ddp_eval.state._rebuilt import (
    extends,
    handed_back,
    in_place_writes,
    plain_value,
    read_from,
    read_rebuilt,
    read_through_data,
    shares_entries,
)
from ddp_eval.state._recording import REMEDY, recording_copy, steered
from ddp_eval.state._values import ABSENT, Op, get_value, is_array, is_number, numpy, set_value, top_label
from ddp_eval.state._watches import BoundWatch, TensorWatch, make_watch

CHOICES = True  # x = max(x, v) replayed as a choice (tests switch it off to show that it matters)
UNSEEN_INT_READS = True  # an int a batch made a float was read unseen (tests switch it off)


class ProbeReadings:
    """What a batch did to a slot's value, from the probe that stood in for it
    (a number's or tuple's: :mod:`ddp_eval.state._numbers`; a tensor's, array's or
    list's: :mod:`ddp_eval.state._rebuilt`). Mixed into ``Slot``."""

    def _observe_reads(self) -> None:
        """A named value (left rank-local): a batch that read it (a comparison, a
        use, ``t.sum()``) read what its rank alone made of it; the plain value back."""
        held, self.probe, self.rebuilt_probe = self.probe if self.probe is not None else self.rebuilt_probe, None, None
        if held is None:
            return
        value = get_value(self.owner, self.name)
        record = getattr(held, "_ddp_record", None)
        if (held._used or held._derived) if is_probe(held) else (read_from(held, rebuilt=False) or record.used):
            self.notes.whole.add(top_label(self.label))
        self.obj = self.obj if value is held else (plain(value) if is_probe(value) else plain_value(value))
        set_value(self.owner, self.name, self.obj)

    def _observe_number(self, batch: int, value: Any) -> Optional[bool]:
        if is_probe(value) and value._origin is not self.probe:  # ns.v = self.n: another number's probe
            value = self._without_probes(value)
        what, data = read_changes(self.probe, value)
        if what == "derived" and self._replayed_reads_only(value):  # x = max(x, v): a set, its reads replayed
            what = "set"
        choices = self._choices(what, value)
        if choices:  # x = max(x, v): the choice itself is replayed, on one process's value
            self.events.extend((batch, Op.CHOICE, choice) for choice in choices)
            self.compared, self.probe, self.obj = True, None, plain(value)
            if what == "set":
                self.notes.sets.add(top_label(self.label))
            set_value(self.owner, self.name, self.obj)
            return what == "set"
        reads = self.probe._compared
        if what == "set" and type(self.obj) is int and is_number(value) and not isinstance(value, int) \
                and UNSEEN_INT_READS:
            reads = [*reads, None]  # min(n, 0.5), 0.5 + n: a float reads an int in C, unseen: not replayable
        if reads and probed(self.obj) and _recording.ENABLED:  # x < k, s.endswith(t)
            start = UNSET if self.start is ABSENT or self.start is None else plain(self.start)
            self.events.append((batch, Op.COMPARED, (plain(self.obj), reads, start)))
            self.compared = True
        if self.probe._read or (what == "same" and (self.probe._derived or self.probe._results)):
            self.notes.reads.add(top_label(self.label))  # its value went into something else
            self.notes.whole.add(top_label(self.label))
        if what == "set" and self.start is not ABSENT:
            self.notes.sets.add(top_label(self.label))
        if what == "ops" and self.probe._operands:  # n += self.m: named if m changed during the stage
            if "" in self.probe._operands:  # an operand of no known place: as if set after every read
                self.notes.sets.add(top_label(self.label))
            self.notes.operands.setdefault(top_label(self.label), set()).update(
                top_label(operand) for operand in self.probe._operands if operand)
        held, self.probe = self.probe, None
        if what == "same":
            set_value(self.owner, self.name, self.obj)  # the plain number back
            self.spare = (self.obj, held) if untouched(held) else None  # placed again before the next batch
            return False
        if what == "derived":  # named below: what the batch left is this rank's value from here on
            self.obj = plain(value) if is_probe(value) else value
            set_value(self.owner, self.name, self.obj)
        if what == "derived" and isinstance(value, (str, bytes, tuple)):
            self.fail(f"a batch computed a new {type(value).__name__} from the previous one by more than appending "
                      "to it (x += y) or keeping the smaller or larger (min, max), so ddp_eval cannot replay it in "
                      "one process's order; append only, or compute it in on_stage_end")
            return True
        if what == "derived":
            became = "" if is_number(value) else f" (it became a {type(value).__name__}: start it as one)"
            self.fail("a batch computed its new value from its previous one by more than + or - (a "
                      f"comparison or a product, as in max() or a running average){became}, so ddp_eval "
                      "cannot tell how to merge it; accumulate with += or compute it in on_stage_end")
            return True
        if what == "set" and not is_number(value):
            return None  # another kind of object bound to it
        if self.assigned_at is not None and not self.events:  # changed from a value a batch bound: that first
            self.events.append((self.assigned_at, Op.OVER_NONE if self.over_none else Op.SET, plain_value(self.obj)))
            self.assigned_at, self.assignments, self.created = None, 0, False
        self.events.extend((batch, op, x) for op, x in (data if what == "ops" else [(Op.SET, data)]))
        before, self.obj = self.obj, plain(value)
        if what == "ops" and type(self.obj) is tuple and self._probed_for is before:  # t += (x,): what it held
            self._probed_for = self.obj  # was checked; only the tail needs to be (Slot._probed)
            self._probed_answer = self._probed_answer and all(op == Op.CONCAT and scalars_only(x) for op, x in data)
        set_value(self.owner, self.name, self.obj)
        return True

    def _choices(self, what: str, value: Any) -> List[Tuple[str, Any, bool]]:
        """``(comparison, operand, answer on which the operand is kept)`` for each call
        of the builtin ``max`` or ``min`` of the number and a plain one, stored back in
        its place (:mod:`ddp_eval.state._select`; ``for s in scores: best = max(best,
        s)``), if those calls were the batch's only use of it and it holds what the last
        one returned; else none."""
        probe, reads = self.probe, self.probe._compared
        if not (CHOICES and _recording.ENABLED and reads and all(read and len(read) == 4 for read in reads)):
            return []  # no call of the builtin, or another read besides
        if probe._read or probe._derived or probe._results or self.assigned_at is not None or what == "ops" \
                or self.start is ABSENT or self.start is None or not is_number(self.obj):
            return []
        choices = []
        for name, (operand,), answer, kind in reads:
            keeps_operand = name != ("__gt__" if kind == "max" else "__lt__")  # max(x, v) keeps v when x < v
            if type(answer) is not bool:
                return []
            choices.append((("<" if name == "__lt__" else ">"), operand, keeps_operand, answer == keeps_operand))
        *earlier, (_, operand, _, took_operand) = choices
        if any(took for *_, took in earlier) or took_operand != (what == "set"):
            return []  # the number itself was not kept until the last call
        if what == "set" and not (value is operand or (type(value) is type(operand) and value == operand)):
            return []
        return [choice[:3] for choice in choices]

    def _replayed_reads_only(self, value: Any) -> bool:
        """Whether a number a batch computed from its previous one (``max(x, v)``,
        ``x * 0.9 + v``) used it only in reads the merge replays on one process's value
        (plain operands, the batch-start value): if they give the same answers there,
        the new value is one process's, as for ``=``; if not, the merge names it."""
        reads = self.probe._compared
        return (_recording.ENABLED and bool(reads) and None not in reads and not self.probe._read
                and ((is_number(self.obj) and is_number(value)) or (type(self.obj) is tuple and probed(value))))

    def _observe_rebuilt(self, batch: int, value: Any) -> Tuple[Optional[bool], Any]:
        """What a batch did to a tensor or array, from its probe: ``(changed, value)``
        (``changed`` None: see the watch, or a new object bound)."""
        probe, self.rebuilt_probe = self.rebuilt_probe, None
        bound, value = value, (value if value is probe else plain_value(value))
        if value is not bound:  # a probe's result (x = x + y) or view: the plain value, for the recipe
            set_value(self.owner, self.name, value)
        if read_from(probe, rebuilt=True):  # its value used (t.sum(), float(t[0])), noted before any failure below
            self.notes.whole.add(top_label(self.label))
        self.data_read = self.data_read or read_through_data(probe)  # x = x + y; x.data += z: replayed
        if getattr(getattr(probe, "_ddp_record", None), "shape_read", False):  # len(x), x.shape
            self.notes.shape.add(top_label(self.label))
        growth = getattr(getattr(probe, "_ddp_record", None), "steered", None)
        if growth is not None:  # an empty list read, then grown: this rank's entries kept, named
            handed_back(probe, self.obj)
            set_value(self.owner, self.name, value if value is not probe else self.obj)
            self.fail(steered(list, growth))
            return True, value
        writes = in_place_writes(probe)
        if writes:
            handed_back(probe, self.obj)  # an empty list's probe: what the batch put in it is this rank's
            set_value(self.owner, self.name, value if value is not probe else self.obj)
            remedy = REMEDY[list] if isinstance(self.obj, list) else (
                "change it with +=, add_() or index_add_() only (x[i] += 1 is one), or compute it in on_stage_end")
            self.fail(f"a batch changed it in place by {', '.join(writes)}, which ddp_eval cannot replay in one "
                      f"process's order; {remedy}")
            return True, value
        appended = handed_back(probe, self.obj)  # an empty list's probe: what batches appended to it
        what, data = read_rebuilt(probe, bound)
        if read_from(probe, rebuilt=what == "ops"):
            self.notes.reads.add(top_label(self.label))
            self.notes.whole.add(top_label(self.label))
        if what == "same":
            set_value(self.owner, self.name, self.obj)  # the plain tensor, array or list back
            if read_through_data(probe) and isinstance(self.watch, TensorWatch):
                self.watch.look_by_value()  # x.data += y moves no _version
            return None, self.obj
        if appended:
            self.fail("a batch appended to it, then bound a new value to it")
            return True, value
        if what == "ops":
            if self.watch.observe(batch, self.obj):  # changed in place, then rebuilt, in one batch
                self.fail("a batch changed it in place and rebuilt it from its previous value")
                return True, value
            return self._rebuild(batch, plain_value(value), data), value
        if what == "derived":
            self.fail(f"a batch computed a new {type(data).__name__} from the previous one by more than +, - or "
                      "concatenation along the first dimension (e.g. torch.maximum, a running mean), so ddp_eval "
                      "cannot tell how to merge it; accumulate with += or torch.cat, or compute it in on_stage_end")
            return True, value
        set_value(self.owner, self.name, data)  # a new value; the probe is not left in the user's object
        self.told_set = True  # the probe saw the old value unused: set anew, not extended
        return None, data

    def _rebuild(self, batch: int, value: Any, ops: List[Tuple[str, Any]]) -> bool:
        """A batch bound a value computed from the previous one by ``+``, ``-`` or
        concatenation: the operations are replayed at the merge, in global order."""
        if self.watch.changes_after(-1 if self.assigned_at is None else self.assigned_at):
            self.fail("it was changed in place, then a batch rebuilt it from its previous value")
            return True
        if self.assigned_at is not None and not self.events:  # the binding rebuilt from is the first event
            self.events.append((self.assigned_at, Op.OVER_NONE if self.over_none else Op.SET, plain_value(self.obj)))
            self.assigned_at, self.assignments, self.created = None, 0, False
        self.events.extend((batch, op, x) for op, x in ops)
        self.obj = value = self._without_probes(value)
        self.watch = BoundWatch(self, value)  # changed in place from now on: named at stage end
        return True

    def _without_probes(self, value: Any) -> Any:
        """``value``, bound by a batch, with the probes it holds replaced by plain
        numbers (``d[k] = self.n``, ``[self.n]``, ``t + (self.n,)``); each number they
        stood in for was read whole (its rank's own value went into this one)."""
        found: List[str] = []
        kept = unprobed(value, found)
        if found:
            if kept is not value:
                value = kept
                set_value(self.owner, self.name, value)
            self.notes.copied(found)
        return value


class Bindings:
    """What a new object a batch bound to a slot means (``x = ...``), and a
    container created where there was none, followed from the next batch on.
    Mixed into ``Slot``."""

    def check_shared(self) -> None:
        """At stage end: if it held a container other places held too, and a batch bound
        another value to it, the places are noted (named at the merge if any rank changed
        the container in place or read it whole: :func:`ddp_eval.state.bookkeeping._name_places_bound_apart`)."""
        if self.shared_from is not None and get_value(self.owner, self.name) is not self.shared_from[1]:
            self.notes.rebound(self.shared_from[1], self.shared_from[2])
        elif self._shared() and get_value(self.owner, self.name) is not self.recorded:
            self.notes.rebound(self.recorded, self.label)
        for entry in getattr(self.watch, "entries", {}).values():
            entry.check_shared()

    def _shared(self) -> bool:
        """Whether another place holds its recording copy too (no probe may stand in for it there)."""
        return self.recorded is not None and id(self.recorded) in self.notes.shared

    def _bind(self, batch: int, value: Any) -> bool:
        """A batch bound a new object to the attribute (``=``)."""
        told_set, self.told_set = self.told_set, False
        value = self._without_probes(value)
        if isinstance(self.obj, (list, tuple)) and not told_set and not self.watch.changes_after(
                -1 if self.assigned_at is None else self.assigned_at):
            grown = extends(self.obj, value)
            if grown is not None:  # ids = ids + [utt]
                return self._rebuild(batch, value, [(grown[0], [plain(x) for x in grown[1]] if isinstance(
                    value, list) else tuple(plain(x) for x in grown[1]))])
            if shares_entries(self.obj, value):
                self.fail(f"a batch bound a {type(value).__name__} holding entries of the previous one, but not "
                          "as the previous one followed by new entries (e.g. sorted(x + [y]), a filter), so ddp_eval "
                          "cannot tell how to merge it; append, or compute it in on_stage_end")
                return True
        if any(value is built for built in getattr(self.recorded, "built", ())):
            self.fail("a batch bound a new set computed from the previous one (s = s | {x}), which ddp_eval "
                      "cannot tell from a set made anew; add in place (s |= {x}, s.add(x)), which merges as a union")
            return True
        if self._read_in_batch():  # s = s - {x} | {y}, h = Holder(n=h.n + 1): computed from what it replaces
            self.fail(f"a batch bound a new {type(value).__name__} after reading the previous one (x = f(x)), "
                      "which ddp_eval cannot tell from a value set anew; change it in place (+=, append, add), "
                      "declare its merge (ddp_eval: merge), or compute it in on_stage_end")
            return True
        if isinstance(self.obj, tuple) and type(self.obj) is not tuple:  # t = t._replace(n=t.n + 1)
            self.fail(f"a batch bound a new {type(value).__name__} over a {type(self.obj).__name__} (a tuple "
                      "subclass, whose field reads ddp_eval cannot see), so it cannot tell x = f(x) from a value "
                      "set anew; keep it in a dataclass or a plain tuple, or set it in on_stage_end")
            return True
        if _unreadable(self.obj):  # f = f or x, t = t + Fraction(1, 3): no probe sees their reads
            self.fail(f"a batch bound a new {type(value).__name__} over a {type(self.obj).__name__}, whose reads "
                      "ddp_eval cannot see, so it cannot tell x = f(x) from a value set anew; count with an int "
                      "or float (n += 1), declare its merge (ddp_eval: merge: {name: max}), or set it in "
                      "on_stage_end")
            return True
        if self.events and not is_number(value) and not is_number(self.obj):  # set anew after rebuilds
            self.notes.sets.add(top_label(self.label))
            self.events.append((batch, Op.SET, plain_value(value)))
            self.obj = value
            self.watch = BoundWatch(self, value)
            return True
        empty = self.obj is ABSENT or self.obj is None
        if is_number(value) and (empty or (self.events and is_number(self.obj))
                                 or (self.depth and type(self.obj) in PROBED_TYPES)):
            if type(value) not in PROBED_TYPES:
                self.fail(f"a {type(value).__name__} changed, and ddp_eval tells = from += only for Python "
                          "int and float; convert it with float() or int()")
                return True
            if self.obj is not ABSENT:  # set over a value (None, or a number changed without a probe)
                self.notes.sets.add(top_label(self.label))
            if empty:  # created where there was none, or bound over None (an assignment unless added to)
                self.events.append((batch, (Op.CREATED if self.obj is ABSENT else Op.OVER_NONE) if not self.events
                                    else Op.SET, value))
            else:  # changed while it had no probe (a dict entry created during the stage)
                self.events.append((batch, Op.UNPROBED, (self.obj, value)))
            self.hot = self.hot or not empty
            self.obj = value
            return True
        if is_number(self.obj) and not empty:
            if type(self.obj) not in PROBED_TYPES:  # numpy.float64(0.0) += x: no probe of its kind
                self.fail(f"a {type(self.obj).__name__} changed, and ddp_eval tells = from += only for Python "
                          f"int and float; start it as one (0.0, not {type(self.obj).__name__}(0)) and add "
                          "Python numbers (float(x))")
            else:
                self.fail(f"a {type(self.obj).__name__} that became a {type(value).__name__}; start it as one")
            return True
        if self.events or self.watch.changes_after(-1 if self.assigned_at is None else self.assigned_at):
            self.fail(f"it was changed in place, then a batch bound a new {type(value).__name__} to it")
            return True
        # created where there was none (its later growth may merge); over None, only a list or dict
        # (`if self.x is None: self.x = []`): another value bound over None is set, not grown
        self.created = self.assignments == 0 and (self.start is ABSENT or (
            self.start is None and isinstance(value, (list, dict))))
        self.over_none = self.over_none or (self.assignments == 0 and self.start is None)
        self.assignments += 1
        if not self.created:
            self.notes.sets.add(top_label(self.label))
        self.assigned_at, self.obj = batch, value
        # created where there was none: its later growth may merge; bound anew: only its last value
        self.watch = make_watch(self, value, created_at=batch if self.created else None, bound=not self.created)
        if self.created and self.recorded is None and _recording.recordable(value):
            self.notes.bound_new.append(self)  # a recording copy from the next batch on (record_from_now)
        return True

    def record_from_now(self) -> None:
        """A container a batch created where there was none (``if self.x is None: self.x
        = []``): a recording copy stands in for it from the next batch on, as for one
        held at stage start, so that reads of what batches added (``len``, ``in``,
        ``x[-1]``) and changes other than growth are seen."""
        value = self.obj
        recorded = recording_copy(value, self.notes)
        if recorded is None or get_value(self.owner, self.name) is not value:
            return
        self.watch.release()  # a defaultdict's factory back, for the copy's own watch
        self.original, self.recorded = value, recorded
        self.notes.copies[id(value)] = (value, recorded, self.label)
        self.original_mark = Fingerprint.of(own_entries(value), depth=1)
        recorded.label = top_label(self.label)
        set_value(self.owner, self.name, recorded)
        self.obj = recorded
        self.watch = make_watch(self, recorded, created_at=self.assigned_at)

    def _read_in_batch(self) -> bool:
        """Whether the batch under way read the value this slot holds, or one of its
        watched entries or fields (their probes used, their recording copies read)."""
        held = self.probe
        if held is not None and (held._used or held._derived or held._results):
            return True
        if self.obj is self.recorded and getattr(self.recorded, "_read", False):
            return True
        return any(entry._read_in_batch() for entry in getattr(self.watch, "entries", {}).values())


_TENSORS = (torch.Tensor,) + ((numpy.ndarray,) if numpy is not None else ())


def own_entries(container: Any) -> Any:
    """What a change of a container held at stage start through another reference
    would change: its entries, a tensor or array among them by identity (the recording
    copy holds the same one, changed in place under its own watch: ``d[k] += x``)."""
    if not isinstance(container, (list, dict, collections.deque)) or not any(
            issubclass(kind, _TENSORS) for kind in set(map(type, (
                dict.values(container) if isinstance(container, dict) else container)))):
        return container  # (an iterator's original is not iterated; the types are read at C speed)
    def own(x: Any) -> Any:
        return f"shared {id(x)}" if isinstance(x, torch.Tensor) or is_array(x) else x
    if isinstance(container, dict):
        return {key: own(x) for key, x in dict.items(container)}
    return [own(x) for x in container]


def _unreadable(value: Any) -> bool:
    """Whether ``value`` is one whose reads no probe or recording copy sees: not a
    number, string, container, tensor, array, object with fields or function
    (a bool, a frozenset, a ``Fraction``, a NumPy integer)."""
    return not (value is None or value is ABSENT or type(value) in PROBED_TYPES or is_number(value)
                or isinstance(value, (list, tuple, dict, set, collections.deque, bytearray, torch.Tensor, type))
                or is_array(value) or callable(value) or hasattr(value, "__dict__"))
