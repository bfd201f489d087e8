"""Finding the Brain's numbers that its batch code reads where no probe can see.

A probe is a subclass of ``int`` or ``float`` (:mod:`ddp_eval.state._numbers`):
``self.n * 2.0``, ``k + self.n`` and ``self.x < 0.5`` call its methods, but a
float on the left of a watched ``int`` (``100.0 * self.correct``, ``2.5 <
self.total``), or a tensor or array on the left of either (``loss * self.n``),
reads it in C without calling any. This module scans the bytecode of the methods
a batch runs (``compute_forward``, ``compute_objectives``, ``evaluate_batch`` and
the Brain's own methods they call, with their nested functions) for an attribute
of ``self`` read as the right operand of an arithmetic operator or a comparison,
whose left operand is neither another attribute of ``self`` (whose probe then sees
it) nor a constant that calls its methods, and for one passed to a call
(``math.sqrt(self.total)``, ``torch.tensor(self.x)``: C code takes the value of a
float or int subclass directly), but for the builtin ``max`` or ``min`` the merge
replays as a choice. Such a read is taken as a read of the
value whole: if batches change the value, it is named with what they may have
computed from it.

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

import dis
import functools
import types
from typing import FrozenSet, Iterator, List, Optional, Set

from ddp_eval.state._select import JUMPS, choice_at, stack_effect

BATCH_METHODS = ("evaluate_batch", "compute_forward", "compute_objectives")
_OPERATORS = ("BINARY_OP", "COMPARE_OP")
_SELF_LOADS = ("LOAD_FAST", "LOAD_DEREF")
_SEEN_CONSTANTS = (int, str, bytes)  # on the left, these try the probe's reflected method (an int's: its own)
_CALLS = ("PRECALL", "CALL", "CALL_FUNCTION_EX")
_TWO_IN = ("BINARY_OP", "COMPARE_OP", "BINARY_SUBSCR", "CONTAINS_OP", "IS_OP")  # take two, give one


@functools.lru_cache(maxsize=256)
def read_in_c(brain_class: type) -> FrozenSet[str]:
    """Names of ``self``'s attributes the batch methods of ``brain_class`` read as the
    right operand of an operator whose left operand may read them in C."""
    found: Set[str] = set()
    done: Set[types.CodeType] = set()
    pending = [getattr(brain_class, name) for name in BATCH_METHODS if hasattr(brain_class, name)]
    while pending:
        code = getattr(pending.pop(), "__code__", None)
        if code is None or code in done or not code.co_varnames:
            continue
        this = code.co_varnames[0]
        for each in _with_nested(code):
            done.add(each)
            found |= _right_operands(each, this) | _call_arguments(each, this)
            pending += [getattr(brain_class, name) for name in _own_calls(each, this)
                        if isinstance(getattr(brain_class, name, None), types.FunctionType)]
    return frozenset(found)


def _with_nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _with_nested(constant)


def _right_operands(code: types.CodeType, this: str) -> Set[str]:
    instructions = list(dis.get_instructions(code))
    found = set()
    for i in range(3, len(instructions)):
        operator, name, owner, left = instructions[i], instructions[i - 1], instructions[i - 2], instructions[i - 3]
        if operator.opname not in _OPERATORS or name.opname != "LOAD_ATTR" or owner.opname not in _SELF_LOADS \
                or owner.argval != this:
            continue
        if left.opname == "LOAD_CONST" and isinstance(left.argval, _SEEN_CONSTANTS):
            continue
        if left.opname == "LOAD_ATTR" and instructions[i - 4].opname in _SELF_LOADS \
                and instructions[i - 4].argval == this:
            continue  # self.x + self.n: x's probe sees n as its operand
        found.add(name.argval)
    return found


def _call_arguments(code: types.CodeType, this: str) -> Set[str]:
    """Attributes of ``self`` passed to a call (``math.sqrt(self.total)``,
    ``torch.tensor(self.x)``: C code takes a float's value without calling the
    probe's methods), but for a running extreme the merge replays as a choice
    (``self.low = min(s, self.low)``, :mod:`ddp_eval.state._select`)."""
    instructions = list(dis.get_instructions(code))
    found = set()
    for i in range(1, len(instructions)):
        name, owner = instructions[i], instructions[i - 1]
        if name.opname != "LOAD_ATTR" or owner.opname not in _SELF_LOADS or owner.argval != this:
            continue
        taker = _taker(instructions, i)
        if taker is not None and instructions[taker].opname in _CALLS and not _is_choice(code, instructions, taker):
            found.add(name.argval)
    return found


def _taker(instructions: List[dis.Instruction], at: int) -> Optional[int]:
    """The index of the instruction that takes the value ``at`` pushed off the stack
    (None past a jump or the end)."""
    above = 1  # the value and what lies above it
    for index in range(at + 1, len(instructions)):
        instruction = instructions[index]
        if instruction.opcode in JUMPS:
            return None
        effect = stack_effect(instruction)
        if above + effect <= 0 or (instruction.opname in _TWO_IN and above <= 2) or (
                above == 1 and effect >= 0 and instruction.opname not in ("KW_NAMES", "NOP", "CACHE")
                and not instruction.opname.startswith(("LOAD_", "PUSH_", "BUILD_", "COPY", "MAKE_"))):
            return index
        above += effect
    return None


def _is_choice(code: types.CodeType, instructions: List[dis.Instruction], taker: int) -> bool:
    call = next((i for i in instructions[taker:] if i.opname == "CALL"), None)  # Python 3.11: after its PRECALL
    return call is not None and choice_at(code, call.offset) is not None


def _own_calls(code: types.CodeType, this: str) -> Set[str]:
    """Methods called on ``self`` (``self.helper(...)``)."""
    instructions = list(dis.get_instructions(code))
    return {b.argval for a, b in zip(instructions, instructions[1:])
            if a.opname in _SELF_LOADS and a.argval == this and b.opname in ("LOAD_METHOD", "LOAD_ATTR")}
