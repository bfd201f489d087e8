"""Replaying what batches did to a number, and the factory that hands out probes.

:func:`replay` is the one interpreter of a value's event log (``+``, ``-``,
concatenation, ``=`` and their kin, see :class:`ddp_eval.state._values.Op`): the
merge runs it over every rank's events in global batch order, and a rank runs it
over its own to check that a rebuilt tensor's record gives its value
(:func:`replays_to`). :class:`Factory` stands in for a ``defaultdict``'s factory
during a stage, so that a new entry is known to start from the factory's value.
"""

from typing import Any, List, Optional, Tuple

import torch
from speechbrain.utils.metric_stats import MultiMetricStats

from ddp_eval.state._numbers import PROBED_TYPES, _Probe, origin_of, plain, probe
from ddp_eval.state._rebuilt import add, concat, make_probe, subtract
from ddp_eval.state._recording import QUIET, BatchNotes, announcing_copy, is_recording, listening_copy, made_copy
from ddp_eval.state._values import ABSENT, Op, is_array, is_flat_list, is_metric_object, numpy

_APPLY = {Op.ADD: add, Op.SUBTRACT: subtract, Op.CONCAT: concat}


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # a number that did not exist yet


def replay(start: Any, events: List[Tuple[str, Any]]) -> Any:
    """Applies ``("+", x)``, ``("-", x)``, concatenation, ``("=", v)`` (and a
    value bound where there was none, or over None), ``("^", v)`` (an initial
    value: taken only while there is none, :data:`UNSET`) and an unprobed change
    ``(before, after)`` to ``start`` in order; comparisons change nothing.

    Example
    -------
    >>> replay(1.0, [("+", 0.5), ("=", 10), ("-", 2)])
    8
    >>> replay(UNSET, [("^", 0), ("+", 1), ("^", 0), ("+", 1)])
    2
    """
    value = start
    for op, operand in events:
        if op == Op.COMPARED:  # checked at the merge (ddp_eval.state.attribute_merge), changes nothing
            continue
        if op == Op.INITIAL:
            value = operand if value is UNSET else value
        elif op == Op.CHOICE:  # max or min of the value and a number: which one it keeps, on this value
            comparison, other, keeps_other = operand
            value = other if ((value < other) if comparison == "<" else (value > other)) == keeps_other else value
        elif op in (Op.SET, Op.OVER_NONE, Op.CREATED):
            value = operand
        elif op == Op.UNPROBED:
            value = operand[1]
        elif value is UNSET and op in (Op.ADD, Op.CONCAT):
            value = operand
        else:
            value = _APPLY[op](0 if value is UNSET else value, operand)
    return value


def replays_to(start: Any, events: List[Tuple[int, str, Any]], value: Any) -> bool:
    """Replay equality of a rebuilt tensor or array on its rank: ``events`` (this
    rank's, ``(batch, op, operand)``) replayed in order from ``start`` give
    ``value`` (bit for bit: the same operations in the same order)."""
    try:
        current = replay(UNSET if start is None or start is ABSENT else start, [(op, x) for _, op, x in events])
    except Exception:  # shapes or types that do not combine: not what the record says
        return False
    return _same_values(current, value)


def _same_values(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = a.detach().cpu(), b.detach().cpu()
        return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a != a) & (b != b)).all())
    if is_array(a) and is_array(b):
        return a.shape == b.shape and a.dtype == b.dtype and numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    return False


ANNOUNCE_MADE_KEYS = True  # a MultiMetricStats a factory makes: its per-key lists listened to (tests switch it off)
MAKES_KEYS = frozenset({MultiMetricStats.append.__code__})  # its `if key not in self.metrics` makes the key


def _the_factory(original: Any) -> Any:
    """What a :class:`Factory` pickled during a stage loads as: the factory it stood for."""
    return original


class Factory:
    """Stands in for a ``defaultdict``'s ``default_factory`` during a stage: a
    number it makes is handed out as a probe, and every object it makes is
    remembered, so that a new entry is known to start from the factory's value
    (``d[k] += 1``, ``d[k].append(x)``), not from an assignment.

    Example
    -------
    >>> import collections
    >>> counts = collections.defaultdict(int)
    >>> factory = counts.default_factory = Factory(counts.default_factory)
    >>> counts["a"] += 2
    >>> factory.origin(counts["a"])
    (0, [('+', 2)])
    """

    def __init__(self, original, notes: Optional[BatchNotes] = None, label: str = "") -> None:
        self.original, self.notes = original, QUIET if notes is None else notes
        self.label = label  # the watched value holding the defaultdict: what a read of a list it made reads
        self.made: dict = {}  # id -> (object, probe or None, {field: probe}), of this batch
        self.lists: list = []  # (object, field, copy) of the recording copies it put in, for the whole stage

    def __call__(self):
        value = self.original()
        root = probe(value) if type(value) in PROBED_TYPES else None
        handed = made_copy(value, self.notes) if root is None else root  # a list: its sort, insert seen
        if (isinstance(value, torch.Tensor) or is_array(value)) and self.notes.listening:  # its mul_(), reads seen
            handed = make_probe(value, self.notes)
            if handed is None:
                handed = value
            else:
                handed._ddp_record.made = True
        fields = {}
        own = getattr(handed, "__dict__", None) if root is None else None
        if isinstance(own, dict):  # an object (a dataclass, a metric object): its numbers probed from the start
            for name, field in own.items():
                if type(field) in (int, float):
                    fields[name] = own[name] = probe(field)
                elif type(field) is list and not field and is_metric_object(handed):  # its sort, insert: seen
                    self._listen(handed, name)
            if ANNOUNCE_MADE_KEYS and isinstance(handed, MultiMetricStats) and type(own.get("metrics")) is dict:
                own["metrics"] = announcing_copy(own["metrics"], self._made_per_key, self.label, self.notes,
                                                 MAKES_KEYS)
                self.lists.append((handed, "metrics", own["metrics"]))
        self.made[id(handed)] = (handed, root, fields)
        return handed

    def _listen(self, obj: Any, name: str) -> None:
        obj.__dict__[name] = listening_copy(obj.__dict__[name], self.label or f"{type(obj).__name__}.{name}",
                                            self.notes)
        self.lists.append((obj, name, obj.__dict__[name]))

    def _made_per_key(self, key: Any, made: Any) -> None:
        """A MultiMetricStats it made took a per-key object: recording copies in its
        flat lists at once, so a read of them in this batch is seen."""
        for name, field in list(vars(made).items()) if is_metric_object(made) else ():
            if type(field) is list and is_flat_list(field):
                self._listen(made, name)

    def __reduce__(self):  # pickles, copies and dumps as the factory it stands for
        return _the_factory, (self.original,)

    def __repr__(self) -> str:  # a defaultdict's repr shows its factory's
        return repr(self.original)

    def field_origin(self, obj: Any, value: Any) -> Optional[Tuple[Any, List[Tuple[str, Any]]]]:
        """``(initial value, ops since)`` of a number field ``value`` of ``obj``, if
        this factory made ``obj`` in this batch and probed that field; else None."""
        made = self.made.get(id(obj))
        if made is None or made[0] is not obj or not isinstance(value, _Probe):
            return None
        root = next((r for r in made[2].values() if r is value._origin), None)
        return None if root is None else origin_of(root, value)

    def unprobe(self) -> None:
        """Plain numbers back in the fields of the objects made this batch (those no watch read)."""
        for obj, _, fields in self.made.values():
            for name in fields:
                field = obj.__dict__.get(name)
                if isinstance(field, _Probe):
                    obj.__dict__[name] = plain(field)

    def rebound(self) -> List[Tuple[Any, str]]:
        """``(object, field)`` of the lists it put in that a batch replaced by another
        list (``self.ids = sorted(...)[:5]`` in a metric object's ``append``)."""
        return [(obj, name) for obj, name, copy in self.lists if obj.__dict__.get(name) is not copy]

    def plain_lists(self) -> None:
        """Plain lists back in place of the recording copies it put in (stage end)."""
        for obj, name, _ in self.lists:
            field = obj.__dict__.get(name)
            if is_recording(field):
                obj.__dict__[name] = dict(field) if isinstance(field, dict) else list(field)
        self.lists = []

    def origin(self, value: Any) -> Optional[Tuple[Any, List[Tuple[str, Any]]]]:
        """``(factory value, ops since)`` if the factory made ``value`` (or a
        number ``value`` descends from), else None."""
        origin = value._origin if isinstance(value, _Probe) else value
        made = self.made.get(id(origin))
        if made is None or made[0] is not origin:
            return None
        if made[1] is None:
            return value, []
        return origin_of(made[1], value)
