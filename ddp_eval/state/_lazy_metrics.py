"""Metric objects created during a stage, on the same engine as those created in
``on_stage_start``.

A metric object held at stage start has its fields that are not flat lists
(numbers, dicts, tensors, ...) watched as attributes
(:func:`ddp_eval.state.metrics.field_targets`): numbers through probes, their
``+=`` replayed in global batch order. One created during the stage (a
``defaultdict(MyStats)`` filled per class or per decoding method) gets the same
watch from the batch that created it:

* the ``defaultdict``'s factory is wrapped for the stage
  (:class:`~ddp_eval.state._probes.Factory`), so an object it makes has probes
  in its number fields before the recipe's code touches them; what that batch
  did is read from them (an initial value, then ``+`` and ``-``);
* an object made by the recipe's own code is watched from the next batch; the
  change its first batch made is told by its other changes, as a dict entry's
  first change seen without a probe is.

Ranks that never held such an object make it (:func:`ddp_eval.state._metric_layout.complete`)
before the merged fields are written into it.
"""

import collections
from typing import Any, Dict, Mapping, Tuple

from speechbrain.utils.metric_stats import MultiMetricStats

from ddp_eval import sb_compat
from ddp_eval.state._attributes import AttributeTracker, Slot, top_label
from ddp_eval.state._probes import MAKES_KEYS, Factory
from ddp_eval.state._recording import announcing_copy, is_recording, listening_copy, unmergeable_operations
from ddp_eval.state._values import ABSENT, is_flat_list
from ddp_eval.state.metrics import METRIC_TYPES, MetricRecorder, all_flat, field_targets

LISTEN_TO_LISTS_MADE_ELSEWHERE = True  # recording copies in objects no factory made (tests switch it off)


class LazyMetricFields:
    """Watches the fields of metric objects created during the stage on this rank."""

    def __init__(self, metrics: MetricRecorder, attributes: AttributeTracker, owner: Any) -> None:
        self.metrics, self.attributes, self.owner = metrics, attributes, owner
        self.factories: Dict[str, Factory] = {}  # attribute -> the factory wrapped for the stage
        self.listened: list = []  # (object, field, copy): lists of objects no factory made, from their next batch
        self.announcing: list = []  # MultiMetricStats whose per-key objects get recording copies as they are made
        self.nested: list = []  # (outer list, index, copy): the inner lists of SpeechBrain's nested fields
        self.wrap(metrics.objects)
        self.announce(metrics.objects)
        self.listen_nested(metrics.objects)

    def wrap(self, objects: Mapping[str, Any], taken: Mapping[str, Factory] = {}) -> None:
        """Wraps the factory of every ``defaultdict`` holding metric objects (or takes
        over the one the attribute tracker wrapped while it watched the attribute)."""
        for attribute in {path.split("[")[0].split(".")[0] for path in objects}:
            container = getattr(self.owner, attribute, None)
            if not isinstance(container, collections.defaultdict) or container.default_factory is None:
                continue
            factory = self.factories.get(attribute) or taken.get(attribute) or Factory(
                container.default_factory, self.attributes.notes, attribute)
            container.default_factory = self.factories[attribute] = factory

    def before_batch(self) -> None:
        for factory in self.factories.values():
            factory.unprobe()
            factory.made.clear()

    def observe(self, batch: int, objects: Mapping[str, Any]) -> None:
        """Watches the fields of the objects first seen after batch ``batch``."""
        for path, obj in all_flat(objects):  # a MultiMetricStats's per-key objects too
            if self.metrics.first_seen.get(path) != batch:
                continue
            factory = self.factories.get(path.split("[")[0])
            self.listen(path, obj)  # recording copies first: the slots watch them
            for label, (sub, name) in field_targets({path: obj}, flat_lists=True).items():
                self.watch(label, sub, name, batch, factory)
            self.announce({path: obj})

    def announce(self, objects: Mapping[str, Any]) -> None:
        """A MultiMetricStats's ``metrics`` dict announces each per-key object it makes, which
        gets recording copies at once: a read of its lists in the batch that made it is seen."""
        for path, obj in all_flat(objects) if LISTEN_TO_LISTS_MADE_ELSEWHERE else ():
            if not isinstance(obj, MultiMetricStats) or any(known is obj for known in self.announcing):
                continue
            if type(vars(obj).get("metrics")) is dict:
                obj.metrics = announcing_copy(obj.metrics, lambda key, made, path=path: self.listen(
                    f"{path}.metrics[{key}]", made) if isinstance(made, METRIC_TYPES) else None,
                    path.split("[")[0].split(".")[0], self.attributes.notes, MAKES_KEYS)
            if is_recording(vars(obj).get("metrics")):  # or the factory that made it did: its changed keys named
                self.announcing.append(obj)

    def listen(self, path: str, obj: Any) -> None:
        """Recording copies in place of the flat lists of an object no factory made
        (a MultiMetricStats's per-key objects, one the recipe's code made), as a
        factory puts in: a later batch's sort or read that steers is seen."""
        for name, value in vars(obj).items() if LISTEN_TO_LISTS_MADE_ELSEWHERE else ():
            if type(value) is list and is_flat_list(value):
                copy = obj.__dict__[name] = listening_copy(value, path.split("[")[0].split(".")[0],
                                                           self.attributes.notes)
                self.listened.append((obj, name, copy))

    def listen_nested(self, objects: Mapping[str, Any]) -> None:
        """Recording copies in place of the inner lists of SpeechBrain's nested list
        fields (``BLEUStats.targets``, bound over ``None`` in a rank's first batch), which
        the metric recorder merges: a batch's read of them (``len``, ``in``, an index)
        is noted, and names what it may have steered."""
        for path, obj in all_flat(objects) if LISTEN_TO_LISTS_MADE_ELSEWHERE else ():
            for name in sb_compat.nested_list_fields(obj):
                outer = vars(obj).get(name)
                for index, inner in enumerate(outer if type(outer) is list else ()):
                    if type(inner) is list:
                        outer[index] = listening_copy(inner, top_label(path), self.attributes.notes)
                        self.nested.append((outer, index, outer[index]))

    def watch(self, label: str, sub: Any, name: str, batch: int, factory: Any) -> None:
        sub_path = label[: -len(name) - 1]
        self.metrics.fields[label] = (sub, name)
        self.metrics.slotted.setdefault(sub_path, set()).add(name)
        self.metrics.unmerged.pop((sub_path, name), None)
        slot = self.attributes.tracks[label] = Slot(label, sub, name, self.attributes.budget, start=ABSENT,
                                                       notes=self.attributes.notes)
        value = vars(sub).get(name, ABSENT)
        if type(value) is list or is_recording(value):  # a flat list: made empty, what it holds is this batch's
            self.metrics.forget(sub_path, name)
            slot.recorded = value if is_recording(value) else None  # its sort, insert, steering read: seen
            slot.adopt(batch, value, [], [])
            return
        made = factory.field_origin(sub, value) if factory is not None else None
        start = self.metrics.made_as.get(sub_path, {}).get(name, ABSENT)
        if made is None and type(start) is type(value) and start == value:  # as made: no batch changed it yet
            made = (value, [])
        if made is not None:
            slot.adopt(batch, value, *made)  # from the factory's value, by the ops its probes saw
        else:
            slot.observe(batch)  # the batch bound it where there was none: told by its later changes

    def locate_all(self, objects: Mapping[str, Any]) -> Dict[str, Tuple[Any, str]]:
        """``{label: (object, field)}`` of every metric object's watched fields (after the
        objects this rank lacked were made), for writing merged fields into them."""
        found = field_targets(objects, flat_lists=True)
        self.metrics.fields.update({label: where for label, where in found.items() if label not in
                                    self.metrics.fields})
        return found

    def rebound(self, objects: Mapping[str, Any]) -> Dict[str, str]:
        """``{path.field: why}`` of the list fields of metric objects made during the
        stage that a batch replaced by another list: a sort or a cut, which no record replays."""
        paths = {id(obj): path for path, obj in all_flat(objects)}
        return {f"{paths.get(id(obj), type(obj).__name__)}.{name}": (
            "a batch bound a new list to this field of a metric object made during the stage (a sort, a cut: "
            "self.ids = sorted(...)[:k]), which ddp_eval cannot replay in one process's order: append to its "
            "lists, and sort or cut them in on_stage_end") for obj, name in self._rebound()}

    def changed_keys(self, objects: Mapping[str, Any]) -> Dict[str, str]:
        """``{path.metrics: why}`` of the ``MultiMetricStats`` whose per-key objects a batch
        removed or replaced (``del multi.metrics["wer"]``): their entries cannot be merged."""
        paths = {id(obj): path for path, obj in all_flat(objects)}
        found = {}
        for obj in self.announcing:
            why = unmergeable_operations(vars(obj).get("metrics")) if is_recording(vars(obj).get("metrics")) else None
            if why is not None:
                found[f"{paths.get(id(obj), type(obj).__name__)}.metrics"] = why
        return found

    def _rebound(self):
        yield from ((obj, name) for factory in self.factories.values() for obj, name in factory.rebound())
        yield from ((obj, name) for obj, name, copy in self.listened if obj.__dict__.get(name) is not copy)

    def release(self) -> None:
        """The original factories back; plain numbers in what they made."""
        for attribute, factory in self.factories.items():
            factory.unprobe()
            factory.plain_lists()
            container = getattr(self.owner, attribute, None)
            if isinstance(container, collections.defaultdict) and container.default_factory is factory:
                container.default_factory = factory.original
        self.factories = {}
        for obj, name, _ in self.listened:
            if is_recording(obj.__dict__.get(name)):
                obj.__dict__[name] = list(obj.__dict__[name])
        self.listened = []
        for obj in self.announcing:
            if is_recording(vars(obj).get("metrics")):
                obj.metrics = dict(obj.metrics)
        self.announcing = []
        for outer, index, copy in self.nested:
            if index < len(outer) and outer[index] is copy:
                outer[index] = list(copy)
        self.nested = []
