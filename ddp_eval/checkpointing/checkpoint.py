"""``ddp_eval.Checkpointer``: SpeechBrain's Checkpointer, atomic, safe under DDP,
and non-blocking on request.

Only the writing rank touches the disk (global rank 0, or local rank 0 of each
node with ``storage="node_local"``); every call is bracketed by bounded
synchronisation points, and a failure on the writer is raised on every rank.
How a checkpoint reaches the disk atomically is :mod:`ddp_eval.checkpointing.commit`.

With ``async_save=True`` a save returns as soon as the writer holds an
in-memory snapshot of every recoverable (:mod:`ddp_eval.checkpointing._async_save`); one
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
import contextvars
import logging
import os
import pathlib
import sys
import time
from typing import Any, Iterator, List, Mapping, Optional, Tuple

from speechbrain.utils import checkpoints as sb_ckpt

from ddp_eval import distributed as dist
from ddp_eval import sb_compat
from ddp_eval.checkpointing._async_save import BackgroundSaves
from ddp_eval.checkpointing._sharded_saves import ShardedSaves
from ddp_eval.checkpointing.commit import UNSUPPORTED_STORAGE_ACTIONS, CheckpointFolder
from ddp_eval.config import check_choice
from ddp_eval.distributed import dcp, fsdp
from ddp_eval.errors import CheckpointLoadError, CheckpointWriteError, ConfigError

logger = logging.getLogger(__name__)

STORAGE_MODES = ("shared", "node_local")
_writer_only = contextvars.ContextVar("ddp_eval_writer_only_saves", default=False)
_keep_only = contextvars.ContextVar("ddp_eval_keep_only", default=None)  # deletions after an async save
_deferred = contextvars.ContextVar("ddp_eval_deferred_saves", default=None)  # sharded saves in writer_only_saves


@contextlib.contextmanager
def writer_only_saves() -> Iterator[List[tuple]]:
    """In this block, saves and deletions of shared-storage Checkpointers run on
    the writer alone, without synchronisation points of their own; elsewhere
    each call synchronises every rank.

    For a block every rank enters after one collective and leaves into another,
    which report a failure raised in it to every rank: the mixin opens it around
    ``on_stage_end``. Recipes may then save there under ``if if_main_process():``,
    as SpeechBrain's transformer recipes do, or on every rank.

    A checkpoint with sharded recoverables (FSDP) needs every rank: on the
    writer, such a save is planned here (named, its meta fixed) and yielded in
    the list this block gives; the caller runs it on every rank after the block
    (:meth:`Checkpointer.save_planned`).

    Example
    -------
    >>> import torch
    >>> ckpter = Checkpointer(getfixture("tmpdir"), {"model": torch.nn.Linear(2, 2)})
    >>> with writer_only_saves():
    ...     ckpt = ckpter.save_checkpoint()  # one process: the writer
    >>> ckpt.path.exists()
    True
    """
    token, planned = _writer_only.set(True), []
    deferred = _deferred.set(planned)
    try:
        yield planned
    finally:
        _deferred.reset(deferred)
        _writer_only.reset(token)


def share_debug_folder(checkpointer: Any) -> None:
    """Every rank's checkpointer uses rank 0's folder (collective). Exists because
    SpeechBrain's ``--debug`` gives each rank a temporary folder of its own, while a
    sharded (FSDP) save, and a resume that reads what rank 0 saved, need one folder."""
    folder = dist.decide("--debug checkpoint folder", lambda: str(checkpointer.checkpoints_dir))[0]

    def check():
        if not os.path.isdir(folder):
            raise ConfigError(f"ddp_eval: under --debug every rank uses rank 0's temporary checkpoint folder "
                              f"{folder}; expected it on this rank's file system, got no such folder (ranks on "
                              "several nodes). Run with --debug_persistently (checkpoints in the recipe's own "
                              "save folder) or debug on one node.")

    dist.decide("--debug checkpoint folder seen", check)
    if str(checkpointer.checkpoints_dir) != folder:  # this rank's own temporary folder goes unused
        checkpointer.tempdir.cleanup()
        checkpointer.checkpoints_dir = pathlib.Path(folder)


class _Reads(sb_ckpt.Checkpointer):
    """The reads of :class:`Checkpointer`: rank 0 chooses, every rank gets the
    same answer, after a save in flight is committed. Uses the attributes that
    :class:`Checkpointer` sets: ``folder``, ``storage``, ``timeout``, ``_background``."""

    def _is_writer(self) -> bool:
        rank = dist.get_local_rank() if self.storage == "node_local" else dist.get_rank()
        return rank == 0

    def _wait_timeout(self) -> float:
        return dist.get_timeout() if self.timeout is None else self.timeout

    def _raise_failure(self) -> None:
        """Waits for this rank's save in flight (the writer's, or its shards'); raises its failure, once."""
        failure = self._background.take_failure(self._wait_timeout())
        if failure is not None:
            raise CheckpointWriteError(f"ddp_eval: rank {dist.get_rank()}: {failure}") from failure.__cause__

    def list_checkpoints(self) -> List[sb_ckpt.Checkpoint]:
        """Lists complete checkpoints only; skipped ones are named in a warning.

        A save still being written in the background is not listed until committed.
        """
        found, problems = self.folder.complete(self._list_checkpoint_dirs(), self._required())
        for path in problems.keys() - self._warned:
            self._warned.add(path)
            logger.warning(f"ddp_eval: skipping incomplete checkpoint {path}: {problems[path]}")
        return [_on_disk(path, meta) for path, meta in found]

    def _required(self):
        """Recoverables a checkpoint must hold to be loadable."""
        if self.allow_partial_load:
            return []
        return [n for n in self.recoverables if not self.optional_recoverables.get(n) and "dataloader" not in n]

    def find_checkpoints(
        self, importance_key=None, max_key: Optional[str] = None, min_key: Optional[str] = None,
        ckpt_predicate=None, max_num_checkpoints: Optional[int] = None,
    ) -> List[sb_ckpt.Checkpoint]:
        """SpeechBrain's selection, made on rank 0 after a save in flight is
        committed: every rank gets the same list (e.g. to average checkpoints),
        and each checks it holds a complete copy of every one."""
        def choose():
            self._raise_failure()
            if dist.get_rank() != 0:
                return None
            found = self._find_local(importance_key, max_key, min_key, ckpt_predicate, max_num_checkpoints)
            return [ckpt.path.name for ckpt in found]

        names = dist.decide("find checkpoints", choose, self.timeout)[0]
        found = []
        dist.decide("find checkpoints: local copies", lambda: found.extend(self._local_copies(names)), self.timeout)
        return found

    def _local_copies(self, names: List[str]) -> List[sb_ckpt.Checkpoint]:
        found, problems = self.folder.complete([self.checkpoints_dir / n for n in names], self._required())
        if problems:
            raise CheckpointWriteError(
                f"ddp_eval: rank {dist.get_rank()} has no complete copy of the chosen checkpoint(s) "
                f"{'; '.join(f'{p}: {why}' for p, why in problems.items())}. With storage: node_local every node "
                "must hold the copy its local rank 0 wrote; with shared, every rank must see the same directory.")
        return [_on_disk(path, meta) for path, meta in found]

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
        """SpeechBrain's load; a load that fails on one rank is raised on every
        rank, naming the checkpoint and the file."""
        def load():
            # sharded recoverables, and any written sharded, load collectively through DCP at this world size
            modules, hooks = self._modules(), dict(self.custom_load_hooks)
            for name, obj in self.recoverables.items():
                path = checkpoint.paramfiles.get(name)
                if path is not None and name not in hooks and (
                        fsdp.is_sharded(obj) or pathlib.Path(path).suffix == dcp.SUFFIX):
                    hooks[name] = lambda obj, path, end_of_epoch: dcp.load(obj, path, modules)
            own, self.custom_load_hooks = self.custom_load_hooks, hooks
            try:
                sb_ckpt.Checkpointer.load_checkpoint(self, checkpoint)
            except Exception as exc:
                name, file = sb_compat.failed_recoverable(sys.exc_info()[2])
                raise CheckpointLoadError.naming(dist.get_rank(), checkpoint.path, exc, name, file) from exc
            finally:
                self.custom_load_hooks = own
            self.loaded = checkpoint.path.name  # named in evaluation journals

        dist.decide("checkpoint load", load, self.timeout)

    def recover_if_possible(
        self, importance_key=None, max_key: Optional[str] = None, min_key: Optional[str] = None,
        ckpt_predicate=None,
    ) -> Optional[sb_ckpt.Checkpoint]:
        """SpeechBrain's recovery, after the writer waited for a save in flight and
        removed the leftovers of a crashed run."""
        if self._is_writer():
            # A failed background save is raised on every rank by find_checkpoint, below.
            self._background.failed = self._background.take_failure(self._wait_timeout())
            if self._background.failed is None and self.checkpoints_dir.exists():
                with dist.fail_together("checkpoint directory cleanup"):
                    self.folder.prepare()
        return super().recover_if_possible(importance_key, max_key, min_key, ckpt_predicate)


class Checkpointer(ShardedSaves, _Reads):
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
        super().__init__(checkpoints_dir, recoverables, custom_load_hooks, custom_save_hooks, allow_partial_load)
        self.storage = check_choice("storage", storage, STORAGE_MODES)
        check_choice("on_unsupported_storage", on_unsupported_storage, UNSUPPORTED_STORAGE_ACTIONS)
        if not isinstance(async_save, bool):
            raise ConfigError(f"ddp_eval: option 'async_save' expects true or false, got "
                              f"{type(async_save).__name__} {async_save!r}")
        self.folder = CheckpointFolder(self.checkpoints_dir, bool(fsync), bool(checksums), on_unsupported_storage)
        self.timeout = timeout
        self.async_save = async_save
        self._background = BackgroundSaves()  # async_save, on the writer
        self.loaded: Optional[str] = None  # name of the checkpoint loaded last
        self._warned = set()

    @property
    def checkpoints_dir(self) -> pathlib.Path:
        """The checkpoints' folder; set anew (SpeechBrain's ``--debug`` points it at a
        temporary folder after construction), the commit protocol writes there too."""
        return self._checkpoints_dir

    @checkpoints_dir.setter
    def checkpoints_dir(self, value: Any) -> None:
        self._checkpoints_dir = pathlib.Path(value)
        if "folder" in self.__dict__:
            self.folder.root, self.folder.atomic = self._checkpoints_dir, None  # probed again at the next write

    # Options of the commit protocol, settable as before.
    fsync = property(lambda self: self.folder.fsync, lambda self, v: setattr(self.folder, "fsync", v))
    checksums = property(lambda self: self.folder.checksums, lambda self, v: setattr(self.folder, "checksums", v))
    on_unsupported_storage = property(lambda self: self.folder.on_unsupported_storage,
                                      lambda self, v: setattr(self.folder, "on_unsupported_storage", v))
    # -- writing -------------------------------------------------------------

    def save_checkpoint(
        self, meta: Mapping[str, Any] = {}, end_of_epoch: bool = True,
        name: Optional[str] = None, verbosity: int = logging.INFO,
    ) -> Optional[sb_ckpt.Checkpoint]:
        """Saves a checkpoint atomically; returns the same Checkpoint on every rank.

        Call it on every rank (no ``if_main_process()`` guard needed). In the
        ``on_stage_end`` of a :class:`~ddp_eval.DDPEvalMixin` Brain it may also be
        called under ``if if_main_process():``: the stage's synchronisation points
        bracket the write, and ranks other than the writer get None, as from
        SpeechBrain's Checkpointer. With ``async_save`` it returns once the state
        is snapshotted; the returned meta then lacks the file manifest, which the
        commit adds.
        """
        keep_only = _keep_only.get()
        if self._writer_alone():  # the caller of writer_only_saves reports a failure
            if not self._is_writer():
                return None
            self._raise_failure()
            dirname, full_meta = self._plan(meta, end_of_epoch, name)
            if self._sharded():  # written by every rank once the block is left (writer_only_saves)
                _deferred.get().append((str(self.checkpoints_dir), dirname, full_meta, end_of_epoch, keep_only,
                                        verbosity))
                return self._checkpoint(dirname, full_meta)
            return self._checkpoint(dirname, self._write(dirname, full_meta, end_of_epoch, keep_only, verbosity))
        if self._sharded():
            dirname, full_meta = dist.decide("checkpoint save: plan", lambda: self._plan(
                meta, end_of_epoch, name) if dist.get_rank() == 0 else None, self.timeout)[0]
            return self._checkpoint(dirname, self._save_sharded(dirname, full_meta, end_of_epoch, keep_only,
                                                                verbosity))

        def begin():  # rank 0 names the checkpoint; a writer's failed background save stops it
            self._raise_failure()
            return self._plan(meta, end_of_epoch, name) if dist.get_rank() == 0 else None

        dirname, full_meta = dist.decide("checkpoint save: begin", begin, self.timeout)[0]

        def write():
            return self._write(dirname, full_meta, end_of_epoch, keep_only, verbosity) if self._is_writer() else None

        return self._checkpoint(dirname, dist.decide("checkpoint save: end", write, self.timeout)[0])

    def save_and_keep_only(
        self, meta={}, end_of_epoch=True, name=None, num_to_keep=1, keep_recent=True,
        importance_keys=[], max_keys=[], min_keys=[], ckpt_predicate=None, verbosity=logging.INFO,
    ) -> None:
        """Saves, then deletes the least important checkpoints (as SpeechBrain).

        Overridden because SpeechBrain appends to its mutable default
        ``importance_keys`` on every call, so deletion slows down run after run;
        and with ``async_save`` the deletions wait for the commit, in the background.
        """
        keys = list(importance_keys) + ([sb_ckpt.ckpt_recency] if keep_recent else [])
        selection = dict(num_to_keep=num_to_keep, max_keys=max_keys, min_keys=min_keys,
                         importance_keys=keys, ckpt_predicate=ckpt_predicate, verbosity=verbosity)
        # Through save_checkpoint, as SpeechBrain does (subclasses and wrappers see the call).
        later = self.async_save or (self._writer_alone() and bool(self._sharded()))  # after the commit
        token = _keep_only.set(selection if later else None)
        try:
            self.save_checkpoint(meta=meta, end_of_epoch=end_of_epoch, name=name, verbosity=verbosity)
        finally:
            _keep_only.reset(token)
        if not later:
            self.delete_checkpoints(**selection)

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
                def on_committed():
                    logger.log(verbosity, f"Saved an {kind} checkpoint in {path} (in the background)")
                    if keep_only is not None:
                        self._delete_here(**keep_only)

                self._background.save_checkpoint(self, dirname, meta, on_committed, self._wait_timeout())
                return meta
            meta = self.folder.write(dirname, meta, lambda work: sb_compat.call_save_hooks(self, work))
        except BaseException as exc:
            raise CheckpointWriteError.naming(dist.get_rank(), path, exc) from exc
        logger.log(verbosity, f"Saved an {kind} checkpoint in {path}")
        return meta

    def _checkpoint(self, dirname: str, meta: dict) -> sb_ckpt.Checkpoint:
        path, sharded = self.checkpoints_dir / dirname, self._sharded()
        return sb_ckpt.Checkpoint(path, meta, {n: path / f"{n}{dcp.SUFFIX if n in sharded else sb_ckpt.PARAMFILE_EXT}"
                                               for n in self.recoverables})

    def _writer_alone(self) -> bool:
        """Inside :func:`writer_only_saves`, with one shared copy: saves and
        deletions need no synchronisation of their own."""
        return _writer_only.get() and self.storage == "shared"
    def wait(self) -> None:
        """Blocks until every started save is committed (and its deletions done).

        Call it on every rank. A background failure is raised on every rank,
        naming the checkpoint and the cause. Without ``async_save``: a
        synchronisation point only.
        """
        dist.decide("checkpoint wait", self._raise_failure, self.timeout)

    def delete_checkpoints(
        self, *, num_to_keep=1, min_keys=None, max_keys=None,
        importance_keys=[sb_ckpt.ckpt_recency], ckpt_predicate=None, verbosity=logging.INFO,
    ) -> None:
        """Deletes the least important checkpoints, on the writer only (as SpeechBrain).

        Each deleted directory is renamed away first, so it disappears atomically.
        """
        if num_to_keep < 0:
            raise ValueError("Number of checkpoints to keep must be positive.")
        selection = dict(num_to_keep=num_to_keep, min_keys=min_keys, max_keys=max_keys,
                         importance_keys=importance_keys, ckpt_predicate=ckpt_predicate, verbosity=verbosity)
        if self._writer_alone():  # the caller of writer_only_saves reports a failure
            if self._is_writer():
                self._raise_failure()
                self._delete_here(**selection)
            return
        dist.decide("delete checkpoints: begin", self._raise_failure, self.timeout)
        dist.decide("delete checkpoints: end", lambda: self._delete_here(**selection) if self._is_writer() else None,
                    self.timeout)

    def _delete_here(self, verbosity=logging.INFO, **selection) -> None:
        try:
            for ckpt in sb_compat.checkpoints_to_delete(self._find_local, **selection):
                self.folder.remove(ckpt.path)
                logger.log(verbosity, f"Deleted checkpoint in {ckpt.path}")
        except BaseException as exc:
            raise CheckpointWriteError(f"ddp_eval: rank {dist.get_rank()} could not delete old checkpoints in "
                                       f"{self.checkpoints_dir}: {type(exc).__name__}: {exc}") from exc


def _on_disk(path: pathlib.Path, meta: dict) -> sb_ckpt.Checkpoint:
    """The Checkpoint of a complete checkpoint directory, with the files it holds
    (a sharded recoverable's DCP folder, ``<name>.dcp``, stands for its file)."""
    return sb_ckpt.Checkpoint(path, meta, {f.stem: f for f in path.iterdir()
                                           if f.suffix in (sb_ckpt.PARAMFILE_EXT, dcp.SUFFIX)})
