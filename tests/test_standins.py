"""Issue 37: the recipe never sees a stand-in. During a batch a watched value may be a
probe or a recording copy; each behaves as the plain value does under pickle,
``copy.copy``/``copy.deepcopy``, ``torch.save`` then ``torch.load(weights_only=True)``,
``yaml.safe_dump``, ``yaml.dump``, ``json.dumps``, ``repr`` and ``str``: the same result, of the plain
type, or the same exception (a ``defaultdict`` the same factory). Metric objects made
during the stage (by a ``defaultdict``, a ``MultiMetricStats``'s keys) included. After
the stage every value is of its own type again, and equal to one process's, down to
the metric function of a per-key object a rank with no batch made.
Compared with one process running the same batches on plain values."""

import collections
import copy
import functools
import io
import json
import pickle
import re
import types

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, given, settings
from speechbrain.utils.metric_stats import ErrorRateStats, MetricStats, MultiMetricStats

from ddp_eval.config import DDPEvalConfig
from ddp_eval.errors import DDPEvalError
from ddp_eval.state.bookkeeping import simulate
from tests import generated_programs as grammar
from tests.test_operations_from_types import programs


def two_scores(predictions, targets):
    """A MultiMetricStats's metric: two scores per utterance."""
    return {"hit": torch.tensor([float(p == t) for p, t in zip(predictions, targets)]),
            "len": torch.tensor([float(len(p)) for p in predictions])}


class Brain:
    def __init__(self):
        self._ddp_brain_attributes = frozenset({"_ddp_brain_attributes", "seen"})
        self.n, self.x, self.text, self.blob, self.pair = 0, 0.0, "", b"", (0, "u")
        self.items, self.empty, self.table, self.labels = [0.5], [], {"a": 1}, {1}
        self.recent, self.counts, self.ordered = collections.deque([1], maxlen=3), collections.Counter(a=1), \
            collections.OrderedDict(a=1)
        self.per = collections.defaultdict(int, a=1)
        self.acc, self.arr, self.bytes_seen = torch.zeros(3), np.zeros(3), bytearray(b"a")
        self.wer = ErrorRateStats()  # a metric object: its lists are recording copies
        self.per_method = collections.defaultdict(ErrorRateStats)  # metric objects made during the stage
        self.multi = MultiMetricStats(metric=two_scores, batch_eval=True)  # per-key objects made during the stage
        self.same_items, self.by_stage = self.items, {"v": self.items}  # other places holding the list
        self.seen = []  # what each batch saw: not watched


def _torch_round_trip(value):
    buffer = io.BytesIO()
    torch.save({"v": value}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["v"]


SERIALISERS = {
    "pickle": lambda v: pickle.loads(pickle.dumps(v)),
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "torch.save/load(weights_only)": _torch_round_trip,
    "yaml.safe_dump": lambda v: yaml.safe_dump({"v": v}),
    "yaml.dump then load": lambda v: yaml.unsafe_load(yaml.dump({"v": v}))["v"],  # a tensor's text differs by run
    "json.dumps": json.dumps,
    "repr": lambda v: re.sub(r" at 0x[0-9a-f]+", "", repr(v)),  # a deque's, a Counter's name their class
    "str": lambda v: re.sub(r" at 0x[0-9a-f]+", "", str(v)),
}
WATCHED = [name for name in vars(Brain()) if name not in ("_ddp_brain_attributes", "seen")]


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(a, np.ndarray):
        return type(a) is type(b) and bool((a == b).all())
    if isinstance(a, collections.defaultdict):
        return type(a) is type(b) and a.default_factory is b.default_factory and a.keys() == b.keys() and all(
            _same(a[k], b[k]) for k in a)
    if isinstance(a, (MetricStats, MultiMetricStats)):
        return type(a) is type(b) and vars(a).keys() == vars(b).keys() and all(
            _same(v, vars(b)[k]) for k, v in vars(a).items())
    if type(a) is list and a and isinstance(a[0], torch.Tensor):
        return type(b) is list and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if callable(a) and not isinstance(a, type):  # a metric function: the same one, or one pickled back
        return type(a) is type(b) and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    return type(a) is type(b) and a == b



def _outcomes(brain):
    """``{(attribute, serialiser): (type of the result, result) or the exception's type}``."""
    found = {}
    for name in WATCHED:
        for label, serialise in SERIALISERS.items():
            try:
                result = serialise(getattr(brain, name))
                found[name, label] = (type(result), copy.deepcopy(result))  # copy.copy of a tensor aliases it
            except Exception as error:  # the outcome compared with one process
                found[name, label] = type(error)
    return found


def batch(brain, b):
    """Changes what merges, then serialises every value (a read before an append would steer it: named)."""
    brain.n += 1
    brain.x += 0.5
    brain.text += f"{b};"
    brain.pair += (b,)
    brain.items.append(b)
    brain.by_stage["v"].append(-b)  # the same list, through another place
    brain.table[f"k{b}"] = b
    brain.per[f"k{b % 2}"] += 1
    brain.acc += 1
    brain.wer.append([f"u{b}"], [["a", "b"]], [["a", "c"]])
    brain.per_method[f"m{b % 2}"].append([f"u{b}"], [["a"]], [["b"]])
    brain.multi.append([f"u{b}"], [f"p{b % 2}"], ["p0"])
    brain.seen.append({"outcomes": _outcomes(brain),
                       "kinds": {name: isinstance(getattr(brain, name), type(getattr(Brain(), name)))
                                 for name in WATCHED}})


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2]], [[0, 2], [1]], [[0, 1, 2], []]],
                         ids=["one process", "2 ranks", "one idle"])
def test_stand_ins_serialise_as_the_plain_values_during_a_batch_and_are_plain_after(layout):
    plain = Brain()
    for b in range(3):
        batch(plain, b)
    brains, records, _ = simulate(layout, Brain, batch, DDPEvalConfig())
    assert not any(r.report["unmergeable"] for r in records)
    for brain, positions in zip(brains, layout):
        alone = Brain()  # the same batches on plain values: what this rank holds during each
        for b in positions:
            batch(alone, b)
        for seen, want in zip(brain.seen, alone.seen):
            assert all(seen["kinds"].values()), seen["kinds"]  # an instance of the plain type
            for key, outcome in want["outcomes"].items():
                got = seen["outcomes"][key]
                if isinstance(outcome, type):
                    assert got is outcome, (key, got, outcome)
                else:
                    assert not isinstance(got, type), (key, got, outcome)
                    assert got[0] is outcome[0] and _same(got[1], outcome[1]), (key, got, outcome)
        for name in WATCHED:  # after the stage: the plain type, and one process's value
            assert type(getattr(brain, name)) is type(getattr(plain, name)), name
            assert _same(getattr(brain, name), getattr(plain, name)) or name in ("acc", "arr"), name
        assert torch.equal(brain.acc, plain.acc) and type(brain.wer.ids) is list
        assert brain.same_items is brain.items is brain.by_stage["v"]  # one list again, as in one process


def _as_seen(value, depth=0):
    """What a recipe's code reads of a value: its own type (a stand-in's plain base) and
    its contents, a stream's text, a metric object's fields."""
    kind = next(c.__name__ for c in type(value).__mro__ if not c.__module__.startswith("ddp_eval"))
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return kind, str(value.dtype), value.tolist()
    if isinstance(value, (io.StringIO, io.BytesIO)):
        return kind, value.getvalue(), value.tell()
    if hasattr(value, "__next__"):  # an iterator: wrapped, not of its own type (docs/exactness.md)
        return "iterator"
    if depth > 3:
        return kind
    if isinstance(value, (list, tuple, collections.deque)):
        return kind, [_as_seen(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return kind, sorted(map(repr, value))
    if isinstance(value, dict):
        factory = repr(getattr(value, "default_factory", None))
        return kind, factory, {k: _as_seen(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (int, float, str, bytes, bytearray, type(None))):
        return kind, repr(value), str(value)
    if hasattr(value, "__dict__") and not callable(value):
        return kind, {k: _as_seen(v, depth + 1) for k, v in vars(value).items() if k != "metric"}
    return kind


@pytest.mark.fast
@settings(max_examples=120, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs())
def test_during_each_batch_every_value_is_what_the_rank_alone_holds(program):
    """For any program (tests/generated_programs.py), after each batch every value, named
    ones included, reads as it does on a rank running its batches on plain values: a
    named running ``max`` keeps the rank's own, a list a metric object's subclass
    inserts into keeps what it inserted."""
    per_batch, owners, world_size, start = program
    assume(any(per_batch))
    seen = collections.defaultdict(list)

    def batch(brain, b):
        torch.manual_seed(b)
        for name in per_batch[b]:
            grammar.OPERATIONS[name](brain, b)
        seen[id(brain)].append(repr({name: _as_seen(v) for name, v in vars(brain).items()
                                     if name not in brain._ddp_brain_attributes}))

    layout = [[b for b in range(len(per_batch)) if owners[b] == r] for r in range(world_size)]
    brains = [grammar.Brain(start) for _ in layout]
    made = iter(brains)
    try:
        simulate(layout, lambda: next(made), batch, DDPEvalConfig())
    except DDPEvalError:
        pass  # named at stage end: what the batches saw is still compared
    alone_brains = [grammar.Brain(start) for _ in layout]  # all kept alive: seen is keyed by id
    for brain, alone, positions in zip(brains, alone_brains, layout):
        for b in positions:
            batch(alone, b)
        for b, got, want in zip(positions, seen[id(brain)], seen[id(alone)], strict=True):
            assert got == want, f"after batch {b} of {per_batch}, owners {owners}"


@pytest.mark.fast
def test_a_recording_copy_that_holds_itself_reads_as_the_plain_list():
    """``repr``/``str`` of a recording copy go through a plain copy: one that holds itself
    ends as the plain list does (``[...]``), not in a RecursionError."""
    from ddp_eval.state._recording import listening_copy

    copy, plain = listening_copy([1, 2], "items"), [1, 2]
    copy.append(copy)
    plain.append(plain)
    assert (repr(copy), str(copy)) == (repr(plain), str(plain))


class WithPartials:
    """A Brain whose ``hparams`` hold a ``functools.partial`` and a function, as
    ``!name:`` makes them, called in each batch."""

    def __init__(self):
        self._ddp_brain_attributes = frozenset({"_ddp_brain_attributes", "hparams"})
        self.hparams = types.SimpleNamespace(dump=functools.partial(json.dumps, sort_keys=True), scale=abs)
        self.counts = {"a": 0}

    def compute_objectives(self, b):
        self.counts["a"] += 1
        return self.hparams.dump({"b": b})


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2]], [[0, 2], [1]], [[0, 1, 2], []]],
                         ids=["one process", "2 ranks", "one idle"])
def test_the_partials_hparams_hold_pickle_after_the_stage_as_in_one_process(layout):
    """ddp_eval's walks over the state outside the Brain do not ask a partial for its
    ``__dict__`` (asking makes one, which its pickle then holds)."""
    plain = WithPartials()
    for b in range(3):
        plain.compute_objectives(b)
    brains, _, _ = simulate(layout, WithPartials, lambda brain, b: brain.compute_objectives(b), DDPEvalConfig())
    for brain in brains:
        assert pickle.dumps(brain.hparams.dump) == pickle.dumps(plain.hparams.dump)
        assert brain.counts == plain.counts
