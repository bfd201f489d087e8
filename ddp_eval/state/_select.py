"""Telling ``self.best = max(self.best, s)`` from a comparison that may steer code.

A probe's comparison made by the builtin ``max`` or ``min`` of two values whose
result goes straight back to where the first of them was read (``self.best =
max(self.best, s)``, ``self.low[k] = min(s, self.low[k])``) steers nothing but
which of the two is kept. The merge can then replay the choice itself on one
process's value, instead of naming what the comparison might have steered. This
module recognises that statement from the calling frame's bytecode: a two-argument
call of the builtin, whose result the next instructions store into the place the
arguments load. Anything else (a comparison in an ``if``, a third argument, a
result kept in a local) is not a choice, and is merged as a comparison.

Example
-------
>>> import sys, types
>>> class Seen(float):
...     def __lt__(self, other):
...         Seen.kind = stored_choice(sys._getframe(1))
...         return float.__lt__(self, other)
>>> holder = types.SimpleNamespace(best=Seen(0.5))
>>> holder.best = max(holder.best, 0.75)
>>> Seen.kind
'max'
>>> keep = max(Seen(0.5), 0.75)
>>> Seen.kind is None
True
"""

import builtins
import dis
import functools
from types import CodeType, FrameType
from typing import List, Optional, Sequence, Tuple

CHOICES = ("max", "min")
JUMPS = frozenset(dis.hasjrel + dis.hasjabs)
_LOADS = ("LOAD_GLOBAL", "LOAD_NAME")


def stored_choice(frame: FrameType) -> Optional[str]:
    """``"max"`` or ``"min"`` if ``frame`` is calling that builtin with two arguments
    and stores its result where one of them was read; else None."""
    found = choice_at(frame.f_code, frame.f_lasti)
    if found is None:
        return None
    kind, load = found
    if load == "LOAD_NAME" and frame.f_locals is not frame.f_globals:
        return None  # a name looked up in locals first (a class body, exec): not told here
    return kind if frame.f_globals.get(kind, getattr(builtins, kind)) is getattr(builtins, kind) else None


@functools.lru_cache(maxsize=4096)
def instructions_of(code: CodeType) -> Sequence[dis.Instruction]:
    """``code``'s instructions, decoded once; a ``KW_NAMES``'s ``argval`` is the
    keywords' names (Python 3.11's ``dis`` leaves it unknown)."""
    return tuple(instruction._replace(argval=code.co_consts[instruction.arg])
                 if instruction.opname == "KW_NAMES" else instruction for instruction in dis.get_instructions(code))


@functools.lru_cache(maxsize=4096)
def choice_at(code: CodeType, offset: int) -> Optional[Tuple[str, str]]:
    instructions = instructions_of(code)
    at = next((i for i, instruction in enumerate(instructions) if instruction.offset == offset), None)
    if at is None or instructions[at].opname != "CALL" or instructions[at].arg != 2:
        return None
    callee = _callee(instructions, at)
    target = None if callee is None else _store(instructions, at)
    if target is None:
        return None
    arguments = instructions[callee + 1: at]
    if arguments and arguments[-1].opname == "PRECALL":  # Python 3.11's half of the call
        arguments = arguments[:-1]
    if target not in _split(arguments):
        return None
    return instructions[callee].argval, instructions[callee].opname


def _callee(instructions: List[dis.Instruction], at: int) -> Optional[int]:
    """The index of the ``max`` (or ``min``) load the call at ``at`` calls, with no
    jump between: the nearest such load after which the stack stays above its level
    until the call, which leaves one value."""
    for start in range(at - 1, -1, -1):
        instruction = instructions[start]
        if instruction.opname not in _LOADS or instruction.argval not in CHOICES:
            continue
        depth = 1 if start and instructions[start - 1].opname == "PUSH_NULL" else 0  # LOAD_NAME's NULL
        for inner in instructions[start: at]:
            if inner.opcode in JUMPS:
                return None
            depth += stack_effect(inner)
            if depth <= 0:  # this load's callable was consumed before the call
                break
        else:
            if depth + stack_effect(instructions[at]) == 1:
                return start
    return None


def _split(arguments: List[dis.Instruction]) -> List[List[Tuple[str, object]]]:
    """The two arguments' instructions, as ``(opname, argval)`` lists: the split
    after which the stack holds one value and never goes back below two."""
    depths, depth = [], 0
    for instruction in arguments:
        depth += stack_effect(instruction)
        depths.append(depth)
    for split, reached in enumerate(depths[:-1]):
        if reached == 1 and min(depths[split + 1:]) >= 2:
            parts = arguments[: split + 1], arguments[split + 1:]
            return [[(i.opname, i.argval) for i in part] for part in parts]
    return []


def stack_effect(instruction: dis.Instruction) -> int:
    if instruction.opcode < dis.HAVE_ARGUMENT:
        return dis.stack_effect(instruction.opcode)
    return dis.stack_effect(instruction.opcode, instruction.arg, jump=False)


def _store(instructions: List[dis.Instruction], at: int) -> Optional[List[Tuple[str, object]]]:
    """What the call's result is stored into, as the instructions that load that
    place (``self`` then ``.best``): the loads after the call up to the ``STORE_ATTR``
    or ``STORE_SUBSCR`` that takes the result, with no call or jump between."""
    depth, loads = 1, []
    for instruction in instructions[at + 1:]:
        if instruction.opcode in JUMPS or instruction.opname in ("CALL", "PRECALL", "CALL_FUNCTION_EX"):
            return None
        effect = stack_effect(instruction)
        if depth + effect <= 0:
            if instruction.opname == "STORE_ATTR" and depth == 2:
                return loads + [("LOAD_ATTR", instruction.argval)]
            if instruction.opname == "STORE_SUBSCR" and depth == 3:
                return loads + [("BINARY_SUBSCR", None)]
            return None
        depth += effect
        loads.append((instruction.opname, instruction.argval))
    return None
