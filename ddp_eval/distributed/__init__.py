"""Every ``torch.distributed`` call of ddp_eval lives in this package: the control
plane and collectives here, FSDP in :mod:`ddp_eval.distributed.fsdp`, sharded
checkpoint I/O in :mod:`ddp_eval.distributed.dcp`.

Each function has a one-line single-process fallback, so the rest of the
package never asks "am I distributed?" itself.

Two kinds of communication are used:

* **Control exchanges** (:class:`ControlChannel`, :func:`exchange`): small
  envelopes ``(tag, payload)`` gathered through the rendezvous store. Rank 0
  coordinates: it alone reads the N envelopes and posts one answer that every
  other rank reads, so an exchange costs O(N) store requests. Every wait is
  bounded; a timeout names the ranks that did not arrive; a rank that fails
  writes its error straight into the answer, so every rank raises at once;
  ranks at different synchronisation points (different tags) raise
  :class:`OutOfStepError` instead of deadlocking. Keys belong to one
  incarnation of the process group, so a job restarted by ``torchrun
  --max-restarts`` never reads an answer of an earlier attempt.
* **Data collectives** (:func:`all_reduce_sum`, :func:`all_gather_bytes`,
  :func:`broadcast_tensors`): issued only right after a successful exchange,
  so every rank is known to be present and at the same point.

Example
-------
>>> exchange("no process group: returns the local payload", payload=3)
[3]
>>> all_reduce_sum([1.5, 2.0])
[1.5, 2.0]
"""

import atexit
import datetime
import logging
import os
import pickle
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ddp_eval import sb_compat
from ddp_eval.errors import (
    CollectiveTimeoutError,
    DDPEvalError,
    OutOfStepError,
    RankFailedError,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
KEY_PREFIX = "ddp_eval"
# If the coordinator is missing, rank 1 reports it REPORT_GRACE_S after the
# timeout, rank 2 (if rank 1 is missing too) after twice that, and so on up to
# _BACKUPS steps: waits of many TCPStore clients that expire together stall
# some of them for 5-10 s, so in the usual case only one wait ever expires.
REPORT_GRACE_S = 0.5
_BACKUPS = 8
_timeout_s = DEFAULT_TIMEOUT_S
WAIT_SLICE_S = 2.0  # the longest single store wait (ControlChannel._wait)
_DECIDED = 1 << 40  # added to an exchange's arrival count once a failure is decided


def shared_store_restart_warning(environ: Optional[dict] = None) -> Optional[str]:
    """The warning for a torchrun job that may restart on torch's shared agent store
    (on rank 0; None where it does not apply).

    After a worker dies, gloo re-creates the group from the dead attempt's
    addresses in the shared store and the restarted attempt can wait silently
    in ``init_process_group`` (docs/never-hangs.md).

    Example
    -------
    >>> env = {"RANK": "0", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True",
    ...        "TORCHELASTIC_RESTART_COUNT": "0"}
    >>> "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared_store_restart_warning(env)
    True
    >>> shared_store_restart_warning({**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) is None
    True
    """
    env = os.environ if environ is None else environ
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if (env.get("RANK", "0") != "0" or not restarts.isdigit() or int(restarts) == 0
            or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1"):
        return None
    count = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    now = (f" This attempt is restart {count} on that shared store: if nothing follows this line, it is that "
           "hang (stop the job, set the variable, start again; the newest complete checkpoint and the "
           "evaluation journal are kept)." if count.isdigit() and int(count) > 0 else "")
    return ("ddp_eval: torchrun may restart this job (--max-restarts " + restarts + ") and shares its agent "
            "store with the workers (torch's default). After a worker dies, gloo can fail to create the process "
            "group of the restarted attempt from the dead attempt's addresses, and that attempt then waits "
            "silently until torchrun gives up. Expected TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment "
            "of torchrun (a fresh store per attempt); see docs/never-hangs.md." + now)


def warn_shared_store_restarts() -> None:
    """Logs :func:`shared_store_restart_warning` once per process, at import:
    before the recipe creates its process group, where a restarted attempt hangs."""
    message = shared_store_restart_warning()
    if message is not None:
        logger.warning(message)


def set_timeout(seconds: float) -> None:
    """Sets how long any ddp_eval wait may block before it raises."""
    global _timeout_s
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {seconds!r}")
    _timeout_s = float(seconds)


def get_timeout() -> float:
    """Returns the current bound of every ddp_eval wait, in seconds."""
    return _timeout_s


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank, 0 without a process group."""
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    """Number of ranks, 1 without a process group."""
    return dist.get_world_size() if is_initialized() else 1


def get_local_rank() -> int:
    """Rank within the node (``LOCAL_RANK`` set by torchrun), 0 without a group."""
    return int(os.environ.get("LOCAL_RANK", "0")) if is_initialized() else 0


def _active() -> bool:
    return (
        is_initialized()
        and dist.get_world_size() > 1
        and not sb_compat.inside_single_rank_section()
    )


@dataclass
class _Envelope:
    tag: str
    payload: Any = None


def _reported(error: BaseException) -> BaseException:
    """Marks ``error`` as raised on every rank (by an exchange); returns it."""
    try:
        error._ddp_eval_raised_on_every_rank = True
    except AttributeError:  # an exception type without attributes: treated as local
        pass
    return error


def raised_on_every_rank(error: BaseException) -> bool:
    """Whether an exchange raised ``error``, so every rank raises it or a
    :class:`RankFailedError` naming it (it needs no reporting).

    Example
    -------
    >>> try:
    ...     exchange("single process", error=ValueError("boom"))
    ... except ValueError as error:
    ...     raised_on_every_rank(error), raised_on_every_rank(ValueError("local"))
    (True, False)
    """
    return getattr(error, "_ddp_eval_raised_on_every_rank", False)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class ControlChannel:
    """Bounded, O(N) control exchanges over a ``torch.distributed`` Store.

    Every rank posts one envelope ``(tag, payload)`` and bumps a counter; the
    last to arrive sets a ``ready`` key. Only the coordinator (rank 0) waits
    for it, reads the N envelopes in one request where the store has
    ``multi_get``, and posts one answer, identical payloads stored once; every
    other rank reads that answer. A rank that fails writes its error as the
    answer (``compare_set``: the first answer wins) and sets ``ready``, so
    every rank, coordinator included, raises at once.

    Arguments
    ---------
    store : torch.distributed.Store
        Any store shared by the ranks (TCPStore, FileStore, HashStore, PrefixStore).
    rank, world_size : int
        This rank and the number of ranks.
    namespace : str
        Key prefix; it must differ between incarnations of a job that share a
        store (see :func:`incarnation_namespace`).

    Example
    -------
    >>> import torch.distributed as dist
    >>> channel = ControlChannel(dist.HashStore(), rank=0, world_size=1, namespace="doc")
    >>> channel.exchange("a tag", payload=7)
    [7]
    """

    def __init__(self, store, rank: int, world_size: int, namespace: str = KEY_PREFIX) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.seq = 0
        self._last: Optional[Tuple[int, str]] = None  # (seq, verdict kind) of the newest exchange
        self._read_by_all = 0  # newest seq whose answer every rank is known to have read

    def _key(self, seq: int, name: str) -> str:
        return f"{self.namespace}/{seq}/{name}"

    def envelope_key(self, rank: int, seq: Optional[int] = None) -> str:
        """The store key of ``rank``'s envelope in exchange ``seq`` (default: this
        rank's next exchange); it exists once that rank has arrived there."""
        return self._key(self.seq + 1 if seq is None else seq, f"r{rank}")

    def exchange(
        self,
        tag: str,
        payload: Any = None,
        error: Optional[BaseException] = None,
        timeout: Optional[float] = None,
    ) -> List[Any]:
        """Gathers one small picklable payload from every rank, bounded in time.

        Arguments
        ---------
        tag : str
            Names the synchronisation point; all ranks must use the same tag.
        payload : object
            Small picklable object to share (it travels through the store).
        error : BaseException, optional
            A local failure to report. The other ranks raise
            :class:`RankFailedError` naming this rank; here it is re-raised
            without waiting.
        timeout : float, optional
            Seconds to wait for the other ranks (default: :func:`get_timeout`).

        Returns
        -------
        list
            The payloads of ranks ``0 .. world_size - 1``.
        """
        self.seq += 1
        seq, store = self.seq, self.store
        timeout = _timeout_s if timeout is None else timeout
        if error is not None:
            failed = ("failed", self.rank, tag, _describe(error),
                      "".join(traceback.format_exception(error)))
            verdict = self._decide(seq, failed)
            self._publish(seq, verdict)
            self._acknowledge(seq, verdict)
            if verdict[0] == "failed" and verdict[1] != self.rank and not isinstance(error, DDPEvalError):
                # Another rank failed first (e.g. this one's collective broke because that rank
                # left it): its failure is the one every rank names. ddp_eval's own errors are
                # decided alike on every rank (a batch plan, a divergence): each raises its own.
                try:
                    self._open(verdict, seq, tag)
                except RankFailedError as first:
                    raise first from error
            raise _reported(error)
        store.set(self._key(seq, f"r{self.rank}"), pickle.dumps(_Envelope(tag, payload)))
        arrived = store.add(self._key(seq, "count"), 1)
        if arrived == self.world_size:
            store.set(self._key(seq, "ready"), b"1")
        if arrived > self.world_size:  # a failure or a timeout was already decided
            answer = pickle.loads(store.get(self._key(seq, "verdict")))
        elif self.rank == 0:
            answer = self._coordinate(seq, tag, timeout)
        else:
            answer = self._await_answer(seq, tag, timeout)
        # The coordinator has read our envelope once a verdict exists.
        store.delete_key(self._key(seq, f"r{self.rank}"))
        self._acknowledge(seq, answer)
        return self._open(answer, seq, tag)

    def _acknowledge(self, seq: int, verdict: tuple) -> None:
        """Notes the verdict; other ranks tell the coordinator they have read it."""
        self._last = (seq, verdict[0])
        if self.rank != 0 and self.store.add(self._key(seq, "read"), 1) == self.world_size - 1:
            self.store.set(self._key(seq, "all_read"), b"1")

    def wait_for_readers(self, timeout: Optional[float] = None) -> bool:
        """On the coordinator: waits until every rank has read the newest answer.

        Call it before the coordinator's process leaves: a launcher that makes
        rank 0 host the store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
        ``srun`` with ``env://``, ``mp.spawn``) takes the store down with it,
        and a slower rank still reading the answer would fail with a
        connection reset. Returns at once on other ranks, after a timeout
        verdict (the missing ranks may never read), or when already known;
        False if the wait timed out.
        """
        if self.rank != 0 or self.world_size == 1 or self._last is None:
            return True
        seq, kind = self._last
        if kind == "timeout" or self._read_by_all == seq:
            return True
        if not self._wait(self._key(seq, "all_read"), _timeout_s if timeout is None else timeout):
            return False
        self._read_by_all = seq
        return True

    # Keys of exchange ``seq``: ``r<rank>`` envelopes, ``count`` arrivals,
    # ``ready`` (all arrived, or a verdict to read), ``verdict`` (decided once,
    # by compare_set: every rank acts on the same one) and ``answer``, the copy
    # that waiting ranks watch.

    def _decide(self, seq: int, verdict: tuple) -> tuple:
        """Proposes ``verdict``; returns the one that stands (the first proposed)."""
        return pickle.loads(self.store.compare_set(self._key(seq, "verdict"), "", pickle.dumps(verdict)))

    def _publish(self, seq: int, verdict: tuple) -> None:
        store = self.store
        if verdict[0] != "ok":
            store.add(self._key(seq, "count"), _DECIDED)  # late arrivals read the verdict
            store.set(self._key(seq, "ready"), b"1")  # wakes the coordinator
        store.set(self._key(seq, "answer"), pickle.dumps(verdict))

    def _wait(self, key: str, seconds: float) -> bool:
        """Whether ``key`` exists within ``seconds``: waits in slices of at most
        ``WAIT_SLICE_S``, checking the key between them, so a wake-up the store
        does not deliver delays a rank by one slice, not until the timeout (once,
        64 simulated ranks of one process under load waited 60 s for a key that
        was set; the cause was not found, the slices bound it)."""
        deadline = time.monotonic() + max(seconds, 0.001)
        while True:
            slice_s = min(deadline - time.monotonic(), WAIT_SLICE_S)
            try:
                self.store.wait([key], datetime.timedelta(seconds=max(slice_s, 0.001)))
                return True
            except Exception:  # DistStoreError / RuntimeError on timeout
                if self.store.check([key]):
                    return True
                if time.monotonic() >= deadline:
                    return False

    def _coordinate(self, seq: int, tag: str, timeout: float) -> tuple:
        store = self.store
        if not self._wait(self._key(seq, "ready"), timeout):
            verdict = self._decide(seq, self._missing(seq, tag, timeout))
        elif store.check([self._key(seq, "verdict")]):  # a failure woke us
            verdict = pickle.loads(store.get(self._key(seq, "verdict")))
        else:
            keys = [self._key(seq, f"r{r}") for r in range(self.world_size)]
            # Store.multi_get: torch >= 2.4 (every supported version); a custom store may lack it.
            blobs = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
            unique, index = {}, []
            for blob in blobs:
                index.append(unique.setdefault(bytes(blob), len(unique)))
            # All alike (most exchanges): no per-rank index, so the answer stays O(1).
            verdict = self._decide(seq, ("ok", list(unique), index if len(unique) > 1 else None))
        self._publish(seq, verdict)
        if seq > 1 and verdict[0] == "ok":  # every rank posted this exchange, so all have read the previous one
            for name in ("verdict", "answer", "count", "ready", "read", "all_read"):
                store.delete_key(self._key(seq - 1, name))
        return verdict

    def _await_answer(self, seq: int, tag: str, timeout: float) -> tuple:
        answer_key = self._key(seq, "answer")
        patience = timeout + REPORT_GRACE_S * min(self.rank, _BACKUPS)
        if self._wait(answer_key, patience):
            return pickle.loads(self.store.get(answer_key))
        # The coordinator (and lower backups) are missing. One elected rank names
        # the missing ranks (N requests, not N per rank).
        elected = self.store.add(self._key(seq, "reporter"), 1) == 1
        if not elected and self._wait(answer_key, REPORT_GRACE_S):
            return pickle.loads(self.store.get(answer_key))
        verdict = self._decide(seq, self._missing(seq, tag, timeout))
        self._publish(seq, verdict)
        return verdict

    def _missing(self, seq: int, tag: str, timeout: float) -> tuple:
        missing = [r for r in range(self.world_size)
                   if not self.store.check([self._key(seq, f"r{r}")])]
        return ("timeout", missing, tag, self.rank, timeout)

    def failure_posted(self) -> bool:
        """Whether another rank already reported a failure at this rank's next exchange
        (one store request; no wait)."""
        return self.store.check([self._key(self.seq + 1, "verdict")])

    def _open(self, answer: tuple, seq: int, tag: str) -> List[Any]:
        kind = answer[0]
        if kind == "failed":
            _, failed_rank, failed_tag, description, failed_traceback = answer
            raise _reported(RankFailedError(
                f"ddp_eval: rank {failed_rank} failed at '{failed_tag}' with "
                f"{description} (this is rank {self.rank}, at '{tag}'). All ranks "
                f"stop here. Rank {failed_rank}'s traceback:\n{failed_traceback}"
            ))
        if kind == "timeout":
            _, missing, reporter_tag, reporter, waited = answer
            message = (
                f"ddp_eval: rank {reporter} waited {waited:g} s at '{reporter_tag}' "
                f"(sync #{seq}); expected all {self.world_size} ranks, ranks that did "
                f"not arrive: {missing}. Check their logs; if they are only slow, "
                "raise the collective timeout (ddp_eval: collective_timeout)."
            )
            if self.rank in missing:  # arrived late: told instead of entering a dead collective
                raise _reported(RankFailedError(
                    f"ddp_eval: this rank ({self.rank}) arrived late at '{tag}'; the "
                    f"others gave up: CollectiveTimeoutError: {message}"
                ))
            raise _reported(CollectiveTimeoutError(message))
        _, unique, index = answer
        envelopes = [pickle.loads(blob) for blob in unique]
        index = [0] * self.world_size if index is None else index
        tags = [envelopes[i].tag for i in index]
        if len(set(tags)) > 1:
            raise _reported(OutOfStepError(
                "ddp_eval: ranks reached different synchronisation points "
                f"(sync #{seq}); expected one tag, got per rank: {tags}. A rank took "
                "a different branch (e.g. saved a checkpoint only under a "
                "rank-dependent condition); make the decision on rank 0 and "
                "broadcast it, or call the method on every rank."
            ))
        return [envelopes[i].payload for i in index]


def incarnation_namespace(group_generation: int) -> str:
    """Key prefix of one incarnation of the default process group.

    torchrun's agent store outlives the workers it restarts, so keys carry the
    run id, the restart count and the world size (from torchrun's environment)
    and how many default groups this process has created.

    Example
    -------
    >>> incarnation_namespace(1).count("/")
    4
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"{KEY_PREFIX}/{run_id}/{restart}/{get_world_size()}/{group_generation}"


_default = {"group": None, "channel": None, "generation": 0}


def default_channel() -> ControlChannel:
    """The channel of the current default process group (a new group, a new channel)."""
    group = dist.group.WORLD
    if _default["group"] is not group:
        _default["generation"] += 1
        # torch.distributed exposes no public getter of the group's store.
        store = dist.distributed_c10d._get_default_store()
        _default.update(group=group, channel=ControlChannel(
            store, dist.get_rank(), dist.get_world_size(),
            incarnation_namespace(_default["generation"])))
    return _default["channel"]


def exchange(
    tag: str,
    payload: Any = None,
    error: Optional[BaseException] = None,
    timeout: Optional[float] = None,
) -> List[Any]:
    """:meth:`ControlChannel.exchange` on the default group; ``[payload]`` alone.

    Example
    -------
    >>> exchange("single process", payload={"a": 1})
    [{'a': 1}]
    """
    if not _active():
        if error is not None:
            raise _reported(error)
        return [payload]
    return default_channel().exchange(tag, payload, error, timeout)


def decide(tag: str, step: Optional[Callable[[], Any]] = None, timeout: Optional[float] = None) -> List[Any]:
    """Runs ``step()`` here, then exchanges its result, or its exception, with
    every rank: returns every rank's result, or raises on every rank.

    The one way ddp_eval decides together (as ``torch.distributed.checkpoint``'s
    ``_DistWrapper``): a rank whose ``step`` raises reports the exception in
    the exchange and re-raises it; every other rank raises
    :class:`RankFailedError` naming it. An exception that an exchange inside
    ``step`` already raised on every rank is re-raised without another
    exchange. ``step`` may be None (a synchronisation point only) or return
    None on ranks with nothing to say.

    Example
    -------
    >>> decide("single process", lambda: 42)
    [42]
    >>> decide("fails", lambda: 1 / 0)
    Traceback (most recent call last):
    ...
    ZeroDivisionError: division by zero
    """
    result, error = None, None
    try:
        result = step() if step is not None else None
    except BaseException as exc:  # noqa: B036 - re-raised here or by the exchange
        if raised_on_every_rank(exc):
            raise
        error = exc
    return exchange(tag, result, error=error, timeout=timeout)


def settle(timeout: Optional[float] = None) -> None:
    """On rank 0: returns once every rank has read the newest exchange's answer.

    Called when ``fit()`` and ``evaluate()`` return and at interpreter exit,
    so rank 0, which may host the store, never leaves a rank reading the last
    answer from a store that is gone. Bounded by ``timeout`` (default: the
    collective timeout); a no-op on other ranks and without a process group.

    Example
    -------
    >>> settle()  # no process group: nothing to wait for
    """
    channel = _default["channel"]
    if channel is None or not is_initialized():
        return
    if not channel.wait_for_readers(timeout):
        logger.warning(f"ddp_eval: rank 0 waited {_timeout_s if timeout is None else timeout:g} s for "
                       "the other ranks to read the last control answer; leaving anyway.")


@atexit.register
def _settle_at_exit() -> None:
    """At interpreter exit: rank 0 waits for the last answer to be read; then the
    store client and, on a normal exit, the default process group are let go
    while the interpreter is whole. Left to its teardown, either aborted some
    runs after the script had finished ("terminate called without an active
    exception": the store client 1-2 runs in 8; gloo's worker threads still
    holding the tensors of a finished collective, in a recipe's torchrun run).
    SpeechBrain's recipes never destroy the group; PyTorch asks every script to,
    at its end. Not after an uncaught exception: peers may still be in a collective."""
    channel = _default["channel"]
    if channel is not None:  # the process group may be gone by now; the store is not
        channel.wait_for_readers()
    _default.update(channel=None, group=None)
    if channel is not None and is_initialized() and not hasattr(sys, "last_value"):
        try:
            dist.destroy_process_group()
        except Exception as error:  # leaving anyway: as if it had been left to teardown
            logger.warning(f"ddp_eval: destroying the process group at exit failed: {error!r}")


@contextmanager
def fail_together(tag: str) -> Iterator[None]:
    """Reports an exception raised in the block to every other rank.

    The other ranks raise :class:`RankFailedError` at their next
    :func:`exchange` instead of waiting for a collective that never completes.
    Errors that an exchange raised are not posted again.

    Example
    -------
    >>> with fail_together("nothing fails"):
    ...     x = 1
    """
    try:
        yield
    except BaseException as error:
        if _active() and not raised_on_every_rank(error):
            try:
                default_channel().exchange(tag, error=error)
            except RankFailedError as first:  # another rank failed first: named instead
                if first.__cause__ is error:
                    raise
            except BaseException:
                pass  # the original error is raised below
        raise


def wait_for_works(works: Sequence[Any], tag: str) -> None:
    """Waits for collectives issued with ``async_op=True``, bounded: raises
    :class:`CollectiveTimeoutError` after the collective timeout, and at once when
    another rank has reported a failure (a rank that fails before joining a
    collective leaves the others in it until the process group's own timeout;
    the next exchange, e.g. :func:`fail_together`'s, names that rank's failure).

    Example
    -------
    >>> wait_for_works([], "nothing issued")
    """
    if not _active():
        for work in works:
            work.wait()
        return
    channel, deadline, pause = default_channel(), time.monotonic() + _timeout_s, 0.001
    while not all(work.is_completed() for work in works):
        if channel.failure_posted():
            raise RuntimeError(f"ddp_eval: another rank reported a failure while this rank waited in '{tag}'")
        if time.monotonic() > deadline:
            raise _reported(CollectiveTimeoutError(
                f"ddp_eval: rank {channel.rank} waited {_timeout_s:g} s in '{tag}'; expected every rank to join its "
                "collective, and no rank reported a failure. Check the other ranks' logs; if they are only slow, "
                "raise the collective timeout (ddp_eval: collective_timeout)."))
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    for work in works:
        work.wait()


def _device() -> torch.device:
    if dist.get_backend() == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: Sequence[float]) -> List[float]:
    """Sums float64 values over ranks with ``all_reduce``; identity without a group."""
    if not _active():
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.cpu().tolist()


def all_gather_bytes(*parts: bytes) -> List[List[memoryview]]:
    """Gathers byte strings of any size from every rank, in rank order: for each
    rank, the list of its ``parts``.

    The answers are views into one buffer (unpickle them straight from it):
    besides that buffer (N times the longest rank's parts) only one padded copy
    of the parts is made, fewer copies than ``all_gather_object``.

    Example
    -------
    >>> [[bytes(view) for view in views] for views in all_gather_bytes(b"alone", b"")]
    [[b'alone', b'']]
    """
    if not _active():
        return [[memoryview(part) for part in parts]]
    device, world = _device(), dist.get_world_size()
    size = torch.tensor([len(part) for part in parts], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    sizes = [[int(n) for n in s.cpu()] for s in sizes]
    longest = max(sum(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    view, offset = memoryview(padded.numpy()), 0
    for part in parts:
        view[offset: offset + len(part)] = part
        offset += len(part)
    gathered = torch.empty(world * longest, dtype=torch.uint8, device=device)
    dist.all_gather(list(gathered.split(longest)), padded.to(device))
    del padded, view
    flat = memoryview(gathered.cpu().numpy())
    out = []
    for rank, rank_sizes in enumerate(sizes):
        offset, views = rank * longest, []
        for n in rank_sizes:
            views.append(flat[offset: offset + n])
            offset += n
        out.append(views)
    return out


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrites ``tensors`` in place with rank ``src``'s values; no-op alone.

    One broadcast per dtype and device (the tensors are flattened together).
    """
    if not _active() or not tensors:
        return
    groups = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        device = flat.device
        flat = flat.to(_device())
        dist.broadcast(flat, src=src)
        flat = flat.to(device)
        offset = 0
        with torch.no_grad():
            for tensor in group:
                tensor.copy_(flat[offset: offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def broadcast_ddp_buffers(modules: Sequence[torch.nn.Module]) -> None:
    """Brings the buffers of DDP-wrapped ``modules`` into step from rank 0.

    Called on every rank at the start of a sharded stage, right after the
    stage-start exchange (every rank is there). DDP broadcasts buffers at the
    first forward after a training step, a collective that a rank without a
    batch would never join; instead they are broadcast here, once, and DDP's
    pending per-forward sync is cleared, as DDP itself does after any forward
    without grad. Rank 0's buffers are the ones its checkpoint holds, so every
    rank evaluates the checkpointed model.
    """
    wrapped = [m for m in modules if isinstance(m, torch.nn.parallel.DistributedDataParallel)]
    buffers = [b for m in wrapped for b in m.module.buffers()]
    if not _active() or not buffers:
        return
    broadcast_tensors(buffers, src=0)
    for module in wrapped:
        # Checked by DDP's will_sync_module_buffers in torch 2.4 to 2.14 alike (next to
        # broadcast_buffers up to 2.x, forward_sync_buffers in newer releases).
        module.require_forward_param_sync = False
