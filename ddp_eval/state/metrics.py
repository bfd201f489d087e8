"""SpeechBrain metric objects during a sharded stage, on one rank.

A metric object's state is its list fields (ids, scores, predictions, ...,
one entry per utterance), fields that hold a fixed list of growing lists
(``BLEUStats.targets``, one list per reference) and its numeric fields
(``AccuracyStats.correct``, ``total``); metric objects it holds
(``MultiMetricStats.metrics``, ``WeightedErrorRateStats.base_stats``, a
``DWER``'s ``wer_computer``) are followed.

The fields of a metric object, its lists included, are watched and merged by
the attribute engine (:func:`field_targets`; those of one made during the stage
from the batch that made it, :mod:`ddp_eval.state._lazy_metrics`): recording
copies see a sort, an insert or a read that steers an append, and the lists are
checked by value at stage end. What this module records itself is the nested
lists SpeechBrain declares (``BLEUStats.targets``, bound over ``None`` to the
caller's list of lists). After every batch a :class:`MetricRecorder` notes which of those grew
and to what length (nothing is copied); each rank then sends the entries it
appended, cut per batch and tagged with the batch's global position, and
:func:`ddp_eval.state.metric_merge.merge_metric_stats` puts them back in global
batch order; entries later reordered, removed or replaced are named, never
merged. ``summarize()`` and ``write_stats()`` give single-process results bit for
bit. Callables (a ``MetricStats``'s metric, a closure) never travel.

Metric objects may be created during the stage, as a ``defaultdict`` of
``ErrorRateStats`` filled per decoding method does: every rank then holds
every one of them (a rank that did not create one makes it, with the
container's factory or the class), in the order one process created them.

Example
-------
>>> class Holder:
...     pass
>>> h = Holder()
>>> recorder = MetricRecorder(MetricFinder(), h)
>>> h.err = MetricStats(metric=lambda x: x)  # made by a batch
>>> h.err.ids.extend(["a", "b"]); h.err.scores.extend([1.0, 2.0])
>>> objects = recorder.after_batch(h)
>>> state = recorder.finish(h, positions=[3])
>>> state["err"]["lists"]["ids"]
([3], [2], ['a', 'b'])
"""

import array
import functools
import itertools
import math
import operator
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from speechbrain.utils.Accuracy import AccuracyStats
from speechbrain.utils.metric_stats import MetricStats, MultiMetricStats

from ddp_eval import sb_compat
from ddp_eval.errors import ConfigError
from ddp_eval.state._explain import Fingerprint, holds_fields, unexplained
from ddp_eval.state._numbers import plain
from ddp_eval.state._order import growth_since, packed
from ddp_eval.state._values import is_flat_list, is_number
from ddp_eval.state.metric_merge import merge_metric_stats  # noqa: F401 - also public here

METRIC_TYPES = (MetricStats, MultiMetricStats, AccuracyStats)

Snapshot = Dict[str, Dict[str, Any]]  # path -> field -> list length or number
WATCH_FLAT_LISTS = True  # flat lists of objects held at stage start on the attribute engine (tests switch it off)


def find_metric_objects(owner: Any, include: Optional[Sequence[str]] = None,
                        exclude: Sequence[str] = ()) -> Dict[str, Any]:
    """Finds SpeechBrain metric objects held by ``owner`` (e.g. a Brain).

    Looks at attributes, one level into dict, list and tuple attributes, and one
    level further into the dicts those hold and the objects of the recipe's own an
    attribute holds (``metrics[VALID][wer]``, ``trackers.wer``, ``hparams.wer_stats``);
    returns ``{path: object}`` sorted by path, each object once.

    Example
    -------
    >>> class Holder:
    ...     pass
    >>> h = Holder()
    >>> h.acc = AccuracyStats()
    >>> h.several = {"a": AccuracyStats()}
    >>> h.per_stage = {"VALID": {"acc": AccuracyStats()}}
    >>> sorted(find_metric_objects(h))
    ['acc', 'per_stage[VALID][acc]', 'several[a]']
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
        # metric objects one level below those: looked for once, at the first find (stage start); at stage
        # end, moved_below() names any that moved or appeared there
        self._below: Optional[Dict[str, Any]] = None

    def find(self, owner: Any) -> Dict[str, Any]:
        """``{path: metric object}`` held by ``owner`` now, sorted by path, each object once."""
        found: Dict[str, Any] = {}
        ids = set()
        seen = {}
        previous = self._seen
        for name, value in self._attributes(owner):
            shape = _shape(type(value))
            if shape is None:  # a number, a string, a module...: holds no metric object
                continue
            before = previous.get(name)
            if before is not None and before[0] is value and shape == "fixed":
                here = before[2]  # the same tuple or metric object: what it held before
            else:
                here = self._scan(name, value)
            seen[name] = (value, len(value) if isinstance(value, (dict, list)) else 0, here)
            for path, (_, obj) in here.items():
                if id(obj) not in ids:
                    ids.add(id(obj))
                    found[path] = obj
        self._seen = seen
        if self._below is None:
            self._below = self._found_below(owner)
        for path, obj in self._below.items():
            if id(obj) not in ids:
                ids.add(id(obj))
                found[path] = obj
        return dict(sorted(found.items()))

    def _attributes(self, owner: Any) -> List[Tuple[str, Any]]:
        return [(name, value) for name, value in sorted(vars(owner).items())
                if name not in self.exclude and (self.include is None or name in self.include)]

    def _found_below(self, owner: Any) -> Dict[str, Any]:
        """``{path: metric object}`` one level below what :meth:`_scan` looks at."""
        return {path: obj for name, value in self._attributes(owner) for path, obj in _below(name, value)}

    def moved_below(self, owner: Any) -> Dict[str, str]:
        """``{path: why}`` of metric objects below the attributes' entries that a batch
        put there, took away or replaced (looked for again, once, at stage end)."""
        before, now = self._below or {}, self._found_below(owner)
        known, moved = set(map(id, before.values())), {}
        for path, obj in now.items():
            if id(obj) not in known:
                moved[path] = ("a batch put this metric object where ddp_eval looks for them only at stage start (in "
                               "a dict an attribute holds, or in an object of the recipe's own): create it in "
                               "on_stage_start, or keep it as an attribute or a dict attribute's entry")
        for path, obj in before.items():
            if now.get(path) is not obj:
                moved[path] = ("a batch took this metric object out of where ddp_eval found it at stage start, so "
                               "its entries cannot be merged: replace metric objects in on_stage_start or on_stage_end")
        return moved

    def rescan(self, owner: Any) -> Dict[str, Any]:
        """:meth:`find` from nothing (containers were reordered or filled from outside);
        below their entries, the metric objects found at stage start."""
        self._seen = {}
        return self.find(owner)

    def where(self, path: str) -> Tuple[str, Any]:
        """``(attribute, key)`` of a path found last (key None: the attribute itself)."""
        attribute = path.split("[")[0]
        return attribute, self._seen[attribute][2][path][0]

    def _scan(self, name: str, value: Any) -> Dict[str, Tuple[Any, Any]]:
        """``{path: (key, metric object)}`` of one attribute."""
        previous = self._seen.get(name)
        here = {}
        if (isinstance(value, (dict, list)) and previous is not None and previous[0] is value
                and previous[1] <= len(value)):
            # Known container: check what was found is still there, then scan new items only.
            for path, (key, _) in previous[2].items():  # still a metric object at that key?
                now = value.get(key) if isinstance(value, dict) else value[key]
                if isinstance(now, METRIC_TYPES):
                    here[path] = (key, now)
            grown = len(value) - previous[1]
            if not grown:
                return here
            if isinstance(value, dict):
                new_keys = list(itertools.islice(reversed(value), grown))
                new_keys.reverse()
                items: Iterable = zip(new_keys, map(value.__getitem__, new_keys))
            else:
                items = enumerate(value[previous[1]:], previous[1])
        elif isinstance(value, Mapping):
            items = value.items()
        elif isinstance(value, (list, tuple)):  # a list rebuilt (ids + [utt]): its entries' types in C speed
            items = enumerate(value) if any(issubclass(kind, METRIC_TYPES) for kind in set(map(type, value))) else ()
        else:
            items = ()
            if isinstance(value, METRIC_TYPES):
                here[name] = (None, value)
        for key, obj in items:
            if isinstance(obj, METRIC_TYPES):
                here[f"{name}[{key}]"] = (key, obj)
        return here


@functools.lru_cache(maxsize=None)
def _shape(cls: type) -> Optional[str]:
    """What :meth:`MetricFinder._scan` may find in an object of ``cls``: ``None``,
    nothing (not a metric object, a mapping, a list or a tuple); ``"fixed"``, the
    same as long as it is the same object (a metric object, a tuple); else
    ``"grows"`` (a mapping or a list)."""
    if issubclass(cls, (Mapping, list)):
        return "grows"
    if getattr(cls, "_ddp_probe", False):  # a probe for a tuple of numbers and strings: no metric object
        return None
    return "fixed" if issubclass(cls, METRIC_TYPES + (tuple,)) else None


_MOST_BELOW = 64  # entries of a dict looked into below the attributes' entries (a dict of stages, of metrics)


def _below(name: str, value: Any) -> Iterable[Tuple[str, Any]]:
    """``(path, metric object)`` in the dicts a dict attribute holds (``metrics[VALID][wer]``)
    and in the fields of an object of the recipe's own, and their dicts' entries
    (``trackers.wer``, ``hparams.wer_stats``, ``trackers.per[spk]``); a dict's first
    64 entries (one past them is not found, and changes what its holder holds besides
    the metric objects found: named, :mod:`ddp_eval.state._metric_holders`)."""
    if isinstance(value, Mapping):
        dicts = [(f"{name}[{key}]", entry) for key, entry in itertools.islice(value.items(), _MOST_BELOW)
                 if isinstance(entry, Mapping)]
    elif holds_fields(value) and not isinstance(value, METRIC_TYPES):
        dicts = []
        for field, entry in vars(value).items():
            if isinstance(entry, METRIC_TYPES):
                yield f"{name}.{field}", entry
            elif isinstance(entry, Mapping):
                dicts.append((f"{name}.{field}", entry))
    else:
        return
    for path, held in dicts:
        yield from ((f"{path}[{key}]", obj) for key, obj in itertools.islice(held.items(), _MOST_BELOW)
                    if isinstance(obj, METRIC_TYPES))


def _flatten(path: str, obj: Any, seen: set) -> Iterable[Tuple[str, Any]]:
    """The metric object and those it holds, as attributes or dict values."""
    yield path, obj
    for name, value in vars(obj).items():
        inner = [(f"{path}.{name}", value)] if isinstance(value, METRIC_TYPES) else (
            [(f"{path}.{name}[{key}]", v) for key, v in value.items() if isinstance(v, METRIC_TYPES)]
            if isinstance(value, dict) else [])
        for inner_path, sub in inner:
            if id(sub) not in seen:
                seen.add(id(sub))
                yield from _flatten(inner_path, sub, seen)


def all_flat(objects: Mapping[str, Any]) -> Iterable[Tuple[str, Any]]:
    """Every (nested) metric object once, e.g. a base_stats also held directly."""
    seen = {id(obj) for obj in objects.values()}
    for top, obj in objects.items():
        yield from _flatten(top, obj, seen)


def _fields(sub: Any, nested: Iterable[str] = None, skip: Iterable[str] = ()) -> Iterable[Tuple[str, Any]]:
    """``(field, list or number)`` of a metric object; each list of a field that
    holds a fixed list of growing lists (:data:`ddp_eval.sb_compat.NESTED_LIST_FIELDS`)
    as ``name[i]``; fields in ``skip`` are watched as attributes (:func:`field_targets`)."""
    nested = sb_compat.nested_list_fields(sub) if nested is None else nested
    for name, value in vars(sub).items():
        if name in skip:
            continue
        if isinstance(value, list):
            if name in nested:
                for i, inner in enumerate(value):
                    yield f"{name}[{i}]", inner
            else:
                yield name, value
        elif is_number(value):
            yield name, value


def snapshot(objects: Mapping[str, Any], slotted: Mapping[str, Iterable[str]] = {}) -> Snapshot:
    """Records list lengths and numeric fields of every (nested) metric object."""
    return {path: {name: len(v) if isinstance(v, list) else v for name, v in _fields(sub, skip=slotted.get(path, ()))}
            for path, sub in all_flat(objects)}


def _merged_elsewhere(value: Any) -> bool:
    """A field the metric merge does not own: metric objects it holds, callables, a summary."""
    if isinstance(value, METRIC_TYPES) or callable(value):
        return True
    return isinstance(value, dict) and any(isinstance(v, METRIC_TYPES) for v in value.values())


def field_targets(objects: Mapping[str, Any], flat_lists: bool = False) -> Dict[str, Tuple[Any, str]]:
    """``{label: (metric object, field)}`` of the fields of metric objects that are
    watched and merged as Brain attributes are (one engine: lists, dicts, tensors,
    arrays, sets, strings, numbers, any kind): every field but the nested lists
    SpeechBrain declares, metric objects it holds and callables; flat lists (ids,
    scores) only with ``flat_lists`` (their recording copies see a sort, an insert
    or a read that steers an append; tests switch it off to show what it catches)."""
    targets = {}
    for path, sub in all_flat(objects):
        nested = sb_compat.nested_list_fields(sub)
        for name, value in vars(sub).items():
            flat = is_flat_list(value)
            if (flat and not flat_lists) or name in nested or name == "summary" or _merged_elsewhere(value) or (
                    isinstance(sub, MultiMetricStats) and name == "metrics"):  # its metric objects, made per key
                continue
            if _is_setting(value):  # a setting (a flag, a token): compared at stage end
                continue
            targets[f"{path}.{name}"] = (sub, name)
    return targets


def _is_setting(value: Any) -> bool:
    """A field that configures a metric object (``split_tokens``, ``space_token``): a
    bool or a string; not watched per batch, compared at stage end."""
    return isinstance(value, (bool, str, bytes))


def _pack(items: list) -> Any:
    """A list of same-shaped tensors travels as one stacked CPU tensor (:func:`ddp_eval.state._order.packed`)."""
    return packed([x.detach().cpu() if isinstance(x, torch.Tensor) else plain(x) for x in items])


class MetricRecorder:
    """Records, batch by batch, how long the list fields of every (nested)
    metric object are, for the merge to cut what each batch appended. Per batch
    it stores one ``(batch, length)`` pair per list field that grew, nothing for
    the others: O(fields) time and memory per batch, whatever the objects hold.

    Arguments
    ---------
    finder : MetricFinder
        Finds the metric objects of the owner (e.g. the Brain).
    owner : object
        Holder of the metric objects; recorded as they are now (stage start).
    """

    def __init__(self, finder: MetricFinder, owner: Any) -> None:
        self.finder = finder
        self.objects = finder.find(owner)
        self.fields = field_targets(self.objects, flat_lists=WATCH_FLAT_LISTS)  # watched by the attribute tracker
        self.slotted: Dict[str, set] = {}
        for label, (_, name) in self.fields.items():
            self.slotted.setdefault(label[: -len(name) - 1], set()).add(name)
        self.start: Snapshot = snapshot(self.objects, self.slotted)
        self.start_fields = {path: set(vars(sub)) for path, sub in all_flat(self.objects)}
        self.settings = {(path, name): value for path, sub in all_flat(self.objects)
                         for name, value in vars(sub).items() if _is_setting(value)}
        self.batches = 0
        self._piece_from, self._piece_numbers = 0, self.start
        self._last: Dict[Tuple[str, str], int] = {}
        self._changes: Dict[Tuple[str, str], array.array] = {}  # batch, length, batch, length, ...
        self._appended: Dict[Tuple[str, str], list] = {}  # what batches appended, read right after each
        self.first_seen: Dict[str, int] = {}  # path -> batch, of objects created during the stage
        self.baselines: Snapshot = {}  # numbers of a fresh object, of objects created during the stage
        self.made_as: Snapshot = {}  # the same, where a fresh object could be made (the start of its fields)
        self.shrunk: Dict[str, str] = {}  # path.field -> what happened
        self.changed_batches: Dict[str, int] = {}  # path -> batches that appended to it
        self.kept: Dict[Tuple[str, str], Fingerprint] = {}  # what the lists held at stage start, checked at the end
        self.rebound: Dict[str, str] = {}  # path.field -> how a batch changed a nested field other than by append
        self.unmerged: Dict[Tuple[str, str], Fingerprint] = {}  # fields of objects created in the stage
        self.moved: Dict[str, str] = {}  # path -> how a batch moved a metric object below the entries (at finish)
        for path, sub in all_flat(self.objects):
            for name, value in _fields(sub, skip=self.slotted.get(path, ())):
                if isinstance(value, list):
                    self._last[(path, name)] = len(value)
                    if value:
                        self.kept[(path, name)] = Fingerprint.of(value)

    def after_batch(self, owner: Any) -> Dict[str, Any]:
        """Notes the list lengths after a batch; returns the metric objects found."""
        self.objects = self.finder.find(owner)
        self._note(self.batches)
        self.batches += 1
        return self.objects

    def _note(self, batch: int) -> None:
        for path, sub in all_flat(self.objects):
            if path not in self.start and path not in self.first_seen:
                self.first_seen[path] = batch
                self.baselines[path], made = fresh_numbers(sub, _per_key(path, self.objects))
                if made:
                    self.made_as[path] = self.baselines[path]
                for name, value in vars(sub).items():  # fields no merge follows: must not change from here on
                    if not isinstance(value, list) and not is_number(value) and name != "summary" and not (
                            _merged_elsewhere(value) or isinstance(sub, MultiMetricStats)):
                        self.unmerged[(path, name)] = Fingerprint.of(value)
            self._note_binding(path, sub)
            grew = False
            for name, value in _fields(sub, skip=self.slotted.get(path, ())):
                if isinstance(value, list):
                    key = (path, name)
                    before = self._last.get(key, 0)
                    if len(value) < before:
                        self.shrunk[f"{path}.{name}"] = f"entries were removed ({before} -> {len(value)})"
                    elif len(value) > before:
                        self._changes.setdefault(key, array.array("q")).extend((batch, len(value)))
                        self._appended.setdefault(key, []).extend(value[before:])  # by reference, checked at the end
                        self._last[key] = len(value)
                        grew = True
            if grew and path in self.start:  # existed at stage start, for the main-process-only check
                self.changed_batches[path] = self.changed_batches.get(path, 0) + 1

    def _note_binding(self, path: str, sub: Any) -> None:
        """A nested field (``BLEUStats.targets``) is bound once, over ``None``, by its
        ``append``, then only extended, each list as long as ``ids``. One a batch left
        ``None`` after appending, or with lists longer or shorter than ``ids`` (an
        insert or a cut after ``append``, also in the batch that bound it: each rank's
        first, in one process another batch's extension), is noted. (A binding by the
        recipe's own code is seen as it happens: ``_lazy_metrics``.)"""
        for name in sb_compat.nested_list_fields(sub):
            outer, ids = vars(sub).get(name), vars(sub).get("ids")
            if not isinstance(ids, list):
                continue
            count = list.__len__(ids)
            if outer is None and count:
                why = "a batch set it back to None after its append bound it"
            elif isinstance(outer, list) and any(not isinstance(inner, list) or list.__len__(inner) != count
                                                 for inner in outer):
                why = "a batch left its lists longer or shorter than ids (an insert or a cut after append)"
            else:
                continue
            self.rebound.setdefault(f"{path}.{name}", f"{why}, which ddp_eval cannot replay in one process's order: "
                                                      "create the metric object anew in on_stage_start, or change "
                                                      "its lists in on_stage_end")

    def forget(self, path: str, name: str) -> None:
        """A list field the attribute engine watches from now on (one of an object
        made during the stage): what this recorder noted of it is dropped."""
        for notes in (self._last, self._changes, self._appended):
            notes.pop((path, name), None)

    def finish(self, owner: Any, positions: Sequence[int]) -> Dict[str, Dict[str, Any]]:
        """What this rank appended during the stage, cut per batch.

        ``positions`` are the global positions of this rank's batches. Returns
        ``{path: {"lists": {field: (positions, sizes, items)}, "numbers":
        {field: delta}, "nested": {field: number of lists}}}``: ``items`` are the
        new entries, ``sizes[i]`` of them appended during the batch at
        ``positions[i]`` (``inf``: after the last batch).
        """
        self.objects = self.finder.find(owner)
        self._note(self.batches)  # anything appended after the last batch
        self.moved = self.finder.moved_below(owner)
        if self.shrunk:
            field, why = next(iter(self.shrunk.items()))
            raise ConfigError(f"ddp_eval: metric field '{field}' lost entries during the sharded stage ({why}); "
                              "expected metric objects that only grow. Create a new one in on_stage_start "
                              "instead of clearing it, or list it in ddp_eval: metrics_exclude.")
        return self._state(0, list(positions[: self.batches]) + [math.inf], self.start)

    def unexplained(self) -> Dict[str, str]:
        """``{path.field: why}`` of metric fields whose end state what was recorded
        does not explain (checked at stage end, before anything is merged)."""
        found = {**self.rebound, **self.moved}
        flat = dict(all_flat(self.objects))
        for path in itertools.chain(self.start, self.first_seen):
            if path not in flat:
                found[path] = ("a batch took this metric object out of where ddp_eval found it (a del, a pop), so "
                               "its entries cannot be merged: remove metric objects in on_stage_start or on_stage_end")
        for (path, name), kept in self.kept.items():
            value = _field(flat.get(path), name)
            if isinstance(value, list) and unexplained(kept, value[: self.start[path].get(name, 0)]):
                found[f"{path}.{name}"] = ("entries it held at stage start were changed in place; a metric "
                                           "object's list fields are merged as lists that grow")
        for (path, name), appended in self._appended.items():
            value = _field(flat.get(path), name)
            if f"{path}.{name}" in found:
                continue
            begin = self.start.get(path, {}).get(name, 0)
            if isinstance(value, list) and (len(value) != begin + len(appended) or any(
                    map(operator.is_not, itertools.islice(value, begin, None), appended))):
                found[f"{path}.{name}"] = ("entries batches appended were later reordered, removed or replaced "
                                           "(a sort, an insert, a cut), which ddp_eval cannot replay in one "
                                           "process's order: create the metric object in on_stage_start, or "
                                           "sort and cut its lists in on_stage_end")
        for (path, name), start in self.unmerged.items():
            if path in flat and unexplained(start, getattr(flat[path], name, None)):
                found[f"{path}.{name}"] = (f"a {type(getattr(flat[path], name, None)).__name__} field of a metric "
                                           "object created during the stage changed, and only the list and number "
                                           "fields of such objects are merged: create the object in on_stage_start")
        for (path, name), value in self.settings.items():
            now = getattr(flat.get(path), name, None)
            if path in flat and (now is not value and now != value):
                found[f"{path}.{name}"] = (f"a setting of the metric object ({value!r}) became {now!r} during the "
                                           "stage, which no merge follows: set it in on_stage_start")
        for path, sub in flat.items():
            if path in self.start:
                known = self.start_fields[path]
                for name, value in vars(sub).items():
                    if (name not in known and not isinstance(value, list)
                            and name != "summary" and not _merged_elsewhere(value)):
                        found[f"{path}.{name}"] = (f"a field set during the stage (a {type(value).__name__}), "
                                                   "which no merge follows: set it in on_stage_start or clear()")
        return found

    def piece(self, positions: Sequence[int]) -> Dict[str, Dict[str, Any]]:
        """What the batches since the previous piece (or stage start) appended,
        in :meth:`finish`'s format, for a journal; :meth:`finish` is unaffected."""
        state = self._state(self._piece_from, list(positions[: self.batches]), self._piece_numbers)
        self._piece_from, self._piece_numbers = self.batches, snapshot(self.objects, self.slotted)
        return state

    def _state(self, from_batch: int, places: Sequence[float], numbers_before: Snapshot) -> Dict[str, Dict[str, Any]]:
        state: Dict[str, Dict[str, Any]] = {}
        for path, sub in all_flat(self.objects):
            lists, numbers, nested = {}, {}, {}
            started = self.start.get(path, {})
            before = numbers_before.get(path, self.baselines.get(path, {}))
            for name, value in _fields(sub, skip=self.slotted.get(path, ())):
                if isinstance(value, list):
                    batches, bounds = growth_since(self._changes.get((path, name), ()), from_batch,
                                                   started.get(name, 0))
                    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
                    lists[name] = ([places[i] for i in batches], sizes, _pack(value[bounds[0]: bounds[-1]]))
                    if "[" in name:
                        outer = name.split("[")[0]
                        nested[outer] = nested.get(outer, 0) + 1
                else:
                    numbers[name] = value - before.get(name, 0)
            state[path] = {"lists": lists, "numbers": numbers, "nested": nested}
        return state


def _field(sub: Any, name: str) -> Any:
    """A list field of a metric object by its recorder name (``targets[0]``: an inner list)."""
    outer, _, index = name.partition("[")
    value = getattr(sub, outer, None)
    if index and isinstance(value, list):  # an inner list of a nested field (BLEUStats.targets[0])
        value = value[int(index[:-1])] if int(index[:-1]) < len(value) else None
    return value


def fresh_numbers(obj: Any, per_key: bool = False) -> Tuple[Dict[str, Any], bool]:
    """``(numeric fields, made)`` of a fresh object of ``obj``'s class (what a metric
    object created during the stage started from; ``per_key``: one a MultiMetricStats
    made), or of ``obj`` itself (``made`` False) if its class cannot be made without
    arguments."""
    try:
        fresh, made = (made_per_key() if per_key else type(obj)()), True
    except Exception:  # needs arguments (a MetricStats's metric): its own numbers are its start
        fresh, made = obj, False
    return {name: value for name, value in _fields(fresh, ()) if not isinstance(value, list)}, made


def made_per_key() -> MetricStats:
    """A metric object made by ``MultiMetricStats.append`` for a new key (SpeechBrain's
    own code, so its metric is SpeechBrain's function, as in one process)."""
    scratch = MultiMetricStats(metric=lambda: {"key": torch.zeros(0)}, batch_eval=True)
    scratch.append([])
    return scratch.metrics["key"]


def _per_key(path: str, objects: Mapping[str, Any]) -> bool:
    """Whether ``path`` is one of a MultiMetricStats's per-key objects (``top.metrics[key]``)."""
    holder, _, key = path.rpartition(".metrics[")
    return bool(holder) and "[" not in key[:-1] and isinstance(dict(all_flat(objects)).get(holder), MultiMetricStats)


def apply_merged(objects: Mapping[str, Any], start: Mapping[str, Mapping[str, Any]],
                 merged: Mapping[str, Mapping[str, Any]]) -> None:
    """Writes merged state into the local metric objects (what they held at
    stage start kept, the merged entries after it)."""
    make_missing_per_key(objects, merged)
    for path, sub in all_flat(objects):
        if path not in merged:
            continue
        before = start.get(path, {})
        state = merged[path]
        for name, count in state.get("nested", {}).items():
            outer = getattr(sub, name, None)
            outer = outer if isinstance(outer, list) else []
            outer += [[] for _ in range(count - len(outer))]
            setattr(sub, name, [outer[i][: before.get(f"{name}[{i}]", 0)] + state["lists"].get(f"{name}[{i}]", [])
                                for i in range(count)])
        for name, items in state["lists"].items():
            if "[" not in name:
                setattr(sub, name, getattr(sub, name, [])[: before.get(name, 0)] + items)
        for name, delta in state["numbers"].items():
            setattr(sub, name, before.get(name, 0) + delta)
        if isinstance(getattr(sub, "summary", None), dict):
            sub.summary = {}


def make_missing_per_key(objects: Mapping[str, Any], merged: Mapping[str, Any]) -> None:
    """Makes the per-key objects a MultiMetricStats on this rank lacks (its batches
    never had a key), as ``MultiMetricStats.append`` would, before merged fields go in."""
    for top, obj in objects.items():
        if not isinstance(obj, MultiMetricStats):
            continue
        prefix = f"{top}.metrics["
        for path in merged:
            if path.startswith(prefix) and "." not in path[len(prefix):]:
                key = path[len(prefix): -1]
                if key not in {str(k) for k in obj.metrics}:
                    obj.metrics[key] = made_per_key()


def describe_objects(objects: Mapping[str, Any]) -> list:
    """``[(path, class name)]`` of the metric objects (the journal's layout key)."""
    return [(path, type(obj).__name__) for path, obj in objects.items()]
