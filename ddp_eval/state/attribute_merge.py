"""Merging every rank's changes of plain attributes into what one process would
hold (pure functions, the same result on every rank).

Each rank, and each journal piece a resumed stage brings, contributes one
:class:`~ddp_eval.state._values.Change` per attribute it changed
(:meth:`ddp_eval.state._attributes.AttributeTracker.finish`). Contributions are
indexed ``0 .. N-1`` for the ranks, then the pieces; at equal global positions
the lower index comes first.

* ``LAST``: the contribution whose binding has the highest global position
  wins (its value: the object, or :data:`~ddp_eval.state._values.ELSEWHERE` while on its
  rank); a rank's object created once and changed no more counts as a binding.
* ``FOLD``: every ``+``, ``-`` and ``=`` in global batch order; a value created
  where there was none (``~``), or a dict entry's first change seen before it had
  a probe (``?``), is an addend if anything is added to the attribute, else an
  assignment.
* ``UNION``: the elements every contribution added to a set;
* ``REDUCE``: a reduction the recipe declared (``ddp_eval: merge``) of every
  contribution's value;
* ``APPEND``: entries in global batch order; ``KEYS``: new keys in the order of
  their first addition, entries merged one by one; ``SUM``: increments summed;
  ``ACCUMULATE``: increments in global batch order (per-rank totals, over the
  memory budget, in rank order).

What one process could not hold is not merged: it is returned in ``conflicts``
by label, with the reason, and every rank keeps its own value. Where the ranks'
changes cannot tell ``=`` from ``+=`` (a value that did not exist, created by
one batch on each of several ranks and changed no more), the last batch's value
is taken, as for ``=``, and the label is returned in ``assumed``.

Example
-------
>>> from ddp_eval.state._values import Change, Kind, Op
>>> rank0 = {"n": Change(Kind.FOLD, [(0, "+", 2), (2, "+", 1)]), "last": Change(Kind.LAST, None, 2, "b0")}
>>> rank1 = {"n": Change(Kind.FOLD, [(1, "=", 10)]), "last": Change(Kind.LAST, None, 1, "b1")}
>>> result = merge_attribute_states([rank0, rank1])
>>> result.merged["n"], result.merged["last"], result.conflicts
((<Kind.FOLD: 'fold'>, [('+', 2), ('=', 10), ('+', 1)]), (<Kind.LAST: 'last'>, 'b0'), {})
"""

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ddp_eval.state._declared import REDUCTIONS, reduce_values
from ddp_eval.state._numbers import compared_alike
from ddp_eval.state._order import in_global_order
from ddp_eval.state._probes import UNSET, replay
from ddp_eval.state._values import OVER_NONE_ONCE, Change, Kind, Op

Merged = Tuple[Kind, Any]
__all__ = ["REDUCTIONS", "MergeResult", "merge_attribute_states", "merge_changes", "last_writer", "last_candidates"]


class MergeResult(NamedTuple):
    merged: Dict[str, Merged]
    conflicts: Dict[str, str]  # label -> why it was not merged
    assumed: Dict[str, str]  # label -> what was assumed to merge it


def merge_attribute_states(contributions: Sequence[Mapping[str, Change]]) -> MergeResult:
    """The merge of every label any contribution changed."""
    result = MergeResult({}, {}, {})
    for label in sorted(set().union(*contributions)):
        merged = merge_changes(label, [c.get(label) for c in contributions], result)
        if merged is not None:
            result.merged[label] = merged
    return result


def last_writer(candidates: Sequence[Tuple[int, float]]) -> int:
    """The index of the winning binding among ``(index, global position)``."""
    return max(candidates, key=lambda c: (c[1], c[0]))[0]


def last_candidates(changes: Mapping[str, Change]) -> Dict[str, float]:
    """``{label: global position}`` of every change, dict entries included, that
    a ``LAST`` merge may choose (see :func:`last_writer`)."""
    found, stack = {}, list(changes.items())
    while stack:
        label, change = stack.pop()
        if change.last is not None:
            found[label] = change.last
        if change.kind in (Kind.KEYS, Kind.ITEMS):
            stack.extend((f"{label}[{key!r}]", entry) for key, entry in change.data["entries"].items())
    return found


def merge_changes(label: str, changes: Sequence[Optional[Change]], result: "MergeResult") -> Optional[Merged]:
    """One label's merge, or None (unchanged, or a conflict noted in ``result``)."""
    present = [(i, c) for i, c in enumerate(changes) if c is not None]
    if not present:
        return None
    kinds = sorted({c.kind.value for _, c in present})
    if Kind.LAST.value in kinds or (len(present) > 1 and all(c.last is not None for _, c in present)):
        return _merge_last(label, present, result)
    if len(kinds) > 1:
        by_kind = {c.kind.value: i for i, c in present}
        result.conflicts[label] = "changed as " + " and as ".join(f"{k} (by contribution {by_kind[k]})"
                                                                  for k in kinds)
        return None
    kind = present[0][1].kind
    data = _MERGERS[kind](label, [c.data for _, c in present], result)
    return None if data is None else (kind, data)


_CREATED_ONCE = ("it did not exist (or held None) before the stage, and each of several ranks created it in one "
                 "batch and "
                 "changed it no more, so ddp_eval cannot tell whether every batch sets it (=) or the first creates "
                 "it and later ones add to it: it took the last batch's value, as for =; if batches add to it, "
                 "create it in on_stage_start (or use a collections.defaultdict or Counter)")


_REBUILT_ONCE = ("each of several ranks bound it once, over the empty list or tuple it held, and no rank saw a "
                 "second batch, so ddp_eval cannot tell whether every batch sets it (x = [...]) or extends it "
                 "(x = x + [...]): it took the last batch's value, as for =; if batches extend it, append in place "
                 "(x.append, x.extend)")


_UNPROBED = ("it is an entry of a dict that gained many keys in the stage, and no batch changed it while it had "
             "a probe, so ddp_eval cannot tell whether batches set it (=) or add to it (+=): it took the last "
             "batch's value, as for =; create such entries in on_stage_start, or keep them in a dict of their own")


def _merge_last(label: str, present: List[Tuple[int, Change]], result: "MergeResult") -> Optional[Merged]:
    in_place = [i for i, c in present if c.last is None]
    if in_place:
        bound = [i for i, c in present if c.kind is Kind.LAST]
        result.conflicts[label] = (f"batches bound new objects to it (contribution {bound[0]}) and changed it in "
                                   f"place (contribution {in_place[0]}); ddp_eval cannot tell which one process "
                                   "would have")
        return None
    if all(c.kind is not Kind.LAST for _, c in present) or (
            len(present) > 1 and all(c.data == OVER_NONE_ONCE for _, c in present)):
        result.assumed[label] = _CREATED_ONCE
    winner = last_writer([(i, c.last) for i, c in present])
    return Kind.LAST, dict(present)[winner].value


def _one_each(positions: Sequence[float], items: Sequence[Any]):
    """Chunks of :func:`in_global_order` of one item per position."""
    return positions, [1] * len(items), items


def _merge_fold(label: str, per_contribution: Sequence[list], result: "MergeResult") -> Optional[list]:
    events = in_global_order([_one_each([p for p, _, _ in events], [(op, x) for _, op, x in events])
                              for events in per_contribution])
    adds = any(op in (Op.ADD, Op.SUBTRACT, Op.CONCAT) for op, _ in events)
    if not adds and sum([op for _, op, _ in events] in ([Op.CREATED], [Op.OVER_NONE], [Op.UNPROBED])
                        for events in per_contribution) > 1:
        result.assumed[label] = _CREATED_ONCE
    elif not adds and sum([op for _, op, _ in events] == [Op.CONCAT_OR_SET] for events in per_contribution) > 1 \
            and not any(op == Op.SET for op, _ in events):
        result.assumed[label] = _REBUILT_ONCE
    elif not adds and not any(op == Op.SET for op, _ in events) and any(op == Op.UNPROBED for op, _ in events):
        result.assumed[label] = _UNPROBED
    decided = [_decided(op, x, adds) for op, x in events]
    if any(op == Op.COMPARED for op, _ in decided) and not _compared_alike(decided):
        result.assumed[label] = COMPARED_OTHERWISE
    return decided


COMPARED_OTHERWISE = ("a batch compared it (if x < k, min, max) when it held another value than one process's at "
                       "that batch (on a rank only its own batches had changed it), and the comparison gives another "
                       "answer on one process's value, so what that batch did may differ: the merge replays what "
                       "each batch did on its rank; declare the merge (ddp_eval: merge) or compare in on_stage_end "
                       "(an int a batch made a float, as in min(n, 0.5) or 0.5 + n, was read in C where ddp_eval "
                       "cannot see it: start it as a float, 0.0)")


def _compared_alike(decided: Sequence[Tuple[Op, Any]]) -> bool:
    """Replays ``decided`` in global order from the stage's start value; at each
    batch that compared the value, the comparisons must give the same answers on
    the replayed value (one process's) as on the rank's own."""
    start = next(x[2] for op, x in decided if op == Op.COMPARED)
    value = start
    for op, x in decided:
        if op == Op.COMPARED:
            local, comparisons, _ = x
            if value is UNSET or not (value == local or compared_alike(comparisons, value)):
                return False
        else:
            value = replay(value, [(op, x)])
    return True


def _decided(op: Op, x: Any, adds: bool) -> Tuple[Op, Any]:
    """``CREATED``, ``OVER_NONE`` and ``UNPROBED`` (a dict entry's first change,
    ``(before, after)``): addends if the label is added to anywhere, else assignments;
    ``CONCAT_OR_SET`` likewise concatenation or assignment."""
    if op in (Op.CREATED, Op.OVER_NONE):  # created where there was none, or bound over None
        return (Op.ADD if adds else Op.SET), x
    if op == Op.CONCAT_OR_SET:  # a list rebuilt over an empty one: grown, or set anew
        return (Op.CONCAT if adds else Op.SET), x
    if op == Op.UNPROBED:
        before, after = x
        return (Op.ADD, after - before) if adds else (Op.SET, after)
    return op, x


def _merge_append(label: str, per_contribution: Sequence[Any], result: "MergeResult") -> list:
    return in_global_order(per_contribution)


def _merge_entries(label: str, per_contribution: Sequence[dict], result: "MergeResult") -> Dict[Any, Merged]:
    """Each watched entry of a dict or list merged by its own rule."""
    entry_changes: Dict[Any, Dict[int, Change]] = {}
    for index, data in enumerate(per_contribution):
        for key, change in data["entries"].items():
            entry_changes.setdefault(key, {})[index] = change
    entries = {}
    for key, by_index in entry_changes.items():
        merged = merge_changes(f"{label}[{key!r}]", [by_index.get(i) for i in range(len(per_contribution))],
                               result)
        if merged is not None:
            entries[key] = merged
    return entries


def _merge_items(label: str, per_contribution: Sequence[dict], result: "MergeResult") -> Any:
    """A list whose entries at stage start are watched: new entries in global
    order, and each start entry merged by its own rule."""
    added = in_global_order([data["added"] or ((), (), ()) for data in per_contribution])
    return added, _merge_entries(label, per_contribution, result)


def _merge_keys(label: str, per_contribution: Sequence[dict], result: "MergeResult") -> Any:
    first: Dict[Any, Tuple[float, int, int]] = {}  # key -> (position, contribution, place in its batch)
    for index, data in enumerate(per_contribution):
        positions, sizes, keys = data["added"]
        offset = 0
        for position, size in zip(positions, sizes):
            for n, key in enumerate(keys[offset: offset + size]):
                first[key] = min(first.get(key, (position, index, n)), (position, index, n))
            offset += size
    order = sorted(first, key=first.get)
    entries = _merge_entries(label, per_contribution, result)
    entry_changes = {key for data in per_contribution for key in data["entries"]}
    taken: Dict[Any, Any] = {}
    setters: Dict[Any, int] = {}
    made_empty = {}  # a key's container made and left empty (d.setdefault(k, set())): where nothing else sets it
    for index, data in enumerate(per_contribution):
        for key, value in list(data["taken"].items()) + list(data["replaced"].items()):
            if key in data["taken"] and type(value) in (list, dict, set) and not value:
                made_empty.setdefault(key, value)
                continue
            if key in setters or key in entry_changes:
                result.conflicts[f"{label}[{key!r}]"] = (
                    f"set by batches of contributions {setters.get(key, 0)} and {index}, at a key ddp_eval does "
                    "not watch one by one (past a dict's first 64, or three levels below the attribute, "
                    "self.x[a][b][c] or self.x.d[a][b]), of which it keeps one value; expected each such key set "
                    "once per stage (one per utterance id): keep counters in a dict of at most 64 keys, at most two "
                    "levels down (self.x[a][b] += 1), or compute them in on_stage_end")
                continue
            setters[key], taken[key] = index, value
    for key, value in made_empty.items():
        if key not in taken and key not in entry_changes:
            taken[key] = value
    return order, entries, taken


def _merge_sum(label: str, per_contribution: Sequence[Any], result: "MergeResult") -> Any:
    total = None
    for value in per_contribution:
        total = value if total is None else total + value
    return total


def _merge_accumulate(label: str, per_contribution: Sequence[Any], result: "MergeResult") -> list:
    if all(data[0] == "batches" for data in per_contribution):
        return in_global_order([_one_each(positions, list(incs)) for _, positions, incs in per_contribution])
    totals = []
    for data in per_contribution:  # some rank went over budget: one total per rank, in rank order
        if data[0] == "total":
            totals.append(data[1])
        elif len(data[2]):
            totals.append(_merge_sum(label, list(data[2]), result))
    return totals


def _merge_union(label: str, per_contribution: Sequence[Any], result: "MergeResult") -> Any:
    """Elements sets gained: their union (a set has no order to keep)."""
    return set().union(*per_contribution)


def _merge_reduce(label: str, per_contribution: Sequence[Any], result: "MergeResult") -> Any:
    """A declared reduction (``ddp_eval: merge``) of every contribution's value."""
    return reduce_values(per_contribution)


_MERGERS = {Kind.UNION: _merge_union,
            Kind.REDUCE: _merge_reduce,
            Kind.FOLD: _merge_fold, Kind.APPEND: _merge_append, Kind.KEYS: _merge_keys, Kind.ITEMS: _merge_items,
            Kind.SUM: _merge_sum,
            Kind.ACCUMULATE: _merge_accumulate}
