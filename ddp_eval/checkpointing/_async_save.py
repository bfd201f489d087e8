"""Non-blocking saves: an in-memory snapshot, then one background writer.

:func:`snapshot_state` copies a ``state_dict`` (module, optimizer, scheduler,
grad scaler) to CPU memory, pinned when CUDA is available, so training may
change the originals the moment it returns. :class:`BackgroundWriter` runs
one job at a time in a daemon thread; a job's exception is kept and handed to
whoever waits for it next, and a job still running at interpreter exit is
finished, bounded by a timeout.

Example
-------
>>> import torch
>>> model, buffers = torch.nn.Linear(2, 2), {}
>>> copy = snapshot_state(model.state_dict(), buffers)
>>> with torch.no_grad():
...     _ = model.weight.fill_(1.0)
>>> bool((copy["weight"] == 1.0).all())
False
>>> snapshot_state(model.state_dict(), buffers)["weight"] is copy["weight"]  # the same memory, refilled
True
>>> writer = BackgroundWriter()
>>> writer.start(lambda: None, "a job")
>>> writer.wait(timeout=5) is None
True
"""

import atexit
import collections
import copy
import logging
import pathlib
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from speechbrain.utils.checkpoints import PARAMFILE_EXT

from ddp_eval import sb_compat

logger = logging.getLogger(__name__)


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a nested state (each storage counted once)."""
    seen, total = set(), 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            key = (item.untyped_storage().data_ptr(), item.device)
            if key not in seen:
                seen.add(key)
                total += item.untyped_storage().nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def available_memory_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo``; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def snapshot_state(state: Any, buffers: Optional[Dict[Any, torch.Tensor]] = None) -> Any:
    """A copy of a nested ``state_dict`` whose tensors live in CPU memory.

    Tensors on a GPU are copied into pinned memory (asynchronously, then one
    synchronisation); a tensor held twice (tied weights) is copied once. Other
    values are deep-copied, and an ``OrderedDict``'s ``_metadata`` is kept.

    ``buffers`` (a dict, kept by the caller between snapshots) holds the
    copies by their place in the state; a later snapshot copies into them
    when shape and dtype still match, so it touches no fresh memory: no page
    faults, which cost more than the copy itself while other processes run.
    """
    memo: Dict[int, torch.Tensor] = {}
    on_gpu = [False]
    buffers = {} if buffers is None else buffers

    def copy_tensor(tensor: torch.Tensor, place: Tuple) -> torch.Tensor:
        if id(tensor) not in memo:
            tensor = tensor.detach()
            on_gpu[0] = on_gpu[0] or tensor.is_cuda
            target = buffers.get(place)
            if target is None or target.shape != tensor.shape or target.dtype != tensor.dtype:
                target = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
                buffers[place] = target
            memo[id(tensor)] = target.copy_(tensor, non_blocking=tensor.is_cuda)
        return memo[id(tensor)]

    def walk(item: Any, place: Tuple) -> Any:
        if isinstance(item, torch.Tensor):
            return copy_tensor(item, place)
        if isinstance(item, dict):
            out = type(item)() if isinstance(item, collections.OrderedDict) else {}
            for key, value in item.items():
                out[key] = walk(value, place + (key,))
            if hasattr(item, "_metadata"):
                out._metadata = copy.deepcopy(item._metadata)
            return out
        if isinstance(item, list):
            return [walk(v, place + (i,)) for i, v in enumerate(item)]
        if isinstance(item, tuple):
            walked = [walk(v, place + (i,)) for i, v in enumerate(item)]
            return type(item)(*walked) if hasattr(item, "_fields") else tuple(walked)  # namedtuple or tuple
        return copy.deepcopy(item)

    result = walk(state, ())
    if on_gpu[0]:
        torch.cuda.synchronize()
    return result


_writers: "weakref.WeakSet[BackgroundWriter]" = weakref.WeakSet()


class BackgroundWriter:
    """Runs one job at a time in a background thread.

    :meth:`start` needs the previous job to be waited for; :meth:`wait`
    returns the job's exception (or None) once, then forgets it.
    """

    def __init__(self, exit_timeout: float = 600.0) -> None:
        self.exit_timeout = exit_timeout
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.name = ""  # of the job running or last started
        self.seconds: Optional[float] = None  # how long the last finished job ran
        _writers.add(self)

    @property
    def busy(self) -> bool:
        """A job is running or finished without having been waited for."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        """A job is still running (its thread has not ended)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: Callable[[], None], name: str) -> None:
        """Starts ``job()`` in the background; ``name`` appears in errors and logs."""
        if self._thread is not None:
            raise RuntimeError(f"ddp_eval: background job '{self.name}' was not waited for")

        def run():
            start = time.perf_counter()
            try:
                job()
            except BaseException as exc:  # handed to the next wait()
                self._error = exc
            self.seconds = time.perf_counter() - start

        self.name = name
        self._thread = threading.Thread(target=run, name=f"ddp_eval save: {name}", daemon=True)
        self._thread.start()

    def wait(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Blocks until the job ends; returns its exception, or None.

        A job still running after ``timeout`` seconds gives a ``TimeoutError``
        (the job goes on; wait again to collect it).
        """
        thread = self._thread
        if thread is None:
            return None
        thread.join(timeout)
        if thread.is_alive():
            return TimeoutError(f"background job '{self.name}' still running after {timeout:g} s")
        error, self._error, self._thread = self._error, None, None
        return error


def by_saver(checkpointer: Any, names: List[str]) -> Tuple[List[str], List[str]]:
    """``(names, names)`` of the recoverables SpeechBrain saves as
    ``torch.save(state_dict())`` (snapshotted by an async save), and the others
    (own savers, custom hooks: written during the call)."""
    by_state_dict = [n for n in names if sb_compat.save_hook(checkpointer, n, checkpointer.recoverables[n])
                     in sb_compat.STATE_DICT_SAVERS]
    return by_state_dict, [n for n in names if n not in by_state_dict]


class BackgroundSaves:
    """The non-blocking saves of one checkpointer on its writer, one at a time:
    the snapshot (memory checked, buffers kept and refilled), the background
    job, and its failure until someone takes it.

    Example
    -------
    >>> import torch
    >>> saves, written = BackgroundSaves(), []
    >>> saves.start("CKPT+demo", {"model": torch.nn.Linear(2, 2).state_dict()}, written.append, timeout=5)
    >>> saves.take_failure(timeout=5) is None, sorted(written[0])
    (True, ['model'])
    """

    def __init__(self) -> None:
        self.writer = BackgroundWriter()
        self.buffers: Dict[str, Dict[Any, torch.Tensor]] = {}  # the snapshot's memory, by recoverable
        self.failed: Optional[BaseException] = None  # taken by the next call

    def start(self, name: str, states: Dict[str, Any], write: Callable[[Dict[str, Any]], None],
              timeout: float) -> None:
        """Snapshots ``states`` (recoverable name -> state_dict) now, then runs
        ``write(snapshots)`` in the background (it may clear them when done)."""
        snapshots = self.snapshot(states)
        self.writer.exit_timeout = timeout
        self.writer.start(lambda: write(snapshots), name)

    def save(self, folder: Any, dirname: str, meta: Dict[str, Any], write_now: Callable[[pathlib.Path], None],
             states: Callable[[], Dict[str, Any]], on_committed: Callable[[], None], timeout: float) -> None:
        """One checkpoint of ``folder`` (a :class:`ddp_eval.CheckpointFolder`):
        ``write_now(work)`` writes what cannot be snapshotted into the work
        directory, ``states()`` is snapshotted, and the background thread
        writes the snapshots, commits, then calls ``on_committed()``. Anything
        that fails before the commit leaves no trace but the error."""
        work = folder.begin(dirname)

        def write(snapshots: Dict[str, Any]) -> None:
            try:
                for name, state in snapshots.items():
                    torch.save(state, work / f"{name}{PARAMFILE_EXT}")
                snapshots.clear()  # free the copy before the commit's fsyncs
                folder.commit(work, dirname, meta)
            except BaseException:
                folder.abort(work)
                raise
            on_committed()

        try:
            write_now(work)
            self.start(str(folder.root / dirname), states(), write, timeout)
        except BaseException:
            folder.abort(work)
            raise

    def save_checkpoint(self, checkpointer: Any, dirname: str, meta: Dict[str, Any],
                        on_committed: Callable[[], None], timeout: float) -> None:
        """A checkpoint of a :class:`ddp_eval.Checkpointer` on its writer: the
        recoverables SpeechBrain saves as ``torch.save(state_dict())`` are
        snapshotted, the others (own savers, custom hooks) written during the
        call; the rest is :meth:`save`."""
        by_state_dict, own_savers = by_saver(checkpointer, list(checkpointer.recoverables))
        self.save(checkpointer.folder, dirname, meta,
                  write_now=lambda work: sb_compat.call_save_hooks(checkpointer, work, own_savers),
                  states=lambda: {n: checkpointer.recoverables[n].state_dict() for n in by_state_dict},
                  on_committed=on_committed, timeout=timeout)

    def snapshot(self, states: Dict[str, Any]) -> Dict[str, Any]:
        """In-memory copies of ``states``, or a ``MemoryError`` saying what is needed."""
        need = sum(state_bytes(s) for s in states.values()) - sum(
            t.untyped_storage().nbytes() for b in self.buffers.values() for t in b.values())
        available = available_memory_bytes()
        advice = (f"async_save needs one copy of the checkpointed state ({need / 2**20:.0f} MB of "
                  f"{', '.join(states)}) in CPU memory on the writer")
        if available is not None and need > available:
            raise MemoryError(f"{advice}, but only {available / 2**20:.0f} MB are available. Free "
                              "memory, or set async_save: false to write from the live state.")
        try:
            return {name: snapshot_state(state, self.buffers.setdefault(name, {})) for name, state in states.items()}
        except (MemoryError, RuntimeError) as exc:
            raise MemoryError(f"{advice}, and copying failed ({type(exc).__name__}: {exc}). Free memory, "
                              "or set async_save: false to write from the live state.") from exc

    def take_failure(self, timeout: float) -> Optional[BaseException]:
        """Waits for the save in flight; returns its failure (once) as an error, or None."""
        if self.writer.busy:
            name = self.writer.name
            failure = self.writer.wait(timeout)
            if failure is not None:
                late = isinstance(failure, TimeoutError)
                self.failed = RuntimeError(
                    f"the background save of checkpoint {name} "
                    f"{'did not finish in time' if late else 'failed'}: {type(failure).__name__}: {failure}. "
                    "The previous checkpoints are intact; this call did nothing. "
                    + ("Raise the checkpointer's timeout, or check the storage." if late
                       else "Check the storage (space, permissions) and the save hooks."))
                self.failed.__cause__ = failure
        failed, self.failed = self.failed, None
        return failed


@atexit.register
def _finish_at_exit() -> None:
    for writer in list(_writers):
        if writer.busy:
            name = writer.name
            error = writer.wait(writer.exit_timeout)
            if error is not None:
                logger.error(f"ddp_eval: at exit, the background save {name} failed: "
                             f"{type(error).__name__}: {error}")
