"""``Brain.step`` during a sharded stage, as one process counts it.

SpeechBrain's VALID and TEST loops count the stage's batches in ``Brain.step``
(``self.step += 1`` right before each batch); ``evaluate`` leaves the count for
TEST's ``on_stage_end`` (``fit`` sets 0 before VALID's). On a rank they would
count its own batches only, so code that reads ``self.step`` in a batch (``if
self.step <= 5:`` keep a sample) or in TEST's ``on_stage_end`` would see another
number than one process, and nothing would name it.
"""

from typing import Any, Callable, Iterator, Optional, Sequence

from ddp_eval.stage.sharding import global_batch_ids, is_stream


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

    def release(self) -> None:
        """The stage's batches are over (a stream stops telling positions)."""

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


def stage_steps(brain: Any, loader: Any, plan: Any) -> OneProcessSteps:
    """The steps of a sharded stage (its journal's batches already taken out of
    ``loader``): a planned loader's positions are known at stage start; a stream
    read whole tells each as it yields it; one split by dataset has no one-process
    order, and the loop's own count stays."""
    if not is_stream(loader):
        return OneProcessSteps(brain, global_batch_ids(loader), lambda: len(plan))
    whole = loader.split == "batches"
    steps = OneProcessSteps(brain, None, lambda: len(loader.ledger) if whole else None)
    if whole:
        loader.before_yield = steps.before
        steps.release = lambda: setattr(loader, "before_yield", None)
    return steps
