"""Which metric objects each rank holds at stage end, and making them the same.

Every rank describes its metric objects (:func:`describe`): class, and for
one created during the stage the global position of the batch that created
it and how a rank without it can make one (the ``defaultdict``'s factory, or
the class itself when a fresh object is configured the same). After the
stage-end exchange, :func:`complete` checks the ranks agree on what existed
at stage start, makes the objects this rank lacks and puts the keys of their
containers in the order one process created them; :func:`apply_merged` then
writes the merged state into every object.

Example
-------
>>> import collections, types
>>> from speechbrain.utils.metric_stats import ErrorRateStats
>>> from ddp_eval.state.metrics import MetricFinder, MetricRecorder
>>> idle = types.SimpleNamespace(wer=collections.defaultdict(ErrorRateStats))
>>> busy = types.SimpleNamespace(wer=collections.defaultdict(ErrorRateStats))
>>> recorders = [MetricRecorder(MetricFinder(), h) for h in (idle, busy)]
>>> busy.wer["1best"].append(["u1"], [["a"]], [["a"]])
>>> _ = recorders[1].after_batch(busy)
>>> layouts = [describe(r, h, positions=[4]) for r, h in zip(recorders, (idle, busy))]
>>> objects = complete(idle, recorders[0], layouts, "TEST")
>>> list(objects), type(idle.wer["1best"]).__name__
(['wer[1best]'], 'ErrorRateStats')
"""

import collections
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from ddp_eval.errors import ConfigError
from ddp_eval.state._values import is_number
from ddp_eval.state.metrics import METRIC_TYPES


class Entry(NamedTuple):
    """One metric object as a rank describes it."""

    cls: str  # class name, compared across ranks
    created: Optional[float] = None  # global position of the batch that created it (None: at stage start)
    attribute: Optional[str] = None  # where it lives: the Brain attribute ...
    key: Any = None  # ... and the key in that container (None: the attribute itself)
    maker: Optional[type] = None  # a class whose fresh object matches it, if no factory makes it
    factory: bool = False  # its container is a defaultdict whose factory makes it
    index: int = 0  # its key's place in its container on the rank that describes it


def describe(recorder: Any, owner: Any, positions: Sequence[int]) -> Dict[str, Entry]:
    """This rank's metric objects (top level), for the stage-end exchange."""
    places = list(positions[: recorder.batches]) + [float("inf")]
    layout = {}
    for path, obj in recorder.objects.items():
        batch = recorder.first_seen.get(path)
        if batch is None:
            layout[path] = Entry(type(obj).__name__)
            continue
        attribute, key = recorder.finder.where(path)
        container = getattr(owner, attribute)
        factory = key is not None and isinstance(container, collections.defaultdict) and \
            container.default_factory is not None
        index = next((i for i, k in enumerate(container) if k == key), 0) if key is not None else 0
        layout[path] = Entry(type(obj).__name__, places[batch], attribute, key,
                             None if factory else _maker(obj), factory, index)
    return layout


def _maker(obj: Any) -> Optional[type]:
    """``type(obj)`` if a fresh one is configured like ``obj`` (its non-growing fields equal)."""
    try:
        fresh = type(obj)()
    except Exception:
        return None
    mine, theirs = _configuration(obj), _configuration(fresh)
    same = mine.keys() == theirs.keys() and all(_same(mine[k], theirs[k]) for k in mine)
    return type(obj) if same else None


def _configuration(obj: Any) -> Dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if not (isinstance(v, (list, dict)) or is_number(v)
                                                        or isinstance(v, METRIC_TYPES + (torch.nn.Module,)))}


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def complete(owner: Any, recorder: Any, layouts: Sequence[Mapping[str, Entry]], stage: str) -> Dict[str, Any]:
    """Makes this rank hold every metric object any rank holds; returns them.

    Raises :class:`ConfigError` on every rank (the layouts are the same
    everywhere) if ranks held different objects at stage start, if a path
    has different classes, or if a rank lacks an object no rank can make.
    """
    paths: Dict[str, Tuple[Entry, int]] = {}
    for rank, layout in enumerate(layouts):
        for path, entry in layout.items():
            paths.setdefault(path, (entry, rank))
            if paths[path][0].cls != entry.cls:
                raise _layout_error(stage, layouts, f"'{path}' is a {paths[path][0].cls} on rank {paths[path][1]} "
                                                    f"and a {entry.cls} on rank {rank}")
    at_start = [{p for p, e in layout.items() if e.created is None} for layout in layouts]
    if any(s != at_start[0] for s in at_start):
        differ = sorted(set.union(*at_start) - set.intersection(*at_start))
        raise _layout_error(stage, layouts, f"at stage start some ranks held {differ} and others not")
    unmakeable = sorted(path for path in paths if any(path not in layout for layout in layouts)
                        and not any(layout[path].factory or layout[path].maker for layout in layouts
                                    if path in layout))
    if unmakeable:  # decided from the layouts, so raised on every rank, not only where one is missing
        raise ConfigError(
            f"ddp_eval: at the end of {stage}, metric object '{unmakeable[0]}' was created during the stage on "
            "some ranks, and the ranks that evaluated no batch that created it cannot make one configured the "
            "same (its class needs arguments, or a fresh one differs). Create it in on_stage_start, or keep "
            f"such objects in a collections.defaultdict whose factory makes them. All such objects: {unmakeable}")
    mine = recorder.objects
    for path in sorted(paths, key=lambda p: paths[p][0].created or 0.0):
        if path not in mine:
            _make(owner, path, [layout[path] for layout in layouts if path in layout])
    _order_containers(owner, layouts)
    recorder.objects = recorder.finder.rescan(owner)
    return recorder.objects


def _make(owner: Any, path: str, entries: List[Entry]) -> None:
    """Makes metric object ``path``, which :func:`complete` checked can be made."""
    entry = entries[0]
    container = getattr(owner, entry.attribute, None)
    if entry.key is not None and isinstance(container, collections.defaultdict) and container.default_factory:
        container[entry.key]  # made by its factory, as one process would
        return
    maker = next((e.maker for e in entries if e.maker is not None), None)
    if maker is None:  # the defaultdict itself was made by a batch this rank did not evaluate
        raise ConfigError(f"ddp_eval: metric object '{path}' lives in '{entry.attribute}', a collections."
                          "defaultdict on the ranks that made it and not on this one: create the defaultdict "
                          "in on_stage_start.")
    if entry.key is None:
        setattr(owner, entry.attribute, maker())
    else:
        if container is None:
            container = {}
            setattr(owner, entry.attribute, container)
        container[entry.key] = maker()


def _order_containers(owner: Any, layouts: Sequence[Mapping[str, Entry]]) -> None:
    """Puts the keys a container gained during the stage in one process's order
    (of the batches that created them; within a batch, as the creating rank did)."""
    first: Dict[Tuple[str, Any], Tuple[float, int, int]] = {}
    for rank, layout in enumerate(layouts):
        for entry in layout.values():
            if entry.created is not None and entry.key is not None:
                place = (entry.created, rank, entry.index)
                first[(entry.attribute, entry.key)] = min(first.get((entry.attribute, entry.key), place), place)
    for attribute in {a for a, _ in first}:
        container = getattr(owner, attribute)
        created = sorted((place, key) for (a, key), place in first.items() if a == attribute)
        moved = [(key, container.pop(key)) for _, key in created if key in container]
        container.update(moved)


def _layout_error(stage: str, layouts: Sequence[Mapping[str, Entry]], what: str) -> ConfigError:
    detail = "; ".join(f"rank {r}: {[(p, e.cls) for p, e in layout.items()]}" for r, layout in enumerate(layouts))
    return ConfigError(
        f"ddp_eval: at the end of {stage}, ranks hold different metric objects, so they cannot be merged: "
        f"{what}. Expected the same on every rank, got {detail}. Create metric objects in on_stage_start "
        "(or in a collections.defaultdict, whose factory makes them on every rank), or list them in "
        "ddp_eval: metrics_exclude.")
