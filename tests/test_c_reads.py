"""A float or tensor on the left of a watched number, or C code given it, reads it
where no probe sees (``100.0 * self.correct``, ``math.sqrt(self.total)``): the batch
code's bytecode names such reads, in the Brain's methods, through a local, in a
module's function given the Brain, and in the methods of objects it holds."""

import ast
import functools
import heapq
import json
import math
import operator
import types

import pytest
import torch
from speechbrain.utils.metric_stats import MetricStats

import tests.test_c_reads
from ddp_eval.config import DDPEvalConfig
from ddp_eval.state._c_reads import read_in_c, read_in_c_of, values_at
from ddp_eval.state._field_flow import parts, uses
from ddp_eval.state.bookkeeping import simulate as simulate_stage
from tests.test_attribute_tracking import simulate


class Counting:
    """A recipe's Brain keeping counters, and what its batches compute from them."""

    def __init__(self):
        self.correct, self.seen, self.weight = 0, 0, 2
        self.running_acc, self.late, self.scaled = 0.0, [], []

    def compute_objectives(self, b):
        self.correct += b % 2
        self.seen += 1
        self._progress(b)

    def _progress(self, b):  # a method of its own, called from the batch
        self.running_acc = 100.0 * self.correct / self.seen

    def on_stage_end(self):  # after the merge: the merged counters
        return 100.0 * self.correct / self.seen


class Steering(Counting):
    def _progress(self, b):
        if 2.5 < self.seen:
            self.late.append(b)


class Tensors(Counting):
    def _progress(self, b):
        self.scaled.append(float(torch.tensor(1.5) * self.seen))


class Passed(Counting):
    def _progress(self, b):  # C code takes a float's or an int's value: no method of the probe is called
        self.scaled.append(math.sqrt(self.seen))
        self.late.append(float(torch.tensor(self.correct)))


class Extreme(Counting):
    def __init__(self):
        super().__init__()
        self.low = 100

    def _progress(self, b):  # a choice the merge replays: not a read in C
        self.low = min(b, self.low)


class Constant(Counting):
    def _progress(self, b):  # read in C, but no batch changes it; a probe's own method; its reflected one
        self.scaled.append(2.5 * self.weight + self.weight * 1.5)
        self.late.append(1 + self.weight)


def _running_accuracy(brain, b):  # a module's function a batch gives the Brain
    brain.running_acc = 100.0 * brain.correct / brain.seen


class Aliased(Counting):
    def _progress(self, b):  # through a local: the float reads the int in C
        seen = self.seen
        self.late.append(2.5 * seen)


class GivenSelf(Counting):
    def _progress(self, b):
        _running_accuracy(self, b)


class RunningMean:
    """An accumulator of the recipe's own, whose method reads its counters in C."""

    def __init__(self, scale=2):
        self.count, self.total, self.means, self.scale = 0, 0, [], scale

    def update(self, b):
        self.count += 1
        self.total += b
        self.means.append(1.0 * self.total / self.count)


class Scaled(RunningMean):
    def update(self, b):  # reads in C a field no batch changes
        self.means.append(1.5 * self.scale)


class Held(Counting):
    def __init__(self, accumulator=RunningMean):
        super().__init__()
        self.stats = accumulator()

    def _progress(self, b):
        self.stats.update(b)


class Meter(RunningMean):
    def __call__(self, b):  # an object of the recipe's own, called
        self.update(b)


class Called(Counting):
    def __init__(self):
        super().__init__()
        self.meter = Meter()

    def _progress(self, b):
        self.meter(b)


def _update(stats, b):  # a module's function a batch gives an object the Brain holds
    stats.update(b)


class GivenField(Held):
    def _progress(self, b):
        _update(self.stats, b)


class PerKey(Counting):
    """Objects of the recipe's own held in a dict, or a list, one updated per batch."""

    def __init__(self, accumulator=RunningMean, container=dict):
        super().__init__()
        self.per_key = container([accumulator(), accumulator()]) if container is list else {0: accumulator(),
                                                                                              1: accumulator()}

    def _progress(self, b):
        self.per_key[b % 2].update(b)


class Counted(Counting):
    def __init__(self):
        super().__init__()
        self.counts = {"a": 0}

    def _progress(self, b):  # a dict's entry, an int, read in C after the batch changed it
        self.counts["a"] += 1
        self.late.append(100.0 * self.counts["a"])


LABELS = [f"label{i}" for i in range(100)]


class Indexed(Counting):
    def _progress(self, b):  # a list takes an int's value in C as its index
        self.late.append(LABELS[self.seen])


class Sliced(Counting):
    def _progress(self, b):
        self.late.append("abcdefgh"[:self.seen])


helpers = types.ModuleType("helpers")  # a module of the recipe's own
helpers.update = _update


class InModule(Held):
    def _progress(self, b):
        helpers.update(self.stats, b)


class InHparams(Counting):
    def __init__(self):
        super().__init__()
        self.hparams = types.SimpleNamespace(stats=RunningMean())

    def _progress(self, b):
        stats = self.hparams.stats
        stats.update(b)


class Unpacked(Counting):
    def _progress(self, b):  # locals bound by unpacking, a conditional expression, `or`, `:=`
        correct, seen = self.correct, self.seen
        chosen = self.seen if b >= 0 else self.correct
        either = self.correct or self.seen
        if (first := self.seen) > 0:
            self.late.append((2.5 * seen, 1.5 * chosen, 0.5 * either, 3.5 * first, 4.5 * correct))


class Branches:
    def compute_objectives(self, b):  # both branches of a conditional expression, both sides of `or`, `for`
        chosen, either = self.a if b else self.b, self.c or self.d
        for value in (self.e, self.f):
            b += 2.5 * value
        self.h, swapped = b, self.g  # compiled with a SWAP
        for _name, _first, second in zip(LABELS, self.pairs, self.others):  # zip: each by its position
            b += 1.5 * second
        return 2.5 * chosen + 1.5 * either + 0.5 * swapped + 0.25 * getattr(self, "i")  # noqa: B009


class Looped(PerKey):
    def _progress(self, b):  # a loop's variable: each entry in turn
        for key, stats in self.per_key.items():
            if key == b % 2:
                stats.update(b)


class Enumerated(PerKey):
    def __init__(self):
        super().__init__(container=list)

    def _progress(self, b):
        for at, stats in enumerate(self.per_key):
            if at == b % 2:
                stats.update(b)


def _score(stats, b, scale=1.0):  # a function of the recipe's module, held in hparams (``!name:``)
    stats.count += 1
    stats.means.append(scale * stats.count)


def _score_by_update(stats, b, scale=1.0):
    stats.update(b)


class Callbacks(Held):
    def __init__(self):
        super().__init__()
        self.hparams = types.SimpleNamespace(score=_score, update=functools.partial(_score_by_update, scale=2.0))

    def _progress(self, b):
        self.hparams.score(self.stats, b) if b % 2 else self.hparams.update(self.stats, b)


def _progress_of(brain, b):  # a function hparams hold, given the Brain, calling a method of its
    brain._progress(b)


class CallsBack(Counting):
    def __init__(self):
        super().__init__()
        self.hparams = types.SimpleNamespace(progress=_progress_of)

    def compute_objectives(self, b):
        self.correct += b % 2
        self.seen += 1
        self.hparams.progress(self, b)


class Dispatched(Counting):
    """Batch code found by name at run time."""

    def __init__(self):
        super().__init__()
        self.kind, self.hparams = "running", types.SimpleNamespace(running_stats=RunningMean())

    def compute_objectives(self, b):
        self.correct += b % 2
        self.seen += 1
        getattr(self, f"_progress_{self.kind}")(b)
        getattr(self.hparams, f"{self.kind}_stats").update(b)

    def _progress_running(self, b):
        self.running_acc = 100.0 * getattr(self, "correct", 0) / self.seen

    def _end_running(self):  # no batch runs it: _progress_*
        return 100.0 * self.weight


class Listed(PerKey):
    def _progress(self, b):  # a local bound to a builtin's copy of the container: the same entries
        ordered = list(self.per_key.values())
        ordered[b % 2].update(b)


class Picked(PerKey):
    def _progress(self, b):  # a builtin handing back one entry
        stats = next(iter(self.per_key.values()))
        stats.update(b)
        for other in sorted(self.per_key.values(), key=lambda s: s.scale):  # looped over a sorted copy
            self.late.append(2.5 * other.count)


def _pick(per_key, b):  # a function of the recipe's own handing back an entry of what it is given
    return per_key[b % 2]


class Helper:
    def pick(self, per_key, b):
        return per_key[b % 2]


class PickedByCall(PerKey):
    """A local bound to what a call given a container hands back, or to what its own
    method does (``m = pick(self.per_key, k)``, ``m = self.per_key.get(k)``): it may be
    the container or one of its entries, and stands for both."""

    def __init__(self, how="function"):
        super().__init__()
        self.how, self.helper = how, Helper()

    def _progress(self, b):
        if self.how == "function":
            stats = _pick(self.per_key, b)
        elif self.how == "method":
            stats = self.per_key.get(b % 2)
        else:
            stats = self.helper.pick(self.per_key, b)
        stats.count += 1
        self.late.append(2.5 * stats.count)


_LABELS_BY_KEY = {0: "a", 1: "b"}


class Tally:
    """An accumulator of the recipe's own that reads nothing in C itself."""

    def __init__(self):
        self.count = 0


class Comprehended(Counting):
    """A comprehension whose loop variable is one of the Brain's objects: over a tuple
    display of fields, a dict's ``values()`` or ``items()``, a list of them."""

    def __init__(self, over="display"):
        super().__init__()
        self.over, self.a, self.b = over, Tally(), Tally()
        self.by_key, self.tallies = {"x": Tally(), "y": Tally()}, [Tally(), Tally()]

    def _progress(self, b):
        for tally in (self.a, self.b, self.by_key["x"], self.tallies[b % 2]):
            tally.count += 1
        if self.over == "display":
            self.late.append([2.5 * t.count for t in (self.a, self.b)][0])
        elif self.over == "values":
            self.late.append(sum(2.5 * t.count for t in self.by_key.values()))
        elif self.over == "items":
            self.late.append({k: 2.5 * t.count for k, t in self.by_key.items()}["x"])
        else:
            self.late.append(max({1.5 * t.count for t in self.tallies}))


class ThroughDisplays(Comprehended):
    """Fields reached through a display or a function of the batch's own: C code given
    a display holding them, a display's own method looped over, a ``lambda`` given
    with a display to ``map``, a nested ``def`` given a field, a ``key`` function
    given a dict's entries. In each, only a value the first form missed changes."""

    def _progress(self, b):
        for tally in (self.a, self.b, self.by_key["xy"[b % 2]]):
            tally.count += 1
        if self.over == "product":  # C code multiplies 2.5 by the int, in C
            self.late.append(math.prod((2.5, self.seen)))
        elif self.over == "values":
            self.late.append(sum(2.5 * v for v in {"w": self.weight, "n": self.seen}.values()))
        elif self.over == "map":
            self.late.append(sum(map(lambda t: 2.5 * t.count, (self.a, self.b))))
        elif self.over == "def":
            def rate(tally):
                return 2.5 * tally.count
            self.late.append(rate(self.b))
        else:
            self.late.append(max(self.by_key.values(), key=lambda t: 1.5 * t.count + 0.1 * len(t.__dict__))
                             is self.by_key["x"])


def _hand_on_1(tally):  # the recipe's functions handing on what they are given, the last reading it in C
    return _hand_on_2(tally)


def _hand_on_2(tally):
    return _hand_on_3(tally)


def _hand_on_3(tally):
    return _hand_on_4(tally)


def _hand_on_4(tally):
    return _rate(tally)


def _rate(tally):
    return 2.5 * tally.count


class Deep(Comprehended):
    def _progress(self, b):  # deeper than the scan follows: what the first is given counts as read, field by field
        self.a.count += 1
        self.late.append(_hand_on_1(self.a))


def _hit(predictions, targets):
    return torch.tensor([float(p == t) for p, t in zip(predictions, targets)])


class Stacked(Counting):
    """A list of tensors given to C code that takes its entries without iterating it
    (``torch.stack``): the Brain's list, through a local, a metric object's scores;
    and lists no batch changes, or only looked at (``isinstance``), which stay unnamed."""

    def __init__(self, through="attribute"):
        super().__init__()
        self.through, self.losses, self.weights = through, [], [torch.tensor(1.0)]
        self.acc = MetricStats(metric=_hit)

    def _progress(self, b):
        self.losses.append(torch.tensor(float(b)))
        self.acc.append([f"u{b}"], [b % 3], [0])
        losses = self.losses
        if self.through == "attribute":
            self.late.append(float(torch.stack(self.losses).mean()))
        elif self.through == "local":
            self.late.append(float(torch.stack(losses).mean()))
        else:
            self.late.append(float(torch.stack(self.acc.scores).mean()))


class StackedUnchanged(Stacked):
    def _progress(self, b):  # a list no batch changes stacked, a changed one only looked at: nothing to name
        self.losses.append(torch.tensor(float(b)))
        self.late.append(float(torch.stack(self.weights).sum()) + isinstance(self.losses, list))


class ComputedName(Counting):
    def _progress(self, b):  # getattr given a name a call computes: any field whose name fits
        self.late.append(2.5 * getattr(self, "SEEN".lower()))


class Literal(Counting):
    def _progress(self, b):  # an entry of a list display holding the field: the field itself
        seen, correct = [self.seen][0], {"n": self.correct, "k": 1}["n"]
        self.late.append(2.5 * seen + 1.5 * correct)


def _late_of(brain, b):
    brain.late.append(2.5 * brain.seen)


class Handlers(Held):
    """Batch code found in a dict of functions, a list of callable objects and a bound
    method of the Brain's own held in a dict."""

    def __init__(self):
        super().__init__()
        self.handlers, self.meters = {0: _running_accuracy, 1: _late_of}, [Meter()]
        self.on_batch = {"progress": self._tally}

    def _progress(self, b):
        self.handlers[b % 2](self, b)
        self.meters[0](b)
        self.on_batch["progress"](b)

    def _tally(self, b):
        self.stats.update(b)


class BoundHandlers(Counting):
    """A bound method of an object the Brain holds, called out of a dict (not the
    Brain's own): its object's method is scanned at that object's place."""

    def __init__(self):
        super().__init__()
        self.stats, self.per_key = RunningMean(), {0: RunningMean()}
        self.on_batch = {"stats": self.stats.update, "per_key": self.per_key[0].update}

    def _progress(self, b):
        self.on_batch["stats" if b % 2 else "per_key"](b)


def _plain(value):
    """An object of the recipe's own as its fields, to compare by value."""
    if isinstance(value, (dict, list)):
        return {k: _plain(v) for k, v in (value.items() if isinstance(value, dict) else enumerate(value))}
    return {k: _plain(v) for k, v in vars(value).items()} if hasattr(value, "__dict__") else value


@pytest.mark.fast
def test_the_scan_finds_reads_through_locals_functions_and_held_objects():
    assert read_in_c(Aliased) == {"seen"} and read_in_c(GivenSelf) == {"correct", "seen"}
    assert read_in_c_of(Held()) == {"stats.count", "stats.total"}
    assert read_in_c_of(Held(Scaled)) == {"stats.scale"}
    assert read_in_c_of(Called()) == {"meter.count", "meter.total"}
    assert read_in_c_of(GivenField()) == {"stats", "stats.count", "stats.total"}  # stats: passed, not a number
    assert read_in_c_of(InModule()) == read_in_c_of(GivenField())
    assert read_in_c_of(PerKey()) == read_in_c_of(PerKey(container=list)) == {"per_key[*].count", "per_key[*].total"}
    assert read_in_c(Counted) == {"counts[*]"}
    assert read_in_c(Indexed) == read_in_c(Sliced) == read_in_c(Decorated) == {"seen"}
    assert read_in_c(Inherits) == read_in_c(Counting) == {"correct", "seen"}  # Steering's override: {"seen"}


def _logged(method):  # a decorator of the recipe's own, as functools.wraps makes them
    @functools.wraps(method)
    def run(*args, **kwargs):
        return method(*args, **kwargs)
    return run


class Decorated(Counting):
    @_logged
    def compute_objectives(self, b):
        super().compute_objectives(b)

    @_logged
    def _progress(self, b):
        self.late.append(2.5 * self.seen)


class Inherits(Counting):
    def compute_objectives(self, b):  # the parent's batch code runs too, through super()
        self.late.append(b)
        super().compute_objectives(b)


class Subscripts:
    def compute_objectives(self, b):
        self.items[self.i] = self.items[self.j] + self.d[self.k]  # watched containers see their index
        return LABELS[self.m], "abc"[:self.q]


@pytest.mark.fast
def test_the_scan_follows_locals_bound_otherwise_loops_and_code_found_by_name():
    assert read_in_c(Unpacked) == {"correct", "seen"}
    assert read_in_c(Branches) == {"a", "b", "c", "d", "e", "f", "g", "pairs", "pairs[*]", "others", "others[*]",
                                   "i"}  # pairs given to a builtin: its entries too
    assert read_in_c_of(Looped()) == read_in_c_of(Enumerated()) - {"per_key", "per_key[*]"} == {"per_key[*].count",
                                                                                  "per_key[*].total"}
    assert read_in_c_of(Callbacks()) == {"stats", "stats.count", "stats.total"}  # stats: given, not a number
    assert read_in_c_of(CallsBack()) == {"correct", "seen"}  # the Brain's _progress, through the function
    assert read_in_c(Dispatched) == {"correct", "seen"}  # _progress_running, not _end_running
    assert read_in_c_of(Dispatched()) == {"correct", "seen", "hparams.running_stats.count",
                                          "hparams.running_stats.total"}


@pytest.mark.fast
def test_the_scan_follows_builtins_list_displays_and_functions_held_in_containers():
    assert read_in_c_of(Listed()) == read_in_c_of(Picked()) == {"per_key", "per_key[*]", "per_key[*].count",
                                                                "per_key[*].total"}
    assert read_in_c(Literal) == {"seen", "correct"}
    assert read_in_c_of(Handlers()) == {"correct", "seen", "stats.count", "stats.total", "meters[*].count",
                                        "meters[*].total"}  # not the callables themselves
    for how in ("function", "method", "helper"):  # what a call hands back: the container, or an entry
        assert {"per_key[*].count", "per_key.count"} <= read_in_c_of(PickedByCall(how)), how
    assert {"a.count", "b.count"} <= read_in_c(Comprehended)  # a comprehension's loop over a display of fields

    def keyed(self):  # a dict's keys are not what it holds: no read of its entries
        for key in self.per_key.keys():
            self.late.append(_LABELS_BY_KEY[key])
    assert uses(keyed.__code__, ("self",))[0] == set()
    assert {"by_key[*].count", "tallies[*].count"} <= read_in_c(Comprehended)
    reads = read_in_c(ThroughDisplays, ("_progress",))  # each form's: seen, a and b's counts, by_key's entries'
    assert {"weight", "seen", "a.count", "b.count", "by_key[*].count"} <= reads, reads
    assert "a.count" in read_in_c_of(Deep())
    assert {"stats.count", "stats.total", "per_key[*].count", "per_key[*].total"} <= read_in_c_of(BoundHandlers())


@pytest.mark.fast
def test_an_index_is_read_in_c_unless_a_watched_container_takes_it():
    assert read_in_c(Subscripts) == {"m", "q"}
    assert read_in_c_of(InHparams()) == {"hparams.stats.count", "hparams.stats.total"}


@pytest.mark.fast
def test_the_scan_finds_right_operands_read_in_c():
    assert read_in_c(Counting) == {"correct", "seen"}
    assert read_in_c(Steering) == {"seen"} and read_in_c(Tensors) == {"seen"}
    assert read_in_c(Constant) == {"weight"}
    assert read_in_c(Passed) == {"seen", "correct", "seen.**", "correct.**"}  # given to a library: what they hold too
    assert read_in_c_of(Passed()) == {"seen", "correct"}  # numbers hold nothing
    assert read_in_c(Extreme) == set()


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [3, 4, 5], []]], ids=["2", "3-one-idle"])
@pytest.mark.parametrize("recipe", [Counting, Steering, Tensors, Passed, Aliased, GivenSelf, Held, Called, GivenField,
                                    InModule, InHparams, PerKey, lambda: PerKey(container=list), Counted,
                                    Indexed, Sliced, Decorated, Unpacked, Looped, Enumerated, Callbacks, Dispatched,
                                    Listed, Picked, Literal, Handlers, PickedByCall,
                                    lambda: PickedByCall("method"), lambda: PickedByCall("helper"),
                                    Comprehended, lambda: Comprehended("values"), lambda: Comprehended("items"),
                                    lambda: Comprehended("list"), lambda: ThroughDisplays("product"),
                                    lambda: ThroughDisplays("values"), lambda: ThroughDisplays("map"),
                                    lambda: ThroughDisplays("def"), lambda: ThroughDisplays("key"), Deep])
def test_what_a_batch_computes_from_a_number_read_in_c_is_named(recipe, layout):
    """Merged as each rank did it (wrong), so named with the read that steered it
    (a rank without a batch reports no read)."""
    single, holders, merged = simulate(recipe, lambda h, b: h.compute_objectives(b), layout)
    named = set(merged.assumed) | set(merged.conflicts)
    differs = {name for name, want in vars(single).items() if _plain(getattr(holders[0], name)) != _plain(want)}
    assert differs and differs <= named, (differs, named)
    why = merged.assumed[sorted(differs)[0]]
    read = why[why.index("batches read [") + len("batches read "): why.index("] when") + 1]
    brain = recipe()
    numbers = {label for label in read_in_c_of(brain) if label != "weight"  # no batch changes it
               and any(isinstance(value, (int, float)) for value in values_at(brain, parts(label)))}
    assert numbers <= set(ast.literal_eval(read)) <= numbers | {"per_key", "by_key", "tallies"}  # loops read whole
    assert "read accumulated values in on_stage_end" in why


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [3, 4, 5], []]], ids=["2", "3-one-idle"])
@pytest.mark.parametrize("through", ["attribute", "local", "metric", "unchanged"])
def test_a_list_whose_entries_a_librarys_c_code_takes_is_read_whole(through, layout):
    """``torch.stack(self.losses)`` reads the list's entries in C, where its recording
    copy sees no iteration: on a rank it stacks that rank's losses only. Named, with
    what it computed; a list no batch changes, or one only given to ``isinstance``, is not."""
    assert {"losses.**", "acc.scores.**"} <= read_in_c(Stacked)
    assert "losses.**" not in read_in_c(StackedUnchanged) and "weights.**" in read_in_c(StackedUnchanged)
    recipe = StackedUnchanged if through == "unchanged" else Stacked
    single, holders, merged = simulate(lambda: recipe(through), lambda h, b: h.compute_objectives(b), layout)
    named = set(merged.assumed) | set(merged.conflicts)
    differs = {name for name, want in vars(single).items()
               if repr(_plain(getattr(holders[0], name))) != repr(_plain(want))}
    if through == "unchanged":
        assert not differs and not named, (differs, sorted(named))
    else:
        assert "late" in differs and differs <= named, (differs, sorted(named))
        assert "batches read [" in merged.assumed["late"], merged.assumed["late"]


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [3, 4, 5], []]], ids=["2", "3-one-idle"])
def test_a_field_found_by_a_name_a_call_computes_stands_for_every_field(layout):
    """``getattr(self, "SEEN".lower())``: any field may be the one read in C; those
    batches change are named as read, with what batches computed from them."""
    assert read_in_c(ComputedName) == {"{*}"} and {"seen", "correct", "weight"} <= read_in_c_of(ComputedName())
    single, holders, merged = simulate(ComputedName, lambda h, b: h.compute_objectives(b), layout)
    assert holders[0].late != single.late and "late" in merged.assumed, merged.assumed
    assert "batches read ['correct', 'seen']" in merged.assumed["late"], merged.assumed["late"]


class Plain:
    """An accumulator of the recipe's own whose method reads nothing."""

    def __init__(self):
        self.count, self.total = 0, 0

    def update(self, b):
        self.count += 1
        self.total += b


class Inner:
    def __init__(self):
        self.inner = Plain()


def _down_1(outer):  # the recipe's functions handing on what they are given, the last reading two objects below
    return _down_2(outer)


def _down_2(outer):
    return _down_3(outer)


def _down_3(outer):
    return _down_4(outer)


def _down_4(outer):
    return _down_5(outer)


def _down_5(outer):
    return 2.5 * outer.inner.count


class FieldsInC(Counting):
    """A library's function given an object reads its numbers in C: ``vars``, then
    ``json.dumps``."""

    def __init__(self):
        super().__init__()
        self.stats, self.config, self.outer = Plain(), Plain(), Inner()

    def _progress(self, b):
        self.stats.update(b)
        self.outer.inner.update(b)
        self._read(b)

    def _read(self, b):
        self.late.append(json.dumps(vars(self.stats)))


class DictInC(FieldsInC):
    def _read(self, b):  # its __dict__
        self.late.append(json.dumps(self.stats.__dict__))


class GetterInC(FieldsInC):
    def _read(self, b):  # a callable a library's call makes
        self.late.append(2.5 * operator.attrgetter("count")(self.stats))


class DeepInC(FieldsInC):
    def _read(self, b):  # five calls down, a number two objects below the value given
        self.late.append(_down_1(self.outer))


class NestedInC(FieldsInC):
    def _read(self, b):  # what the value's fields hold, read in C
        self.late.append(json.dumps(vars(self.outer), default=vars))


class Dumped(Plain):
    def dump(self):  # an object of the recipe's own giving itself to a library's function
        return json.dumps(vars(self))


class SelfInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.stats = Dumped()

    def _read(self, b):
        self.late.append(self.stats.dump())


class GotInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.per = {0: Plain(), 1: Plain()}

    def _read(self, b):  # an entry a dict's get hands back
        self.per[b % 2].update(b)
        meter = self.per.get(b % 2)
        self.late.append(json.dumps(vars(meter)))


class LocalInC(FieldsInC):
    def _read(self, b):  # through a local bound to a library's function
        dump = json.dumps
        self.late.append(dump(self.stats.__dict__))


class MethodInC(FieldsInC):
    def _read(self, b):  # a method of what a library's call makes
        self.late.append(json.JSONEncoder(default=vars).encode(self.stats))


class HeldInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.hparams = types.SimpleNamespace(dump=functools.partial(json.dumps, default=vars))  # !name:json.dumps

    def _read(self, b):  # a library's function hparams hold
        self.late.append(self.hparams.dump(self.stats))


def _dump(stats, indent):  # a helper of the recipe's with several parameters, one given to a library's function
    return json.dumps(vars(stats), indent=indent)


class PositionalInC(FieldsInC):
    def _read(self, b):  # given by position
        self.late.append(_dump(self.stats, 2))


class KeywordInC(FieldsInC):
    def _read(self, b):  # given by keyword
        self.late.append(_dump(indent=None, stats=self.stats))


class Snapshots(Plain):
    def snapshot(self):  # what its methods hand back holds its numbers
        return {"count": self.count, "total": self.total}

    def mean_of(self, b):
        return b / 2

    def counted(self):
        return self.count


class ReturnedInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.stats = Snapshots()

    def _read(self, b):  # a library's function given what a method of the recipe's hands back
        self.late.append(json.dumps(self.stats.snapshot()))


class ReturnedOperand(ReturnedInC):
    def _read(self, b):  # a float on the left of what a method hands back
        self.late.append(2.5 * self.stats.counted())


class ReturnedEntry(ReturnedInC):
    def _read(self, b):  # an entry of what a method hands back
        self.late.append(2.5 * self.stats.snapshot()["count"])


class ReturnedByLocal(ReturnedInC):
    def _read(self, b):  # the method bound to a local, then called
        snapshot = self.stats.snapshot
        self.late.append(json.dumps(snapshot()))


class ReturnedComputed(ReturnedInC):
    def _read(self, b):  # what a method computes anew: no field read in C
        self.late.append(2.5 * self.stats.mean_of(b) + 2.5 * self._halved(b))

    def _halved(self, b):
        return b / 2


def _snapshot(stats, digits=None):  # a helper of the recipe's handing back a dict of the numbers it is given
    return tests.test_c_reads._snapshot_of(stats) if digits is None else {"count": round(stats.count, digits)}


def _snapshot_of(stats):
    return {"count": stats.count, "total": stats.total}


class FunctionReturnedInC(FieldsInC):
    def _read(self, b):  # a library's function given what a module's function hands back, two functions deep
        self.late.append(json.dumps(_snapshot(self.stats)))


def _counts_of(b, stats):  # the value given second, handed back in a list
    return [stats.count, stats.total]


class FunctionEntryInC(FieldsInC):
    def _read(self, b):  # an entry of what a module's function hands back of its second argument
        self.late.append(2.5 * _counts_of(b, self.stats)[0])


class FunctionByLocalInC(FieldsInC):
    def _read(self, b):  # a module's function bound to a local, then called
        snapshot = _snapshot_of
        self.late.append(json.dumps(snapshot(self.stats)))


class HandlersInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.handlers = {"dump": functools.partial(json.dumps, default=vars)}

    def _read(self, b):  # a library's function held in a dict
        self.late.append(self.handlers["dump"](self.stats))


class SpreadInC(FieldsInC):
    def _read(self, b):  # given ahead of a spread sequence: its position is not known
        rest = (2,)
        self.late.append(_dump(self.stats, *rest))


class SpreadMappingInC(FieldsInC):
    def _read(self, b):  # given ahead of a spread mapping
        options = {"indent": 2}
        self.late.append(_dump(self.stats, **options))


class SpreadLocalInC(FieldsInC):
    def _read(self, b):  # in a local tuple spread into the arguments
        arguments = (self.stats, 2)
        self.late.append(_dump(*arguments))


def _dump_each(*values):  # a helper packing what it is given, read in C in a comprehension
    return json.dumps([vars(value) for value in values])


class PackedInC(FieldsInC):
    def _read(self, b):  # given to a *values parameter
        self.late.append(_dump_each(self.stats))


def _dump_looped(*values):  # the same, in a for loop, through another helper
    dumped = []
    for value in values:
        dumped.append(_dumped(value))
    return dumped


def _dumped(value):
    return json.dumps(vars(value))


class PackedLoopedInC(FieldsInC):
    def _read(self, b):  # given to a *values parameter with another object
        self.late.append(_dump_looped(self.config, self.stats))


def _dump_options(**options):  # a helper packing keywords
    return json.dumps(vars(options["stats"]))


class PackedKeywordInC(FieldsInC):
    def _read(self, b):  # given to a **options parameter
        self.late.append(_dump_options(stats=self.stats))


def _count_of(*values):  # hands back the number of the object it is given first
    return {"count": values[0].count}


class PackedReturnedInC(FieldsInC):
    def _read(self, b):  # a float on the left of what a helper hands back of a *values parameter
        self.late.append(2.5 * _count_of(self.stats)["count"])


class SpreadReturnedInC(FieldsInC):
    def _read(self, b):  # the same, given through a spread list
        arguments = [self.stats]
        self.late.append(2.5 * _count_of(*arguments)["count"])


class HeldReturnedInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.hparams = types.SimpleNamespace(snapshot=functools.partial(_snapshot_of))  # !name:recipe._snapshot_of

    def _read(self, b):  # a library's function given what a function of the recipe's hparams hold hands back
        self.late.append(json.dumps(self.hparams.snapshot(self.stats)))


class HeldEntryInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.hparams = types.SimpleNamespace(snapshot=_snapshot_of)

    def _read(self, b):  # a float on the left of an entry of it
        self.late.append(2.5 * self.hparams.snapshot(self.stats)["count"])


class HeldByLocalInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.snapshot = _snapshot_of

    def _read(self, b):  # a function of the recipe's an attribute holds, bound to a local, then called
        snapshot = self.snapshot
        self.late.append(json.dumps(snapshot(self.stats)))


class Writer:
    """An object of the recipe's own the Brain does not hold, whose bound methods it does."""

    def write(self, stats):
        return json.dumps(vars(stats))

    def snapshot(self, stats):
        return {"count": stats.count}


_WRITER = Writer()


class BoundInDictInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.handlers = {"write": _WRITER.write}

    def _read(self, b):  # a bound method of an object the Brain does not hold, held in a dict
        self.late.append(self.handlers["write"](self.stats))


class BoundReturnedInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.handlers = {"snapshot": _WRITER.snapshot}

    def _read(self, b):  # a library's function given what it hands back
        self.late.append(json.dumps(self.handlers["snapshot"](self.stats)))


class BoundFieldInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.write = _WRITER.write

    def _read(self, b):  # one an attribute holds
        self.late.append(self.write(self.stats))


class BuiltDictInC(FieldsInC):
    def _read(self, b):  # a library's function in a dict the batch builds: a callable the scan cannot tell
        dumpers = {"json": functools.partial(json.dumps, default=vars)}
        self.late.append(dumpers["json"](self.stats))


class BuiltListInC(FieldsInC):
    def _read(self, b):  # in a list the batch builds, given the object's __dict__
        dumpers = [json.dumps]
        self.late.append(dumpers[0](self.stats.__dict__))


def _dumper():  # a function of the recipe's handing back a library's function
    return json.dumps


def _square_root():
    return math.sqrt


class MadeInC(FieldsInC):
    def _read(self, b):  # a library's function a function of the recipe's hands back, then called
        self.late.append(_square_root()(self.stats.count))


class MadeLocalInC(FieldsInC):
    def _read(self, b):
        dump = _dumper()
        self.late.append(dump(self.stats.count))


class MadeByMethodInC(FieldsInC):
    def _format(self):  # a bound method of a string, handed back
        return "{:.3f}".format

    def _read(self, b):
        self.late.append(self._format()(self.stats.total))


class MadeHeldInC(FieldsInC):
    def __init__(self):
        super().__init__()
        self.dump = _dumper()  # held by an attribute

    def _read(self, b):
        self.late.append(self.dump(self.stats.count))


class UnchangedInC(FieldsInC):
    def _read(self, b):  # a library reads fields no batch changes; an object only iterated
        self.late.append(json.dumps(vars(self.config)) + str(list(enumerate([self.stats]))[0][0]))


def _accumulate(stats, b):  # a helper of the recipe's given an object and a batch's number, which C code takes
    stats.count += 1
    stats.total += int(float(b))


class Converted(FieldsInC):
    def _read(self, b):
        _accumulate(self.stats, b)


class CheckedOnly(FieldsInC):
    def _read(self, b):
        self.late.append(isinstance(self.stats, Plain))


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [3, 4, 5], []]], ids=["2", "3-one-idle"])
@pytest.mark.parametrize("recipe", [FieldsInC, DictInC, GetterInC, DeepInC, NestedInC, SelfInC, GotInC, LocalInC,
                                    MethodInC, HeldInC, PositionalInC, KeywordInC, ReturnedInC, ReturnedOperand,
                                    ReturnedEntry, ReturnedByLocal,
                                    FunctionReturnedInC, FunctionEntryInC, FunctionByLocalInC, HandlersInC,
                                    SpreadInC, SpreadMappingInC, SpreadLocalInC, PackedInC, PackedLoopedInC,
                                    PackedKeywordInC, PackedReturnedInC, SpreadReturnedInC, HeldReturnedInC,
                                    HeldEntryInC, HeldByLocalInC, BoundInDictInC, BoundReturnedInC, BoundFieldInC,
                                    BuiltDictInC, BuiltListInC, MadeInC, MadeLocalInC, MadeByMethodInC, MadeHeldInC,
                                    UnchangedInC, CheckedOnly, Converted,
                                    ReturnedComputed])
def test_a_librarys_function_given_an_object_reads_its_fields_in_c(recipe, layout):
    """``json.dumps(vars(self.stats))`` reads ``stats.count`` in C, where no probe sees:
    on a rank it reads that rank's count. Named, with what it computed, however the
    library's function is found (a global, a call's product, a local, ``hparams``, a
    dict's entry), five calls down, two objects below, through a helper's parameter
    matched by position or keyword, spread (``f(*args)``, ``f(**options)``) or packed
    (``def f(*values)``), or what a method or function of the recipe's hands back (one
    ``hparams``, an attribute or a dict holds too, a bound method of an object the Brain
    does not hold), or a callable the scan cannot tell (a dict or list the batch builds,
    what a function of the recipe's hands back);
    fields no batch changes, an object given to ``isinstance`` or only iterated, a
    helper's other parameter given to C code, what a method computes anew, are not."""
    reads = {DeepInC: {"outer.inner.count", "outer.inner.total"}, NestedInC: {"outer.inner.count", "outer.inner.total"},
             UnchangedInC: {"config.count", "config.total"},
             CheckedOnly: set(), Converted: set(), ReturnedComputed: set(), ReturnedOperand: {"stats.count"},
             ReturnedEntry: {"stats.count", "stats.total"}, PackedReturnedInC: {"stats.count"},
             SpreadReturnedInC: {"stats.count"}, BoundReturnedInC: {"stats.count"}, MadeInC: {"stats.count"},
             MadeLocalInC: {"stats.count"}, MadeByMethodInC: {"stats.total"}, MadeHeldInC: {"stats.count"},
             PackedLoopedInC: {"config.count", "config.total", "stats.count", "stats.total"},
             GotInC: {"per[*].count", "per[*].total"}}.get(
        recipe, {"stats.count", "stats.total"})
    brain = recipe()
    found = {label for label in read_in_c_of(brain) if label not in ("seen", "correct") and any(
        isinstance(value, (int, float)) for value in values_at(brain, parts(label)))}  # the numbers read
    assert found == reads, found
    single, holders, merged = simulate(recipe, lambda h, b: h.compute_objectives(b), layout)
    named = set(merged.assumed) | set(merged.conflicts)
    differs = {name for name, want in vars(single).items()
               if repr(_plain(getattr(holders[0], name))) != repr(_plain(want))}
    if recipe in (UnchangedInC, CheckedOnly, Converted, ReturnedComputed):
        assert not differs and not named, (differs, sorted(named))
    else:
        assert "late" in differs and differs <= named, (differs, sorted(named))
        assert "batches read [" in merged.assumed["late"], merged.assumed["late"]


class Described(Held):
    def _progress(self, b):  # the fields' reprs replay otherwise on a rank: stats['count'] is named, so is stats
        self.stats.update(b)
        self.late.append(len(str(vars(self.stats))))


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [3, 4, 5], []]], ids=["2", "3-one-idle"])
def test_a_value_named_in_part_is_named_whole(layout):
    """A read of ``stats.count`` that gives another answer on a rank names
    ``stats['count']``; what the same batch computed into ``stats.means`` differs
    too, so ``stats`` itself is named, not only that field."""
    single, holders, merged = simulate(Described, lambda h, b: h.compute_objectives(b), layout)
    differs = {name for name, want in vars(single).items() if _plain(getattr(holders[0], name)) != _plain(want)}
    assert {"stats", "late"} <= differs and differs <= set(merged.assumed), (differs, sorted(merged.assumed))


@pytest.mark.fast
def test_a_number_no_batch_changes_read_in_c_and_reads_after_the_merge_name_nothing():
    single, holders, merged = simulate(Constant, lambda h, b: h.compute_objectives(b), [[0, 2, 4], [1, 3, 5]])
    assert not merged.assumed and all(vars(h) == vars(single) for h in holders)
    assert all(h.on_stage_end() == single.on_stage_end() for h in holders)
    single, holders, merged = simulate(lambda: Held(Scaled), lambda h, b: h.compute_objectives(b), [[0, 2], [1]])
    assert not merged.assumed and all(vars(h.stats) == vars(single.stats) for h in holders)
    single, holders, merged = simulate(lambda: PerKey(Scaled), lambda h, b: h.compute_objectives(b), [[0, 1], [2]])
    assert not merged.assumed and all(_plain(h.per_key) == _plain(single.per_key) for h in holders)
    single, holders, merged = simulate(Extreme, lambda h, b: h.compute_objectives(b), [[0, 2, 4], [1, 3, 5]])
    assert not merged.assumed and all(h.low == single.low == 0 for h in holders)


def test_a_class_without_batch_methods_has_none():
    assert read_in_c(types.SimpleNamespace) == frozenset()


class Gathered(Counting):
    """Strings and sets batches grow, read by C code that takes their characters or
    entries directly (no method of the value is called)."""

    def __init__(self):
        super().__init__()
        self.text, self.labels, self.size = "", set(), 0

    def _progress(self, b):
        self.text += f"u{b};"
        self.labels.add(b % 4)
        self.size = len(frozenset(self.labels))
        self.late.append(len(json.dumps(self.text)))


@pytest.mark.fast
def test_strings_and_sets_c_code_is_given_are_named():
    assert {"text", "labels"} <= read_in_c(Gathered)
    single, holders, merged = simulate(Gathered, lambda h, b: h.compute_objectives(b), [[0, 1, 2], [3, 4, 5]])
    differs = {name for name, want in vars(single).items() if getattr(holders[0], name) != want}
    assert {"size", "late"} <= differs and differs <= set(merged.assumed) | set(merged.conflicts)


_SCORES = [5, 3, 8, 1, 9, 2]


def _one_process_and_ranks(recipe, layout):
    """``(one process, each simulated rank after the merge, the labels named)`` of
    ``recipe``'s batches, run alone and split as ``layout`` says (defaults on)."""
    single = recipe()
    for b in range(sum(map(len, layout))):
        single.compute_objectives(b)

    def brain():
        holder = recipe()
        holder._ddp_brain_attributes = frozenset({"_ddp_brain_attributes"})
        return holder
    holders, records, merged = simulate_stage(layout, brain, lambda h, b: h.compute_objectives(b), DDPEvalConfig())
    named = {*merged.attributes.conflicts, *merged.attributes.assumed} | {
        label for record in records for label in record.report["unmergeable"]}
    return single, holders, named


def _keep_hardest(heap, score):  # a helper of the recipe's keeping a heap
    heapq.heappush(heap, score)


class Heaped:
    """A heap of scores ``heapq`` keeps on a Brain list: its C code appends and moves
    entries in the list's memory, where no recording copy sees them."""

    def __init__(self):
        self.hardest = []

    def compute_objectives(self, b):
        heapq.heappush(self.hardest, _SCORES[b])


class HeapedByHelper(Heaped):
    def compute_objectives(self, b):
        _keep_hardest(self.hardest, _SCORES[b])


class HeapedThroughLocals(Heaped):
    def compute_objectives(self, b):  # locals bound by unpacking
        push, hardest = heapq.heappush, self.hardest
        push(hardest, _SCORES[b])


class HeapedByPartial(Heaped):
    def __init__(self):
        super().__init__()
        self.push = functools.partial(heapq.heappush, self.hardest)  # as `push: !name:heapq.heappush` would

    def compute_objectives(self, b):
        self.push(_SCORES[b])


class HeapedByLambda(Heaped):
    def __init__(self):
        super().__init__()
        self.keep = lambda score: heapq.heappush(self.hardest, score)  # a callable the bytecode scan does not follow

    def compute_objectives(self, b):
        self.keep(_SCORES[b])


class HeapedByLambdaOverARoot(HeapedByLambda):
    def __init__(self):
        super().__init__()
        self.hardest = [0]  # every score is larger: no rank's heap moves an entry, and one process's does


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2], [3, 4, 5]], [[0], [1], [2], [3], [4], [5]],
                                    [[0], [1], [2], [3], [4], [5], []]],
                         ids=["2", "6-one-batch-each", "7-one-idle"])
@pytest.mark.parametrize("recipe", [Heaped, HeapedByHelper, HeapedThroughLocals, HeapedByPartial, HeapedByLambda,
                                    HeapedByLambdaOverARoot])
def test_a_list_heapq_keeps_is_named_even_with_one_batch_a_rank(recipe, layout):
    """``heapq.heappush(self.hardest, s)``: with one batch a rank each list holds one
    entry, no reorder shows, and the lists were merged as appends, not in heap order:
    silently wrong. The list given to ``heapq``'s C code, directly, through a helper,
    locals or a ``functools.partial`` the Brain holds, is read whole in C: named. Through
    a lambda the scan does not follow, its length changed without its methods: named."""
    single, holders, named = _one_process_and_ranks(recipe, layout)
    assert any(h.hardest != single.hardest for h in holders)
    assert "hardest" in named, named


class ClosureReadsInC(Counting):
    """A lambda on the Brain closing over ``self``, whose ``torch.tensor(self.correct)``
    reads the watched count in C; what it steers is each rank's alone."""

    def __init__(self):
        super().__init__()
        self.passed = lambda: float(torch.tensor(self.correct)) > 1  # a callable the batch finds on the Brain

    def _progress(self, b):
        if self.passed():
            self.late.append(b)


class ClosureOverAHeldObject(Counting):
    def __init__(self):
        super().__init__()
        tally = self.tally = types.SimpleNamespace(count=0)
        self.dump = lambda: json.dumps(tally.count)  # closes over an object the Brain holds, not the Brain

    def _progress(self, b):
        self.tally.count += 1
        self.late.append(self.dump())


class ClosureThatOnlyAppends(Counting):
    def __init__(self):
        super().__init__()
        self.keep = lambda x: self.late.append(x)

    def _progress(self, b):
        self.keep(b)


class PercentFormatted(Counting):
    def _progress(self, b):  # str's own % formats the probe's int in C: no method of the probe's runs
        self.late.append("%d correct" % self.correct)


class PercentFormattedTuple(Counting):
    def _progress(self, b):
        self.late.append("%d/%d" % (self.correct, b))


class PropertyReadInC(Counting):
    @property
    def passed(self):  # the getter runs with the batch: 1.5 < self.correct reads the int in C
        return 1.5 < self.correct

    def _progress(self, b):
        if self.passed:
            self.late.append(b)


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2], [3, 4, 5]], [[0], [1], [2], [3], [4], [5], []]], ids=["2", "7"])
@pytest.mark.parametrize("recipe", [ClosureReadsInC, ClosureOverAHeldObject, PercentFormatted, PercentFormattedTuple,
                                    PropertyReadInC])
def test_a_watched_value_read_in_c_by_a_closure_a_format_or_a_property_is_named(recipe, layout):
    """A function the Brain holds that reaches the Brain (or an object it holds) through
    its closure, not its parameters, is scanned with its closure's variables; a number
    a text's ``%`` formats (alone or in a tuple), and a property of the recipe's the batch
    reads, are read in C: what they read is named with what it steered (silently wrong
    before)."""
    assert {"correct", "tally.count"} & read_in_c_of(recipe())
    single, holders, named = _one_process_and_ranks(recipe, layout)
    assert any(h.late != single.late for h in holders)
    assert "late" in named, named


class FormatsAConstant(Counting):
    def __init__(self):
        super().__init__()
        self.unit = "utt"

    def _progress(self, b):  # a value no batch changes, formatted in C: one process's
        self.late.append("%s %d" % (self.unit, b))


@pytest.mark.fast
@pytest.mark.parametrize("recipe", [ClosureThatOnlyAppends, FormatsAConstant])
def test_a_closure_that_only_appends_or_a_constant_formatted_merges_exactly_and_names_nothing(recipe):
    single, holders, merged = simulate(recipe, lambda h, b: h.compute_objectives(b), [[0], [1, 2], [3], [4, 5]])
    assert not merged.conflicts and not merged.assumed
    assert all(h.late == single.late and len(h.late) == 6 for h in holders)


class OwnEntryInC(Counting):
    def __init__(self):
        super().__init__()
        self.preds, self.counts = {}, {"n": 0}

    def _progress(self, b):  # the batch's own prediction, read back and given to C code
        self.preds[f"u{b}"] = b * 10
        self.late.append(json.dumps(self.preds[f"u{b}"]))


class CountedEntryInC(OwnEntryInC):
    def _progress(self, b):  # an entry the batch set from what it read of it: each rank's count
        self.counts["n"] += 1
        self.late.append(json.dumps(self.counts["n"]))


class DefaultEntryInC(OwnEntryInC):
    def _progress(self, b):  # as above, from a default on a rank's first batch
        self.preds["n"] = self.preds.get("n", 0) + 1
        self.late.append(json.dumps(self.preds["n"]))


class StoredEntryInC(OwnEntryInC):
    def _progress(self, b):  # the batch's own key, holding a watched number's rank-local value
        self.preds[f"u{b}"] = self.correct
        self.late.append(json.dumps(self.preds[f"u{b}"]))


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2], [3, 4, 5]], [[0], [1], [2]], [[0, 1, 2], [3, 4, 5], []]],
                         ids=["2", "one batch each", "3-one-idle"])
@pytest.mark.parametrize("recipe", [OwnEntryInC, CountedEntryInC, DefaultEntryInC, StoredEntryInC])
def test_a_dict_entry_its_batch_set_then_given_to_c_code_is_named_only_if_it_holds_a_ranks_value(recipe, layout):
    """``self.preds[utt] = p``, then ``json.dumps(self.preds[utt])``: the batch reads back
    its own value, as one process does; exact, nothing named (before, every value was
    named). An entry the batch set from a read of it (``+=``, ``get(k, 0) + 1``) or
    from a watched number holds the rank's own count: named."""
    single, holders, merged = simulate(recipe, lambda h, b: h.compute_objectives(b), layout)
    named = {label.split("[")[0].split(".")[0] for label in (*merged.assumed, *merged.conflicts)}
    differs = {name for name, want in vars(single).items() if repr(getattr(holders[0], name)) != repr(want)}
    if recipe is OwnEntryInC:
        assert not named and not differs, (named, differs)
    else:
        assert "late" in differs and differs <= named, (differs, named)
