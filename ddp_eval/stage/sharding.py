"""Splitting evaluation batches across ranks, each sample evaluated once.

Batches, not samples, are sharded: every rank builds the same batches as one
process would (same batch size, same sorting, same ``DynamicBatchSampler``) and
keeps its share. Batch contents, padding and per-batch losses are therefore
exactly those of a single-process run. The share is dealt like cards, in a
snake order (0, 1, 1, 0, 0, 1, ...), so that with length-sorted data (the
SpeechBrain default) no rank always gets the longer batch of each round.

Example
-------
>>> shard_batches(7, rank=0, world_size=3)
[0, 5, 6]
>>> shard_batches(7, rank=2, world_size=3)
[2, 3]
>>> shard_batches(1, rank=1, world_size=2)
[]
"""

import array
import hashlib
import itertools
import zlib
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from speechbrain.dataio.dataloader import LoopedLoader
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler

from ddp_eval import distributed as dist
from ddp_eval.errors import BatchPlanError, ConfigError
from ddp_eval.stage._draws import WorkerDraws


def batch_owner(index: int, world_size: int) -> int:
    """Rank that evaluates global batch ``index`` (snake order over rounds)."""
    round_, seat = divmod(index, world_size)
    return seat if round_ % 2 == 0 else world_size - 1 - seat


def shard_batches(num_batches: int, rank: int, world_size: int) -> List[int]:
    """Global indices of the batches that ``rank`` evaluates, in order."""
    return [i for i in range(num_batches) if batch_owner(i, world_size) == rank]


def batch_ids_digest(batch: Any) -> Optional[str]:
    """A digest of a batch's utterance ids (``batch.id``), None without ids."""
    ids = getattr(batch, "id", None)
    return None if ids is None else hashlib.sha1(repr(list(ids)).encode()).hexdigest()[:16]


class BatchLedger:
    """What a stage's batches held, batch by batch, in the order they were built:
    a running digest of their utterance ids (or indices), and per batch a crc32,
    its size and its first ids, to name the first batch where two ranks differ.

    Example
    -------
    >>> a, b = BatchLedger(), BatchLedger()
    >>> a.add(["u1", "u2"]); a.add(["u3"]); b.add(["u1", "u2"]); b.add(["u4"])
    >>> a.summary() == b.summary(), first_difference([a.crcs, b.crcs]), b.held(1)
    (False, 1, "1 item(s): ['u4']")
    """

    def __init__(self) -> None:
        self._digest = hashlib.sha1()
        self.crcs = array.array("L")
        self._heads: List[Tuple[int, str]] = []

    def add(self, names: Sequence[Any]) -> None:
        text = repr(list(names)).encode()
        self._digest.update(text)
        self.crcs.append(zlib.crc32(text))
        self._heads.append((len(names), ", ".join(map(repr, names[:3]))[:80]))

    def __len__(self) -> int:
        return len(self.crcs)

    def summary(self) -> Tuple[int, str]:
        """``(number of batches, digest)``, compared across ranks."""
        return len(self.crcs), self._digest.hexdigest()[:20]

    def held(self, position: int) -> str:
        """What batch ``position`` held, in a few words."""
        if position >= len(self._heads):
            return "no such batch"
        size, head = self._heads[position]
        return f"{size} item(s): [{head}{', ...' if size > 3 else ''}]"


def first_difference(per_rank: Sequence[Sequence[int]]) -> int:
    """The first position where the ranks' per-batch crcs differ (or one ends)."""
    longest = max(len(c) for c in per_rank)
    return next(p for p in range(longest + 1)
                if len({c[p] if p < len(c) else None for c in per_rank}) > 1)


def check_same_batches(what: str, summaries: Sequence[Tuple[int, str]], ledger: BatchLedger) -> None:
    """Raises :class:`BatchPlanError` on every rank if the ranks built different
    batches. Collective when they differ (two more exchanges that name the
    first differing batch and what each rank held there); free otherwise."""
    if len(set(summaries)) == 1:
        return
    crcs = dist.exchange(f"{what}: batches differ", ledger.crcs.tobytes())
    position = first_difference([array.array("L", blob) for blob in crcs])
    held = dist.exchange(f"{what}: batch {position}", ledger.held(position))
    counts = ", ".join(f"rank {r}: {n}" for r, (n, _) in enumerate(summaries))
    raise BatchPlanError(
        f"ddp_eval: {what}: the ranks built different batches, so some utterances would be "
        f"evaluated twice and others never. Expected every rank to build the batches one process "
        f"would, in the same order. Batches built: {counts}; the first that differs is batch "
        f"{position}: " + "; ".join(f"rank {r} held {h}" for r, h in enumerate(held)) + ". A sampler "
        "that depends on the rank or on an unseeded random generator, or whose state advanced "
        "differently on some rank (set_epoch, a pass of its own), does this: seed it the same "
        "way on every rank, call set_epoch on every rank, or set shard_valid/shard_test: false."
    )


class BatchPlan:
    """The batches of one pass of a batch sampler, built once and kept compact
    (one flat array of indices), with their :class:`BatchLedger`.

    Example
    -------
    >>> plan = BatchPlan([[0, 1], [2]], names=["a", "b", "c"])
    >>> len(plan), plan[1], plan.ledger.held(0)
    (2, [2], "2 item(s): ['a', 'b']")
    """

    def __init__(self, batches: Iterable[Sequence[int]], names: Optional[Sequence[Any]] = None) -> None:
        self.ledger = BatchLedger()
        self._flat, self._ends, self._other = array.array("q"), array.array("q"), None
        for batch in batches:
            batch = list(batch)
            self.ledger.add([names[i] for i in batch] if names is not None else batch)
            if self._other is None and all(type(i) is int for i in batch):
                self._flat.extend(batch)
                self._ends.append(len(self._flat))
            else:  # indices that are not ints (a sampler of keys): kept as they are
                self._other = [self[i] for i in range(len(self._ends))] if self._other is None else self._other
                self._other.append(batch)

    def __len__(self) -> int:
        return len(self._other) if self._other is not None else len(self._ends)

    def __getitem__(self, position: int) -> List[Any]:
        if self._other is not None:
            return self._other[position]
        start = self._ends[position - 1] if position else 0
        return self._flat[start: self._ends[position]].tolist()


class ShardedBatchSampler(Sampler):
    """Yields this rank's share of the batches of another batch sampler.

    The batches of one pass of ``batch_sampler`` are built once per stage
    (:meth:`new_plan`, called at stage start by the mixin, else by the
    iteration itself), so the sampler is iterated as often as one process
    iterates it; dealing, the journal and the cross-rank check all read that
    one plan.

    Arguments
    ---------
    batch_sampler : iterable of lists of indices
        The batch sampler one process would use (e.g. ``BatchSampler`` or
        SpeechBrain's ``DynamicBatchSampler``); it must yield the same batches
        on every rank (this is checked at the start of every sharded stage).
    rank : int, optional
        Defaults to the global rank.
    world_size : int, optional
        Defaults to the number of ranks.
    names : sequence, optional
        Item names by index (e.g. a ``DynamicItemDataset``'s ``data_ids``), for
        the ledger; default: the indices.

    Example
    -------
    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> batches = BatchSampler(SequentialSampler(range(5)), 2, drop_last=False)
    >>> list(ShardedBatchSampler(batches, rank=1, world_size=2))
    [[2, 3], [4]]
    """

    def __init__(
        self,
        batch_sampler: Iterable[List[int]],
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        names: Optional[Sequence[Any]] = None,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.names = names
        self.done: frozenset = frozenset()
        self.plan: Optional[BatchPlan] = None  # of the current stage
        self._plan_unread = False  # new_plan() made it and no iteration has read it yet
        self.listener: Optional[Any] = None  # told when reading starts (listen())

    def new_plan(self, limit: Optional[int] = None) -> BatchPlan:
        """Builds this stage's batches: one pass of the batch sampler (its first
        ``limit`` batches only, as a debug run stops early); forgets ``skip``."""
        batches = iter(self.batch_sampler)
        self.plan = BatchPlan(batches if limit is None else itertools.islice(batches, limit), self.names)
        self.done, self._plan_unread = frozenset(), True
        return self.plan

    def skip(self, done: Iterable[int]) -> None:
        """From now on, deal only the batches not in ``done`` (global positions),
        in the same snake order (a resumed evaluation; empty: every batch)."""
        self.done = frozenset(done)

    def __iter__(self) -> Iterator[List[int]]:
        if not self._plan_unread:  # iterated again, or outside a stage: one more pass, as one process
            self.new_plan()
        self._plan_unread = False
        if self.listener is not None:
            self.listener.reading()
        plan = self.plan
        for index in self.global_batch_ids():
            yield plan[index]

    def __len__(self) -> int:
        return len(self.global_batch_ids())

    def global_batch_ids(self) -> List[int]:
        """Global position of each batch this rank yields from the current plan (before
        any: from the batch sampler's length), in order."""
        total = len(self.plan) if self.plan is not None else len(self.batch_sampler)
        if not self.done:
            return shard_batches(total, self.rank, self.world_size)
        remaining = [i for i in range(total) if i not in self.done]
        return [remaining[k] for k in shard_batches(len(remaining), self.rank, self.world_size)]

    def set_epoch(self, epoch: int) -> None:
        """Forwards ``set_epoch`` (e.g. to a ``DynamicBatchSampler``)."""
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)


class _Dealt:
    """What a sharded stream does: every rank reads every batch (one process's
    batches), keeps its share dealt in snake order, records the position and an
    ids digest of each batch it keeps, and a ledger of all it read."""

    def _start_dealing(self, split: str, rank: Optional[int], world_size: Optional[int]) -> None:
        self.split = split
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.limit: Optional[int] = None  # read at most this many batches (a debug run)
        self._yielded: List[int] = []
        self.ledger = BatchLedger()  # every batch read by the latest iteration
        self.digests: Dict[int, Optional[str]] = {}  # position -> digest of its ids, of batches yielded
        self.done: frozenset = frozenset()
        self._expected: Dict[int, Optional[str]] = {}
        self.listener: Optional[Any] = None  # told when reading starts and of each batch yielded (listen())

    def skip(self, done: Iterable[int], expected: Optional[Dict[int, Optional[str]]] = None) -> None:
        """From now on, read past the batches in ``done`` without yielding them
        (``split="batches"`` only), checking their ids against ``expected``
        digests, and deal the others in snake order (a resumed evaluation)."""
        self.done, self._expected = frozenset(done), dict(expected or {})

    def _deal(self, batches: Iterable[Any]) -> Iterator[Any]:
        if self.listener is not None:
            self.listener.reading()
        self._yielded = yielded = []
        self.digests, self.ledger = {}, BatchLedger()
        remaining = 0
        for index, batch in enumerate(batches):
            if self.limit is not None and index >= self.limit:
                break
            ids = getattr(batch, "id", None)
            self.ledger.add(list(ids) if ids is not None else [])  # without ids: the count only
            if self.split == "by_dataset":
                yielded.append(index)
                if self.listener is not None:
                    self.listener.handing(index)
                yield batch
                continue
            if index in self.done:
                self._check(index, batch)
                continue
            if batch_owner(remaining, self.world_size) == self.rank:
                yielded.append(index)
                self.digests[index] = batch_ids_digest(batch)
                if self.listener is not None:
                    self.listener.handing(index)
                yield batch
            remaining += 1

    def _check(self, index: int, batch) -> None:
        expected = self._expected.get(index)
        found = batch_ids_digest(batch)
        if expected is not None and found is not None and found != expected:
            raise ConfigError(
                f"ddp_eval: resuming from a journal, the stream's batch {index} holds other utterances "
                f"than when it was journaled (ids digest {found}, journal {expected}); expected the same "
                "stream, read in the same order. Delete the journal (ddp_eval: resume_eval_dir, or "
                ".ddp_eval-journal in the checkpoints folder) or set resume_eval: false."
            )

    def __len__(self) -> int:
        raise TypeError("a sharded stream has no length before it is read")

    def global_batch_ids(self) -> List[int]:
        """Position of each batch yielded by the latest iteration, in yield order."""
        return list(self._yielded)


class ShardedStreamLoader(_Dealt, DataLoader):
    """A DataLoader over an ``IterableDataset`` that yields this rank's batches.

    With ``split="batches"`` every rank iterates the whole stream, so it builds
    the batches one process would, and keeps its share, dealt as for map-style
    sets: exact, but every rank reads and decodes everything. With
    ``split="by_dataset"`` the dataset already yields a different part on each
    rank (e.g. ``wds.split_by_node``) and every batch is kept. Either way the
    position of each yielded batch is recorded for the merge.
    """

    def __init__(self, loader: DataLoader, split: str = "batches",
                 rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        super().__init__(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last,
                         **_worker_options(loader))
        self._start_dealing(split, rank, world_size)

    def __iter__(self):
        return self._deal(DataLoader.__iter__(self))


class ShardedLoopedLoader(_Dealt, LoopedLoader):
    """SpeechBrain's ``LoopedLoader`` (a nominal epoch of ``epoch_length``
    batches of an endless loader), sharded as a stream: every rank steps the
    loader through the whole nominal epoch, as one process would, and keeps
    its share of the batches."""

    def __init__(self, looped: LoopedLoader, rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        self.looped = looped
        self._start_dealing("batches", rank, world_size)

    def __iter__(self):
        return self._deal(iter(self.looped))

    def __getattr__(self, name: str) -> Any:  # loader, step, epoch_length, ... of the looped loader
        if name == "looped":
            raise AttributeError(name)
        return getattr(self.looped, name)


def listen(loader, listener: Optional[Any]) -> None:
    """From now on, ``listener.reading()`` when a sharded ``loader`` starts reading a
    pass (after its iterator drew its seed), and ``listener.handing(position)`` right
    before a stream yields a batch (None: no more)."""
    (loader if is_stream(loader) else loader.batch_sampler).listener = listener


def is_stream(loader) -> bool:
    """Whether ``loader`` is sharded as a stream (read whole on every rank, or by dataset)."""
    return isinstance(loader, _Dealt)


def is_sharded(loader) -> bool:
    """Whether ``loader`` was sharded by :func:`shard_dataloader`."""
    return is_stream(loader) or isinstance(getattr(loader, "batch_sampler", None), ShardedBatchSampler)


def new_plan(loader, limit: Optional[int] = None) -> Optional[BatchPlan]:
    """At the start of a sharded stage: builds the batches of a map-style
    ``loader`` (its first ``limit``, as a debug run evaluates); a stream's
    batches are known only as it is read (None; it stops after ``limit``)."""
    if is_stream(loader):
        loader.limit = limit
        return None
    return loader.batch_sampler.new_plan(limit)


def describe_loader(loader, stage_name: str) -> str:
    """``the VALID loader (DynamicBatchSampler)``: how errors name a loader."""
    if isinstance(loader, ShardedLoopedLoader):
        inner = loader.looped
    elif is_stream(loader):
        inner = loader.dataset
    else:
        inner = loader.batch_sampler.batch_sampler
    inner = getattr(inner, "sampler", inner) if type(inner).__name__ == "BatchSampler" else inner
    return f"the {stage_name} loader ({type(inner).__name__})"


def global_batch_ids(loader) -> List[int]:
    """Global position of each batch a sharded ``loader`` yielded (streams) or yields."""
    if is_stream(loader):
        return loader.global_batch_ids()
    return loader.batch_sampler.global_batch_ids()


def _worker_options(loader: DataLoader) -> dict:
    options = dict(collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                   pin_memory=loader.pin_memory, timeout=loader.timeout,
                   worker_init_fn=loader.worker_init_fn,
                   multiprocessing_context=loader.multiprocessing_context,
                   generator=loader.generator)
    if loader.num_workers > 0:  # the workers' random draws are noted (ddp_eval.stage._draws)
        draws = WorkerDraws(loader.collate_fn, loader.worker_init_fn, loader.num_workers)
        options.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                       collate_fn=draws, worker_init_fn=draws.worker_init_fn)
    return options


def shard_dataloader(loader: DataLoader, split: str = "batches") -> DataLoader:
    """Returns a copy of ``loader`` that yields only this rank's batches.

    Use it to shard a ready DataLoader that you pass to ``fit(valid_set=...)``
    or ``evaluate(...)`` yourself (those are left alone otherwise). A loader
    over an ``IterableDataset`` becomes a :class:`ShardedStreamLoader` (``split``
    as there). A loader that cannot be sharded consistently raises
    :class:`ConfigError`.

    Example
    -------
    >>> loader = DataLoader(list(range(5)), batch_size=2)
    >>> [b.tolist() for b in shard_dataloader(loader)]  # one process: unchanged
    [[0, 1], [2, 3], [4]]
    """
    if is_sharded(loader):
        return loader
    if isinstance(loader, LoopedLoader):
        return ShardedLoopedLoader(loader)
    if isinstance(loader.dataset, IterableDataset):
        return ShardedStreamLoader(loader, split)
    sampler = getattr(loader.batch_sampler, "sampler", None)
    if isinstance(sampler, RandomSampler) and sampler.generator is None:
        raise ConfigError(
            "ddp_eval: evaluation DataLoader uses shuffle=True; each rank would "
            "draw a different order, so samples would be evaluated twice or "
            "never. Expected shuffle=False for VALID/TEST; remove it from the "
            "loader options (evaluation results do not depend on order)."
        )
    if loader.batch_sampler is None:
        raise ConfigError(
            "ddp_eval: cannot shard a DataLoader without a batch sampler "
            f"(batch_size={loader.batch_size}); expected batch_size or "
            "batch_sampler, or set shard_valid/shard_test: false."
        )
    names = getattr(loader.dataset, "data_ids", None)  # a DynamicItemDataset's utterance ids
    return DataLoader(loader.dataset, batch_sampler=ShardedBatchSampler(loader.batch_sampler, names=names),
                      **_worker_options(loader))
