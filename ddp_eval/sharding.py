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

from typing import Dict, Iterable, Iterator, List, Optional

from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler

from ddp_eval import dist
from ddp_eval.errors import ConfigError
from ddp_eval.journal import batch_ids_digest


def batch_owner(index: int, world_size: int) -> int:
    """Rank that evaluates global batch ``index`` (snake order over rounds)."""
    round_, seat = divmod(index, world_size)
    return seat if round_ % 2 == 0 else world_size - 1 - seat


def shard_batches(num_batches: int, rank: int, world_size: int) -> List[int]:
    """Global indices of the batches that ``rank`` evaluates, in order."""
    return [i for i in range(num_batches) if batch_owner(i, world_size) == rank]


class ShardedBatchSampler(Sampler):
    """Yields this rank's share of the batches of another batch sampler.

    Arguments
    ---------
    batch_sampler : iterable of lists of indices
        The batch sampler one process would use (e.g. ``BatchSampler`` or
        SpeechBrain's ``DynamicBatchSampler``); it must yield the same batches
        on every rank.
    rank : int, optional
        Defaults to the global rank.
    world_size : int, optional
        Defaults to the number of ranks.

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
    ) -> None:
        self.batch_sampler = batch_sampler
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.done: frozenset = frozenset()

    def skip(self, done: Iterable[int]) -> None:
        """From now on, deal only the batches not in ``done`` (global positions),
        in the same snake order (a resumed evaluation; empty: every batch)."""
        self.done = frozenset(done)

    def __iter__(self) -> Iterator[List[int]]:
        mine = set(self.global_batch_ids())
        for index, batch in enumerate(self.batch_sampler):
            if index in mine:
                yield batch

    def __len__(self) -> int:
        return len(self.global_batch_ids())

    def global_batch_ids(self) -> List[int]:
        """Global position of each batch this rank yields, in yield order."""
        if not self.done:
            return shard_batches(len(self.batch_sampler), self.rank, self.world_size)
        remaining = [i for i in range(len(self.batch_sampler)) if i not in self.done]
        return [remaining[k] for k in shard_batches(len(remaining), self.rank, self.world_size)]

    def set_epoch(self, epoch: int) -> None:
        """Forwards ``set_epoch`` (e.g. to a ``DynamicBatchSampler``)."""
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)


class ShardedStreamLoader(DataLoader):
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
        self.split = split
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self._yielded: List[int] = []
        self.digests: Dict[int, Optional[str]] = {}  # position -> digest of its ids, of batches yielded
        self.done: frozenset = frozenset()
        self._expected: Dict[int, Optional[str]] = {}

    def skip(self, done: Iterable[int], expected: Optional[Dict[int, Optional[str]]] = None) -> None:
        """From now on, read past the batches in ``done`` without yielding them
        (``split="batches"`` only), checking their ids against ``expected``
        digests, and deal the others in snake order (a resumed evaluation)."""
        self.done, self._expected = frozenset(done), dict(expected or {})

    def __iter__(self):
        self._yielded = yielded = []
        self.digests = {}
        remaining = 0
        for index, batch in enumerate(super().__iter__()):
            if self.split == "by_dataset":
                yielded.append(index)
                yield batch
                continue
            if index in self.done:
                self._check(index, batch)
                continue
            if batch_owner(remaining, self.world_size) == self.rank:
                yielded.append(index)
                self.digests[index] = batch_ids_digest(batch)
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


def is_sharded(loader) -> bool:
    """Whether ``loader`` was sharded by :func:`shard_dataloader`."""
    return isinstance(loader, ShardedStreamLoader) or isinstance(
        getattr(loader, "batch_sampler", None), ShardedBatchSampler)


def global_batch_ids(loader) -> List[int]:
    """Global position of each batch a sharded ``loader`` yielded (streams) or yields."""
    if isinstance(loader, ShardedStreamLoader):
        return loader.global_batch_ids()
    return loader.batch_sampler.global_batch_ids()


def _worker_options(loader: DataLoader) -> dict:
    options = dict(collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                   pin_memory=loader.pin_memory, timeout=loader.timeout,
                   worker_init_fn=loader.worker_init_fn,
                   multiprocessing_context=loader.multiprocessing_context,
                   generator=loader.generator)
    if loader.num_workers > 0:
        options.update(prefetch_factor=loader.prefetch_factor,
                       persistent_workers=loader.persistent_workers)
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
    return DataLoader(loader.dataset, batch_sampler=ShardedBatchSampler(loader.batch_sampler),
                      **_worker_options(loader))
