"""Merging plain Brain attributes that grow during a sharded stage, exactly.

Recipes accumulate on the Brain itself (``self.acc_metric.append(acc)``,
``self.outcome[utt_id] = ...``, ``self.n_correct += ...``). Like metric
objects, such attributes are snapshotted at stage start and after every
batch; at stage end each rank sends what every batch changed, tagged with the
batch's global position, and :func:`merge_attribute_states` (a pure function)
rebuilds what one process would hold:

=============  ==============================================================
kind           how it is merged
=============  ==============================================================
``append``     list that only grew: new entries in global batch order
``keys``       dict that only gained keys: new keys in global batch order; a
               key added on two ranks is an error naming it
``sum``        int: the increments, summed (exact)
``accumulate`` float or tensor of a fixed shape: the per-batch increments added
               to the start value in global batch order (equal to one process
               up to floating-point rounding, see the README)
=============  ==============================================================

Anything else that changed (a list or dict replaced by a new object, a bool, a
string, a tensor that changed shape, another object replaced) cannot be merged
and is reported by name.

Example
-------
>>> r0 = {"acc": ("append", ([0, 2], [1, 1], [0.5, 0.7]))}
>>> r1 = {"acc": ("append", ([1], [1], [0.9]))}
>>> merge_attribute_states([r0, r1])["acc"]
('append', [0.5, 0.9, 0.7])
"""

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ddp_eval.errors import ConfigError

MERGEABLE_KINDS = ("append", "keys", "sum", "accumulate")
_ABSENT = ("absent",)

# name -> (identity, marker): list/dict length, number, tensor copy; absent names are missing
AttributeSnapshot = Dict[str, Tuple[int, Any]]


def _marker(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        return len(value)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def snapshot_attributes(owner: Any, names: Sequence[str]) -> AttributeSnapshot:
    """Records identity and size or value of each attribute of ``owner`` in ``names``."""
    values = vars(owner)
    return {name: (id(values[name]), _marker(values[name])) for name in names if name in values}


def classify(start: Any, snapshots: Sequence[Tuple[int, Any]], end: Any) -> Optional[str]:
    """Kind of an attribute over a stage, None if unchanged, or ``"unmergeable: why"``.

    Arguments
    ---------
    start : object
        The value at stage start (``_ABSENT`` if it did not exist).
    snapshots : list
        ``(identity, marker)`` at stage start and after every batch.
    end : object
        The value now (``_ABSENT`` if it does not exist).
    """
    present = [s for s in snapshots if s[1] is not _ABSENT]
    if end is _ABSENT:
        return "unmergeable: deleted during the stage" if present else None
    ids = {s[0] for s in present} | {id(end)}
    if isinstance(end, (list, dict)):
        kind = "append" if isinstance(end, list) else "keys"
        if len(ids) > 1:
            return f"unmergeable: a new {type(end).__name__} was assigned during the stage"
        sizes = [s[1] for s in present] + [len(end)]
        if any(b < a for a, b in zip(sizes, sizes[1:])):
            return f"unmergeable: entries were removed from the {type(end).__name__}"
        return kind if sizes[-1] != (sizes[0] if start is not _ABSENT else 0) else None
    if isinstance(end, bool) or not isinstance(end, (int, float, torch.Tensor)):
        if start is not _ABSENT and len(ids) == 1:
            return None
        return f"unmergeable: a {type(end).__name__} changed during the stage"
    if isinstance(end, torch.Tensor):
        markers = [s[1] for s in present] + [end]
        if any(not isinstance(m, torch.Tensor) or m.shape != end.shape or m.dtype != end.dtype
               for m in markers):
            return "unmergeable: a tensor that changed shape or dtype during the stage"
        changed = start is _ABSENT or not torch.equal(markers[0], end)
        return "accumulate" if changed else None
    if any(not isinstance(s[1], (int, float)) for s in present):
        return f"unmergeable: a {type(end).__name__} that was not a number during the stage"
    if start is not _ABSENT and start == end:
        return None
    return "sum" if isinstance(end, int) and all(isinstance(s[1], int) for s in present) else "accumulate"


def _increment(before: Any, after: Any) -> Any:
    if after is _ABSENT:
        return 0
    return after if before is _ABSENT else after - before


def local_attribute_state(
    owner: Any,
    kinds: Mapping[str, str],
    snapshots: Sequence[AttributeSnapshot],
    global_batch_ids: Sequence[int],
) -> Dict[str, Tuple[str, Any]]:
    """What each batch changed in the attributes named in ``kinds``, on this rank.

    Returns ``{name: (kind, (positions, sizes, items))}`` for ``append`` and
    ``keys`` (``items`` of a dict are ``(key, value)`` pairs) and
    ``{name: (kind, (positions, increments))}`` for ``sum`` and
    ``accumulate``; position ``inf`` is after the last batch.
    """
    end = snapshot_attributes(owner, list(kinds))
    snapshots = list(snapshots)
    positions = list(global_batch_ids[: len(snapshots) - 1]) + [math.inf]
    state = {}
    for name, kind in sorted(kinds.items()):
        marks = [s.get(name, (0, _ABSENT))[1] for s in snapshots + [end]]
        value = vars(owner).get(name)
        if kind in ("append", "keys"):
            bounds = [0 if m is _ABSENT else m for m in marks]
            items = list(value.items()) if kind == "keys" else list(value)
            sizes = [b - a for a, b in zip(bounds, bounds[1:])]
            state[name] = (kind, (positions, sizes, items[bounds[0]:]))
        else:
            increments = [_increment(a, b) for a, b in zip(marks, marks[1:])]
            state[name] = (kind, (positions, increments))
    return state


def merge_attribute_states(rank_states: Sequence[Mapping[str, Tuple[str, Any]]]) -> Dict[str, Tuple[str, Any]]:
    """Merges per-rank :func:`local_attribute_state` results (pure function).

    Returns ``{name: ("append", new entries) | ("keys", new (key, value) pairs)
    | ("sum", total) | ("accumulate", increments in global order)}``.

    Example
    -------
    >>> r0 = {"n": ("sum", ([0, math.inf], [3, 0]))}
    >>> r1 = {"n": ("sum", ([1, math.inf], [2, 0]))}
    >>> merge_attribute_states([r0, r1])["n"]
    ('sum', 5)
    """
    kinds: Dict[str, str] = {}
    pieces: Dict[str, List[Tuple[float, int, Any]]] = {}
    for rank, state in enumerate(rank_states):
        for name, (kind, data) in state.items():
            if kinds.setdefault(name, kind) != kind:
                raise ConfigError(
                    f"ddp_eval: Brain attribute '{name}' changed as '{kinds[name]}' on one "
                    f"rank and as '{kind}' on rank {rank}; expected the same kind of change "
                    "on every rank. List it in ddp_eval: attributes_exclude."
                )
            bucket = pieces.setdefault(name, [])
            if kind in ("append", "keys"):
                positions, sizes, items = data
                offset = 0
                for position, size in zip(positions, sizes):
                    bucket.append((position, rank, items[offset: offset + size]))
                    offset += size
            else:
                bucket.extend((p, rank, [inc]) for p, inc in zip(*data))
    merged: Dict[str, Tuple[str, Any]] = {}
    for name in sorted(kinds):
        ordered = [x for _, _, chunk in sorted(pieces[name], key=lambda p: p[:2]) for x in chunk]
        kind = kinds[name]
        if kind == "keys":
            seen = {}
            for key, _ in ordered:
                if key in seen:
                    raise ConfigError(
                        f"ddp_eval: key {key!r} was added to Brain attribute '{name}' by "
                        "more than one batch (on different ranks or twice), so the dict "
                        "cannot be merged; expected each key once (e.g. one per utterance "
                        "id). Accumulate counts in a list or a counter instead, or list "
                        f"'{name}' in ddp_eval: attributes_exclude."
                    )
                seen[key] = True
        elif kind == "sum":
            ordered = sum(ordered)
        merged[name] = (kind, ordered)
    return merged


def apply_attributes(owner: Any, start: AttributeSnapshot, merged: Mapping[str, Tuple[str, Any]]) -> None:
    """Writes merged attributes into ``owner``, keeping what it held at stage start."""
    values = vars(owner)
    for name, (kind, data) in merged.items():
        had = start.get(name, (0, _ABSENT))[1]
        if kind == "append":
            target = values.setdefault(name, [])
            del target[0 if had is _ABSENT else had:]
            target.extend(data)
        elif kind == "keys":
            target = values.setdefault(name, {})
            for key in list(target)[0 if had is _ABSENT else had:]:
                del target[key]
            target.update(data)
        elif kind == "sum":
            setattr(owner, name, (0 if had is _ABSENT else had) + data)
        else:
            value = None if had is _ABSENT else had
            for increment in data:
                value = increment if value is None else value + increment
            if isinstance(value, torch.Tensor) and isinstance(values.get(name), torch.Tensor):
                value = value.to(values[name].device)
            setattr(owner, name, value)


def attribute_kinds(
    owner: Any, names: Sequence[str], snapshots: Sequence[AttributeSnapshot]
) -> Tuple[Dict[str, str], Dict[str, str]]:
    """``({name: kind}, {name: why it cannot be merged})`` of the attributes that
    changed since the first snapshot (``names``: the candidates present now)."""
    kinds, unmergeable = {}, {}
    values = vars(owner)
    for name in sorted(set(names).union(*snapshots)):
        track = [s.get(name, (0, _ABSENT)) for s in snapshots]
        kind = classify(track[0][1], track, values.get(name, _ABSENT))
        if kind is not None and kind.startswith("unmergeable: "):
            unmergeable[name] = kind[len("unmergeable: "):]
        elif kind is not None:
            kinds[name] = kind
    return kinds, unmergeable
