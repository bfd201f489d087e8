"""What SpeechBrain's VALID/TEST loop sees around each batch of a sharded stage.

SpeechBrain's loops count the stage's batches in ``Brain.step`` (``self.step +=
1`` right before each batch); ``evaluate`` leaves the count for TEST's
``on_stage_end`` (``fit`` sets 0 before VALID's). On a rank they would count its
own batches only, so code that reads ``self.step`` in a batch (``if self.step <=
5:`` keep a sample) or in TEST's ``on_stage_end`` would see another number than
one process: :class:`OneProcessSteps` keeps it one process's.

Which global random generators its batches drew from is noted for the stage
(:class:`~ddp_eval.stage._draws.RandomDraws`), to be named at stage end.

The loss the loop averages (:func:`stage_loss`: SpeechBrain's running average, or a
recipe's own ``update_average`` replayed) and the TRAIN loss it hands
``on_stage_end`` (:func:`global_train_loss`) are one process's, or every rank's.
"""

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from ddp_eval import distributed as dist
from ddp_eval.errors import ConfigError
from ddp_eval.stage._draws import RandomDraws, WorkerDraws
from ddp_eval.stage.sharding import global_batch_ids, is_stream, listen


class OneProcessSteps:
    """Sets ``brain.step`` before each of this rank's batches so that the loop's
    ``+= 1`` gives what one process holds there (the step at stage start plus the
    batch's global position plus one), and at TEST's end the global count.

    Arguments
    ---------
    brain : sb.Brain
        The Brain whose ``step`` the loop counts.
    positions : sequence of int, optional
        The global position of each batch this rank evaluates, in order; None when
        the loader tells each one as it yields it (:meth:`before` with its position).
    total : callable
        How many batches one process evaluates in the stage, asked at its end
        (None: unknown, the rank's own count stays).

    Example
    -------
    >>> brain = type("Brain", (), {"step": 0})()
    >>> steps = OneProcessSteps(brain, [1, 2, 5], total=lambda: 7)  # this rank's batches
    >>> seen = []
    >>> for _ in range(3):
    ...     brain.step += 1  # SpeechBrain's loop, right before the batch
    ...     seen.append(brain.step)
    ...     steps.before()  # after the batch: the next one's
    >>> seen
    [2, 3, 6]
    >>> steps.at_test_end(); brain.step  # what evaluate() leaves for TEST's on_stage_end
    7
    """

    def __init__(self, brain: Any, positions: Optional[Sequence[int]], total: Callable[[], Optional[int]]) -> None:
        self.brain, self.start, self.total = brain, brain.step, total
        self._positions: Iterator[int] = iter(positions or ())
        self.before()

    def before(self, position: Optional[int] = None) -> None:
        """Before this rank's next batch, at global ``position`` (default: the next
        of ``positions``; none left: the step stays as the loop leaves it)."""
        position = next(self._positions, None) if position is None else position
        if position is not None:
            self.brain.step = self.start + position

    def at_test_end(self) -> None:
        """The count one process's ``evaluate`` leaves for TEST's ``on_stage_end``."""
        total = self.total()
        if total is not None:
            self.brain.step = self.start + total


def running_average(losses: List[Tuple[int, Optional[float]]]) -> float:
    """SpeechBrain's stage loss (``Brain.update_average``) over every batch of the
    stage, ``(global position, loss or None if not finite)``, replayed in one
    process's order: bit for bit what one process computes (a sum over a count
    differs in the last bits).

    Example
    -------
    >>> running_average([(1, 2.0), (0, 1.0), (2, None)])  # the third batch counts as a step, as in SpeechBrain
    1.5
    """
    average = 0.0
    for step, (_, loss) in enumerate(sorted(losses, key=lambda pair: pair[0]), start=1):
        if loss is not None:
            average -= average / step
            average += loss / step
    return average


def noted_loss(loss: Any, brain: Any) -> Any:
    """What the merge keeps of a batch's loss: for SpeechBrain's average, a float (None
    if not finite); for a recipe's own ``update_average``, the loss as the loop gave
    it, its tensors detached, on the CPU (a dict of losses stays a dict).

    Example
    -------
    >>> plain = type("Brain", (), {})()  # SpeechBrain's update_average
    >>> noted_loss(torch.tensor(2.0), plain), noted_loss(torch.tensor(float("nan")), plain)
    (2.0, None)
    >>> own = type("Brain", (), {"_ddp_own_average": print})()  # a recipe's own
    >>> noted_loss({"mse": torch.tensor(1.5, requires_grad=True)}, own)
    {'mse': tensor(1.5000)}
    """
    if getattr(brain, "_ddp_own_average", None) is None:
        return float(loss) if bool(torch.isfinite(torch.as_tensor(loss))) else None
    return _detached(loss)


def _detached(loss: Any) -> Any:
    if isinstance(loss, torch.Tensor):
        return loss.detach().cpu()
    if isinstance(loss, (dict, list, tuple)):
        items = [_detached(x) for x in (loss.values() if isinstance(loss, dict) else loss)]
        return dict(zip(loss, items)) if isinstance(loss, dict) else type(loss)(items)
    return loss


def stage_loss(losses: List[Tuple[int, Any]], brain: Any, start: int = 0) -> Any:
    """The stage loss one process computes from every batch's noted loss,
    ``(global position, loss)``: SpeechBrain's running average, or the recipe's own
    ``update_average`` replayed (``start``: ``brain.step`` at stage start)."""
    own = getattr(brain, "_ddp_own_average", None)
    return running_average(losses) if own is None else replayed_average(losses, brain, own, start)


def replayed_average(losses: List[Tuple[int, Any]], brain: Any, update: Any, start: int = 0) -> Any:
    """A recipe's own ``update_average`` replayed over every batch's loss of the stage,
    ``(global position, loss)``, in one process's order, ``brain.step`` one process's at
    each (put back after): what one process computes with it.

    Example
    -------
    >>> brain = type("Brain", (), {"step": 0})()
    >>> def mean_of_max(loss, avg):  # a recipe's own average, of the larger of two losses
    ...     return avg + (max(loss) - avg) / brain.step
    >>> replayed_average([(1, (2.0, 4.0)), (0, (1.0, 0.0))], brain, mean_of_max)
    2.5
    """
    step, average = brain.step, 0.0
    try:
        for count, (_, loss) in enumerate(sorted(losses, key=lambda pair: pair[0]), start=1):
            brain.step = start + count
            average = update(loss, average)
    finally:
        brain.step = step
    return average


class LoopWatch:
    """Both, for one sharded stage: attached to its loader at stage start, told of
    each batch by :meth:`after_batch`, detached by :meth:`stop`."""

    def __init__(self, brain: Any, loader: Any, plan: Any) -> None:
        workers = getattr(loader, "collate_fn", None)
        self.loader, self.draws = loader, RandomDraws(workers if isinstance(workers, WorkerDraws) else None)
        self.whole = is_stream(loader) and loader.split == "batches"  # a stream every rank reads whole
        if not is_stream(loader):  # a planned loader: every position known now
            self.steps = OneProcessSteps(brain, global_batch_ids(loader), lambda: len(plan))
        else:  # a stream tells each as it yields it; split by dataset, it has no one-process order
            self.steps = OneProcessSteps(brain, None, lambda: len(loader.ledger) if self.whole else None)
        listen(loader, self)

    def reading(self) -> None:
        self.draws.reading()

    def handing(self, position: int) -> None:
        if self.whole:
            self.steps.before(position)
        self.draws.handing()

    def after_batch(self) -> None:
        self.steps.before()
        self.draws.after_batch()

    def stop(self) -> None:
        listen(self.loader, None)


def global_train_loss(stage_loss: Any, step: int) -> Any:
    """The TRAIN loss SpeechBrain's loop hands ``on_stage_end``, averaged over every
    rank's batches (collective; sums and counts, not averages): a number, or each
    entry of a dict of them (a recipe's own ``update_average``). Ranks whose dicts
    hold other keys raise the same error on every rank, before any reduction.

    Example
    -------
    >>> global_train_loss(1.5, step=4), global_train_loss({"mse": 0.5, "total": 2.0}, step=3)  # one process
    (1.5, {'mse': 0.5, 'total': 2.0})
    """
    if dist.get_world_size() == 1:
        return stage_loss

    def local():  # the keys, values and count, read here: a failure to read them is raised on every rank
        keys = sorted(stage_loss) if isinstance(stage_loss, dict) else None
        return keys, [float(stage_loss[k]) for k in keys] if keys is not None else [float(stage_loss)], step

    per_rank = dist.decide("TRAIN stage end", local)  # every rank's sums and counts, in rank order on every rank
    keys = per_rank[dist.get_rank()][0]
    if any(rank_keys != keys for rank_keys, _, _ in per_rank):
        raise ConfigError("ddp_eval: the TRAIN stage loss is a dict whose keys differ across ranks (" + "; ".join(
            f"rank {rank}: {rank_keys}" for rank, (rank_keys, _, _) in enumerate(per_rank)) + "), so it cannot be "
            "averaged over them. Expected the same keys on every rank: give every batch's loss dict the same keys.")
    count = sum(steps for _, _, steps in per_rank)
    if not count:
        return stage_loss
    averages = [sum(values[i] * steps for _, values, steps in per_rank) / count for i in range(len(per_rank[0][1]))]
    return dict(zip(keys, averages)) if keys is not None else averages[0]
