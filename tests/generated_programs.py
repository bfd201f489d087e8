"""Recipe programs whose per-batch operations are taken from the types themselves.

The operations are not a list anyone wrote: every public method (and in-place
operator, item assignment and deletion) that ``dir()`` gives for ``list``,
``dict``, ``set``, ``collections.deque``, ``Counter``, ``OrderedDict``,
``defaultdict`` and ``bytearray``; every in-place method of ``torch.Tensor``
(``add_``, ``mul_``, ... as ``dir()`` lists them), index assignment, writes
through ``.data`` and ``out=``; every two-input NumPy ufunc applied in place,
``numpy.add.at`` and slice assignment. Added to those: rebinding with ``+`` and
``+=`` (str, bytes, tuples, lists, tensors, arrays), ``max``/``min``,
``numpy.append``, ``torch.cat``, ``torch.stack``; fields of a dataclass and of a
``SimpleNamespace``; metric objects created lazily in a ``defaultdict``; an
iterator consumed; values computed from accumulated state (``len(self.items)``);
appends steered by a read of the list (``if len(self.first) < 5: append``).

Each operation is a function ``(brain, batch) -> None`` of the batch's global
position only, so one process and any split of the batches over ranks run the
same program. Arguments come from a few shapes tried in order (none, a value,
an index, an index and a value, an iterable, a mapping); a call the type
rejects (``TypeError``) tries the next shape; a call that fails on the value
(``pop`` from an empty list) does nothing, in one process as on a rank.
"""

import collections
import collections.abc
import dataclasses
import fractions
import functools
import io
import json
import math
import operator
import random
import types
import warnings

import numpy as np
import torch
from speechbrain.utils.metric_stats import MetricStats, MultiMetricStats

from tests.patterns import bleu_stats

CONTAINERS = (list, dict, set, collections.deque, collections.Counter, collections.OrderedDict,
              collections.defaultdict, bytearray)
_FAILS = (ValueError, KeyError, IndexError, RuntimeError, OverflowError, ZeroDivisionError, AttributeError)


def value(b):
    return float(b) * 0.1 + 0.05  # not exactly representable: float order matters


@dataclasses.dataclass
class Tally:
    correct: int = 0
    total: float = 0.0


class Meter:
    """An accumulator of the recipe's own whose method reads its count in C."""

    def __init__(self):
        self.count, self.means = 0, []

    def update(self, v):
        self.count += 1
        self.means.append(2.5 * self.count + v)  # a float on the left of a watched int


class Count:
    """An object of the recipe's own whose count batches change; it reads nothing in C."""

    def __init__(self):
        self.count = 0


class DumpedCount(Count):
    def dump(self):  # gives itself to a library's function, which reads its count in C
        return json.dumps(vars(self))

    def snapshot(self):  # hands back a dict holding its count
        return {"count": self.count}


def _count_of(tally):  # a module's function handing back a dict holding the count it is given
    return {"count": tally.count}


def _dump_with(tally, indent):  # a module's function with two parameters, one given to a library's function
    return json.dumps(vars(tally), indent=indent)


def _dump_each(*tallies):  # a module's function packing what it is given, read in C in a comprehension
    return json.dumps([vars(tally) for tally in tallies])


_LABELS = [f"label{i}" for i in range(1000)]


class OutsideTally:
    """An object of the recipe's own outside the Brain, holding one of its containers."""

    def __init__(self, counts):
        self.counts = counts


def _update_meter(meter, b):  # a module's function a batch gives an object the Brain holds
    meter.update(value(b))


def _count_in_c(brain, b):  # a module's function a batch gives the Brain
    brain.c_count += 1
    brain.c_reads.append(0.5 * brain.c_count)


def _count_by_handler(brain, b):  # a module's function a dict the Brain holds maps to, a batch gives the Brain
    brain.f_count += 1
    brain.c_reads.append(0.5 * brain.f_count)


def _count_by_callback(brain, b):  # a module's function hparams hold, a batch gives the Brain
    brain.h_count += 1
    brain.c_reads.append(0.5 * brain.h_count)


@dataclasses.dataclass(frozen=True)
class FrozenTally:
    correct: int = 0


# values whose reads no probe sees, bound anew from the previous one: attribute -> (start, a batch's operand)
UNREADABLE = {"flag": (False, lambda b: b % 3 == 1), "frozen": (frozenset(), lambda b: frozenset({b % 3})),
              "cplx": (0j, lambda b: complex(b, 1)),
              "frac": (fractions.Fraction(0), lambda b: fractions.Fraction(b, 3)),
              "npint": (np.int64(0), lambda b: np.int64(b + 1))}
_OPERATORS = ("__add__", "__sub__", "__mul__", "__or__", "__and__", "__xor__", "__floordiv__", "__mod__",
              "__truediv__")


def rebinding_operations():
    """``x = x <op> y`` for every operator in ``dir()`` of each :data:`UNREADABLE`
    type that takes the batch's operand, and ``x = y``."""
    ops = {}
    for attribute, (start, operand) in UNREADABLE.items():
        kind = type(start).__name__
        ops[f"{kind} = y"] = _setter(attribute, lambda x, y: y, operand)
        for name in sorted(set(dir(type(start))) & set(_OPERATORS)):
            try:
                works = getattr(start, name)(operand(1)) is not NotImplemented
            except Exception:
                works = False
            if works:
                ops[f"{kind} = {kind}.{name}(y)"] = _setter(attribute, lambda x, y, name=name: getattr(x, name)(y),
                                                            operand)
    return ops


def _setter(attribute, compute, operand):
    return lambda h, b: setattr(h, attribute, compute(getattr(h, attribute), operand(b)))


class LazyStats(MetricStats):
    """A metric object a recipe creates per key during the stage, with number fields."""

    def __init__(self):
        super().__init__(metric=None)
        self.sum, self.n = 0.0, 0

    def add(self, x):
        self.sum += x
        self.n += 1


class CalledTotal:
    """A recipe's own accumulator called per batch (``self.total(loss)``)."""

    def __init__(self):
        self.sum, self.count = 0.0, 0

    def __call__(self, x):
        self.sum += x
        self.count += 1


def running_total():
    """A generator that yields the sum of what was sent to it."""
    total = 0
    while True:
        total += yield total


def _primed(generator):
    next(generator)
    return generator


def closure_counter():
    """A function that keeps a running sum in its closure and returns it."""
    seen = [0.0]

    def count(x):
        seen[0] += x
        return seen[0]
    return count


def _scores(values):
    return torch.tensor(values, dtype=torch.float64)


def _scores_by_key(values):
    """Two metrics at once, for a MultiMetricStats (which makes a MetricStats per key in a batch)."""
    return {"a": _scores(values), "b": _scores(values) * 2}


class KeepsHardest(MetricStats):
    """A recipe's own metric object whose append keeps its three hardest items:
    it sorts both lists by score and cuts them (issue 37)."""

    def __init__(self):
        super().__init__(metric=_scores)

    def append(self, ids, *args, **kwargs):
        super().append(ids, *args, **kwargs)
        order = sorted(range(len(self.scores)), key=lambda i: -float(self.scores[i]))[:3]
        self.ids, self.scores = [self.ids[i] for i in order], [self.scores[i] for i in order]


class NewestFirst(MetricStats):
    """A metric object that puts each new item first (``insert(0, ...)``)."""

    def __init__(self):
        super().__init__(metric=_scores)

    def append(self, ids, *args, **kwargs):
        for i, score in zip(ids, self.metric(*args, **kwargs)):
            self.ids.insert(0, i)
            self.scores.insert(0, score)


def _attribute(kind):
    return "c_" + kind.__name__.lower()


def _start(kind):
    """A container of three entries (so that an item assignment by index 0-2 never fails)."""
    if kind is bytearray:
        return bytearray(b"abc")
    if kind is collections.defaultdict:
        return collections.defaultdict(int, {"k0": 1, "k1": 2, "k2": 3})
    if kind in (dict, collections.Counter, collections.OrderedDict):
        return kind({"k0": 1, "k1": 2, "k2": 3})
    if kind is set:
        return {0, 1, 2}
    return kind([0.5, 1.5, 2.5])


def _counts():
    return collections.defaultdict(int)


def _counts_per_word():
    return collections.defaultdict(_counts)


def _add_deep(deep, x):
    """``deep["VALID"]["spk"]["n"] += x``, then a read of it: what it holds now."""
    deep["VALID"]["spk"]["n"] += x
    return deep["VALID"]["spk"]["n"]


class Brain:
    """What a recipe's Brain holds at stage start."""

    def __init__(self, start=False):
        self._ddp_brain_attributes = frozenset({"_ddp_brain_attributes", "hparams"})
        for kind in CONTAINERS:
            setattr(self, _attribute(kind), _start(kind))
        self.text, self.blob, self.tup, self.rebuilt = "", b"", (), []
        self.n, self.x, self.derived = 0, 0.0, None
        self.best, self.low, self.best_n, self.best_by = 0.0, 100.0, 0, {0: 0.0, 1: 0.0, 2: 0.0}  # running extremes
        self.vec, self.ivec = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.long)
        self.grown = torch.zeros(1, dtype=torch.float64)  # changes shape: its own attribute
        self.arr, self.iarr, self.arr_grown = np.zeros(3), np.zeros(3, dtype=np.int64), np.zeros(1)
        self.tally, self.ns = Tally(), types.SimpleNamespace(n=0, t=0.0)
        self.lazy = collections.defaultdict(LazyStats)
        self.it, self.last_item = iter(range(1000)), None
        self.running = _primed(running_total())  # a generator batches send() to
        self.rng = random.Random(0)
        self.called, self.count = CalledTotal(), closure_counter()  # functions that keep state between batches
        self.keep = functools.partial(list.append, [])
        self.first, self.made_over_none = [], None  # bound in on_stage_start: empty, and None made lazily
        self.pair = (0, 0.0)  # a tuple of numbers, rebound by batches: (count, total), (score, batch)
        self.deep = {"VALID": {"spk": {"n": 0}}}  # its innermost entries are not watched one by one
        self.made_deep = collections.defaultdict(_counts_per_word)  # made during the stage, three levels down
        for attribute, (start_value, _) in UNREADABLE.items():  # rebound from their previous value
            setattr(self, attribute, start_value)
        self.frozen_tally = FrozenTally()
        self.log, self.blob_log = io.StringIO(), io.BytesIO()
        self.m, self.hardest, self.newest = MetricStats(metric=_scores), KeepsHardest(), NewestFirst()
        self.made_hardest = collections.defaultdict(KeepsHardest)
        self.made_newest = collections.defaultdict(NewestFirst)
        self.multi = MultiMetricStats(metric=_scores_by_key, batch_eval=True)
        self.made_multi = collections.defaultdict(functools.partial(MultiMetricStats, metric=_scores_by_key,
                                                                    batch_eval=True))  # per decoding method
        self.own = {}  # a metric object the recipe's own code makes in a batch
        self.holding = {"m": MetricStats(metric=_scores), "n": 0, "ids": []}  # a metric object and other state
        self.deeper = {"VALID": {"m": MetricStats(metric=_scores)}}  # a metric object two levels down
        self.tracked = types.SimpleNamespace(m=MetricStats(metric=_scores), n=0)  # in an object of the recipe's
        self.made_lists, self.made_by_setdefault = collections.defaultdict(list), {}  # containers made per key
        self.bleu = bleu_stats()()  # nested: targets, a list per reference set (bound: reads need no None check)
        self.bleu.targets = [[]]
        self.lazy_bleu = bleu_stats()()  # targets None: its append binds them, each rank's first batch too
        self.t_list, self.nested = [], []  # a list of tensors (per-batch losses), a list of lists
        # other references to watched containers: a second attribute, fields of hparams (one level deep)
        self.same_nested, self.by_stage = self.nested, {"valid": self.nested}
        self.hparams = types.SimpleNamespace(c_dict=self.c_dict, holder=types.SimpleNamespace(c_list=self.c_list),
                                             count_in_c=_count_by_callback,  # a function of the recipe's
                                             dump=functools.partial(json.dumps, default=vars),  # !name:json.dumps
                                             count_of=functools.partial(_count_of))  # !name: of the recipe's
        # outside the Brain: a closure's variable, a field of an object of the recipe's own only a closure holds
        self.c_list_size = (lambda items: lambda: len(items))(self.c_list)
        self.c_dict_keys = (lambda tally: lambda: tally.counts)(OutsideTally(self.c_dict))
        self.c_list_len = functools.partial(len, self.c_list)  # a partial's argument
        self.c_dict_in_pair = (lambda pair: lambda: pair[0])((self.c_dict, "c_dict"))  # a tuple: cannot hold a copy
        self.nested_in_dicts = (lambda d: lambda: d["a"]["nested"])({"a": {"nested": self.nested}})
        self.u_count = self.k_count = self.n_count = self.h_count = 0
        self.l_meter, self.e_meters = Meter(), (Meter(),)
        self.c_count, self.c_reads, self.meter = 0, [], Meter()  # read in C by compute_objectives
        self.c_by_key, self.meters = {0: 0, 1: 0}, {0: Meter(), 1: Meter()}
        self.s_meters, self.d_count, self.f_count, self.handlers = [Meter()], 0, 0, {0: _count_by_handler}
        self.p_meters, self.g_meters = {0: Meter(), 1: Meter()}, {0: Meter(), 1: Meter()}
        self.q_a, self.q_b = Count(), Count()  # read in C by a comprehension over a tuple of them
        self.m_a, self.m_b, self.r_meter = Count(), Count(), Count()  # by a lambda given to map, a nested def
        self.v_weight, self.v_count, self.x_count = 2, 0, 0  # in displays, after a constant
        self.stacked = []  # a list of tensors torch.stack takes the entries of in C
        self.j_tally, self.o_tally, self.h_tally = Count(), Count(), Count()  # fields a library's function reads
        self.w_dumped, self.z_dumped, self.y_tally, self.i_tally = DumpedCount(), DumpedCount(), Count(), Count()
        self.a_tally, self.sp_tally, self.pk_tally, self.hr_tally = Count(), Count(), Count(), Count()
        self.dumpers = {"json": functools.partial(json.dumps, default=vars)}  # a library's function in a dict
        self.cl_count, self.pf_count, self.pp_count = 0, 0, 0  # read by a closure, a text's %, a property
        self.cl_passed = lambda: float(torch.tensor(self.cl_count)) > 1.5  # the Brain in its closure, not a parameter
        if start:  # a stage that starts from an earlier one's state
            self.c_list.append(9.5)
            self.t_list.append(torch.zeros(1, dtype=torch.float64))
            self.n, self.text = 5, "earlier "


    def compute_objectives(self, b, read):  # the batch method ddp_eval's bytecode scan starts from
        if read == "local":
            count = self.c_count
            self.c_reads.append(2.5 * count)
            self.c_count = count + 1
        elif read == "function":
            _count_in_c(self, b)
        elif read == "function given a field":
            _update_meter(self.meter, b)
        elif read == "entry":
            self.c_by_key[b % 2] += 1
            self.c_reads.append(0.5 * self.c_by_key[b % 2])
        elif read == "index":
            self.c_count += 1
            self.c_reads.append(_LABELS[self.c_count])
        elif read == "held in a dict":
            self.meters[b % 2].update(value(b))
        elif read == "unpacked":  # each form below reads fields no other one reads in C
            count, reads = self.u_count + 1, self.c_reads
            self.u_count, seen = count, self.u_count
            reads.append(2.5 * seen)
        elif read == "chosen":
            self.k_count += 1
            count = self.k_count if b % 2 else self.k_count + 1
            self.c_reads.append(1.5 * count)
        elif read == "looped":
            for meter in (self.l_meter,):
                meter.update(value(b))
        elif read == "enumerated":
            for at, meter in enumerate(self.e_meters):
                meter.update(value(b) + at)
        elif read == "callback":
            self.hparams.count_in_c(self, b)
        elif read == "sorted":
            for meter in sorted(self.s_meters, key=id):
                meter.update(value(b))
        elif read == "display":
            count = [self.d_count][0]
            self.d_count = count + 1
            self.c_reads.append(2.5 * count)
        elif read == "handler":
            self.handlers[b % 1](self, b)
        elif read == "comprehension":
            self.q_a.count += 1
            self.c_reads.append([2.5 * t.count for t in (self.q_a, self.q_b)][0])
        elif read == "map":
            self.m_b.count += 1
            self.c_reads.append(sum(map(lambda t: 2.5 * t.count, (self.m_a, self.m_b))))
        elif read == "nested def":
            def rate(meter):
                return 2.5 * meter.count
            self.r_meter.count += 1
            self.c_reads.append(rate(self.r_meter))
        elif read == "display values":
            self.v_count += 1
            self.c_reads.append(sum(1.5 * v for v in {"w": self.v_weight, "n": self.v_count}.values()))
        elif read == "product of a display":
            self.x_count += 1
            self.c_reads.append(math.prod((2.5, self.x_count)))
        elif read == "vars":
            self.j_tally.count += 1
            self.c_reads.append(json.dumps(vars(self.j_tally)))
        elif read == "attrgetter":
            self.o_tally.count += 1
            self.c_reads.append(2.5 * operator.attrgetter("count")(self.o_tally))
        elif read == "held library":
            self.h_tally.count += 1
            self.c_reads.append(self.hparams.dump(self.h_tally))
        elif read == "vars of self":
            self.w_dumped.count += 1
            self.c_reads.append(self.w_dumped.dump())
        elif read == "positional":
            self.y_tally.count += 1
            self.c_reads.append(_dump_with(self.y_tally, None))
        elif read == "returned":
            self.z_dumped.count += 1
            self.c_reads.append(json.dumps(self.z_dumped.snapshot()))
        elif read == "function returned":
            self.a_tally.count += 1
            self.c_reads.append(json.dumps(_count_of(self.a_tally)))
        elif read == "spread":
            self.sp_tally.count += 1
            rest = (None,)
            self.c_reads.append(_dump_with(self.sp_tally, *rest))
        elif read == "packed":
            self.pk_tally.count += 1
            self.c_reads.append(_dump_each(self.pk_tally))
        elif read == "held returned":
            self.hr_tally.count += 1
            self.c_reads.append(json.dumps(self.hparams.count_of(self.hr_tally)))
        elif read == "library in a dict":
            self.i_tally.count += 1
            self.c_reads.append(self.dumpers["json"](self.i_tally))
        elif read == "stacked":
            self.stacked.append(torch.tensor(value(b), dtype=torch.float64))
            self.c_reads.append(float(torch.stack(self.stacked).sum()))
        elif read in ("picked", "got"):  # what a call or the dict's own method hands back: one of its entries
            meter = _pick_meter(self.p_meters, b) if read == "picked" else self.g_meters.get(b % 2)
            meter.count += 1
            self.c_reads.append(2.5 * meter.count)
        elif read == "by name":
            getattr(self, f"_c_read_{'by_name'}")(b)
        elif read == "closure":
            self.cl_count += 1
            self.c_reads.append(self.cl_passed())
        elif read == "percent":
            self.pf_count += 1
            self.c_reads.append("%d/%d" % (self.pf_count, b) if b % 2 else "%d" % self.pf_count)
        elif read == "property":
            self.pp_count += 1
            self.c_reads.append(self.pp_high)
        else:
            self.meter.update(value(b))

    @property
    def pp_high(self):  # a property of the recipe's: its getter runs in the batch, reading pp_count in C
        return 1.5 < self.pp_count


    def _c_read_by_name(self, b):  # batch code found at run time: getattr(self, f"_c_read_{...}")
        self.n_count += 1
        self.c_reads.append(0.5 * self.n_count)


_C_READS = {  # operation -> the branch of Brain.compute_objectives it runs
    "read in C through a local": "local", "read in C by a function given self": "function",
    "read in C by a held object's method": "held", "read in C by a function given a field": "function given a field",
    "a dict's int entry read in C": "entry", "an int read in C as a list's index": "index",
    "read in C by a method of an object in a dict": "held in a dict", "read in C through a local unpacked": "unpacked",
    "read in C through a conditional expression": "chosen", "read in C in a loop over objects": "looped",
    "read in C by a method found by name": "by name", "read in C in a loop over enumerate": "enumerated",
    "read in C by a function held in hparams": "callback", "read in C in a loop over a sorted copy": "sorted",
    "read in C through a list display": "display", "read in C by a function held in a dict": "handler",
    "read in C of what a function given a dict hands back": "picked",
    "read in C of what a dict's get hands back": "got",
    "read in C in a comprehension over a tuple of objects": "comprehension",
    "read in C by a lambda given to map with a tuple of objects": "map",
    "read in C by a nested function given an object": "nested def",
    "read in C of a dict display's values": "display values",
    "read in C by C code given a tuple display": "product of a display",
    "a list of tensors torch.stack takes the entries of": "stacked",
    "an object's fields json.dumps(vars(o)) reads in C": "vars",
    "read in C by a callable a library's call makes": "attrgetter",
    "read in C by a library's function hparams hold": "held library",
    "read in C of vars(self) by a held object's method": "vars of self",
    "read in C by a helper's parameter given to a library's function": "positional",
    "read in C of what a method of the recipe's hands back": "returned",
    "read in C of what a function of the recipe's hands back": "function returned",
    "read in C by a library's function held in a dict": "library in a dict",
    "read in C by a helper given a field ahead of a spread tuple": "spread",
    "read in C by a helper packing its arguments (*values)": "packed",
    "read in C of what a function of the recipe's hparams hold hands back": "held returned",
    "read in C by a closure on the Brain": "closure", "a number a text's % formats": "percent",
    "read in C by a property's getter": "property"}


def _pick_meter(meters, b):  # a function of the recipe's own, given a dict of the Brain's
    return meters[b % 2]


def _read_in_c(h, b, read):
    h.compute_objectives(b, read)


def _arguments(kind, b):
    """The argument shapes tried, in order, for a method of ``kind`` in batch ``b``."""
    i = b % 3
    if kind is bytearray:
        v, many = 97 + b % 26, bytes([97 + b % 26])
    elif kind is set:
        v, many = b % 5, {b % 5}
    else:
        v, many = value(b), [value(b)]
    key = f"k{b % 4}"
    if issubclass(kind, dict):
        return [(), (key,), (key, b), ({key: b},), ([key],)]
    return [(), (v,), (i,), (i, v), (many,), (0, 1)]


def _call_method(kind, name, field=None, owner="m"):
    def run(brain, b):
        holder = _metric(brain, owner) if field is not None else None
        if holder is _NOT_MADE:  # a per-key object no batch has made yet
            return
        _call(getattr(brain, _attribute(kind)) if field is None else getattr(holder, field), kind, name, b)
    return run


def _call_made(kind, name):
    """``name`` called on a container made for a new key in that batch: a
    ``defaultdict(list)``'s, or ``setdefault``'s default (a set, a dict)."""
    def run(brain, b):
        _call(brain.made_lists[f"k{b % 2}"] if kind is list else brain.made_by_setdefault.setdefault(
            f"{kind.__name__}{b % 2}", kind()), kind, name, b)
    return run


def _call(target, kind, name, b):
    """``target.name(*args)`` with the first argument shape of :func:`_arguments` it takes."""
    # x *= n with n a value (97 for a bytearray) three times a batch would grow it past any memory
    for args in ([(2,)] if name == "__imul__" else _arguments(kind, b)):
        try:
            getattr(target, name)(*args)
            return
        except TypeError:
            continue
        except _FAILS:
            return


def container_methods(kind):
    """Public methods, in-place operators, item assignment and deletion, from ``dir(kind)``."""
    return sorted(name for name in dir(kind) if callable(getattr(kind, name)) and (
        not name.startswith("_") or name in ("__setitem__", "__delitem__")
        or (name.startswith("__i") and name[3:-2] in ("add", "sub", "mul", "and", "or", "xor"))))


def tensor_methods():
    """Every in-place method of ``torch.Tensor`` (``dir()``: public, ending in ``_``)."""
    return sorted(name for name in dir(torch.Tensor) if name.endswith("_") and not name.startswith("_"))


def _tensor_method(name):
    def run(brain, b):
        target = brain.vec if not name.startswith(("bitwise", "__i", "lshift", "rshift", "gcd", "lcm")) \
            else brain.ivec
        operand = torch.full((3,), value(b), dtype=target.dtype) if target.is_floating_point() else \
            torch.full((3,), b % 4 + 1, dtype=target.dtype)
        for args in ((), (operand,), (value(b),), (0, operand), (0, torch.tensor([b % 3]), operand)):
            try:
                with torch.no_grad():
                    getattr(target, name)(*args)
                return
            except (TypeError, NotImplementedError):
                continue
            except _FAILS:
                return
    return run


def numpy_ufuncs():
    """Every two-input NumPy ufunc with a float loop (``dir(numpy)``), applied in place."""
    return sorted(name for name in dir(np) if isinstance(getattr(np, name), np.ufunc) and getattr(np, name).nin == 2
                  and getattr(np, name).nout == 1 and "dd->d" in getattr(np, name).types)


def _ufunc(name):
    def run(brain, b):
        with np.errstate(all="ignore"):
            getattr(np, name)(brain.arr, value(b), out=brain.arr)
    return run


def _set_index(t, i, v):
    t[i] = v


def _full(b):
    return torch.full((3,), value(b), dtype=torch.float64)


def jumbled(b):
    """A batch's score, up and down with ``b``: which batch holds the extreme depends on all."""
    return value(b * 7 % 11)


# running extremes as recipes keep them: the builtin max or min, stored back where it was read
def _keep_max(h, b):
    h.best = max(h.best, jumbled(b))


def _keep_min(h, b):
    h.low = min(jumbled(b) * 10, h.low)


def _keep_max_int(h, b):
    h.best_n = max(h.best_n, b * 7 % 11)


def _keep_max_by_key(h, b):
    h.best_by[b % 3] = max(h.best_by[b % 3], jumbled(b))


def _keep_max_in_a_loop(h, b):  # a later item compared with an earlier one's score, not the batch-start value
    for score in (jumbled(b), jumbled(b + 5)):
        h.best = max(h.best, score)


def _keep_max_by_if(h, b):  # a comparison that steers code
    if jumbled(b) > h.best:
        h.best = jumbled(b)


def _int_made_float_by_max(h, b):  # a float compares with an int in C: no probe sees it
    h.n = max(h.n, jumbled(b))


def _int_made_float_by_sum(h, b):
    h.n = jumbled(b) + h.n


def _data_iadd(h, b):
    h.vec.data += _full(b)


def _fixed():
    """Operations no type lists: rebinding, fields, lazy metric objects, iterators, reads."""
    t = _full
    return {
        "tensor[i] += 1": lambda h, b: h.ivec.__setitem__(b % 3, h.ivec[b % 3] + 1),
        "tensor[i] = b": lambda h, b: _set_index(h.ivec, b % 3, b),
        "tensor.data += t": _data_iadd,
        "tensor.data.add_": lambda h, b: h.vec.data.add_(t(b)),
        "torch.add(out=)": lambda h, b: torch.add(h.vec, t(b), out=h.vec),
        "numpy.add.at": lambda h, b: np.add.at(h.iarr, [b % 3], 1),
        "array[i:] += v": lambda h, b: h.arr[b % 3:].__iadd__(value(b)),
        "array[i] = v": lambda h, b: _set_index(h.arr, b % 3, value(b)),
        "str +=": lambda h, b: setattr(h, "text", h.text + f"line{b};"),
        "str = str + x": lambda h, b: setattr(h, "text", h.text + str(b)),
        "str set": lambda h, b: setattr(h, "text", f"u{b}"),
        "bytes +=": lambda h, b: setattr(h, "blob", h.blob + bytes([b])),
        "tuple +=": lambda h, b: setattr(h, "tup", h.tup + (b,)),
        "list = list + [x]": lambda h, b: setattr(h, "rebuilt", h.rebuilt + [value(b)]),
        "tensor = tensor + t": lambda h, b: setattr(h, "vec", h.vec + t(b)),
        "array = array + v": lambda h, b: setattr(h, "arr", h.arr + value(b)),
        "best = max(best, v)": _keep_max,
        "low = min(v, low)": _keep_min,
        "best_n = max(best_n, k)": _keep_max_int,
        "best_by[k] = max(best_by[k], v)": _keep_max_by_key,
        "for v in scores: best = max(best, v)": _keep_max_in_a_loop,
        "if v > best: best = v": _keep_max_by_if,
        "n = max(n, v)": _int_made_float_by_max,
        "n = v + n": _int_made_float_by_sum,
        **{name: functools.partial(_read_in_c, read=read) for name, read in _C_READS.items()},
        "max": lambda h, b: setattr(h, "x", max(h.x, value(b))),
        "min": lambda h, b: setattr(h, "x", min(h.x, value(b))),
        "+= float": lambda h, b: setattr(h, "x", h.x + value(b)),
        "+= int": lambda h, b: setattr(h, "n", h.n + b),
        "numpy.append": lambda h, b: setattr(h, "arr_grown", np.append(h.arr_grown, value(b))),
        # NumPy's own methods that change an array in place (dir(numpy.ndarray), those that keep its shape)
        "ndarray.fill": lambda h, b: h.arr.fill(value(b)),
        "ndarray.sort": lambda h, b: h.arr.sort(),
        "ndarray.put": lambda h, b: h.arr.put([b % 3], [value(b)]),
        "ndarray.partition": lambda h, b: h.arr.partition(1),
        "ndarray.flat[i] = v": lambda h, b: h.arr.flat.__setitem__(b % 3, value(b)),
        "torch.cat": lambda h, b: setattr(h, "grown", torch.cat([h.grown, t(b)[:1]])),
        "torch.stack": lambda h, b: setattr(h, "vec", torch.stack([h.vec, t(b)]).sum(0)),
        "dataclass field +=": lambda h, b: setattr(h.tally, "correct", h.tally.correct + 1),
        "dataclass float +=": lambda h, b: setattr(h.tally, "total", h.tally.total + value(b)),
        "dataclass field =": lambda h, b: setattr(h.tally, "correct", b),
        "namespace +=": lambda h, b: setattr(h.ns, "n", h.ns.n + 1),
        "namespace float +=": lambda h, b: setattr(h.ns, "t", h.ns.t + value(b)),
        "lazy metric object": lambda h, b: h.lazy[f"c{b % 2}"].add(value(b)),
        "iterator consumed": lambda h, b: setattr(h, "last_item", next(h.it)),
        "iterator generator send": lambda h, b: h.c_list.append(h.running.send(b)),
        # a value added to a number from another watched value, an iterator, a random generator
        "n += tally.correct": lambda h, b: setattr(h, "n", h.n + h.tally.correct),
        "n += next(it)": lambda h, b: setattr(h, "n", h.n + next(h.it)),
        "x += rng.random()": lambda h, b: setattr(h, "x", h.x + h.rng.random()),
        "len(accumulated)": lambda h, b: setattr(h, "derived", len(h.c_list)),
        # functions that keep state: an object with __call__, a closure, a partial's bound list
        "called(x)": lambda h, b: h.called(value(b)),
        "x += count(x)": lambda h, b: setattr(h, "x", h.x + h.count(value(b))),
        "keep(b)": lambda h, b: h.keep(b),
        # reads of accumulated state that steer what is added (issue 37)
        "if len(list) < k: append": lambda h, b: h.c_list.append(b) if len(h.c_list) < 5 else None,
        "if x not in list: append": lambda h, b: h.c_list.append(b % 3) if b % 3 not in h.c_list else None,
        "if not list: append": lambda h, b: h.c_list.append(b) if not h.c_list else None,
        "append(list[-1] + 1)": lambda h, b: h.c_list.append(h.c_list[-1] + 1 if len(h.c_list) else b),
        "for x in list: ... append": lambda h, b: h.c_list.append(sum(1 for x in h.c_list if x == b % 2)),
        "if len(dict) < k: d[new] = b": lambda h, b: h.c_dict.__setitem__(f"n{b}", b) if len(h.c_dict) < 5 else None,
        "d[k] = sum(d.values())": lambda h, b: h.c_dict.__setitem__("total", sum(v for v in h.c_dict.values()
                                                                                 if isinstance(v, int))),
        "if len(set) < k: add": lambda h, b: h.c_set.add(10 + b) if len(h.c_set) < 5 else None,
        "if k not in d: n += 1; d[k] = b": lambda h, b: (setattr(h, "n", h.n + 1), h.c_dict.__setitem__(
            f"q{b % 2}", b)) if f"q{b % 2}" not in h.c_dict else None,  # distinct keys counted
        "if k not in d: d[k] = b": lambda h, b: h.c_dict.__setitem__(f"f{b % 2}", b) if f"f{b % 2}" not in h.c_dict
        else None,
        "if not first: first.append": lambda h, b: h.first.append(b) if not h.first else None,
        # entries three subscripts down, which are not watched one by one, and a key read back after its batch set it
        "deep[a][b][n] += 1": lambda h, b: _add_deep(h.deep, 1),
        "if (deep[a][b][n] += 1) == 1: first.append": lambda h, b: h.first.append(b) if _add_deep(h.deep, 1) == 1
        else None,
        "if (made_deep[a][b][n] += 1) == 2: first.append": lambda h, b: h.first.append(b) if _add_deep(
            h.made_deep, 1) == 2 else None,
        "deep[a][b][u] = b; first.append(it)": lambda h, b: (h.deep["VALID"]["spk"].__setitem__(f"u{b}", b),
                                                             h.first.append(h.deep["VALID"]["spk"][f"u{b}"])),
        "d[u] = b; first.append(d[u])": lambda h, b: (h.c_dict.__setitem__(f"u{b}", b), h.first.append(h.c_dict[
            f"u{b}"])),
        "if len(first) < 2: first.append": lambda h, b: h.first.append(b) if len(h.first) < 2 else None,
        "first.append": lambda h, b: h.first.append(b),
        "first[i] = b": lambda h, b: h.first.__setitem__(b % 3, b),  # i from the start: another entry in one process
        "if x is None: x = []; x.append": lambda h, b: (setattr(h, "made_over_none", []) if h.made_over_none is None
                                                        else None, h.made_over_none.append(b)),
        "if x is None: x = []; if len(x) < 2: x.append": lambda h, b: (
            setattr(h, "made_over_none", []) if h.made_over_none is None else None,
            h.made_over_none.append(b) if len(h.made_over_none) < 2 else None),
        "if x is None: x = []; if k not in x: x.append": lambda h, b: (
            setattr(h, "made_over_none", []) if h.made_over_none is None else None,
            h.made_over_none.append(b % 3) if b % 3 not in h.made_over_none else None),
        "stream.write": lambda h, b: h.log.write(f"u{b} {value(b)}\n"),
        "stream print(file=)": lambda h, b: print(f"u{b}", file=h.log),
        "stream bytes write": lambda h, b: h.blob_log.write(bytes([65 + b])),
        "stream: if tell() < k: write": lambda h, b: h.log.write(f"u{b}\n") if h.log.tell() < 8 else None,
        "stream: write(len(getvalue()))": lambda h, b: h.log.write(f"{len(h.log.getvalue())};"),
        "stream seek(0) then write": lambda h, b: (h.log.seek(0), h.log.write("x")),
        "first.append(len(stream.getvalue()))": lambda h, b: h.first.append(len(h.log.getvalue())),
        "sum(accumulated)": lambda h, b: setattr(h, "derived", sum(h.c_counter.values())),
        "from a number": lambda h, b: setattr(h, "derived", h.n * 2),
        "get(k, 0) + 1": lambda h, b: h.c_dict.__setitem__(f"g{b % 2}", h.c_dict.get(f"g{b % 2}", 0) + 1),
        "setdefault().append": lambda h, b: h.c_dict.setdefault(f"s{b % 2}", []).append(b),
        "set |=": lambda h, b: setattr(h, "c_set", h.c_set | {b % 4}),
        # metric objects' lists (issue 37): SpeechBrain's append, a subclass's, trimming, a read that steers
        "tensor list.append": lambda h, b: h.t_list.append(torch.tensor([value(b)], dtype=torch.float64)),
        "tensor list[0].add_": lambda h, b: _entry(h.t_list, 0).add_(1.0),
        "nested.append([b])": lambda h, b: h.nested.append([b]),
        "nested[0].append": lambda h, b: _entry(h.nested, 0, []).append(b),
        "metric.append": lambda h, b: h.m.append([f"u{b}"], [value(b)]),
        "metric keeps its hardest": lambda h, b: h.hardest.append([f"u{b}"], [value(b % 4)]),
        "metric inserts first": lambda h, b: h.newest.append([f"u{b}"], [value(b)]),
        "lazy metric keeps its hardest": lambda h, b: h.made_hardest[f"c{b % 2}"].append([f"u{b}"], [value(b % 4)]),
        "lazy metric inserts first": lambda h, b: h.made_newest["c"].append([f"u{b}"], [value(b)]),
        "lazy metric.append": lambda h, b: h.made_newest["c"].ids.append(f"u{b}"),
        "metric trimmed": lambda h, b: (setattr(h.m, "ids", h.m.ids[-2:]), setattr(h.m, "scores", h.m.scores[-2:])),
        "multi metric.append": lambda h, b: h.multi.append([f"u{b}"], [value(b)]),
        "lazy multi metric.append": lambda h, b: h.made_multi["c"].append([f"u{b}"], [value(b)]),
        "bleu metric.append": lambda h, b: h.bleu.append([f"u{b}"], [f"p{b}"], [[f"r{b}"]]),
        "if len(bleu metric.targets[0]) < 2: append": lambda h, b: h.bleu.append([f"u{b}"], [f"p{b}"], [[f"r{b}"]])
        if len(h.bleu.targets[0]) < 2 else None,
        "if r not in bleu metric.targets[0]: append": lambda h, b: h.bleu.append([f"u{b}"], [f"p{b}"], [[
            f"r{b % 2}"]]) if f"r{b % 2}" not in h.bleu.targets[0] else None,
        "append(bleu metric.targets[0][-1])": lambda h, b: h.bleu.append([f"u{b}"], [f"p{b}"], [[
            h.bleu.targets[0][-1] + "x" if h.bleu.targets[0] else "r"]]),
        "bleu metric.targets[0].sort()": lambda h, b: h.bleu.targets[0].sort(reverse=True),
        "lazy bleu metric.append": lambda h, b: h.lazy_bleu.append([f"u{b}"], [f"p{b}"], [[f"r{b}"], [f"s{b}"]]),
        "lazy bleu metric.targets[0].insert(0, x)": lambda h, b: h.lazy_bleu.targets[0].insert(0, f"x{b}")
        if h.lazy_bleu.targets is not None else None,
        "lazy bleu metric.targets[1].reverse()": lambda h, b: h.lazy_bleu.targets[1].reverse()
        if h.lazy_bleu.targets is not None else None,
        "lazy bleu metric.targets = None": lambda h, b: setattr(h.lazy_bleu, "targets", None),
        "if lazy bleu metric.targets is None or len(its [0]) < 2: append": lambda h, b: h.lazy_bleu.append(
            [f"u{b}"], [f"p{b}"], [[f"r{b}"], [f"s{b}"]]) if h.lazy_bleu.targets is None or len(
            h.lazy_bleu.targets[0]) < 2 else None,
        "multi metric.metrics.pop('a')": lambda h, b: h.multi.metrics.pop("a"),
        "own metric.append": lambda h, b: (h.own if "x" in h.own else h.own.setdefault("x", MetricStats(
            metric=_scores)))["x"].append([f"u{b}"], [value(b)]),
        "holding metric.append": lambda h, b: h.holding["m"].append([f"u{b}"], [value(b)]),
        "holding metric's dict['n'] += 1": lambda h, b: h.holding.__setitem__("n", h.holding["n"] + 1),
        "holding metric's dict['ids'].append": lambda h, b: h.holding["ids"].append(b),
        "own metric's dict['n'] = get + 1": lambda h, b: h.own.__setitem__("n", h.own.get("n", 0) + 1),
        "deeper metric.append": lambda h, b: h.deeper["VALID"]["m"].append([f"u{b}"], [value(b)]),
        "deeper metric.ids.sort(reverse=True)": lambda h, b: h.deeper["VALID"]["m"].ids.sort(reverse=True),
        "tracked metric.append": lambda h, b: h.tracked.m.append([f"u{b}"], [value(b)]),
        "tracked metric's namespace.n += 1": lambda h, b: setattr(h.tracked, "n", h.tracked.n + 1),
        "if len(metric.ids) < k: append": lambda h, b: h.m.append([f"u{b}"], [value(b)]) if len(h.m.ids) < 2
        else None,
        # through another reference to a watched container
        "hparams.holder.c_list.append": lambda h, b: h.hparams.holder.c_list.append(value(b)),
        "hparams.c_dict[k] += 1": lambda h, b: h.hparams.c_dict.__setitem__(f"k{b % 4}", h.hparams.c_dict.get(
            f"k{b % 4}", 0) + 1),
        "same_nested.append([b])": lambda h, b: h.same_nested.append([-b]),
        "same_nested = []": lambda h, b: setattr(h, "same_nested", []),
        "by_stage['valid'].append([b])": lambda h, b: h.by_stage["valid"].append([b + 100]),
        "by_stage['valid'] = []": lambda h, b: h.by_stage.__setitem__("valid", []),
        # a new object computed from the previous one's fields, a watched number stored elsewhere
        "frozen dataclass replace(n=n + 1)": lambda h, b: setattr(h, "frozen_tally", dataclasses.replace(
            h.frozen_tally, correct=h.frozen_tally.correct + 1)),
        "namespace = SimpleNamespace(n=ns.n + 1)": lambda h, b: setattr(h, "ns", types.SimpleNamespace(
            n=h.ns.n + 1, t=h.ns.t)),
        "d[k] = n": lambda h, b: h.c_dict.__setitem__("snap", h.n),
        "x = [n, text]": lambda h, b: setattr(h, "derived", [h.n, h.text]),
        "x = (x,)": lambda h, b: setattr(h, "derived", (h.x,)),
        "pair = (pair[0] + 1, pair[1] + v)": lambda h, b: setattr(h, "pair", (h.pair[0] + 1, h.pair[1] + value(b))),
        "pair = min(pair, (b, v))": lambda h, b: setattr(h, "pair", min(h.pair, (b % 3, value(b)))),
        "pair = (b, v) if v > pair[1] else pair": lambda h, b: setattr(
            h, "pair", (b, value(b)) if value(b) > h.pair[1] + 0.2 else h.pair),
        "n, t = pair; pair = (n + 1, t)": lambda h, b: setattr(h, "pair", (lambda n, t: (n + 1, t))(*h.pair)),
        "pair = (b, v)": lambda h, b: setattr(h, "pair", (b, value(b))),
        "pair += (b,)": lambda h, b: setattr(h, "pair", h.pair + (b,)),
        "if len(pair) < 4: first.append": lambda h, b: h.first.append(b) if len(h.pair) < 4 else None,
        "list.append(n)": lambda h, b: h.c_list.append(h.n),
        "list.append(text)": lambda h, b: h.c_list.append(h.text),
        "namespace.t = x": lambda h, b: setattr(h.ns, "t", h.x),
    }


# object plumbing, not a read of the value
_PLUMBING = {"__class__", "__init__", "__new__", "__getattribute__", "__setattr__", "__delattr__", "__init_subclass__",
             "__subclasshook__", "__reduce__", "__reduce_ex__", "__getnewargs__", "__sizeof__", "__dir__",
             "__getstate__", "__class_getitem__", "__set_format__", "__getformat__", "from_bytes", "fromhex",
             "__new_member__"}


# ndarray methods that change the array (the grammar's writes), write a file, or give an alias or a device
_ARRAY_NOT_READ = {"fill", "sort", "put", "partition", "resize", "setfield", "setflags", "dump", "tofile", "view",
                   "to_device"}


def steers(result):
    """A branch on what a read gave, the same function of the value in one process and on a rank."""
    if isinstance(result, bool):  # k in d, x == y: the answer itself
        return result
    if isinstance(result, collections.abc.Iterator):  # iter(text): what it gives, not its address
        result = list(result)
    if isinstance(result, torch.Tensor):
        return bool(torch.as_tensor(result).detach().double().nan_to_num().sum() > 1.0)
    if isinstance(result, (list, tuple)) and result and isinstance(result[0], torch.Tensor):
        return steers(result[0])
    return sum(map(ord, repr(result))) % 3 == 0


def _reading(kind, name, attribute, tries=((), (2,), (1, 2))):
    """``if steers(getattr(value, name)(...)): c_list.append(b)`` on ``brain.attribute``."""
    def run(brain, b):
        target = getattr(brain, attribute)
        for args in tries:
            try:
                result = getattr(target, name)(*args)
            except TypeError:
                continue
            except (*_FAILS, NotImplementedError):
                return
            if steers(result):
                brain.c_list.append(b)
            return
    return run


def steering_reads():
    """``{name: op}``: a read of an accumulated value, by every method ``dir()`` gives
    for ``int`` (of ``n``), ``float`` (of ``x``), ``str`` (of ``text``), ``bytes`` (of
    ``blob``) and ``list`` (of ``c_list``, steering ``n``), every method of
    ``torch.Tensor`` that leaves ``vec`` as it is, the length of a tensor and an array
    batches concatenate to, and the builtins that read a value whole (``str``,
    ``format``, ``hash``, ``range``), followed by an append that the read steers."""
    ops = {}
    for kind, attribute in ((int, "n"), (float, "x")):
        for name in dir(kind):
            if callable(getattr(kind, name)) and name not in _PLUMBING:
                ops[f"steer by {kind.__name__}.{name}"] = _reading(kind, name, attribute)
    for kind, attribute, text in ((str, "text", "1;"), (bytes, "blob", b"\x01")):  # appended to by batches
        for name in dir(kind):
            if callable(getattr(kind, name)) and name not in _PLUMBING:
                ops[f"steer by {kind.__name__}.{name}"] = _reading(kind, name, attribute, (
                    (), (text,), (2,), (text, text), (1, 2)))
        for label, read in {"str": str, "repr": repr, "format": lambda v: f"<{v}>"}.items():
            ops[f"steer by {label}({attribute})"] = lambda h, b, attribute=attribute, read=read: h.c_list.append(
                b) if steers(read(getattr(h, attribute))) else None
    for attribute in ("grown", "arr_grown"):  # the length of a tensor or array batches concatenate to, its sum
        for label, read in {"len": len, "shape[0]": lambda v: v.shape[0], "size": lambda v: v.size(0) if isinstance(
                v, torch.Tensor) else v.size, "numel": lambda v: v.numel() if isinstance(v, torch.Tensor) else
                v.shape[0], "sum": lambda v: int(v.sum() * 10)}.items():
            ops[f"steer by {label} of {attribute}"] = lambda h, b, attribute=attribute, read=read: h.c_list.append(
                b) if read(getattr(h, attribute)) % 2 else None
    for attribute in ("rebuilt", "tup"):  # a list and a tuple batches rebuild (x = x + [y])
        for label, read in {"len": len, "[-1]": lambda v: v[-1] if v else 0, "sum": sum}.items():
            ops[f"steer by {label} of {attribute}"] = lambda h, b, attribute=attribute, read=read: h.c_list.append(
                b) if int(read(getattr(h, attribute)) * 10) % 2 else None
    for name in dir(np.ndarray):  # NumPy's own methods, which do not pass through its dispatch
        if not name.startswith("_") and callable(getattr(np.ndarray, name)) and name not in _ARRAY_NOT_READ:
            ops[f"steer by ndarray.{name}"] = _reading(np.ndarray, name, "arr")
    ops["steer by ndarray.flat[0]"] = lambda h, b: h.c_list.append(b) if steers(float(h.arr.flat[0])) else None
    for name in dir(torch.Tensor):
        if not name.endswith("_") and not name.startswith("_") and callable(getattr(torch.Tensor, name)):
            if _value_read(name):
                ops[f"steer by Tensor.{name}"] = _reading(torch.Tensor, name, "vec")
    for name in container_methods(list):  # the reads among them: those that leave the list as it is
        if name not in changing_list_methods():
            ops[f"steer by list.{name}"] = lambda h, b, name=name: setattr(h, "n", h.n + 1) if steers(
                _call_quietly(getattr(h.c_list, name))) else None
    for kind, attribute in ((dict, "c_dict"), (set, "c_set")):  # reads of one key: present on a rank or not
        for name in container_methods(kind) + ["__contains__", "__getitem__"]:
            if name not in changing_methods(kind) and hasattr(kind, name):
                ops[f"steer by {kind.__name__}.{name}"] = lambda h, b, attribute=attribute, name=name: setattr(
                    h, "n", h.n + 1) if steers(_call_with_key(getattr(getattr(h, attribute), name), b)) else None
    for label, read in {"str": str, "format": lambda v: format(v, ".3g"), "hash": hash, "range": range,
                        "index a list": lambda v: [0, 1, 2, 3][v % 4], "torch.tensor": torch.tensor}.items():
        ops[f"steer by {label}(n)"] = lambda h, b, read=read: h.c_list.append(b) if steers(read(h.n)) else None
    for owner, field in (("m", "ids"), ("m", "scores"), ("made_newest['c']", "ids"), ("made_hardest['c0']", "scores"),
                         ("own['x']", "scores"), ("multi['a']", "scores")):
        for label, read in {"len": len, "bool": bool, "[-1]": lambda v: v[-1] if v else 0,
                            "in": lambda v: "u1" in v}.items():  # a metric object's field, held or made lazily
            ops[f"steer by {label} of {owner}.{field}"] = lambda h, b, owner=owner, field=field, read=read: setattr(
                h, "n", h.n + 1) if steers(read(getattr(_metric(h, owner), field))) else None
    ops.update({  # reads through another reference to a watched container
        "steer by len(hparams.holder.c_list)": lambda h, b: setattr(h, "n", h.n + 1) if steers(
            len(h.hparams.holder.c_list)) else None,
        "steer by k in hparams.c_dict": lambda h, b: setattr(h, "n", h.n + 1) if f"k{b % 5}" in h.hparams.c_dict
        else None,
        "lazy multi metric.append, steer by len of its ['a'].scores": lambda h, b: (h.made_multi["c"].append(
            [f"u{b}"], [value(b)]), setattr(h, "n", h.n + 1) if len(h.made_multi["c"].metrics["a"].scores) > 1
                                                  else None),
        "steer by len(same_nested)": lambda h, b: setattr(h, "n", h.n + 1) if steers(len(h.same_nested)) else None,
        "steer by a closure's len(c_list)": lambda h, b: setattr(h, "n", h.n + 1) if steers(h.c_list_size()) else None,
        "steer by k in an outside object's c_dict": lambda h, b: setattr(h, "n", h.n + 1) if f"k{b % 5}" in
        h.c_dict_keys() else None,
        "an outside object's c_dict[k] = b": lambda h, b: h.c_dict_keys().__setitem__(f"k{b % 3}", b),
        "steer by a partial's len(c_list)": lambda h, b: setattr(h, "n", h.n + 1) if steers(h.c_list_len()) else None,
        "steer by k in a tuple's c_dict": lambda h, b: setattr(h, "n", h.n + 1) if f"k{b % 5}" in h.c_dict_in_pair()
        else None,
        "a closure's dict's nested.append([b])": lambda h, b: h.nested_in_dicts().append([b]),
        "steer by len of a closure's dict's nested": lambda h, b: setattr(h, "n", h.n + 1) if steers(len(
            h.nested_in_dicts())) else None,
        "steer by len(by_stage['valid'])": lambda h, b: setattr(h, "n", h.n + 1) if steers(len(h.by_stage[
            "valid"])) else None,
    })
    ops.update({  # an entry read by index
        "steer by list[-1]": lambda h, b: setattr(h, "n", h.n + 1) if steers(h.c_list[-1]) else None,
        "steer by array[0]": lambda h, b: h.c_list.append(b) if steers(float(h.arr[0])) else None,
        "steer by tensor[0]": lambda h, b: h.c_list.append(b) if steers(float(h.vec[0])) else None,
        "steer by tensor list[0]": lambda h, b: setattr(h, "n", h.n + 1) if steers(_entry(h.t_list, 0)) else None,
        "steer by tensor list[-1]": lambda h, b: setattr(h, "n", h.n + 1) if steers(_entry(h.t_list, -1)) else None,
        "steer by nested[0]": lambda h, b: setattr(h, "n", h.n + 1) if steers(_entry(h.nested, 0, [])) else None,
        "steer by nested[2] out of range": lambda h, b: setattr(h, "n", h.n + 1) if _entry(
            h.nested, 2, "none") != "none" else None,  # try: items[2] except IndexError
    })
    return ops


def _entry(items, index, missing=None):
    """``items[index]``, or ``missing`` (a fresh zero tensor by default) where there is
    none, without a read of the list whole."""
    try:
        return items[index]
    except IndexError:
        return torch.zeros(1, dtype=torch.float64) if missing is None else missing


def _metric(brain, owner):
    """``brain.m``, ``brain.made_newest['c']`` or ``brain.own['x']``: a metric object, by
    the path a label gives (one no batch has made yet reads as empty)."""
    name, _, key = owner.partition("[")
    holder, key = getattr(brain, name), key.strip("[]'")
    holder = holder.metrics if isinstance(holder, MultiMetricStats) else holder  # its per-key objects
    if not key:
        return holder
    return holder[key] if key in holder or isinstance(holder, collections.defaultdict) else _NOT_MADE


_NOT_MADE = types.SimpleNamespace(ids=[], scores=[])


def _value_read(name):
    """Whether ``vec.name(...)`` leaves ``vec`` as it is and gives what two equal
    tensors give alike (not an address: ``data_ptr``)."""
    results = []
    for _ in range(2):
        brain = Brain()
        before = brain.vec.clone()
        try:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for args in ((), (2,), (1, 2)):
                    try:
                        results.append(repr(getattr(brain.vec, name)(*args)))
                        break
                    except TypeError:
                        continue
        except Exception:
            return False
        if not torch.equal(brain.vec, before) or brain.vec.requires_grad:
            return False
    return len(results) == 2 and results[0] == results[1]


def changing_list_methods():
    from ddp_eval.state._recording import changing_methods
    return set(changing_methods(list))


def changing_methods(kind):
    from ddp_eval.state._recording import changing_methods
    return set(changing_methods(kind))


def _call_with_key(method, b):
    """``method`` called on a key or element earlier batches may have added (see
    :func:`_arguments`), or on nothing; ``"absent"`` where the key is missing."""
    key = f"k{(b + 1) % 4}" if isinstance(method.__self__, dict) else (b + 1) % 5
    for args in ((key,), ()):
        try:
            return method(*args)
        except TypeError:
            continue
        except KeyError:
            return "absent"
        except _FAILS:
            return None
    return None


def _call_quietly(method):
    for args in ((), (1.5,), (0, 1)):
        try:
            return method(*args)
        except TypeError:
            continue
        except _FAILS:
            return None
    return None


def _quiet(op):
    """An operation that does nothing where it fails on the value (in one process as on a rank)."""
    def run(brain, b):
        try:
            op(brain, b)
        except (TypeError, *_FAILS):
            pass
    return run


def _keeps_layout(op):
    """Whether ``op`` runs on a fresh Brain and leaves its tensors' and arrays' shape,
    dtype and ``requires_grad`` as they were (``resize_``, ``requires_grad_``, a
    ufunc that needs matrices do not: they would make the program's other
    operations fail on some ranks and not in one process)."""
    brain = Brain()
    before = [(t.shape, t.dtype, getattr(t, "requires_grad", False)) for t in (brain.vec, brain.ivec, brain.arr)]
    try:
        with np.errstate(all="ignore"):
            op(brain, 1)
    except Exception:
        return False
    return before == [(t.shape, t.dtype, getattr(t, "requires_grad", False)) for t in (brain.vec, brain.ivec,
                                                                                        brain.arr)]


def operations():
    """``({name: (brain, batch) -> None}, [names left out by _keeps_layout])``."""
    ops, left_out = {}, []
    for kind in CONTAINERS:
        for name in container_methods(kind):
            ops[f"{kind.__name__}.{name}"] = _call_method(kind, name)
    # a metric object's lists, by the same methods: one held at stage start, one a defaultdict makes
    # during the stage, a MultiMetricStats's per-key object
    for owner, prefix in (("m", "metric"), ("lazy['c']", "lazy metric"), ("multi['a']", "multi metric['a']")):
        for field in ("ids", "scores"):
            for name in container_methods(list):
                ops[f"{prefix}.{field}.{name}"] = _call_method(list, name, field, owner)
    for kind in (list, set, dict):  # the methods of a container made for a new key, in the batch that made it
        for name in container_methods(kind):
            ops[f"made {kind.__name__}.{name}"] = _call_made(kind, name)
    candidates = {f"Tensor.{name}": _tensor_method(name) for name in tensor_methods()}
    candidates.update({f"numpy.{name}(out=)": _ufunc(name) for name in numpy_ufuncs()})
    for label, op in candidates.items():
        if _keeps_layout(op):
            ops[label] = op
        else:
            left_out.append(label)
    ops.update({label: _quiet(op) for label, op in _fixed().items()})
    ops.update({label: _quiet(op) for label, op in rebinding_operations().items()})
    return ops, left_out


OPERATIONS, LEFT_OUT = operations()
NAMES = sorted(OPERATIONS)
STEERING_READS = {label: _quiet(op) for label, op in steering_reads().items()}  # in programs of their own
OPERATIONS.update(STEERING_READS)
