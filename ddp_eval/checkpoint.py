"""``ddp_eval.Checkpointer``: SpeechBrain's Checkpointer, atomic and safe under DDP.

A checkpoint is written into a hidden temporary directory beside the final
one, every file flushed and fsync'ed, ``CKPT.yaml`` (with a manifest of file
sizes) written last, then the directory is renamed into place and the parent
directory fsync'ed. A crash at any instant leaves either the previous set of
checkpoints or the new complete one; resume skips anything incomplete.

Only the writing rank touches the disk (global rank 0, or local rank 0 of each
node with ``storage="node_local"``); every call is bracketed by bounded
synchronisation points, and a failure on the writer is raised on every rank.

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

import ctypes
import errno
import hashlib
import logging
import os
import pathlib
import shutil
import struct
import sys
import time
import uuid
import zipfile
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import yaml
from speechbrain.utils import checkpoints as sb_ckpt
from speechbrain.utils.distributed import MainProcessContext, main_process_only

from ddp_eval import dist
from ddp_eval.config import check_choice
from ddp_eval.errors import CheckpointLoadError, CheckpointWriteError, StorageError

logger = logging.getLogger(__name__)

MANIFEST_KEY = "ddp_eval_files"
TMP_PREFIX = ".ddp_eval-tmp-"
TRASH_PREFIX = ".ddp_eval-trash-"
STORAGE_MODES = ("shared", "node_local")
UNSUPPORTED_STORAGE_ACTIONS = ("error", "fallback")
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6
_MAIN_ONLY_CODE = main_process_only(lambda: None).__code__


def _fsync_file(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_dir(src: pathlib.Path, dst: pathlib.Path) -> None:
    os.rename(src, dst)


def _exchange_dirs(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Atomically swaps two directories (Linux renameat2); False if unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _file_digest(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def paramfile_problem(path: pathlib.Path) -> Optional[str]:
    """Why a parameter file without a manifest entry cannot be loaded, or None.

    A file that ``torch.save`` wrote (a zip archive) must have its central
    directory, and every entry must lie within the file: a truncated archive
    has neither. Other files (a legacy pickle, a custom saver's format) must
    exist and not be empty.
    """
    size = path.stat().st_size
    if size == 0:
        return f"parameter file {path.name} is empty"
    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:
            return None
        try:
            with zipfile.ZipFile(f) as archive:
                for info in archive.infolist():
                    f.seek(info.header_offset)
                    header = f.read(30)
                    if len(header) < 30 or header[:4] != ZIP_MAGIC:
                        return f"parameter file {path.name}: entry {info.filename} has no header"
                    name_len, extra_len = struct.unpack("<HH", header[26:30])
                    end = info.header_offset + 30 + name_len + extra_len + info.compress_size
                    if end > size:
                        return (f"parameter file {path.name}: entry {info.filename} ends at byte "
                                f"{end}, past the end of the file ({size} bytes)")
        except (zipfile.BadZipFile, OSError, ValueError, struct.error) as exc:
            return (f"parameter file {path.name} is not a readable zip archive "
                    f"({type(exc).__name__}: {exc}); truncated or damaged")
    return None


def inspect_checkpoint_dir(
    path: pathlib.Path, verify_checksums: bool = True, required: Iterable[str] = ()
) -> Tuple[Optional[str], dict]:
    """Returns ``(problem, meta)``; ``problem`` is None for a complete checkpoint.

    A checkpoint with a ddp_eval manifest must hold every listed file at its
    recorded size. One without (written by SpeechBrain, which writes the meta
    file first) must have a valid meta file, a ``<name>.ckpt`` for each name in
    ``required``, and every ``.ckpt`` file must pass :func:`paramfile_problem`.
    """
    try:
        with open(path / sb_ckpt.METAFNAME, encoding="utf-8") as f:
            meta = yaml.load(f, Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError) as exc:
        return f"meta file unreadable ({type(exc).__name__}: {exc})", {}
    if not isinstance(meta, dict) or "unixtime" not in meta or "end-of-epoch" not in meta:
        return "meta file incomplete (no unixtime / end-of-epoch)", {}
    if MANIFEST_KEY not in meta:
        for name in required:
            file = path / f"{name}{sb_ckpt.PARAMFILE_EXT}"
            if not file.is_file():
                return f"parameter file {file.name} is missing", meta
        for file in sorted(path.glob(f"*{sb_ckpt.PARAMFILE_EXT}")):
            problem = paramfile_problem(file)
            if problem:
                return problem, meta
    for name, info in (meta.get(MANIFEST_KEY) or {}).items():
        file = path / name
        if not file.is_file():
            return f"parameter file {name} is missing", meta
        size = file.stat().st_size
        if size != info["size"]:
            return f"parameter file {name} has {size} bytes, expected {info['size']}", meta
        if verify_checksums and "sha256" in info and _file_digest(file) != info["sha256"]:
            return f"parameter file {name} fails its sha256 checksum", meta
    return None, meta


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
        Seconds to wait at each synchronisation point (default: the
        ``collective_timeout`` of ddp_eval).
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
    ) -> None:
        super().__init__(
            checkpoints_dir, recoverables, custom_load_hooks, custom_save_hooks, allow_partial_load
        )
        self.storage = check_choice("storage", storage, STORAGE_MODES)
        self.on_unsupported_storage = check_choice(
            "on_unsupported_storage", on_unsupported_storage, UNSUPPORTED_STORAGE_ACTIONS
        )
        self.fsync = bool(fsync)
        self.checksums = bool(checksums)
        self.timeout = timeout
        self._atomic: Optional[bool] = None  # probed at the first write
        self._warned = set()

    # -- writing -------------------------------------------------------------

    def save_checkpoint(
        self, meta: Mapping[str, Any] = {}, end_of_epoch: bool = True,
        name: Optional[str] = None, verbosity: int = logging.INFO,
    ) -> sb_ckpt.Checkpoint:
        """Saves a checkpoint atomically; returns the same Checkpoint on every rank.

        Call it on every rank (no ``if_main_process()`` guard needed).
        """
        plan, error = None, None
        if dist.get_rank() == 0:
            try:
                path = self._custom_checkpoint_dirpath(name) if name else self._new_checkpoint_dirpath()
                plan = (path.name, {"unixtime": time.time(), "end-of-epoch": end_of_epoch, **meta})
            except Exception as exc:  # e.g. an unreadable directory: reported on every rank
                error = exc
        dirname, full_meta = dist.exchange(
            "checkpoint save: begin", plan, error=error, timeout=self.timeout)[0]
        error = None
        if self._is_writer():
            try:
                full_meta = self._write_checkpoint(dirname, full_meta)
                kind = "end-of-epoch" if end_of_epoch else "intra-epoch"
                logger.log(verbosity, f"Saved an {kind} checkpoint in {self.checkpoints_dir / dirname}")
            except BaseException as exc:
                error = CheckpointWriteError(
                    f"ddp_eval: rank {dist.get_rank()} could not write checkpoint "
                    f"{self.checkpoints_dir / dirname}: {type(exc).__name__}: {exc}. "
                    "The previous checkpoints are intact."
                )
                error.__cause__ = exc
        written = dist.exchange("checkpoint save: end", full_meta, error=error, timeout=self.timeout)
        path = self.checkpoints_dir / dirname
        paramfiles = {n: path / f"{n}{sb_ckpt.PARAMFILE_EXT}" for n in self.recoverables}
        return sb_ckpt.Checkpoint(path, written[0], paramfiles)

    def save_and_keep_only(
        self, meta={}, end_of_epoch=True, name=None, num_to_keep=1, keep_recent=True,
        importance_keys=[], max_keys=[], min_keys=[], ckpt_predicate=None, verbosity=logging.INFO,
    ) -> None:
        """Saves, then deletes the least important checkpoints (as SpeechBrain).

        Why override: SpeechBrain appends to its mutable default
        ``importance_keys`` on every call, so deletion slows down run after run.
        """
        self.save_checkpoint(meta=meta, end_of_epoch=end_of_epoch, name=name, verbosity=verbosity)
        keys = list(importance_keys) + ([sb_ckpt.ckpt_recency] if keep_recent else [])
        self.delete_checkpoints(
            num_to_keep=num_to_keep, max_keys=max_keys, min_keys=min_keys,
            importance_keys=keys, ckpt_predicate=ckpt_predicate, verbosity=verbosity,
        )

    def delete_checkpoints(
        self, *, num_to_keep=1, min_keys=None, max_keys=None,
        importance_keys=[sb_ckpt.ckpt_recency], ckpt_predicate=None, verbosity=logging.INFO,
    ) -> None:
        """Deletes the least important checkpoints, on the writer only (as SpeechBrain).

        Each deleted directory is renamed away first, so it disappears atomically.
        """
        if num_to_keep < 0:
            raise ValueError("Number of checkpoints to keep must be positive.")
        dist.exchange("delete checkpoints: begin", timeout=self.timeout)
        error = None
        if self._is_writer():
            try:
                # Selection tracks speechbrain 1.1 Checkpointer.delete_checkpoints.
                keys = [{"min_key": k} for k in min_keys or []]
                keys += [{"max_key": k} for k in max_keys or []]
                keys += [{"importance_key": k} for k in importance_keys]
                candidates, protected = set(), set()
                for kwargs in keys:
                    found = self.find_checkpoints(ckpt_predicate=ckpt_predicate, **kwargs)
                    candidates.update(found)
                    protected.update(found[:num_to_keep])
                for ckpt in sorted(candidates - protected, key=lambda c: c.path.name):
                    self._remove_dir(ckpt.path)
                    logger.log(verbosity, f"Deleted checkpoint in {ckpt.path}")
            except BaseException as exc:
                error = CheckpointWriteError(
                    f"ddp_eval: rank {dist.get_rank()} could not delete old checkpoints "
                    f"in {self.checkpoints_dir}: {type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
        dist.exchange("delete checkpoints: end", error=error, timeout=self.timeout)

    def _is_writer(self) -> bool:
        rank = dist.get_local_rank() if self.storage == "node_local" else dist.get_rank()
        return rank == 0

    def _write_checkpoint(self, dirname: str, meta: Dict[str, Any]) -> Dict[str, Any]:
        self._prepare_directory()
        final = self.checkpoints_dir / dirname
        if self._atomic:
            work = self.checkpoints_dir / f"{TMP_PREFIX}{dirname}.{uuid.uuid4().hex[:8]}"
        else:
            if final.exists():
                self._remove_dir(final)
            work = final
        work.mkdir(parents=True)
        try:
            self._run_save_hooks(work)
            files = {}
            for file in sorted(work.iterdir()):
                if file.is_file():
                    files[file.name] = {"size": file.stat().st_size}
                    if self.checksums:
                        files[file.name]["sha256"] = _file_digest(file)
                    if self.fsync:
                        _fsync_file(file)
            meta = {**meta, MANIFEST_KEY: files}
            with open(work / sb_ckpt.METAFNAME, "w", encoding="utf-8") as f:
                f.write("# yamllint disable\n")
                f.write(yaml.dump(meta))
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            if self._atomic:
                if self.fsync:
                    _fsync_dir(work)
                self._publish(work, final)
            if self.fsync:
                _fsync_dir(self.checkpoints_dir)
        except BaseException:
            if self._atomic:
                shutil.rmtree(work, ignore_errors=True)
            raise
        return meta

    def _run_save_hooks(self, directory: pathlib.Path) -> None:
        # The writer runs every hook itself: SpeechBrain's main_process_only
        # wrappers are bypassed (a node-local writer is not global rank 0) and
        # nested SpeechBrain collectives are disabled by MainProcessContext.
        with MainProcessContext():
            for name, obj in self.recoverables.items():
                hook = self.custom_save_hooks.get(name) or sb_ckpt.get_default_hook(
                    obj, sb_ckpt.DEFAULT_SAVE_HOOKS
                )
                if hook is None:
                    raise RuntimeError(
                        f"Don't know how to save {type(obj)}. Register default hook "
                        "or add custom hook for this object."
                    )
                if getattr(hook, "__code__", None) is _MAIN_ONLY_CODE:
                    hook = hook.__wrapped__
                hook(obj, directory / f"{name}{sb_ckpt.PARAMFILE_EXT}")

    def _publish(self, work: pathlib.Path, final: pathlib.Path) -> None:
        """Renames ``work`` to ``final``, replacing an existing one atomically."""
        # Leftovers of the old version are hidden names, removed at the next start.
        if not final.exists():
            _rename_dir(work, final)
        elif _exchange_dirs(work, final):
            shutil.rmtree(work, ignore_errors=True)  # now holds the old version
        else:  # no renameat2: a short window without `final`, repaired at start-up
            trash = self.checkpoints_dir / f"{TRASH_PREFIX}{final.name}.{uuid.uuid4().hex[:8]}"
            _rename_dir(final, trash)
            _rename_dir(work, final)
            shutil.rmtree(trash, ignore_errors=True)

    def _remove_dir(self, path: pathlib.Path) -> None:
        trash = self.checkpoints_dir / f"{TRASH_PREFIX}deleted.{uuid.uuid4().hex[:8]}"
        try:
            _rename_dir(path, trash)
        except OSError:
            if self._atomic:
                raise
            trash = path  # fallback storage: remove in place, meta file first
            (path / sb_ckpt.METAFNAME).unlink(missing_ok=True)
        shutil.rmtree(trash, ignore_errors=True)  # a hidden leftover is removed at the next start

    def _prepare_directory(self) -> None:
        """On the writer: remove leftovers of a crashed run, probe the storage once."""
        os.makedirs(self.checkpoints_dir, exist_ok=True)
        for entry in self.checkpoints_dir.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(TRASH_PREFIX):
                original = self.checkpoints_dir / entry.name[len(TRASH_PREFIX):].rsplit(".", 1)[0]
                if original.name.startswith(sb_ckpt.CKPT_PREFIX) and not original.exists():
                    _rename_dir(entry, original)  # crashed inside a non-atomic replace
                else:
                    shutil.rmtree(entry, ignore_errors=True)
        if self._atomic is None:
            self._atomic = self._probe_storage()

    def _probe_storage(self) -> bool:
        probe = self.checkpoints_dir / f"{TMP_PREFIX}probe.{uuid.uuid4().hex[:8]}"
        try:
            (probe / "a").mkdir(parents=True)
            (probe / "a" / "f").write_bytes(b"probe")
            if self.fsync:
                _fsync_file(probe / "a" / "f")
                _fsync_dir(probe / "a")
            _rename_dir(probe / "a", probe / "b")
            return True
        except OSError as exc:
            problem = (
                f"the checkpoint directory {self.checkpoints_dir} does not support "
                f"atomic directory rename and fsync ({type(exc).__name__}: {exc})"
            )
            if self.on_unsupported_storage == "error":
                raise StorageError(
                    f"ddp_eval: {problem}. Expected a POSIX filesystem. Use another "
                    "directory, or set on_unsupported_storage: fallback to write "
                    "checkpoints in place (not atomic; resume skips incomplete ones)."
                ) from exc
            logger.warning(f"ddp_eval: {problem}; writing checkpoints in place (non-atomic), without fsync.")
            self.fsync = False
            return False
        finally:
            shutil.rmtree(probe, ignore_errors=True)

    # -- reading -------------------------------------------------------------

    def list_checkpoints(self) -> List[sb_ckpt.Checkpoint]:
        """Lists complete checkpoints only; skipped ones are named in a warning."""
        found = []
        for ckpt_dir in self._list_checkpoint_dirs():
            problem, meta = inspect_checkpoint_dir(ckpt_dir, self.checksums, self._required())
            if problem:
                if ckpt_dir not in self._warned:
                    self._warned.add(ckpt_dir)
                    logger.warning(f"ddp_eval: skipping incomplete checkpoint {ckpt_dir}: {problem}")
                continue
            paramfiles = {
                f.stem: f for f in ckpt_dir.iterdir() if f.suffix == sb_ckpt.PARAMFILE_EXT
            }
            found.append(sb_ckpt.Checkpoint(ckpt_dir, meta, paramfiles))
        return found

    def _required(self):
        """Recoverables a checkpoint must hold to be loadable."""
        if self.allow_partial_load:
            return []
        return [n for n in self.recoverables if not self.optional_recoverables.get(n) and "dataloader" not in n]

    def find_checkpoint(
        self, importance_key=None, max_key: Optional[str] = None, min_key: Optional[str] = None,
        ckpt_predicate=None,
    ) -> Optional[sb_ckpt.Checkpoint]:
        """Why: rank 0 chooses and broadcasts, so every rank loads the same checkpoint."""
        choice, error = None, None
        if dist.get_rank() == 0:
            try:
                found = super().find_checkpoint(importance_key, max_key, min_key, ckpt_predicate)
                choice = found.path.name if found else None
            except BaseException as exc:
                error = exc
        name = dist.exchange("find checkpoint", choice, error=error, timeout=self.timeout)[0]
        if name is None:
            return None
        path, error, ckpt = self.checkpoints_dir / name, None, None
        problem, meta = inspect_checkpoint_dir(path, self.checksums, self._required())
        if problem:
            error = CheckpointWriteError(
                f"ddp_eval: rank {dist.get_rank()} has no complete copy of the chosen "
                f"checkpoint {path}: {problem}. With storage: node_local every node "
                "must hold the copy its local rank 0 wrote; with shared, every rank "
                "must see the same directory."
            )
        else:
            paramfiles = {f.stem: f for f in path.iterdir() if f.suffix == sb_ckpt.PARAMFILE_EXT}
            ckpt = sb_ckpt.Checkpoint(path, meta, paramfiles)
        dist.exchange("find checkpoint: local copy", error=error, timeout=self.timeout)
        return ckpt

    def load_checkpoint(self, checkpoint: sb_ckpt.Checkpoint) -> None:
        """Why: a load that fails on one rank is raised on every rank, naming the
        checkpoint and the file."""
        error = None
        try:
            super().load_checkpoint(checkpoint)
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
        """Why: the writer first removes leftovers of a crashed run."""
        if self._is_writer() and self.checkpoints_dir.exists():
            with dist.fail_together("checkpoint directory cleanup"):
                self._prepare_directory()
        return super().recover_if_possible(importance_key, max_key, min_key, ckpt_predicate)


def _loading(traceback) -> Tuple[Optional[str], Optional[pathlib.Path]]:
    """``(recoverable name, file)`` that SpeechBrain's load loop was at when it failed."""
    found = (None, None)
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code.co_name == "_call_load_hooks" and "loadpath" in frame.f_locals:
            found = (frame.f_locals.get("name"), frame.f_locals["loadpath"])
        traceback = traceback.tb_next
    return found
