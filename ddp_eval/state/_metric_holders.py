"""What an attribute holding metric objects holds besides them.

An attribute that holds metric objects (``self.stats = {"wer": ErrorRateStats(),
"n": 0}``) is merged as metric objects: the metric merge owns its metric objects,
and the attribute engine does not watch it. Anything else it holds (a counter, a
list of ids, a recipe object's field) would keep each rank's own batches' share.
:class:`MetricHolders` takes a fingerprint of that rest when the attribute becomes
a holder (stage start, or the batch that put a metric object in it) and names the
attribute at stage end if the rest changed, or if a batch made the holder with a
rest already in it: never merged as if understood.

Example
-------
>>> import types
>>> from speechbrain.utils.metric_stats import ErrorRateStats
>>> brain = types.SimpleNamespace(stats={"wer": ErrorRateStats(), "n": 0})
>>> found = {id(brain.stats["wer"])}
>>> holders = MetricHolders()
>>> holders.adopt(brain, ["stats"], found)
>>> brain.stats["wer"].append(["u1"], [["a"]], [["a"]])
>>> holders.changed(brain, found)
{}
>>> brain.stats["n"] += 1
>>> list(holders.changed(brain, found))
['stats']
"""

from typing import Any, Dict, Iterable, Mapping, Optional, Set

from ddp_eval.state._explain import Fingerprint, holds_fields
from ddp_eval.state._values import get_value, is_metric_object

_DEPTH = 3  # levels of dicts, lists and recipe objects looked into (self.metrics[stage]["n"])
FOLLOW_HOLDERS = True  # tests switch it off to show what it catches


def besides_metrics(value: Any, found: Set[int], depth: int = 0) -> Any:
    """``value`` with the metric objects it holds that were ``found`` (their ids) left
    out, ``_DEPTH`` levels down: a dict's entries, a list's or tuple's items and a
    recipe object's fields, as a dict; anything else as it is.

    Example
    -------
    >>> from speechbrain.utils.metric_stats import ErrorRateStats
    >>> wer, cer = ErrorRateStats(), ErrorRateStats()
    >>> rest = besides_metrics({"wer": wer, "n": 2, "per": [cer, 1]}, {id(wer), id(cer)})
    >>> rest
    {'n': 2, 'per': {1: 1}}
    """
    if depth >= _DEPTH or id(value) in found:
        return value
    if isinstance(value, Mapping):
        items: Iterable = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif holds_fields(value):
        items = vars(value).items()
    else:
        return value
    return {key: besides_metrics(entry, found, depth + 1) for key, entry in items if id(entry) not in found}


class MetricHolders:
    """The rest (:func:`besides_metrics`) of each attribute holding metric objects,
    taken when it became a holder; one per stage."""

    def __init__(self) -> None:
        self._rests: Dict[str, Fingerprint] = {}
        self._made: Dict[str, str] = {}  # holders a batch made with a rest in it: name -> what

    def adopt(self, brain: Any, names: Iterable[str], found: Set[int],
              start_rests: Mapping[str, Optional[Fingerprint]] = {}) -> None:
        """Follows the holders ``names`` not followed yet, of the metric objects ``found``
        (ids). ``start_rests`` gives, of one the attribute engine watched until now, the
        fingerprint of its rest at stage start (None: a batch bound it); the others are
        taken as they are now."""
        for name in names:
            now = get_value(brain, name)
            rest = besides_metrics(now, found)
            if name in self._rests or name in self._made or is_metric_object(now) or not isinstance(rest, dict):
                continue  # followed, or a metric object itself (its fields are merged as such)
            if name not in start_rests:
                self._rests[name] = Fingerprint.of(rest)
            elif start_rests[name] is None and rest:
                self._made[name] = "a batch made it holding other state too"
            elif start_rests[name] is not None and not start_rests[name].matches(rest):
                self._made[name] = "a batch changed other state it holds before putting a metric object in it"
            else:
                self._rests[name] = Fingerprint.of(rest)

    @staticmethod
    def rest_at_start(original: Any, found: Set[int]) -> Optional[Fingerprint]:
        """The fingerprint of what ``original`` (an attribute's stage-start value)
        holds besides metric objects, for :meth:`adopt`; None if it held no container
        or object (``ABSENT``, ``None``: a batch made the holder)."""
        rest = besides_metrics(original, found)
        return Fingerprint.of(rest) if isinstance(rest, dict) and not is_metric_object(original) else None

    def changed(self, brain: Any, found: Set[int]) -> Dict[str, str]:
        """``{attribute: why}`` of holders whose other state (besides the metric objects
        ``found``, ids) changed (checked at stage end)."""
        if not FOLLOW_HOLDERS:
            return {}
        named = dict(self._made)
        for name, rest in self._rests.items():
            if not rest.matches(besides_metrics(get_value(brain, name), found)):
                named[name] = "other state it holds changed"
        return {name: (f"it holds metric objects, which are merged as such, and {why} (a number, a list, a "
                       "field besides them), which is not merged, so each rank would keep its own batches' share: "
                       "keep that state in an attribute of its own (bound in on_stage_start), or the metric "
                       "objects in attributes of their own") for name, why in named.items()}
