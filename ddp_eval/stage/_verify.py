"""``ddp_eval: {verify: first}``: proving a conversion on the recipe's own data.

On a verified VALID/TEST stage each rank, after the merge and before
``on_stage_end``, also evaluates every batch of the stage as one process would,
in order, from a copy of the Brain's stage-start state, and compares what
``on_stage_end`` is about to see (the stage loss, every recipe attribute, every
metric object's fields and ``summarize()``) with that one-process result. The
recipe's own values are put back before ``on_stage_end`` runs; the reference
pass writes ``stage_output`` files to a scratch folder, and state outside the
Brain it changes (modules, hparams objects) is named, since the pass ran those
batches a second time.

Example
-------
>>> import torch
>>> first_difference({"n": 3, "ids": ["a", "b"]}, {"n": 3, "ids": ["a", "c"]})
("['ids'][1]", "'b'", "'c'")
>>> first_difference(torch.tensor([1.0]), torch.tensor([1.0])) is None
True
"""

import copy
import io
import pickle
import random
import tempfile
import types
from typing import Any, Dict, List, Optional, Tuple

import torch

from ddp_eval.stage._loop import noted_loss, stage_loss
from ddp_eval.state import compared_captured_state, is_array, numpy, recipe_names

MODES = ("off", "first", "every", "strict")
_MAX_SHOWN = 120  # characters of a value in a message


def wants_verification(mode: str, stage_name: str, done: set) -> bool:
    """Whether this stage is verified (``done``: stage names verified so far).

    Example
    -------
    >>> wants_verification("first", "TEST", {"VALID"}), wants_verification("first", "VALID", {"VALID"})
    (True, False)
    """
    if mode == "off":
        return False
    return mode == "every" or stage_name not in done


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def first_difference(got: Any, want: Any, path: str = "", uncompared: Optional[List[Tuple[str, str]]] = None
                     ) -> Optional[Tuple[str, str, str]]:
    """``(path, got, want)`` of the first place two values differ (bit for bit for
    floats and tensors), or None if they are equal. Objects whose state the
    engine reads by digest rather than field by field (an in-memory stream, a
    random generator, a deque, a class with ``__slots__``) are compared by what
    they hold and pickle to; one that cannot be compared (a generator, a file) is
    added to ``uncompared`` as ``(path, why)``, never taken as equal silently."""
    def inner(a: Any, b: Any, where: str) -> Optional[Tuple[str, str, str]]:
        return first_difference(a, b, where, uncompared)

    if type(got) is not type(want):
        return path, f"{type(got).__name__} {_short(got)}", f"{type(want).__name__} {_short(want)}"
    if isinstance(got, torch.Tensor):
        same = got.shape == want.shape and got.dtype == want.dtype and torch.equal(
            got.detach().cpu(), want.detach().cpu()) or (got.is_floating_point() and got.shape == want.shape and bool(
                torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())))
        return None if same else (path, _short(got), _short(want))
    if is_array(got):
        same = got.shape == want.shape and got.dtype == want.dtype and numpy.array_equal(
            got, want, equal_nan=got.dtype.kind in "fc")
        return None if same else (path, _short(got), _short(want))
    if isinstance(got, (list, tuple)):
        if len(got) != len(want):
            return path, f"{len(got)} entries: {_short(got)}", f"{len(want)} entries: {_short(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            found = inner(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(got, dict):
        if list(got) != list(want):
            return f"{path} keys", _short(list(got)), _short(list(want))
        for key in got:
            found = inner(got[key], want[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(got, float):
        return None if got == want or (got != got and want != want) else (path, repr(got), repr(want))
    if isinstance(got, (int, str, bytes, bool, type(None), complex)):
        return None if got == want else (path, _short(got), _short(want))
    captured = compared_captured_state(got)
    if captured is not None:  # a closure's cells, a partial's arguments: state a stage may accumulate
        if got is want and captured:
            if uncompared is not None:
                uncompared.append((path, f"a {type(got).__name__} whose closure, defaults or arguments hold state "
                                         "the one-process pass shares with the merged run"))
            return None
        return inner(captured, compared_captured_state(want), f"{path} (captured)")
    if isinstance(got, torch.nn.Module) or (callable(got) and getattr(got, "__dict__", None) is None):
        return None  # models and plain code are not what a stage accumulates
    if isinstance(got, (io.StringIO, io.BytesIO)):  # its __dict__ shows none of its state
        return None if (got.getvalue(), got.tell()) == (want.getvalue(), want.tell()) else (
            path, _short(got.getvalue()), _short(want.getvalue()))
    own_got, own_want = getattr(got, "__dict__", None), getattr(want, "__dict__", None)
    opaque = own_got is None or not isinstance(got, types.SimpleNamespace) and (  # a namespace: its __dict__
        type(got).__reduce_ex__ is not object.__reduce_ex__ or type(got).__reduce__ is not object.__reduce__
    )  # state kept in C or __slots__, as the engine reads it
    if not opaque:
        fields = {k: v for k, v in own_got.items() if k != "summary"}
        return inner(fields, {k: v for k, v in own_want.items() if k != "summary"}, path)
    if type(got).__eq__ is not object.__eq__:  # equality by value (a deque, a Counter)
        return None if got == want else (path, _short(got), _short(want))
    try:
        same = pickle.dumps(got) == pickle.dumps(want)
    except Exception as exc:  # a generator, a file, a lock: nothing to read its state by
        if uncompared is not None:
            uncompared.append((path, f"a {type(got).__name__}, which cannot be compared ({type(exc).__name__})"))
        return None
    return None if same else (path, _short(got), _short(want))


def recipe_attributes(brain: Any, config: Any) -> List[str]:
    """The Brain attributes a verified stage compares: the recipe's, metric objects
    included; not what ``sb.Brain`` set up, training machinery or recoverables."""
    names = recipe_names(brain) - set(config.attributes_exclude) - set(config.metrics_exclude)
    checkpointer = getattr(brain, "checkpointer", None)
    recoverables = {id(v) for v in (getattr(checkpointer, "recoverables", None) or {}).values()}
    return sorted(n for n in names if id(getattr(brain, n)) not in recoverables)


class StageVerifier:
    """The one-process reference of one sharded stage on this rank.

    Arguments
    ---------
    brain : DDPEvalMixin
        The Brain, at stage start (after the recipe's ``on_stage_start``).
    names : list of str
        The recipe's attributes to copy now and compare at stage end.
    """

    def __init__(self, brain: Any, names: List[str]) -> None:
        self.start: Dict[str, Any] = {}
        self.uncopied: Dict[str, str] = {}
        for name in names:
            try:
                self.start[name] = copy.deepcopy(getattr(brain, name))
            except Exception as exc:  # a file handle, a generator: named, not compared
                self.uncopied[name] = f"{type(exc).__name__}: {exc}"

    def reference(self, brain: Any, stage: Any, batches: List[Any], outside: Any) -> Tuple[float, Dict[str, Any],
                                                                                           Dict[str, str]]:
        """Runs ``batches`` as one process would, from the stage-start copy; returns
        ``(loss, {name: value}, {what changed outside: why})``, the recipe's own
        values put back. ``outside()`` summarises state outside the Brain."""
        held = {name: getattr(brain, name) for name in self.start if hasattr(brain, name)}
        rng = (torch.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy is not None else None)
        step, before = brain.step, outside()
        kept = OutsideState(brain)  # a scheduler stepped per batch must not be stepped twice
        for name, value in self.start.items():
            setattr(brain, name, value)
        try:
            brain.step, losses = 0, []
            for batch in batches:
                brain.step += 1
                losses.append((brain.step, noted_loss(brain.evaluate_batch(batch, stage=stage), brain)))
            avg_loss = stage_loss(losses, brain)
            result = {name: getattr(brain, name, None) for name in self.start}
        finally:
            for name, value in held.items():
                setattr(brain, name, value)
            brain.step = step
            kept.restore()
            torch.set_rng_state(rng[0])
            random.setstate(rng[1])
            if rng[2] is not None:
                numpy.random.set_state(rng[2])
        after = outside()
        changed = {label: "changed by the reference pass" for label in sorted(set(before) | set(after))
                   if before.get(label) != after.get(label)}
        return avg_loss, result, changed


class OutsideState:
    """The state outside the recipe's attributes that a batch may change, copied so
    that the reference pass leaves training as it found it: the objects in
    ``hparams`` and among the checkpointer's recoverables (a scheduler stepped in
    ``compute_objectives``, a counter), each one's own attributes, and the
    hyperparameters of the Brain's optimizers (the learning rate such a scheduler
    sets). Modules, optimizers' states, parameters and these objects themselves are
    kept by identity (never copied); an object that cannot be copied is left as it
    is (and named if the pass changed it).

    Example
    -------
    >>> import types
    >>> model = torch.nn.Linear(1, 1)
    >>> class Scheduler:
    ...     def __init__(self):
    ...         self.steps = 0
    >>> brain = types.SimpleNamespace(hparams=types.SimpleNamespace(lr=Scheduler()),
    ...                               optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
    >>> kept = OutsideState(brain)
    >>> brain.hparams.lr.steps += 1
    >>> brain.optimizer.param_groups[0]["lr"] = 0.1
    >>> kept.restore()
    >>> brain.hparams.lr.steps, brain.optimizer.param_groups[0]["lr"]
    (0, 0.5)
    """

    def __init__(self, brain: Any) -> None:
        hparams = getattr(brain, "hparams", None)
        checkpointer = getattr(brain, "checkpointer", None)
        candidates = list(vars(hparams).values()) if hparams is not None else []
        candidates += list((getattr(checkpointer, "recoverables", None) or {}).values())
        candidates += [v for v in vars(brain).values() if isinstance(v, torch.optim.Optimizer)]
        objects = list({id(o): o for o in candidates}.values())
        heavy = [o for o in objects if isinstance(o, (torch.nn.Module, torch.optim.Optimizer))]
        for module in [o for o in objects if isinstance(o, torch.nn.Module)] + list(
                (getattr(brain, "modules", None) or {}).values()):
            heavy += [module, *module.parameters(), *module.buffers()]
        memo = {id(o): o for o in objects + heavy + [checkpointer, brain]}
        self.optimizers = [(o, [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in o.param_groups])
                           for o in objects if isinstance(o, torch.optim.Optimizer)]
        self.objects = []
        for obj in objects:
            own = getattr(obj, "__dict__", None)
            if own is None or obj is checkpointer or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, type)):
                continue
            try:
                self.objects.append((obj, dict(own), copy.deepcopy(dict(own), dict(memo))))
            except Exception:  # a lock, a file: left as it is (outside() names it if the pass changed it)
                continue

    def restore(self) -> None:
        """Puts every copied object's attributes back (the same objects: a list,
        dict or set refilled in place, a value rebound put back) and every
        optimizer's hyperparameters."""
        for obj, originals, copies in self.objects:
            own = vars(obj)
            for key in [k for k in own if k not in originals]:  # bound by the pass
                del own[key]
            for key, original in originals.items():
                own[key] = original
                if isinstance(original, list):
                    original[:] = copies[key]
                elif isinstance(original, (dict, set)):
                    original.clear()
                    original.update(copies[key])
        for optimizer, groups in self.optimizers:
            for group, saved in zip(optimizer.param_groups, groups):
                group.update(saved)


def _losses_agree(loss: Any, reference: Any) -> bool:
    """Equal to 1e-9 relative: a number, or each entry of a dict of numbers (a
    recipe's own ``update_average``); anything else, equal.

    Example
    -------
    >>> _losses_agree(1.0, 1.0 + 1e-12), _losses_agree({"a": 1.0}, {"a": 1.1}), _losses_agree({"a": 1.0}, {})
    (True, False, False)
    """
    if isinstance(loss, dict) and isinstance(reference, dict):
        return loss.keys() == reference.keys() and all(_losses_agree(loss[k], reference[k]) for k in loss)
    try:
        return loss == reference or abs(loss - reference) <= 1e-9 * max(abs(loss), abs(reference))
    except TypeError:
        return False


def compare(loss: float, reference_loss: float, merged: Dict[str, Any], reference: Dict[str, Any]
            ) -> Tuple[int, List[Tuple[str, str, str]], Dict[str, str]]:
    """``(number of values compared, differences, {path: why not compared})``: the loss
    (to 1e-9 relative: the merged loss is one process's bit for bit, but a
    re-evaluation on a GPU need not repeat its forwards' last bits), every
    attribute, and each metric object's ``summarize()``."""
    differences, count, uncompared = [], 1, []
    if not _losses_agree(loss, reference_loss):
        differences.append(("stage_loss", repr(loss), repr(reference_loss)))
    for name, want in reference.items():
        count += 1
        found = first_difference(merged.get(name), want, name, uncompared)
        if found is None and hasattr(want, "summarize") and callable(want.summarize):
            count += 1
            found = first_difference(_summary(merged.get(name)), _summary(want), f"{name}.summarize()")
        if found is not None:
            differences.append(found)
    return count, differences, dict(uncompared)


def _summary(metric: Any) -> Any:
    try:
        return copy.deepcopy(metric).summarize()
    except Exception as exc:  # noqa: BLE001 - an empty metric may not summarize: compared as such
        return f"<summarize() raised {type(exc).__name__}>"


def scratch_folder() -> str:
    """Where ``stage_output`` files of the reference pass go."""
    return tempfile.mkdtemp(prefix="ddp_eval-verify-")
