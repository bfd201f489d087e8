"""Telling ``x = x + y`` from ``x = f(batch)`` for tensors, arrays, lists and tuples.

A batch that rebuilds a value from its previous one (``x = x + y``, ``x =
torch.cat([x, y])``, ``ids = ids + [utt]``) binds a new object, as a batch that
sets it anew does (``self.last_attn = attn``). Merged as "the last batch's
value", the first would keep one rank's partial result. So:

* lists and tuples: a new one whose first entries *are* the old one's entries
  (identity) extends it: ``("&", tail)``, replayed as concatenation in global
  batch order; over an empty one this cannot be told from a new value
  (``"?&"``, decided by the other batches at the merge);
* tensors and NumPy arrays: before each batch a *probe* stands in the
  attribute, an alias of the same data (:class:`TensorProbe`, :class:`ArrayProbe`)
  that notes what the batch computes from it: ``+`` / ``-`` of another value and
  concatenation along the first dimension are replayed; any other use of its
  value (``torch.maximum``, a running mean, a comparison) makes a new value
  *derived* from the old one, which is named, never merged.

Example
-------
>>> import torch
>>> x = torch.zeros(2)
>>> p = tensor_probe(x)
>>> y = p + torch.ones(2)
>>> read_rebuilt(p, y), read_rebuilt(p, p)
(('ops', [('+', tensor([1., 1.]))]), ('same', None))
>>> read_rebuilt(tensor_probe(x), torch.ones(2))[0]
'set'
>>> q = tensor_probe(x)
>>> read_rebuilt(q, torch.maximum(q, torch.ones(2)))[0]
'derived'
>>> extends([1.5, "a"], [1.5, "a", "b"]), extends([], ["b"])
(('&', ['b']), ('?&', ['b']))
"""

import copy
import operator
from typing import Any, List, Optional, Tuple

import torch

from ddp_eval.state import _recording
from ddp_eval.state._numbers import unprobed
from ddp_eval.state._recording import GROWS, changing_methods, is_recording
from ddp_eval.state._values import Op, as_builtin, is_array, numpy

_ADD = {"add", "__add__", "__radd__", "__iadd__"}
_SUB = {"sub", "__sub__"}
_CAT = {"cat", "concat", "concatenate"}
# what reads no value: metadata, and the attribute look-ups that give it
_NO_READ = {"__get__", "size", "dim", "numel", "nelement", "ndimension", "data_ptr", "element_size", "stride",
            "storage_offset", "is_floating_point", "is_complex", "is_contiguous", "get_device", "__len__",
            "__hash__", "__reduce_ex__", "__setstate__", "__repr__", "__format__", "requires_grad_",
            "data.__get__", "data.__set__", "shape.__get__"}


# reads of a value's length (len(x), x.shape, x.size(0)): its length is accumulated
# state where batches concatenate to it (torch.cat([x, y]))
_SHAPE_READS = {"__len__", "size", "numel", "nelement", "shape.__get__"}


# what moves or reshapes a value without combining it with another (``F.pad(prev, ...)``
# of a previous alignment, ``torch.stack``, indexing, a copy, a dtype or device): its
# tensor result is a *child* probe, whose own uses count as the value's, so that
# ``prev = x.clone(); prev += y; self.x = prev`` is derived, while an aligner that
# pads the previous alignment for the loss, then stores a new one, is not
_MOVES = {"clone", "detach", "__deepcopy__", "__setitem__", "copy_", "pad", "stack", "hstack", "vstack", "cat",
          "concat", "concatenate", "__getitem__", "view", "reshape", "flatten", "squeeze", "unsqueeze", "permute",
          "transpose", "t", "contiguous", "expand", "expand_as", "narrow", "select", "split", "chunk", "unbind",
          "to", "cpu", "cuda", "long", "float", "int", "double", "half", "bool", "type", "numpy", "tolist", "item",
          "pad_sequence", "index_select", "gather", "flip", "roll", "repeat", "tile", "astype", "copy", "ravel",
          "__array__", "__iter__", "__index__", "__int__", "__float__"}


# of the moves, those whose result is the value itself, out of the tensor: a read of it
_EXTRACTS = {"item", "tolist", "numpy", "__float__", "__int__", "__index__", "__array__"}


# in-place changes the merge replays as increments (``x += y``, ``x.add_(y)``,
# ``torch.add(x, y, out=x)``, ``index_add_``); an index assignment is one if the
# value assigned was computed from the value itself by + or - (``x[i] += 1``,
# ``x[i] = x[i] + 1``); every other in-place change is noted in ``writes``
_ADDITIVE = {"add_", "sub_", "__iadd__", "__isub__", "index_add_", "scatter_add_", "add", "sub", "subtract"}


def _write(record: Any, name: str, args: tuple, kwargs: dict, out: Any, target: Any) -> bool:
    """Notes an in-place change of ``target`` (the probe, or a view of it) in
    ``record.writes`` unless additive; whether the call was one."""
    if name == "__setitem__":
        if not (args and args[0] is target):
            return False
        value = args[2] if len(args) > 2 else None
        if not any(value is s for s in record.sums):
            record.writes.append("index assignment of a value not computed from it by + or -")
        return True
    if name == "data.__set__" and args and args[0] is target:
        if not any(args[1] is s for s in record.sums):  # x.data += y is an increment; x.data = y is not
            record.writes.append("a write through .data")
        return True
    into = kwargs.get("out")
    if out is None or not (out is target or (into is target and out is into)) or not (args and (
            args[0] is target or into is target)):
        return False
    if name in _ADDITIVE:
        record.sums.append(out)
    else:
        record.writes.append(f"{name}()")
    return True


class _Record:
    """What a batch computed from one probe: ``results`` of ``+``, ``-`` and
    concatenation, whether the value was used otherwise, values computed from it
    (or its views) by ``+`` or ``-`` (``sums``) and in-place changes the merge
    cannot replay as increments (``writes``)."""

    __slots__ = ("root", "used", "read", "results", "sums", "writes", "aliased", "steered", "index_reads",
                 "index_sets", "notes", "shape_read", "label", "made", "grown")

    def __init__(self, root: Any, notes: Any = None) -> None:
        self.root, self.used, self.results, self.sums, self.writes = root, False, [], [], []
        self.notes = notes  # the stage's BatchNotes (an empty list's probe): reads count while a batch runs
        self.index_reads, self.index_sets = [], set()  # an array's entries read (float(a[i])), and set again
        self.steered = None  # an empty list's growing method called after a read of it
        self.read = False  # the value itself (not an entry of it) went into another computation
        self.aliased = False  # .data was read: a change through it moves no _version
        self.shape_read = False  # its length was read (len(x), x.shape): see _SHAPE_READS
        self.label = ""  # the watched value's
        self.made = False  # a defaultdict's factory made it for a new key during the batch
        self.grown = 0  # an empty list's probe: how many entries its own methods put in (see in_place_writes)

    def note(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        root = self.root
        if name in _SHAPE_READS:
            self.shape_read = True
        if _write(self, name, args, kwargs, out, root):
            return
        if name in _NO_READ or out is root:  # metadata, or changed in place (seen by _version)
            return
        if name in _ADD and len(args) == 2 and not kwargs and any(a is root for a in args):
            self._result(out, Op.ADD, args[1] if args[0] is root else args[0])
        elif name in _SUB and len(args) == 2 and not kwargs and args[0] is root:
            self._result(out, Op.SUBTRACT, args[1])
        elif (name in _CAT and args and isinstance(args[0], (list, tuple)) and args[0] and args[0][0] is root
              and _axis(args, kwargs) == 0 and len(args) <= 2):
            rest = [_plain(x) for x in args[0][1:]]
            tail = rest[0] if len(rest) == 1 else _cat(rest)
            self._result(out, Op.CONCAT, tail)
        elif (name == "append" and len(args) == 2 and args[0] is root and getattr(root, "ndim", 0) == 1
              and kwargs.get("axis") is None):  # numpy.append of a 1-d array: concatenation
            self._result(out, Op.CONCAT, numpy.ravel(_plain(args[1])))
        elif name not in _MOVES or name in _EXTRACTS:
            self.used = self.read = True

    def _result(self, out: Any, op: str, operand: Any) -> None:
        """A value computed from the probe by ``op``, with what tells a later
        in-place change of it (``x = x + y; x += z``): its version, or a copy."""
        if isinstance(out, (list, tuple)):
            mark = tuple(map(id, (list.__iter__ if isinstance(out, list) else tuple.__iter__)(out)))
        else:
            mark = out._version if isinstance(out, torch.Tensor) else (numpy.array(out) if is_array(out) else None)
        self.results.append((out, op, operand, mark))


def _axis(args: tuple, kwargs: dict) -> int:
    axis = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    return 0 if axis is None else axis


class TensorProbe(torch.Tensor):
    """An alias of a watched tensor (same storage, same ``_version``) that notes
    what a batch computes from it; results are plain tensors."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        record = _find_record(args)
        if record is not None:
            name = getattr(func, "__name__", "")
            if name in ("__get__", "__set__") and getattr(func, "__self__", None) is torch.Tensor.data:
                name = "data." + name
            elif name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.shape:
                name = "shape.__get__"
            recorded = len(getattr(record, "results", ()))
            record.note(name, args, kwargs, out)
            if len(getattr(record, "results", ())) != recorded and type(out) is torch.Tensor:
                out = _result_child(out, record)  # x + y, torch.cat([x, y]): a result the merge may replay
            elif name == "data.__get__" and type(out) is torch.Tensor:  # an alias with a version of its own
                out = _child(out, record)
                (record.record if isinstance(record, _Used) else record).aliased = True
            elif name in _MOVES and type(out) is torch.Tensor:
                out = out.as_subclass(TensorProbe)
                out._ddp_record = _Used(record)
            elif name in _MOVES and isinstance(out, (list, tuple)) and all(type(o) is torch.Tensor for o in out):
                out = type(out)(_child(o, record) for o in out)  # split, chunk, unbind
        return out

    def _ddp_plain(self) -> Tuple[str, torch.Tensor]:  # stored elsewhere by a batch: (its value's label, plain)
        return _label_of(self), _as_plain(self)

    def __reduce_ex__(self, protocol):  # pickles and saves as the plain tensor (torch.load with weights_only too)
        return _as_plain(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return copy.deepcopy(_as_plain(self), memo)

    def __repr__(self, **kwargs):  # a subclass's repr names the class: the plain tensor's
        return repr(_as_plain(self))


def _as_plain(probe: Any) -> torch.Tensor:
    """The plain tensor a probe aliases; pickling or copying it is a read of its value."""
    record = getattr(probe, "_ddp_record", None)
    if record is not None:
        (record.record if isinstance(record, _Used) else record).used = True
    with torch._C.DisableTorchFunctionSubclass():
        return probe.as_subclass(torch.Tensor)


def _label_of(probe: Any) -> str:
    """The label of the watched value a probe, a view or a result of it stands for."""
    record = getattr(probe, "_ddp_record", None)
    record = record.record if isinstance(record, _Used) else record
    return getattr(record, "label", "")


def _child(tensor: torch.Tensor, record: Any) -> "TensorProbe":
    child = tensor.as_subclass(TensorProbe)
    child._ddp_record = _Used(record)
    return child


def _result_child(tensor: torch.Tensor, record: "_Record") -> "TensorProbe":
    """A result the merge may replay (``x = x + y``, ``torch.cat([x, y])``), as a probe
    whose reads are reads of what batches accumulated (:class:`_Result`)."""
    child = tensor.as_subclass(TensorProbe)
    child._ddp_record = _Result(record)
    out, op, operand, _ = record.results[-1]
    record.results[-1] = (child, op, operand, child._version)
    return child


def _find_record(args: Any) -> Optional[_Record]:
    for arg in args:
        if isinstance(arg, (list, tuple)):
            found = _find_record(arg)
            if found is not None:
                return found
        record = getattr(arg, "_ddp_record", None) if isinstance(arg, (torch.Tensor, _ARRAY_TYPES)) else None
        if record is not None:
            return record
    return None


def tensor_probe(tensor: torch.Tensor) -> TensorProbe:
    """A probe standing in for ``tensor`` during one batch."""
    probe = tensor.as_subclass(TensorProbe)
    probe._ddp_record = _Record(probe)
    return probe


# NumPy's own methods, which do not pass through its dispatch (a.tolist(), a.item(), a.dot(b), a.sort()),
# from dir(numpy.ndarray): reads of the value, but for those that change it in place (writes) and these
_ARRAY_WRITES = frozenset({"fill", "sort", "put", "partition", "resize", "setfield", "itemset"})
_ARRAY_NOT_READS = frozenset({"view", "setflags", "to_device"})  # an alias (ddp_eval's own too), flags, a device
_ARRAY_READ_DUNDERS = ("__iter__", "__float__", "__int__", "__index__", "__bool__", "__complex__", "__contains__")


def _through_memory(probe: Any, name: str) -> Any:
    root = _root_record(probe)
    if root is not None:
        root.used = root.read = True
        root.writes.append(f".{name}")
    return getattr(numpy.ndarray, name).__get__(probe)


def _array_method(name: str):
    method = getattr(numpy.ndarray, name)

    def run(self, *args, **kwargs):
        root = _root_record(self)
        if root is not None:
            if name in _ARRAY_WRITES or (name == "byteswap" and (args[:1] == (True,) or kwargs.get("inplace"))):
                root.writes.append(f"{name}()")
            else:
                root.used = root.read = True
        return method(self, *args, **kwargs)
    run.__name__ = name
    return run


if numpy is not None:
    class ArrayProbe(numpy.ndarray):
        """A view of a watched NumPy array that notes what a batch computes from it."""

        def _ddp_plain(self):  # stored elsewhere by a batch: (its value's label, the plain array)
            return _label_of(self), _plain_array(self)

        def __reduce__(self):  # pickles, copies and saves as the plain array (a read of its value)
            return _plain_array(self).__reduce__()

        def __deepcopy__(self, memo):
            return copy.deepcopy(_plain_array(self), memo)

        def __copy__(self):
            return _plain_array(self).copy()

        def __repr__(self):  # a subclass's repr names the class: the plain array's
            return repr(_plain_array(self))

        def __len__(self):
            _note_shape_read(self)
            return super().__len__()

        @property
        def shape(self):
            _note_shape_read(self)
            return numpy.ndarray.shape.__get__(self)

        @shape.setter
        def shape(self, value):
            numpy.ndarray.shape.__set__(self, value)

        @property
        def flat(self):  # an iterator over the memory (a.flat[0], a.flat[i] = v): a read, and maybe a write
            return _through_memory(self, "flat")

        @property
        def data(self):  # a buffer of the memory
            return _through_memory(self, "data")

        @property
        def size(self):
            _note_shape_read(self)
            return numpy.ndarray.size.__get__(self)

        def __array_finalize__(self, obj):
            # views of the probe (x[0:2]) report uses to the same record, as uses
            record = getattr(obj, "_ddp_record", None)
            self._ddp_record = None if record is None else _Used(record)

        def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
            args = tuple(_plain(x) for x in inputs)
            if out is not None:
                kwargs["out"] = tuple(_plain(x) for x in out)
            result = getattr(ufunc, method)(*args, **kwargs)
            root = _root_record(self)
            if out is not None and any(o is self for o in out):  # in place (x += y): the watch compares contents
                if root is not None and ufunc in _ADDS and method == "__call__":
                    root.sums.append(self)
                elif root is not None:
                    root.writes.append(f"numpy.{ufunc.__name__}(out=)")
                return self
            if method == "at" and inputs and inputs[0] is self:  # numpy.add.at(x, i, y): in place
                if root is not None and ufunc not in _ADDS:
                    root.writes.append(f"numpy.{ufunc.__name__}.at()")
                return result
            name = {numpy.add: "add", numpy.subtract: "sub"}.get(ufunc, ufunc.__name__) if method == "__call__" \
                else method
            return _noted_array(_find_record(inputs), name, inputs, {}, result)

        def __getitem__(self, index):
            root = _root_record(self)
            entry = super().__getitem__(index)
            if root is not None:
                root.sums.append(_index_key(index))  # x[i] = x[i] + 1 reads i first: an increment
                if not isinstance(entry, numpy.ndarray):  # an entry out of the array: a read unless set again
                    root.index_reads.append(_index_key(index))
            return entry

        def __setitem__(self, index, value):
            root = _root_record(self)
            if root is not None:
                root.index_sets.add(_index_key(index))
                key = _index_key(index)  # root.sums holds arrays too: compared by identity, keys by value
                if not any(value is s or (type(s) is tuple and s == key) for s in root.sums):
                    root.writes.append("index assignment of a value not computed from it")
            super().__setitem__(index, value)

        def __array_function__(self, func, types, args, kwargs):
            return _noted_array(_find_record(args), func.__name__, args, kwargs, func(*_unwrap(args), **kwargs))

    for _name in [name for name in dir(numpy.ndarray) if not name.startswith("_") and callable(
            getattr(numpy.ndarray, name)) and name not in _ARRAY_NOT_READS] + list(_ARRAY_READ_DUNDERS):
        if _name not in vars(ArrayProbe) and hasattr(numpy.ndarray, _name):
            setattr(ArrayProbe, _name, _array_method(_name))

    _ARRAY_TYPES: tuple = (numpy.ndarray,)
    _ADDS = (numpy.add, numpy.subtract)
else:  # pragma: no cover - torch installs numpy
    ArrayProbe = None
    _ARRAY_TYPES = ()


def _note_shape_read(probe: Any) -> None:
    record = getattr(probe, "_ddp_record", None)
    if isinstance(record, (_Record, _Result)):  # of the value, or of one rebuilt from it, not of a view
        (record.record if isinstance(record, _Result) else record).shape_read = True


def _noted_array(record: Any, name: str, args: tuple, kwargs: dict, result: Any) -> Any:
    """``result`` of a NumPy function or ufunc on a probe, noted: a result the merge
    may replay (``x + y``, ``numpy.append(x, y)``) as a child whose reads are the
    value's (:class:`_Result`), a move (a copy, a slice) as a child whose uses are."""
    if record is None:
        return result
    recorded = len(getattr(record, "results", ()))
    record.note(name, args, kwargs, result)
    if type(result) is not numpy.ndarray:
        return result
    if len(getattr(record, "results", ())) != recorded:
        child = result.view(ArrayProbe)
        child._ddp_record = _Result(record)
        record.results[-1] = (child,) + record.results[-1][1:]
        return child
    if name in _MOVES:
        child = result.view(ArrayProbe)
        child._ddp_record = _Used(record)
        return child
    return result


def _plain_array(probe: Any) -> Any:
    root = _root_record(probe)
    if root is not None:
        root.used = True
    return probe.view(numpy.ndarray)


def _root_record(probe: Any) -> Any:
    """The record of a probe, or of the probe a view was taken of (None: not a probe)."""
    record = getattr(probe, "_ddp_record", None)
    return record.record if isinstance(record, _Used) else record


def _index_key(index: Any) -> Any:
    """An index as a comparable key (slices and arrays by their text)."""
    return ("index", repr(index))


class _EmptyProbe:
    """What the probes of an empty list and an empty tuple share: ``+`` gives a
    plain one and is noted; any read of the value is a use; a list's in-place
    changes (``append``, ``extend``) are kept and handed back after the batch."""

    def __add__(self, other):
        result = self._base.__add__(self._base(self._base.__iter__(self)), other)  # not a read of it
        if self is not self._ddp_record.root:  # x = x + [y] twice in a batch: not replayed, derived
            self._ddp_record.used = True
        elif result is not NotImplemented:  # a result whose reads are the value's: it holds what batches added
            result = _RESULT_CLASSES[self._base](result)
            result._ddp_record = self._ddp_record
            self._ddp_record._result(result, Op.CONCAT, self._base(other))
        return result

    def __reduce__(self):  # pickles, copies and saves as the plain list or tuple (a read of it)
        _note_read(self._ddp_record)
        return as_builtin, (self._base.__name__, self._base(self))


def _note_read(record: "_Record") -> None:
    """A batch read an empty list or tuple: one process's may hold entries, a read of its value."""
    if record.notes is None or record.notes.listening:  # not ddp_eval's own look after the batch
        record.used = record.read = True


def _reading(name: str):
    def method(self, *args, **kwargs):
        _note_read(self._ddp_record)
        return getattr(self._base, name)(self, *args, **kwargs)
    method.__name__ = name
    return method


_READS = ("__iter__", "__len__", "__bool__", "__getitem__", "__contains__", "__eq__", "__ne__", "__lt__", "__le__",
          "__gt__", "__ge__", "__radd__", "__mul__", "__rmul__", "__reversed__", "index", "count", "copy")


def _changing(name: str, grows: bool = False):
    """A change of an empty list's probe: noted, but for what the merge replays
    (``append``), which is noted only if it raises (``items[0] = x`` on a rank's
    empty list; one process's may hold entries)."""
    def method(self, *args, **kwargs):
        record = self._ddp_record
        if not grows:
            record.writes.append(f"{name}()")
        elif record.used and record.steered is None:
            record.steered = name  # if not self.first: self.first.append(x)
        if record.notes is not None and record.notes.listening:  # items.append(self.n): the plain number, n read
            found: List[str] = []
            args = tuple(unprobed(arg, found, depth=1) for arg in args)
            record.notes.copied(found)
        before = self._base.__len__(self)
        try:
            return getattr(self._base, name)(self, *args, **kwargs)
        except Exception as error:
            if grows and not isinstance(error, TypeError):
                self._ddp_record.writes.append(f"{name}() (it raised {type(error).__name__})")
            raise
        finally:
            if self is record.root:  # not a list rebuilt from it (x = ids + [u]; x.append(v))
                record.grown += self._base.__len__(self) - before
    method.__name__ = name
    return method


def _empty_probe_class(base: type) -> type:
    namespace = {name: _changing(name, name in GROWS[base]) for name in changing_methods(base)} \
        if base in GROWS else {}
    namespace.update({name: _reading(name) for name in _READS if hasattr(base, name)})
    namespace.update(_base=base, __hash__=base.__hash__)
    return type(f"Empty{base.__name__.capitalize()}Probe", (_EmptyProbe, base), namespace)


EmptyListProbe, EmptyTupleProbe = _empty_probe_class(list), _empty_probe_class(tuple)


def _rebuilt_plain(self) -> Tuple[str, Any]:
    """A result stored elsewhere by a batch (``self.other = self.ids + [utt]``): a read
    of the value; ``(its label, the plain list or tuple)``."""
    _note_read(self._ddp_record)
    return self._ddp_record.label, self._base(self._base.__iter__(self))


# ids = ids + [utt] on an empty list's probe gives one of these: its reads are reads of the value
_RESULT_CLASSES = {base: type(f"Rebuilt{base.__name__.capitalize()}Probe", (probe,), {"_ddp_plain": _rebuilt_plain})
                   for base, probe in ((list, EmptyListProbe), (tuple, EmptyTupleProbe))}


class _Used:
    """The record seen through a view of a probe: every use is a use."""

    __slots__ = ("record",)

    def __init__(self, record: Any) -> None:
        self.record = record if isinstance(record, _Record) else record.record

    def note(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        record = self.record
        target = args[0] if args else None  # in place on a view: a change of the value
        if getattr(target, "_ddp_record", None) is self and _write(record, name, args, kwargs, out, target):
            return
        if name in _ADD | _SUB and out is not None and any(getattr(a, "_ddp_record", None) is self for a in args):
            record.sums.append(out)  # x[i] + 1: an index assignment of it is an increment
            record.used = True
        elif name in _EXTRACTS or (name not in _NO_READ and name not in _MOVES):  # float(x[0]), x[0] > k
            record.used = record.read = True


class _Result(_Used):
    """The record seen through a value rebuilt from the probe (``x = x + y``,
    ``torch.cat([x, y])``): it holds what earlier batches accumulated, so a read of
    it, its length included, is a read of the value."""

    __slots__ = ()

    def note(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        if name in _SHAPE_READS:
            self.record.shape_read = True
        super().note(name, args, kwargs, out)


def array_probe(array: Any) -> Any:
    """A probe standing in for a NumPy ``array`` during one batch."""
    probe = array.view(ArrayProbe)
    probe._ddp_record = _Record(probe)
    return probe


def _unwrap(args: Any) -> Any:
    if isinstance(args, (list, tuple)):
        return type(args)(_unwrap(a) for a in args)
    return _plain(args)


def _plain(value: Any) -> Any:
    """A probe as the plain tensor or array it stands for; anything else as it is."""
    if isinstance(value, TensorProbe):
        return value.as_subclass(torch.Tensor)
    if ArrayProbe is not None and isinstance(value, ArrayProbe):
        return value.view(numpy.ndarray)
    if isinstance(value, _EmptyProbe):
        return value._base(value._base.__iter__(value))  # not a read
    return value


plain_value = _plain


def make_probe(value: Any, notes: Any = None, label: str = "") -> Any:
    """A probe for a tensor, array, empty list or empty tuple attribute, or None for
    other values (``notes``: the stage's, which tell an empty one when a batch runs;
    ``label``: the value's, noted where a batch stores what it computed from it)."""
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        probe = tensor_probe(value)
    elif numpy is not None and type(value) is numpy.ndarray:
        probe = array_probe(value)
    elif (type(value) in (list, tuple) or (is_recording(value) and isinstance(value, list))) and not value:
        probe = (EmptyListProbe if isinstance(value, list) else EmptyTupleProbe)()
        probe._ddp_record = _Record(probe, notes)
    else:
        return None
    probe._ddp_record.label = label
    return probe


def handed_back(probe: Any, original: Any) -> bool:
    """After a batch: moves what a batch appended in place to an empty list's probe
    into the list it stood for; whether there was any."""
    if isinstance(probe, EmptyListProbe) and list.__len__(probe):
        before = list.__len__(original)
        original.extend(list.__iter__(probe))
        if is_recording(original):  # ddp_eval's own, after the batch: not C code's (ListWatch)
            original.explained += list.__len__(original) - before
        return True
    return False


def read_from(probe: Any, rebuilt: bool) -> bool:
    """Whether a batch used the probed value in a computation (``x.sum()``, ``y = x + 1``)
    other than rebuilding the value itself (``rebuilt``: ``x = x + y``)."""
    record = getattr(probe, "_ddp_record", None)
    return bool(getattr(record, "read", False) or (not rebuilt and getattr(record, "results", None)) or any(
        key not in record.index_sets for key in getattr(record, "index_reads", ())))


def read_through_data(probe: Any) -> bool:
    """Whether a batch read ``.data`` of the probed tensor (changes through it move no ``_version``)."""
    return bool(getattr(getattr(probe, "_ddp_record", None), "aliased", False))


# a list whose length changed other than by its methods: C code wrote into its memory
BYPASSED = "C code that writes into the list's memory without its methods (heapq's functions)"


def in_place_writes(probe: Any) -> list:
    """The in-place changes of the probed value (or its views) a batch made that
    the merge cannot replay as increments (``mul_()``, ``x[i] = 0``, ``.data``)."""
    record = getattr(probe, "_ddp_record", None)
    if isinstance(probe, EmptyListProbe) and probe is record.root and list.__len__(probe) != record.grown:
        # heapq.heappush(items, x); not a list rebuilt from it (x = items + [u]), whose growth is its own
        record.writes.append(BYPASSED)
    return list(dict.fromkeys(getattr(record, "writes", ()))) if _recording.ENABLED else []


def read_rebuilt(probe: Any, value: Any) -> Tuple[str, Any]:
    """What a batch did to a tensor or array attribute, from its probe and what
    the attribute holds after the batch: ``("same", None)`` (the probe: at most
    changed in place), ``("ops", [(op, operand)])`` (rebuilt by ``+``, ``-`` or
    concatenation), ``("set", value)`` (a new value, the old one unused) or
    ``("derived", value)`` (a new value, the old one used otherwise)."""
    record = probe._ddp_record
    if value is probe:
        return "same", None
    for out, op, operand, mark in record.results:
        if out is value:
            if _changed_since(value, mark):  # rebuilt, then changed in place: derived
                return "derived", _plain(value)
            return "ops", [(op, _copy(operand))]
    return ("derived" if record.used or record.results else "set"), _plain(value)


def _changed_since(value: Any, mark: Any) -> bool:
    value = _plain(value)  # ddp_eval's own look is not a read
    if isinstance(value, (list, tuple)):
        return tuple(map(id, value)) != mark
    if isinstance(value, torch.Tensor):
        return value._version != mark
    if is_array(value):
        return not numpy.array_equal(value, mark, equal_nan=True)
    return False


def _copy(operand: Any) -> Any:
    """An operand as it travels: on the CPU, detached, a copy (the batch may reuse its buffer)."""
    if isinstance(operand, torch.Tensor):
        return _plain(operand).detach().to("cpu", copy=True)
    if numpy is not None and isinstance(operand, numpy.ndarray):
        return numpy.array(_plain(operand))
    return operand


def extends(old: Any, new: Any) -> Optional[Tuple[str, Any]]:
    """``("&", tail)`` if list or tuple ``new`` is ``old`` with entries appended
    (its first entries are ``old``'s, by identity), ``("?&", tail)`` over an
    empty ``old``, else None."""
    if type(new) is not type(old) or not isinstance(new, (list, tuple)) or len(new) < len(old):
        return None
    if not all(map(operator.is_, old, new)):
        return None
    return (Op.CONCAT if old else Op.CONCAT_OR_SET), new[len(old):]


def shares_entries(old: Any, new: Any) -> bool:
    """Whether list or tuple ``new`` looks computed from ``old`` (``sorted(old + [x])``,
    a filter): it holds an entry of ``old`` by identity that Python does not share
    between unrelated values (a float, an object: not an int, string or None), or it
    is longer and holds every entry of ``old``.

    Example
    -------
    >>> ids = ["u2", "u1"]
    >>> shares_entries(ids, sorted(ids + ["u3"])), shares_entries(ids, ["u3"])
    (True, False)
    """
    if not isinstance(old, (list, tuple)) or not isinstance(new, (list, tuple)) or not old:
        return False
    held = {id(x) for x in old if not isinstance(x, (int, str, bytes, type(None)))}
    if held and any(id(x) in held for x in new):
        return True
    return len(new) > len(old) and {id(x) for x in old} <= {id(x) for x in new}


def _on_device_of(a: Any, b: Any) -> Any:
    return b.to(a.device) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else b


def add(a: Any, b: Any) -> Any:
    """``a + b``, a tensor operand moved to ``a``'s device."""
    return a + _on_device_of(a, b)


def subtract(a: Any, b: Any) -> Any:
    """``a - b``, a tensor operand moved to ``a``'s device."""
    return a - _on_device_of(a, b)


def concat(a: Any, b: Any) -> Any:
    """``a`` followed by ``b``: ``torch.cat``, ``numpy.concatenate`` or ``+``."""
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b.to(a.device)])
    if numpy is not None and isinstance(a, numpy.ndarray):
        return numpy.concatenate([a, b])
    return a + b


def _cat(pieces: List[Any]) -> Any:
    out = pieces[0]
    for piece in pieces[1:]:
        out = concat(out, piece)
    return out
