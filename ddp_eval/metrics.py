"""Merging SpeechBrain metric objects across ranks, exactly.

A metric object's state is its list fields (ids, scores, predictions, ...,
one entry per utterance) and its numeric fields (``AccuracyStats.correct``,
``total``). During a sharded stage, a :class:`MetricRecorder` notes after
every batch which list fields grew and to what length (nothing is copied); each
rank then sends the entries it appended, cut per batch and tagged with the
batch's global position. :func:`merge_metric_stats`
(a pure function) puts the pieces back in global batch order, so the merged
object holds exactly what one process would have appended, in the same order:
``summarize()`` and ``write_stats()`` give single-process results bit for bit.

Fields that did not grow during the stage (configuration lists, flags) are
left as they are, and numbers are merged as the sum of per-rank increments.

Example
-------
>>> rank0 = {"m": {"lists": {"ids": ([0, 2], [1, 1], ["a", "c"])}, "numbers": {}}}
>>> rank1 = {"m": {"lists": {"ids": ([1], [1], ["b"])}, "numbers": {}}}
>>> merge_metric_stats([rank0, rank1])["m"]["lists"]["ids"]
['a', 'b', 'c']
"""

import array
import itertools
import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from speechbrain.utils.Accuracy import AccuracyStats
from speechbrain.utils.metric_stats import (
    MetricStats,
    MultiMetricStats,
    WeightedErrorRateStats,
)

from ddp_eval.attributes import growth_since
from ddp_eval.errors import ConfigError

METRIC_TYPES = (MetricStats, MultiMetricStats, AccuracyStats)

Snapshot = Dict[str, Dict[str, Any]]  # path -> field -> list length or number


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def find_metric_objects(
    owner: Any,
    include: Optional[Sequence[str]] = None,
    exclude: Sequence[str] = (),
) -> Dict[str, Any]:
    """Finds SpeechBrain metric objects held by ``owner`` (e.g. a Brain).

    Looks at attributes and one level into dict, list and tuple attributes;
    returns ``{path: object}`` sorted by path, each object once.

    Example
    -------
    >>> class Holder:
    ...     pass
    >>> h = Holder()
    >>> h.acc = AccuracyStats()
    >>> h.several = {"a": AccuracyStats()}
    >>> sorted(find_metric_objects(h))
    ['acc', 'several[a]']
    """
    return MetricFinder(include, exclude).find(owner)


class MetricFinder:
    """:func:`find_metric_objects`, incremental: a list or dict attribute that
    kept its identity is searched only in the items it gained since the last
    call, so a growing list of floats on the Brain costs nothing per batch.

    Example
    -------
    >>> class Holder:
    ...     pass
    >>> h, finder = Holder(), MetricFinder()
    >>> h.scores = [0.5] * 1000
    >>> finder.find(h)
    {}
    >>> h.scores.append(AccuracyStats())
    >>> list(finder.find(h))
    ['scores[1000]']
    """

    def __init__(self, include: Optional[Sequence[str]] = None, exclude: Sequence[str] = ()) -> None:
        self.include, self.exclude = include, set(exclude)
        self._seen: Dict[str, Tuple[Any, int, Dict[str, Tuple[Any, Any]]]] = {}

    def find(self, owner: Any) -> Dict[str, Any]:
        """``{path: metric object}`` held by ``owner`` now, sorted by path, each object once."""
        found: Dict[str, Any] = {}
        ids = set()
        seen = {}
        for name, value in sorted(vars(owner).items()):
            if name in self.exclude or (self.include is not None and name not in self.include):
                continue
            here = self._scan(name, value)
            seen[name] = (value, len(value) if isinstance(value, (dict, list)) else 0, here)
            for path, (_, obj) in here.items():
                if id(obj) not in ids:
                    ids.add(id(obj))
                    found[path] = obj
        self._seen = seen
        return dict(sorted(found.items()))

    def _scan(self, name: str, value: Any) -> Dict[str, Tuple[Any, Any]]:
        """``{path: (key, metric object)}`` of one attribute."""
        previous = self._seen.get(name)
        if (isinstance(value, (dict, list)) and previous is not None and previous[0] is value
                and previous[1] <= len(value)):
            # Known container: check what was found is still there, then scan new items only.
            here = {}
            for path, (key, _) in previous[2].items():  # still a metric object at that key?
                now = value.get(key) if isinstance(value, dict) else value[key]
                if isinstance(now, METRIC_TYPES):
                    here[path] = (key, now)
            if isinstance(value, dict):
                new_keys = list(itertools.islice(reversed(value), len(value) - previous[1]))[::-1]
                items = ((k, value[k]) for k in new_keys)
            else:
                items = ((i, value[i]) for i in range(previous[1], len(value)))
        else:
            here = {}
            if isinstance(value, Mapping):
                items = value.items()
            elif isinstance(value, (list, tuple)):
                items = enumerate(value)
            else:
                items = ()
                if isinstance(value, METRIC_TYPES):
                    here[name] = (None, value)
        for key, obj in items:
            if isinstance(obj, METRIC_TYPES):
                here[f"{name}[{key}]"] = (key, obj)
        return here


def _flatten(path: str, obj: Any) -> Iterable[Tuple[str, Any]]:
    # Metric objects that hold other metric objects.
    yield path, obj
    if isinstance(obj, MultiMetricStats):
        for key, inner in obj.metrics.items():
            yield from _flatten(f"{path}.metrics[{key}]", inner)
    if isinstance(obj, WeightedErrorRateStats):
        yield from _flatten(f"{path}.base_stats", obj.base_stats)


def _all_flat(objects: Mapping[str, Any]) -> Iterable[Tuple[str, Any]]:
    """Every (nested) metric object once, e.g. a base_stats also held directly."""
    seen = set()
    for top, obj in objects.items():
        for path, sub in _flatten(top, obj):
            if id(sub) not in seen:
                seen.add(id(sub))
                yield path, sub


def snapshot(objects: Mapping[str, Any]) -> Snapshot:
    """Records list lengths and numeric fields of every (nested) metric object."""
    snap: Snapshot = {}
    for path, sub in _all_flat(objects):
        fields = {}
        for name, value in vars(sub).items():
            if isinstance(value, list):
                fields[name] = len(value)
            elif _is_number(value):
                fields[name] = value
        snap[path] = fields
    return snap


def _pack(items: list) -> Any:
    """A list of same-shaped tensors travels as one stacked CPU tensor (pickling
    thousands of 0-d tensors one by one costs far more than the merge)."""
    if items and all(isinstance(x, torch.Tensor) for x in items):
        first = items[0]
        if all(x.shape == first.shape and x.dtype == first.dtype for x in items):
            return torch.stack([x.detach() for x in items]).cpu()
    return [x.detach().cpu() if isinstance(x, torch.Tensor) else x for x in items]


def _unpack(packed: Any) -> list:
    return list(packed.unbind(0)) if isinstance(packed, torch.Tensor) else packed


class MetricRecorder:
    """Records, batch by batch, how long the list fields of every (nested)
    metric object are, for :func:`merge_metric_stats` to cut what each batch
    appended. Per batch it stores one ``(batch, length)`` pair per list field
    that grew, nothing for the others: O(fields) time and memory per batch,
    whatever the metric objects hold.

    Arguments
    ---------
    finder : MetricFinder
        Finds the metric objects of the owner (e.g. the Brain).
    owner : object
        Holder of the metric objects; recorded as they are now (stage start).

    Example
    -------
    >>> class Holder:
    ...     pass
    >>> h = Holder()
    >>> h.err = MetricStats(metric=lambda x: x)
    >>> recorder = MetricRecorder(MetricFinder(), h)
    >>> h.err.ids.extend(["a", "b"]); h.err.scores.extend([1.0, 2.0])
    >>> objects = recorder.after_batch(h)
    >>> state = recorder.finish(h, positions=[3])
    >>> state["err"]["lists"]["ids"]
    ([3], [2], ['a', 'b'])
    """

    def __init__(self, finder: MetricFinder, owner: Any) -> None:
        self.finder = finder
        self.objects = finder.find(owner)
        self.start: Snapshot = snapshot(self.objects)
        self.batches = 0
        self._piece_from, self._piece_numbers = 0, self.start  # where the next journal piece starts
        self._last: Dict[Tuple[str, str], int] = {}
        self._changes: Dict[Tuple[str, str], array.array] = {}  # batch, length, batch, length, ...
        for path, sub in _all_flat(self.objects):
            for name, value in vars(sub).items():
                if isinstance(value, list):
                    self._last[(path, name)] = len(value)

    def after_batch(self, owner: Any) -> Dict[str, Any]:
        """Notes the list lengths after a batch; returns the metric objects found."""
        self.objects = self.finder.find(owner)
        self._note(self.batches)
        self.batches += 1
        return self.objects

    def _note(self, batch: int) -> None:
        for path, sub in _all_flat(self.objects):
            for name, value in vars(sub).items():
                if isinstance(value, list):
                    key = (path, name)
                    if len(value) != self._last.get(key, 0):
                        self._changes.setdefault(key, array.array("q")).extend((batch, len(value)))
                        self._last[key] = len(value)

    def finish(self, owner: Any, positions: Sequence[int]) -> Dict[str, Dict[str, Any]]:
        """What this rank appended during the stage, cut per batch.

        ``positions`` are the global positions of this rank's batches. Returns
        ``{path: {"lists": {field: (positions, sizes, items)}, "numbers":
        {field: delta}}}``: ``items`` are the new entries, ``sizes[i]`` of them
        appended during the batch at ``positions[i]`` (``inf``: after the last batch).
        """
        self.objects = self.finder.find(owner)
        self._note(self.batches)  # anything appended after the last batch
        return self._state(0, list(positions[: self.batches]) + [math.inf], self.start)

    def piece(self, positions: Sequence[int]) -> Dict[str, Dict[str, Any]]:
        """What the batches since the previous piece (or stage start) appended,
        in :meth:`finish`'s format, for a journal; :meth:`finish` is unaffected."""
        state = self._state(self._piece_from, list(positions[: self.batches]), self._piece_numbers)
        self._piece_from, self._piece_numbers = self.batches, snapshot(self.objects)
        return state

    def _state(self, from_batch: int, places: Sequence[float], numbers_before: Snapshot) -> Dict[str, Dict[str, Any]]:
        state: Dict[str, Dict[str, Any]] = {}
        for path, sub in _all_flat(self.objects):
            lists, numbers = {}, {}
            started = self.start.get(path, {})
            for name, value in vars(sub).items():
                if isinstance(value, list):
                    batches, bounds = growth_since(self._changes.get((path, name), ()), from_batch,
                                                   started.get(name, 0))
                    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
                    lists[name] = ([places[i] for i in batches], sizes, _pack(value[bounds[0]: bounds[-1]]))
                elif _is_number(value):
                    numbers[name] = value - numbers_before.get(path, {}).get(name, 0)
            state[path] = {"lists": lists, "numbers": numbers}
        return state


def merge_metric_stats(rank_states: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Merges the per-rank states of :func:`local_state` (pure function).

    List entries are put in global batch order (ties: rank order); numeric
    increments are summed in rank order.

    Example
    -------
    >>> r0 = {"acc": {"lists": {}, "numbers": {"correct": 3.0, "total": 4.0}}}
    >>> r1 = {"acc": {"lists": {}, "numbers": {"correct": 1.0, "total": 4.0}}}
    >>> merge_metric_stats([r0, r1])["acc"]["numbers"]
    {'correct': 4.0, 'total': 8.0}
    """
    paths: List[str] = []
    for state in rank_states:
        paths.extend(p for p in state if p not in paths)
    merged: Dict[str, Dict[str, Any]] = {}
    for path in paths:
        pieces: Dict[str, List[Tuple[float, int, list]]] = {}
        numbers: Dict[str, Any] = {}
        for rank, state in enumerate(rank_states):
            entry = state.get(path, {"lists": {}, "numbers": {}})
            for name, (positions, sizes, packed) in entry["lists"].items():
                items, offset = _unpack(packed), 0
                for position, size in zip(positions, sizes):
                    pieces.setdefault(name, []).append((position, rank, items[offset : offset + size]))
                    offset += size
            for name, delta in entry["numbers"].items():
                numbers[name] = numbers.get(name, 0) + delta
        lists = {
            name: [x for _, _, items in sorted(ps, key=lambda p: p[:2]) for x in items]
            for name, ps in pieces.items()
        }
        merged[path] = {"lists": lists, "numbers": numbers}
    return merged


def apply_merged(
    objects: Mapping[str, Any], start: Snapshot, merged: Mapping[str, Mapping[str, Any]]
) -> None:
    """Writes merged state into the local metric objects (prefix kept)."""
    for top, obj in objects.items():
        _create_missing_inner(top, obj, merged)
    for path, sub in _all_flat(objects):
        if path not in merged:
            continue
        before = start.get(path, {})
        for name, items in merged[path]["lists"].items():
            setattr(sub, name, getattr(sub, name, [])[: before.get(name, 0)] + items)
        for name, delta in merged[path]["numbers"].items():
            setattr(sub, name, before.get(name, 0) + delta)
        if isinstance(getattr(sub, "summary", None), dict):
            sub.summary = {}


def _create_missing_inner(top: str, obj: Any, merged: Mapping[str, Any]) -> None:
    # A rank that evaluated no batch never had MultiMetricStats create its
    # per-key MetricStats; create them as MultiMetricStats.append would.
    if not isinstance(obj, MultiMetricStats):
        return
    prefix = f"{top}.metrics["
    for path in merged:
        if path.startswith(prefix) and "." not in path[len(prefix):]:
            key = path[len(prefix) : -1]
            if key not in {str(k) for k in obj.metrics}:
                obj.metrics[key] = MetricStats(lambda x: x, batch_eval=True)


def describe_objects(objects: Mapping[str, Any]) -> List[Tuple[str, str]]:
    """``[(path, class name)]``, compared across ranks before merging."""
    return [(path, type(obj).__name__) for path, obj in objects.items()]


def check_same_objects(per_rank: Sequence[List[Tuple[str, str]]], stage: str) -> None:
    """Raises :class:`ConfigError` if ranks hold different metric objects."""
    if all(desc == per_rank[0] for desc in per_rank):
        return
    detail = "; ".join(f"rank {r}: {d}" for r, d in enumerate(per_rank))
    raise ConfigError(
        f"ddp_eval: at the end of {stage}, ranks hold different metric objects, so "
        f"they cannot be merged; expected the same on every rank, got {detail}. "
        "Create metric objects in on_stage_start (not lazily in "
        "compute_objectives), or list them in ddp_eval: metrics_exclude."
    )
