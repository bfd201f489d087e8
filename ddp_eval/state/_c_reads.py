"""Finding the numbers a batch's code reads where no probe can see.

A probe is a subclass of ``int`` or ``float`` (:mod:`ddp_eval.state._numbers`):
``self.n * 2.0``, ``k + self.n`` and ``self.x < 0.5`` call its methods, but a
float on the left of a watched ``int`` (``100.0 * self.correct``, ``2.5 <
self.total``), or a tensor or array on the left of either (``loss * self.n``),
reads it in C without calling any. This module scans the bytecode of the code
a batch runs for a field of ``self`` (``self.n``, ``self.stats.count``,
``getattr(self, "n")``, or a local bound to one: ``seen = self.seen``, ``a, b =
self.a, self.b``, ``x = self.a if c else self.b``, ``for m in self.meters``,
``for m in sorted(self.meters)``, ``x = [self.a][0]``; what a call given one or a
method of its own hands back, taken for the field and for each of its entries:
``m = pick(self.meters, k)``, ``m = self.meters.get(k)``; a comprehension's
variable: ``[2.5 * m.count for m in (self.a, self.b)]``; a display holding
one: ``math.prod((2.5, self.n))``; a parameter of a ``lambda`` or nested
``def`` given with one or given one: ``map(lambda m: 2.5 * m.count, (self.a,
self.b))``) read
as the right operand of an arithmetic
operator or a comparison, whose left operand is neither another field of
``self`` (whose probe then sees it) nor a constant that calls its methods, and
for one passed to a call (``math.sqrt(self.total)``, ``torch.tensor(self.x)``: C
code takes the value of a float or int subclass directly; given to a library's
function, what it holds too: ``torch.stack(self.losses)`` takes a list's tensors
without iterating it, ``losses.**``), but for the builtin
``max`` or ``min`` the merge replays as a choice, or used as the index of a
container that is not watched (``LABELS[self.n]``); the instructions are
followed by :mod:`ddp_eval.state._field_flow`.

The code scanned, with its nested functions: ``compute_forward``,
``compute_objectives`` and ``evaluate_batch``; the methods they call on
``self``, and the parents' they call through ``super()``; the functions of the
recipe's modules they give ``self`` or a field of it (``update(self.stats, x)``:
each parameter taken for the value given to it by position or keyword, a read of
``stats.count`` as one of ``self.stats.count``); the methods they call on the objects the Brain holds and
on the entries of its dicts and lists, and the objects called
(``self.stats.update(x)``, ``self.per_key[k].update(x)``,
``self.hparams.meter(x)``, :func:`read_in_c_of`), a function held so with the
Brain or what it holds in its closure (``self.passed = lambda: 2.5 < self.n``); and what a batch finds by name
(``getattr(self, f"_update_{stage}")(x)``: each method of the recipe's own whose
name fits ``_update_*``) or in a container (``self.handlers[stage](self, x)``: each
function, bound method of the Brain's or callable object of the recipe's own held
there). A function of the recipe's given a field more than four calls deep
counts as reading it, and each field it holds, in C. A field given to a library's
function counts as read in C with what it holds: its entries (``torch.stack``) and
its fields, and theirs (``json.dumps(vars(self.stats))``,
``operator.attrgetter("n")(self.stats)``); given to one that only iterates it
(``enumerate``, ``zip``, ``sorted``), with its entries only. What a method of the
recipe's hands back stands for the fields it returns (``json.dumps(self.stats.snapshot())``
with ``snapshot`` returning ``{"n": self.n}`` reads ``stats.n``). A library's code is not
scanned itself. Such a read is taken as a
read of the value whole: if batches change the value, it is named with what they
may have computed from it. The same walk (:func:`reach`) tells which objects the
batch code runs methods of and which globals it names, for
:mod:`ddp_eval.state._outside`.

Example
-------
>>> import math
>>> class Recipe:
...     def compute_objectives(self, predictions, batch, stage):
...         self.correct += 1
...         self.running_acc = 100.0 * self.correct / self.seen
...         self.rms = math.sqrt(self.squares)
...         return self.scale * 2.0
...     def on_stage_end(self, stage, loss, epoch):
...         self.acc = 100.0 * self.correct / self.seen  # after the merge: not a batch's read
>>> sorted(read_in_c(Recipe))
['correct', 'seen', 'squares', 'squares.**']
"""

import builtins
import collections
import dis
import fnmatch
import functools
import inspect
import itertools
import os
import sys
import types
from typing import Any, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from ddp_eval.state._field_flow import (
    CALLED,
    ENTRY,
    FUNCTION,
    HELD,
    RETURNED,
    UNKNOWN,
    Argument,
    Iterated,
    comprehensions,
    given_to_calls,
    instructions_of,
    is_called,
    label_of,
    parts,
    passed_functions,
    plain,
    returned,
    uses,
)

BATCH_METHODS = ("evaluate_batch", "compute_forward", "compute_objectives")
_STAGE_HOOKS = ("on_stage_start", "on_stage_end", "on_evaluate_start", "on_fit_start")  # not batch code
_DEPTH = 4  # objects held in objects: how deep method calls are followed
LIBRARIES = {*sys.stdlib_module_names, "torch", "numpy", "speechbrain"}
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # a stand-in's methods are not the recipe's

Calls = FrozenSet[Tuple[Tuple[str, ...], str]]  # (the fields leading to an object, its method called)
Named = FrozenSet[Tuple[types.FunctionType, str]]  # a global's name, and a function that names it
Held = FrozenSet[Tuple[Tuple[str, ...], str, bool, Argument]]  # (fields leading to a callable held, a path
# given, itself, the argument it is)
Scan = Tuple[FrozenSet[str], Calls, Named, FrozenSet[str], Held]  # read in C, called, globals named, given to calls


def read_in_c(owner_class: type, methods: Tuple[str, ...] = BATCH_METHODS) -> FrozenSet[str]:
    """Names of ``self``'s attributes that ``methods`` of ``owner_class`` (and what they
    call) read as the right operand of an operator whose left operand may read them
    in C, or pass to a call."""
    return _scan(owner_class, methods)[0]


def read_in_c_of(brain: Any, copies: Optional[Dict[int, Any]] = None) -> Set[str]:
    """:func:`read_in_c` of ``brain``'s batch methods, and of the methods they call on
    the objects ``brain`` holds, as labels (``correct``, ``stats.count``).

    Example
    -------
    >>> class Stats:
    ...     def __init__(self):
    ...         self.count, self.rates = 0, []
    ...     def update(self, x):
    ...         self.count += 1
    ...         self.rates.append(x / self.count)
    >>> class Recipe:
    ...     def __init__(self):
    ...         self.stats = Stats()
    ...     def compute_objectives(self, predictions, batch, stage):
    ...         self.stats.update(2.5)
    >>> sorted(read_in_c_of(Recipe()))
    ['stats.count']
    """
    return reach(brain, copies)[0]


def reach(brain: Any, copies: Optional[Dict[int, Any]] = None
          ) -> Tuple[Set[str], List[Any], Set[Tuple[types.FunctionType, str]]]:
    """(labels read in C, the objects whose methods the batch code runs, the globals it
    names, each with a function naming it) of ``brain``'s batch code; ``copies``: the
    recording copy the Brain holds for a container, by the container's id, where a
    ``functools.partial`` may hold the container itself."""
    copies = copies or {}
    found: Set[str] = set()
    named: Set[Tuple[types.FunctionType, str]] = set()
    owners: Dict[int, Any] = {}
    pending: List[Tuple[Tuple[str, ...], Any, Tuple[str, ...]]] = [((), brain, BATCH_METHODS)]
    done: Set[Tuple[Tuple[str, ...], type, Tuple[str, ...]]] = set()
    while pending:
        path, owner, methods = pending.pop()
        if (path, type(owner), methods) in done or len(path) > _DEPTH:
            continue
        done.add((path, type(owner), methods))
        owners[id(owner)] = owner
        reads, calls, more, given, held_calls = _scan(type(owner), methods)
        reads, todo, seen = set(reads), list(calls), set(calls)
        for chain, given_path, itself, _ in held_calls:  # self.hparams.dump(self.stats): a library's function it holds
            for target in _held_callables(owner, chain):
                if _a_librarys_reader(target) and not _callback(target):
                    reads.add(_in_c(given_path, itself and not _only_iterates(target)))
        named |= more
        while todo:
            place, method = todo.pop()
            for fields in _expand(owner, place, held_calls):
                targets = values_at(owner, fields)
                for target in {id(value) if method == CALLED else type(value): value for value in targets}.values():
                    if method.startswith("{"):  # getattr(self.stats, name)(...): any method of its own
                        pending += [((*path, *fields), target, (name,)) for name in _own_methods(type(target), method)]
                        continue
                    held, name, function = fields, method, getattr(type(target), method, None)
                    if method == CALLED or not isinstance(function, types.FunctionType):  # an object called
                        if method != CALLED:  # self.meter(x); self.handlers[k](x): the entry itself
                            held, target = (*fields, method), fields_of(target).get(method)
                        name, bound = "__call__", getattr(target, "__func__", None)
                        function = getattr(type(target), name, None)
                        if getattr(target, "__self__", None) is owner and _the_recipes(bound):
                            pending.append((path, owner, (bound.__name__,)))  # a method of the owner's own
                            continue
                        where = _the_recipes(bound) and _place_of(owner, target.__self__)
                        if where:  # {"valid": self.stats.update}: the method of an object the owner holds
                            pending.append(((*path, *where), target.__self__, (bound.__name__,)))
                            continue
                        if isinstance(target, functools.partial) and _a_librarys_reader(target.func):
                            for bound_value in (*target.args, *target.keywords.values()):  # partial(heappush, h)
                                where = _place_of(owner, copies.get(id(bound_value), bound_value))
                                if where:
                                    reads.add(_in_c(label_of(where), not _only_iterates(target.func)))
                            continue
                        callback = _callback(target)
                        if callback:  # self.hparams.score(self.stats, x): as a module's function given them
                            for selves, passed in {**_passed(target, held_calls, place, method, given),
                                                   **_closed_over(callback, owner, copies)}.items():
                                more_reads, more_calls = _as_given(*_scan_function(callback, selves, _DEPTH)[:2],
                                                                   passed)
                                reads |= more_reads
                                todo += [call for call in more_calls - seen]
                                seen |= more_calls
                            continue
                    elif not fields and (place, method) in calls:
                        continue  # a method of the owner's own its code calls: scanned with it
                    if _the_recipes(function):
                        pending.append(((*path, *held), target, (name,)))
        found |= {label_of((*path, *concrete)) for name in reads
                  for concrete in _expand(owner, parts(name), held_calls)}
    return found, list(owners.values()), named


def _place_of(owner: Any, held: Any) -> Optional[Tuple[str, ...]]:
    """Where ``owner`` holds ``held``: a field (``("stats",)``), a field of a field
    or an entry of a container field (``("per_key", "[*]")``); None if not there."""
    fields = list(fields_of(owner).items())
    for name, value in fields:
        if value is held:
            return (name,)
    for name, value in fields:
        for inner in (ENTRY, *fields_of(value)):
            if any(found is held for found in values_at(value, (inner,))):
                return (name, inner)
    return None


def _closed_over(function: types.FunctionType, owner: Any, copies: Dict[int, Any]
                 ) -> Dict[Tuple[str, ...], Set[str]]:
    """``{(variable,): {path}}`` of ``function``'s closure variables that hold ``owner``
    (``self.keep = lambda x: heapq.heappush(self.hard, x)``: path ``""``) or a value it
    holds (``stats = self.stats; self.dump = lambda: json.dumps(stats.count)``), scanned
    as parameters given them."""
    found: Dict[Tuple[str, ...], Set[str]] = {}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            held = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        where = () if held is owner else _place_of(owner, copies.get(id(held), held))
        if where is not None:
            found[(name,)] = {label_of(where)}
    return found


def _callback(value: Any) -> Optional[types.FunctionType]:
    """The recipe's function ``value`` is, or wraps as a ``functools.partial``
    (``!name:`` in hparams) or a bound method (of an object the Brain does not hold), if any."""
    function = value.func if isinstance(value, functools.partial) else value
    function = function.__func__ if isinstance(function, types.MethodType) else function
    return function if _the_recipes(function) else None


def _as_given(reads: Iterable[str], calls: Iterable[Tuple[Tuple[str, ...], str]], given: Iterable[str]
              ) -> Tuple[Set[str], Set[Tuple[Tuple[str, ...], str]]]:
    """A function's ``reads`` and ``calls`` of its parameters, as paths of the values
    ``given`` to it (``""``: the owner itself)."""
    return ({label_of((*parts(path), *parts(read))) for path in given for read in reads},
            {(parts(label_of((*parts(path), *fields))), method) for path in given for fields, method in calls})


def values_at(owner: Any, path: Sequence[str]) -> List[Any]:
    """The values at ``path`` (:func:`parts`) from ``owner``: fields from the objects'
    ``__dict__`` (no property runs), ``[*]`` every entry of a dict, list, tuple or
    deque; none where one is missing."""
    found = [owner]
    for part in path:
        if part == ENTRY:
            found = [entry for value in found if isinstance(value, (dict, list, tuple, collections.deque))
                     for entry in list(value.values() if isinstance(value, dict) else value)]
        elif part.startswith("{"):
            found = [field for value in found for name, field in list(fields_of(value).items())
                     if _matches(name, part)]
        else:
            found = [fields_of(value)[part] for value in found if part in fields_of(value)]
    return found


def fields_of(value: Any) -> Dict[str, Any]:
    """``value``'s fields, by its ``__dict__``; none of a container's (a recording
    copy's are its bookkeeping) or a stand-in's, nor of a function's or a
    ``functools.partial``'s (asking makes them one, which a pickle of it then holds)."""
    if isinstance(value, _NO_FIELDS) or (type(value).__module__.startswith("ddp_eval") and of_a_library(type(value))):
        return {}  # nor a stand-in's (a probe's bookkeeping), while a batch's record is taken
    return getattr(value, "__dict__", {})


_NO_FIELDS = (dict, list, tuple, set, frozenset, collections.deque, functools.partial, types.FunctionType,
              types.MethodType)


@functools.lru_cache(maxsize=256)
def _scan(owner_class: type, methods: Tuple[str, ...]) -> Scan:
    """:func:`_scan_function` of ``methods`` and the methods of ``owner_class`` they
    call (``self.helper(...)``)."""
    reads: Set[str] = set()
    calls: Set[Tuple[Tuple[str, ...], str]] = set()
    named: Set[Tuple[types.FunctionType, str]] = set()
    given: FrozenSet[str] = frozenset()
    held: Held = frozenset()
    pending, done = list(methods), set()
    while pending:
        name = pending.pop()
        if name in done:
            continue
        done.add(name)
        found, called = set(), set()
        for function in _implementations(owner_class, name):
            scanned = _scan_function(function, function.__code__.co_varnames[:1], _DEPTH)
            found, called, named, given, held = (found | scanned[0], called | scanned[1], named | scanned[2],
                                                 given | scanned[3], held | scanned[4])
            pending += _properties_read(function, owner_class)
        reads |= found
        pending += [name for name in found if isinstance(getattr(owner_class, name, None), types.FunctionType)]
        for fields, method in called:
            if not fields and method.startswith("{"):
                pending += _own_methods(owner_class, method)  # getattr(self, f"_update_{stage}")(...)
            elif not fields and isinstance(getattr(owner_class, method, None), types.FunctionType):
                pending.append(method)  # self.helper(...)
            else:
                calls.add((fields, method))
    return frozenset(reads), frozenset(calls), frozenset(named), given, held


def _properties_read(function: types.FunctionType, owner_class: type) -> List[str]:
    """The properties of the recipe's on ``owner_class`` that ``function`` reads off its
    first parameter (``if self.accuracy > best``): their getters run with the batch."""
    me = function.__code__.co_varnames[:1]
    names = []
    for code, _ in _with_nested(function.__code__, me):
        instructions = instructions_of(code)
        for previous, instruction in zip(instructions, instructions[1:]):
            if previous.opname in ("LOAD_FAST", "LOAD_DEREF") and previous.argval in me and instruction.opname in (
                    "LOAD_ATTR", "LOAD_METHOD"):
                found = inspect.getattr_static(owner_class, instruction.argval, None)
                if isinstance(found, property) and _the_recipes(found.fget):
                    names.append(instruction.argval)
    return names


def _held_callables(owner: Any, chain: Tuple[str, ...]) -> Iterator[Any]:
    """What ``chain`` (fields, then a callable's name) leads to from ``owner``: a field's
    value, or a method of its class (found statically: no property runs); if it
    ends with ``[*]``, each entry of the container there."""
    if chain[-1] == ENTRY:
        yield from values_at(owner, chain)
        return
    for value in values_at(owner, chain[:-1]):
        yield fields_of(value).get(chain[-1], inspect.getattr_static(type(value), chain[-1], None))


def _expand(owner: Any, path: Sequence[str], held: Held = frozenset(), depth: int = _DEPTH
            ) -> List[Tuple[str, ...]]:
    """``path`` with each ``{pattern}`` (:data:`~ddp_eval.state._field_flow.ANY`) replaced
    by each field held there, ``**`` (:data:`BELOW`) by the place itself and each
    place below it (:func:`_below`), and ``name()`` by what that method of the
    recipe's hands back (:func:`_handed_back_by`), or the function of the recipe's
    held there, given the fields ``held`` says the code gives it (:func:`_handed_back_of`),
    ``depth`` methods deep."""
    found: List[Tuple[str, ...]] = [()]
    for at, part in enumerate(path):
        if part.endswith(RETURNED):
            name = part[:-len(RETURNED)]
            return list(dict.fromkeys(
                expanded for place in found for handed in (
                    *((*place, *parts(handed)) for handed in _handed_back_by(owner, place, name)),
                    *_handed_back_of(owner, place, name, held))
                for expanded in _expand(owner, parts(label_of((*handed, *path[at + 1:]))), held, depth - 1)
            )) if depth else []
        if part == BELOW:
            found = [(*place, *below) for place in found for below in _below(values_at(owner, place))]
            continue
        found = [(*place, field) for place in found for field in (
            dict.fromkeys(name for value in values_at(owner, place) for name in fields_of(value)
                          if _matches(name, part))
            if part.startswith("{") else (part,))]
    return found


def _handed_back_by(owner: Any, place: Sequence[str], name: str) -> Set[str]:
    """The paths, from the values at ``place``, of what their method ``name`` hands
    back (``""``: the value itself), if it is the recipe's
    (:func:`~ddp_eval.state._field_flow.returned`); none for a library's."""
    classes = {type(value) for value in values_at(owner, place)}
    return set().union(*(_handed_back_by_class(cls, name) for cls in classes))


def _handed_back_of(owner: Any, place: Sequence[str], name: str, held: Held) -> Set[Tuple[str, ...]]:
    """The paths (:func:`parts`), from ``owner``, of what the recipe's function held at
    ``place`` as ``name`` (``self.hparams.snapshot``, ``!name:`` in hparams;
    ``self.snap``) hands back of the fields ``held`` says the code gives it."""
    chain = (*place, name) if name else tuple(place)  # self.handlers[k](...): the entry itself called
    return {(*parts(path), *parts(handed)) for value in values_at(owner, chain) if _callback(value)
            for parameter, paths in _held_arguments(value, held, chain).items()
            for handed in _returned_of(_callback(value), parameter, _DEPTH) for path in paths}


def _passed(target: Any, held: Held, place: Sequence[str], method: str, given: FrozenSet[str]
            ) -> Dict[Tuple[str, ...], Set[str]]:
    """The parameters of the recipe's function ``target`` (or the one it wraps), held at
    ``place`` (``method``: its name there, or :data:`CALLED` if ``place`` ends with it),
    to scan, each with the fields given it (:func:`_held_arguments`), else all of its
    parameters at once for every field ``given`` a call."""
    chain = tuple(place) if method == CALLED else (*place, method)
    passed = {(parameter,): paths for parameter, paths in _held_arguments(target, held, chain).items()}
    code = _callback(target).__code__
    return passed or {code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]: set(given)}


def _held_arguments(target: Any, held: Held, chain: Tuple[str, ...]) -> Dict[str, Set[str]]:
    """The paths of the fields the code gives the recipe's function ``target`` held at
    ``chain`` (``self.hparams.score(self.stats, x)``), by the parameter each may bind."""
    found: Dict[str, Set[str]] = collections.defaultdict(set)
    for held_chain, path, itself, argument in held:
        if held_chain == chain and itself:
            for parameter, suffix in _bindings(_callback(target), _past_bound(target, argument)):
                found[parameter].add(f"{path}{suffix}")
    return found


@functools.lru_cache(maxsize=1024)
def _handed_back_by_class(cls: type, name: str) -> FrozenSet[str]:
    method = inspect.unwrap(inspect.getattr_static(cls, name, None))
    if _the_recipes(method) and method.__code__.co_argcount:
        return _returned_of(method, method.__code__.co_varnames[0], _DEPTH)
    return frozenset()


BELOW = "**"  # in a path: the value and what it holds, its fields' and entries' too, up to _BELOW_DEPTH down
_BELOW_DEPTH, _BELOW_MOST = 4, 1_000


def _below(values: List[Any]) -> List[Tuple[str, ...]]:
    """The paths from ``values`` to themselves (``()``), their entries (``[*]``) and
    fields, and theirs, :data:`_BELOW_DEPTH` down, at most :data:`_BELOW_MOST`; a
    place's fields are found on its first :data:`_BELOW_MOST` values (a dataset's
    100,000 entries are not all walked)."""
    found: List[Tuple[str, ...]] = [()]
    level = [((), values[:_BELOW_MOST])]
    for _ in range(_BELOW_DEPTH):
        deeper = []
        for place, held in level:
            entries = list(itertools.islice((entry for value in held for entry in values_at(value, (ENTRY,))),
                                            _BELOW_MOST))
            if entries:
                deeper.append(((*place, ENTRY), entries))
            for name in dict.fromkeys(name for value in held for name in fields_of(value)):
                deeper.append(((*place, name), [fields_of(value)[name] for value in held if name in fields_of(value)]))
        found += [place for place, _ in deeper][:_BELOW_MOST - len(found)]
        level = deeper
        if len(found) >= _BELOW_MOST or not level:
            break
    return found


def _matches(name: str, pattern: str) -> bool:
    """Whether ``name`` matches a path's ``{pattern}`` (:data:`~ddp_eval.state._field_flow.ANY`)."""
    return fnmatch.fnmatchcase(name, pattern[1:-1])


def _own_methods(owner_class: type, pattern: str) -> Tuple[str, ...]:
    """The methods of the recipe's own in ``owner_class`` that no library parent has
    (not ``on_stage_end``: it runs after the merge), but the batch methods, whose
    names match ``pattern``: those a ``getattr(self, name)(...)`` may run."""
    libraries = {name for cls in owner_class.__mro__ if of_a_library(cls) for name in vars(cls)}
    return tuple(dict.fromkeys(
        name for cls in owner_class.__mro__ for name, function in vars(cls).items()
        if isinstance(function, types.FunctionType) and _the_recipes(inspect.unwrap(function))
        and _matches(name, pattern) and (name in BATCH_METHODS or not (
            name in libraries or name in _STAGE_HOOKS or name.startswith("__")))))


def of_a_library(cls: type) -> bool:
    """Whether ``cls`` is a library's (Python's own, torch, NumPy, SpeechBrain) or one
    of ddp_eval's own (the mixin, a stand-in), not the recipe's."""
    return (cls.__module__ or "").split(".")[0] in LIBRARIES | {"builtins"} or (
        (cls.__module__ or "").startswith("ddp_eval")
        and getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls)  # not a doctest's


def _implementations(owner_class: type, name: str) -> List[types.FunctionType]:
    """``owner_class``'s ``name``, and along its MRO each next one that the previous
    calls through ``super().name(...)``; decorated ones by their own code."""
    found = []
    for cls in owner_class.__mro__:
        function = vars(cls).get(name)
        function = inspect.unwrap(function.fget if isinstance(function, property) else function)  # its getter runs
        if not isinstance(function, types.FunctionType):
            continue
        found.append(function)
        if not _calls_super(instructions_of(function.__code__), name):
            break
    return found


def _calls_super(instructions: List[dis.Instruction], name: str) -> bool:
    """Whether the code calls ``super().name`` (``super`` loaded just before)."""
    return any(instruction.opname in ("LOAD_METHOD", "LOAD_ATTR") and instruction.argval == name and any(
        before.opname == "LOAD_GLOBAL" and before.argval == "super" for before in instructions[max(0, at - 4):at])
        for at, instruction in enumerate(instructions))


@functools.lru_cache(maxsize=1024)
def _scan_function(function: types.FunctionType, selves: Tuple[str, ...], depth: int) -> Scan:
    """(paths read in C, methods called) of the objects named ``selves`` in
    ``function``, its nested functions, and the module's functions it gives them
    (``update_stats(self.stats, x)``: read as ``stats.count``), and the globals
    (``(function, name)``) these and the module's functions it calls name, ``depth``
    calls deep."""
    reads: Set[str] = set()
    calls: Set[Tuple[Tuple[str, ...], str]] = set()
    named, gives, held = set(), set(), set()
    for code, iterated in _with_nested(function.__code__, selves):
        instructions = instructions_of(code)
        named |= {(function, instruction.argval) for instruction in instructions
                  if instruction.opname in ("LOAD_GLOBAL", "STORE_GLOBAL")}
        found, called, given = uses(code, selves, iterated)
        reads, calls, gives = reads | found, calls | called, gives | given
        given_to: Dict[Any, Dict[Tuple[str, ...], Set[str]]] = collections.defaultdict(  # a module's function ->
            lambda: collections.defaultdict(set))  # its parameters scanned together -> the fields given to them
        for names, path, itself, argument in given_to_calls(code, selves, iterated):  # torch.stack(self.losses)
            if names == UNKNOWN:  # a callable the scan cannot tell may read in C what it is given
                reads.add(_in_c(path, itself))
            elif names[0] in selves:  # self.hparams.dump(self.stats): found on the owner
                held.add((names[1:], path, itself, argument))
            elif _a_librarys_reader(taker := _resolve(names, function.__globals__)):
                reads.add(_in_c(path, itself and not _only_iterates(taker)))
            elif _the_recipes(taker) and itself:  # not meter in meter.update(value(b))
                for parameter, suffix in _bindings(taker, argument):
                    given_to[taker][(parameter,)].add(f"{path}{suffix}")
        for nested, passed in passed_functions(code, selves, iterated).items():  # map(lambda m: ..., v)
            parameters = nested.co_varnames[:nested.co_argcount + nested.co_kwonlyargcount]
            for inner, looped in _with_nested(nested, parameters):
                found, called = _as_given(*uses(inner, parameters, looped)[:2], passed)
                reads, calls = reads | found, calls | called
        for module_function, called_here in _module_functions(instructions, function.__globals__).items():
            code_of = module_function.__code__
            by_parameter = given_to[module_function] if called_here else {  # map(update, ...): any parameter
                code_of.co_varnames[:code_of.co_argcount + code_of.co_kwonlyargcount]: given}
            if not depth:  # deeper than the scan goes: what it is given counts as read in C, with what it holds
                reads |= {_in_c(plain(path), True) for passed in by_parameter.values() for path in passed}
                continue
            for parameters, passed in by_parameter.items() or {(): set()}.items():  # each parameter given a field
                found, called, more, _, _ = _scan_function(module_function, parameters if passed else (), depth - 1)
                named |= more
                found, called = _as_given(found, called, passed)
                reads, calls = reads | found, calls | called
    here = function.__globals__  # what functions of its module hand back: @snapshot#0()
    return (frozenset(_through_functions(reads, here)),
            frozenset((parts(label), method) for fields, method in calls
                      for label in _through_functions({label_of(fields)}, here)),
            frozenset(named), frozenset(_through_functions(gives, here)),
            frozenset((chain, label, itself, argument) for chain, path, itself, argument in held
                      for label in _through_functions({path}, here)))


def _through_functions(labels: Iterable[str], globals_: Dict[str, Any], depth: int = _DEPTH) -> Set[str]:
    """``labels`` with each part standing for what a function hands back
    (:func:`~ddp_eval.state._field_flow.function_result`) replaced by the paths it
    returns of the value given, for a function of the recipe's (``snapshot(stats)``
    returning ``{"n": stats.n}``: ``stats.n``), ``depth`` functions deep; a label
    through a library's function (``sorted``, ``len``) stands for nothing."""
    found: Set[str] = set()
    for label in labels:
        path = parts(label)
        at = next((i for i, part in enumerate(path) if part.startswith(FUNCTION)), None)
        if at is None:
            found.add(label)
            continue
        name, argument = path[at][len(FUNCTION):-len(RETURNED)].rsplit("#", 1)
        function = _resolve(name.split(":"), globals_)
        bindings = _bindings(function, int(argument) if argument.isdigit() else argument) if (
            _the_recipes(function) and depth) else []
        for parameter, suffix in bindings:
            for handed in _returned_of(function, parameter, depth - 1):
                found |= _through_functions({label_of((*path[:at], *parts(suffix), *parts(handed), *path[at + 1:]))},
                                            globals_, depth - 1)
    return found


@functools.lru_cache(maxsize=1024)
def _returned_of(function: types.FunctionType, parameter: str, depth: int) -> FrozenSet[str]:
    """What ``function`` returns of its ``parameter``
    (:func:`~ddp_eval.state._field_flow.returned`), through its module's functions."""
    return frozenset(_through_functions(returned(function.__code__, (parameter,)), function.__globals__, depth))


def _bindings(function: types.FunctionType, argument: Argument = None) -> List[Tuple[str, str]]:
    """The parameters of ``function`` a call's ``argument``
    (:func:`~ddp_eval.state._field_flow.given_to_calls`) may bind, each with what
    makes the given value's path the parameter's: ``f(self.stats)`` binds ``stats``
    (``""``) or ``*values`` (``[^]``: ``values[0]`` is ``stats``); an entry of a
    sequence spread, ``f(*args)`` (``"*"``), any positional parameter or ``*values``;
    of a mapping, ``f(**kwargs)`` (``"**"``), likewise by keyword; None (not known) any.

    Example
    -------
    >>> def snapshot(stats, digits=2, *values, **options):
    ...     pass
    >>> _bindings(snapshot, 0), _bindings(snapshot, 3), _bindings(snapshot, "indent")
    ([('stats', '')], [('values', '[^]')], [('options', '[^]')])
    >>> _bindings(snapshot, "*")
    [('stats', ''), ('digits', ''), ('values', '[^]')]
    """
    code = function.__code__
    positional = code.co_varnames[:code.co_argcount]
    named = code.co_varnames[code.co_posonlyargcount:code.co_argcount + code.co_kwonlyargcount]
    after = code.co_argcount + code.co_kwonlyargcount
    varargs = code.co_varnames[after] if code.co_flags & inspect.CO_VARARGS else None
    varkw = code.co_varnames[after + bool(varargs)] if code.co_flags & inspect.CO_VARKEYWORDS else None
    packed = [parameter for parameter in (varargs, varkw) if parameter]
    if isinstance(argument, int):
        return [(positional[argument], "")] if argument < len(positional) else [(varargs, HELD)] if varargs else []
    if argument in ("*", "**"):  # given the entries spread
        spread, rest = (positional, varargs) if argument == "*" else (named, varkw)
        return [(parameter, "") for parameter in spread] + ([(rest, HELD)] if rest else [])
    if argument is None:
        return [(parameter, "") for parameter in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]] + [
            (parameter, HELD) for parameter in packed]
    return [(argument, "")] if argument in named else [(varkw, HELD)] if varkw else []


def _past_bound(target: Any, argument: Argument) -> Argument:
    """A call's ``argument`` to ``target`` as an argument of the function it wraps: a
    ``functools.partial``'s positions come after the arguments it binds, a bound
    method's after its object."""
    if not isinstance(argument, int):
        return argument
    bound = len(target.args) if isinstance(target, functools.partial) else 0
    inner = target.func if isinstance(target, functools.partial) else target
    return argument + bound + isinstance(inner, types.MethodType)


def _in_c(path: str, whole: bool) -> str:
    """The label of what C code given the value at ``path`` may read of it: its
    entries, or if ``whole`` everything it holds (``stats.**``; the Brain's, ``**``;
    ``stats.__dict__``'s: ``stats.**``)."""
    path = "" if path == "__dict__" else path.removesuffix(".__dict__")
    return f"{path}.{BELOW}" if whole and path else BELOW if whole else f"{path}{ENTRY}"


_NOT_READING = (isinstance, issubclass, id, type, hasattr, getattr, setattr, callable)  # of a value's entries


def _resolve(names: Sequence[str], globals_: Dict[str, Any]) -> Any:
    """What ``names`` (a global, then attributes: ``("torch", "stack")``) load, or None."""
    value = globals_.get(names[0], getattr(builtins, names[0], None))
    for name in names[1:]:
        value = getattr(value, name, None) if isinstance(value, types.ModuleType) else None
    return value


_ITERATING = (enumerate, zip, iter, reversed, len, list, tuple, map, filter, sorted, sum, any, all, min, max)


def _only_iterates(function: Any) -> bool:
    """Whether ``function`` takes only a container's entries, never an entry's fields
    (``enumerate``, ``zip``, ``sorted``: it hands them to Python, or compares them by
    their own methods)."""
    return any(function is other for other in _ITERATING)


def _a_librarys_reader(function: Any) -> bool:
    """Whether ``function`` may read what it is given in C, where no recording copy
    or probe sees it (``torch.stack`` takes a list's tensors without iterating it,
    ``json.dumps`` an object's numbers through ``vars``): a library's (Python's own,
    torch, NumPy, SpeechBrain) callable, but those that only look at the value itself
    (``isinstance``, ``id``)."""
    if function is None or _the_recipes(function) or any(function is other for other in _NOT_READING):
        return False
    return (getattr(function, "__module__", None) or type(function).__module__ or "").split(".")[0] in {
        *LIBRARIES, "builtins"}


def _with_nested(code: types.CodeType, selves: Tuple[str, ...], iterated: Iterated = (frozenset(), False)
                 ) -> Iterator[Tuple[types.CodeType, Iterated]]:
    """``code`` and its nested code objects, each a comprehension's with what it loops over."""
    yield code, iterated
    looped = comprehensions(code, selves, iterated) if selves else {}
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _with_nested(constant, selves, looped.get(constant, (frozenset(), False)))


def _module_functions(instructions: List[dis.Instruction], names: Dict[str, Any]
                      ) -> Dict[types.FunctionType, bool]:
    """The functions of the recipe's modules the code loads (``update(...)``,
    ``helpers.update(...)``), each with whether every load of it is called there
    (then it is given what its calls give it; else, as in ``map(update, ...)``, it may
    be given anything the code gives)."""
    found: Dict[types.FunctionType, bool] = {}
    for at, instruction in enumerate(instructions[:-1]):
        if instruction.opname != "LOAD_GLOBAL":
            continue
        value, end = names.get(instruction.argval), at
        if isinstance(value, types.ModuleType) and instructions[at + 1].opname in ("LOAD_ATTR", "LOAD_METHOD"):
            value, end = getattr(value, instructions[at + 1].argval, None), at + 1
        if _the_recipes(value):
            found[value] = found.get(value, True) and is_called(instructions, end)
    return found


def _the_recipes(function: Any) -> bool:
    """Whether ``function`` is Python code of the recipe's own, not of a library
    (Python's own, torch, NumPy, SpeechBrain), which holds none of its state."""
    return isinstance(function, types.FunctionType) and (function.__module__ or "").split(".")[0] not in LIBRARIES \
        and not function.__code__.co_filename.startswith(_OURS)  # nor a stand-in's


