"""Checkpoints with sharded recoverables (FSDP modules and their optimizers): every
rank writes its shard with ``torch.distributed.checkpoint``
(:mod:`ddp_eval.distributed.dcp`) into the writer's hidden work directory, then the
writer writes the rest and commits (:mod:`ddp_eval.checkpointing.commit`), so the
checkpoint is complete or absent; with ``async_save`` every rank copies its
shards during the call and writes them in the background.

:class:`ShardedSaves` is a part of :class:`ddp_eval.Checkpointer` (it uses the
checkpointer's ``folder``, ``recoverables``, ``storage``, ``async_save``,
``timeout``, its background saves and its writer's reads and deletions).
"""

import logging
import pathlib
from typing import Any, Dict, List, Optional

import torch
from speechbrain.utils import checkpoints as sb_ckpt

from ddp_eval import distributed as dist
from ddp_eval import sb_compat
from ddp_eval.checkpointing._async_save import by_saver
from ddp_eval.distributed import dcp, fsdp
from ddp_eval.errors import CheckpointWriteError, ConfigError

logger = logging.getLogger("ddp_eval.checkpointing.checkpoint")  # where the checkpointer's messages go


class ShardedSaves:
    """The saves of a :class:`ddp_eval.Checkpointer` that every rank writes."""

    def _sharded(self) -> Dict[str, Any]:
        """Recoverables that only every rank together holds (FSDP modules, their optimizers)."""
        return {n: obj for n, obj in self.recoverables.items() if fsdp.is_sharded(obj)}

    def _modules(self) -> Dict[str, torch.nn.Module]:
        """The module recoverables by name: an optimizer's state is keyed by their parameters' names."""
        return {n: obj for n, obj in self.recoverables.items() if isinstance(obj, torch.nn.Module)}

    def save_planned(self, planned: List[tuple]) -> None:
        """Every rank: writes the sharded saves the writer planned in :func:`writer_only_saves`."""
        for folder, dirname, meta, end_of_epoch, keep_only, verbosity in planned:
            if folder != str(self.checkpoints_dir):
                raise CheckpointWriteError(
                    f"ddp_eval: a sharded save of {folder} was planned in on_stage_end, but the Brain's checkpointer "
                    f"writes {self.checkpoints_dir}. Save another Checkpointer with sharded recoverables on every "
                    "rank, outside on_stage_end.")
            self._save_sharded(dirname, meta, end_of_epoch, keep_only, verbosity)

    def _save_sharded(self, dirname, meta, end_of_epoch, keep_only, verbosity) -> dict:
        """Every rank: a checkpoint whose sharded recoverables every rank writes its
        shard of (DCP), inside the writer's atomic commit. Returns the meta written."""
        sharded, path = self._sharded(), self.checkpoints_dir / dirname

        def begin():
            self._raise_failure()
            if self.storage != "shared":
                raise ConfigError(f"ddp_eval: sharded recoverables {sorted(sharded)} (FSDP) need storage: shared, "
                                  f"got {self.storage!r}: every rank writes its shard into one directory.")
            return str(self.folder.begin(dirname)) if self._is_writer() else None

        work = pathlib.Path(dist.decide("checkpoint save: shards", begin, self.timeout)[0])
        if self.async_save:
            return self._save_sharded_in_background(work, dirname, meta, end_of_epoch, keep_only, verbosity)
        failure: Optional[BaseException] = None
        try:
            for name in sorted(sharded):  # the same order on every rank: each save is a collective
                dcp.save(sharded[name], work / f"{name}{dcp.SUFFIX}", self._modules())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP raises a failure of any rank on every rank (a BaseException)
            failure = exc

        def commit():
            if failure is not None:
                if self._is_writer():
                    self.folder.abort(work)
                raise CheckpointWriteError.naming(dist.get_rank(), path, failure, "its shards of ") from failure
            if not self._is_writer():
                return None
            try:
                sb_compat.call_save_hooks(self, work, [n for n in self.recoverables if n not in sharded])
                written = self.folder.commit(work, dirname, meta)
            except BaseException as exc:
                self.folder.abort(work)
                raise CheckpointWriteError.naming(dist.get_rank(), path, exc) from exc
            kind = "end-of-epoch" if end_of_epoch else "intra-epoch"
            logger.log(verbosity, f"Saved an {kind} checkpoint in {path} ({len(sharded)} sharded recoverable(s))")
            if keep_only is not None:
                self._delete_here(**keep_only)
            return written

        return dist.decide("checkpoint save: commit", commit, self.timeout)[0]

    def _save_sharded_in_background(self, work, dirname, meta, end_of_epoch, keep_only, verbosity) -> dict:
        """Every rank, ``async_save``: copies its shards (and, on the writer, the other
        state) in memory now; a background thread on every rank writes the shards
        (over a group of their own), then the writer's writes the rest and commits.
        A failure anywhere is raised on every rank by the next checkpointer call."""
        sharded, path, writer = self._sharded(), self.checkpoints_dir / dirname, self._is_writer()
        group = dcp.checkpoint_group()  # the first time: made on every rank, here
        copies: Dict[str, Any] = {}

        def snapshot():
            copies["shards"] = {n: dcp.staged(dcp.state_of(sharded[n], self._modules())) for n in sorted(sharded)}
            if writer:
                by_state_dict, own_savers = by_saver(self, [n for n in self.recoverables if n not in sharded])
                sb_compat.call_save_hooks(self, work, own_savers)
                copies["rest"] = self._background.snapshot(
                    {n: self.recoverables[n].state_dict() for n in by_state_dict})

        try:
            dist.decide("checkpoint save: snapshot", snapshot, self.timeout)
        except BaseException:
            if writer:
                self.folder.abort(work)
            raise

        def write():
            try:
                shards = copies.pop("shards")
                for name in sorted(shards):  # the same order on every rank: each save is a collective
                    dcp.save_state(shards.pop(name), work / f"{name}{dcp.SUFFIX}", group)
                if not writer:
                    return
                for name, state in copies.pop("rest").items():
                    torch.save(state, work / f"{name}{sb_ckpt.PARAMFILE_EXT}")
                self.folder.commit(work, dirname, meta)
            except BaseException:
                if writer:
                    self.folder.abort(work)
                raise
            kind = "end-of-epoch" if end_of_epoch else "intra-epoch"
            logger.log(verbosity, f"Saved an {kind} checkpoint in {path} (in the background; "
                                  f"{len(sharded)} sharded recoverable(s))")
            if keep_only is not None:
                self._delete_here(**keep_only)

        self._background.writer.exit_timeout = self._wait_timeout()
        self._background.writer.start(write, str(path))
        return meta

