"""Attributes whose merge the recipe declares (``ddp_eval: {merge: {path: reduction}}``).

Inference cannot know how every value merges: ``self.best = max(self.best,
score)`` computes the new value from the old one by a comparison, which the
engine names rather than guesses. Declared, in the spirit of torchmetrics'
``add_state(dist_reduce_fx=...)``, it merges from every rank's stage-end value
and the stage-start value, with one of :data:`REDUCTIONS`:

========  ==================================================  ====================
reduction  merged value                                        checked on each rank
========  ==================================================  ====================
max        the largest (elementwise; of bools: any True)       never below the start
min        the smallest                                        never above the start
sum        start + every rank's change                         a number, tensor or array
union      start with every rank's elements                    a set holding the start
========  ==================================================  ====================

A function of the recipe's own (``!name:my_recipe.merge_best`` in the YAML, as
torchmetrics' ``dist_reduce_fx``) gets every rank's stage-end value, in rank order
(a rank without a batch sends its stage-start value), and returns the merged one;
it is checked on each rank to give a rank's value from that value alone
(``f([x]) == x``), and must be a module-level function (it travels by reference).

A rank whose value contradicts its declaration (a ``max`` that fell) is named
at stage end, never merged.

Example
-------
>>> import types
>>> from ddp_eval.state._values import Budget
>>> brain = types.SimpleNamespace(best=0.5)
>>> slot = DeclaredSlot("best", brain, "best", Budget(1), "max")
>>> brain.best = 0.75
>>> slot.finish(1)
>>> slot.change([0.0, float("inf")]).data
('max', 0.5, 0.75)
"""

import copy
from typing import Any, Callable, Optional, Sequence

import torch

from ddp_eval.state._values import ABSENT, Change, Kind, get_value, is_array, is_number, numpy, set_value

REDUCTIONS = ("max", "min", "sum", "union")


def _elementwise(name: str, a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return getattr(torch, {"max": "maximum", "min": "minimum"}[name])(a, b.to(a.device))
    if is_array(a):
        return getattr(numpy, {"max": "maximum", "min": "minimum"}[name])(a, b)
    return (max if name == "max" else min)(a, b)


def _all(value: Any) -> bool:
    return bool(value.all()) if isinstance(value, torch.Tensor) or is_array(value) else bool(value)


def _reducible(reduction: str, value: Any) -> bool:
    if reduction == "union":
        return isinstance(value, (set, frozenset))
    if isinstance(value, bool):  # max: any rank's True (flag = flag or x); min: every rank's
        return reduction in ("max", "min")
    return is_number(value) or isinstance(value, torch.Tensor) or is_array(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or is_array(a):
        return type(a) is type(b) and a.shape == b.shape and _all(a == b)
    return type(a) is type(b) and a == b


def contradiction(reduction: Any, start: Any, end: Any) -> Optional[str]:
    """Why ``end`` cannot come from ``start`` by batches merged with ``reduction`` (None: it can).
    A function of the recipe's own must give a rank's value from that value alone."""
    if callable(reduction):
        try:
            alone = reduction([end])
        except Exception as exc:  # named, with what it raised
            return f"the function raised {type(exc).__name__}: {exc} on this rank's value alone ([{end!r}])"
        if not _same(alone, end):
            return f"the function gives {alone!r} from this rank's value {end!r} alone, which a merge must keep"
        return None
    if not _reducible(reduction, end):
        return f"it holds a {type(end).__name__}, which '{reduction}' does not merge"
    if start is ABSENT or start is None:
        return None
    if type(start) is not type(end) and not (is_number(start) and is_number(end)):
        return f"it was a {type(start).__name__} at stage start and is a {type(end).__name__} now"
    if reduction == "max" and not _all(end >= start):
        return "it fell below its stage-start value, which a merge by 'max' cannot give"
    if reduction == "min" and not _all(end <= start):
        return "it rose above its stage-start value, which a merge by 'min' cannot give"
    if reduction == "union" and not end >= start:
        return "elements it held at stage start were removed, which a merge by 'union' cannot give"
    return None


def reduce_values(per_contribution: Sequence[Any]) -> Any:
    """The merged value from every contribution's ``(reduction, base, end)``."""
    reduction, start, _ = per_contribution[0]
    ends = [end for _, _, end in per_contribution]
    if callable(reduction):  # the recipe's own, as torchmetrics' dist_reduce_fx: every rank's value, in rank order
        return reduction(ends)
    if reduction == "union":
        return (set() if start in (None, ABSENT) else set(start)).union(*ends)
    if reduction == "sum":
        total = None if start in (None, ABSENT) else start
        for _, base, end in per_contribution:
            change = end if base in (None, ABSENT) else end - base
            total = change if total is None else total + change
        return total
    merged = ends[0] if start in (None, ABSENT) else start
    for end in ends:
        merged = _elementwise(reduction, merged, end)
    return merged


class DeclaredSlot:
    """One declared attribute on this rank during one stage: its stage-start value
    (a copy), checked and sent whole at stage end (``REDUCE``)."""

    why: Optional[str] = None
    assigned_at = None
    changed_batches = 0

    def __init__(self, label: str, owner: Any, name: Any, budget: Any, reduction: str) -> None:
        self.label, self.owner, self.name, self.reduction = label, owner, name, reduction
        self.start = self.base = copy.deepcopy(get_value(owner, name))
        self.obj = get_value(owner, name)
        self.watch = self  # no entries to follow

    def busy(self) -> bool:
        return False

    def before_batch(self) -> None:
        pass

    def observe(self, batch: int) -> None:
        self.obj = get_value(self.owner, self.name)

    def finish(self, batch: int) -> None:
        self.obj = get_value(self.owner, self.name)
        if self.obj is ABSENT:
            return
        why = contradiction(self.reduction, self.start, self.obj)
        if why is not None:
            self.why = f"declared 'merge: {getattr(self.reduction, '__name__', self.reduction)}', but {why}"

    def release(self) -> None:
        pass

    def restore(self) -> None:
        pass

    def kind(self) -> Optional[Kind]:
        return Kind.REDUCE if self.why is None and get_value(self.owner, self.name) is not ABSENT else None

    def change(self, positions: Sequence[float], from_batch: int = 0, piece: bool = False) -> Optional[Change]:
        """``(reduction, base, value now)``: base is the stage start, or for a journal
        piece the value at the previous piece (so that ``sum`` counts each change once)."""
        if self.kind() is None:
            return None
        now = copy.deepcopy(get_value(self.owner, self.name))
        base = self.base if piece else self.start
        if piece:
            self.base = now
        return Change(Kind.REDUCE, (self.reduction, base, now))

    def apply(self, kind: Kind, data: Any, last_value: Callable[[], Any]) -> None:
        set_value(self.owner, self.name, data)
