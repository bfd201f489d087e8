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
import functools
from typing import Any, Dict, Mapping, Sequence, Tuple

from speechbrain.utils.metric_stats import MultiMetricStats

from ddp_eval import sb_compat
from ddp_eval.state._attributes import AttributeTracker, Slot, top_label
from ddp_eval.state._probes import MAKES_KEYS, Factory
from ddp_eval.state._recording import announcing_copy, is_recording, listening_copy, unmergeable_operations
from ddp_eval.state._values import ABSENT, is_flat_list
from ddp_eval.state.metrics import METRIC_TYPES, MetricRecorder, all_flat, field_targets

LISTEN_TO_LISTS_MADE_ELSEWHERE = True  # recording copies in objects no factory made (tests switch it off)
HOOK_NESTED_FIELDS = True  # BLEUStats.append and its targets hooked for the stage (tests switch it off)


class LazyMetricFields:
    """Watches the fields of metric objects created during the stage on this rank."""

    def __init__(self, metrics: MetricRecorder, attributes: AttributeTracker, owner: Any) -> None:
        self.metrics, self.attributes, self.owner = metrics, attributes, owner
        self.factories: Dict[str, Factory] = {}  # attribute -> the factory wrapped for the stage
        self.listened: list = []  # (object, field, copy): lists of objects no factory made, from their next batch
        self.announcing: list = []  # MultiMetricStats whose per-key objects get recording copies as they are made
        self.nested: list = []  # (outer list, index, copy, path, field): inner lists of SpeechBrain's nested fields
        self.nested_paths: Dict[int, Tuple[str, Any]] = {}  # id -> (path, object) of those with nested fields
        self.hooked: list = []  # the classes whose append and nested fields are hooked for the stage
        self.in_append = 0  # inside the hooked append
        self.none_reads: Dict[str, set] = {}  # path.field -> the rank's batches that read it while None
        self.bound_by_batches: set = set()  # path.field the recipe's own code bound during a batch
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
            if sb_compat.nested_list_fields(obj):
                self.nested_paths[id(obj)] = (path, obj)
                self._hook_append(type(obj))
                self._listen_nested(path, obj)

    def _listen_nested(self, path: str, obj: Any) -> None:
        for name in sb_compat.nested_list_fields(obj):
            outer = vars(obj).get(name)
            for index, inner in enumerate(outer if type(outer) is list else ()):
                if type(inner) is list:
                    outer[index] = listening_copy(inner, top_label(path), self.attributes.notes)
                    self.nested.append((outer, index, outer[index], path, name))

    def _hook_append(self, kind: type) -> None:
        """For the stage, the SpeechBrain class that declares a nested field (``BLEUStats``)
        gets an ``append`` that calls its own, then puts recording copies in the lists
        it bound over ``None``: what the rest of the batch does to them is seen (each
        rank's first binding is another batch's extension in one process); and the
        field a descriptor that notes a batch's read of it while ``None``. The
        instances' types stay as they are; one hook per class, shared by the stage
        books of simulated ranks, taken out when the last one releases it."""
        owner = sb_compat.nested_list_owner(kind)
        if not HOOK_NESTED_FIELDS or owner is None or "append" not in vars(owner) or owner in self.hooked:
            return
        hook = vars(owner)["append"]
        if not hasattr(hook, "ddp_eval_books"):
            hook = _append_hook(hook)
            owner.append = hook
            for name in sb_compat.NESTED_LIST_FIELDS[owner.__name__]:
                if name not in vars(owner):
                    setattr(owner, name, _NoneReads(name, hook.ddp_eval_books))
        hook.ddp_eval_books.append(self)
        self.hooked.append(owner)

    def _unhook(self) -> None:
        for owner in self.hooked:
            hook = vars(owner).get("append")
            if self in getattr(hook, "ddp_eval_books", ()):
                hook.ddp_eval_books.remove(self)
                if not hook.ddp_eval_books:
                    owner.append = hook.__wrapped__
                    for name, value in list(vars(owner).items()):
                        if isinstance(value, _NoneReads):
                            delattr(owner, name)
        self.hooked = []

    def owns(self, metric: Any) -> bool:
        return id(metric) in self.nested_paths and self.nested_paths[id(metric)][1] is metric

    def note_none_read(self, obj: Any, name: str) -> None:
        """A batch's own code read ``obj.name`` while it was ``None`` (``if bleu.targets is None``)."""
        if self.in_append == 0 and self.attributes.notes.listening and self.owns(obj):
            self.none_reads.setdefault(f"{self.nested_paths[id(obj)][0]}.{name}", set()).add(self.metrics.batches)

    def note_set(self, obj: Any, name: str) -> None:
        """A batch's own code bound ``obj.name`` (``bleu.targets = None``, a reset)."""
        if self.in_append == 0 and self.attributes.notes.listening and self.owns(obj):
            self.bound_by_batches.add(f"{self.nested_paths[id(obj)][0]}.{name}")

    def none_reads_that_steer(self, positions: Sequence[int]) -> Dict[str, str]:
        """``{path.field: why}`` of nested fields a batch at a global position past the
        first read while ``None``: in one process an earlier batch may have bound them."""
        return {label: (
            "a batch read it while it was None (each rank's first batch finds it so; in one process only the "
            "first batch does), and what it did after that read may differ from one process: bind it in "
            "on_stage_start (bleu.targets = [[] for _ in range(number of references)])")
            for label, batches in self.none_reads.items()
            if any(k >= len(positions) or positions[k] > 0 for k in batches)}

    def nested_changes(self) -> Dict[str, str]:
        """``{path.field: why}`` of the nested fields a batch's own code bound (a reset to
        None, a new list) and of the nested lists a batch changed other than by growing
        them (a sort, a reverse, an insert), in any batch, the one that bound them included."""
        found = {label: ("a batch bound it (a reset to None, a new list), which ddp_eval cannot replay in one "
                         "process's order: make a new metric object in on_stage_start instead")
                 for label in self.bound_by_batches}
        for _, _, copy, path, name in self.nested:
            why = unmergeable_operations(copy) if copy.ops else None
            if why is not None:
                found.setdefault(f"{path}.{name}", why)
        return found

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
        self._unhook()
        self.nested_paths = {}
        for outer, index, copy, _, _ in self.nested:
            if index < len(outer) and outer[index] is copy:
                outer[index] = list(copy)
        self.nested = []


def _append_hook(original: Any) -> Any:
    """``original`` (``BLEUStats.append``) that lets each stage book owning the metric
    object (``ddp_eval_books``) put recording copies in what it bound."""
    def append(metric, *args, **kwargs):
        books = [book for book in append.ddp_eval_books if book.owns(metric)]
        for book in books:  # its own `if self.targets is None` makes the field: not a read that steers
            book.in_append += 1
        try:
            result = original(metric, *args, **kwargs)
        finally:
            for book in books:
                book.in_append -= 1
        for book in books:
            book._listen_nested(book.nested_paths[id(metric)][0], metric)
        return result
    functools.update_wrapper(append, original)
    append.ddp_eval_books = []
    return append


class _NoneReads:
    """A nested field (``BLEUStats.targets``) on its class for the stage: reads and
    writes go to the instance's ``__dict__`` as without it; a batch's read while the
    value is ``None`` is noted (:meth:`LazyMetricFields.note_none_read`)."""

    def __init__(self, name: str, books: list) -> None:
        self.name, self.books = name, books

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        try:
            value = obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None
        if value is None:
            for book in self.books:
                book.note_none_read(obj, self.name)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value
        for book in self.books:
            book.note_set(obj, self.name)

    def __delete__(self, obj: Any) -> None:
        del obj.__dict__[self.name]
