"""Where a function's bytecode pushes fields of ``self``, and what takes each one.

:mod:`ddp_eval.state._c_reads` asks, of each code object a batch runs, which
fields of ``self`` (or of the parameters standing for it) are read where no probe
sees the read: on the right of an operator whose left operand reads them in C,
given to a call, used as a container's index. This module answers from the
instructions alone (Python 3.11's), with no object at hand: it follows each field
from its load (``self.n``, ``self.stats.count``, ``self.per_key[k].count``,
``getattr(self, "n")``, a local bound to one) to the instruction that takes it
off the stack. Fields are named by paths (:func:`parts`): ``per_key[*].count``
for an entry's field, ``{_update_*}`` for one found by a name computed at run time,
``stats.snapshot()`` for what a method of a field hands back and
``stats.@snapshot#0()`` for what a function given the field as its first argument
hands back (:mod:`ddp_eval.state._c_reads` resolves both).

Example
-------
>>> def compute_objectives(self, batch):
...     seen = self.seen
...     self.rates.append(100.0 * self.correct / seen)
...     self.stats.update(batch)
>>> reads, calls, given = uses(compute_objectives.__code__, ("self",))
>>> sorted(reads), sorted(calls), sorted(given)
(['correct', 'seen'], [(('rates',), 'append'), (('stats',), 'update')], [])
"""

import collections
import dis
import functools
import re
import types
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, Union

from ddp_eval.state._select import JUMPS, choice_at, instructions_of, stack_effect

ENTRY = "[*]"  # in a path: any entry of a container
ANY = "{*}"  # in a path: any field (``getattr(self, name)``); ``{_batch_*}``: any whose name matches
HELD = "[^]"  # in a path: a display holding the value (``(self.a, self.b)``: ``a[^]``); ``a[^][*]`` is ``a``
CALLED = "()"  # as a method's name: the value itself is called (``self.handlers[k](x)``)
RETURNED = "()"  # ending a path's part: what that method hands back (``stats.snapshot()``)
FUNCTION = "@"  # starting such a part: a function's, given the value (``stats.@snapshot#0()``)
UNKNOWN = ("?",)  # a callable the scan cannot tell (``out.extend(self.ids)`` on a local list; ``fns[0](x)``)
_OPERATORS = ("BINARY_OP", "COMPARE_OP")
_SELF_LOADS = ("LOAD_FAST", "LOAD_DEREF")
_SEEN_CONSTANTS = (int, str, bytes)  # on the left, these try the probe's reflected method (an int's: its own)
_CALLS = ("PRECALL", "CALL", "CALL_FUNCTION_EX")
_TWO_IN = ("BINARY_OP", "COMPARE_OP", "BINARY_SUBSCR", "CONTAINS_OP", "IS_OP")  # take two, give one
_KEEPING = ("JUMP_IF_TRUE_OR_POP", "JUMP_IF_FALSE_OR_POP")  # a jump that keeps the value it tests
_DISPLAYS = ("BUILD_LIST", "BUILD_TUPLE", "BUILD_MAP", "BUILD_CONST_KEY_MAP")
_HOLDING = (*_DISPLAYS, "BUILD_SET")  # a display holding the values it takes
_PASSING_ENTRY = ("max", "min", "next")  # given one container (and keywords): return one of its entries
_VIEWS = ("values", "items", "keys", "get", "copy", "setdefault", "pop")  # methods handing back what it holds
_PASSING = ("sorted", "list", "tuple", "reversed", "iter", "set", "frozenset", "filter", *_PASSING_ENTRY)
Loads = Dict[int, Tuple[int, FrozenSet[str]]]  # where a field is pushed -> (where its load starts, its paths)
Iterated = Tuple[FrozenSet[str], bool]  # what a comprehension's entries stand for; whether they are items() pairs
_COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<setcomp>", "<dictcomp>")
Calls = Set[Tuple[Tuple[str, ...], str]]  # (the fields leading to an object, its method called)
_CALLABLE_LOADS = ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "CALL", "LOAD_FAST")  # what pushes a callable
_BINDING_REACH = 64  # instructions before a local's binding searched for the value it stores
Argument = Union[int, str, None]  # a call's argument: by position, by keyword, "*"/"**" (``f(*a, **k)``), not known
_SPREADING = ("LIST_EXTEND", "SET_UPDATE", "DICT_MERGE", "DICT_UPDATE")  # ``[*v]``, ``f(*v, **w)``: into the display


def uses(code: types.CodeType, selves: Tuple[str, ...], iterated: Iterated = (frozenset(), False)
         ) -> Tuple[Set[str], Calls, Set[str]]:
    """(paths read in C, methods called, paths given to calls: ``""`` for ``self``
    itself) of the fields of the locals named ``selves`` in ``code`` (not its nested
    code objects); in a comprehension's code, ``iterated`` (:func:`comprehensions`)
    says what its loop's variable stands for."""
    if not selves:
        return set(), set(), set()
    instructions = instructions_of(code)
    loads = _attribute_loads(instructions, selves, iterated)
    reads = _right_operands(instructions, loads) | _call_arguments(code, instructions, loads, selves) | _indices(
        instructions, loads)
    return {plain(path) for path in reads}, _field_calls(instructions, loads, selves), _given(
        instructions, loads, selves)


def given_to_calls(code: types.CodeType, selves: Tuple[str, ...], iterated: Iterated = (frozenset(), False)
                   ) -> Set[Tuple[Tuple[str, ...], str, bool, Argument]]:
    """(the names that load a call's callable from a global, ``("torch", "stack")``,
    or from one of ``selves``, ``("self", "hparams", "dump")``, ``("self", "handlers",
    "[*]")`` for an entry of a container; the path of a field
    given to it; whether the field itself is given, not what a method of it hands
    back; the argument it is, :func:`_argument_at`) of each field ``code`` gives to
    such a call.

    Example
    -------
    >>> def f(self):
    ...     return torch.stack(self.losses).mean() + len(self.ids) + json.dumps(self.stats.snapshot(), indent=self.n)
    >>> sorted(given_to_calls(f.__code__, ("self",)))  # doctest: +NORMALIZE_WHITESPACE
    [(('json', 'dumps'), 'n', True, 'indent'), (('json', 'dumps'), 'stats', False, 0),
     (('json', 'dumps'), 'stats.snapshot()', True, 0), (('len',), 'ids', True, 0),
     (('torch', 'stack'), 'losses', True, 0)]
    """
    instructions = instructions_of(code)
    found = set()
    loads = _attribute_loads(instructions, selves, iterated)
    itself = {at: (at, frozenset({""})) for at, instruction in enumerate(instructions[:-1])  # vars(self)
              if len(selves) == 1 and instruction.opname in _SELF_LOADS and instruction.argval in selves
              and _itself(instructions, at)}  # of several, which is not known
    for end, (start, paths) in {**itself, **loads}.items():
        taker, above = _take(instructions, end)
        if taker is None or not _is_argument(instructions, taker) or _is_choice(code, instructions, taker):
            continue  # min(s, self.low) stored back: a choice the merge replays
        call = taker + 1 if instructions[taker].opname == "PRECALL" else taker
        callee = _callee(instructions, start, call)
        names = _from_a_global(instructions, callee, selves)
        held = [(selves[0], *parts(plain(path))) for path in loads[callee][1] if path.endswith(ENTRY)] if (
            callee in loads and not names) else []  # self.handlers["dump"](self.stats): an entry it holds
        if not names and not held and not _makes_function(instructions, callee):
            held = [UNKNOWN]
        argument = _argument_at(instructions, taker, above)
        spread = ENTRY if argument in ("*", "**") else ""  # f(*args): what it is given are the entries
        found |= {(callable_, plain(f"{path}{spread}"), not _handed_back(instructions, end), argument)
                  for callable_ in ([names] if names else held) for path in paths}
    return found


def _makes_function(instructions: List[dis.Instruction], callee: Optional[int]) -> bool:
    """Whether the callable pushed at ``callee`` is a function the code makes (a local
    bound to a nested ``def`` or ``lambda``: :func:`passed_functions` follows it)."""
    if callee is None or instructions[callee].opname not in ("LOAD_FAST", "LOAD_DEREF"):
        return False
    store = next((i for i in range(callee - 1, 0, -1) if instructions[i].opname in ("STORE_FAST", "STORE_DEREF")
                  and instructions[i].argval == instructions[callee].argval), None)
    return store is not None and instructions[store - 1].opname == "MAKE_FUNCTION"


def _argument_at(instructions: List[dis.Instruction], taker: int, above: int) -> Argument:
    """Which argument of the call whose ``PRECALL`` is at ``taker`` a value ``above``
    (:func:`_take`) from the top is: its position (``dump(self.stats, 2)``: 0), its
    keyword (``dump(indent=2, stats=self.stats)``: ``"stats"``), the sequence or the
    mapping spread into the arguments (``dump(*args)``: ``"*"``; ``dump(**kwargs)``:
    ``"**"``), or None (the callable)."""
    if instructions[taker].opname == "CALL_FUNCTION_EX":  # f(*args, **kwargs): the sequence, then the mapping
        keywords = instructions[taker].arg & 1
        return {1: "**" if keywords else "*", 2: "*" if keywords else None}.get(above)
    if instructions[taker].opname != "PRECALL":
        return None
    count, keywords = instructions[taker].arg, ()
    if taker and instructions[taker - 1].opname == "KW_NAMES":
        keywords = instructions[taker - 1].argval
    position = count - above
    if position < 0:  # not one of the arguments counted (a method's object)
        return None
    return keywords[position - (count - len(keywords))] if position >= count - len(keywords) else position


def is_called(instructions: List[dis.Instruction], at: int) -> bool:
    """Whether the value pushed ``at`` is what a call calls (``update(...)``), not
    given or stored (``map(update, ...)``)."""
    taker, above = _take(instructions, at)
    return taker is not None and (instructions[taker].opname == "CALL" or (
        instructions[taker].opname == "CALL_FUNCTION_EX" and _argument_at(instructions, taker, above) is None))


def _handed_back(instructions: List[dis.Instruction], end: int) -> bool:
    """Whether the value pushed at ``end`` is what a call hands back, not a field
    itself: a method of it is called (``self.stats.snapshot()``; not a view of it,
    ``self.per_key.values()``), or it is a local bound to what a call hands back
    (``m = self.aligner.lookup(k)``; not ``m = self.meters.get(k)``)."""
    if instructions[end + 1].opname == "LOAD_METHOD":
        return instructions[end + 1].argval not in _VIEWS
    if instructions[end].opname != "LOAD_FAST":
        return False
    store = next((i for i in range(end - 1, 0, -1) if instructions[i].opname == "STORE_FAST"
                  and instructions[i].argval == instructions[end].argval), None)
    if store is None or instructions[store - 1].opname != "CALL":
        return False
    callee = _callee(instructions, store - 1, store - 1)  # m = self.meters.get(k): one of its entries
    return callee is None or instructions[callee].opname != "LOAD_METHOD" or instructions[callee].argval not in _VIEWS


def _callee(instructions: List[dis.Instruction], start: int, call: int) -> Optional[int]:
    """The index of the instruction before ``start`` that pushes what ``call`` calls:
    a load, a call that makes it, or a subscript that takes it from a container."""
    return next((i for i in range(start - 1, -1, -1) if instructions[i].opname in (*_CALLABLE_LOADS, "BINARY_SUBSCR")
                 and _taker(instructions, i) == call), None)


def _from_a_global(instructions: List[dis.Instruction], at: Optional[int], selves: Tuple[str, ...]
                   ) -> Optional[Tuple[str, ...]]:
    """The names that load from a global the callable pushed ``at``
    (``torch.nn.functional.pad``), or the callable a call of it makes, or whose method
    it is (``operator.attrgetter("n")``, ``json.JSONEncoder().encode``:
    ``("json", "JSONEncoder")``), through a local bound to one (``fn = json.dumps``);
    or from one of ``selves`` (``self.hparams.dump``: ``("self", "hparams", "dump")``);
    None if it comes otherwise."""
    names: List[str] = []
    for _ in range(16):
        if at is None:
            return None
        instruction = instructions[at]
        if instruction.opname == "LOAD_GLOBAL":
            return (instruction.argval, *names)
        if instruction.opname == "CALL":  # what a call makes: the callable it calls stands for it
            names, at = [], _callee(instructions, at, at)
        elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and at and instructions[at - 1].opname in (
                "LOAD_GLOBAL", "LOAD_ATTR", "CALL", "LOAD_FAST"):
            names, at = [instruction.argval, *names], at - 1
        elif instruction.opname == "LOAD_FAST":  # its last binding before: what it stores
            bound, at = _binding(instructions, at), _stored(instructions, at)
            if bound is None and instruction.argval in selves and names:
                return (instruction.argval, *names)
        else:
            return None
    return None


def _binding(instructions: Sequence[dis.Instruction], at: int) -> Optional[int]:
    """The index of the last ``STORE_FAST`` before ``at`` of the local ``at`` loads."""
    return next((i for i in range(at - 1, 0, -1) if instructions[i].opname == "STORE_FAST"
                 and instructions[i].argval == instructions[at].argval), None)


def _stored(instructions: Sequence[dis.Instruction], at: int) -> Optional[int]:
    """The index of the load or call that pushed what the local ``at`` loads was last
    bound to (``a, b = f, g``: through the ``SWAP``), if near its binding."""
    store = _binding(instructions, at)
    return None if store is None else next((i for i in range(store - 1, max(-1, store - _BINDING_REACH), -1)
                                            if instructions[i].opname in _CALLABLE_LOADS
                                            and _taker(instructions, i) == store), None)


def passed_functions(code: types.CodeType, selves: Tuple[str, ...], iterated: Iterated = (frozenset(), False)
                     ) -> Dict[types.CodeType, FrozenSet[str]]:
    """What the parameters of each function ``code`` makes (a ``lambda``, a nested
    ``def``) may stand for, by its code object: the fields given with it to the call
    it is given to (``map(lambda m: 2.5 * m.count, (self.a, self.b))``: ``a``, ``b``),
    or given to it where a local holding it is called (``def score(m): ...``, then
    ``score(self.a)``); else every field ``code`` gives to a call. Each stands for
    the field and for its entries (``sorted(self.meters, key=lambda m: ...)``).

    Example
    -------
    >>> def f(self):
    ...     return list(map(lambda m: 2.5 * m.count, (self.a, self.b)))
    >>> [sorted({plain(path) for path in paths}) for paths in passed_functions(f.__code__, ("self",)).values()]
    [['a', 'a[*]', 'b']]
    """
    nested = [constant for constant in code.co_consts
              if isinstance(constant, types.CodeType) and constant.co_name not in _COMPREHENSIONS]
    if not nested or not selves:
        return {}
    instructions = instructions_of(code)
    loads = _attribute_loads(instructions, selves, iterated)
    taken = {end: _taker(instructions, end) for end in loads}

    def given_at(site: int) -> Set[str]:
        return {path for end, (_, paths) in loads.items() if taken[end] == site for path in paths}
    everywhere = {path for end, (_, paths) in loads.items() if taken[end] is not None
                  and _is_argument(instructions, taken[end]) for path in paths}
    found: Dict[types.CodeType, FrozenSet[str]] = {}
    for at, instruction in enumerate(instructions[:-1]):
        if not any(instruction.argval is made for made in nested) or instructions[at + 1].opname != "MAKE_FUNCTION":
            continue
        taker = _taker(instructions, at + 1)
        if taker is not None and _is_argument(instructions, taker):  # map(lambda m: ..., v)
            paths = given_at(taker)
        elif taker is not None and instructions[taker].opname in ("STORE_FAST", "STORE_DEREF"):  # def f(m): ...
            name = instructions[taker].argval
            calls = [_taker(instructions, index) for index, load in enumerate(instructions)
                     if load.opname in _SELF_LOADS and load.argval == name]
            paths = set().union(*(given_at(call - 1) for call in calls if call is not None and _is_callable(
                instructions, call) and instructions[call].opname == "CALL"))
        else:
            paths = everywhere
        found[instruction.argval] = frozenset(paths | {f"{path}{ENTRY}" for path in paths})
    return found


def parts(label: str) -> Tuple[str, ...]:
    """``per_key[*].count`` -> ``("per_key", "[*]", "count")``."""
    return tuple(re.findall(r"\[\*\]|\[\^\]|[^.\[\]]+", label))


def label_of(path: Sequence[str]) -> str:
    """:func:`parts` undone, :func:`plain`."""
    return plain("".join(part if part in (ENTRY, HELD) or not at else f".{part}" for at, part in enumerate(path)))


def plain(label: str) -> str:
    """``label`` without the displays its value passed through: an entry of a display
    holding ``a`` (``a[^][*]``) is ``a``, and so, for what C code given it reads, is
    the display (``a[^]``), but before what a function hands back (``a[^].@f#*()``)."""
    return re.sub(r"\[\^\](?!\.@)", "", _entries_taken(label))


def _entries_taken(label: str) -> str:
    while HELD + ENTRY in label:
        label = label.replace(HELD + ENTRY, "")
    return label


def comprehensions(code: types.CodeType, selves: Tuple[str, ...], iterated: Iterated = (frozenset(), False)
                   ) -> Dict[types.CodeType, Iterated]:
    """What each comprehension ``code`` runs loops over, by its code object: the
    entries of a field (``[2.5 * m.count for m in self.meters]``, its ``values()``
    or ``items()``: ``meters[*]``) or the fields a display holds (``for m in
    (self.a, self.b)``: ``a``, ``b``).

    Example
    -------
    >>> def f(self):
    ...     return [2.5 * m.count for m in (self.a, self.b)], {k: v for k, v in self.d.items()}
    >>> sorted((sorted(paths), items) for paths, items in comprehensions(f.__code__, ("self",)).values())
    [(['a', 'b'], False), (['d[*]'], True)]
    """
    if not any(isinstance(c, types.CodeType) and c.co_name in _COMPREHENSIONS for c in code.co_consts):
        return {}
    instructions = instructions_of(code)
    loads = _attribute_loads(instructions, selves, iterated)
    found: Dict[types.CodeType, Iterated] = {}
    for at, instruction in enumerate(instructions[:-1]):
        if not (isinstance(instruction.argval, types.CodeType) and instruction.argval.co_name in _COMPREHENSIONS
                and instructions[at + 1].opname == "MAKE_FUNCTION"):
            continue
        depth, last = 0, None
        for index in range(at + 2, len(instructions) - 2):  # the iterable, then GET_ITER and the call
            if instructions[index].opcode in JUMPS:
                break
            if instructions[index].opname == "GET_ITER" and depth == 1 and instructions[index + 1].opname == "PRECALL":
                last = index - 1
                break
            depth += stack_effect(instructions[index])
        if last is None:
            continue
        if last in loads:  # for m in self.meters; for m in (self.a, self.b)
            found[instruction.argval] = (frozenset(_entries_taken(f"{path}{ENTRY}") for path in loads[last][1]), False)
        elif instructions[last].opname in _SELF_LOADS and instructions[last].argval in selves:  # in *values
            found[instruction.argval] = (frozenset({ENTRY}), False)
        elif instructions[last].opname == "CALL" and instructions[last - 2].opname == "LOAD_METHOD" and instructions[
                last - 2].argval in ("values", "items") and last - 3 in loads:  # self.per_key.items()
            found[instruction.argval] = (frozenset(_entries_taken(f"{path}{ENTRY}") for path in loads[last - 3][1]),
                                         instructions[last - 2].argval == "items")
    return found


def _loop_variables(instructions: List[dis.Instruction], iterated: Iterated) -> Dict[str, FrozenSet[str]]:
    """A comprehension's loop variable bound to what ``iterated`` says its entries are
    (of ``items()`` pairs, the value)."""
    paths, items = iterated
    for at, instruction in enumerate(instructions[:-3]) if paths else ():
        if instruction.opname == "LOAD_FAST" and instruction.argval == ".0" and instructions[
                at + 1].opname == "FOR_ITER":
            store = at + 2 + (items and instructions[at + 2].opname == "UNPACK_SEQUENCE") * 2
            if instructions[store].opname == "STORE_FAST":
                return {instructions[store].argval: paths}
    return {}


def _attribute_loads(instructions: List[dis.Instruction], selves: Tuple[str, ...],
                     iterated: Iterated = (frozenset(), False)) -> Loads:
    """Index of each instruction that pushes a field of ``self`` -> (index of the load
    it starts from, the paths it may be): ``self.n``, ``self.stats.count`` and
    ``self.per_key[k].count`` (``n``, ``stats.count``, ``per_key[*].count``), or
    through ``getattr`` (``getattr(self, "n")``; ``getattr(self, f"{stage}_stats")``:
    ``{*_stats}``) or a local bound to one (``stats = self.stats``, ``a, b = self.a,
    self.b``, ``x = self.a if c else self.b``, ``(x := self.a)``; ``for m in
    self.meters``, ``enumerate`` or ``zip`` of it: ``meters[*]``; ``m =
    pick(self.meters)``, ``m = self.meters.get(k)``: ``meters`` and ``meters[*]``)."""
    def chains(starts: Dict[int, FrozenSet[str]]) -> Loads:
        found = {}
        for begin, paths in starts.items():
            start, end = origins.get(begin, begin), begin
            while True:
                while end + 1 < len(instructions) and instructions[end + 1].opname == "LOAD_ATTR":
                    end += 1
                    paths = frozenset(f"{path}.{instructions[end].argval}" if path else instructions[end].argval
                                      for path in paths)
                taker, above = _take(instructions, end)
                if taker is not None and instructions[taker].opname in _DISPLAYS:  # {"a": self.a}["a"]
                    taker, above = _take(instructions, taker)
                if taker is None or instructions[taker].opname != "BINARY_SUBSCR" or above != 2:
                    break
                if paths == {""}:  # values[0] of a *values parameter: one of its entries
                    paths, end = frozenset({ENTRY}), taker
                    continue
                if instructions[end + 1].opname == "LOAD_METHOD" and instructions[end + 1].argval not in _VIEWS:
                    break  # self.stats.snapshot()["n"]: what the method hands back is subscripted (_method_results)
                if not _in_literal(instructions, end, taker):  # [self.a][0] is a itself
                    paths = frozenset(f"{path}{ENTRY}" for path in paths)  # one of the container's entries
                end = taker
            if "" not in paths:
                found[end] = (start, paths)
        return found
    starts = {i: frozenset({""}) for i, instruction in enumerate(instructions)
              if instruction.opname in _SELF_LOADS and instruction.argval in selves}
    looped = _loop_variables(instructions, iterated)  # a comprehension's: the entries of what it loops over
    aliases: Dict[str, FrozenSet[str]] = dict(looped)
    fetched: Dict[int, FrozenSet[str]] = {}
    origins: Dict[int, int] = {}  # a method's call -> where the load of its object starts
    for _ in range(8):  # a local bound to a local bound to a field, too
        through = {i: aliases[instruction.argval] for i, instruction in enumerate(instructions)
                   if instruction.opname == "LOAD_FAST" and instruction.argval in aliases}
        loads = chains({**starts, **fetched, **through})
        loads = {**_displays(instructions, loads), **loads}
        fetched = {call: frozenset(f"{path}.{name}" if path else name for path in paths)
                   for call, (_, paths, name) in _getattrs(instructions, loads, selves).items()}
        returning = {**_function_results(instructions, loads, selves), **_method_results(instructions, loads, selves)}
        origins = {call: start for call, (start, _) in returning.items()}
        fetched = {**{call: paths for call, (_, paths) in returning.items()}, **fetched}  # getattr: the field
        bound: Dict[str, Set[str]] = collections.defaultdict(set, {name: set(paths) for name, paths in looped.items()})
        for end, (start, paths) in loads.items():
            for name, entry in _bound_to(instructions, start, end):
                bound[name] |= {f"{path}{ENTRY}" if entry else path for path in paths}
        for end in filter(functools.partial(_itself, instructions), starts):  # for v in values: *values's entries
            bound.update((name, bound[name] | {ENTRY}) for name, entry in _bound_to(instructions, end, end) if entry)
        if {name: frozenset(paths) for name, paths in bound.items()} == aliases and set(fetched) <= set(loads):
            return loads
        aliases = {name: frozenset(paths) for name, paths in bound.items()}
    return loads


def _method_results(instructions: List[dis.Instruction], loads: Loads, selves: Tuple[str, ...]) -> Loads:
    """What a method of ``self`` or of a field hands back (``self.stats.snapshot()``:
    ``stats.snapshot()``, :data:`RETURNED`), but a view's (``get``, ``values``: followed
    as the value's entries): index of its ``CALL`` -> (where the object's load
    starts, the paths)."""
    found = {}
    for end, paths in _pushed(instructions, loads, selves).items():
        call = _method_call(instructions, end) if end + 1 < len(instructions) and instructions[
            end + 1].argval not in _VIEWS else None
        if call is not None:
            start = loads[end][0] if end in loads else end
            name = instructions[end + 1].argval + RETURNED
            found[call] = (start, frozenset(f"{path}.{name}" if path else name for path in paths))
    for end, (start, paths) in loads.items():  # snap = self.stats.snapshot; snap(): the method loaded, then called
        taker = _taker(instructions, end)
        if taker is not None and _is_callable(instructions, taker) and not any(
                path.endswith(HELD) for path in paths):
            found[taker if instructions[taker].opname == "CALL" else taker + 1] = (
                start, frozenset(f"{path}{RETURNED}" for path in paths))
    return found


def _function_results(instructions: Sequence[dis.Instruction], loads: Loads, selves: Tuple[str, ...]) -> Loads:
    """What a function loaded from a global hands back, given ``self`` or a field
    (``snapshot(self.stats, 2)``: ``stats.@snapshot#0()``, :func:`function_result`):
    index of its ``CALL`` -> (where the call starts, the paths)."""
    found: Dict[int, Tuple[int, Set[str]]] = {}
    for end, paths in _pushed(instructions, loads, selves).items():
        if paths == {""} and not _itself(instructions, end):
            continue  # self's field, not self itself
        taker, above = _take(instructions, end)
        if taker is None or instructions[taker].opname not in ("PRECALL", "CALL_FUNCTION_EX") or not _is_argument(
                instructions, taker):
            continue
        start = loads[end][0] if end in loads else end
        call = taker + 1 if instructions[taker].opname == "PRECALL" else taker
        callee = _callee(instructions, start, call)
        argument = _argument_at(instructions, taker, above)
        names = _global_chain(instructions, callee)
        if not names or argument is None or _handed_back(instructions, end):
            continue
        name = function_result(names, argument)
        found.setdefault(call, (callee - len(names) + 1, set()))[1].update(
            f"{path}.{name}" if path else name for path in paths)
    return {call: (start, frozenset(paths)) for call, (start, paths) in found.items()}


def _global_chain(instructions: Sequence[dis.Instruction], at: Optional[int]) -> Tuple[str, ...]:
    """The names loading the callable pushed ``at`` from a global and its attributes
    only (``snapshot``, ``helpers.snapshot``; through a local bound to one, ``f =
    snapshot``), or ``()``."""
    names: List[str] = []
    if at is not None and instructions[at].opname == "LOAD_FAST":
        at = _stored(instructions, at)
    while at is not None and at >= 0 and instructions[at].opname in ("LOAD_ATTR", "LOAD_METHOD"):
        names, at = [instructions[at].argval, *names], at - 1
    return (instructions[at].argval, *names) if at is not None and at >= 0 and instructions[
        at].opname == "LOAD_GLOBAL" else ()


def function_result(names: Sequence[str], argument: Union[int, str]) -> str:
    """A path's part standing for what the function ``names`` load (a global and its
    attributes) hands back of the value given as its ``argument``
    (``@snapshot#0()``, ``@helpers:snapshot#stats()``)."""
    return f"{FUNCTION}{':'.join(names)}#{argument}{RETURNED}"


def returned(code: types.CodeType, selves: Tuple[str, ...]) -> FrozenSet[str]:
    """The paths of the fields of ``selves`` (``""``: the object itself) that ``code``
    returns, as they are held (``return {"n": self.n}``: ``n[^]``).

    Example
    -------
    >>> def snapshot(self):
    ...     total = self.total
    ...     return {"n": self.n, "total": total} if self.n else self.empty()
    >>> sorted(returned(snapshot.__code__, ("self",)))
    ['empty()', 'n[^]', 'total[^]']
    """
    instructions = instructions_of(code)
    pushed = _pushed(instructions, _attribute_loads(instructions, selves), selves)
    return frozenset(path for end, paths in pushed.items()
                     if (paths != {""} or _itself(instructions, end))
                     and _holder(instructions, end) is None  # {"n": self.n}: the display's path, n[^]
                     and (taker := _taker(instructions, end)) is not None
                     and instructions[taker].opname == "RETURN_VALUE" for path in paths)


def _displays(instructions: List[dis.Instruction], loads: Loads) -> Loads:
    """Each list, tuple, set or dict display holding fields (``(self.a, self.b)``,
    ``{"n": self.n}``), but one subscripted at once (``[self.a][0]``, followed as
    ``a``): index of its build -> (where its build starts, the fields' paths as held
    by it: ``a[^]``, ``b[^]``)."""
    held: Dict[int, Set[str]] = collections.defaultdict(set)
    for end, (_, paths) in loads.items():
        display = _holder(instructions, end)
        if display is not None:
            held[display] |= {f"{path}{HELD}" for path in paths}
    found = {}
    for display, paths in held.items():
        start = _start_of(instructions, display)
        taker, above = _take(instructions, display)
        if start is not None and display not in loads and not (
                taker is not None and instructions[taker].opname == "BINARY_SUBSCR" and above == 2):
            found[display] = (start, frozenset(paths))
    return found


def _holder(instructions: List[dis.Instruction], end: int) -> Optional[int]:
    """The index of the display that takes the value pushed at ``end``, if one does
    before it is taken otherwise."""
    above, taker = 1, _taker(instructions, end)
    for index in range(end + 1, len(instructions)):
        instruction = instructions[index]
        if instruction.opcode in JUMPS:
            return None
        if instruction.opname in _HOLDING and 1 - stack_effect(instruction) >= above:
            return index
        above += stack_effect(instruction)
        if above <= 0 or index == taker:
            return None
    return None


def _start_of(instructions: List[dis.Instruction], display: int) -> Optional[int]:
    """The index of the first instruction building what ``display`` takes (None
    across a jump)."""
    taken, pushed = 1 - stack_effect(instructions[display]), 0
    for index in range(display - 1, -1, -1):
        if instructions[index].opcode in JUMPS:
            return None
        pushed += stack_effect(instructions[index])
        if pushed >= taken:
            return index
    return None


def _in_literal(instructions: List[dis.Instruction], end: int, taker: int) -> bool:
    """Whether a list, tuple or dict display built between ``end`` and ``taker`` holds
    the value ``end`` pushed (``[self.a][0]``, ``{"a": self.a}["a"]``, not
    ``self.d[a, b]``)."""
    above = 1
    for instruction in instructions[end + 1:taker]:
        if instruction.opname in _DISPLAYS and 1 - stack_effect(instruction) >= above:  # it takes the value
            return True
        above += stack_effect(instruction)
    return False


def _getattrs(instructions: List[dis.Instruction], loads: Loads, selves: Tuple[str, ...]
              ) -> Dict[int, Tuple[int, FrozenSet[str], str]]:
    """Each call ``getattr(v, name)`` (or ``getattr(v, name, constant)``) of ``self`` or a
    field of it: index of its ``CALL`` -> (index of its ``LOAD_GLOBAL``, the paths of
    ``v``, the name or its pattern, :func:`_name_of`)."""
    owners = {**{i: (i, frozenset({""})) for i, instruction in enumerate(instructions)
                 if instruction.opname in _SELF_LOADS and instruction.argval in selves}, **loads}
    starts = {start: (end, paths) for end, (start, paths) in owners.items()}
    found = {}
    for at, instruction in enumerate(instructions[:-1]):
        if instruction.opname != "LOAD_GLOBAL" or instruction.argval != "getattr" or at + 1 not in starts:
            continue
        owner, paths = starts[at + 1]
        call = _taker(instructions, at)  # getattr's own (a name computed by a call, name.lower(), has one before)
        precall = call - 1 if call is not None and instructions[call - 1].opname == "PRECALL" else None
        if precall is None or not (instructions[precall].arg == 2 or (
                instructions[precall].arg == 3 and instructions[precall - 1].opname == "LOAD_CONST")):
            continue
        found[call] = (at, paths, _name_of(instructions[owner + 1:precall + 2 - instructions[precall].arg]))
    return found


def _name_of(instructions: List[dis.Instruction]) -> str:
    """The name a ``getattr`` is given, from the code computing it: a constant's, or a
    pattern (``f"_batch_{stage}"``: ``{_batch_*}``, :data:`ANY` if not made of
    constants and values joined)."""
    if len(instructions) == 1 and instructions[0].opname == "LOAD_CONST" and isinstance(instructions[0].argval, str):
        return instructions[0].argval
    pieces: List[str] = []
    for instruction in instructions:
        if instruction.opname == "LOAD_CONST" and isinstance(instruction.argval, str):
            pieces.append(re.sub(r"[^\w]", "?", instruction.argval))  # no separator of a path's parts
        elif instruction.opname == "FORMAT_VALUE" and instruction.arg & 0x04:
            pieces[-1:] = []  # a format spec's constant
        elif instruction.opname.startswith("LOAD_"):
            pieces.append("*")
        elif not (instruction.opname in ("FORMAT_VALUE", "BUILD_STRING") or (
                instruction.opname == "BINARY_OP" and instruction.argrepr == "+")):
            return ANY
    return "{" + re.sub(r"\*+", "*", "".join(pieces)) + "}"


def _bound_to(instructions: List[dis.Instruction], start: int, end: int) -> List[Tuple[str, bool]]:
    """The locals the value pushed from ``start`` to ``end`` is bound to, each with
    whether it is bound to the value's entries (a ``for`` loop over it, its
    ``values()`` or ``items()``, ``enumerate`` or ``zip`` of it)."""
    def at(index: int, *opnames: str) -> bool:
        return index < len(instructions) and instructions[index].opname in opnames
    method = _method_call(instructions, end) if at(end + 1, "LOAD_METHOD") and instructions[
        end + 1].argval not in ("values", "items", "keys") else None  # keys(): not what the value holds
    if method is not None:  # x = v.get(k): the value or one of its entries
        return _whole_or_entry(_bound_to(instructions, start, method))
    taker = _taker(instructions, end)
    if taker is not None and at(taker, "STORE_FAST"):  # x = v; a, b = v, w; x = v if c else w
        return [(instructions[taker].argval, False)]
    if at(end + 1, "COPY") and instructions[end + 1].arg == 1 and at(end + 2, "STORE_FAST"):  # (x := v)
        return [(instructions[end + 2].argval, False)]
    if taker is not None and at(taker, "GET_ITER") and at(taker - 1, "BUILD_TUPLE", "BUILD_LIST"):
        taker -= 1  # for x in (v, w): the tuple taken as the first value (_take)
    if taker is not None and at(taker, "BUILD_TUPLE", "BUILD_LIST") and at(taker + 1, "GET_ITER") and at(
            taker + 2, "FOR_ITER") and at(taker + 3, "STORE_FAST"):  # for x in (v, w)
        return [(instructions[taker + 3].argval, False)]
    paired = _paired_in_loop(instructions, start, end)
    if paired:
        return [(paired, True)]
    items = at(end + 1, "LOAD_METHOD") and instructions[end + 1].argval == "items"
    if at(end + 1, "LOAD_METHOD") and instructions[end + 1].argval in ("values", "items") and at(
            end + 2, "PRECALL") and at(end + 3, "CALL"):
        end += 3
    if at(end + 1, "GET_ITER") and at(end + 2, "FOR_ITER"):
        if items and at(end + 3, "UNPACK_SEQUENCE") and at(end + 4, "STORE_FAST") and at(end + 5, "STORE_FAST"):
            return [(instructions[end + 5].argval, True)]  # for k, x in v.items()
        if not items and at(end + 3, "STORE_FAST"):  # for x in v; for x in v.values()
            return [(instructions[end + 3].argval, True)]
    return [] if items else _bound_through_call(instructions, start, end)


def _bound_through_call(instructions: List[dis.Instruction], start: int, end: int) -> List[Tuple[str, bool]]:
    """:func:`_bound_to` of what a call given the value pushed from ``start`` to
    ``end`` returns. From a builtin of :data:`_PASSING` given it first: the value's
    entries again (``ms = sorted(v)``, ``for m in list(v.values())``: ``ms`` stands
    for ``v``) or one of them (``m = max(v, key=f)``, ``next(iter(v))``). From any
    other call given it, or a method of its own (``m = pick(v, k)``, ``m =
    v.get(k)``): what it returns may be the value or one of its entries, so it stands
    for both."""
    taker, above = _take(instructions, end)
    if taker is None or instructions[taker].opname != "PRECALL" or above > instructions[taker].arg or (
            taker + 1 >= len(instructions) or instructions[taker + 1].opname != "CALL"):
        return []
    callee = next((i for i in range(start - 1, -1, -1) if instructions[i].opname == "LOAD_GLOBAL"
                   and _taker(instructions, i) == taker + 1), None)
    if callee is None or instructions[callee].argval not in _PASSING or above != instructions[taker].arg:
        return _whole_or_entry(_bound_to(instructions, start, taker + 1))  # another call: the value, or an entry
    bound = _bound_to(instructions, callee, taker + 1)
    if instructions[callee].argval not in _PASSING_ENTRY:
        return bound
    count, keywords = instructions[taker].arg, instructions[taker - 1].opname == "KW_NAMES"  # 3.11 hides their names
    entry = [(name, True) for name, entries in bound if not entries]  # one entry, bound as it is
    if count == 1 or instructions[callee].argval == "next" or (keywords and count == 2):
        return entry
    return entry + bound if keywords else bound  # max(v, w, key=f) or max(v, key=f, default=d); max(v, w)


def _whole_or_entry(bound: List[Tuple[str, bool]]) -> List[Tuple[str, bool]]:
    """``bound``, each local bound to the value standing for its entries too."""
    return bound + [(name, True) for name, entries in bound if not entries]


def _method_call(instructions: List[dis.Instruction], end: int) -> Optional[int]:
    """The index of the ``CALL`` of a method of the value pushed at ``end``
    (``v.get(k)``), if the next instruction loads one (None past a jump)."""
    if end + 1 >= len(instructions) or instructions[end + 1].opname != "LOAD_METHOD":
        return None
    depth = 2  # the method and the value
    for index in range(end + 2, len(instructions)):
        if instructions[index].opcode in JUMPS:
            return None
        depth += stack_effect(instructions[index])
        if instructions[index].opname == "CALL" and depth == 1:
            return index
        if depth < 1:
            return None
    return None


def _paired_in_loop(instructions: List[dis.Instruction], start: int, end: int) -> Optional[str]:
    """The local a loop binds to the entries of the value pushed from ``start`` to
    ``end`` through the builtin ``enumerate`` or ``zip`` (``for i, x in enumerate(v)``,
    ``for name, x in zip(names, v)``), if any."""
    taker, above = _take(instructions, end)
    if taker is None or instructions[taker].opname != "PRECALL" or taker + 5 >= len(instructions) or [
            instruction.opname for instruction in instructions[taker + 1:taker + 5]] != [
            "CALL", "GET_ITER", "FOR_ITER", "UNPACK_SEQUENCE"]:
        return None
    pairing = next((i for i in range(start - 1, -1, -1) if instructions[i].opname == "LOAD_GLOBAL"
                    and instructions[i].argval in ("enumerate", "zip") and _taker(instructions, i) == taker + 1), None)
    if pairing is None:
        return None
    element = instructions[taker].arg - above + (instructions[pairing].argval == "enumerate")  # after the count
    store = taker + 5 + element
    return instructions[store].argval if store < len(instructions) and all(
        instruction.opname == "STORE_FAST" for instruction in instructions[taker + 5:store + 1]) else None


def _right_operands(instructions: List[dis.Instruction], loads: Loads) -> Set[str]:
    found: Set[str] = set()
    for end, (start, paths) in loads.items():
        taker = _taker(instructions, end)
        if taker is not None and instructions[taker].opname in _DISPLAYS and _formats(
                instructions, _taker(instructions, taker)):
            found |= paths  # "%d/%d" % (self.n, b): the text's own % formats the tuple's entries in C
            continue
        if end + 1 >= len(instructions) or instructions[end + 1].opname not in _OPERATORS or start < 1:
            continue
        left = instructions[start - 1]
        if start - 1 in loads or (left.opname == "LOAD_CONST" and isinstance(left.argval, _SEEN_CONSTANTS) and not (
                isinstance(left.argval, (str, bytes)) and _formats(instructions, end + 1))):
            continue  # self.x + self.n: x's probe sees n as its operand; 2 * self.n: n's reflected method
        found |= paths  # ("%d" % self.n: the text's % formats a number in C, no method of the probe's called)
    return found


def _formats(instructions: List[dis.Instruction], at: Optional[int]) -> bool:
    """Whether instruction ``at`` is ``%`` (``"%d" % n``: printf-style formatting)."""
    if at is None:
        return False
    instruction = instructions[at]
    return (instruction.opname == "BINARY_OP" and instruction.argrepr in ("%", "%=")) or instruction.opname in (
        "BINARY_MODULO", "INPLACE_MODULO")


def _call_arguments(code: types.CodeType, instructions: List[dis.Instruction], loads: Loads,
                    selves: Tuple[str, ...]) -> Set[str]:
    """Fields of ``self`` passed to a call (``math.sqrt(self.total)``,
    ``torch.tensor(self.x)``: C code takes a float's value without calling the
    probe's methods), but for a running extreme the merge replays as a choice
    (``self.low = min(s, self.low)``, :mod:`ddp_eval.state._select`), and for
    ``getattr(self.x, name)``; not a field called (``getattr(self, name)(x)``)."""
    fetching = set(_getattrs(instructions, loads, selves))
    found: Set[str] = set()
    for end, (_, paths) in loads.items():
        taker = _taker(instructions, end)
        if taker is not None and _is_argument(instructions, taker) and taker + 1 not in fetching and not _is_choice(
                code, instructions, taker):
            found |= paths
    return found


def _is_argument(instructions: List[dis.Instruction], taker: int) -> bool:
    """Whether a value taken at ``taker`` is a call's argument: Python 3.11's ``PRECALL
    n`` takes those (``PRECALL 0`` and the ``CALL`` after a ``PRECALL``: the callable)."""
    instruction = instructions[taker]
    return instruction.opname in _CALLS and not (instruction.opname == "PRECALL" and instruction.arg == 0) and not (
        instruction.opname == "CALL" and taker and instructions[taker - 1].opname == "PRECALL")


def _indices(instructions: List[dis.Instruction], loads: Loads) -> Set[str]:
    """Fields of ``self`` used as an index or a slice's bound of a container that is not
    one (``NAMES[self.n]``, ``x[:self.n]``): a list or a string takes an ``int``'s value
    in C. A watched container's recording copy sees its index (``self.items[self.n]``)."""
    taken = {end: _take(instructions, end) for end in loads}
    of_self = {taker for taker, above in taken.values() if above == 2} | {  # a field subscripted
        end for end, (_, paths) in loads.items() if any(path.endswith(ENTRY) for path in paths)}
    return {path for end, (_, paths) in loads.items() for path in paths if taken[end][0] is not None and (
        instructions[taken[end][0]].opname == "BUILD_SLICE" or (
            instructions[taken[end][0]].opname in ("BINARY_SUBSCR", "STORE_SUBSCR", "DELETE_SUBSCR")
            and taken[end][1] == 1 and taken[end][0] not in of_self))}


def _field_calls(instructions: List[dis.Instruction], loads: Loads, selves: Tuple[str, ...]
                 ) -> Set[Tuple[Tuple[str, ...], str]]:
    """Methods called on ``self`` and the objects it holds: ``self.meter(x)``,
    ``self.stats.update(x)`` and ``self.hparams.stats.update(x)`` give ``((),
    "meter")``, ``(("stats",), "update")`` and ``(("hparams", "stats"), "update")``;
    ``getattr(self, name)(x)`` gives ``((), ANY)``; ``self.handlers[k](x)`` and ``f =
    self.fn; f(x)`` give ``(("handlers", "[*]"), CALLED)`` and ``(("fn",), CALLED)``."""
    fetching = _getattrs(instructions, loads, selves)
    called = {(path, instructions[end + 1].argval) for end, paths in _pushed(instructions, loads, selves).items()
              for path in paths if end + 1 < len(instructions) and instructions[end + 1].opname == "LOAD_METHOD"}
    called |= {(path, CALLED) for end, (_, paths) in loads.items() if end not in fetching
               and (taker := _taker(instructions, end)) is not None and _is_callable(instructions, taker)
               for path in paths}
    called |= {(path, name) for at, paths, name in fetching.values()
               if at and instructions[at - 1].opname == "PUSH_NULL" for path in paths}  # getattr(self, name)(x)
    return {(parts(plain(path)), name) for path, name in called
            if not _entries_taken(path).endswith(HELD)}  # not a display's own ({"n": self.n}.values())


def _is_callable(instructions: List[dis.Instruction], taker: int) -> bool:
    """Whether a value taken at ``taker`` is the callable of a call (:func:`_is_argument`)."""
    instruction = instructions[taker]
    return (instruction.opname == "PRECALL" and instruction.arg == 0) or (
        instruction.opname == "CALL" and taker > 0 and instructions[taker - 1].opname == "PRECALL")


def _given(instructions: List[dis.Instruction], loads: Loads, selves: Tuple[str, ...]) -> Set[str]:
    """Paths of ``self`` (``""`` for ``self`` itself) passed to a call."""
    return {path for end, paths in _pushed(instructions, loads, selves).items() for path in paths
            if (path or _itself(instructions, end)) and (taker := _taker(instructions, end)) is not None
            and _is_argument(instructions, taker)}  # not the callable itself (self.handlers[k](x))


def _itself(instructions: Sequence[dis.Instruction], end: int) -> bool:
    """Whether ``self`` pushed at ``end`` is used itself, not as the owner of a field
    or method loaded next (``vars(self)``, not ``self.n``)."""
    return end + 1 < len(instructions) and instructions[end + 1].opname not in ("LOAD_ATTR", "LOAD_METHOD")


def _pushed(instructions: List[dis.Instruction], loads: Loads, selves: Tuple[str, ...]) -> Dict[int, FrozenSet[str]]:
    """Index of each instruction that pushes ``self`` (path ``""``) or a field of it -> its paths."""
    return {**{i: frozenset({""}) for i, instruction in enumerate(instructions)
               if instruction.opname in _SELF_LOADS and instruction.argval in selves},
            **{end: paths for end, (_, paths) in loads.items()}}


def _taker(instructions: List[dis.Instruction], at: int) -> Optional[int]:
    """The index of the instruction that takes the value ``at`` pushed off the stack
    (None past a jump or the end)."""
    return _take(instructions, at)[0]


def _take(instructions: List[dis.Instruction], at: int) -> Tuple[Optional[int], int]:
    """:func:`_taker`, and how many values from the taken one up it takes (1: the
    value is its last operand; 2: the one before, as a subscript's container)."""
    above = 1  # the value and what lies above it
    index = at + 1
    while index < len(instructions):
        instruction = instructions[index]
        if instruction.opcode in JUMPS:  # past a conditional expression's branch, or `v or w` keeping v: go on
            if instruction.opname == "JUMP_FORWARD" or (instruction.opname in _KEEPING and above == 1):
                index = next((i for i, to in enumerate(instructions) if to.offset == instruction.argval), index + 1)
                continue
            if above == 1 or instruction.offset > instruction.argval or "BACKWARD" in instruction.opname:
                return None, above  # the value tested, or a loop
            # a test of a value above it, in an expression whose branches each push one: the first branch
        if above == 1 and instruction.opname in (*_SPREADING, "LIST_TO_TUPLE"):  # f(*self.ids): its entries are
            above = instruction.arg if instruction.opname in _SPREADING else 1  # the display's, which goes on
            index += 1
            continue
        if instruction.opname == "SWAP":  # a, b = b, a: the value moves
            above = instruction.arg if above == 1 else 1 if above == instruction.arg else above
            index += 1
            continue
        effect = stack_effect(instruction)
        if above + effect <= 0 or (instruction.opname in _TWO_IN and above <= 2) or (
                above == 1 and effect >= 0 and instruction.opname not in ("KW_NAMES", "NOP", "CACHE")
                and not instruction.opname.startswith(("LOAD_", "PUSH_", "BUILD_", "COPY", "MAKE_"))):
            return index, above
        above += effect
        index += 1
    return None, above


def _is_choice(code: types.CodeType, instructions: List[dis.Instruction], taker: int) -> bool:
    call = next((i for i in instructions[taker:] if i.opname == "CALL"), None)  # Python 3.11: after its PRECALL
    return call is not None and choice_at(code, call.offset) is not None
