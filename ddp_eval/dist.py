"""Every ``torch.distributed`` call of ddp_eval lives in this module.

Each function has a one-line single-process fallback, so the rest of the
package never asks "am I distributed?" itself.

Two kinds of communication are used:

* **Control exchanges** (:func:`exchange`): small envelopes ``(tag, payload,
  error)`` posted by every rank to the rendezvous store and read back by all.
  Every wait is bounded by a timeout; a timeout names the ranks that did not
  arrive; an envelope carrying an error makes every rank raise at once; ranks
  that reached different synchronisation points (different tags) raise
  :class:`OutOfStepError` instead of deadlocking.
* **Data collectives** (:func:`all_reduce_sum`, :func:`all_gather_object`):
  issued only right after a successful exchange, so every rank is known to be
  present and at the same point.

Example
-------
>>> exchange("no process group: returns the local payload", payload=3)
[3]
>>> all_reduce_sum([1.5, 2.0])
[1.5, 2.0]
"""

import datetime
import os
import pickle
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from ddp_eval.errors import (
    CollectiveTimeoutError,
    DDPEvalError,
    OutOfStepError,
    RankFailedError,
)

DEFAULT_TIMEOUT_S = 600.0
_timeout_s = DEFAULT_TIMEOUT_S
_seq = 0
_KEY_PREFIX = "ddp_eval"


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


def _inside_single_rank_section() -> bool:
    # SpeechBrain's run_on_main / main_process_only run code on one rank only;
    # a collective there would wait for ranks that never come.
    from speechbrain.utils import distributed as sb_dist

    return sb_dist.MAIN_PROC_ONLY >= 1 or sb_dist.NODE_ONCE_ONLY >= 1


def _active() -> bool:
    return (
        is_initialized()
        and dist.get_world_size() > 1
        and not _inside_single_rank_section()
    )


@dataclass
class _Envelope:
    tag: str
    payload: Any = None
    error: Optional[str] = None  # "ExcType: message" of the failing rank
    error_traceback: Optional[str] = None


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _store():
    # The default store is the rendezvous store of the process group (torchrun's
    # agent store, a TCPStore or a FileStore); it outlives a crashed peer and
    # supports bounded waits, unlike a collective.
    return dist.distributed_c10d._get_default_store()


def _key(seq: int, rank: int) -> str:
    return f"{_KEY_PREFIX}/{seq}/{rank}"


def _post(envelope: _Envelope) -> int:
    global _seq
    _seq += 1
    _store().set(_key(_seq, get_rank()), pickle.dumps(envelope))
    return _seq


def exchange(
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
        A local failure to report. It is posted for the other ranks, which
        raise :class:`RankFailedError`, and re-raised here without waiting.
    timeout : float, optional
        Seconds to wait for the other ranks (default: :func:`get_timeout`).

    Returns
    -------
    list
        The payloads of ranks ``0 .. world_size - 1``.

    Example
    -------
    >>> exchange("single process", payload={"a": 1})
    [{'a': 1}]
    """
    if not _active():
        if error is not None:
            raise error
        return [payload]
    if error is not None:
        _post(
            _Envelope(
                tag, None, _describe(error), "".join(traceback.format_exception(error))
            )
        )
        raise error
    seq = _post(_Envelope(tag, payload))
    store, world = _store(), get_world_size()
    keys = [_key(seq, r) for r in range(world)]
    timeout = _timeout_s if timeout is None else timeout
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # DistStoreError / RuntimeError on timeout
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        error = CollectiveTimeoutError(
            f"ddp_eval: rank {get_rank()} waited {timeout:g} s at '{tag}' "
            f"(sync #{seq}); expected all {world} ranks, ranks that did not "
            f"arrive: {missing}. Check their logs; if they are only slow, raise "
            "the collective timeout (ddp_eval: collective_timeout)."
        )
        # A rank arriving late must not take our envelope for a go-ahead.
        store.set(_key(seq, get_rank()), pickle.dumps(_Envelope(tag, None, _describe(error))))
        raise error from exc
    envelopes = [pickle.loads(store.get(k)) for k in keys]
    if seq > 1:  # every rank has read our previous envelope once all posted this one
        store.delete_key(_key(seq - 1, get_rank()))
    failed = [(r, e) for r, e in enumerate(envelopes) if e.error is not None]
    if failed:
        first_rank, first = failed[0]
        raise RankFailedError(
            f"ddp_eval: rank {first_rank} failed at '{first.tag}' with "
            f"{first.error} (this is rank {get_rank()}, at '{tag}'). All ranks "
            f"stop here; failed ranks: {[r for r, _ in failed]}. Rank "
            f"{first_rank}'s traceback:\n{first.error_traceback}"
        )
    tags = [e.tag for e in envelopes]
    if len(set(tags)) > 1:
        raise OutOfStepError(
            "ddp_eval: ranks reached different synchronisation points "
            f"(sync #{seq}); expected one tag, got per rank: {tags}. A rank took "
            "a different branch (e.g. saved a checkpoint only under a "
            "rank-dependent condition); make the decision on rank 0 and "
            "broadcast it, or call the method on every rank."
        )
    return [e.payload for e in envelopes]


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
        if _active() and not isinstance(error, DDPEvalError):
            _post(
                _Envelope(
                    tag, None, _describe(error), "".join(traceback.format_exception(error))
                )
            )
        raise


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


def all_gather_object(obj: Any) -> List[Any]:
    """Gathers a picklable object of any size from every rank, in rank order."""
    if not _active():
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
