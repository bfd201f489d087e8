"""The vocabulary of attribute tracking: how a change is merged, what one
rank's change carries, reading and binding attributes, and the memory budget
for copies of tensors and arrays.

Example
-------
>>> Kind.APPEND == "append", Change(Kind.LAST, None, last=3.0, value=ELSEWHERE).last
(True, 3.0)
>>> get_value({"a": 1}, "b") is ABSENT
True
"""

import enum
from typing import Any, Mapping, NamedTuple, Optional

import torch

try:
    import numpy
except ImportError:  # pragma: no cover - torch installs numpy
    numpy = None

class _Sentinel:
    """A named marker that pickles as itself (by reference to this module)."""

    def __init__(self, name: str, text: str) -> None:
        self.name, self.text = name, text

    def __repr__(self) -> str:
        return f"<{self.text}>"

    def __reduce__(self) -> str:
        return self.name


def is_training_machinery(value: Any) -> bool:
    """Optimizers, modules, schedulers (and SpeechBrain's ``optimizers_dict`` of
    optimizers): what training owns, not what a stage accumulates.

    Example
    -------
    >>> model = torch.nn.Linear(1, 1)
    >>> is_training_machinery({"opt_class": torch.optim.SGD(model.parameters(), lr=1.0)}), is_training_machinery([])
    (True, False)
    """
    if isinstance(value, dict) and value:
        return all(is_training_machinery(v) for v in value.values())
    if isinstance(value, (torch.optim.Optimizer, torch.nn.Module)):
        return True
    return type(value).__module__.startswith(("torch.optim", "speechbrain.nnet.schedulers", "torch.cuda.amp",
                                              "torch.amp"))


_MIXIN_NAMES = frozenset({"on_stage_start", "on_stage_end", "update_average", "ddp_eval_config"})  # the mixin's


def recipe_names(brain: Any) -> set:
    """The names of the Brain attributes the recipe keeps: not what ``sb.Brain`` set
    up (``brain._ddp_brain_attributes``), not the mixin's own (``_ddp...``, its stage
    wrappers and config), not training machinery.

    Example
    -------
    >>> import types
    >>> brain = types.SimpleNamespace(_ddp_brain_attributes=frozenset({"step"}), step=3, ids=[],
    ...                               optimizer=torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0))
    >>> recipe_names(brain)
    {'ids'}
    """
    return {name for name in set(vars(brain)) - brain._ddp_brain_attributes - _MIXIN_NAMES
            if not name.startswith("_ddp") and not is_training_machinery(getattr(brain, name))}


ABSENT = _Sentinel("ABSENT", "absent")  # an attribute or entry that does not exist
ELSEWHERE = _Sentinel("ELSEWHERE", "sent by the rank whose value won")
SMALL_DICT = 64  # entries; a larger dict is watched by its new keys only
MAX_DEPTH = 2  # dict entries are watched two levels deep (self.stats[stage]["loss"])


class Kind(str, enum.Enum):
    """How a change is merged (the table of :mod:`ddp_eval.state._attributes`)."""

    APPEND = "append"
    KEYS = "keys"
    FOLD = "fold"
    SUM = "sum"
    ACCUMULATE = "accumulate"
    LAST = "last"
    ITEMS = "items"
    UNION = "union"
    REDUCE = "reduce"


class Op(str, enum.Enum):
    """What one event of a value's record did (``FOLD`` events: ``(position, op, operand)``).
    A ``str`` enum: an event read from an older journal (the plain string) compares equal."""

    ADD = "+"
    SUBTRACT = "-"
    CONCAT = "&"  # s += x, x = torch.cat([x, y]), ids = ids + [utt]
    SET = "="
    CREATED = "~"  # bound where there was none: an addend if anything adds to it, else set
    OVER_NONE = "!"  # bound over the None it held: the same
    INITIAL = "^"  # a factory's or a handed-out default's value, taken while there is none
    UNPROBED = "?"  # changed while it had no probe: (before, after), told by its other changes
    CONCAT_OR_SET = "?&"  # bound once over an empty list or tuple: extended, or set anew
    COMPARED = "<"  # a batch compared the value: (its value at batch start, the comparisons, the stage's start)
    CHOICE = "<?"  # x = max(x, v) or min: (comparison, v, the answer on which v is kept), replayed as such

    def __repr__(self) -> str:  # as the code it stands for: ('+', 2) in a record
        return repr(self.value)

    __str__ = str.__str__


class Change(NamedTuple):
    """What one rank's batches did to one attribute during a stage.

    ``data`` depends on ``kind`` (None for ``LAST``); ``last`` is the global
    position of the batch that last bound a new object to it, if this change
    can be read as such (a ``LAST`` change, or an object created once and
    changed no more); ``value`` is that object, or :data:`ELSEWHERE` while it
    stays on its rank (sent only if it is the one a merge takes).
    """

    kind: Kind
    data: Any
    last: Optional[float] = None
    value: Any = None


def top_label(label: str) -> str:
    """The attribute a label belongs to (``d['a']`` and ``stats.count``: ``d``, ``stats``)."""
    return label.split("[")[0].split(".")[0]


def is_number(value: Any) -> bool:
    """int or float, not bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def get_value(owner: Any, name: Any) -> Any:
    """``owner.name`` (or ``owner[name]`` for a mapping); ``ABSENT`` if missing.
    A dict's entry is read without its ``defaultdict`` factory."""
    if isinstance(owner, dict):
        return dict.get(owner, name, ABSENT)
    if isinstance(owner, list):
        return owner[name] if name < len(owner) else ABSENT
    own = getattr(owner, "__dict__", None)
    if own is not None and name in own:
        return own[name]
    if isinstance(owner, Mapping):
        return owner.get(name, ABSENT)
    return getattr(owner, name, ABSENT)


def is_mutable(value: Any) -> bool:
    """Whether a batch may change ``value`` in place in a way ddp_eval watches."""
    return isinstance(value, (list, dict, bytearray, torch.Tensor)) or is_array(value)


def set_value(owner: Any, name: Any, value: Any) -> None:
    """Binds ``owner.name`` (or ``owner[name]``) to ``value``; nothing for an entry a
    list no longer has."""
    if isinstance(owner, list) and name >= len(owner):
        return
    if isinstance(owner, (dict, list)):
        owner[name] = value
    else:
        setattr(owner, name, value)


def cpu_copy(value: Any) -> Any:
    """A copy of a tensor (on the CPU) or of a NumPy array."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value.copy()


def nbytes(value: Any) -> int:
    """Bytes of a tensor's or array's elements."""
    return value.nelement() * value.element_size() if isinstance(value, torch.Tensor) else value.nbytes


def is_array(value: Any) -> bool:
    """Whether ``value`` is a NumPy array."""
    return numpy is not None and isinstance(value, numpy.ndarray)


def exact_dtype(value: Any) -> bool:
    """Whether increments of this tensor or array add up exactly (integers, bools)."""
    if isinstance(value, torch.Tensor):
        return not (value.is_floating_point() or value.is_complex())
    return value.dtype.kind in "biu"


class Budget:
    """Memory for copies of tensors and arrays on this rank (``attribute_memory_mb``)."""

    def __init__(self, megabytes: float) -> None:
        self.total, self.used = megabytes * 2**20, 0

    def reserve(self, nbytes: int) -> bool:
        """Takes ``nbytes``; False (nothing taken) if they do not fit."""
        if self.used + nbytes > self.total:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.used -= nbytes


def is_flat_list(value: Any) -> bool:
    """A list (a recording copy too) that is not a list of lists: a metric object's
    ``ids`` or ``scores``, not BLEUStats' ``targets``."""
    return isinstance(value, list) and not (value and all(isinstance(x, list) for x in value))


def is_metric_object(value: Any) -> bool:
    """A SpeechBrain metric object (told by class name: no import of SpeechBrain here)."""
    return any(cls.__name__ in ("MetricStats", "MultiMetricStats", "AccuracyStats") for cls in type(value).__mro__)


# a LAST change of a value bound over the None it held at stage start by one batch and unchanged since: each
# batch set it, or the first made it and added to it (`if self.x is None: self.x = []`) cannot be told apart
OVER_NONE_ONCE = "bound once over None"

_BUILTINS = {kind.__name__: kind for kind in (int, float, str, bytes, list, tuple, dict)}


def as_builtin(kind: str, value: Any) -> Any:
    """The builtin value a stand-in stands for: a probe or a recording copy pickles
    as ``as_builtin("int", 3)``, so pickle, ``copy.deepcopy`` and ``torch.save``
    give the plain type back (``torch.load(weights_only=True)`` accepts it:
    :mod:`ddp_eval.state._standins`).

    Example
    -------
    >>> as_builtin("list", (1, 2))
    [1, 2]
    """
    return _BUILTINS[kind](value)
