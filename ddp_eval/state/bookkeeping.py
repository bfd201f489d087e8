"""What one rank's batches did during a sharded stage, and the one pure merge of
every rank's record: no collectives here.

:class:`StageBook` records, on one rank, what the stage's batches do to the
recipe's state: its metric objects (:class:`~ddp_eval.state.metrics.MetricRecorder`)
and its attributes and the fields of its metric objects that are not flat
lists (:class:`~ddp_eval.state._attributes.AttributeTracker`, one engine for both).
At stage end :meth:`StageBook.collect` checks that the record explains the
state the rank holds (anything it does not is named, never merged) and gives
what travels; :func:`merge_stage` merges every rank's record (and a resumed
stage's journal pieces) into what one process would hold, the same on every
rank; :meth:`StageBook.apply` writes it into this rank's objects.
:class:`ddp_eval.stage._sharded.ShardedStage` runs these around its collectives; tests
and benchmarks run them for simulated ranks.

Example
-------
>>> import types
>>> from ddp_eval.config import DDPEvalConfig
>>> def recipe():
...     return types.SimpleNamespace(_ddp_brain_attributes=frozenset(), hist=[0, 0], ids=[])
>>> def batch(brain, b):
...     brain.hist[b % 2] += 1
...     brain.ids.append(f"u{b}")
>>> brains = [recipe(), recipe()]
>>> books = [StageBook(brain, DDPEvalConfig()) for brain in brains]
>>> records = []
>>> for brain, book, positions in zip(brains, books, ([0, 3], [1, 2])):
...     book.start()
...     for b in positions:
...         batch(brain, b)
...         book.after_batch()
...     records.append(book.collect(positions))
>>> merged = merge_stage([record.state for record in records])
>>> winners = winners_of([record.report for record in records])
>>> for book, record in zip(books, records):
...     book.apply(merged, [r.report["layout"] for r in records], winners, [r.bound for r in records])
>>> brains[1].hist, brains[1].ids
([2, 2], ['u0', 'u1', 'u2', 'u3'])
"""

import pickle
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from ddp_eval.state._aliases import SharedCopies
from ddp_eval.state._attributes import AttributeTracker, resolve, top_label
from ddp_eval.state._c_reads import read_in_c_of, values_at
from ddp_eval.state._declared import DeclaredSlot
from ddp_eval.state._field_flow import ENTRY, parts
from ddp_eval.state._lazy_metrics import LazyMetricFields
from ddp_eval.state._metric_holders import MetricHolders
from ddp_eval.state._metric_layout import complete, describe
from ddp_eval.state._values import ELSEWHERE, Kind, Op, recipe_names
from ddp_eval.state.attribute_merge import (
    COMPARED_OTHERWISE,
    MergeResult,
    last_candidates,
    last_writer,
    merge_attribute_states,
)
from ddp_eval.state.metric_merge import merge_metric_stats
from ddp_eval.state.metrics import MetricFinder, MetricRecorder, all_flat, apply_merged, make_missing_per_key


class Collected(NamedTuple):
    """One rank's record at stage end: ``report`` travels in the stage-end
    exchange (small), ``state`` in the gather, ``bound`` (pickled objects bound
    by a batch, by label) only the part whose binding is the globally last."""

    report: Dict[str, Any]
    state: Tuple[Any, Any]
    bound: Dict[str, bytes]


class StageMerge(NamedTuple):
    """What one process would hold: merged metric state and attribute changes."""

    metrics: Dict[str, Dict[str, Any]]
    attributes: MergeResult


def merge_stage(states: Sequence[Tuple[Any, Any]], reports: Sequence[Mapping[str, Any]] = ()) -> StageMerge:
    """Merges every contribution's ``(metric state, attribute changes)`` (ranks in
    order, then a journal's pieces) in global batch order; pure, the same on every
    rank. ``reports`` (the ranks'): values set by batches that read what other
    batches changed are named (:func:`name_values_read_from_partial_state`)."""
    merged = StageMerge(merge_metric_stats([s[0] for s in states]), merge_attribute_states([s[1] for s in states]))
    grown = {top_label(path) for state, _ in states for path, fields in state.items()
             if any(any(sizes) for _, sizes, _ in fields["lists"].values())}  # metric objects' lists appended to
    name_values_read_from_partial_state(merged.attributes, reports, grown)
    return merged


def name_values_read_from_partial_state(result: MergeResult, reports: Sequence[Mapping[str, Any]],
                                        grown: Iterable[str] = ()) -> None:
    """A value a batch set after reading an attribute that batches changed during the
    stage (``self.n_items = len(self.items)``, ``self.last = next(self.it)``) holds,
    on each rank, what that rank's batches alone made of it: it is named (a
    conflict, left rank-local), never merged. What such a read may have steered
    otherwise is named too (:func:`_name_what_a_steering_read_may_have_left_undone`)."""
    _name_places_bound_apart(result, reports)  # first: a read of what it names may have steered
    _name_entries_made_apart(result, reports)
    changed = _changed(result)  # a number batches only compared is unchanged: a read of it is one process's
    changed |= {top_label(label) for report in reports for label in report.get("unmergeable", ())} | set(grown)
    for rank, report in enumerate(reports):
        for label, read in report.get("read_then_set", {}).items():
            partial = sorted(set(read) & changed)
            if not partial or label in result.conflicts:
                continue
            for key in [k for k in result.merged if top_label(k) == label]:
                del result.merged[key]
            result.conflicts[label] = (
                f"a batch (on rank {rank}) set it after reading {partial}, which batches changed during the stage: "
                "on each rank it is computed from that rank's batches only; compute it in on_stage_end from the "
                "merged values")
    _name_what_a_steering_read_may_have_left_undone(result, reports, changed)


def _name_entries_made_apart(result: MergeResult, reports: Sequence[Mapping[str, Any]]) -> None:
    """A dict entry that batches on several ranks (or journal pieces) each made a
    container for (``d.setdefault(k, [])``, a ``defaultdict``'s factory) merges as if
    the later batches had found the earlier one's: exact where each batch only grew
    it. Where a batch also sorted, inserted into, set by position or read it, in one
    process it did so to every earlier batch's entries: the entry is named."""
    made: Dict[str, List[str]] = {}
    for report in reports:
        for label, did in report.get("made", {}).items():
            made.setdefault(label, []).extend(did)
    for label, did in made.items():
        other = sorted({what for what in did if what})
        if len(did) < 2 or not other:
            continue
        for key in [k for k in result.merged if k == label or k.startswith((label + "[", label + "."))]:
            del result.merged[key]
        result.conflicts.setdefault(label, (
            f"batches on {len(did)} ranks each made it anew (setdefault, a defaultdict's factory) and one also did "
            f"{', '.join(other)} to it: in one process that batch found the entry an earlier batch made, with its "
            "entries; only append to (or add to) a container made this way, and sort, trim or read it in "
            "on_stage_end"))


def _name_places_bound_apart(result: MergeResult, reports: Sequence[Mapping[str, Any]]) -> None:
    """A container several places held at stage start (``self.every_id = self.ids``)
    has one record, whichever place a batch changed it through. If a batch bound
    another value to one of those places and some rank's batches changed the container
    in place, or read it whole (its reads carry the label of the place watched first),
    what one process did or read through that place after the binding went to the new
    value, not the container: every place that held it is named."""
    changed = {label for report in reports for label in report.get("shared_changed", ())}
    read = {label for report in reports for label in report.get("whole_reads", ())}
    for report in reports:
        for container, places in report.get("shared_rebound", {}).items():
            if container not in changed and top_label(container) not in read:
                continue
            for label in {top_label(place) for place in places}:
                for key in [k for k in result.merged if top_label(k) == label]:
                    del result.merged[key]
                result.conflicts.setdefault(label, (
                    f"it held the same container as {[p for p in places if top_label(p) != label]} at stage start, a "
                    "batch bound another value to one of them, and batches changed or read the container: ddp_eval "
                    "keeps one record per container, whichever place a batch changed it through; bind them apart in "
                    "on_stage_start, or change the container in place only"))


# what C code reads without a method of the value: a number's, a string's or a tuple's
# value, a set's entries (a list's and a dict's C readers iterate them: seen)
_READ_IN_C = (int, float, str, bytes, tuple, set, frozenset)
_ARRAYS = (torch.Tensor, np.ndarray)  # a list's entries a library's C code takes without iterating it

NAME_WHAT_READS_STEER = True  # tests switch it off to show that it matters
SCAN_C_READS = True  # as this one


def _changed(result: MergeResult) -> set:
    """Labels some batch changed (a number only compared is merged, but unchanged)."""
    changed = {top_label(label) for label in (*result.conflicts, *result.assumed)}
    return changed | {top_label(label) for label, (kind, data) in result.merged.items() if _did_change(kind, data)}


def _did_change(kind: Kind, data: Any) -> bool:
    """Whether a merged record changes its value (one of a number only compared does not)."""
    return kind is not Kind.FOLD or any(op != Op.COMPARED for op, _ in data)


def _named_entries_read(result: MergeResult, reports: Sequence[Mapping[str, Any]]) -> set:
    """Top labels of dicts one of whose entries the merge named (set apart by several
    ranks where not watched one by one, ``d[a][b]["n"] += 1``; made anew by several,
    ``d[a][b] = {}``) whose entries batches read other than right after setting them
    (``if d[a][b]["n"] == 1``): a read below the watched levels, or in a container made
    during the stage, is not seen, and each rank's read its own value. A read carries its
    dict's top label (a nested recording copy has it) and its key: it matches a named entry
    it leads to (``d['a']``) or one with its key (``d['n']``, read in a nested copy); past
    a dict's first 64 keys read, a read of any key (``d[*]``) matches each of its entries."""
    named = [label for label in (*result.conflicts, *result.assumed) if label != top_label(label)]
    reads = {label for report in reports for label in report.get("entry_reads", ())}
    return {top_label(read) for read in reads for label in named if top_label(label) == top_label(read) and (
        read.endswith(ENTRY) or label.startswith(read) or label.endswith(read[len(top_label(read)):]))}


def _name_what_a_steering_read_may_have_left_undone(result: MergeResult, reports: Sequence[Mapping[str, Any]],
                                                    changed: set) -> None:
    """A batch whose read gave another answer than one process's (a number whose
    reads do not replay alike; a container or tensor other batches changed, read
    whole; a metric object's field read while None, as only a rank's first batch
    finds it; state outside the Brain that changed, whose reads no probe sees) may
    also have left undone what one process did (``if self.n % 2:
    self.odd.append(i)`` on a rank where ``n`` was even): every value the stage
    watches that is not named yet is named as assumed (merged as recorded)."""
    if not NAME_WHAT_READS_STEER:
        return
    steering = sorted({top_label(label) for label, why in result.assumed.items() if why == COMPARED_OTHERWISE})
    steering += sorted({label for report in reports for label in report.get("whole_reads", ()) if label in changed}
                       - set(steering))
    entries_read = {top_label(label) for report in reports for label in report.get("entry_reads", ())} | {
        label for report in reports for label in report.get("whole_reads", ())}  # d.values(), iteration
    steering += sorted({label for report in reports for label in report.get("c_reads", ())
                        if _changed_at(result, label, changed) and not _only_own_entries(result, label, entries_read)}
                       - set(steering))  # read in C: 100.0 * self.correct
    steering += sorted({label for report in reports for label in report.get("none_reads", ())}
                       - set(steering))  # a metric object's field read while None (a rank's first batch)
    named = {top_label(label) for label in (*result.conflicts, *result.assumed)} | {
        top_label(label) for report in reports for label in report.get("unmergeable", ())}
    steering += sorted({label for report in reports for label in report.get("absent_reads", ()) if label in named}
                       - set(steering))
    steering += sorted({label for report in reports for label in report.get("shape_reads", ())} & _grown(result)
                       - set(steering))
    steering += sorted(_named_entries_read(result, reports) - set(steering))
    steering = [label for label in steering if not (label.endswith(ENTRY) and label[:-len(ENTRY)] in steering)]
    unseen = {label: places for report in reports for label, places in report.get("unseen_holders", {}).items()
              if label in changed}  # a read through a tuple holding it: the stage-start contents, unseen
    outside = sorted({label for report in reports for label in report.get("outside", ())  # a module learning:
                      if not of_a_module(label, report.get("modules", ({},))[0])})  # named apart, as an effect
    held = "".join(f"; batches changed {label!r}, which {places} also held at stage start, where ddp_eval cannot "
                   "put the copy it records through (a tuple): a batch's read there saw the stage-start contents, "
                   "unseen; hold it in a list or on the Brain instead" for label, places in sorted(unseen.items()))
    places = {label: where for report in reports for label, where in report.get("shared_places", {}).items()}
    held += "".join(f"; {label!r} was also held at stage start by {places[label]}, and a read through any of them "
                    "is a read of it" for label in steering if places.get(label))
    if steering:
        why = (f"batches read {steering} when it held, on their rank, another value than one process's, and what a "
               "batch does after such a read (or leaves undone) may differ from one process: merged as each rank's "
               f"batches did it; read accumulated values in on_stage_end, or declare the merge (ddp_eval: merge){held}")
    elif unseen:
        why = ("what a batch computed may differ from one process, since a read may have seen a container's "
               f"stage-start contents: merged as each rank's batches did it; read it in on_stage_end{held}")
    elif outside:  # no read of it is seen: any batch may have read it
        why = (f"state outside the Brain {outside} changed during the stage, so on each rank it held only its own "
               "batches' share, and what a batch computed from it may differ from one process: merged as each "
               f"rank's batches did it; {_remedy(outside[0])}, or list it in attributes_exclude if no batch reads it")
    else:
        return
    named = {*result.conflicts, *result.assumed}  # whole: a value named in part (stats['count']) is named whole too
    for label in sorted({label for report in reports for label in report.get("watched", ())} - named):
        result.assumed[label] = why


def _remedy(outside: str) -> str:
    """How to merge state outside the Brain at label ``outside``."""
    if outside.startswith(("global ", "class ")):  # a module's global, a class attribute
        return "keep it on the Brain instead (self.x, bound in on_stage_start), where ddp_eval merges it"
    return f"merge that state (ddp_eval: attributes_include: [{outside}])"


def _only_own_entries(result: MergeResult, label: str, entries_read: set) -> bool:
    """Whether ``label`` (read in C) is an entry of a dict attribute (``preds[*]``) whose
    entries no batch read (``entries_read``: by key, or whole) other than right after
    setting them (``self.preds[utt] = p``, then ``json.dumps(self.preds[utt])``): each
    such read gave the batch's own value."""
    top = top_label(label)
    merged = result.merged.get(top)
    return label.startswith(top + ENTRY) and merged is not None and merged[0] is Kind.KEYS and top not in entries_read


def _changed_at(result: MergeResult, label: str, changed: set) -> bool:
    """Whether batches changed the value at ``label`` (``n``; ``stats.count``, a field
    of an object an attribute holds; ``per_key[*].count``, of any entry): the
    attribute's merge, walked field by field."""
    if top_label(label) not in changed:
        return False
    held = next((key for key in result.merged if label == key or label.startswith((key + ".", key + ENTRY))), None)
    if held is None:
        return True  # named
    return _changed_below(result.merged[held], parts(label[len(held):]))


def _changed_below(merged: Tuple[Kind, Any], path: Sequence[str]) -> bool:
    kind, data = merged
    if not path:
        return _did_change(kind, data)
    if kind is not Kind.KEYS:
        return True  # bound anew, or an entry of a list: changed
    _, entries, taken = data
    if path[0] == ENTRY:
        return bool(taken) or any(_changed_below(entry, path[1:]) for entry in entries.values())
    if path[0] not in entries:
        return path[0] in taken
    return _changed_below(entries[path[0]], path[1:])


def of_a_module(label: str, modules: Iterable[str]) -> bool:
    """Whether ``label`` is one of ``modules`` (their paths) or a field of one."""
    return any(label == where or label.startswith(where + ".") for where in modules)


def _grown(result: MergeResult) -> set:
    """Labels whose merge concatenates to a tensor or array (``x = torch.cat([x, y])``):
    its length is what batches accumulated."""
    return {top_label(label) for label, (kind, data, *_) in result.merged.items()
            if kind is Kind.FOLD and any(op == Op.CONCAT for op, _ in data)}


def with_journal_notes(report: Mapping[str, Any], notes: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Rank 0's ``report`` with the :meth:`StageBook.notes` of the journal pieces it
    resumes: what the interrupted run's batches did that no merge replays is named
    as if this run's batches had done it.

    Example
    -------
    >>> report = {"unmergeable": {}, "read_then_set": {"n": ["a"]}, "whole_reads": [], "watched": ["a", "n"]}
    >>> piece = {"unmergeable": {"ids": "sorted"}, "read_then_set": {"n": ["b"]}, "whole_reads": ["first"],
    ...          "watched": ["first", "ids"]}
    >>> merged = with_journal_notes(report, [piece])
    >>> merged["unmergeable"]
    {'ids': 'sorted (in a batch of the interrupted run this stage resumes)'}
    >>> merged["read_then_set"], merged["whole_reads"], merged["watched"]
    ({'n': ['a', 'b']}, ['first'], ['a', 'first', 'ids', 'n'])
    """
    merged = dict(report)
    for piece in notes:
        merged["unmergeable"] = {**{label: f"{why} (in a batch of the interrupted run this stage resumes)"
                                    for label, why in piece.get("unmergeable", {}).items()}, **merged["unmergeable"]}
        read_then_set = dict(merged["read_then_set"])
        for label, read in piece.get("read_then_set", {}).items():
            read_then_set[label] = sorted(set(read_then_set.get(label, ())) | set(read))
        merged["read_then_set"] = read_then_set
        for key in ("whole_reads", "c_reads", "absent_reads", "entry_reads", "shape_reads", "shared_changed",
                    "none_reads"):
            merged[key] = sorted(set(merged.get(key, ())) | set(piece.get(key, ())))
        for key in ("shared_rebound", "shared_places"):
            merged[key] = {**piece.get(key, {}), **merged.get(key, {})}
        merged["unseen_holders"] = {**piece.get("unseen_holders", {}), **merged.get("unseen_holders", {})}
        merged["made"] = {label: [*merged.get("made", {}).get(label, ()), *piece.get("made", {}).get(label, ())]
                          for label in {*merged.get("made", {}), *piece.get("made", {})}}
        merged["watched"] = sorted(set(merged["watched"]) | set(piece.get("watched", ())))
    return merged


def last_candidates_of(per_rank: Sequence[Mapping[str, Any]]) -> Dict[str, List]:
    """``{label: [(contribution, global position, error)]}`` of every binding a
    ``LAST`` merge may take: the ranks', then a journal's pieces (rank 0 sent them)."""
    candidates: Dict[str, List] = {}
    for rank, report in enumerate(per_rank):
        for path, (position, error) in report["last"].items():
            candidates.setdefault(path, []).append((rank, position, error))
    for n, piece in enumerate(per_rank[0].get("piece_last", [])):
        for path, position in piece.items():
            candidates.setdefault(path, []).append((len(per_rank) + n, position, None))
    return candidates


def winners_of(per_rank: Sequence[Mapping[str, Any]]) -> Dict[str, int]:
    """``{label: contribution}`` whose binding a ``LAST`` merge takes (the globally
    last, see :func:`ddp_eval.state.attribute_merge.last_writer`); every rank finds the same."""
    return {path: last_writer([(index, position) for index, position, _ in found])
            for path, found in last_candidates_of(per_rank).items()}


def _holders(metric_objects: Mapping[str, Any]) -> set:
    """Brain attributes that hold the metric objects found (merged as metric objects)."""
    return {path.split("[")[0].split(".")[0] for path in metric_objects}


class StageBook:
    """The record of one sharded stage on one rank (see the module's docstring).

    Arguments
    ---------
    brain : object
        The recipe's Brain (its ``_ddp_brain_attributes`` are never watched).
    config : DDPEvalConfig
        Which metric objects and attributes to watch, and the memory budget.
    share : bool
        Whether places outside the Brain hold the recording copies at once; if not,
        from :meth:`share` on (after the stage-start markers of the state outside).
    """

    def __init__(self, brain: Any, config: Any, share: bool = True) -> None:
        self.brain, self.config = brain, config
        self.metrics = MetricRecorder(MetricFinder(config.metrics_include, config.metrics_exclude), brain)
        targets = {n: (brain, n) for n in self.attribute_names(self.metrics.objects)}
        targets.update(self.metrics.fields)  # a metric object's fields that are not flat lists: one engine
        for path in config.attributes_include or ():
            if "." in path and path not in config.attributes_exclude:
                targets[path] = resolve(brain, path)
        for path in config.merge:  # declared: merged by their reduction, not watched per batch
            targets.pop(path, None)
        self.attributes = AttributeTracker(targets, config.attribute_memory_mb)
        for path, reduction in config.merge.items():
            owner, name = resolve(brain, path) if "." in path else (brain, path)
            self.attributes.tracks[path] = DeclaredSlot(path, owner, name, self.attributes.budget, reduction)
        self.lazy = LazyMetricFields(self.metrics, self.attributes, brain)
        self.holders, self._names_at_start = MetricHolders(), set(vars(brain))
        self._holders_seen = _holders(self.metrics.objects)  # each holder looked at once, when it first is one
        self.holders.adopt(brain, self._holder_names(self.metrics.objects), self.metric_object_ids())
        self.shared: Optional[SharedCopies] = None
        if share:
            self.share()
        self._names_of: Tuple[Any, Any] = (None, None)  # (the Brain's attribute names, holders) last looked at

    def share(self) -> None:
        """The places outside the Brain that hold a watched container (``hparams``' fields,
        closures, globals) hold its recording copy from now on, for the stage."""
        self.shared = SharedCopies(self.brain, self.attributes.notes, self._holder_names(self.metrics.objects))

    def metric_object_ids(self) -> Set[int]:
        """Ids of the metric objects found and those they hold: merged as such (one
        ``hparams`` holds is not state outside the Brain)."""
        return {id(obj) for _, obj in all_flat(self.metrics.objects)}

    def _holder_names(self, metric_objects: Mapping[str, Any]) -> set:
        """The recipe's attributes holding ``metric_objects`` (whose other state :class:`MetricHolders` follows)."""
        return _holders(metric_objects) & recipe_names(self.brain) - set(self.config.attributes_exclude)

    def _holders_at_start(self, names: Iterable[str]) -> Dict[str, Any]:
        """For :meth:`MetricHolders.adopt`: what new holders held at stage start besides
        metric objects (the original of a watched one; None: bound by a batch)."""
        starts, found = {}, self.metric_object_ids() if names else set()
        for name in names:
            slot = self.attributes.tracks.get(name)
            if slot is not None:
                starts[name] = MetricHolders.rest_at_start(slot.original if slot.original is not None else slot.start,
                                                           found)
            elif name not in self._names_at_start:
                starts[name] = None
        return starts

    def attribute_names(self, metric_objects: Mapping[str, Any]) -> List[str]:
        """Plain attributes of the recipe's Brain that may be merged (not those
        holding the ``metric_objects`` found, nor what ``sb.Brain`` set up)."""
        cfg = self.config
        names = recipe_names(self.brain) - _holders(metric_objects) - set(cfg.attributes_exclude) - set(cfg.merge)
        plain = [n for n in cfg.attributes_include or () if "." not in n]
        if plain:  # names without a dot restrict the Brain's attributes; paths only add
            names &= set(plain)
        return sorted(names)

    def start(self) -> None:
        """Right before each batch: numbers and tensors get their probes."""
        self.lazy.before_batch()
        self.attributes.before_batch()

    def after_batch(self) -> None:
        """Notes what the batch just evaluated did, and prepares the next."""
        self.observe()
        self.start()

    def observe(self) -> None:
        """Notes what the batch just evaluated did (the values are plain until the
        next :meth:`start`-like preparation, ``attributes.before_batch()``)."""
        self.attributes.stop_listening()  # what follows reads the containers too
        objects = self.metrics.after_batch(self.brain)
        holders, tracks = _holders(objects), self.attributes.tracks
        new_holders = holders - self._holders_seen
        if new_holders:  # rare: an attribute that came to hold a metric object
            self._holders_seen |= new_holders
            new_holders = self._holder_names(objects) & new_holders
        starts = self._holders_at_start(new_holders)  # before drop() puts the originals back
        dropped = [h for h in holders if h in tracks]
        self.lazy.wrap(objects, {h: tracks[h].watch.factory for h in dropped if getattr(tracks[h].watch, "factory",
                                                                                        None) is not None})
        self.lazy.observe(self.metrics.batches - 1, objects)  # metric objects first seen: fields watched
        self.lazy.listen_nested(objects)
        self.attributes.drop(dropped)
        self.lazy.wrap(objects)  # their factories, which drop() took out, back for the stage
        if new_holders:
            self.holders.adopt(self.brain, new_holders, self.metric_object_ids(), starts)
        names, seen = vars(self.brain).keys(), self._names_of
        if names != seen[0] or holders != seen[1]:  # an attribute bound where there was none, or a new holder
            self.attributes.add({n: (self.brain, n) for n in self.attribute_names(objects)})
            self._names_of = (set(names), holders)
        self.attributes.after_batch()

    def collect(self, positions: Sequence[int]) -> Collected:
        """At stage end (probes out): this rank's record, its batches at the global
        ``positions``; what the record does not explain is named in ``unmergeable``."""
        self.attributes.stop_listening()  # no batch runs: the reads and writes from here on are ddp_eval's
        self.shared.restore_elsewhere()  # a function whose closure holds a watched container holds it again
        metric_state = self.metrics.finish(self.brain, positions)
        changes, _ = self.attributes.finish(positions)
        bound, last = {}, {}
        objects = self.attributes.bound_objects()
        for path, position in last_candidates(changes).items():
            try:
                bound[path] = pickle.dumps(objects[path])
                last[path] = (position, None)
            except Exception as exc:  # named only if this rank's object is the one to send
                last[path] = (position, f"{type(exc).__name__}: {exc}")
        changed = {**self.attributes.changed_batches(), **self.metrics.changed_batches}
        report = {"layout": describe(self.metrics, self.brain, positions), "last": last, "changed": changed,
                  "batches": self.metrics.batches, **self.notes()}
        none_reads = self.lazy.none_reads_that_steer(positions)  # what the batch did after it may differ too
        report["unmergeable"].update(none_reads)
        report["none_reads"] = sorted(none_reads)
        return Collected(report, (metric_state, changes), bound)

    def notes(self) -> Dict[str, Any]:
        """What this rank's report says of its batches so far that no merge replays:
        values named (``unmergeable``), values set after a read (``read_then_set``),
        values read whole (``whole_reads``), and every value ``watched``. A journal
        piece carries them, so that a resumed stage names what the interrupted
        run's batches did (:func:`with_journal_notes`)."""
        self.shared.note_rebound()
        unmergeable = {**self.attributes.unmergeable(), **self.metrics.unexplained(),
                       **self.holders.changed(self.brain, self.metric_object_ids()),
                       **self.lazy.rebound(self.metrics.objects), **self.lazy.changed_keys(self.metrics.objects),
                       **self.lazy.nested_changes()}
        return {"unmergeable": unmergeable,
                "read_then_set": {label: sorted(read) for label, read in self.attributes.read_then_set.items()},
                "whole_reads": sorted(self.attributes.whole_reads), "c_reads": sorted(self._read_in_c()),
                "absent_reads": sorted(top_label(label) for label in self.attributes.absent_reads),
                "entry_reads": sorted(f"{label}{ENTRY}" if keys is None else f"{label}[{key!r}]"
                                      for label, keys in self.attributes.entry_reads.items() for key in keys or [None]),
                "shape_reads": sorted(self.attributes.shape_reads),
                "shared_rebound": dict(self.attributes.notes.rebound_places), "shared_changed": self.shared.touched(),
                "shared_places": self.shared.places(),
                "unseen_holders": self.shared.unseen,
                "made": {label: list(did) for label, did in self.attributes.notes.made.items()},
                "watched": sorted({top_label(label) for label in self.attributes.tracks} | _holders(
                    self.metrics.objects))}

    def _read_in_c(self) -> set:
        """The Brain's numbers, strings, tuples and sets its batch code reads where no
        probe or recording copy sees (:mod:`ddp_eval.state._c_reads`: ``100.0 *
        self.correct``, ``json.dumps(self.text)``, ``frozenset(self.seen)``), once a
        batch ran."""
        if not self.metrics.batches or not SCAN_C_READS:
            return set()
        tracks = self.attributes.tracks
        copies = {id(original): copy for original, copy, _ in self.attributes.notes.copies.values()}
        return {label for label in read_in_c_of(self.brain, copies) if of_a_module(label.split(ENTRY)[0], tracks)
                and any(isinstance(value, _READ_IN_C) or (label.endswith(ENTRY) and isinstance(value, _ARRAYS))
                        for value in values_at(self.brain, parts(label)))}  # torch.stack(self.losses): losses[*]

    def finish_alone(self, positions: Sequence[int]) -> None:
        """One process that evaluated every batch: probes out, nothing to merge."""
        self.metrics.finish(self.brain, positions)
        self.attributes.finish(positions)
        self.lazy.release()
        self.restore()

    def apply(self, merged: StageMerge, layouts: Sequence[Mapping[str, Any]], winners: Mapping[str, int],
              won: Sequence[Mapping[str, bytes]], rank: Optional[int] = None, stage: str = "") -> None:
        """Writes ``merged`` into this rank's metric objects and attributes: the
        metric objects every rank holds (``layouts``) made here if missing, a
        ``LAST`` merge's value taken from ``won[winners[label]]`` (pickled), or
        kept where this ``rank`` won."""
        self.lazy.release()  # the original factories make what this rank lacks
        objects = complete(self.brain, self.metrics, layouts, stage)
        make_missing_per_key(objects, merged.metrics)
        self.lazy.locate_all(objects)  # fields of metric objects made just now, where merged fields go
        apply_merged(objects, self.metrics.start, merged.metrics)

        def last_value(label: str) -> Any:
            winner = winners.get(label)
            return ELSEWHERE if winner == rank else pickle.loads(won[winner][label])

        try:
            self.attributes.apply(merged.attributes.merged, self.locate, last_value)
        finally:
            self.restore()

    def locate(self, label: str) -> Tuple[Any, Any]:
        """``(owner, name)`` of a watched label."""
        if label in self.metrics.fields:
            return self.metrics.fields[label]
        return resolve(self.brain, label) if "." in label else (self.brain, label)

    def release(self) -> None:
        """The stage ended by an exception: plain numbers, factories and containers back."""
        self.attributes.release()
        self.lazy.release()
        self.restore()

    def restore(self) -> None:
        """The containers held at stage start back in place of their recording copies,
        for the attributes and for every other reference to them."""
        try:
            self.attributes.restore()
        finally:
            if self.shared is not None:  # None: the stage failed before its places outside held the copies
                self.shared.restore()


def simulate(positions_per_rank: Sequence[Sequence[int]], make, batch, config) -> Tuple[List[Any], List[Collected],
                                                                                      StageMerge]:
    """Runs one stage for simulated ranks in this process, with the stage's own
    record, merge and apply (no collectives: what they exchange is passed by
    hand, pickled as it travels): ``make()`` builds a rank's Brain,
    ``batch(brain, b)`` runs global batch ``b``. Returns ``(brains after the
    merge, records, merge)``; used by tests and benchmarks.
    """
    brains = [make() for _ in positions_per_rank]
    books = [StageBook(brain, config) for brain in brains]
    records = []
    for brain, book, positions in zip(brains, books, positions_per_rank):
        book.start()
        for b in positions:
            batch(brain, b)
            book.after_batch()
        records.append(pickle.loads(pickle.dumps(book.collect(list(positions)))))
    merged = merge_stage([r.state for r in records], [r.report for r in records])
    winners = winners_of([r.report for r in records])
    won = [{label: blob for label, blob in r.bound.items() if winners.get(label) == rank}
           for rank, r in enumerate(records)]
    for rank, book in enumerate(books):
        book.apply(merged, [r.report["layout"] for r in records], winners, won, rank)
    return brains, records, merged

