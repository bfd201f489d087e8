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
import operator
import sys
import types
from typing import Any, List, Optional, Tuple

from ddp_eval.state._select import stored_choice
from ddp_eval.state._values import Op, as_builtin

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
    _operands: Tuple = ()  # on the origin: labels of other probes whose values were added to or subtracted from it
    _label = ""  # the watched value a root probe stands in for ("": made elsewhere, a factory's)

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
        other = self._plain_operand(other)
        if isinstance(self, (str, bytes, tuple)):  # s += line: concatenation, replayed in global batch order
            return self._derive(Op.CONCAT, other, _value(self) + other)
        return self._derive(Op.ADD, other, _value(self) + other)

    def __radd__(self, other):  # other + n: the same sum (addition commutes in IEEE 754)
        other = self._plain_operand(other)
        if isinstance(self, (str, bytes, tuple)):  # prefix + s: not replayed
            self._origin._used = True
            return other + _value(self)
        return self._derive(Op.ADD, other, other + _value(self))

    def __sub__(self, other):
        other = self._plain_operand(other)
        return self._derive(Op.SUBTRACT, other, _value(self) - other)

    def _plain_operand(self, other: Any) -> Any:
        """``other``'s plain value; if it is a probe too (another watched number, ``n +=
        self.m``), its value went into this one, which is then replayed with an operand
        a rank computed from its own batches: both are noted (``_read``, ``_operands``)."""
        if isinstance(other, _Probe):
            other._origin._read = True
            self._origin._operands += (other._origin._label,)
            return _value(other)
        return other

    def __reduce__(self):  # pickles, copies and saves as the plain number (a read of its value)
        self._origin._used = self._origin._read = True
        return as_builtin, (_base(self).__name__, _value(self))


_CHOOSING = ("__lt__", "__gt__")  # what the builtin max and min compare with
_COMPARISONS = ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__bool__")


_REPLAYABLE = (int, float, bool, str, type(None), slice)


def _replayable(value: Any) -> bool:
    """Whether a read's operand is a plain value the merge can replay it with."""
    return type(value) in _REPLAYABLE or (type(value) is tuple and all(map(_replayable, value)))


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
        result = _outcome(getattr(_base(self), name), self, args)
        replayable = self is origin and all(map(_replayable, args))
        if not (replayable or comparison):
            origin._read = True
        if not origin._compared:
            origin._compared = []
        if not replayable:
            origin._compared.append(None)
        elif name in _CHOOSING and (kind := stored_choice(sys._getframe(1))):  # self.best = max(self.best, s)
            origin._compared.append((name, tuple(plain(a) for a in args), result, kind))
        else:
            origin._compared.append((name, tuple(plain(a) for a in args), result))
        if isinstance(result, _Raised):  # text[5] on a rank's shorter text: a read too
            raise result.error
        return iter(result) if name == "__iter__" else result
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
    return all(c is not None and _same(_outcome(getattr(_base(value), c[0]), value, c[1]), c[2])
               for c in comparisons)


class _Raised:
    """A read that raised (``text[5]``, ``int("x")``): compared by the exception's type."""

    __slots__ = ("error", "kind")

    def __init__(self, error: Optional[Exception], kind: str = "") -> None:
        self.error, self.kind = error, kind or type(error).__qualname__

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Raised) and other.kind == self.kind

    __hash__ = None

    def __reduce__(self):  # travels in a report as the type's name
        return _Raised, (None, self.kind)


def _outcome(method: Any, value: Any, args: tuple) -> Any:
    try:
        result = method(value, *args)
        return tuple(result) if method.__name__ == "__iter__" else result  # for x in t: what it gives
    except Exception as error:
        return _Raised(error)


def _same(a: Any, b: Any) -> bool:
    return a == b or (a != a and b != b)  # NaN is NaN


_USES = ("__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__",
         "__mod__", "__rmod__", "__pow__", "__rpow__", "__divmod__", "__neg__", "__abs__", "__lt__", "__le__",
         "__gt__", "__ge__", "__eq__", "__ne__", "__bool__", "__round__", "__trunc__", "__floor__", "__ceil__")
# a number's value read whole: converted (float(n), range(n), items[n], torch.tensor(n)),
# printed (f"{n}", str(n)) or used as a key (d[n])
_NUMBER_READS = ("__int__", "__float__", "__index__", "__format__", "__str__", "__repr__", "__hash__")
# a string's value read whole: formatted, converted or hashed (f"{s}", str(s), repr(s),
# hash(s), d[s], bytes(b)); C code that takes its characters directly (sep.join([s]),
# json.dumps(s)) is not seen
_TEXT_READS = ("__format__", "__str__", "__repr__", "__hash__", "__bytes__")


def _uses(base: type) -> List[str]:
    """What reads a probe's value, taken from ``dir()``: every method of the type but
    ``+`` and ``-`` (replayed; ``+=`` on a string is concatenation), with, for
    numbers, their conversions (:data:`_NUMBER_READS`), for strings, their formatting
    (:data:`_TEXT_READS`): a method a future Python
    adds is a read too (``n.bit_count()``, ``n & 1``, ``x.hex()``).

    Example
    -------
    >>> {"bit_length", "__and__", "conjugate", "__mod__"} <= set(_uses(int)), "hex" in _uses(float)
    (True, True)
    >>> {"__len__", "endswith", "__format__", "__str__"} <= set(_uses(str))
    True
    """
    numbers = base in (int, float)
    own = [name for name in dir(base) if name not in ("__add__", "__radd__", "__sub__", "__getnewargs__", "__hash__",
                                                       "__bytes__", "__str__")
           and (name not in dir(object) or name in _USES or (numbers and name in _NUMBER_READS))]
    reads = _NUMBER_READS if numbers else _TEXT_READS
    own += [name for name in reads if name not in own and hasattr(base, name)]
    return [name for name in own if type(inspect.getattr_static(base, name)).__name__ in _METHOD_KINDS]


_METHOD_KINDS = ("method_descriptor", "wrapper_descriptor")  # not static or class methods


def _probe_class(base: type) -> type:
    namespace = {"__hash__": base.__hash__, **{name: _used(name) for name in _uses(base)}}
    return type(f"{base.__name__.capitalize()}Probe", (_Probe, base), namespace)


IntProbe, FloatProbe, StrProbe, BytesProbe, TupleProbe = (_probe_class(kind) for kind in (*PROBED_TYPES, tuple))
_CLASSES = {int: IntProbe, float: FloatProbe, str: StrProbe, bytes: BytesProbe, tuple: TupleProbe}
_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def probed(value: Any) -> bool:
    """Whether a probe stands in for ``value`` during a batch: an ``int``, ``float``,
    ``str`` or ``bytes``, or a tuple of them (``self.best = (score, utt_id)``)."""
    return type(value) in PROBED_TYPES or (type(value) is tuple and bool(value) and scalars_only(value))


def scalars_only(entries: Any) -> bool:
    """Whether a tuple's (or list's) entries are all plain numbers, strings, bytes or None (C speed).

    Example
    -------
    >>> scalars_only((1, "a", None)), scalars_only(()), scalars_only((1, [2]))
    (True, True, False)
    """
    return _SCALARS.issuperset(map(type, entries))


def _base(value: Any) -> type:
    return next(kind for kind in (float, str, bytes, int, tuple) if isinstance(value, kind))


# a probe's plain value by the base type's own copy (float(p) would call the probe's
# __float__, a read the recipe did not make)
_PLAIN = {int: int.__pos__, float: float.__pos__, str: str.__str__, bytes: lambda b: bytes.__getitem__(b, slice(None)),
          tuple: lambda t: tuple.__getitem__(t, slice(None))}


def _value(probe: Any) -> Any:
    return _PLAIN[_base(probe)](probe)


def probe(value: Any, label: str = "") -> Any:
    """A probe equal to ``value`` (an ``int`` or ``float``, not a subclass), standing in for ``label``."""
    root = _CLASSES[type(value)](value)
    root._origin = root
    if label:
        root._label = label
    return root


_ROOT_FIELDS = frozenset({"_origin", "_label"})  # what a root probe holds until something uses it
_SPARE_REFERENCES = 3  # sys.getrefcount of a probe held by one local name only (its _origin, the call's argument)


def untouched(root: Any) -> bool:
    """Whether nothing used root probe ``root`` (no read, no + or -): it may stand in
    for the same value again.

    Example
    -------
    >>> n = probe(3, "n")
    >>> untouched(n), (n > 2, untouched(n))[1]
    (True, False)
    """
    return root.__dict__.keys() <= _ROOT_FIELDS


def reusable(root: Any) -> bool:
    """:func:`untouched`, and held by no one but the caller's one name (a batch kept no
    reference to it: ``cache.append(self.n)`` outside the Brain would see its next uses)."""
    return untouched(root) and sys.getrefcount(root) <= _SPARE_REFERENCES + 1  # the caller's name, this argument


def is_probe(value: Any) -> bool:
    return isinstance(value, _Probe)


PLAIN = frozenset({int, float, str, bytes, bool, type(None)})  # exactly these: no probe, none held


def unprobed(value: Any, found: List[str], depth: int = 4, handed: bool = False) -> Any:
    """``value`` with each probe a batch put in it (``d[k] = self.n``, ``[self.n]``,
    ``replace(acc, n=acc.n + 1)``) replaced by its plain value, in lists, dicts,
    tuples, sets and objects' fields ``depth`` levels down; each probe's origin is
    noted as read whole and its label appended to ``found``. A probe a factory or a
    ``get`` default handed out stays (its own record follows it), unless ``handed``.

    Example
    -------
    >>> n, found = probe(3, "n"), []
    >>> kept = unprobed({"count": [n + 1]}, found)
    >>> kept, type(kept["count"][0]).__name__, found
    ({'count': [4]}, 'int', ['n'])
    """
    if type(value) in PLAIN:
        return value
    if isinstance(value, _Probe):
        origin = value._origin
        if not origin._label:  # a factory's or a get default's: its own record follows it, but where none does
            return _value(value) if handed else value
        origin._used = origin._read = True
        found.append(origin._label)
        return _value(value)
    if depth == 0 or isinstance(value, (str, bytes, int, float, type(None))):
        return value
    if hasattr(type(value), "_ddp_plain"):  # a tensor's or array's probe, a view or a result of it
        label, kept = value._ddp_plain()
        found.append(label)
        return kept
    if type(value) in (list, tuple) and PLAIN.issuperset(map(type, value)):  # ids + [utt]: entries in C speed
        return value
    if isinstance(value, list):
        for index, item in enumerate(list(value)):
            kept = item if type(item) in PLAIN else unprobed(item, found, depth - 1, handed)
            if kept is not item:
                list.__setitem__(value, index, kept)
    elif isinstance(value, dict):
        for key, item in list(dict.items(value)):
            kept = item if type(item) in PLAIN else unprobed(item, found, depth - 1, handed)
            if kept is not item:
                dict.__setitem__(value, key, kept)
    elif type(value) is tuple:
        kept = tuple(item if type(item) in PLAIN else unprobed(item, found, depth - 1, handed) for item in value)
        return value if all(map(operator.is_, kept, value)) else kept
    elif isinstance(value, set) and any(isinstance(item, _Probe) for item in value):
        probes = [item for item in value if isinstance(item, _Probe)]
        set.difference_update(value, probes)
        set.update(value, [unprobed(item, found, handed=handed) for item in probes])
    elif type(getattr(value, "__dict__", None)) is dict and not isinstance(value, (type, types.ModuleType)):
        fields = vars(value)
        for key, item in list(fields.items()):
            kept = unprobed(item, found, depth - 1, handed) if isinstance(item, (_Probe, list, dict, tuple, set)) \
                else item
            if kept is not item:
                fields[key] = kept
    return value


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
