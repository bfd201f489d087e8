"""Telling ``n += x`` from ``n = x`` for numbers, by what a batch does to them.

A number has no identity to watch: ``+=`` and ``=`` both bind a new object.
Before each batch of a sharded stage, the tracker puts a *probe* in place of a
watched ``int`` or ``float``: an instance of a subclass of it, equal to it.
Adding to or subtracting from a probe gives another probe that remembers the
operation; any other use of its value in a computation (a comparison, a
product, a truth test) is noted. After the batch, :func:`read_changes` looks at
what the attribute holds:

* the probe itself: unchanged;
* a probe descended from it: the chain of ``+`` and ``-`` (``n += x``,
  ``n -= x``, ``n = n + x``), replayed at the merge in global batch order,
  which gives one process's value bit for bit;
* another number, from a probe whose value was not otherwise used: ``n = x``;
* another number, from a probe whose value was used (``max(n, x)``, ``n * 0.9
  + x``, ``if n > x: n = x``): the new value may depend on the old one, and
  cannot be merged (the tracker names it).

A probe pickles, copies and prints as the plain number.

Example
-------
>>> root = probe(2)
>>> n = root + 3
>>> n -= 1
>>> read_changes(root, n)
('ops', [('+', 3), ('-', 1)])
>>> read_changes(root, 7), read_changes(root, root)
(('set', 7), ('same', None))
>>> used = probe(1.5)
>>> read_changes(used, max(used, 4.0))
('derived', 4.0)
>>> type(plain(n)) is int and plain(n) == 4
True
"""

import inspect
from typing import Any, List, Optional, Tuple

import torch

from ddp_eval.state._rebuilt import add, concat, subtract
from ddp_eval.state._recording import is_recording, listening_copy
from ddp_eval.state._values import ABSENT, Op, as_builtin, is_array, is_metric_object, numpy

PROBED_TYPES = (int, float, str, bytes)


class _Probe:
    """What the two probe classes share; ``_origin`` is the batch's first probe.
    Class defaults keep a root probe to one attribute of its own (it is made for
    every watched number before every batch)."""

    _ddp_probe = True  # a list's entry that is a probe replays its own reads (ddp_eval.state._recording)
    _parent = _op = _operand = None
    _used = False  # on the origin: its value was used by something other than + and -
    _results: Tuple = ()  # on the origin: (result, parent, op, operand) of + or - giving another number type

    _compared: Tuple = ()  # on the origin: a list of (name, operand, result), a comparison each (compared_alike)
    _derived = False  # on the origin: a value was computed from it by + or -
    _read = False  # on the origin: its value went into another one by more than a comparison

    def _derive(self, op: str, operand: Any, result: Any) -> Any:
        origin = self._origin
        origin._derived = True
        if type(result) in _CLASSES:
            child = _CLASSES[type(result)](result)
            child._origin, child._parent, child._op, child._operand = origin, self, op, operand
            return child
        if isinstance(result, (int, float)) and not isinstance(result, bool):  # e.g. numpy.float64
            origin._results = origin._results + ((result, self, op, operand),)
        else:
            origin._used = True  # a tensor or array: not a number any more
        return result

    def __add__(self, other):
        if isinstance(self, (str, bytes)):  # s += line: concatenation, replayed in global batch order
            return self._derive(Op.CONCAT, other, _value(self) + other)
        return self._derive(Op.ADD, other, _value(self) + other)

    def __radd__(self, other):  # other + n: the same sum (addition commutes in IEEE 754)
        if isinstance(self, (str, bytes)):  # prefix + s: not replayed
            self._origin._used = True
            return other + _value(self)
        return self._derive(Op.ADD, other, other + _value(self))

    def __sub__(self, other):
        return self._derive(Op.SUBTRACT, other, _value(self) - other)

    def __reduce__(self):  # pickles, copies and saves as the plain number (a read of its value)
        self._origin._used = self._origin._read = True
        return as_builtin, (_base(self).__name__, _value(self))


_COMPARISONS = ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__bool__")


_REPLAYABLE = (int, float, bool, str, type(None))


def _used(name: str):
    """A method of the base type that also notes that the probe's value was used.
    A read of the batch-start value with plain operands (``n % 2``, ``n > k``,
    ``f"{n}"``, ``d[n]``) is kept as ``(name, operands, result)``, replayed at the
    merge on one process's value (:func:`compared_alike`); any other read (of a
    value the batch changed, or with a tensor) is kept as None and, but for a
    comparison, notes that the value went into another one (``_read``)."""
    comparison = name in _COMPARISONS

    def method(self, *args):
        origin = self._origin
        origin._used = True
        result = getattr(_base(self), name)(self, *args)
        replayable = self is origin and all(type(a) in _REPLAYABLE for a in args)
        if not (replayable or comparison):
            origin._read = True
        if not origin._compared:
            origin._compared = []
        origin._compared.append((name, tuple(plain(a) for a in args), result) if replayable else None)
        return result
    method.__name__ = name
    return method


def compared_alike(comparisons: Tuple, value: Any) -> bool:
    """Whether the reads a batch made of its value at batch start (``(name,
    operands, result)``; None: of a value it had changed, or with another operand)
    give the same results on ``value``, one process's value at that batch.

    Example
    -------
    >>> x = probe(0.0)
    >>> _ = min(x, 0.3)
    >>> compared_alike(x._compared, 0.0), compared_alike(x._compared, 0.5)
    (True, False)
    >>> n = probe(3)
    >>> _ = n % 2, n > 1
    >>> compared_alike(n._compared, 5), compared_alike(n._compared, 4)
    (True, False)
    """
    return all(c is not None and _same(getattr(_base(value), c[0])(value, *c[1]), c[2]) for c in comparisons)


def _same(a: Any, b: Any) -> bool:
    return a == b or (a != a and b != b)  # NaN is NaN


_USES = ("__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__",
         "__mod__", "__rmod__", "__pow__", "__rpow__", "__divmod__", "__neg__", "__abs__", "__lt__", "__le__",
         "__gt__", "__ge__", "__eq__", "__ne__", "__bool__", "__round__", "__trunc__", "__floor__", "__ceil__")
# a number's value read whole: converted (float(n), range(n), items[n], torch.tensor(n)),
# printed (f"{n}", str(n)) or used as a key (d[n])
_NUMBER_READS = ("__int__", "__float__", "__index__", "__format__", "__str__", "__repr__", "__hash__")


def _uses(base: type) -> List[str]:
    """What reads a probe's value: for numbers, :data:`_USES`; for strings and
    bytes, every method of the type but ``+`` (``+=`` is concatenation,
    replayed), taken from ``dir()``."""
    if base in (int, float):
        return [name for name in _USES + _NUMBER_READS if hasattr(base, name)]
    own = (name for name in dir(base) if name not in ("__add__", "__getnewargs__", "__hash__", "__bytes__", "__str__")
           and (name not in dir(object) or name in _USES))
    return [name for name in own if type(inspect.getattr_static(base, name)).__name__ in _METHOD_KINDS]


_METHOD_KINDS = ("method_descriptor", "wrapper_descriptor")  # not static or class methods


def _probe_class(base: type) -> type:
    namespace = {"__hash__": base.__hash__, **{name: _used(name) for name in _uses(base)}}
    return type(f"{base.__name__.capitalize()}Probe", (_Probe, base), namespace)


IntProbe, FloatProbe, StrProbe, BytesProbe = (_probe_class(kind) for kind in PROBED_TYPES)
_CLASSES = {int: IntProbe, float: FloatProbe, str: StrProbe, bytes: BytesProbe}


def _base(value: Any) -> type:
    return next(kind for kind in (float, str, bytes, int) if isinstance(value, kind))


# a probe's plain value by the base type's own copy (float(p) would call the probe's
# __float__, a read the recipe did not make)
_PLAIN = {int: int.__pos__, float: float.__pos__, str: str.__str__, bytes: lambda b: bytes.__getitem__(b, slice(None))}


def _value(probe: Any) -> Any:
    return _PLAIN[_base(probe)](probe)


def probe(value: Any) -> Any:
    """A probe equal to ``value`` (an ``int`` or ``float``, not a subclass)."""
    root = _CLASSES[type(value)](value)
    root._origin = root
    return root


def is_probe(value: Any) -> bool:
    return isinstance(value, _Probe)


def plain(value: Any) -> Any:
    """``value`` as a plain ``int`` or ``float`` if it is a probe; else itself."""
    return _value(value) if isinstance(value, _Probe) else value


def _chain(node: Any, root: _Probe) -> Optional[List[Tuple[str, Any]]]:
    ops = []
    while node is not root:
        if not isinstance(node, _Probe) or node._origin is not root or node._parent is None:
            return None
        ops.append((node._op, plain(node._operand)))
        node = node._parent
    return ops[::-1]


def read_changes(root: _Probe, value: Any) -> Tuple[str, Any]:
    """What a batch did to a number, from the probe put in place before it
    (``root``) and what the attribute holds after it (``value``):
    ``("same", None)``, ``("ops", [(op, operand), ...])``, ``("set", number)``
    or ``("derived", number)``."""
    if value is root:
        return "same", None
    ops = _chain(value, root)
    if ops is None:
        for result, parent, op, operand in root._results:  # the last step made a non-wrappable number
            if result is value:
                before = _chain(parent, root)
                ops = None if before is None else before + [(op, plain(operand))]
                break
    if ops is not None:
        return "ops", ops
    return ("derived" if root._used else "set"), plain(value)


def origin_of(root: _Probe, value: Any) -> Optional[Tuple[Any, List[Tuple[str, Any]]]]:
    """``(initial value, ops)`` of a number that started as probe ``root`` (handed
    out by a factory or a ``get`` default) and became ``value`` by + and - (None:
    set or derived otherwise)."""
    what, data = read_changes(root, value)
    return (plain(root), data if what == "ops" else []) if what in ("ops", "same") else None


_APPLY = {Op.ADD: add, Op.SUBTRACT: subtract, Op.CONCAT: concat}


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # a number that did not exist yet


def replay(start: Any, events: List[Tuple[str, Any]]) -> Any:
    """Applies ``("+", x)``, ``("-", x)``, ``("=", v)`` and ``("^", v)`` (an
    initial value: taken only while there is none, :data:`UNSET`) to ``start``
    in order.

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
        elif op == Op.SET:
            value = operand
        elif value is UNSET and op in (Op.ADD, Op.CONCAT):
            value = operand
        else:
            value = _APPLY[op](0 if value is UNSET else value, operand)
    return value


def replays_to(start: Any, events: List[Tuple[int, str, Any]], value: Any) -> bool:
    """Replay equality of a rebuilt tensor or array on its rank: ``events`` (this
    rank's, ``(batch, op, operand)``) replayed in order from ``start`` give
    ``value`` (bit for bit: the same operations in the same order)."""
    current = UNSET if start is None or start is ABSENT else start
    try:
        for _, op, operand in events:
            if op == Op.COMPARED:
                continue
            if op in (Op.SET, Op.OVER_NONE, Op.CREATED) or (op == Op.INITIAL and current is UNSET):
                current = operand
            elif op == Op.UNPROBED:
                current = operand[1]
            elif op != Op.INITIAL:
                current = operand if current is UNSET and op == Op.CONCAT else _APPLY[op](current, operand)
        return _same_values(current, value)
    except Exception:  # shapes or types that do not combine: not what the record says
        return False


def _same_values(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = a.detach().cpu(), b.detach().cpu()
        return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a != a) & (b != b)).all())
    if is_array(a) and is_array(b):
        return a.shape == b.shape and a.dtype == b.dtype and numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    return False


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

    def __init__(self, original) -> None:
        self.original = original
        self.made: dict = {}  # id -> (object, probe or None, {field: probe}), of this batch
        self.lists: list = []  # (object, field) of the recording copies it put in, for the whole stage

    def __call__(self):
        value = self.original()
        root = probe(value) if type(value) in PROBED_TYPES else None
        handed = value if root is None else root
        fields = {}
        own = getattr(handed, "__dict__", None) if root is None else None
        if isinstance(own, dict):  # an object (a dataclass, a metric object): its numbers probed from the start
            for name, field in own.items():
                if type(field) in (int, float):
                    fields[name] = own[name] = probe(field)
                elif type(field) is list and not field and is_metric_object(handed):  # its sort, insert: seen
                    own[name] = listening_copy(field, f"{type(handed).__name__}.{name}")
                    self.lists.append((handed, name))
        self.made[id(handed)] = (handed, root, fields)
        return handed

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

    def plain_lists(self) -> None:
        """Plain lists back in place of the recording copies it put in (stage end)."""
        for obj, name in self.lists:
            field = obj.__dict__.get(name)
            if is_recording(field):
                obj.__dict__[name] = list(field)
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
