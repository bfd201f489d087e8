"""What a sharded stage's batches do beyond the Brain's attributes, and the
cross-rank checks that name what could not be merged.

* :class:`StageOutputs`: per-batch files (SLURP appends every TEST batch's
  predictions to ``predictions.jsonl``): each rank appends to a part file of
  its own (:meth:`ddp_eval.DDPEvalMixin.stage_output`); what each batch added is
  cut by file size and, at stage end, the writer appends every rank's parts to
  the real file in global batch order, as one process would have.
* :class:`AppendWatch`: any other file opened for appending during a sharded
  stage (an audit hook of the ``open`` event) is named at stage end.
* :func:`main_only`: an attribute or metric changed by every batch of rank 0
  and by none of the other ranks' batches: a per-batch effect under ``if
  if_main_process():`` (BEST-RQ appends its accuracy so), which sharding
  leaves with rank 0's batches only.

Example
-------
>>> main_only({"acc": [3, 0, 0]}, batches=[3, 2, 2])
['acc']
>>> main_only({"acc": [1, 0]}, batches=[1, 1])  # one batch each: the data may explain it
[]
>>> main_only({"acc": [3, 1, 0]}, batches=[3, 2, 2])
[]
"""

import array
import os
import pathlib
import sys
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ddp_eval.state import as_chunks, growth_since

PART_SUFFIX = ".ddp_eval-part"


class StageOutputs:
    """The per-batch files of one sharded stage on this rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.parts: Dict[str, pathlib.Path] = {}  # target path -> this rank's part
        self.sizes: Dict[str, array.array] = {}  # target -> batch, size after it, ...
        self.shrunk: Dict[str, str] = {}

    def part(self, path: Any) -> str:
        """This rank's part of ``path`` (made empty at its first use in the stage)."""
        target = os.fspath(path)
        if target not in self.parts:
            part = pathlib.Path(f"{target}{PART_SUFFIX}{self.rank}")
            part.unlink(missing_ok=True)  # a leftover of an interrupted run
            self.parts[target], self.sizes[target] = part, array.array("q")
        return os.fspath(self.parts[target])

    def after_batch(self, batch: int) -> None:
        """Notes the size of every part (one ``stat`` each)."""
        for target, part in self.parts.items():
            size = part.stat().st_size if part.exists() else 0
            sizes = self.sizes[target]
            before = sizes[-1] if sizes else 0
            if size < before:
                self.shrunk[target] = "it was opened for writing, not appending, so earlier batches' lines were lost"
            elif size > before:
                sizes.extend((batch, size))

    def state(self, positions: Sequence[float], from_batch: int = 0) -> Dict[str, Any]:
        """``{target: chunks of bytes}``: what this rank's batches appended, per batch."""
        state = {}
        for target, part in self.parts.items():
            batches, bounds = growth_since(self.sizes[target], from_batch, 0)
            if not batches:
                continue
            data = part.read_bytes()
            chunks = [data[a:b] for a, b in zip(bounds, bounds[1:])]
            state[target] = as_chunks(positions, batches, [0] + list(range(1, len(chunks) + 1)), chunks)
        return state

    def remove_parts(self) -> None:
        for part in self.parts.values():
            part.unlink(missing_ok=True)


def write_outputs(merged: Mapping[str, List[bytes]]) -> None:
    """On the writer: appends each target's merged bytes to it."""
    for target, chunks in merged.items():
        with open(target, "ab") as f:
            f.write(b"".join(chunks))


class AppendWatch:
    """Files opened for appending while batches of a sharded stage run on this
    rank, by the thread that runs them (``sys.addaudithook``; the hook does
    nothing between stages, nor for a data-loading or logging thread)."""

    active: Optional["AppendWatch"] = None
    _installed = False

    def __init__(self) -> None:
        self.paths: Dict[str, None] = {}  # in the order first opened
        self.thread: Optional[int] = None  # the batch loop's thread

    def __enter__(self) -> "AppendWatch":
        if not AppendWatch._installed:
            sys.addaudithook(_audit)
            AppendWatch._installed = True
        self.thread = threading.get_ident()
        AppendWatch.active = self
        return self

    def __exit__(self, *exc) -> None:
        AppendWatch.active = None

    def opened(self, path: Any, mode: Any, flags: Any) -> None:
        appends = (isinstance(mode, str) and "a" in mode) or (isinstance(flags, int) and flags & os.O_APPEND)
        if appends and isinstance(path, (str, bytes, os.PathLike)):
            name = os.fsdecode(path)
            if PART_SUFFIX not in name:
                self.paths[name] = None


def _audit(event: str, args: Tuple[Any, ...]) -> None:
    watch = AppendWatch.active
    if watch is not None and event == "open" and len(args) == 3 and threading.get_ident() == watch.thread:
        watch.opened(*args)


def main_only(changed: Mapping[str, Sequence[int]], batches: Sequence[int]) -> List[str]:
    """Labels changed in each of rank 0's batches (at least two) and in none of
    the other ranks' (at least two in all): a main-process-only effect."""
    if not batches or batches[0] < 2 or sum(batches[1:]) < 2:
        return []
    return sorted(label for label, counts in changed.items()
                  if counts[0] == batches[0] and not any(counts[1:]))
