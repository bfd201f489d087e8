"""Resuming an interrupted sharded stage from its journal (:mod:`ddp_eval.stage._journal`).

:meth:`StageResume.propose` runs on rank 0 at the start of a sharded stage:
it reads the journals and keeps the pieces that match this stage, data (the
stage's batch plan), layout and model; the stage-start exchange takes its
answer to every rank, where :meth:`StageResume.accept` tells the sampler to
deal only the batches not done. :meth:`StageResume.after_batch` writes this
rank's piece when the interval has passed. At stage end, rank 0 adds the old
pieces to the merge (:meth:`StageResume.old_states`, :meth:`StageResume.old_losses`),
and :meth:`StageResume.close` removes the journal once ``on_stage_end`` has
finished on every rank.

Example
-------
>>> compress([0, 1, 2, 5, 7, 8]), expand(compress([0, 1, 2, 5, 7, 8]))
([(0, 3), (5, 6), (7, 9)], [0, 1, 2, 5, 7, 8])
"""

import logging
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

from ddp_eval import distributed as dist
from ddp_eval.checkpointing.commit import TMP_PREFIX
from ddp_eval.stage._effects import StageOutputs
from ddp_eval.stage._journal import JournalKey, StageJournal, find_resumable, layout_fingerprint, remove_pieces
from ddp_eval.stage._model import fingerprint_share, model_fingerprint, model_modules, model_tensors, tensor_crc
from ddp_eval.stage.sharding import global_batch_ids, is_stream
from ddp_eval.state import AttributeTracker
from ddp_eval.state.bookkeeping import StageBook
from ddp_eval.state.metrics import MetricRecorder, describe_objects

logger = logging.getLogger(__name__)


class StageRecord(Protocol):
    """What a resume reads of the stage that drives it (:class:`ddp_eval.stage._sharded.ShardedStage`)."""

    stage: Any  # sb.Stage
    epoch: Optional[int]
    loader: Any  # the sharded loader
    metrics: MetricRecorder
    attributes: AttributeTracker
    outputs: StageOutputs
    losses: List[Optional[float]]
    book: StageBook


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


def model_of(brain: Any) -> list:
    """The model's tensors in fingerprint order (:func:`ddp_eval.stage._model.model_tensors`),
    listed once per stage start for :meth:`StageResume.share`, ``propose`` and ``accept``."""
    return model_tensors([module for _, module in model_modules(brain)])


def _data_key(loader: Any) -> Tuple[str, Optional[int]]:
    """``(digest, number of batches)`` of this stage's batch plan (a stream: checked per batch)."""
    if is_stream(loader):
        return "stream", None
    count, digest = loader.batch_sampler.plan.ledger.summary()
    return digest, count


class StageResume:
    """The journal of one sharded stage on this rank, and what it resumed."""

    def __init__(self, journal: StageJournal, done: Sequence[int], old: List[Tuple[Any, dict]], model: str) -> None:
        self.journal = journal
        self.done = list(done)
        self.old = old  # rank 0: (path, piece) of the journal it resumes
        self.model = model  # this stage's model fingerprint, taken together at stage start
        self.journaled_batches = 0  # this rank's batches already in a piece
        self.failed = False

    @staticmethod
    def share(tensors: list, crcs: Dict[int, int]) -> Dict[int, int]:
        """On every rank at stage start: ``{position: crc32}`` of this rank's share of
        the model fingerprint of ``tensors`` (:func:`model_of`; ``crcs``: what
        :func:`~ddp_eval.stage._model.module_states` already read, by tensor id), for
        the stage-start exchange."""
        return {i: crcs[id(tensors[i][1])] if id(tensors[i][1]) in crcs else tensor_crc(tensors[i][1])
                for i in fingerprint_share(tensors, dist.get_rank(), dist.get_world_size())}

    @staticmethod
    def propose(brain: Any, stage: StageRecord, root, tensors: list,
                crcs: Dict[int, int]) -> Tuple[Any, list, dict, list]:
        """On rank 0 at stage start: ``(key, done ranges, stream digests, pieces)``
        of the journal this stage resumes; the first three travel to every rank."""
        data, batches = _data_key(stage.loader)
        # Metric objects and the paths listed: what every run of the stage has (Brain
        # attributes left by earlier stages differ, e.g. none after a restart skipped fit).
        listed = [label for label in stage.attributes.tracks if "." in label]
        layout = layout_fingerprint(describe_objects(stage.metrics.objects), listed)
        key = JournalKey(stage.stage.name, stage.epoch, data, batches, layout)
        checkpoint = getattr(getattr(brain, "checkpointer", None), "loaded", None)
        # the whole fingerprint, read here only if there are pieces to check
        old, notes = find_resumable(root, key, lambda: model_fingerprint(
            tensors, {i: crcs[id(t)] for i, (_, t, _) in enumerate(tensors) if id(t) in crcs}), checkpoint)
        for note in notes:
            logger.warning(note)
        done = sorted(p for _, piece in old for p in piece["positions"])
        digests = {p: d for _, piece in old for p, d in piece["batch_digests"].items()}
        return key, compress(done), digests if batches is None else {}, old

    @classmethod
    def accept(cls, proposal: Tuple[Any, list, dict], old: list, tensors: list, shares: Sequence[Dict[int, int]],
               stage: StageRecord, root, every_s: float) -> "StageResume":
        """On every rank, with rank 0's :meth:`propose` and every rank's :meth:`share`:
        tells the loader what is done, and takes the model fingerprint."""
        key, done_ranges, digests = proposal
        done = expand(done_ranges)
        if is_stream(stage.loader):
            stage.loader.skip(done, digests)
        else:
            stage.loader.batch_sampler.skip(done)
        if done and dist.get_rank() == 0:
            total = key.batches if key.batches is not None else "?"
            logger.info(f"ddp_eval: resuming {stage.stage.name} from its journal: {len(done)} of {total} batches done "
                        f"(from {len(old)} piece(s)); evaluating the others.")
        model = model_fingerprint(tensors, {i: crc for share in shares for i, crc in share.items()})
        return cls(StageJournal(root, key, dist.get_rank(), every_s), done, old, model)

    def after_batch(self, brain: Any, stage: StageRecord) -> None:
        """Writes this rank's piece of the batches since the previous one, if due.

        A piece that cannot be written (disk full, permissions) is warned about
        once; this rank then stops journaling for the stage: the evaluation goes on,
        and its later batches would be evaluated again after an interruption.
        """
        if self.failed or not self.journal.due():
            return
        try:
            self._write(brain, stage)
        except Exception as exc:  # a full disk, or a bound object that cannot be pickled
            self.failed = True
            logger.warning(f"ddp_eval: rank {dist.get_rank()} could not write its evaluation journal in "
                           f"{self.journal.folder} ({type(exc).__name__}: {exc}); it stops journaling this "
                           "stage, whose results are unaffected. Check resume_eval_dir.")

    def _write(self, brain: Any, stage: StageRecord) -> None:
        positions = global_batch_ids(stage.loader)
        covered = positions[self.journaled_batches: stage.metrics.batches]
        digests = getattr(stage.loader, "digests", {})
        loss = list(zip(covered, stage.losses[self.journaled_batches: stage.metrics.batches]))
        checkpoint = getattr(getattr(brain, "checkpointer", None), "loaded", None)
        self.journal.write(self.model, covered, loss, stage.metrics.piece(positions),
                           stage.attributes.piece(positions), {p: digests.get(p) for p in covered}, checkpoint,
                           stage.outputs.state(positions, self.journaled_batches), stage.book.notes())
        self.journaled_batches = stage.metrics.batches

    def old_states(self) -> List[Tuple[Any, Any, Any]]:
        """``(metric state, attribute changes, per-batch files)`` of each resumed
        piece (rank 0; else empty)."""
        return [(piece["metrics"], piece["attributes"], piece["outputs"]) for _, piece in self.old]

    def old_notes(self) -> List[Dict[str, Any]]:
        """What each resumed piece's batches did that no merge replays (rank 0; else none)."""
        return [piece["notes"] for _, piece in self.old]

    def old_losses(self) -> List[Tuple[int, Optional[float]]]:
        """``(position, loss)`` of the resumed pieces' batches (rank 0; else none)."""
        return [tuple(pair) for _, piece in self.old for pair in piece["loss"]]

    def close(self) -> None:
        """After on_stage_end on every rank: each rank removes its pieces, rank 0 the
        resumed ones and the leftovers of writes a crash cut short."""
        leftovers = list(self.journal.folder.glob(f"{TMP_PREFIX}*")) if dist.get_rank() == 0 else []
        remove_pieces(list(self.journal.written) + [path for path, _ in self.old] + leftovers)

    def describe(self) -> Dict[str, Any]:
        return {"done": len(self.done), "old_pieces": len(self.old), "written": len(self.journal.written)}
