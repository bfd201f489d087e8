"""Resuming an interrupted sharded stage from its journal (:mod:`ddp_eval.journal`).

:meth:`StageResume.open` runs on every rank at the start of a sharded stage:
rank 0 reads the journals, keeps the pieces that match this stage, data,
layout and model, and every rank learns which batches they hold, so the
sampler deals only the others. :meth:`StageResume.after_batch` writes this
rank's piece when the interval has passed. At stage end, rank 0 adds the old
pieces to the merge (:meth:`StageResume.old_states`, :meth:`StageResume.old_loss`),
and :meth:`StageResume.close` removes the journal once ``on_stage_end`` has
finished on every rank.

Example
-------
>>> compress([0, 1, 2, 5, 7, 8]), expand(compress([0, 1, 2, 5, 7, 8]))
([(0, 3), (5, 6), (7, 9)], [0, 1, 2, 5, 7, 8])
"""

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ddp_eval import dist
from ddp_eval.commit import TMP_PREFIX
from ddp_eval.journal import (
    JournalKey,
    StageJournal,
    batches_fingerprint,
    find_resumable,
    layout_fingerprint,
    model_fingerprint,
    remove_pieces,
)
from ddp_eval.metrics import describe_objects
from ddp_eval.sharding import ShardedBatchSampler, ShardedStreamLoader, global_batch_ids

logger = logging.getLogger(__name__)


def compress(positions: Sequence[int]) -> List[Tuple[int, int]]:
    """Sorted positions as half-open ranges (what travels in the exchange)."""
    ranges: List[Tuple[int, int]] = []
    for p in sorted(positions):
        if ranges and ranges[-1][1] == p:
            ranges[-1] = (ranges[-1][0], p + 1)
        else:
            ranges.append((p, p + 1))
    return ranges


def expand(ranges: Sequence[Tuple[int, int]]) -> List[int]:
    """The positions of :func:`compress`'s ranges."""
    return [p for a, b in ranges for p in range(a, b)]


def _model_modules(brain: Any) -> List[torch.nn.Module]:
    """The Brain's modules and the modules among its hparams (e.g. a language model)."""
    modules = list(brain.modules.values()) if getattr(brain, "modules", None) is not None else []
    hparams = vars(brain.hparams) if getattr(brain, "hparams", None) is not None else {}
    return modules + [v for _, v in sorted(hparams.items()) if isinstance(v, torch.nn.Module)]


def _data_key(loader: Any) -> Tuple[str, Optional[int]]:
    if isinstance(loader, ShardedStreamLoader):
        return "stream", None
    sampler: ShardedBatchSampler = loader.batch_sampler
    return batches_fingerprint(sampler.batch_sampler, getattr(loader.dataset, "data_ids", None))


class StageResume:
    """The journal of one sharded stage on this rank, and what it resumed."""

    def __init__(self, journal: StageJournal, done: Sequence[int], old: List[Tuple[Any, dict]]) -> None:
        self.journal = journal
        self.done = list(done)
        self.old = old  # rank 0: (path, piece) of the journal it resumes
        self.model: Optional[str] = None  # this stage's model fingerprint, once computed
        self.journaled_batches = 0  # this rank's batches already in a piece
        self.journaled_loss = (0.0, 0)
        self.failed = False

    @classmethod
    def open(cls, brain: Any, stage: Any, epoch: Optional[int], run: Any, root, every_s: float) -> "StageResume":
        """Collective, at stage start: decide what is done and tell the loader."""
        plan, error, old = None, None, []
        if dist.get_rank() == 0:
            try:
                data, batches = _data_key(run.loader)
                # Metric objects and the paths listed: what every run of the stage has (Brain
                # attributes left by earlier stages differ, e.g. none after a restart skipped fit).
                listed = [label for label in run.attributes.tracks if "." in label]
                layout = layout_fingerprint(describe_objects(run.metrics.objects), listed)
                key = JournalKey(stage.name, epoch, data, batches, layout)
                checkpoint = getattr(getattr(brain, "checkpointer", None), "loaded", None)
                old, notes = find_resumable(root, key, lambda: model_fingerprint(_model_modules(brain)),
                                            checkpoint)
                for note in notes:
                    logger.warning(note)
                done = sorted(p for _, piece in old for p in piece["positions"])
                digests = {p: d for _, piece in old for p, d in piece["batch_digests"].items()}
                plan = (key, compress(done), digests if batches is None else {})
            except Exception as exc:  # reported on every rank
                error = exc
        key, done_ranges, digests = dist.exchange(f"{stage.name} journal", plan, error=error)[0]
        done = expand(done_ranges)
        if isinstance(run.loader, ShardedStreamLoader):
            run.loader.skip(done, digests)
        else:
            run.loader.batch_sampler.skip(done)
        if done and dist.get_rank() == 0:
            total = key.batches if key.batches is not None else "?"
            logger.info(f"ddp_eval: resuming {stage.name} from its journal: {len(done)} of {total} batches done "
                        f"(from {len(old)} piece(s)); evaluating the others.")
        return cls(StageJournal(root, key, dist.get_rank(), every_s), done, old)

    def after_batch(self, brain: Any, run: Any) -> None:
        """Writes this rank's piece of the batches since the previous one, if due.

        A piece that cannot be written (disk full, permissions) is warned about
        once; this rank then stops journaling for the stage: the evaluation goes on,
        and its later batches would be evaluated again after an interruption.
        """
        if self.failed or not self.journal.due():
            return
        try:
            self._write(brain, run)
        except OSError as exc:
            self.failed = True
            logger.warning(f"ddp_eval: rank {dist.get_rank()} could not write its evaluation journal in "
                           f"{self.journal.folder} ({type(exc).__name__}: {exc}); it stops journaling this "
                           "stage, whose results are unaffected. Check resume_eval_dir.")

    def _write(self, brain: Any, run: Any) -> None:
        if self.model is None:
            self.model = model_fingerprint(_model_modules(brain))
        positions = global_batch_ids(run.loader)
        covered = positions[self.journaled_batches: run.metrics.batches]
        digests = getattr(run.loader, "digests", {})
        loss = (run.loss_sum - self.journaled_loss[0], run.loss_count - self.journaled_loss[1])
        checkpoint = getattr(getattr(brain, "checkpointer", None), "loaded", None)
        self.journal.write(self.model, covered, loss, run.metrics.piece(positions), run.attributes.piece(positions),
                           {p: digests.get(p) for p in covered}, checkpoint)
        self.journaled_batches = run.metrics.batches
        self.journaled_loss = (run.loss_sum, run.loss_count)

    def old_states(self) -> List[Tuple[Any, Any]]:
        """``(metric state, attribute state)`` of each resumed piece (rank 0; else empty)."""
        return [(piece["metrics"], piece["attributes"]) for _, piece in self.old]

    def old_loss(self) -> Tuple[float, int]:
        """Loss sum and count of the resumed pieces (rank 0; else zero)."""
        return (sum(piece["loss"][0] for _, piece in self.old), sum(piece["loss"][1] for _, piece in self.old))

    def close(self) -> None:
        """After on_stage_end on every rank: each rank removes its pieces, rank 0 the
        resumed ones and the leftovers of writes a crash cut short."""
        leftovers = list(self.journal.folder.glob(f"{TMP_PREFIX}*")) if dist.get_rank() == 0 else []
        remove_pieces(list(self.journal.written) + [path for path, _ in self.old] + leftovers)

    def describe(self) -> Dict[str, Any]:
        return {"done": len(self.done), "old_pieces": len(self.old), "written": len(self.journal.written)}
