"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank
writes its own shard of a sharded module or optimizer, and any number of ranks
(one process included) reads them back, resharded.

One recoverable is one DCP folder, ``<name>.dcp`` inside the checkpoint's
directory. :class:`ddp_eval.Checkpointer` decides where and when (inside its
atomic commit: the shards are written into the hidden work directory, the
manifest of every file and ``CKPT.yaml`` come last); this module only moves
state between objects and folders:

* :func:`save` (collective with a process group): the state of a module
  (``get_model_state_dict``, DTensor shards under FSDP) or of an optimizer
  (``get_optimizer_state_dict``, keyed by parameter names, which do not depend
  on the world size);
* :func:`load` (collective with a process group): into a sharded module or
  optimizer at any world size, or into plain ones (DDP, one process); a plain
  ``.ckpt`` file SpeechBrain or DDP wrote loads into a sharded module too;
* :func:`load_full_state_dict` (local): one process reads a DCP folder as one
  full state dict, e.g. as ``parameter_loader`` of SpeechBrain's
  ``average_checkpoints``.

Example
-------
>>> import torch
>>> folder = getfixture("tmp_path") / "model.dcp"
>>> model = torch.nn.Linear(2, 1)
>>> save(model, folder, {"model": model})
>>> copy = torch.nn.Linear(2, 1)
>>> load(copy, folder, {"model": copy})
>>> torch.equal(copy.weight, model.weight)
True
>>> sorted(load_full_state_dict(folder))
['bias', 'weight']
"""

import inspect
import pathlib
from typing import Any, Dict, List, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

SUFFIX = ".dcp"


def _alone() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _no_dist() -> dict:
    """``no_dist`` for DCP's save and load without a process group (torch >= 2.5 takes
    it; 2.4 decides so itself)."""
    return {"no_dist": _alone()} if _TAKES_NO_DIST else {}


_TAKES_NO_DIST = "no_dist" in inspect.signature(dcp.save).parameters


def _owner(modules: Mapping[str, torch.nn.Module]) -> torch.nn.Module:
    """The modules an optimizer's parameters belong to, under their recoverable names
    (the optimizer's state is keyed by ``<name>.<parameter>``)."""
    return torch.nn.ModuleDict(dict(modules))


def state_of(obj: Any, modules: Mapping[str, torch.nn.Module]) -> Dict[str, Any]:
    """The state DCP writes of ``obj``: sharded where ``obj`` is, full elsewhere."""
    if isinstance(obj, torch.optim.Optimizer):
        return get_optimizer_state_dict(_owner(modules), obj)
    return get_model_state_dict(obj)


def save(obj: Any, folder: pathlib.Path, modules: Mapping[str, torch.nn.Module]) -> None:
    """Writes ``obj``'s state into ``folder`` (every rank its shard; collective)."""
    save_state(state_of(obj, modules), folder)


def save_state(state: Dict[str, Any], folder: pathlib.Path, group: Any = None) -> None:
    """Writes a state (:func:`state_of`, or its :func:`staged` copy) into ``folder``,
    every rank its shard, collectively over ``group`` (default: the default group)."""
    dcp.save(state, checkpoint_id=str(folder), process_group=group, **_no_dist())


def staged(state: Any) -> Any:
    """A copy of a state in CPU memory that training may not change: each rank's
    shard of a ``DTensor`` (a ``DTensor`` again, on its mesh), every other tensor
    whole; containers copied, other values kept."""
    if isinstance(state, DTensor):
        local = state.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, state.device_mesh, state.placements, run_check=False,
                                  shape=state.shape, stride=state.stride())
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: staged(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(staged(v) for v in state)
    return state


def checkpoint_group() -> Any:
    """A gloo group of every rank for saves written in the background (their
    collectives must not interleave with training's on the default group);
    made once per default group, on every rank at the same point (collective).
    None without a process group."""
    if _alone():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _groups.get("of") is not default:
        _groups.update(of=default, group=dist.new_group(backend="gloo"))
    return _groups["group"]


_groups: Dict[str, Any] = {}


def load(obj: Any, path: pathlib.Path, modules: Mapping[str, torch.nn.Module]) -> None:
    """Loads ``path`` into ``obj`` (collective with a process group): a DCP folder
    at any world size, or a plain ``torch.save`` file of a full state dict."""
    path = pathlib.Path(path)
    optimizer = isinstance(obj, torch.optim.Optimizer)
    if path.is_dir():
        state, options = state_of(obj, modules), None
        if optimizer:  # the groups' entries as the checkpoint holds them (a scheduler's prev_lr, ...)
            state["param_groups"] = _groups_to_read(state["param_groups"], _saved_group_keys(path), obj)
        dcp.load(state, checkpoint_id=str(path), **_no_dist())
    else:  # a full state dict from SpeechBrain's or DDP's checkpoint: every rank keeps its part
        state, options = torch.load(path, map_location="cpu"), StateDictOptions(full_state_dict=True)
        state = _by_names(state, obj, modules) if optimizer else state
    if optimizer:
        tuples = [{key for key, value in [*group.items(), *saved.items()] if isinstance(value, tuple)}
                  for group, saved in zip(obj.param_groups, state["param_groups"])]
        _adopt_group_entries(obj, state["param_groups"])
        set_optimizer_state_dict(_owner(modules), obj, state, options=options)
        for group, keys in zip(obj.param_groups, tuples):  # torch's flattening turns a tuple (betas) into a list
            group.update({key: tuple(group[key]) for key in keys if isinstance(group.get(key), list)})
    else:
        set_model_state_dict(obj, state, options=options)


def _saved_group_keys(folder: pathlib.Path) -> List[List[str]]:
    """Per parameter group of the optimizer saved in a DCP folder, the keys of its
    entries (``lr``, a scheduler's ``prev_lr`` or ``initial_lr``, a recipe's own)."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    groups: Dict[int, List[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith("param_groups."):
            index, name = key[len("param_groups."):].split(".", 1)
            groups.setdefault(int(index), []).append(name)
    return [groups[i] for i in sorted(groups)]


def _groups_to_read(current: List[Dict[str, Any]], saved: List[List[str]], optimizer: Any) -> List[Dict[str, Any]]:
    """The param groups DCP fills: exactly the saved entries (DCP refuses a key the
    checkpoint lacks and skips one the target lacks), the current values as placeholders."""
    _check_group_count(len(saved), optimizer)
    return [{key: group.get(key) for key in keys} for group, keys in zip(current, saved)]


def _check_group_count(saved: int, optimizer: Any) -> None:
    if saved != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {saved} parameter group(s), this "
                         f"{type(optimizer).__name__} has {len(optimizer.param_groups)}: expected the same groups. "
                         "Build the optimizer as the run that saved it did, or start without this checkpoint.")


def _adopt_group_entries(optimizer: Any, saved: List[Dict[str, Any]]) -> None:
    """Gives the optimizer's groups every entry the saved groups hold, before
    ``set_optimizer_state_dict`` (which maps saved entries onto the current ones and
    fails on one the current groups lack, e.g. SpeechBrain's ``prev_lr``)."""
    _check_group_count(len(saved), optimizer)
    for group, saved_group in zip(optimizer.param_groups, saved):
        group.update({key: value for key, value in saved_group.items() if key != "params"})


def _by_names(state: Dict[str, Any], optimizer: torch.optim.Optimizer,
              modules: Mapping[str, torch.nn.Module]) -> Dict[str, Any]:
    """``optimizer.state_dict()`` as torch writes it (parameters by position) keyed by
    parameter names instead, as ``set_optimizer_state_dict`` reads a full one."""
    names = {id(p): n for n, p in _owner(modules).named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    positions = [i for group in state["param_groups"] for i in group["params"]]
    rename = dict(zip(positions, order))
    return {"state": {rename[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [rename[i] for i in g["params"]]} for g in state["param_groups"]]}


def load_full_state_dict(path: Any, map_location: Any = "cpu") -> Dict[str, Any]:
    """The whole state a DCP folder holds, read by this process alone (no collective)
    into one full state dict on the CPU, moved to ``map_location`` (as ``torch.load``'s);
    a plain file is ``torch.load``-ed."""
    path = pathlib.Path(path)
    if not path.is_dir():
        return torch.load(path, map_location=map_location)
    # What torch's dcp_to_torch_save does, kept in memory (torch 2.4-2.14: private names).
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: Dict[str, Any] = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    if map_location in (None, "cpu", torch.device("cpu")):
        return state
    return {k: v.to(map_location) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
