"""``ddp_eval.Checkpointer``: SpeechBrain's Checkpointer, atomic, safe under DDP,
and non-blocking on request.

Only the writing rank touches the disk (global rank 0, or local rank 0 of each
node with ``storage="node_local"``); every call is bracketed by bounded
synchronisation points, and a failure on the writer is raised on every rank.
How a checkpoint reaches the disk atomically is :mod:`ddp_eval.commit`.

With ``async_save=True`` a save returns as soon as the writer holds an
in-memory snapshot of every recoverable (:mod:`ddp_eval.async_save`); one
background thread writes, commits, then deletes what ``save_and_keep_only``
drops. The next checkpointer call waits for it first, and raises its failure
on every rank.

Example
-------
>>> import torch
>>> tmpdir = getfixture("tmpdir")
>>> model = torch.nn.Linear(2, 2)
>>> ckpter = Checkpointer(tmpdir, recoverables={"model": model})
>>> ckpt = ckpter.save_checkpoint(meta={"loss": 1.0})
>>> ckpter.find_checkpoint(min_key="loss").path == ckpt.path
True
"""

import contextlib
import logging
import pathlib
import sys
import time
from typing import Any, Iterator, List, Mapping, Optional, Tuple

import torch
from speechbrain.utils import checkpoints as sb_ckpt
from speechbrain.utils.distributed import MainProcessContext, main_process_only

from ddp_eval import dist
from ddp_eval.async_save import BackgroundSaves
from ddp_eval.commit import UNSUPPORTED_STORAGE_ACTIONS, CheckpointFolder, inspect_checkpoint_dir
from ddp_eval.config import check_choice
from ddp_eval.errors import CheckpointLoadError, CheckpointWriteError, ConfigError

logger = logging.getLogger(__name__)

STORAGE_MODES = ("shared", "node_local")
_MAIN_ONLY_CODE = main_process_only(lambda: None).__code__
# SpeechBrain's default savers of modules, optimizers, schedulers and scalers:
# torch.save(obj.state_dict()). Those recoverables can be snapshotted in memory.
_STATE_DICT_SAVERS = tuple(h for h in (sb_ckpt.torch_save, getattr(sb_ckpt, "torch_save_once_per_node", None)) if h)


_writer_only_depth = 0  # > 0 inside writer_only_saves()


@contextlib.contextmanager
def writer_only_saves() -> Iterator[None]:
    """In this block, saves and deletions of shared-storage Checkpointers run on
    the writer alone, without synchronisation points of their own; elsewhere
    each call synchronises every rank.

    For a block every rank enters after one collective and leaves into another,
    which report a failure raised in it to every rank: the mixin opens it around
    ``on_stage_end``. Recipes may then save there under ``if if_main_process():``,
    as SpeechBrain's transformer recipes do, or on every rank.

    Example
    -------
    >>> ckpter = Checkpointer(getfixture("tmpdir"), {"model": torch.nn.Linear(2, 2)})
    >>> with writer_only_saves():
    ...     ckpt = ckpter.save_checkpoint()  # one process: the writer
    >>> ckpt.path.exists()
    True
    """
    global _writer_only_depth
    _writer_only_depth += 1
    try:
        yield
    finally:
        _writer_only_depth -= 1


class Checkpointer(sb_ckpt.Checkpointer):
    """Drop-in replacement of SpeechBrain's Checkpointer, atomic and DDP-safe.

    Same constructor and methods as :class:`speechbrain.utils.checkpoints.Checkpointer`
    (usable as ``!new:ddp_eval.Checkpointer``), plus keyword options:

    Arguments
    ---------
    checkpoints_dir, recoverables, custom_load_hooks, custom_save_hooks, allow_partial_load
        As in SpeechBrain.
    storage : str
        ``"shared"`` (one filesystem for all nodes; global rank 0 writes) or
        ``"node_local"`` (each node its own disk; local rank 0 of every node
        writes a full copy, and every node resumes from its own).
    fsync : bool
        fsync files and directories before the commit (default True). Off:
        faster, but a power loss (not a process crash) may lose the newest one.
    checksums : bool
        Also record and verify sha256 of every file (default False: sizes only).
    on_unsupported_storage : str
        What to do if the directory lacks atomic rename or fsync: ``"error"``
        (default: fail at the first save with a clear message on every rank) or
        ``"fallback"`` (warn, and write in place with the meta file last; a
        crash can then leave an incomplete checkpoint, which resume skips).
    timeout : float, optional
        Seconds to wait at each synchronisation point and for a background
        save (default: the ``collective_timeout`` of ddp_eval).
    async_save : bool
        Return from a save once the writer holds an in-memory snapshot (one
        copy of the state in CPU memory, pinned with CUDA, kept and refilled
        from one save to the next); the write, fsync, commit and deletions run
        in a background thread (default False).
        Recoverables with their own savers (``mark_as_saver``, custom save
        hooks) are written during the call. At most one save is in flight:
        every later save, delete, find or recover, and :meth:`wait`, waits for
        it and raises its failure on every rank.
    """

    def __init__(
        self,
        checkpoints_dir,
        recoverables=None,
        custom_load_hooks=None,
        custom_save_hooks=None,
        allow_partial_load=False,
        storage: str = "shared",
        fsync: bool = True,
        checksums: bool = False,
        on_unsupported_storage: str = "error",
        timeout: Optional[float] = None,
        async_save: bool = False,
    ) -> None:
        super().__init__(
            checkpoints_dir, recoverables, custom_load_hooks, custom_save_hooks, allow_partial_load
        )
        self.storage = check_choice("storage", storage, STORAGE_MODES)
        check_choice("on_unsupported_storage", on_unsupported_storage, UNSUPPORTED_STORAGE_ACTIONS)
        if not isinstance(async_save, bool):
            raise ConfigError(f"ddp_eval: option 'async_save' expects true or false, got "
                              f"{type(async_save).__name__} {async_save!r}")
        self.folder = CheckpointFolder(self.checkpoints_dir, bool(fsync), bool(checksums), on_unsupported_storage)
        self.timeout = timeout
        self.async_save = async_save
        self._background = BackgroundSaves()  # async_save, on the writer
        self._keep_only: Optional[dict] = None  # deletions of the save_and_keep_only under way
        self.loaded: Optional[str] = None  # name of the checkpoint loaded last
        self._warned = set()

    # Options of the commit protocol, settable as before.
    fsync = property(lambda self: self.folder.fsync, lambda self, v: setattr(self.folder, "fsync", v))
    checksums = property(lambda self: self.folder.checksums, lambda self, v: setattr(self.folder, "checksums", v))
    on_unsupported_storage = property(lambda self: self.folder.on_unsupported_storage,
                                      lambda self, v: setattr(self.folder, "on_unsupported_storage", v))

    # -- writing -------------------------------------------------------------

    def save_checkpoint(
        self, meta: Mapping[str, Any] = {}, end_of_epoch: bool = True,
        name: Optional[str] = None, verbosity: int = logging.INFO,
    ) -> sb_ckpt.Checkpoint:
        """Saves a checkpoint atomically; returns the same Checkpoint on every rank.

        Call it on every rank (no ``if_main_process()`` guard needed). In the
        ``on_stage_end`` of a :class:`~ddp_eval.DDPEvalMixin` Brain it may also be
        called under ``if if_main_process():``: the stage's synchronisation points
        bracket the write, and ranks other than the writer get None, as from
        SpeechBrain's Checkpointer. With ``async_save`` it returns once the state
        is snapshotted; the returned meta then lacks the file manifest, which the
        commit adds.
        """
        return self._save(meta, end_of_epoch, name, verbosity, keep_only=self._keep_only)

    def save_and_keep_only(
        self, meta={}, end_of_epoch=True, name=None, num_to_keep=1, keep_recent=True,
        importance_keys=[], max_keys=[], min_keys=[], ckpt_predicate=None, verbosity=logging.INFO,
    ) -> None:
        """Saves, then deletes the least important checkpoints (as SpeechBrain).

        Why override: SpeechBrain appends to its mutable default
        ``importance_keys`` on every call, so deletion slows down run after run;
        and with ``async_save`` the deletions wait for the commit, in the background.
        """
        keys = list(importance_keys) + ([sb_ckpt.ckpt_recency] if keep_recent else [])
        keep_only = dict(num_to_keep=num_to_keep, max_keys=max_keys, min_keys=min_keys,
                         importance_keys=keys, ckpt_predicate=ckpt_predicate, verbosity=verbosity)
        # Through save_checkpoint, as SpeechBrain does (subclasses and wrappers see the call).
        self._keep_only = keep_only if self.async_save else None
        try:
            self.save_checkpoint(meta=meta, end_of_epoch=end_of_epoch, name=name, verbosity=verbosity)
        finally:
            self._keep_only = None
        if not self.async_save:
            self.delete_checkpoints(**keep_only)

    def _save(self, meta, end_of_epoch, name, verbosity, keep_only) -> Optional[sb_ckpt.Checkpoint]:
        if self._writer_alone():
            return self._save_on_writer_alone(meta, end_of_epoch, name, verbosity, keep_only)
        plan, error = None, self._take_failure()
        if dist.get_rank() == 0 and error is None:
            try:
                plan = self._plan(meta, end_of_epoch, name)
            except Exception as exc:  # e.g. an unreadable directory: reported on every rank
                error = exc
        dirname, full_meta = dist.exchange(
            "checkpoint save: begin", plan, error=error, timeout=self.timeout)[0]
        error = None
        if self._is_writer():
            try:
                full_meta = self._write(dirname, full_meta, end_of_epoch, keep_only, verbosity)
            except CheckpointWriteError as exc:
                error = exc
        written = dist.exchange("checkpoint save: end", full_meta, error=error, timeout=self.timeout)
        return self._checkpoint(dirname, written[0])

    def _save_on_writer_alone(self, meta, end_of_epoch, name, verbosity, keep_only) -> Optional[sb_ckpt.Checkpoint]:
        """A save inside :func:`writer_only_saves`: the writer saves, the others
        return None (as off SpeechBrain's main process); a failure is raised here,
        on the writer, and the block's caller reports it to every rank."""
        if not self._is_writer():
            return None
        failure = self._take_failure()
        if failure is not None:
            raise failure
        dirname, full_meta = self._plan(meta, end_of_epoch, name)
        return self._checkpoint(dirname, self._write(dirname, full_meta, end_of_epoch, keep_only, verbosity))

    def _plan(self, meta, end_of_epoch, name) -> Tuple[str, dict]:
        """``(directory name, meta)`` of a new checkpoint (chosen on rank 0)."""
        path = self._custom_checkpoint_dirpath(name) if name else self._new_checkpoint_dirpath()
        return path.name, {"unixtime": time.time(), "end-of-epoch": end_of_epoch, **meta}

    def _write(self, dirname, meta, end_of_epoch, keep_only, verbosity) -> dict:
        """On the writer: writes and commits (or starts that in the background); the
        meta written. Any failure is a CheckpointWriteError naming the checkpoint."""
        path, kind = self.checkpoints_dir / dirname, "end-of-epoch" if end_of_epoch else "intra-epoch"
        try:
            if self.async_save:
                self._start_background_save(dirname, meta, keep_only, f"an {kind}", verbosity)
                return meta
            meta = self.folder.write(dirname, meta, self._run_save_hooks)
        except BaseException as exc:
            error = CheckpointWriteError(
                f"ddp_eval: rank {dist.get_rank()} could not write checkpoint {path}: "
                f"{type(exc).__name__}: {exc}. The previous checkpoints are intact."
            )
            raise error from exc
        logger.log(verbosity, f"Saved an {kind} checkpoint in {path}")
        return meta

    def _checkpoint(self, dirname: str, meta: dict) -> sb_ckpt.Checkpoint:
        path = self.checkpoints_dir / dirname
        return sb_ckpt.Checkpoint(path, meta, {n: path / f"{n}{sb_ckpt.PARAMFILE_EXT}" for n in self.recoverables})

    def _writer_alone(self) -> bool:
        """Inside :func:`writer_only_saves`, with one shared copy: saves and
        deletions need no synchronisation of their own."""
        return _writer_only_depth > 0 and self.storage == "shared"

    def _save_hook(self, name: str, obj: Any):
        hook = self.custom_save_hooks.get(name) or sb_ckpt.get_default_hook(obj, sb_ckpt.DEFAULT_SAVE_HOOKS)
        if hook is None:
            raise RuntimeError(
                f"Don't know how to save {type(obj)}. Register default hook or add custom hook for this object."
            )
        return hook

    def _run_save_hooks(self, directory: pathlib.Path, names=None) -> None:
        # The writer runs every hook itself: SpeechBrain's main_process_only
        # wrappers are bypassed (a node-local writer is not global rank 0) and
        # nested SpeechBrain collectives are disabled by MainProcessContext.
        with MainProcessContext():
            for name, obj in self.recoverables.items():
                if names is not None and name not in names:
                    continue
                hook = self._save_hook(name, obj)
                if getattr(hook, "__code__", None) is _MAIN_ONLY_CODE:
                    hook = hook.__wrapped__
                hook(obj, directory / f"{name}{sb_ckpt.PARAMFILE_EXT}")

    def _start_background_save(self, dirname, meta, keep_only, kind, verbosity) -> None:
        """Writes own-saver recoverables now and snapshots the others; the rest
        (write, commit, deletions) goes to the background thread."""
        by_state_dict = [n for n, obj in self.recoverables.items()
                         if self._save_hook(n, obj) in _STATE_DICT_SAVERS]
        work, path = self.folder.begin(dirname), self.checkpoints_dir / dirname

        def write(snapshots):
            try:
                for name, state in snapshots.items():
                    torch.save(state, work / f"{name}{sb_ckpt.PARAMFILE_EXT}")
                snapshots.clear()  # free the copy before the commit's fsyncs
                self.folder.commit(work, dirname, meta)
            except BaseException:
                self.folder.abort(work)
                raise
            logger.log(verbosity, f"Saved {kind} checkpoint in {path} (in the background)")
            if keep_only is not None:
                self._delete_selected(**keep_only)

        try:
            self._run_save_hooks(work, [n for n in self.recoverables if n not in by_state_dict])
            states = {n: self.recoverables[n].state_dict() for n in by_state_dict}
            self._background.start(str(path), states, write, self._wait_timeout())
        except BaseException:
            self.folder.abort(work)
            raise

    def _wait_timeout(self) -> float:
        return dist.get_timeout() if self.timeout is None else self.timeout

    def _take_failure(self) -> Optional[BaseException]:
        """Waits for the save in flight (writer); returns its failure once, as an error."""
        failure = self._background.take_failure(self._wait_timeout())
        if failure is None:
            return None
        error = CheckpointWriteError(f"ddp_eval: rank {dist.get_rank()}: {failure}")
        error.__cause__ = failure.__cause__
        return error

    def wait(self) -> None:
        """Blocks until every started save is committed (and its deletions done).

        Call it on every rank. A background failure is raised on every rank,
        naming the checkpoint and the cause. Without ``async_save``: a
        synchronisation point only.
        """
        dist.exchange("checkpoint wait", error=self._take_failure(), timeout=self.timeout)

    def delete_checkpoints(
        self, *, num_to_keep=1, min_keys=None, max_keys=None,
        importance_keys=[sb_ckpt.ckpt_recency], ckpt_predicate=None, verbosity=logging.INFO,
    ) -> None:
        """Deletes the least important checkpoints, on the writer only (as SpeechBrain).

        Each deleted directory is renamed away first, so it disappears atomically.
        """
        if num_to_keep < 0:
            raise ValueError("Number of checkpoints to keep must be positive.")
        selection = (num_to_keep, min_keys, max_keys, importance_keys, ckpt_predicate, verbosity)
        if self._writer_alone():  # the caller of writer_only_saves reports a failure
            if self._is_writer():
                failure = self._take_failure() or self._delete_on_writer(*selection)
                if failure is not None:
                    raise failure
            return
        dist.exchange("delete checkpoints: begin", error=self._take_failure(), timeout=self.timeout)
        error = self._delete_on_writer(*selection) if self._is_writer() else None
        dist.exchange("delete checkpoints: end", error=error, timeout=self.timeout)

    def _delete_on_writer(self, *selection) -> Optional[CheckpointWriteError]:
        try:
            self._delete_selected(*selection)
        except BaseException as exc:
            error = CheckpointWriteError(
                f"ddp_eval: rank {dist.get_rank()} could not delete old checkpoints "
                f"in {self.checkpoints_dir}: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            return error
        return None

    def _delete_selected(self, num_to_keep, min_keys, max_keys, importance_keys, ckpt_predicate,
                         verbosity) -> None:
        # Selection tracks speechbrain 1.1 Checkpointer.delete_checkpoints.
        keys = [{"min_key": k} for k in min_keys or []]
        keys += [{"max_key": k} for k in max_keys or []]
        keys += [{"importance_key": k} for k in importance_keys]
        candidates, protected = set(), set()
        for kwargs in keys:
            found = self._find_local(ckpt_predicate=ckpt_predicate, **kwargs)
            candidates.update(found)
            protected.update(found[:num_to_keep])
        for ckpt in sorted(candidates - protected, key=lambda c: c.path.name):
            self.folder.remove(ckpt.path)
            logger.log(verbosity, f"Deleted checkpoint in {ckpt.path}")

    def _is_writer(self) -> bool:
        rank = dist.get_local_rank() if self.storage == "node_local" else dist.get_rank()
        return rank == 0

    # -- reading -------------------------------------------------------------

    def list_checkpoints(self) -> List[sb_ckpt.Checkpoint]:
        """Lists complete checkpoints only; skipped ones are named in a warning.

        A save still being written in the background is not listed until committed.
        """
        found = []
        for ckpt_dir in self._list_checkpoint_dirs():
            problem, meta = inspect_checkpoint_dir(ckpt_dir, self.checksums, self._required())
            if problem:
                if ckpt_dir not in self._warned:
                    self._warned.add(ckpt_dir)
                    logger.warning(f"ddp_eval: skipping incomplete checkpoint {ckpt_dir}: {problem}")
                continue
            found.append(_on_disk(ckpt_dir, meta))
        return found

    def _required(self):
        """Recoverables a checkpoint must hold to be loadable."""
        if self.allow_partial_load:
            return []
        return [n for n in self.recoverables if not self.optional_recoverables.get(n) and "dataloader" not in n]

    def find_checkpoints(
        self, importance_key=None, max_key: Optional[str] = None, min_key: Optional[str] = None,
        ckpt_predicate=None, max_num_checkpoints: Optional[int] = None,
    ) -> List[sb_ckpt.Checkpoint]:
        """Why: rank 0 chooses and broadcasts, so every rank gets the same list
        (e.g. to average checkpoints), never without a save still in flight (it
        is waited for) and never a checkpoint this rank cannot read."""
        names, error = None, self._take_failure()
        if dist.get_rank() == 0 and error is None:
            try:
                found = self._find_local(importance_key, max_key, min_key, ckpt_predicate, max_num_checkpoints)
                names = [ckpt.path.name for ckpt in found]
            except BaseException as exc:
                error = exc
        names = dist.exchange("find checkpoints", names, error=error, timeout=self.timeout)[0]
        found, problems = [], []
        for name in names:
            path = self.checkpoints_dir / name
            problem, meta = inspect_checkpoint_dir(path, self.checksums, self._required())
            if problem:
                problems.append(f"{path}: {problem}")
                continue
            found.append(_on_disk(path, meta))
        error = None if not problems else CheckpointWriteError(
            f"ddp_eval: rank {dist.get_rank()} has no complete copy of the chosen checkpoint(s) "
            f"{'; '.join(problems)}. With storage: node_local every node must hold the copy its "
            "local rank 0 wrote; with shared, every rank must see the same directory."
        )
        dist.exchange("find checkpoints: local copies", error=error, timeout=self.timeout)
        return found

    def find_checkpoint(
        self, importance_key=None, max_key: Optional[str] = None, min_key: Optional[str] = None,
        ckpt_predicate=None,
    ) -> Optional[sb_ckpt.Checkpoint]:
        """The most important checkpoint: the first of :meth:`find_checkpoints`,
        the same on every rank."""
        found = self.find_checkpoints(importance_key, max_key, min_key, ckpt_predicate, max_num_checkpoints=1)
        return found[0] if found else None

    def _find_local(self, importance_key=None, max_key=None, min_key=None, ckpt_predicate=None,
                    max_num_checkpoints=None) -> List[sb_ckpt.Checkpoint]:
        """SpeechBrain's selection among what this process sees (no synchronisation)."""
        return sb_ckpt.Checkpointer.find_checkpoints(
            self, importance_key, max_key, min_key, ckpt_predicate, max_num_checkpoints)

    def load_checkpoint(self, checkpoint: sb_ckpt.Checkpoint) -> None:
        """Why: a load that fails on one rank is raised on every rank, naming the
        checkpoint and the file."""
        error = None
        try:
            super().load_checkpoint(checkpoint)
            self.loaded = checkpoint.path.name  # named in evaluation journals
        except Exception as exc:
            name, file = _loading(sys.exc_info()[2])
            what = f"recoverable '{name}' from {file}" if file else f"checkpoint {checkpoint.path}"
            error = CheckpointLoadError(
                f"ddp_eval: rank {dist.get_rank()} could not load {what} (checkpoint "
                f"{checkpoint.path}): {type(exc).__name__}: {exc}. Expected a file that its "
                "recoverable's load hook accepts; move the checkpoint away to resume from the "
                "previous one, or fix the recoverable's definition."
            )
            error.__cause__ = exc
        dist.exchange("checkpoint load", error=error, timeout=self.timeout)

    def recover_if_possible(
        self, importance_key=None, max_key: Optional[str] = None, min_key: Optional[str] = None,
        ckpt_predicate=None,
    ) -> Optional[sb_ckpt.Checkpoint]:
        """Why: the writer first waits for a save in flight, then removes leftovers
        of a crashed run."""
        if self._is_writer():
            # A failed background save is raised on every rank by find_checkpoint, below.
            self._background.failed = self._background.take_failure(self._wait_timeout())
            if self._background.failed is None and self.checkpoints_dir.exists():
                with dist.fail_together("checkpoint directory cleanup"):
                    self.folder.prepare()
        return super().recover_if_possible(importance_key, max_key, min_key, ckpt_predicate)


def _on_disk(path: pathlib.Path, meta: dict) -> sb_ckpt.Checkpoint:
    """The Checkpoint of a complete checkpoint directory, with the files it holds."""
    return sb_ckpt.Checkpoint(path, meta, {f.stem: f for f in path.iterdir() if f.suffix == sb_ckpt.PARAMFILE_EXT})


def _loading(traceback) -> Tuple[Optional[str], Optional[pathlib.Path]]:
    """``(recoverable name, file)`` that SpeechBrain's load loop was at when it failed."""
    found = (None, None)
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code.co_name == "_call_load_hooks" and "loadpath" in frame.f_locals:
            found = (frame.f_locals.get("name"), frame.f_locals["loadpath"])
        traceback = traceback.tb_next
    return found
