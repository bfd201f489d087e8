"""The invariant of issue 32 on programs whose operations come from the types
themselves (tests/generated_programs.py): for any program, run as one process and
as N simulated ranks over any split of the batches (a rank with none included),
every value on every rank equals one process's, or is named at stage end.

Ranks are simulated with the stage's own record, merge and apply
(:func:`ddp_eval.state.bookkeeping.simulate`; only the collectives are left out).
Float tensors and arrays changed in place are compared within the documented
bound (docs/exactness.md). Also here: the idioms recipes write merge exactly and
name nothing, at any number of ranks. That the property fails with each check
switched off: tests/test_checks_switched_off.py.
"""

import collections
import functools
import hashlib
import io
import os
import pickle
import re
import types
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from speechbrain.utils.metric_stats import MetricStats

from ddp_eval.config import DDPEvalConfig
from ddp_eval.errors import DDPEvalError
from ddp_eval.stage._verify import first_difference
from ddp_eval.state.bookkeeping import simulate
from tests import generated_programs as grammar

MAX_BATCHES = 6


def test_the_grammar_is_taken_from_the_types(capsys):
    """Every public method of the containers, every in-place tensor method and two-input
    ufunc is in the grammar, unless it breaks the program's layout (printed)."""
    names = set(grammar.NAMES)
    for kind in grammar.CONTAINERS:
        assert {f"{kind.__name__}.{m}" for m in dir(kind) if not m.startswith("_")
                and callable(getattr(kind, m))} <= names
    assert {f"Tensor.{m}" for m in grammar.tensor_methods()} <= names | set(grammar.LEFT_OUT)
    assert {"Tensor.mul_", "Tensor.add_", "list.sort", "set.discard", "deque.rotate", "Counter.subtract",
            "OrderedDict.move_to_end", "bytearray.reverse", "numpy.maximum(out=)"} <= names
    with capsys.disabled():
        print(f"\n{len(names)} distinct operations ({len(grammar.LEFT_OUT)} left out: {grammar.LEFT_OUT})")
    assert len(names) > 300


def _within_rounding(got, want, n_batches):
    """Float tensors and arrays changed in place: within 2 n eps max|value| (docs/exactness.md)."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.is_floating_point():
        if got.shape != want.shape or got.dtype != want.dtype:
            return False
        finite = torch.isfinite(want)
        if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite].nan_to_num(),
                                                                           want[~finite].nan_to_num()):
            return False
        scale = float(want[finite].abs().max()) if finite.any() else 0.0
        return bool(((got[finite] - want[finite]).abs() <= 2 * n_batches * torch.finfo(want.dtype).eps * scale).all())
    if isinstance(got, np.ndarray) and isinstance(want, np.ndarray) and got.dtype.kind == "f":
        return _within_rounding(torch.from_numpy(got), torch.from_numpy(want), n_batches)
    return False


def _same_pickled(got, want):
    """State first_difference compares by identity (an iterator), compared by what it pickles to."""
    try:
        return pickle.dumps(got) == pickle.dumps(want)
    except Exception:
        return False


def run_program(per_batch, owners, world_size, start=False, config=None):
    """``(one process, [each rank's Brain after the merge] or None, named top-level attributes)``."""
    def batch(brain, b):
        torch.manual_seed(b)  # bernoulli_, cauchy_: the same draws in one process as on the rank of batch b
        for name in per_batch[b]:
            grammar.OPERATIONS[name](brain, b)

    single = grammar.Brain(start)
    for b in range(len(per_batch)):
        batch(single, b)
    layout = [[b for b in range(len(per_batch)) if owners[b] == r] for r in range(world_size)]
    try:
        brains, records, merged = simulate(layout, lambda: grammar.Brain(start), batch, config or DDPEvalConfig())
    except DDPEvalError as error:  # named as an error on every rank
        return single, None, {str(error)}
    named = set()
    for record in records:
        named |= set(record.report["unmergeable"])
    named |= set(merged.attributes.conflicts) | set(merged.attributes.assumed)
    return single, brains, Named(named)


class Named(set):
    """The top-level attributes named; ``labels``: the labels named, as the merge gave them."""

    def __init__(self, labels):
        super().__init__(label.split("[")[0].split(".")[0] for label in labels)
        self.labels = set(labels)

    def only_in_part(self, name):
        """The labels below ``name`` named, if ``name`` itself is not."""
        return set() if name in self.labels else {label for label in self.labels if _parts(label)[0] == name}


def _parts(label):
    """``stats['count']``, ``stats.count`` -> ``["stats", "count"]``."""
    return re.findall(r"[^.\[\]'\"]+", label)


def _under_named(path, labels):
    """Whether a difference at ``path`` lies within a value named at one of ``labels``."""
    return any(_parts(path)[:len(_parts(label))] == _parts(label) for label in labels)


def _unnamed_fields(namespace, held, like=None):
    """``{path: value}`` of a namespace's fields one level deep, but those whose object is
    in ``held`` (on ``like``, the rank's namespace, when given)."""
    like = namespace if like is None else like
    found = {}
    for name, value in vars(namespace).items():
        inner = vars(value) if isinstance(value, types.SimpleNamespace) else {"": value}
        inner_like = vars(getattr(like, name)) if isinstance(value, types.SimpleNamespace) else {"": getattr(
            like, name)}
        found.update({f"{name}.{key}": v for key, v in inner.items() if id(inner_like[key]) not in held})
    return found


def _stand_in(value, path, depth=3):
    """``(path, type name)`` of the first of ddp_eval's stand-ins (a probe, a recording
    copy) left in ``value`` after the stage, ``depth`` levels down, or None."""
    if type(value).__module__.startswith("ddp_eval"):
        return path, type(value).__name__
    if depth == 0 or isinstance(value, (str, bytes, torch.Tensor, np.ndarray, types.ModuleType, type)):
        return None
    if isinstance(value, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in list(value.items())]
    elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif type(getattr(value, "__dict__", None)) is dict and not callable(value):
        items = [(f"{path}.{k}", v) for k, v in vars(value).items()]
    else:
        return None
    return next((found for found in (_stand_in(v, p, depth - 1) for p, v in items) if found), None)


def silently_wrong(per_batch, owners, world_size, start=False):
    """The first value some rank holds that differs from one process and is not named,
    or a stand-in of ddp_eval's left in one, or None."""
    single, brains, named = run_program(per_batch, owners, world_size, start)
    if brains is None:
        return None
    for rank, brain in enumerate(brains):
        for name, value in vars(brain).items():
            left = _stand_in(value, name)
            if left is not None:
                return rank, (left[0], f"a {left[1]} left after the stage", "")
    for rank, brain in enumerate(brains):
        for name, want in vars(single).items():
            got = getattr(brain, name)
            if name == "hparams":  # its fields, but those that hold a named attribute's container (named with it)
                held = {id(getattr(brain, label)) for label in named if hasattr(brain, label)}
                got, want = _unnamed_fields(got, held), _unnamed_fields(want, held, like=got)
            if name in named and not named.only_in_part(name):
                continue  # named whole
            if _within_rounding(got, want, len(per_batch)) or _holds_named(got, brain, named):
                continue
            if isinstance(want, io.IOBase):  # first_difference reads __dict__, which a stream keeps empty
                if (got.getvalue(), got.tell()) != (want.getvalue(), want.tell()):
                    return rank, (name, repr(got.getvalue()), repr(want.getvalue()))
                continue
            difference = first_difference(got, want, name)
            if difference is not None and name in named and _under_named(difference[0], named.only_in_part(name)):
                continue  # named in part, and its first difference lies there
            if difference is not None and not _same_pickled(got, want):
                return rank, difference
    return None


def _holds_named(value, brain, named):
    """Whether ``value`` is a function or a ``functools.partial`` whose closure or
    arguments hold a named attribute's container, directly or through dicts, lists,
    tuples and objects up to three steps down (named with it)."""
    if not callable(value) or not (isinstance(value, functools.partial) or getattr(value, "__closure__", None)):
        return False
    held = {id(getattr(brain, label)) for label in named if hasattr(brain, label)}
    return any(id(v) in held for v in _reached(value, 3))


def _reached(value, depth):
    """What a function's cells, a partial's arguments, a dict's values, a list's or
    tuple's entries and an object's fields hold, ``depth`` steps down."""
    if depth == 0:
        return []
    if isinstance(value, functools.partial):
        inner = [*value.args, *value.keywords.values()]
    elif getattr(value, "__closure__", None):
        inner = [cell.cell_contents for cell in value.__closure__]
    elif isinstance(value, dict):
        inner = list(value.values())
    elif isinstance(value, (list, tuple)):
        inner = list(value)
    else:
        inner = list(getattr(value, "__dict__", {}).values()) if not isinstance(value, torch.Tensor) else []
    return inner + [x for v in inner for x in _reached(v, depth - 1)]


@st.composite
def programs(draw, names=grammar.NAMES):
    n_batches = draw(st.integers(1, MAX_BATCHES))
    world_size = draw(st.integers(1, 4))
    per_batch = [draw(st.lists(st.sampled_from(names), max_size=3)) for _ in range(n_batches)]
    owners = [draw(st.integers(0, world_size - 1)) for _ in range(n_batches)]
    return per_batch, owners, world_size, draw(st.booleans())


QUICK_LANE = os.environ.get("DDP_EVAL_QUICK_LANE") == "1"  # -m fast alone (conftest.py)
SHORT = settings(max_examples=60 if QUICK_LANE else 150, derandomize=True, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LONG = settings(max_examples=1000, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _check(program):
    per_batch, owners, world_size, start = program
    assume(any(per_batch))
    found = silently_wrong(per_batch, owners, world_size, start)
    assert found is None, f"rank {found[0]}: {found[1]} differs from one process and is not named; program " \
                          f"{per_batch}, owners {owners}, {world_size} ranks, start {start}"


@pytest.mark.fast
@SHORT
@given(programs())
def test_any_program_equals_one_process_or_is_named(program):
    _check(program)


@pytest.mark.timeout(900)
@LONG
@given(programs())
def test_any_program_equals_one_process_or_is_named_long(program):
    _check(program)


# What recipes write, each merged exactly at any number of ranks, naming nothing.
# (a tensor changed in place and rebuilt in one batch is named: each idiom set uses one way per attribute)
IDIOMS = {
    "in place": ["list.append", "list.extend", "list.__iadd__", "dict.__setitem__", "dict.update", "get(k, 0) + 1",
                 "setdefault().append", "Counter.update", "defaultdict.__setitem__", "str +=", "bytes +=",
                 "tuple +=", "list = list + [x]", "+= float", "+= int", "Tensor.add_", "tensor[i] += 1",
                 "torch.add(out=)", "tensor.data += t", "numpy.add.at", "torch.cat", "numpy.append",
                 "bytearray.append", "bytearray.extend", "set.add", "set.update", "set.__ior__",
                 "dataclass field +=", "dataclass float +=", "namespace +=", "namespace float +=",
                 "lazy metric object", "array[i:] += v", "multi metric.append", "d[u] = b; first.append(d[u])",
                 "deep[a][b][u] = b; first.append(it)"],
    "rebuilt": ["array = array + v", "tensor = tensor + t", "str = str + x"],
    "extremes": ["best = max(best, v)", "low = min(v, low)", "best_n = max(best_n, k)",
                 "best_by[k] = max(best_by[k], v)"],
}


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("batches_per_rank", [1, 2])
@pytest.mark.parametrize("idioms", IDIOMS)
def test_idioms_are_exact_and_name_nothing(world_size, batches_per_rank, idioms):
    n_batches = world_size * batches_per_rank
    owners = [b % world_size for b in range(n_batches)]
    single, brains, named = run_program([IDIOMS[idioms]] * n_batches, owners, world_size)
    assert brains is not None and named == set(), named
    for brain in brains:
        for name, want in vars(single).items():
            got = getattr(brain, name)
            assert _within_rounding(got, want, n_batches) or _same_pickled(got, want) or first_difference(
                got, want, name) is None


# Reads of a list's accumulated entries that steer what a batch appends (issue 37)
STEERING = ["if len(list) < k: append", "if x not in list: append", "if not list: append", "append(list[-1] + 1)",
            "for x in list: ... append", "list.append", "if len(dict) < k: d[new] = b", "d[k] = sum(d.values())",
            "if len(set) < k: add", "if k not in d: d[k] = b", "get(k, 0) + 1", "setdefault().append", "set |=",
            "if not first: first.append", "if len(first) < 2: first.append", "if x is None: x = []; x.append"]


@pytest.mark.fast
@SHORT
@given(programs(names=STEERING))
def test_appends_steered_by_a_read_equal_one_process_or_are_named(program):
    _check(program)


# Streams written per batch (concatenated), read back, and a generator advanced (issue 37)
STREAMS = [name for name in grammar.NAMES if name.startswith(("stream", "iterator"))]


@pytest.mark.fast
@SHORT
@given(programs(names=STREAMS))
def test_streams_and_iterators_equal_one_process_or_are_named(program):
    _check(program)


# A metric object's lists: SpeechBrain's append, subclasses that reorder or cut, dir(list) on its fields (issue 37)
METRIC = [name for name in grammar.NAMES if "metric" in name]


@pytest.mark.fast
@SHORT
@given(programs(names=METRIC))
def test_metric_objects_lists_equal_one_process_or_are_named(program):
    _check(program)


# A value bound anew from its previous one: types whose reads no probe sees (their operators from dir()), a
# new object made from the previous one's fields, a watched number stored in another value
REBOUND = sorted(grammar.rebinding_operations()) + [
    "frozen dataclass replace(n=n + 1)", "namespace = SimpleNamespace(n=ns.n + 1)", "d[k] = n", "x = [n, text]",
    "x = (x,)", "list.append(n)", "list.append(text)", "namespace.t = x", "+= int", "+= float", "str +=", "max",
    "min", "dict.__setitem__", "tuple +="]


@pytest.mark.fast
@SHORT
@given(programs(names=REBOUND))
def test_a_value_bound_anew_from_its_previous_one_equals_one_process_or_is_named(program):
    """``flag = flag or x``, ``s = s | {x}`` on a frozenset, a ``Fraction`` or NumPy
    integer summed, ``replace(acc, n=acc.n + 1)``, ``d[k] = self.n``,
    ``items.append(self.n)``: named unless one process's value, and no probe is left
    in what the batch bound or stored."""
    _check(program)


# Another reference to a watched container: a second attribute, a field of hparams one level deep (issue 37)
ALIASED = [name for name in grammar.OPERATIONS if "hparams" in name or "same_nested" in name or "by_stage" in name
           or "closure" in name or "outside object" in name or "partial's" in name or "tuple's" in name] + [
    "list.append", "nested.append([b])", "steer by nested[0]", "dict.__setitem__", "+= int"]


@pytest.mark.fast
@SHORT
@given(programs(names=ALIASED))
def test_a_container_changed_or_read_through_another_reference_equals_one_process_or_is_named(program):
    """``self.same = self.items``, ``{"valid": self.items}``, ``self.hparams.items``
    holding ``self.items``: each place holds the one recording copy for the stage, so
    what a batch changes or reads through it is on the one record; a place a batch
    bound anew is named."""
    _check(program)


class _Holder:
    """A Brain whose list, filled at stage start, two attributes hold, and whose log holds
    the list a previous stage bound to ``last_ids``."""

    def __init__(self):
        self._ddp_brain_attributes = frozenset({"_ddp_brain_attributes", "hparams"})
        self.items = self.same = [1, 2, 3]
        self.last_ids = ["u0"]
        self.tally = self.tally_alias = collections.defaultdict(int, a=1)
        self.log, self.n, self.hparams = [{"last_ids": self.last_ids}], 0, types.SimpleNamespace()


def _simulated(batch, layout):
    one = _Holder()
    for b in range(sum(map(len, layout))):
        batch(one, b)
    brains, records, merged = simulate(layout, _Holder, batch, DDPEvalConfig())
    named = {top for record in records for top in record.report["unmergeable"]}
    named |= set(merged.attributes.conflicts) | set(merged.attributes.assumed)
    return one, brains, {label.split("[")[0].split(".")[0] for label in named}


@pytest.mark.fast
def test_a_place_bound_anew_names_the_places_of_a_container_read_or_changed_and_only_then():
    """One rank binds ``self.same = []``; another reads ``len(self.same)``, which on that
    rank is the stage-start list: in one process, the new one. The places and what the
    read steered are named. A place bound anew whose container no batch changed or read
    (``self.last_ids = ids`` while the log holds the old list) stays exact and unnamed."""
    def read_after_rebind(h, b):
        if b == 0:
            h.same = []
        if b == 1 and len(h.same) > 1:
            h.n += 1

    one, brains, named = _simulated(read_after_rebind, [[0], [1]])
    assert one.n == 0 and any(brain.n != one.n for brain in brains)
    assert {"items", "same", "n"} <= named, named

    def last_ids(h, b):
        h.last_ids = [f"u{b}"]

    def through_the_rebound_place(h, b):  # a defaultdict's value changed through the place bound anew
        if b == 0:
            h.tally_alias = collections.defaultdict(int)
        if b == 1:
            h.tally_alias["a"] += 1

    one, brains, named = _simulated(through_the_rebound_place, [[0], [1]])
    assert any(dict(brain.tally) != dict(one.tally) for brain in brains)
    assert {"tally", "tally_alias"} <= named, named

    one, brains, named = _simulated(last_ids, [[0, 2], [1]])
    assert not named, named
    for brain in brains:
        assert (brain.last_ids, brain.log) == (one.last_ids, one.log) == (["u2"], [{"last_ids": ["u0"]}])


# A read of an accumulated value that steers a change of another (issue 37): the reads by every
# method dir() gives for int, float, list and torch.Tensor, and the builtins that read a value whole
METRIC_CHANGES = ["metric.append", "lazy metric inserts first", "lazy metric keeps its hardest",
                  "multi metric.append", "own metric.append"]
CHANGES = ["+= int", "+= float", "list.append", "list.__setitem__", "Tensor.add_", "Tensor.mul_", "numpy.add(out=)",
           *METRIC_CHANGES, "str +=", "bytes +=", "torch.cat", "numpy.append", "list = list + [x]", "tuple +="]
STEERED = sorted(grammar.STEERING_READS) + CHANGES
# one read of each kind, for the switched-off property (found in seconds, not among 322 operations)
STEERED_FEW = ["steer by int.__mod__", "steer by str(n)", "steer by Tensor.sum", "steer by list.count",
               "steer by list[-1]", "steer by tensor[0]", "steer by len of made_newest['c'].ids"] + CHANGES


@pytest.mark.fast
@SHORT
@given(programs(names=STEERED))
def test_reads_that_steer_another_value_equal_one_process_or_are_named(program):
    _check(program)


# the reads of metric objects' fields (held at stage start, made by a defaultdict, by a MultiMetricStats or by
# the recipe's code during it), among themselves
LAZY_BLEU = [name for name in grammar.NAMES if "lazy bleu" in name]  # targets bound over None by append
METRIC_STEERED = [name for name in grammar.STEERING_READS if " of " in name and name.split(" of ")[-1] not in (
    "grown", "arr_grown", "rebuilt", "tup")] + METRIC_CHANGES + ["+= int"]


@pytest.mark.fast
@SHORT
@given(programs(names=METRIC_STEERED))
def test_reads_of_metric_objects_fields_that_steer_equal_one_process_or_are_named(program):
    _check(program)


@pytest.mark.fast
def test_a_read_of_a_metric_object_the_recipes_code_made_is_seen(monkeypatch):
    """A metric object made in a batch by code that is not a factory gets recording
    copies: a MultiMetricStats's per-key object as its ``metrics`` dict takes it (a read
    of its lists in the batch that made it, on a rank whose batches come after another
    rank's, is seen), the recipe's own (in a dict) after that batch. A read of its lists
    that steers is named; with its lists left plain, the same programs are silently
    wrong. (For the recipe's own object in a dict, the read of its key already names it
    when two ranks make it.)"""
    from ddp_eval.state import _lazy_metrics

    own = ([["own metric.append", "steer by [-1] of own['x'].scores"]] * 4, [0, 1, 0, 1], 2)
    assert silently_wrong(*own) is None
    later = ([["steer by [-1] of multi['a'].scores", "multi metric.append"]] * 6, [0, 1, 0, 1, 0, 1], 2)
    # rank 1 makes multi.metrics['a'] in batch 2 and reads len(...scores) there: 1 entry, one process 3
    same = ([["multi metric.append"]] * 2 + [["multi metric.append", "steer by len of multi['a'].scores"]]
            + [["multi metric.append"]], [0, 0, 1, 0], 2)
    for program in (later, same):
        assert silently_wrong(*program) is None
    monkeypatch.setattr(_lazy_metrics, "LISTEN_TO_LISTS_MADE_ELSEWHERE", False)
    for program in (later, same):
        assert silently_wrong(*program) is not None


@pytest.mark.fast
@pytest.mark.parametrize("program", [
    ([["nested.append([b])"], ["nested.append([b])"], ["nested[0].append"]], [0, 1, 1], 2),
    # one process reads [0], rank 1 its first entry [2]: the branch differs
    ([["nested.append([b])"]] * 3 + [["steer by nested[0]"]], [0, 0, 1, 1], 2),
    # one process reads 0.05, rank 1 its first entry 1.15 (above steers()'s threshold)
    ([["tensor list.append"]] * 12 + [["steer by tensor list[0]"]], [0] * 11 + [1, 1], 2),
    # rank 1 holds two entries when it reads items[2] (IndexError), one process four
    ([["nested.append([b])"]] * 4 + [["steer by nested[2] out of range"]], [0, 0, 1, 1, 1], 2),
], ids=["changed in place", "read to steer", "tensor entry read", "out of range"])
def test_an_entry_batches_appended_read_by_its_index_from_the_start_is_seen(program):
    """``items[0]`` is a stage-start entry when the list held one at stage start, the same on
    every rank; otherwise it is the first entry a batch appended, on each rank its own
    batches' first: a read of it, or a change through it, is named, never merged as if
    ``items[0]`` were one entry. So is a read out of range on a rank (IndexError), which
    in one process may find an entry."""
    per_batch = program[0]
    assert silently_wrong(*program) is None
    assert silently_wrong(per_batch, [0] * len(per_batch), 1) is None


@pytest.mark.fast
@pytest.mark.parametrize("label, program", [
    # rank 0's one batch appends then sets first[0]: its own entry; in one process batch 0's
    ("first", ([["first.append", "first[i] = b"]] * 4, [1, 1, 1, 0], 2)),
    ("lazy", ([["lazy metric.scores.append", "lazy metric.scores.__setitem__"]] * 4, [1, 1, 1, 0], 2)),
    ("multi", ([["multi metric.append", "multi metric['a'].ids.__setitem__"]] * 4, [1, 1, 1, 0], 2)),
], ids=["attribute", "metric object a defaultdict made", "MultiMetricStats's per-key object"])
def test_an_entry_batches_appended_set_by_its_position_from_the_start_is_named(label, program):
    """``items[i] = x`` with ``i`` counted from the start past the stage-start entries
    sets, on a rank, one of its own batches' entries, in one process another batch's:
    named, even when the batch appended that entry itself (its record holds the new value)."""
    assert label in run_program(*program)[2]
    assert silently_wrong(*program) is None
    assert silently_wrong(program[0], [0] * 4, 1) is None


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_read_of_which_keys_a_multi_metric_stats_holds_is_seen(world_size):
    """``multi.metrics['a']`` read by the recipe's code where this rank has not made it yet
    (batch 3 made it on rank 0, batch 4 on rank 1 finds it absent and appends nothing; one
    process appends): named. SpeechBrain's own ``if key not in self.metrics`` in ``append``,
    followed by making the key, is not a read: appends alone stay exact and unnamed."""
    program = ([[], [], [], ["multi metric.append"], ["multi metric['a'].scores.__iadd__"]], [0, 0, 0, 0, 1],
               world_size)
    assert "multi" in run_program(*program)[2]
    assert silently_wrong(*program) is None
    appends = ([["multi metric.append"]] * 5, [0, 1, 0, 1, world_size - 1], world_size)
    single, brains, named = run_program(*appends)
    assert named == set() and silently_wrong(*appends) is None


@pytest.mark.fast
@pytest.mark.parametrize("label, program", [
    # n += self.tally.correct, which batches also change: the operand is what a rank's batches made of it
    ("n", ([["dataclass field +=", "n += tally.correct"]] * 4, [0, 1, 0, 1], 2)),
    ("n", ([["n += next(it)"]] * 4, [1, 1, 0, 0], 2)),  # the next item: after the rank's own batches only
    ("x", ([["x += rng.random()"]] * 4, [0, 1, 0, 1], 2)),  # a draw: from the rank's own generator state
], ids=["another watched number", "an iterator", "a random generator"])
def test_a_number_added_to_from_a_value_batches_change_is_named(label, program):
    """``n += v`` replays its operands in global batch order; an operand read from a value
    batches change (another watched number, an iterator, a random generator) is what
    the rank's own batches made of it, another number in one process: named (before,
    the iterator and the generator were named but the number merged silently wrong)."""
    assert label in run_program(*program)[2]
    assert silently_wrong(*program) is None
    constant = ([["n += tally.correct"]] * 4, [0, 1, 0, 1], 2)  # no batch changes tally: exact, nothing named
    assert run_program(*constant)[2] == set() and silently_wrong(*constant) is None


@pytest.mark.fast
def test_a_number_added_to_from_a_constant_keeps_its_merged_value_beside_another_read():
    """``self.total += self.weight`` (no batch changes ``weight``) is exact; a read whole of
    a growing list in the same batch names every value as assumed, merged as recorded,
    but does not leave ``total`` rank-local as if it were set after that read."""
    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), total=0.0,
                                     weight=0.25, items=[], last=0)

    def batch(h, b):
        h.items.append(b)
        h.last = len(h.items)
        h.total += h.weight

    single = make()
    for b in range(4):
        batch(single, b)
    brains, _, merged = simulate([[0, 2], [1, 3], []], make, batch, DDPEvalConfig())
    assert [brain.total for brain in brains] == [single.total] * 3 and "total" not in merged.attributes.conflicts


@pytest.mark.fast
@pytest.mark.parametrize("owners", [[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 1, 1]])
def test_a_per_key_object_a_batch_removes_from_a_multi_metric_stats_is_named(owners):
    """``multi.metrics.pop("a")`` in a batch, later batches making it again: named (before,
    the stage end crashed on a removed object, or merged its entries silently wrong)."""
    program = ([["multi metric.append"], ["multi metric.append", "multi metric.metrics.pop('a')"],
                ["multi metric.append"], ["multi metric.append"]], owners, 3)
    assert "multi" in run_program(*program)[2]
    assert silently_wrong(*program) is None


class _Scores(MetricStats):
    """A recipe's metric object that a rank with no batch can make too (no arguments)."""

    def __init__(self):
        super().__init__(metric=grammar._scores)


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 2, 4], [1, 3]], [[0, 1], [2, 3, 4], []]], ids=["2 ranks", "3, one idle"])
def test_the_lists_of_a_metric_object_made_during_the_stage_merge_on_the_attribute_engine(layout):
    """One engine: the lists of a metric object a ``defaultdict`` makes during the stage,
    or the recipe's own code makes, are watched and merged as a Brain attribute's are
    (the metric recorder sends none of them), and equal one process."""
    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}),
                                     per_class=collections.defaultdict(lambda: MetricStats(metric=grammar._scores)))

    def batch(h, b):
        h.per_class[f"c{b % 2}"].append([f"u{b}"], [float(b)])
        if b == 0 or not hasattr(h, "own"):
            h.own = _Scores()
        h.own.append([f"u{b}", f"v{b}"], [float(b), -float(b)])

    single = make()
    for b in range(5):
        batch(single, b)
    brains, records, merged = simulate(layout, make, batch, DDPEvalConfig())
    assert all(record.report["unmergeable"] == {} for record in records)
    sent_by_recorder = {(path, name) for record in records for path, state in record.state[0].items()
                        for name in state["lists"]}
    assert sent_by_recorder == set()
    assert {"per_class[c0].ids", "per_class[c1].scores", "own.ids", "own.scores"} <= set(merged.attributes.merged)
    for brain in brains:
        assert {k: (m.ids, m.scores) for k, m in brain.per_class.items()} == {
            k: (m.ids, m.scores) for k, m in single.per_class.items()}
        assert (brain.own.ids, brain.own.scores) == (single.own.ids, single.own.scores)


@pytest.mark.fast
def test_a_random_generator_no_batch_touches_is_not_named_and_one_a_batch_draws_from_is():
    """A ``torch.Generator`` pickles a new state tensor each time: compared by its state's
    bytes, one no batch touches is not named (before, it was, at every stage)."""
    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), x=0.0,
                                     gen=torch.Generator().manual_seed(0), np_gen=np.random.default_rng(0))

    def untouched(h, b):
        h.x += 0.5

    def draws(h, b):
        h.x += float(torch.rand(1, generator=h.gen))

    _, records, merged = simulate([[0, 2], [1]], make, untouched, DDPEvalConfig())
    assert all(record.report["unmergeable"] == {} for record in records) and not merged.attributes.assumed
    _, records, merged = simulate([[0, 2], [1]], make, draws, DDPEvalConfig())
    assert "gen" in records[0].report["unmergeable"] and "x" in merged.attributes.assumed


@pytest.mark.fast
@pytest.mark.parametrize("make_unread", [hashlib.sha256, zlib.compressobj], ids=["hash", "compressor"])
def test_an_object_ddp_eval_cannot_read_is_named_with_what_batches_computed_from_it(make_unread):
    """An object that cannot be pickled and keeps its state in C (a running hash, a
    compressor): whether batches changed or read it is unknown, so it is named, and so
    is what they computed from it (a digest appended per batch: each rank's own);
    listed in ``attributes_exclude`` it is the recipe's business."""
    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), unread=make_unread(),
                                     out=[])

    def batch(h, b):
        if hasattr(h.unread, "hexdigest"):
            h.unread.update(bytes([b]))
            h.out.append(h.unread.hexdigest())
        else:
            h.out.append(h.unread.compress(bytes([b]) * 10))

    _, records, merged = simulate([[0, 2], [1, 3]], make, batch, DDPEvalConfig())
    assert "cannot read" in records[0].report["unmergeable"]["unread"] and "out" in merged.attributes.assumed
    _, records, merged = simulate([[0, 2], [1, 3]], make, batch, DDPEvalConfig(attributes_exclude=["unread"]))
    assert records[0].report["unmergeable"] == {} and not merged.attributes.assumed


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 2, 4], [1, 3]], [[0], [1, 2], [3, 4]], [[], [0, 1, 2, 3, 4]]],
                         ids=["2 ranks", "3 ranks", "one idle"])
def test_state_a_function_keeps_between_batches_is_named_and_a_callable_object_merges(layout):
    """A closure's counter, a partial's bound list, a bound method of an object no
    attribute holds and a ``csv.writer`` (its file out of reach), changed by batches:
    each named, with what batches computed from them, never compared by identity. An
    object of the recipe's own with ``__call__`` merges field by field as one process's.
    Functions that keep nothing, or keep what no batch changes, name nothing."""
    import csv
    import functools
    import io

    def make(with_state):
        brain = types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}),
                                      total=grammar.CalledTotal(), loss_fn=functools.partial(max, 0),
                                      scale=lambda x, k=2: k * x, seen_total=[])
        brain.describe = lambda: len(vars(brain))  # holds the Brain: compared by identity
        if with_state:
            brain.counter, brain.keep = grammar.closure_counter(), functools.partial(list.append, [])
            brain.push = grammar.CalledTotal().__call__  # a bound method of an object no attribute holds
            brain.rows = csv.writer(io.StringIO())
        return brain

    def batch(brain, b):
        brain.total(float(b))
        brain.seen_total.append(brain.scale(brain.loss_fn(b)))
        if hasattr(brain, "counter"):
            brain.seen_total.append(brain.counter(b + 1))
            brain.keep(b)
            brain.push(b)
            brain.rows.writerow([b])

    one, _, _ = simulate([[0, 1, 2, 3, 4]], functools.partial(make, False), batch, DDPEvalConfig())
    brains, records, merged = simulate(layout, functools.partial(make, False), batch, DDPEvalConfig())
    assert all(r.report["unmergeable"] == {} for r in records) and not merged.attributes.assumed
    assert not merged.attributes.conflicts
    for brain in brains:
        assert vars(brain.total) == vars(one[0].total) and brain.seen_total == one[0].seen_total
    _, records, merged = simulate(layout, functools.partial(make, True), batch, DDPEvalConfig())
    for record, positions in zip(records, layout):
        named = record.report["unmergeable"]  # one it cannot read: named whether or not the rank had a batch
        assert set(named) == ({"counter", "keep", "push", "rows"} if positions else {"rows"}), named
        assert "cannot read" in named["rows"]
        assert not positions or "closure, defaults, arguments or object" in named["counter"]
    assert "seen_total" in merged.attributes.assumed


def _one_key_read(read, setter, at, gap, world_size):
    """Batch ``at`` (rank 0) adds a key or element that batch ``at + gap`` (rank 1, the
    last) reads (see generated_programs._call_with_key); ranks from 2 on get no batch."""
    per_batch = [[] for _ in range(at + gap + 1)]
    per_batch[at], per_batch[-1] = [setter], [f"steer by {read}"]
    return per_batch, [0] * (at + gap) + [1], world_size


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("start", [False, True])
@pytest.mark.parametrize("read, setter, at, gap", [
    ("dict.__contains__", "dict.__setitem__", 3, 3), ("dict.get", "dict.__setitem__", 3, 3),
    ("dict.__getitem__", "dict.__setitem__", 3, 3), ("dict.__getitem__", "dict.__setitem__", 0, 3),
    ("set.__contains__", "set.add", 4, 4)])
def test_a_read_of_one_key_another_rank_added_or_changed_is_seen(read, setter, at, gap, start, world_size):
    """``if k in d``, ``d.get(k)``, ``d[k]``, ``if x in s`` steering another value: on the
    reading rank the key is absent (or holds its stage-start value) while in one process an
    earlier batch on another rank added (or set) it. Each was silently wrong before 0.9.1."""
    assert silently_wrong(*_one_key_read(read, setter, at, gap, world_size), start) is None


@pytest.mark.fast
def test_a_key_found_absent_then_set_and_counted_is_seen():
    """``if k not in d: self.n += 1; d[k] = b`` (distinct speakers counted): with the key
    on two ranks, each counts it; the dict is named by its own record, and so is what the
    read steered."""
    assert silently_wrong([["if k not in d: n += 1; d[k] = b"]] * 4, [0, 0, 1, 1], 2) is None


# Programs the 10,000-program run by hand found silently wrong (docs/testing.md), kept as cases
FOUND_BY_HAND = [
    # min() on a rank where only its own batches had added to the value: one process's min sets it
    ([["+= float", "+= float"], [], [], ["+= float"], ["min"]], [3, 0, 2, 3, 2], 4, True),
    # a string set by a batch, then concatenated by a later one on the same rank: the set came first
    ([[], ["str set"], [], [], ["str = str + x"], []], [0, 0, 0, 0, 0, 0], 1, False),
    # (0.9.0) a metric object a defaultdict made, whose append sorts and cuts by binding new lists, one batch a
    # rank: each rank's sort of one entry changed nothing
    ([["lazy metric keeps its hardest"]] * 3, [1, 2, 0], 3, True),
    # (0.9.1) a number read by a method outside the fixed list (n.conjugate(), n.bit_length(), n & 1) on a rank
    # where another rank's earlier batch had added to it: the probe did not note it
    ([["steer by [-1] of own['x'].scores", "Tensor.apply_", "dict.get"], ["bytearray.replace"], [], [],
      ["steer by int.conjugate", "Tensor.i0_"], []], [0, 1, 1, 1, 1, 1], 2, False),
]


@pytest.mark.fast
@pytest.mark.parametrize("program", FOUND_BY_HAND, ids=["min after +=", "str set then +", "lazy metric rebinds",
                                                         "number method read"])
def test_programs_found_by_hand_equal_one_process_or_are_named(program):
    assert silently_wrong(*program) is None


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_read_of_bleu_targets_that_steers_is_named_and_its_appends_stay_exact(monkeypatch, world_size):
    """SpeechBrain's BLEUStats binds ``targets`` over None in a rank's first batch and
    extends each reference list after: merged exactly. A batch that reads a reference
    list (``len``, ``in``, ``[-1]``) and then appends is named; with those lists left
    plain, the same programs are silently wrong."""
    from ddp_eval.state import _lazy_metrics

    def cleared(program):  # targets None at stage start, as BLEUStats.clear() leaves them; reads after the first
        per_batch, owners, size = program
        return [["bleu metric.append"]] + per_batch[1:], [0] + owners[1:], size

    monkeypatch.setattr(grammar.Brain, "__init__", _bleu_cleared(grammar.Brain.__init__))
    owners = [b % world_size for b in range(2 * world_size)]
    exact = ([["bleu metric.append"]] * len(owners), owners, world_size)
    single, brains, named = run_program(*exact)
    assert named == set() and all(brain.bleu.targets == single.bleu.targets for brain in brains)
    steering = [cleared(([[read]] * len(owners), owners, world_size)) for read in (
        "if len(bleu metric.targets[0]) < 2: append", "if r not in bleu metric.targets[0]: append",
        "append(bleu metric.targets[0][-1])")]
    for program in steering:
        _, _, named = run_program(*program)
        assert "bleu" in named, program
        assert silently_wrong(*program) is None
    monkeypatch.setattr(_lazy_metrics, "LISTEN_TO_LISTS_MADE_ELSEWHERE", False)
    assert all(silently_wrong(*program) is not None for program in steering)


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 3])
def test_bleu_targets_bound_over_none_merge_exactly_and_what_else_a_batch_does_to_them_is_named(world_size):
    """``BLEUStats.targets`` starts as None and each rank's first ``append`` binds it (in
    one process, another batch's extension); the last rank gets no batch. Appends alone
    merge exactly and name nothing. An insert or a reverse in the batch that bound them,
    a reset to None, and a batch's own ``targets is None`` test that steered are named;
    with the hook off, each of those is silently wrong."""
    from ddp_eval.state import _lazy_metrics

    owners = [b % (world_size - 1) for b in range(2 * (world_size - 1))]
    single, brains, named = run_program([["lazy bleu metric.append"]] * len(owners), owners, world_size)
    assert named == set() and all(brain.lazy_bleu.targets == single.lazy_bleu.targets for brain in brains)
    one_each = list(range(world_size))  # one batch per rank: each binds
    corners = [([["lazy bleu metric.append", then]] * world_size, one_each, world_size) for then in (
        "lazy bleu metric.targets[1].reverse()", "lazy bleu metric.targets[0].insert(0, x)")]
    corners += [([["lazy bleu metric.append"], ["lazy bleu metric.targets = None"], ["lazy bleu metric.append"]],
                 [0, 1, 0], world_size),
                ([["lazy bleu metric.append"]] * 2 + [["if lazy bleu metric.targets is None or len(its [0]) < 2: "
                                                        "append"]], [0, 0, 1], world_size)]
    for program in corners:
        assert "lazy_bleu" in run_program(*program)[2], program
        assert silently_wrong(*program) is None
    with pytest.MonkeyPatch.context() as patch:  # the insert changes the lists' lengths: named without the hook
        patch.setattr(_lazy_metrics, "HOOK_NESTED_FIELDS", False)
        wrong = [program for program in corners if silently_wrong(*program) is not None]
    assert wrong == [corners[0], corners[2], corners[3]], wrong


def _bleu_cleared(init):
    def cleared_init(self, start=False):
        init(self, start)
        self.bleu.targets = None
    return cleared_init


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_read_of_a_multimetricstats_a_defaultdict_makes_is_seen_in_the_batch_that_made_it(monkeypatch, world_size):
    """A ``defaultdict`` of ``MultiMetricStats`` (one per decoding method) filled during the
    stage: its per-key objects get recording copies as they are made, in the batch that
    makes the ``MultiMetricStats``, so a read of their lists there (each rank's first
    batch, where one process has earlier batches' entries) names what it steered;
    appends alone stay exact and unnamed. With that off, the read is silently wrong."""
    from ddp_eval.state import _probes

    owners = list(range(world_size))
    appends = ([["lazy multi metric.append"]] * world_size, owners, world_size)
    single, brains, named = run_program(*appends)
    assert named == set() and silently_wrong(*appends) is None
    assert all(brain.made_multi["c"].metrics["a"].ids == single.made_multi["c"].metrics["a"].ids for brain in brains)
    steering = ([["lazy multi metric.append, steer by len of its ['a'].scores"]] * world_size, owners, world_size)
    assert "made_multi" in run_program(*steering)[2] and silently_wrong(*steering) is None
    monkeypatch.setattr(_probes, "ANNOUNCE_MADE_KEYS", False)
    assert silently_wrong(*steering) is not None


@pytest.mark.fast
def test_a_memoryview_held_on_a_watched_bytearray_stops_the_merge_with_an_error_naming_it():
    """Writes through the view go around the bytearray's recording copy: an error, not a value."""
    def make():
        brain = grammar.Brain()
        brain.buf = bytearray(4)
        brain.view = memoryview(brain.buf)
        return brain

    def batch(brain, b):
        brain.view[b] = 1

    with pytest.raises(DDPEvalError, match="'buf'.*memoryview"):
        simulate([[0, 2], [1, 3]], make, batch, DDPEvalConfig())
