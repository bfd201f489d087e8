"""FSDP (torch's ``fully_shard``): sharding a Brain's modules, gathering their
parameters for a sharded evaluation, and telling sharded state from plain.

* :func:`shard_module`: ``fully_shard`` on the submodules of the classes named
  in ``fsdp: shard_modules`` (innermost first), then on the module itself.
* :func:`gather_parameters` / :func:`release_parameters`: around a sharded
  VALID/TEST stage. Every forward of a sharded module all-gathers its
  parameters from every rank, so ranks with different numbers of batches (or a
  decoder that makes a data-dependent number of forward calls) would wait for
  each other forever. At stage start, right after an exchange every rank
  passed, each sharded module is unsharded once (its all-gather, in the same
  order on every rank) and told not to reshard after forward; the stage's
  forwards then issue no collective at all, and the release (local) frees the
  full parameters and restores the module's setting. Cost: one full copy of
  the sharded modules' parameters per rank for the length of the stage.
* :func:`is_sharded`: a module with ``DTensor`` parameters, or an optimizer over
  them: state that only all ranks together hold, saved by
  :mod:`ddp_eval.distributed.dcp`.

Without FSDP in this torch (:func:`support_problem`), ``fsdp:`` fails at start-up.

Example
-------
>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> is_sharded(model), is_sharded(torch.optim.SGD(model.parameters(), lr=0.1))
(False, False)
>>> release_parameters(gather_parameters([model]))  # nothing sharded: nothing to do
"""

from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

try:  # torch >= 2.6: public; 2.4-2.5: the composable API
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - depends on the torch release
    try:
        from torch.distributed._composable.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )
    except ImportError:
        fully_shard = FSDPModule = MixedPrecisionPolicy = CPUOffloadPolicy = None
from torch.distributed.device_mesh import init_device_mesh

from ddp_eval import distributed

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor

# The oldest torch release whose fully_shard trains, evaluates and saves on CPU
# with gloo as the tests here do (docs/versions.md: 2.4 and 2.6 fail on CPU, in
# their CUDA stream calls; 2.7.1, 2.8.0 and 2.14.1 pass tests/test_fsdp.py).
MIN_TORCH = (2, 7)


def _release(version: str) -> Tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def support_problem(version: Optional[str] = None) -> Optional[str]:
    """Why ``fsdp:`` cannot work with this torch (or ``version``), or None.

    Example
    -------
    >>> support_problem("2.6.0").split(" (")[0]
    'ddp_eval: fsdp needs torch >= 2.7'
    >>> support_problem("2.14.1") is None
    True
    """
    version = version or torch.__version__
    if fully_shard is None or _release(version) < MIN_TORCH:
        return (f"ddp_eval: fsdp needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (FSDP2's fully_shard as ddp_eval "
                f"uses it, on CPU and GPU), got torch {version}. Upgrade torch, or remove the 'fsdp:' key from the "
                "ddp_eval: section to train with DDP.")
    return None


def shard_module(module: torch.nn.Module, shard_modules: Sequence[str], reshard_after_forward: bool = True,
                 mixed_precision: Optional[dict] = None, cpu_offload: bool = False) -> torch.nn.Module:
    """Shards ``module`` in place with ``fully_shard``: each submodule whose class
    name is in ``shard_modules`` on its own (innermost first), then the rest with
    the module itself. Returns the module (now also an ``FSDPModule``)."""
    # the mesh on the module's own device (torch's default picks CUDA whenever it exists)
    device = next(module.parameters()).device
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    kwargs: dict = {"reshard_after_forward": reshard_after_forward, "mesh": mesh}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            **{key: getattr(torch, dtype) for key, dtype in mixed_precision.items()})
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    wanted = set(shard_modules)
    inner = [m for m in module.modules() if m is not module and type(m).__name__ in wanted]
    for sub in reversed(inner):  # modules() is parents first: children are sharded before their parents
        fully_shard(sub, **kwargs)
    fully_shard(module, **kwargs)
    return module


def _params(obj: Any) -> Iterable[Any]:
    if isinstance(obj, torch.nn.Module):
        return obj.parameters()
    if isinstance(obj, torch.optim.Optimizer):
        return (p for group in obj.param_groups for p in group["params"])
    return ()


def is_sharded(obj: Any) -> bool:
    """Whether ``obj`` is a module or an optimizer with ``DTensor`` parameters."""
    return any(isinstance(p, DTensor) for p in _params(obj))


def fsdp_modules(modules: Iterable[torch.nn.Module]) -> List[torch.nn.Module]:
    """Every ``FSDPModule`` in ``modules`` (and below), each once, parents first."""
    found, seen = [], set()
    for module in modules:
        for sub in module.modules() if FSDPModule is not None else ():
            if isinstance(sub, FSDPModule) and id(sub) not in seen:
                seen.add(id(sub))
                found.append(sub)
    return found


def _groups(state: Any) -> List[Any]:
    """An FSDP state's parameter groups (torch 2.7: one, ``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _setting(module: Any) -> Tuple[Optional[bool], List[Any]]:
    """What ``set_reshard_after_forward`` changes, to put back as it was (torch 2.7-2.14;
    the flag of the root's automatic choice exists from 2.8 on)."""
    state = module._get_fsdp_state()
    return (getattr(state, "_auto_reshard_after_forward", None),
            [g.post_forward_mesh_info for g in _groups(state)])


def _restore(module: Any, setting: Tuple[Optional[bool], List[Any]]) -> None:
    state = module._get_fsdp_state()
    if setting[0] is not None:
        state._auto_reshard_after_forward = setting[0]
    for group, info in zip(_groups(state), setting[1]):
        group.post_forward_mesh_info = info


def gather_parameters(modules: Iterable[torch.nn.Module]) -> List[Tuple[Any, Tuple[Any, List[Any]]]]:
    """Collective (call it on every rank, right after an exchange): unshards every
    FSDP module in ``modules`` and keeps it unsharded across forwards; returns what
    :func:`release_parameters` needs. A no-op without FSDP modules."""
    gathered, handles = [], []
    try:
        for module in fsdp_modules(modules):  # every all-gather issued, in the same order on every rank
            gathered.append((module, _setting(module)))
            if hasattr(module, "set_reshard_after_forward"):  # torch >= 2.8
                module.set_reshard_after_forward(False, recurse=False)
            else:  # what it does, in torch 2.7
                for group in _groups(module._get_fsdp_state()):
                    group.post_forward_mesh_info = None
            handles.append(module.unshard(async_op=True))
        # one bounded wait: a rank that fails before its all-gathers must not leave the others in theirs
        distributed.wait_for_works([w for module, _ in gathered for w in _pending_all_gathers(module)],
                                   "FSDP parameters gather")
        for handle in handles:
            if handle is not None:
                handle.wait()
    except BaseException:
        release_parameters(gathered)
        raise
    return gathered


def _pending_all_gathers(module: Any) -> List[Any]:
    """The all-gathers an ``unshard(async_op=True)`` issued (torch 2.7-2.14: each param
    group's ``_all_gather_result``); none where this torch keeps them elsewhere."""
    works = []
    for group in _groups(module._get_fsdp_state()):
        work = getattr(getattr(group, "_all_gather_result", None), "all_gather_work", None)
        if hasattr(work, "is_completed"):
            works.append(work)
    return works


def release_parameters(gathered: Sequence[Tuple[Any, Tuple[Any, List[Any]]]]) -> None:
    """Local: frees the full parameters :func:`gather_parameters` made and restores
    each module's reshard-after-forward setting."""
    for module, setting in reversed(gathered):
        module.reshard()
        _restore(module, setting)
        _forget_forwards(module)


def _forget_forwards(module: Any) -> None:
    """Clears FSDP's record of the stage's forwards (torch 2.7-2.14: every forward is
    noted for the next backward's prefetch order, and only a backward clears it). The
    ranks made different numbers of forwards, so the next training backward would
    prefetch different all-gathers on different ranks and deadlock."""
    state = module._get_fsdp_state()
    order = getattr(getattr(state, "_comm_ctx", None), "post_forward_order", None)
    if order is not None:
        order.clear()
    for group in _groups(state):
        getattr(group, "_post_forward_indices", []).clear()
