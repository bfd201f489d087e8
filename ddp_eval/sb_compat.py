"""What ddp_eval reads or repeats of SpeechBrain's internals, in one place.

Each piece names the SpeechBrain releases it tracks: 1.0.3 to 1.1.2, the
supported range (docs/versions.md). A SpeechBrain release that changes one of
them is handled here and nowhere else.

Example
-------
>>> from speechbrain.utils.distributed import main_process_only
>>> def save(obj, path):
...     return path
>>> unwrapped(main_process_only(save)) is save
True
"""

import functools
import pathlib
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

from speechbrain.utils import checkpoints as sb_ckpt
from speechbrain.utils import distributed as sb_dist

# SpeechBrain's default savers of modules, optimizers, schedulers and scalers:
# torch.save(obj.state_dict()); torch_save_once_per_node exists from 1.1 on.
STATE_DICT_SAVERS = tuple(h for h in (sb_ckpt.torch_save, getattr(sb_ckpt, "torch_save_once_per_node", None)) if h)

# The code object of the wrapper that speechbrain.utils.distributed.main_process_only
# returns (1.0.3 to 1.1.2: functools.wraps, so the original is __wrapped__).
_MAIN_ONLY_CODE = sb_dist.main_process_only(lambda: None).__code__


# Metric fields that hold a fixed list of lists, each growing at every append:
# BLEUStats.targets, one list of references per reference set (speechbrain.utils.bleu
# in 1.0.3, speechbrain.integrations.nlp.bleu in 1.1).
NESTED_LIST_FIELDS = {"BLEUStats": ("targets",)}


def nested_list_fields(metric: Any) -> Tuple[str, ...]:
    """The fields of ``metric`` (by its class or a SpeechBrain base class) in
    :data:`NESTED_LIST_FIELDS`."""
    return _nested_list_fields(type(metric))


@functools.lru_cache(maxsize=None)
def _nested_list_fields(metric_class: type) -> Tuple[str, ...]:
    owner = nested_list_owner(metric_class)
    return () if owner is None else NESTED_LIST_FIELDS[owner.__name__]


def nested_list_owner(metric_class: type) -> Optional[type]:
    """The SpeechBrain class in ``metric_class``'s bases that declares nested list
    fields (``BLEUStats``), or None."""
    for cls in metric_class.__mro__:
        if cls.__module__.startswith("speechbrain.") and cls.__name__ in NESTED_LIST_FIELDS:
            return cls
    return None


# SpeechBrain's decoders (beam searchers, scorers) keep per-call scratch state on
# themselves (batch_size, n_bh, beam_offset, max_decode_steps, kv_cache), written by
# every call before it is read (1.0.3 to 1.1.2): not state a stage accumulates.
SCRATCH_STATE_PACKAGES = ("speechbrain.decoders.",)


def holds_scratch_state(obj: Any) -> bool:
    """Whether ``obj`` is (a subclass of) a SpeechBrain decoder."""
    return any(getattr(cls, "__module__", "").startswith(SCRATCH_STATE_PACKAGES) for cls in type(obj).__mro__)


def inside_single_rank_section() -> bool:
    """Whether SpeechBrain runs this code on one rank only (``run_on_main``,
    ``main_process_only``): a collective there would wait for ranks that never
    come. ``MAIN_PROC_ONLY`` in 1.0.3 to 1.1.2, ``NODE_ONCE_ONLY`` from 1.1 on."""
    return getattr(sb_dist, "MAIN_PROC_ONLY", 0) >= 1 or getattr(sb_dist, "NODE_ONCE_ONLY", 0) >= 1


def local_collectives():
    """A context in which SpeechBrain's collectives (``ddp_all_reduce``,
    ``ddp_barrier``, ``ddp_broadcast``) return at once, as inside ``run_on_main``
    (``MainProcessContext``, 1.0.3 to 1.1.2): sharded ranks evaluate different
    numbers of batches, so a collective in per-batch code (InputNormalization's
    statistics in 1.1) would wait for ranks that never come."""
    return sb_dist.MainProcessContext()


def save_hook(checkpointer: Any, name: str, obj: Any) -> Callable:
    """The hook SpeechBrain's ``Checkpointer._call_save_hooks`` would call for
    recoverable ``name`` (custom hook first, then the default by MRO; 1.0.3 to
    1.1.2), with SpeechBrain's own error when there is none."""
    hook = checkpointer.custom_save_hooks.get(name) or sb_ckpt.get_default_hook(obj, sb_ckpt.DEFAULT_SAVE_HOOKS)
    if hook is None:
        raise RuntimeError(
            f"Don't know how to save {type(obj)}. Register default hook or add custom hook for this object."
        )
    return hook


def unwrapped(hook: Callable) -> Callable:
    """``hook`` without SpeechBrain's ``main_process_only`` wrapper: the writer
    of a node-local checkpoint is not global rank 0, and runs every hook itself."""
    return hook.__wrapped__ if getattr(hook, "__code__", None) is _MAIN_ONLY_CODE else hook


def call_save_hooks(checkpointer: Any, directory: pathlib.Path, names: Optional[Sequence[str]] = None) -> None:
    """SpeechBrain's ``Checkpointer._call_save_hooks`` loop (1.0.3 to 1.1.2) for the
    recoverables in ``names`` (default: all), run by the writer itself: without
    the ``main_process_only`` wrappers, and with SpeechBrain collectives nested in
    a hook disabled (``MainProcessContext``)."""
    with sb_dist.MainProcessContext():
        for name, obj in checkpointer.recoverables.items():
            if names is None or name in names:
                unwrapped(save_hook(checkpointer, name, obj))(obj, directory / f"{name}{sb_ckpt.PARAMFILE_EXT}")


def checkpoints_to_delete(find: Callable[..., List[Any]], num_to_keep: int, min_keys: Optional[Sequence[str]],
                          max_keys: Optional[Sequence[str]], importance_keys: Sequence[Callable],
                          ckpt_predicate: Optional[Callable]) -> List[Any]:
    """The selection of SpeechBrain's ``Checkpointer.delete_checkpoints`` (1.0.3
    to 1.1.2): every checkpoint some key ranks, minus the ``num_to_keep`` best of
    each key; ``find(**kwargs)`` is ``find_checkpoints`` without synchronisation.
    Sorted by name, so every run deletes in the same order."""
    keys = [{"min_key": k} for k in min_keys or []]
    keys += [{"max_key": k} for k in max_keys or []]
    keys += [{"importance_key": k} for k in importance_keys]
    candidates: Set[Any] = set()
    protected: Set[Any] = set()
    for kwargs in keys:
        found = find(ckpt_predicate=ckpt_predicate, **kwargs)
        candidates.update(found)
        protected.update(found[:num_to_keep])
    return sorted(candidates - protected, key=lambda ckpt: ckpt.path.name)


def failed_recoverable(traceback) -> Tuple[Optional[str], Optional[pathlib.Path]]:
    """``(recoverable name, file)`` that SpeechBrain's ``_call_load_hooks`` loop
    (locals ``name`` and ``loadpath``, 1.0.3 to 1.1.2) was loading when it raised."""
    found = (None, None)
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code.co_name == "_call_load_hooks" and "loadpath" in frame.f_locals:
            found = (frame.f_locals.get("name"), frame.f_locals["loadpath"])
        traceback = traceback.tb_next
    return found
