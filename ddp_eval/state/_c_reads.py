"""Finding the numbers a batch's code reads where no probe can see.

A probe is a subclass of ``int`` or ``float`` (:mod:`ddp_eval.state._numbers`):
``self.n * 2.0``, ``k + self.n`` and ``self.x < 0.5`` call its methods, but a
float on the left of a watched ``int`` (``100.0 * self.correct``, ``2.5 <
self.total``), or a tensor or array on the left of either (``loss * self.n``),
reads it in C without calling any. This module scans the bytecode of the code
a batch runs for a field of ``self`` (``self.n``, ``self.stats.count``, or a local
bound to one: ``seen = self.seen``) read as the right operand of an arithmetic
operator or a comparison, whose left operand is neither another field of
``self`` (whose probe then sees it) nor a constant that calls its methods, and
for one passed to a call (``math.sqrt(self.total)``, ``torch.tensor(self.x)``: C
code takes the value of a float or int subclass directly), but for the builtin
``max`` or ``min`` the merge replays as a choice, or used as the index of a
container that is not watched (``LABELS[self.n]``).

The code scanned, with its nested functions: ``compute_forward``,
``compute_objectives`` and ``evaluate_batch``; the methods they call on
``self``, and the parents' they call through ``super()``; the functions of the
recipe's modules they give ``self`` or a field of it (``update(self.stats, x)``:
each parameter taken for the value given, a read of ``stats.count`` as one of
``self.stats.count``); the methods they call on the objects the Brain holds and
on the entries of its dicts and lists, and the objects called
(``self.stats.update(x)``, ``self.per_key[k].update(x)``,
``self.hparams.meter(x)``, :func:`read_in_c_of`). What is reached otherwise (a
function found at run time, a library's code) is not. Such a read is taken as a
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
['correct', 'seen', 'squares']
"""

import collections
import dis
import functools
import inspect
import os
import re
import sys
import types
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set, Tuple

from ddp_eval.state._select import JUMPS, choice_at, stack_effect

BATCH_METHODS = ("evaluate_batch", "compute_forward", "compute_objectives")
_OPERATORS = ("BINARY_OP", "COMPARE_OP")
_SELF_LOADS = ("LOAD_FAST", "LOAD_DEREF")
_SEEN_CONSTANTS = (int, str, bytes)  # on the left, these try the probe's reflected method (an int's: its own)
_CALLS = ("PRECALL", "CALL", "CALL_FUNCTION_EX")
_TWO_IN = ("BINARY_OP", "COMPARE_OP", "BINARY_SUBSCR", "CONTAINS_OP", "IS_OP")  # take two, give one
_DEPTH = 4  # objects held in objects: how deep method calls are followed
LIBRARIES = {*sys.stdlib_module_names, "torch", "numpy", "speechbrain"}
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # a stand-in's methods are not the recipe's

ENTRY = "[*]"  # in a path: any entry of a container
Calls = FrozenSet[Tuple[Tuple[str, ...], str]]  # (the fields leading to an object, its method called)
Named = FrozenSet[Tuple[types.FunctionType, str]]  # a global's name, and a function that names it
Scan = Tuple[FrozenSet[str], Calls, Named]  # read in C, called, globals named


def read_in_c(owner_class: type, methods: Tuple[str, ...] = BATCH_METHODS) -> FrozenSet[str]:
    """Names of ``self``'s attributes that ``methods`` of ``owner_class`` (and what they
    call) read as the right operand of an operator whose left operand may read them
    in C, or pass to a call."""
    return _scan(owner_class, methods)[0]


def read_in_c_of(brain: Any) -> Set[str]:
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
    return reach(brain)[0]


def reach(brain: Any) -> Tuple[Set[str], List[Any], Set[Tuple[types.FunctionType, str]]]:
    """(labels read in C, the objects whose methods the batch code runs, the globals it
    names, each with a function naming it) of ``brain``'s batch code."""
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
        reads, calls, more = _scan(type(owner), methods)
        found |= {label_of((*path, *parts(name))) for name in reads}
        named |= more
        for fields, method in calls:
            for target in {type(value): value for value in values_at(owner, fields)}.values():  # one of a kind
                place, name, function = fields, method, getattr(type(target), method, None)
                if not isinstance(function, types.FunctionType):  # an object called: self.meter(x)
                    place, name, target = (*fields, method), "__call__", getattr(target, "__dict__", {}).get(method)
                    function = getattr(type(target), name, None)
                elif not fields:
                    continue  # a method of the owner's own: scanned with it
                if _the_recipes(function):
                    pending.append(((*path, *place), target, (name,)))
    return found, list(owners.values()), named


def parts(label: str) -> Tuple[str, ...]:
    """``per_key[*].count`` -> ``("per_key", "[*]", "count")``."""
    return tuple(re.findall(r"\[\*\]|[^.\[\]]+", label))


def label_of(path: Sequence[str]) -> str:
    """:func:`parts` undone."""
    return "".join(part if part == ENTRY or not at else f".{part}" for at, part in enumerate(path))


def values_at(owner: Any, path: Sequence[str]) -> List[Any]:
    """The values at ``path`` (:func:`parts`) from ``owner``: fields from the objects'
    ``__dict__`` (no property runs), ``[*]`` every entry of a dict, list, tuple or
    deque; none where one is missing."""
    found = [owner]
    for part in path:
        if part == ENTRY:
            found = [entry for value in found if isinstance(value, (dict, list, tuple, collections.deque))
                     for entry in list(value.values() if isinstance(value, dict) else value)]
        else:
            found = [vars(value)[part] for value in found if part in getattr(value, "__dict__", ())]
    return found


@functools.lru_cache(maxsize=256)
def _scan(owner_class: type, methods: Tuple[str, ...]) -> Scan:
    """:func:`_scan_function` of ``methods`` and the methods of ``owner_class`` they
    call (``self.helper(...)``)."""
    reads: Set[str] = set()
    calls: Set[Tuple[Tuple[str, ...], str]] = set()
    named: Set[Tuple[types.FunctionType, str]] = set()
    pending, done = list(methods), set()
    while pending:
        name = pending.pop()
        if name in done:
            continue
        done.add(name)
        found, called, more = set(), set(), set()
        for function in _implementations(owner_class, name):
            scanned = _scan_function(function, function.__code__.co_varnames[:1], _DEPTH)
            found, called, more = found | scanned[0], called | scanned[1], more | scanned[2]
        reads |= found
        named |= more
        pending += [name for name in found if isinstance(getattr(owner_class, name, None), types.FunctionType)]
        for fields, method in called:
            if not fields and isinstance(getattr(owner_class, method, None), types.FunctionType):
                pending.append(method)  # self.helper(...)
            else:
                calls.add((fields, method))
    return frozenset(reads), frozenset(calls), frozenset(named)


def _implementations(owner_class: type, name: str) -> List[types.FunctionType]:
    """``owner_class``'s ``name``, and along its MRO each next one that the previous
    calls through ``super().name(...)``; decorated ones by their own code."""
    found = []
    for cls in owner_class.__mro__:
        function = inspect.unwrap(vars(cls).get(name))
        if not isinstance(function, types.FunctionType):
            continue
        found.append(function)
        if not _calls_super(list(dis.get_instructions(function)), name):
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
    named = set()
    for code in _with_nested(function.__code__):
        instructions = list(dis.get_instructions(code))
        named |= {(function, instruction.argval) for instruction in instructions
                  if instruction.opname in ("LOAD_GLOBAL", "STORE_GLOBAL")}
        loads = _attribute_loads(instructions, selves) if selves else {}
        reads |= _right_operands(instructions, loads) | _call_arguments(code, instructions, loads) | _indices(
            instructions, loads)
        calls |= _field_calls(instructions, loads, selves) if selves else set()
        given = _given(instructions, loads, selves) if selves else set()
        for module_function in _module_functions(instructions, function.__globals__) if depth else ():
            parameters = module_function.__code__.co_varnames[:module_function.__code__.co_argcount]
            found, called, more = _scan_function(module_function, parameters if given else (), depth - 1)
            named |= more
            for path in given:
                reads |= {label_of((*parts(path), *parts(read))) for read in found}
                calls |= {((*parts(path), *fields), method) for fields, method in called}
    return frozenset(reads), frozenset(calls), frozenset(named)


def _with_nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _with_nested(constant)


def _attribute_loads(instructions: List[dis.Instruction], selves: Tuple[str, ...]) -> Dict[int, Tuple[int, str]]:
    """Index of each instruction that pushes a field of ``self`` -> (index of the load
    it starts from, its path): ``self.n``, ``self.stats.count`` and
    ``self.per_key[k].count`` (``n``, ``stats.count``, ``per_key[*].count``), or
    through a local bound to one (``stats = self.stats``; ``stats.count``)."""
    def chains(starts: Dict[int, str]) -> Dict[int, Tuple[int, str]]:
        found = {}
        for start, path in starts.items():
            end = start
            while True:
                while end + 1 < len(instructions) and instructions[end + 1].opname == "LOAD_ATTR":
                    end += 1
                    path = f"{path}.{instructions[end].argval}" if path else instructions[end].argval
                taker, above = _take(instructions, end)
                if not path or taker is None or instructions[taker].opname != "BINARY_SUBSCR" or above != 2:
                    break
                end, path = taker, f"{path}{ENTRY}"  # the container subscripted: one of its entries
            if path:
                found[end] = (start, path)
        return found
    starts = {i: "" for i, instruction in enumerate(instructions)
              if instruction.opname in _SELF_LOADS and instruction.argval in selves}
    aliases = {instructions[end + 1].argval: path for end, (_, path) in chains(starts).items()
               if end + 1 < len(instructions) and instructions[end + 1].opname == "STORE_FAST"}
    starts.update({i: aliases[instruction.argval] for i, instruction in enumerate(instructions)
                   if instruction.opname == "LOAD_FAST" and instruction.argval in aliases})
    return chains(starts)


def _right_operands(instructions: List[dis.Instruction], loads: Dict[int, Tuple[int, str]]) -> Set[str]:
    found = set()
    for end, (start, path) in loads.items():
        if end + 1 >= len(instructions) or instructions[end + 1].opname not in _OPERATORS or start < 1:
            continue
        left = instructions[start - 1]
        if start - 1 in loads or (left.opname == "LOAD_CONST" and isinstance(left.argval, _SEEN_CONSTANTS)):
            continue  # self.x + self.n: x's probe sees n as its operand; 2 * self.n: n's reflected method
        found.add(path)
    return found


def _call_arguments(code: types.CodeType, instructions: List[dis.Instruction], loads: Dict[int, Tuple[int, str]]
                    ) -> Set[str]:
    """Fields of ``self`` passed to a call (``math.sqrt(self.total)``,
    ``torch.tensor(self.x)``: C code takes a float's value without calling the
    probe's methods), but for a running extreme the merge replays as a choice
    (``self.low = min(s, self.low)``, :mod:`ddp_eval.state._select`)."""
    found = set()
    for end, (_, path) in loads.items():
        taker = _taker(instructions, end)
        if taker is not None and instructions[taker].opname in _CALLS and not _is_choice(code, instructions, taker):
            found.add(path)
    return found


def _indices(instructions: List[dis.Instruction], loads: Dict[int, Tuple[int, str]]) -> Set[str]:
    """Fields of ``self`` used as an index or a slice's bound of a container that is not
    one (``NAMES[self.n]``, ``x[:self.n]``): a list or a string takes an ``int``'s value
    in C. A watched container's recording copy sees its index (``self.items[self.n]``)."""
    taken = {end: _take(instructions, end) for end in loads}
    of_self = {taker for taker, above in taken.values() if above == 2} | {  # a field subscripted
        end for end, (_, path) in loads.items() if path.endswith(ENTRY)}
    return {path for end, (_, path) in loads.items() if taken[end][0] is not None and (
        instructions[taken[end][0]].opname == "BUILD_SLICE" or (
            instructions[taken[end][0]].opname in ("BINARY_SUBSCR", "STORE_SUBSCR", "DELETE_SUBSCR")
            and taken[end][1] == 1 and taken[end][0] not in of_self))}


def _field_calls(instructions: List[dis.Instruction], loads: Dict[int, Tuple[int, str]], selves: Tuple[str, ...]
                 ) -> Set[Tuple[Tuple[str, ...], str]]:
    """Methods called on ``self`` and the objects it holds: ``self.meter(x)``,
    ``self.stats.update(x)`` and ``self.hparams.stats.update(x)`` give ``((),
    "meter")``, ``(("stats",), "update")`` and ``(("hparams", "stats"), "update")``."""
    return {(parts(path), instructions[end + 1].argval) for end, path in _pushed(instructions, loads, selves).items()
            if end + 1 < len(instructions) and instructions[end + 1].opname == "LOAD_METHOD"}


def _given(instructions: List[dis.Instruction], loads: Dict[int, Tuple[int, str]], selves: Tuple[str, ...]
           ) -> Set[str]:
    """Paths of ``self`` (``""`` for ``self`` itself) passed to a call."""
    def itself(end: int) -> bool:  # self itself, not the owner of a field or method loaded next
        return end + 1 < len(instructions) and instructions[end + 1].opname not in ("LOAD_ATTR", "LOAD_METHOD")
    return {path for end, path in _pushed(instructions, loads, selves).items() if (path or itself(end))
            and (taker := _taker(instructions, end)) is not None and instructions[taker].opname in _CALLS}


def _pushed(instructions: List[dis.Instruction], loads: Dict[int, Tuple[int, str]], selves: Tuple[str, ...]
            ) -> Dict[int, str]:
    """Index of each instruction that pushes ``self`` (path ``""``) or a field of it -> path."""
    return {**{i: "" for i, instruction in enumerate(instructions)
               if instruction.opname in _SELF_LOADS and instruction.argval in selves},
            **{end: path for end, (_, path) in loads.items()}}


def _module_functions(instructions: List[dis.Instruction], names: Dict[str, Any]) -> List[types.FunctionType]:
    """The functions of the recipe's modules the code loads (``update(...)``,
    ``helpers.update(...)``): each may be the one a value is given to."""
    found = []
    for at, instruction in enumerate(instructions[:-1]):
        if instruction.opname != "LOAD_GLOBAL":
            continue
        value = names.get(instruction.argval)
        if isinstance(value, types.ModuleType) and instructions[at + 1].opname in ("LOAD_ATTR", "LOAD_METHOD"):
            value = getattr(value, instructions[at + 1].argval, None)
        if _the_recipes(value):
            found.append(value)
    return found


def _the_recipes(function: Any) -> bool:
    """Whether ``function`` is Python code of the recipe's own, not of a library
    (Python's own, torch, NumPy, SpeechBrain), which holds none of its state."""
    return isinstance(function, types.FunctionType) and (function.__module__ or "").split(".")[0] not in LIBRARIES \
        and not function.__code__.co_filename.startswith(_OURS)  # nor a stand-in's


def _taker(instructions: List[dis.Instruction], at: int) -> Optional[int]:
    """The index of the instruction that takes the value ``at`` pushed off the stack
    (None past a jump or the end)."""
    return _take(instructions, at)[0]


def _take(instructions: List[dis.Instruction], at: int) -> Tuple[Optional[int], int]:
    """:func:`_taker`, and how many values from the taken one up it takes (1: the
    value is its last operand; 2: the one before, as a subscript's container)."""
    above = 1  # the value and what lies above it
    for index in range(at + 1, len(instructions)):
        instruction = instructions[index]
        if instruction.opcode in JUMPS:
            return None, above
        effect = stack_effect(instruction)
        if above + effect <= 0 or (instruction.opname in _TWO_IN and above <= 2) or (
                above == 1 and effect >= 0 and instruction.opname not in ("KW_NAMES", "NOP", "CACHE")
                and not instruction.opname.startswith(("LOAD_", "PUSH_", "BUILD_", "COPY", "MAKE_"))):
            return index, above
        above += effect
    return None, above


def _is_choice(code: types.CodeType, instructions: List[dis.Instruction], taker: int) -> bool:
    call = next((i for i in instructions[taker:] if i.opname == "CALL"), None)  # Python 3.11: after its PRECALL
    return call is not None and choice_at(code, call.offset) is not None
