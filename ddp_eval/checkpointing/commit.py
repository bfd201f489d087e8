"""The commit protocol of a checkpoints folder, on one process.

A checkpoint is written into a hidden temporary directory beside the final
one (:meth:`CheckpointFolder.begin`), its files flushed and fsync'ed,
``CKPT.yaml`` written last with a manifest of file sizes (sha256 optional),
the directory renamed into place and the folder fsync'ed
(:meth:`CheckpointFolder.commit`). A crash at any instant leaves the previous
checkpoints and, once the rename happened, the new complete one; whatever a
crash leaves behind is hidden and removed by :meth:`CheckpointFolder.prepare`.
:func:`inspect_checkpoint_dir` tells a complete checkpoint from anything else,
also for checkpoints that SpeechBrain wrote (meta file first, no manifest).

Nothing here knows about ranks: :class:`ddp_eval.Checkpointer` decides who
writes and when, and a background writer commits with the same calls.

Example
-------
>>> folder = CheckpointFolder(getfixture("tmp_path"))
>>> work = folder.begin("CKPT+demo")
>>> _ = (work / "model.ckpt").write_bytes(b"weights")
>>> meta = folder.commit(work, "CKPT+demo", {"unixtime": 0.0, "end-of-epoch": True})
>>> inspect_checkpoint_dir(folder.root / "CKPT+demo")[0] is None
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
import uuid
import zipfile
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import yaml
from speechbrain.utils import checkpoints as sb_ckpt

from ddp_eval.errors import StorageError

logger = logging.getLogger(__name__)

MANIFEST_KEY = "ddp_eval_files"
TMP_PREFIX = ".ddp_eval-tmp-"
TRASH_PREFIX = ".ddp_eval-trash-"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6
UNSUPPORTED_STORAGE_ACTIONS = ("error", "fallback")


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


def write_file_atomically(path: pathlib.Path, data: bytes, fsync: bool = True) -> None:
    """Writes ``data`` to ``path`` whole or not at all: a hidden temporary file
    beside it, flushed and fsync'ed, renamed over ``path``, the folder fsync'ed.

    Example
    -------
    >>> target = getfixture("tmp_path") / "piece.pkl"
    >>> write_file_atomically(target, b"state")
    >>> target.read_bytes()
    b'state'
    """
    temporary = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(path.parent)


def file_digest(path: pathlib.Path) -> str:
    """sha256 of a file, read in 1 MB blocks."""
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


def read_meta(path: pathlib.Path) -> Tuple[Optional[str], dict]:
    """``(problem, meta)`` of a checkpoint directory's meta file."""
    try:
        with open(path / sb_ckpt.METAFNAME, encoding="utf-8") as f:
            meta = yaml.load(f, Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError) as exc:
        return f"meta file unreadable ({type(exc).__name__}: {exc})", {}
    if not isinstance(meta, dict) or "unixtime" not in meta or "end-of-epoch" not in meta:
        return "meta file incomplete (no unixtime / end-of-epoch)", {}
    return None, meta


def inspect_checkpoint_dir(
    path: pathlib.Path, verify_checksums: bool = True, required: Iterable[str] = ()
) -> Tuple[Optional[str], dict]:
    """Returns ``(problem, meta)``; ``problem`` is None for a complete checkpoint.

    A checkpoint with a ddp_eval manifest must hold every listed file at its
    recorded size. One without (written by SpeechBrain, which writes the meta
    file first) must have a valid meta file, a ``<name>.ckpt`` for each name in
    ``required``, and every ``.ckpt`` file must pass :func:`paramfile_problem`.
    """
    problem, meta = read_meta(path)
    if problem:
        return problem, meta
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
        if verify_checksums and "sha256" in info and file_digest(file) != info["sha256"]:
            return f"parameter file {name} fails its sha256 checksum", meta
    return None, meta


class CheckpointFolder:
    """One checkpoints folder, written atomically by one process.

    Arguments
    ---------
    root : path
        The checkpoints folder (created at the first write).
    fsync : bool
        fsync files and directories before the commit.
    checksums : bool
        Record sha256 of every file in the manifest.
    on_unsupported_storage : str
        ``"error"``: raise :class:`StorageError` if the folder lacks atomic
        rename; ``"fallback"``: warn, then write in place, meta file last.
    """

    def __init__(self, root, fsync: bool = True, checksums: bool = False,
                 on_unsupported_storage: str = "error") -> None:
        self.root = pathlib.Path(root)
        self.fsync = fsync
        self.checksums = checksums
        self.on_unsupported_storage = on_unsupported_storage
        self.atomic: Optional[bool] = None  # probed at the first write

    # -- writing -------------------------------------------------------------

    def begin(self, dirname: str) -> pathlib.Path:
        """Prepares the folder; returns the directory to fill for ``dirname``."""
        self.prepare()
        final = self.root / dirname
        if self.atomic:
            work = self.root / f"{TMP_PREFIX}{dirname}.{uuid.uuid4().hex[:8]}"
        else:
            if final.exists():
                self.remove(final)
            work = final
        work.mkdir(parents=True)
        return work

    def commit(self, work: pathlib.Path, dirname: str, meta: Dict[str, Any]) -> Dict[str, Any]:
        """Makes the filled ``work`` directory the checkpoint ``dirname``.

        Returns the meta written, with the manifest. On failure ``work`` is
        removed and the previous checkpoints are untouched.
        """
        try:
            files = {}
            for file in sorted(work.rglob("*")):  # a sharded recoverable is a folder of shards (<name>.dcp/)
                name = file.relative_to(work).as_posix()
                if file.is_file():
                    files[name] = {"size": file.stat().st_size}
                    if self.checksums:
                        files[name]["sha256"] = file_digest(file)
                    if self.fsync:
                        _fsync_file(file)
                elif self.fsync:
                    _fsync_dir(file)
            meta = {**meta, MANIFEST_KEY: files}
            with open(work / sb_ckpt.METAFNAME, "w", encoding="utf-8") as f:
                f.write("# yamllint disable\n")
                f.write(yaml.dump(meta))
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            if self.atomic:
                if self.fsync:
                    _fsync_dir(work)
                self._publish(work, self.root / dirname)
            if self.fsync:
                _fsync_dir(self.root)
        except BaseException:
            self.abort(work)
            raise
        return meta

    def write(self, dirname: str, meta: Dict[str, Any], fill: Callable[[pathlib.Path], None]) -> Dict[str, Any]:
        """:meth:`begin`, ``fill(directory)``, :meth:`commit`."""
        work = self.begin(dirname)
        try:
            fill(work)
        except BaseException:
            self.abort(work)
            raise
        return self.commit(work, dirname, meta)

    def abort(self, work: pathlib.Path) -> None:
        """Removes an uncommitted ``work`` directory (atomic mode; in place, the
        next start finds it incomplete and skips it)."""
        if self.atomic:
            shutil.rmtree(work, ignore_errors=True)

    def _publish(self, work: pathlib.Path, final: pathlib.Path) -> None:
        """Renames ``work`` to ``final``, replacing an existing one atomically."""
        # Leftovers of the old version are hidden names, removed at the next start.
        if not final.exists():
            _rename_dir(work, final)
        elif _exchange_dirs(work, final):
            shutil.rmtree(work, ignore_errors=True)  # now holds the old version
        else:  # no renameat2: a short window without `final`, repaired at start-up
            trash = self.root / f"{TRASH_PREFIX}{final.name}.{uuid.uuid4().hex[:8]}"
            _rename_dir(final, trash)
            _rename_dir(work, final)
            shutil.rmtree(trash, ignore_errors=True)

    def remove(self, path: pathlib.Path) -> None:
        """Deletes a checkpoint directory; it disappears atomically (renamed away first)."""
        trash = self.root / f"{TRASH_PREFIX}deleted.{uuid.uuid4().hex[:8]}"
        try:
            _rename_dir(path, trash)
        except OSError:
            if self.atomic:
                raise
            trash = path  # fallback storage: remove in place, meta file first
            (path / sb_ckpt.METAFNAME).unlink(missing_ok=True)
        shutil.rmtree(trash, ignore_errors=True)  # a hidden leftover is removed at the next start

    # -- leftovers and storage ---------------------------------------------------

    def prepare(self) -> None:
        """Removes leftovers of a crashed run; probes the storage once."""
        os.makedirs(self.root, exist_ok=True)
        for entry in self.root.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(TRASH_PREFIX):
                original = self.root / entry.name[len(TRASH_PREFIX):].rsplit(".", 1)[0]
                if original.name.startswith(sb_ckpt.CKPT_PREFIX) and not original.exists():
                    _rename_dir(entry, original)  # crashed inside a non-atomic replace
                else:
                    shutil.rmtree(entry, ignore_errors=True)
        if self.atomic is None:
            self.atomic = self._probe_storage()

    def complete(self, paths: Iterable[pathlib.Path], required: Iterable[str] = ()
                 ) -> Tuple[List[Tuple[pathlib.Path, dict]], Dict[pathlib.Path, str]]:
        """Sorts checkpoint directories: ``([(path, meta)]`` of the complete ones,
        ``{path: problem}`` of the others), by :func:`inspect_checkpoint_dir`."""
        required = list(required)
        found, problems = [], {}
        for path in paths:
            problem, meta = inspect_checkpoint_dir(path, self.checksums, required)
            if problem:
                problems[path] = problem
            else:
                found.append((path, meta))
        return found, problems

    def _probe_storage(self) -> bool:
        probe = self.root / f"{TMP_PREFIX}probe.{uuid.uuid4().hex[:8]}"
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
                f"the checkpoint directory {self.root} does not support "
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
