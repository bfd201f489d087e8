"""Opt-in check that schedulers and epoch counters agree across ranks.

Example
-------
>>> from speechbrain.utils.epoch_loop import EpochCounter
>>> class Holder:
...     pass
>>> h = Holder()
>>> h.epoch_counter = EpochCounter(limit=3)
>>> list(state_summaries(h, {}))
['epoch_counter']
"""

import hashlib
import importlib
import inspect
from typing import Any, Dict, List, Mapping, Sequence

import torch
from speechbrain.utils.epoch_loop import EpochCounter

from ddp_eval.errors import StateDivergenceError

# SpeechBrain imports its submodules lazily; load the real module to list its classes.
sb_schedulers = importlib.import_module("speechbrain.nnet.schedulers")

_SCHEDULER_TYPES = tuple(
    cls
    for _, cls in inspect.getmembers(sb_schedulers, inspect.isclass)
    if cls.__module__ == sb_schedulers.__name__ and not issubclass(cls, torch.nn.Module)
) + (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau, EpochCounter)


def _plain(value: Any) -> Any:
    """Reduces a state to plain, comparable Python values."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return type(value).__name__  # functions, modules: compare by type only


def _state_of(obj: Any) -> Any:
    if isinstance(obj, torch.optim.Optimizer):
        return [group["lr"] for group in obj.param_groups]
    if hasattr(obj, "state_dict") and not isinstance(obj, EpochCounter):
        return _plain(obj.state_dict())
    return _plain(vars(obj))


def state_summaries(brain: Any, recoverables: Mapping[str, Any]) -> Dict[str, List[str]]:
    """``{name: [sha1, short repr]}`` of every scheduler, epoch counter and optimizer."""
    objects: Dict[str, Any] = {}
    hparams = vars(brain.hparams) if hasattr(brain, "hparams") else {}
    for source in (hparams, recoverables, vars(brain)):
        for name, obj in source.items():
            if isinstance(obj, _SCHEDULER_TYPES + (torch.optim.Optimizer,)):
                objects.setdefault(name, obj)
    summaries = {}
    for name in sorted(objects):
        text = repr(_state_of(objects[name]))
        summaries[name] = [hashlib.sha1(text.encode()).hexdigest(), text[:300]]
    return summaries


def check_states_agree(per_rank: Sequence[Dict[str, List[str]]], stage: str) -> None:
    """Raises :class:`StateDivergenceError` naming the object and the ranks that differ."""
    reference = per_rank[0]
    for name in sorted(set().union(*per_rank)):
        ref = reference.get(name)
        diverged = [r for r, s in enumerate(per_rank) if s.get(name, [None])[0] != (ref or [None])[0]]
        if diverged:
            r = diverged[0]
            got = per_rank[r].get(name, [None, "<missing>"])[1]
            raise StateDivergenceError(
                f"ddp_eval: after on_stage_end({stage}), '{name}' differs across "
                f"ranks; expected rank 0's state {ref[1] if ref else '<missing>'}, "
                f"got on rank {r}: {got} (diverged ranks: {diverged}). Step "
                "schedulers from values that are identical on every rank (the "
                "stage_loss and merged metrics are), never from rank-local values."
            )
