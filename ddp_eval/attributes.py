"""Merging plain attributes that grow during a sharded stage, exactly.

Recipes accumulate on the Brain itself (``self.acc_metric.append(acc)``,
``self.outcome[utt_id] = ...``, ``self.n_correct += ...``) and sometimes on
objects it holds (``self.hparams.aligner.align_dict[utt_id] = ...``, named by
a dotted path in ``ddp_eval: attributes_include``). An
:class:`AttributeTracker` watches such attributes during a stage; after every
batch it looks only at what that batch changed (list and dict lengths,
numbers, a tensor's identity and ``_version``), so its cost does not grow with
the state the attributes hold. At stage end each rank sends what it changed,
tagged with global batch positions, and :func:`merge_attribute_states` (a pure
function) rebuilds what one process would hold:

=============  ==============================================================
kind           how it is merged
=============  ==============================================================
``append``     list that only grew: new entries in global batch order
``keys``       dict that gained keys (in global batch order) or whose values
               were replaced; a key added or replaced on two ranks is an error
``sum``        int, or integer tensor of fixed shape: the increments, summed
               (exact in any order; one running increment per rank)
``accumulate`` float, or float tensor of fixed shape: per-batch increments
               added to the start value in global batch order; beyond
               ``attribute_memory_mb`` of tensor increments, per-rank totals
               added in rank order (both equal one process up to rounding)
=============  ==============================================================

Anything else that changed (a list or dict replaced by a new object, a bool, a
string, a tensor that changed shape, another object replaced) cannot be merged
and is reported by name. Copies of tensors live in CPU memory: one at stage
start, and for float tensors that change, one more plus the increments.

Example
-------
>>> r0 = {"acc": ("append", ([0, 2], [1, 1], [0.5, 0.7]))}
>>> r1 = {"acc": ("append", ([1], [1], [0.9]))}
>>> merge_attribute_states([r0, r1])["acc"]
('append', [0.5, 0.9, 0.7])
"""

import array
import bisect
import itertools
import logging
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ddp_eval.errors import ConfigError

logger = logging.getLogger(__name__)

MERGEABLE_KINDS = ("append", "keys", "sum", "accumulate")
ABSENT = type("Absent", (), {"__repr__": lambda self: "<absent>"})()
_warned_over_budget = set()  # labels warned about once per process


def is_number(value: Any) -> bool:
    """int or float, not bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def growth_since(changes: Sequence[int], from_batch: int, start_len: int) -> Tuple[Sequence[int], List[int]]:
    """From a flat record ``batch, length after it, batch, length, ...`` of a
    list or dict: the batches from ``from_batch`` on that grew it, and the
    bounds of their growth (the first is its length before them).

    Example
    -------
    >>> growth_since([0, 2, 3, 5, 4, 6], from_batch=1, start_len=0)
    ([3, 4], [2, 5, 6])
    """
    batches, lengths = changes[0::2], changes[1::2]
    first = bisect.bisect_left(batches, from_batch)
    return batches[first:], [lengths[first - 1] if first else start_len] + list(lengths[first:])


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


def get_value(owner: Any, name: str) -> Any:
    """``owner.name`` (or ``owner[name]`` for a mapping); ``ABSENT`` if missing."""
    if isinstance(owner, Mapping):
        return owner.get(name, ABSENT)
    own = getattr(owner, "__dict__", None)
    if own is not None and name in own:
        return own[name]
    return getattr(owner, name, ABSENT)


def _set_value(owner: Any, name: str, value: Any) -> None:
    if isinstance(owner, dict):
        owner[name] = value
    else:
        setattr(owner, name, value)


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _exact_dtype(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex())


class _Increments:
    """Per-batch increments of one float tensor, packed in one growing buffer.

    Why packed: thousands of small tensors kept alive between a recipe's
    large transient allocations pin the top of the C heap, and the process
    then keeps memory that grows with the number of batches although little
    is stored. One buffer grows geometrically: O(log n) allocations in all.
    """

    def __init__(self, like: torch.Tensor) -> None:
        self.dtype, self.shape = like.dtype, like.shape
        self.buffer = bytearray()
        self.batches = array.array("q")

    def append(self, batch: int, increment: torch.Tensor) -> None:
        self.buffer += increment.contiguous().reshape(-1).view(torch.uint8).numpy().data
        self.batches.append(batch)

    def stacked(self, first: int = 0) -> torch.Tensor:
        """The increments from the ``first``-th on, as one ``(n, *shape)`` tensor."""
        row = len(self.buffer) // max(len(self.batches), 1)
        part = self.buffer[first * row:]
        flat = torch.frombuffer(part, dtype=torch.uint8) if part else torch.empty(0, dtype=torch.uint8)
        return flat.view(self.dtype).reshape(len(self.batches) - first, *self.shape).clone()


class _Track:
    """What one attribute held at stage start and how the batches changed it."""

    def __init__(self, label: str, owner: Any, name: str, value: Any) -> None:
        self.label, self.owner, self.name = label, owner, name
        self.start = value
        self.obj = value  # held, so that an identity check cannot meet a reused id
        self.why: Optional[str] = None  # why it cannot be merged
        self.changes = array.array("q")  # batch index, length after it, ...: lists, dicts
        self.numbers: List[Tuple[int, Any]] = []  # (batch index, value after it): numbers
        self.increments: Optional[_Increments] = None  # float tensors, while within budget
        self.totals = False  # float tensor over budget: one total per rank
        self.changed = False
        self.base = self.previous = self.spec = None
        self.mark: Any = None  # the value at the previous journal piece (tensors, int sums)
        self.journaled: set = set()  # dict keys whose replaced value a journal piece holds
        self.start_len, self.start_items = 0, None
        if isinstance(value, (list, dict)):
            self.start_len = len(value)
            self.start_items = dict(value) if isinstance(value, dict) else None  # references only
        elif isinstance(value, torch.Tensor):
            self.version, self.spec = value._version, (value.shape, value.dtype)
            self.start_version, self.zero_start = value._version, False
        self.last = self._marker(value)

    def keep_start(self, tracker: "AttributeTracker") -> None:
        """What a tensor's increments will be taken from: nothing if it is zero (a
        fresh accumulator) or reassigned later (the start object stays intact);
        a CPU copy, within the budget, for a batch that changes it in place."""
        value = self.start
        if not isinstance(value, torch.Tensor):
            return
        try:
            self.zero_start = not bool(value.detach().any())
        except RuntimeError:  # a dtype without any()
            self.zero_start = False
        if not self.zero_start and tracker.reserve(value.nelement() * value.element_size()):
            self.base = _cpu_copy(value)

    def start_tensor(self) -> Optional[torch.Tensor]:
        """The tensor at stage start, on the CPU; None if it did not exist or was
        zero (increments then start from nothing: ``0 + x`` is ``x``).

        Raises ``LookupError`` if it was changed in place without a start copy.
        """
        if self.start is ABSENT or self.base is not None or self.zero_start:
            return self.base
        if isinstance(self.start, torch.Tensor) and self.start._version == self.start_version:
            self.base = _cpu_copy(self.start)  # replaced by another object, itself untouched
        else:
            raise LookupError(self.label)
        return self.base

    @staticmethod
    def _marker(value: Any) -> Any:
        if isinstance(value, (list, dict)):
            return len(value)
        if is_number(value):
            return value
        return None

    def _fail(self, why: str) -> None:
        self.why = why
        self.increments = None

    def observe(self, index: int, tracker: "AttributeTracker") -> None:
        """Notes what batch ``index`` changed (O(1), plus a copy of a changed float tensor)."""
        if self.why is not None:
            return
        value = get_value(self.owner, self.name)
        if value is ABSENT:
            if self.obj is not ABSENT:
                self._fail("deleted during the stage")
            return
        if isinstance(value, (list, dict)):
            self._observe_container(index, value)
        elif is_number(value):
            if not (self.obj is ABSENT or is_number(self.obj)):
                self._fail(f"a {type(self.obj).__name__} that became a number during the stage")
            elif value != self.last or type(value) is not type(self.last):
                self.numbers.append((index, value))
                self.last, self.obj = value, value
        elif isinstance(value, torch.Tensor):
            self._observe_tensor(index, value, tracker)
        elif value is not self.obj:
            self._fail(f"a {type(value).__name__} changed during the stage")

    def _observe_container(self, index: int, value: Any) -> None:
        kind = type(value).__name__
        if self.obj is ABSENT:  # created during the stage: it starts empty
            self.obj, self.start_len, self.last = value, 0, 0
            self.start_items = {} if isinstance(value, dict) else None
        if value is not self.obj:
            self._fail(f"a new {kind} was assigned during the stage")
        elif len(value) < self.last:
            self._fail(f"entries were removed from the {kind}")
        elif len(value) != self.last:
            self.changes.extend((index, len(value)))
            self.last = len(value)

    def _observe_tensor(self, index: int, value: torch.Tensor, tracker: "AttributeTracker") -> None:
        if value is self.obj and value._version == self.version:
            return  # unchanged: no copy, no comparison
        if self.obj is not ABSENT and not isinstance(self.obj, torch.Tensor):
            self._fail(f"a {type(self.obj).__name__} that became a tensor during the stage")
            return
        self.spec = self.spec or (value.shape, value.dtype)
        if (value.shape, value.dtype) != self.spec:
            self._fail("a tensor that changed shape or dtype during the stage")
            return
        self.obj, self.version, self.changed = value, value._version, True
        try:
            start = self.start_tensor()
        except LookupError:
            mb = value.nelement() * value.element_size() / 2**20
            self._fail(f"a {mb:.0f} MB tensor changed in place, and ddp_eval: attribute_memory_mb "
                       f"({tracker.budget_bytes / 2**20:g} MB) had no room for its start copy; raise it, "
                       "or list the attribute in attributes_exclude")
            return
        if _exact_dtype(value) or self.totals:
            return  # one increment per rank, taken at stage end
        self.previous = start if self.previous is None else self.previous
        current = value.detach().cpu()  # a transient copy if on a GPU
        increment = current.clone() if self.previous is None else current - self.previous
        if not tracker.reserve(increment.nelement() * increment.element_size()):
            self._switch_to_totals(tracker)
            return
        self.increments = self.increments or _Increments(value)
        self.increments.append(index, increment)
        if self.previous is None or self.previous is self.base:
            self.previous = _cpu_copy(value)  # once; later batches overwrite it in place
        else:
            self.previous.copy_(current)

    def _switch_to_totals(self, tracker: "AttributeTracker") -> None:
        tracker.release(len(self.increments.buffer) if self.increments else 0)
        self.increments, self.previous, self.totals = None, None, True
        if self.label not in _warned_over_budget:
            _warned_over_budget.add(self.label)
            logger.warning(
                f"ddp_eval: the per-batch increments of float tensor attribute '{self.label}' "
                f"exceed ddp_eval: attribute_memory_mb ({tracker.budget_bytes / 2**20:g} MB) on "
                "this rank; from now on each rank sends one total, added in rank order. The "
                "merged value then equals one process up to about 2 (n + N) eps max|value| "
                "(n batches, N ranks, eps = 2**-53 for float64, 2**-24 for float32) instead of "
                "2 n eps max|value|. Raise attribute_memory_mb to keep per-batch order."
            )

    # -- stage end -------------------------------------------------------------

    def kind(self) -> Optional[str]:
        """The merge kind, None if unchanged, or ``"unmergeable: why"``."""
        if self.why is not None:
            return f"unmergeable: {self.why}"
        value = get_value(self.owner, self.name)
        if value is ABSENT:
            return None
        if isinstance(value, list):
            return "append" if self.changes else None
        if isinstance(value, dict):
            if self.changes or self._replaced(value):
                return "keys"
            return None
        if is_number(value):
            if not self.numbers:
                return None
            ints = all(isinstance(v, int) for _, v in self.numbers)
            exact = ints and (self.start is ABSENT or isinstance(self.start, int))
            return "sum" if exact else "accumulate"
        if isinstance(value, torch.Tensor):
            if not self.changed:
                return None
            return "sum" if _exact_dtype(value) else "accumulate"
        return None

    def _replaced(self, value: dict) -> Dict[Any, Any]:
        start = self.start_items or {}
        missing = [k for k in start if k not in value]
        if missing:
            self._fail(f"keys were removed from the dict (e.g. {missing[0]!r})")
            return {}
        return {k: value[k] for k, v in start.items() if value[k] is not v}

    def local_state(self, kind: str, positions: Sequence[float], from_batch: int = 0,
                    piece: bool = False) -> Tuple[str, Any]:
        """What this rank's batches changed, with the global ``positions`` of batch indices.

        The whole stage (``positions`` then ends with ``inf``, after the last
        batch), or with ``piece`` what batches from ``from_batch`` on changed
        since the previous piece, for a journal.
        """
        value = get_value(self.owner, self.name)

        def cut(start: int, end: int):
            batches, bounds = growth_since(self.changes, from_batch, start)
            places = [positions[i] for i in batches]
            if not piece and bounds[-1] != end:  # grew without a recorded change: after the last batch
                places, bounds = places + [positions[-1]], bounds + [end]
            return places, [b - a for a, b in zip(bounds, bounds[1:])], bounds[0], bounds[-1]

        if kind == "append":
            places, sizes, first, last = cut(self.start_len, len(value))
            return kind, (places, sizes, value[first:last])
        if kind == "keys":
            places, sizes, first, last = cut(self.start_len, len(value))
            new_items = list(itertools.islice(value.items(), first, last))
            replaced = self._replaced(value)
            if piece:  # a piece holds what the previous pieces do not
                replaced = {k: v for k, v in replaced.items() if k not in self.journaled}
                self.journaled.update(replaced)
            return kind, (places, sizes, new_items, replaced)
        if isinstance(value, torch.Tensor):
            if kind == "sum" or self.totals:
                end = _cpu_copy(value)
                before = self.mark if piece and self.mark is not None else self.start_tensor()
                delta = end if before is None else end - before
                if piece:
                    self.mark = end
                return kind, delta if kind == "sum" else ("total", delta)
            if piece:
                self.mark = _cpu_copy(value)  # where a later total (over budget) starts
            if self.increments is None:
                return kind, ("batches", [], [])
            first = bisect.bisect_left(self.increments.batches, from_batch)
            return kind, ("batches", [positions[i] for i in self.increments.batches[first:]],
                          self.increments.stacked(first))
        start = 0 if self.start is ABSENT else self.start
        if kind == "sum":
            delta = value - (self.mark if piece and self.mark is not None else start)
            if piece:
                self.mark = value
            return kind, delta
        before, places, increments = start, [], []
        for index, after in self.numbers:
            if index >= from_batch:
                places.append(positions[index])
                increments.append(after - before)
            before = after
        return kind, ("batches", places, increments)


class AttributeTracker:
    """Watches attributes during one sharded stage on this rank.

    Arguments
    ---------
    targets : dict
        ``{label: (owner, name)}`` of the attributes to watch from now on.
    budget_mb : float
        Memory for per-batch increments of float tensors on this rank.

    Example
    -------
    >>> import types
    >>> holder = types.SimpleNamespace(hits=[], n=0)
    >>> tracker = AttributeTracker({"hits": (holder, "hits"), "n": (holder, "n")})
    >>> holder.hits.append("a"); holder.n += 2
    >>> tracker.after_batch()
    >>> kinds, unmergeable, state = tracker.finish(positions=[5])
    >>> kinds, state["hits"], state["n"]
    ({'hits': 'append', 'n': 'sum'}, ('append', ([5], [1], ['a'])), ('sum', 2))
    """

    def __init__(self, targets: Mapping[str, Tuple[Any, str]], budget_mb: float = 64.0) -> None:
        self.budget_bytes = budget_mb * 2**20
        self.used_bytes = 0
        self.batches = 0
        self._piece_from = 0  # where the next journal piece starts
        self.tracks = {label: _Track(label, owner, name, get_value(owner, name))
                       for label, (owner, name) in targets.items()}
        for track in self.tracks.values():
            track.keep_start(self)

    def add(self, targets: Mapping[str, Tuple[Any, str]]) -> None:
        """Watches ``targets`` not watched yet: created during the stage, so
        absent at its start (their value is a change of the batch to come)."""
        for label, (owner, name) in targets.items():
            if label not in self.tracks:
                self.tracks[label] = _Track(label, owner, name, ABSENT)

    def reserve(self, nbytes: int) -> bool:
        """Takes ``nbytes`` of the budget; False (nothing taken) if it does not fit."""
        if self.used_bytes + nbytes > self.budget_bytes:
            return False
        self.used_bytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Gives ``nbytes`` back to the budget."""
        self.used_bytes -= nbytes

    def after_batch(self) -> None:
        """Notes what the batch just evaluated changed."""
        for track in self.tracks.values():
            track.observe(self.batches, self)
        self.batches += 1

    def finish(self, positions: Sequence[int]) -> Tuple[Dict[str, str], Dict[str, str], Dict[str, Tuple[str, Any]]]:
        """``(kinds, unmergeable, state)`` at stage end.

        ``positions`` are the global positions of this rank's batches, in
        order; ``state`` is ``{label: (kind, data)}`` for :func:`merge_attribute_states`.
        """
        for track in self.tracks.values():  # what changed after the last batch: position inf
            track.observe(self.batches, self)
        positions = list(positions[: self.batches]) + [math.inf]
        kinds, unmergeable, state = {}, {}, {}
        for label in sorted(self.tracks):
            track = self.tracks[label]
            kind = track.kind()
            if kind is None:
                continue
            if kind.startswith("unmergeable: "):
                unmergeable[label] = kind[len("unmergeable: "):]
                continue
            kinds[label] = kind
            state[label] = track.local_state(kind, positions)
        return kinds, unmergeable, state

    def piece(self, positions: Sequence[int]) -> Dict[str, Tuple[str, Any]]:
        """What the batches since the previous piece (or stage start) changed,
        in :meth:`finish`'s state format, for a journal; :meth:`finish` is unaffected."""
        state = {}
        for label in sorted(self.tracks):
            track = self.tracks[label]
            kind = track.kind()
            if kind is not None and not kind.startswith("unmergeable: "):
                state[label] = track.local_state(kind, positions, self._piece_from, piece=True)
        self._piece_from = self.batches
        return state

    def apply(self, merged: Mapping[str, Tuple[str, Any]], locate: Callable[[str], Tuple[Any, str]]) -> None:
        """Writes ``merged`` (of :func:`merge_attribute_states`) into the attributes,
        on top of what they held at stage start; ``locate(label)`` gives
        ``(owner, name)`` of a label this rank never watched (created elsewhere)."""
        for label, (kind, data) in merged.items():
            track = self.tracks.get(label)
            if track is None:
                owner, name = locate(label)
                track = _Track(label, owner, name, ABSENT)
            if track.why is None:  # an unmergeable one stays rank-local (and is reported)
                _apply_one(track, kind, data)


def _apply_one(track: _Track, kind: str, data: Any) -> None:
    owner, name, start = track.owner, track.name, track.start
    current = get_value(owner, name)
    if kind == "append":
        if not isinstance(current, list):
            current = []
            _set_value(owner, name, current)
        del current[0 if start is ABSENT else track.start_len:]
        current.extend(data)
    elif kind == "keys":
        new_items, replaced = data
        if not isinstance(current, dict):
            current = {}
            _set_value(owner, name, current)
        keep = 0 if start is ABSENT else track.start_len
        for key in list(itertools.islice(current, keep, None)):
            del current[key]
        current.update(replaced)
        current.update(new_items)
    else:
        if isinstance(current, torch.Tensor) or isinstance(start, torch.Tensor):
            value = track.start_tensor()
            for increment in (data if kind == "accumulate" else [data]):
                value = increment.clone() if value is None else value + increment
            if isinstance(current, torch.Tensor) and current.shape == value.shape and current.dtype == value.dtype:
                with torch.no_grad():
                    current.copy_(value)  # in place: other holders of the tensor see it too
            else:
                _set_value(owner, name, value)
            return
        value = 0 if start is ABSENT else start
        for increment in (data if kind == "accumulate" else [data]):
            value = value + increment
        _set_value(owner, name, value)


def merge_attribute_states(rank_states: Sequence[Mapping[str, Tuple[str, Any]]]) -> Dict[str, Tuple[str, Any]]:
    """Merges per-rank :meth:`AttributeTracker.finish` states (pure function).

    Returns ``{label: ("append", new entries) | ("keys", (new (key, value)
    pairs, {replaced key: value})) | ("sum", total) | ("accumulate",
    increments in the order to add them)}``.

    Example
    -------
    >>> r0 = {"n": ("sum", 3), "x": ("accumulate", ("batches", [0, 2], [0.5, 0.25]))}
    >>> r1 = {"n": ("sum", 2), "x": ("accumulate", ("batches", [1], [1.0]))}
    >>> merged = merge_attribute_states([r0, r1])
    >>> merged["n"], merged["x"]
    (('sum', 5), ('accumulate', [0.5, 1.0, 0.25]))
    """
    kinds: Dict[str, str] = {}
    per_label: Dict[str, List[Tuple[int, Any]]] = {}
    for rank, state in enumerate(rank_states):
        for label, (kind, data) in state.items():
            if kinds.setdefault(label, kind) != kind:
                raise ConfigError(
                    f"ddp_eval: attribute '{label}' changed as '{kinds[label]}' on one rank "
                    f"and as '{kind}' on rank {rank}; expected the same kind of change on every "
                    "rank. List it in ddp_eval: attributes_exclude."
                )
            per_label.setdefault(label, []).append((rank, data))
    return {label: (kinds[label], _MERGERS[kinds[label]](label, per_label[label]))
            for label in sorted(kinds)}


def _ordered_chunks(per_rank: Sequence[Tuple[int, Tuple[list, list, Sequence]]]) -> list:
    pieces = []
    for rank, (positions, sizes, items) in per_rank:
        offset = 0
        for position, size in zip(positions, sizes):
            pieces.append((position, rank, items[offset: offset + size]))
            offset += size
    return [x for _, _, chunk in sorted(pieces, key=lambda p: p[:2]) for x in chunk]


def _merge_append(label: str, per_rank: Sequence[Tuple[int, Any]]) -> list:
    return _ordered_chunks(per_rank)


def _merge_keys(label: str, per_rank: Sequence[Tuple[int, Any]]) -> Tuple[list, dict]:
    new_items = _ordered_chunks([(rank, data[:3]) for rank, data in per_rank])
    replaced: Dict[Any, Any] = {}
    seen = set()
    for key in itertools.chain((k for k, _ in new_items), (k for _, d in per_rank for k in d[3])):
        if key in seen:
            raise ConfigError(
                f"ddp_eval: key {key!r} of dict attribute '{label}' was set by more than one "
                "batch (on different ranks, or added twice), so the dict cannot be merged; "
                "expected each key set once per stage (e.g. one per utterance id). "
                f"Accumulate in a list or a counter instead, or list '{label}' in "
                "ddp_eval: attributes_exclude."
            )
        seen.add(key)
    for _, data in per_rank:
        replaced.update(data[3])
    return new_items, replaced


def _merge_sum(label: str, per_rank: Sequence[Tuple[int, Any]]) -> Any:
    total = None
    for _, value in per_rank:
        total = value if total is None else total + value
    return total


def _merge_accumulate(label: str, per_rank: Sequence[Tuple[int, Any]]) -> list:
    if all(data[0] == "batches" for _, data in per_rank):
        pieces = [(p, rank, inc) for rank, (_, positions, incs) in per_rank for p, inc in zip(positions, incs)]
        return [inc for _, _, inc in sorted(pieces, key=lambda p: p[:2])]
    totals = []
    for _, data in per_rank:  # some rank went over budget: one total per rank, in rank order
        if data[0] == "total":
            totals.append(data[1])
        elif data[2]:
            totals.append(_merge_sum(label, [(0, inc) for inc in data[2]]))
    return totals


_MERGERS = {"append": _merge_append, "keys": _merge_keys, "sum": _merge_sum, "accumulate": _merge_accumulate}
