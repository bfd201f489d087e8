"""What a sharded stage reads of the model: checksums of its tensors, each read
once per stage edge.

* :func:`module_states` (at stage start and at stage end, on every rank): per
  module, one checksum per buffer, and per tensor and number attribute of its
  parts without parameters (where InputNormalization keeps its statistics;
  elsewhere such attributes are per-call caches); :func:`differing_modules`
  names modules the stage used (:class:`ModuleUse`) that differed across ranks
  when the stage started (the stage-start checksums are taken after DDP's
  buffers were broadcast, so only what no broadcast brings into step can differ: a module
  outside DDP that learnt on each rank's own batches) and modules whose state
  the stage changed and that differ across ranks after it (InputNormalization
  called through ``hparams`` keeps learning). Both edges read the buffers: a
  BatchNorm's running statistics change in place without moving the tensor's
  ``_version``, so nothing cheaper says they did not change.
* :func:`model_fingerprint`: the model a journal piece was written with (the
  names, dtypes, shapes and crc32 of every parameter and buffer). The ranks
  take it together at stage start: each reads only its :func:`fingerprint_share`
  of the parameters, rank 0 also the buffers (the source of the stage-start
  broadcast), whose checksums :func:`module_states` has just read, and the
  shares travel on the stage-start exchange. The digest does not depend on the
  world size, so a journal resumes at another one.

Example
-------
>>> _ = torch.manual_seed(0)
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
>>> tensors = model_tensors([model])
>>> [name for name, _, _ in tensors]
['0.weight', '0.bias', '1.weight', '1.bias', '1.running_mean', '1.running_var', '1.num_batches_tracked']
>>> shares = [fingerprint_share(tensors, rank, 2) for rank in range(2)]
>>> shares  # rank 0: the buffers (24 bytes) and one bias; rank 1: the 16-byte weight first
[[2, 4, 5, 6], [0, 1, 3]]
>>> crcs = {i: tensor_crc(tensors[i][1]) for share in shares for i in share}
>>> model_fingerprint(tensors, crcs) == model_fingerprint(tensors)
True
"""

import ctypes
import functools
import hashlib
import zlib
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from ddp_eval import sb_compat
from ddp_eval.state import is_number


def _unwrapped(module: Any) -> Any:
    return module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module


def model_modules(brain: Any) -> List[Tuple[str, torch.nn.Module]]:
    """``(where, module)`` of the Brain's modules and the modules among its hparams
    (e.g. a language model), each once, DDP wrappers looked through."""
    modules = getattr(brain, "modules", None)
    candidates = [(f"modules.{n}", m) for n, m in (modules.items() if modules is not None else ())]
    hparams = getattr(brain, "hparams", None)
    candidates += [(f"hparams.{n}", v) for n, v in sorted(vars(hparams).items())] if hparams is not None else []
    found, seen = [], set()
    for where, module in candidates:
        module = _unwrapped(module)
        if isinstance(module, torch.nn.Module) and id(module) not in seen:
            seen.add(id(module))
            found.append((where, module))
    return found


def tensor_crc(tensor: torch.Tensor) -> int:
    """The crc32 of a tensor's bytes (a device tensor is copied to the CPU).

    Read through its address, not ``.numpy()``: a NumPy view makes the storage
    unresizable, and FSDP frees a gathered parameter by resizing its storage.
    """
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    nbytes = flat.numel() * flat.element_size()
    return zlib.crc32((ctypes.c_char * nbytes).from_address(flat.data_ptr())) if nbytes else 0


def _keeps_statistics_as_attributes(module: torch.nn.Module) -> bool:
    """Whether ``module``'s plain tensor and number attributes are state: in a module
    without parameters (InputNormalization's ``glob_mean``, ``count``). A module with
    parameters keeps statistics in buffers (BatchNorm); its plain attributes are
    per-call caches (an attention's ``precomputed_enc_h``), as a SpeechBrain
    decoder's ``batch_size`` and ``n_bh`` are: they differ across ranks by the
    batches each evaluated last, which says nothing about the model."""
    return next(module.parameters(), None) is None and not sb_compat.holds_scratch_state(module)


def _state_items(module: torch.nn.Module, crcs: Dict[int, int]) -> Dict[str, int]:
    """``{item: crc32}`` of a module's state: each buffer (and each statistic kept as
    an attribute) by its path in the module, e.g. ``1.running_mean``."""
    items: Dict[str, int] = {}
    for prefix, sub in module.named_modules():
        found = [(n, b) for n, b in sub.named_buffers(recurse=False)]
        if _keeps_statistics_as_attributes(sub):
            found += [(n, v) for n, v in vars(sub).items() if isinstance(v, torch.Tensor) or is_number(v)]
        for name, value in found:
            if isinstance(value, torch.Tensor):
                if id(value) not in crcs:
                    crcs[id(value)] = tensor_crc(value)
                text = f"{value.dtype}|{tuple(value.shape)}|{crcs[id(value)]}"
            else:
                text = repr(value)
            items[f"{prefix}.{name}" if prefix else name] = zlib.crc32(text.encode())
    return items


def module_states(brain: Any, crcs: Optional[Dict[int, int]] = None,
                  only: Optional[Iterable[str]] = None) -> Dict[str, Dict[str, int]]:
    """``{where: {item: checksum}}`` of the Brain's modules and the modules in its
    hparams (those named in ``only``, if given); ``crcs`` (if given) receives
    ``{id(tensor): crc32}`` of every tensor read."""
    crcs = {} if crcs is None else crcs
    only = None if only is None else set(only)
    return {where: _state_items(module, crcs) for where, module in model_modules(brain)
            if only is None or where in only}


class ModuleUse:
    """Which of the Brain's modules (and modules in its hparams) a stage used: a
    forward of the module or of any module inside it ran on this rank. A
    training-only module (a speed perturbation never called in VALID/TEST) that
    differs across ranks changes no result. One forward pre-hook per module inside
    each, removed once that module is known used (a used model costs its first
    forward's hooks only); :meth:`stop` removes the rest.

    Example
    -------
    >>> class Holder:
    ...     modules = {"model": torch.nn.Sequential(torch.nn.Linear(2, 2))}
    ...     hparams = None
    >>> use = ModuleUse(Holder())
    >>> _ = Holder.modules["model"][0](torch.ones(1, 2))  # an inner module called alone
    >>> use.stop()
    ['modules.model']
    """

    def __init__(self, brain: Any) -> None:
        self.used: set = set()
        self._hooks: Dict[str, list] = {}
        for where, module in model_modules(brain):
            called = functools.partial(self._called, where)
            self._hooks[where] = [sub.register_forward_pre_hook(called) for sub in module.modules()]

    def _called(self, where: str, module: torch.nn.Module, args: Any) -> None:
        self.used.add(where)
        for hook in self._hooks.pop(where, ()):  # torch iterates over a copy of the hooks: removable here
            hook.remove()

    def stop(self) -> List[str]:
        """Removes the hooks left; returns where the used modules are."""
        for hooks in self._hooks.values():
            for hook in hooks:
                hook.remove()
        self._hooks.clear()
        return sorted(self.used)


def ddp_wrapped(brain: Any) -> List[str]:
    """Where the Brain's DDP-wrapped modules are (their buffers are broadcast at stage start)."""
    modules = getattr(brain, "modules", None)
    return [f"modules.{n}" for n, m in (modules.items() if modules is not None else ())
            if isinstance(m, torch.nn.parallel.DistributedDataParallel)]


def differing_modules(start: Sequence[Mapping[str, Mapping[str, int]]], end: Sequence[Mapping[str, Mapping[str, int]]],
                      used: Optional[Sequence[Iterable[str]]] = None) -> Dict[str, str]:
    """``{where: why}`` of modules some rank used (:class:`ModuleUse`; all of them
    when ``used`` is None) that differed across ranks at stage start, and of
    modules some rank's stage changed that differ across ranks after it; ``why``
    says which of its buffers or statistics differ.

    Example
    -------
    >>> differing_modules([{"m": {"bn.mean": 1}}, {"m": {"bn.mean": 2}}], [{"m": {"bn.mean": 1}}] * 2)["m"][:86]
    "it differed across ranks when the stage started (rank(s) [1] against rank 0: 'bn.mean'"
    >>> differing_modules([{"m": {"bn.mean": 1}}, {"m": {"bn.mean": 2}}], [{}, {}], used=[[], []])  # not used
    {}
    """
    named = {}
    used_somewhere = None if used is None else {where for rank in used for where in rank}
    for where in sorted(set(start[0]) | set(end[0])):
        apart = [r for r, s in enumerate(start) if s.get(where) != start[0].get(where)]
        changed = [r for r, (s, e) in enumerate(zip(start, end)) if s.get(where) != e.get(where)]
        if apart and (used_somewhere is None or where in used_somewhere):
            named[where] = (f"it differed across ranks when the stage started (rank(s) {apart} against rank 0: "
                            f"{_differing_items([s.get(where) for s in start])}), so each rank evaluated its "
                            "batches with a model of its own and the merged results are no one process's: bring "
                            "its state into step on every rank before the stage (e.g. broadcast it from rank 0 in "
                            "on_stage_start, as DDP does for its buffers), or keep what it learns out of it")
        elif changed and len({_frozen(e.get(where)) for e in end}) > 1:
            named[where] = (f"its buffers or statistics changed during the stage (on rank(s) {changed}) and now "
                            f"differ across ranks ({_differing_items([e.get(where) for e in end])}): each rank "
                            "updated them from its own batches")
    return named


def _frozen(items: Optional[Mapping[str, int]]) -> Any:
    return None if items is None else tuple(sorted(items.items()))


def _differing_items(per_rank: Sequence[Optional[Mapping[str, int]]], most: int = 5) -> str:
    """The items (buffers, statistics) whose checksums differ across ranks, quoted."""
    names = sorted({n for items in per_rank for n in (items or {})})
    apart = [n for n in names if len({(items or {}).get(n) for items in per_rank}) > 1]
    shown = ", ".join(repr(n) for n in apart[:most]) + (f" and {len(apart) - most} more" if len(apart) > most else "")
    return shown or "its set of buffers"


def model_tensors(modules: Iterable[torch.nn.Module]) -> List[Tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, is_buffer)`` of every parameter, then every buffer, of each
    module in turn, each tensor once: the order of the fingerprint."""
    found, seen = [], set()
    for module in modules:
        module = _unwrapped(module)
        named = [(n, t, False) for n, t in module.named_parameters()]
        for name, tensor, is_buffer in named + [(n, t, True) for n, t in module.named_buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                found.append((name, tensor, is_buffer))
    return found


def fingerprint_share(tensors: Sequence[Tuple[str, torch.Tensor, bool]], rank: int, world_size: int) -> List[int]:
    """Positions in ``tensors`` whose crc ``rank`` reads for the fingerprint: every
    buffer on rank 0, the parameters spread over the ranks by bytes (largest first)."""
    size = [t.numel() * t.element_size() for _, t, _ in tensors]
    load = [sum(s for s, (_, _, is_buffer) in zip(size, tensors) if is_buffer)] + [0] * (world_size - 1)
    owner = {i: 0 for i, (_, _, is_buffer) in enumerate(tensors) if is_buffer}
    for i in sorted((i for i in range(len(tensors)) if i not in owner), key=lambda i: (-size[i], i)):
        owner[i] = min(range(world_size), key=lambda r: (load[r], r))
        load[owner[i]] += size[i]
    return [i for i in range(len(tensors)) if owner[i] == rank]


def model_fingerprint(tensors: Sequence[Tuple[str, torch.Tensor, bool]],
                      crcs: Optional[Mapping[int, int]] = None) -> str:
    """A digest of ``tensors`` (:func:`model_tensors`); ``crcs`` gives the crc32 of
    positions already read (the ranks' shares); the others are read here."""
    crcs = crcs or {}
    digest = hashlib.sha1()
    for i, (name, tensor, _) in enumerate(tensors):
        crc = crcs[i] if i in crcs else tensor_crc(tensor)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|{crc}\n".encode())
    return digest.hexdigest()[:20]
