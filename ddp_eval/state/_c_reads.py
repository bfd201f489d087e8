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
it) nor a constant that calls its methods. Such a read is taken as a read of the
value whole: if batches change the value, it is named with what they may have
computed from it.

Example
-------
>>> class Recipe:
...     def compute_objectives(self, predictions, batch, stage):
...         self.correct += 1
...         self.running_acc = 100.0 * self.correct / self.seen
...         return self.scale * 2.0
...     def on_stage_end(self, stage, loss, epoch):
...         self.acc = 100.0 * self.correct / self.seen  # after the merge: not a batch's read
>>> sorted(read_in_c(Recipe))
['correct', 'seen']
"""

import dis
import functools
import types
from typing import FrozenSet, Iterator, Set

BATCH_METHODS = ("evaluate_batch", "compute_forward", "compute_objectives")
_OPERATORS = ("BINARY_OP", "COMPARE_OP")
_SELF_LOADS = ("LOAD_FAST", "LOAD_DEREF")
_SEEN_CONSTANTS = (int, str, bytes)  # on the left, these try the probe's reflected method (an int's: its own)


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
            found |= _right_operands(each, this)
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


def _own_calls(code: types.CodeType, this: str) -> Set[str]:
    """Methods called on ``self`` (``self.helper(...)``)."""
    instructions = list(dis.get_instructions(code))
    return {b.argval for a, b in zip(instructions, instructions[1:])
            if a.opname in _SELF_LOADS and a.argval == this and b.opname in ("LOAD_METHOD", "LOAD_ATTR")}
