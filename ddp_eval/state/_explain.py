"""Fingerprints: does what the bookkeeping recorded explain a value's end state?

The merge rebuilds what one process would hold from what each rank *recorded*
(lists that grew, numbers changed by probes, tensors by ``_version``, ...).
A change the recording did not see (``self.hist[label] += 1`` on a pre-sized
list, ``self.targets[0].extend(refs)`` inside a list, a dict field of a metric
object) would be merged as if it had not happened. So at stage start each
watched value gets a :func:`fingerprint` of the part the recording promises not
to change (a list's entries at stage start, a dict's entries no watch
follows, a whole object no watch follows), and at stage end the same part is
fingerprinted again: a difference is named, never merged.

A fingerprint is cheap and flat in the number of batches: numbers, strings and
small arrays by value, tensors by identity and ``_version``, containers entry
by entry (four levels deep), other objects by identity and their own
attributes. The objects it names by identity are held (:class:`Fingerprint`),
so a freed object's address cannot come back as a look-alike.

Example
-------
>>> hist = [0, 0, 0]
>>> before = Fingerprint.of(hist)
>>> hist[1] += 1
>>> before.matches(hist)
False
>>> Fingerprint.of([[1], "a"]).matches([[1], "a"])
True
"""

import collections
import functools
import io
import pickle
import types
import zlib
from typing import Any, List, Optional

import torch

from ddp_eval.state._values import is_array

MAX_DEPTH = 4  # containers deeper than this are compared by identity and length
SMALL_TENSOR = 64  # elements; a smaller tensor is also compared by value
LARGE = 256  # entries; in a larger container, entries that are containers count by identity and length

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _leaf(value: Any, held: List[Any], depth: int) -> Any:
    """A hashable summary of ``value`` (see the module's docstring)."""
    kind = type(value)
    if isinstance(value, _SCALARS):
        return (kind.__name__ if kind in _SCALARS else "num", value if value == value else "nan")
    if isinstance(value, bytearray):
        return ("bytearray", bytes(value))
    if isinstance(value, torch.Tensor):
        held.append(value)
        # a tensor subclass (an FSDP DTensor) holds a shard only: by identity and version
        small = value.numel() <= SMALL_TENSOR and value.device.type == "cpu" and type(value) in _PLAIN_TENSORS
        return ("tensor", id(value), value._version, tuple(value.shape),
                tuple(value.detach().reshape(-1).tolist()) if small else None)
    if is_array(value):
        held.append(value)
        return ("array", id(value), value.shape, str(value.dtype), zlib.crc32(value.tobytes()))
    if depth >= MAX_DEPTH:
        held.append(value)
        return ("deep", id(value), len(value) if isinstance(value, (list, tuple, dict, set)) else None)
    if isinstance(value, (list, tuple)):
        name = "list" if isinstance(value, list) else kind.__name__  # a recording copy is its list
        if len(value) > LARGE:  # one entry per utterance: by value or identity, flat (C speed for scalars)
            return (name, _flat(value, held))
        return (name, tuple(_leaf(x, held, depth + 1) for x in value))
    if isinstance(value, dict):
        if len(value) > LARGE:
            return ("dict", _flat(list(value), held), _flat(list(value.values()), held))
        return ("dict", tuple((_leaf(k, held, depth + 1), _leaf(v, held, depth + 1)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return ("set", len(value), hash(frozenset(map(id, value))) if not all(
            isinstance(x, _SCALARS) for x in value) else hash(frozenset(value)))
    if isinstance(value, collections.deque):
        return ("deque", value.maxlen, tuple(_leaf(x, held, depth + 1) for x in value))
    held.append(value)
    own = getattr(value, "__dict__", None)
    captured = captured_state(value)
    if captured is not None:  # a closure's cells, a partial's arguments, a bound method's object
        parts = []
        for x in captured:
            if _by_identity(x):  # held, so that a freed object's address cannot come back as a look-alike
                held.append(x)
                parts.append(("object", id(x)))
            else:
                parts.append(_leaf(x, held, depth + 1))
        return ("callable", id(value), tuple(parts))
    if isinstance(value, (type, torch.nn.Module, types.ModuleType)) or (callable(value) and own is None):
        return ("object", id(value))
    if isinstance(value, io.IOBase) or hasattr(value, "gi_frame"):  # its __dict__ shows none of its state
        return ("object", id(value), _unpicklable_digest(value))
    if own is None or type(value).__reduce_ex__ is not object.__reduce_ex__ or (  # state the engine cannot read
            type(value).__reduce__ is not object.__reduce__):  # (random.Random keeps its state in C)
        digest = opaque_digest(value)
        if digest is None and type(value).__module__ not in _NO_STATE:  # a hash, a compressor: unread
            held.append(_UNREAD)
        return ("object", id(value), digest)
    return ("object", id(value), tuple((k, _leaf(v, held, depth + 1)) for k, v in sorted(own.items(), key=str)
                                       if not callable(v)))


def captured_state(value: Any) -> Optional[tuple]:
    """What a function keeps between calls: a closure's cells and its defaults, a
    partial's arguments, a bound method's object; None for anything else.

    Example
    -------
    >>> def counter():
    ...     n = [0]
    ...     return lambda: n.append(1)
    >>> count = counter()
    >>> captured_state(count), captured_state(len)
    (([0],), None)
    """
    if isinstance(value, types.FunctionType):
        if (value.__module__ or "").split(".")[0] in _FRAMEWORKS:  # a library's cache (SpeechBrain's _dictify)
            return None
        cells = tuple(_cell(c) for c in value.__closure__ or ())
        return cells + tuple(value.__defaults__ or ()) + tuple((value.__kwdefaults__ or {}).values())
    if isinstance(value, functools.partial):
        return (value.func, *value.args, *value.keywords.values())
    if isinstance(value, (types.MethodType, types.BuiltinFunctionType)):
        owner = value.__self__
        return None if owner is None or isinstance(owner, types.ModuleType) else (owner,)
    return None


def compared_captured_state(value: Any) -> Optional[list]:
    """What of :func:`captured_state` is compared by value (the Brain, modules,
    classes and libraries' objects it holds are not); None if ``value`` keeps none."""
    captured = captured_state(value)
    return None if captured is None else [x for x in captured if not _by_identity(x)]


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


# an object whose class comes from (or extends one of) these is not the recipe's own data: a sampler,
# a loader, a tokenizer (their fields change as they work, e.g. a sampler's epoch at stage start)
_FRAMEWORKS = ("torch", "numpy", "speechbrain", "logging", "io", "_io", "threading", "sentencepiece", "transformers")


def of_a_framework(value: Any) -> bool:
    """Whether ``value``'s class, or one it derives from, comes from a library whose
    objects keep state of their own kind (a tokenizer, a logger, a SpeechBrain class)."""
    return any((cls.__module__ or "").split(".")[0] in _FRAMEWORKS for cls in type(value).__mro__)


def holds_fields(value: Any) -> bool:
    """Whether ``value`` is an object of the recipe's own whose fields hold its state
    (not a module, a function, a partial, a class or a library's object)."""
    return (not isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module,
                                   functools.partial))  # asking a function or a partial for fields makes them one
            and type(getattr(value, "__dict__", None)) is dict and not of_a_framework(value))


def _by_identity(value: Any) -> bool:
    """Whether a function's captured ``value`` is compared by identity only: the
    Brain (its own state is watched attribute by attribute), a module, a class, a
    library's object (a tokenizer); tensors, arrays and streams are compared."""
    if isinstance(value, (torch.Tensor, io.IOBase)) or is_array(value):
        return False
    return (isinstance(value, (type, types.ModuleType)) or hasattr(value, "_ddp_brain_attributes")
            or of_a_framework(value))


def _flat(entries: list, held: List[Any]) -> Any:
    """A large container's entries: scalars by value (one C-level hash), others by
    identity (held), containers also by length, tensors also by ``_version``."""
    kinds = set(map(type, entries))
    if kinds <= SCALAR_TYPES:
        return hash(tuple(entries))
    held.extend(entries)
    if len(kinds) == 1 and kinds <= _SIZED:  # one entry per utterance, all dicts (ErrorRateStats.scores): C speed
        return hash((tuple(map(id, entries)), tuple(map(len, entries))))
    return hash(tuple(x if type(x) in SCALAR_TYPES else (
        id(x), len(x) if isinstance(x, (list, tuple, dict, set)) else (
            x._version if isinstance(x, torch.Tensor) else -1)) for x in entries))


SCALAR_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes})  # fingerprinted by value
_UNREAD = object()  # among a fingerprint's held objects: it met an object it could not read
_NO_STATE = frozenset({"_thread", "threading", "socket", "select", "weakref"})  # locks, sockets
_SIZED = {list, tuple, dict, set}


class _Digester(pickle.Pickler):
    """Pickles an object's state for a digest; tensors and modules by identity
    and version, not by their (large) contents."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return ("tensor", id(obj), obj._version)
        if isinstance(obj, torch.nn.Module):
            return ("module", id(obj))
        if isinstance(obj, torch.Generator):  # it pickles a new state tensor each time: its state's bytes
            return ("generator", bytes(obj.get_state().numpy()))
        return None


def opaque_digest(value: Any) -> Optional[int]:
    """A digest of what ``value`` pickles to (a deque, an object with ``__slots__``,
    a random generator); None if it cannot be pickled (then only its identity counts).

    Example
    -------
    >>> import random
    >>> rng = random.Random(0)
    >>> before = opaque_digest(rng)
    >>> _ = rng.random()
    >>> opaque_digest(rng) == before, opaque_digest(iter([1])) is None
    (False, False)
    """
    buffer = io.BytesIO()
    try:
        _Digester(buffer, protocol=4).dump(value)
    except Exception:  # a file, a generator, a lock: cannot be pickled; read what says it changed
        return _unpicklable_digest(value)
    return zlib.crc32(buffer.getbuffer())


def _unpicklable_digest(value: Any) -> Optional[int]:
    """What changes when batches touch an object that cannot be pickled: an in-memory
    stream's contents and position, a file's position, a generator's place; None
    for anything else (only its identity counts).

    Example
    -------
    >>> log = io.StringIO()
    >>> before = _unpicklable_digest(log)
    >>> _ = log.write("utt1 yes")
    >>> _unpicklable_digest(log) == before
    False
    """
    try:
        if isinstance(value, (io.StringIO, io.BytesIO)):
            contents = value.getvalue()
            contents = contents.encode("utf-8", "surrogatepass") if isinstance(contents, str) else contents
            return zlib.crc32(contents, zlib.crc32(repr(("stream", value.tell())).encode()))
        if isinstance(value, io.IOBase):
            return zlib.crc32(repr(("file", value.closed or value.tell())).encode())
        for name in ("gi_frame", "cr_frame", "ag_frame"):
            if hasattr(value, name):  # a generator: where it stands, and its locals (a loop yields from one place)
                frame = getattr(value, name)
                return None if frame is None else _frame_digest(frame)
    except (OSError, ValueError):  # a closed or unseekable stream
        return None
    return None


def _frame_digest(frame: Any) -> int:
    """A suspended generator's place: its instruction and each local, pickled where it
    can be (a range iterator pickles with its position), else by identity."""
    digest = zlib.crc32(repr(("frame", frame.f_lasti)).encode())
    for name, local in sorted(frame.f_locals.items()):
        buffer = io.BytesIO()
        try:
            _Digester(buffer, protocol=4).dump(local)
            part = bytes(buffer.getbuffer())
        except Exception:
            part = repr((type(local).__name__, id(local))).encode()
        digest = zlib.crc32(name.encode() + part, digest)
    return digest


class Fingerprint:
    """The fingerprint of a value at one moment, holding what it names by identity."""

    __slots__ = ("digest", "held", "top")

    def __init__(self, digest: int, held: List[Any], top: int = 0) -> None:
        self.digest, self.held, self.top = digest, held, top

    @classmethod
    def of(cls, value: Any, depth: int = MAX_DEPTH) -> "Fingerprint":
        """The fingerprint of ``value``, ``depth`` levels deep (below: identity and length)."""
        held: List[Any] = []
        return cls(hash(_leaf(value, held, MAX_DEPTH - depth)), held, MAX_DEPTH - depth)

    def unread(self) -> bool:
        """Whether the value holds an object that cannot be pickled and keeps its state
        where ddp_eval cannot read it (``hashlib.sha256()``, ``zlib.compressobj()``)."""
        return any(x is _UNREAD for x in self.held)

    def matches(self, value: Any) -> bool:
        """Whether ``value`` has the fingerprint this one was taken of."""
        return hash(_leaf(value, [], self.top)) == self.digest


def unexplained(start: Optional[Fingerprint], value: Any) -> bool:
    """Whether ``value`` differs from the state ``start`` was taken of (None: unchecked)."""
    return start is not None and not start.matches(value)
