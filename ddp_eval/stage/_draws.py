"""Which global random generators a sharded stage's batches drew from.

A batch that draws from the process's global random generators (masks, sampled
negatives, noise: wav2vec2's and BEST-RQ's losses) draws, on a rank, from another
state than one process at that batch, which has drawn for every earlier batch: what
it computes from the draws may differ, and no merge can tell. :class:`RandomDraws`
notes which generators this rank's batches drew from, in the main process and in
DataLoader workers (:class:`WorkerDraws`), to be named at stage end.
"""

import random
import zlib
from typing import Any, Callable, Dict, List, Optional

import torch

try:
    import numpy
except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
    numpy = None

TORCH, PYTHON, NUMPY = "torch.random", "random", "numpy.random"  # as named, and as attributes_exclude takes them
IN_WORKERS = " in DataLoader workers"  # a generator's name, drawn from in workers


def _torch_states() -> List[torch.Tensor]:
    """torch's default generators: the CPU one, and CUDA's once CUDA is in use."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def _other_states() -> Dict[str, int]:
    """A checksum of Python's and NumPy's global generators' states (read once a stage: about 50 us)."""
    found = {PYTHON: hash(random.getstate())}
    if numpy is not None:
        _, keys, position, *rest = numpy.random.get_state()
        found[NUMPY] = zlib.crc32(keys.tobytes(), position) ^ hash(tuple(rest))
    return found


class RandomDraws:
    """Which global random generators this rank's batches drew from: torch's per
    batch (from when the batch was handed over, for a stream, or from the end of
    the previous one, its loading included, as a map-style loader loads only this
    rank's batches), Python's ``random`` and NumPy's over the stage; and, through
    a :class:`WorkerDraws` the loader's DataLoader workers run, theirs.

    Example
    -------
    >>> draws = RandomDraws()
    >>> draws.reading()
    >>> _ = torch.rand(2)  # a batch draws
    >>> draws.after_batch()
    >>> draws.after_batch()  # a batch that draws nothing
    >>> draws.finish()
    ['torch.random']
    """

    def __init__(self, workers: Optional["WorkerDraws"] = None) -> None:
        self.drew: set = set()
        self.workers = workers
        if workers is not None:
            workers.reset()
        self._torch: Optional[List[torch.Tensor]] = None
        self._others: Optional[Dict[str, int]] = None

    def reading(self) -> None:
        """The loader starts reading the stage's batches (after the draw of its iterator's seed)."""
        self._torch, self._others = _torch_states(), _other_states()

    def handing(self) -> None:
        """A stream hands a batch over: what it read until now, one process read too."""
        self._torch = _torch_states()

    def after_batch(self) -> None:
        if self._torch is None:
            return
        now = _torch_states()
        if len(now) != len(self._torch) or not all(map(torch.equal, now, self._torch)):
            self.drew.add(TORCH)
        self._torch = now

    def finish(self) -> List[str]:
        """The generators batches drew from (Python's and NumPy's read now)."""
        if self._others is not None:
            now = _other_states()
            self.drew.update(name for name, state in now.items() if self._others.get(name) != state)
            self._others = None
        if self.workers is not None:
            self.drew.update(name + IN_WORKERS for name in self.workers.drew())
        return sorted(self.drew)


class WorkerDraws:
    """A sharded loader's ``collate_fn`` and ``worker_init_fn`` when it loads in
    DataLoader workers: in a worker, whether loading each batch (its items and its
    collation: random crops, BEST-RQ's masks) drew from the worker's global
    generators, and the worker's seed, told to the main process through shared
    memory. A map-style loader's worker loads other batches on a rank than in one
    process, so such draws differ; a stream's workers load every batch on every rank,
    as one process's do, from the seed the rank's generator gave them. Passes
    everything through where it is called outside a worker.

    Example
    -------
    >>> draws = WorkerDraws(sorted, None, workers=2)
    >>> draws([3, 1, 2]), draws.drew(), draws.seeds.tolist()  # the main process: passed through
    ([1, 2, 3], [], [-1, -1])
    """

    GENERATORS = (TORCH, PYTHON, NUMPY)

    def __init__(self, collate_fn: Callable, worker_init_fn: Optional[Callable], workers: int) -> None:
        self.collate_fn, self.user_init = collate_fn, worker_init_fn
        self.flags = torch.zeros(len(self.GENERATORS), dtype=torch.uint8).share_memory_()
        self.seeds = torch.full((workers,), -1, dtype=torch.int64).share_memory_()  # -1: not started
        self._seen: Optional[list] = None  # in a worker: its generators' states when it last looked

    def worker_init_fn(self, worker_id: int) -> None:
        """In the worker, after torch seeded its generators: the recipe's, then the states."""
        self.seeds[worker_id] = torch.initial_seed() % 2**63
        if self.user_init is not None:
            self.user_init(worker_id)
        self._seen = _worker_states()

    def __call__(self, items: Any) -> Any:
        if self._seen is None:
            return self.collate_fn(items)
        self._look()  # what loading the items drew
        batch = self.collate_fn(items)
        self._look()
        return batch

    def _look(self) -> None:
        now = _worker_states()
        for index, (state, seen) in enumerate(zip(now, self._seen)):
            if not _same(state, seen):
                self.flags[index] = 1
        self._seen = now

    def reset(self) -> None:
        """A stage starts: nothing drawn yet (persistent workers keep their seeds)."""
        self.flags.zero_()

    def drew(self) -> List[str]:
        return [name for name, flag in zip(self.GENERATORS, self.flags.tolist()) if flag]


def _worker_states() -> list:
    others = _other_states()
    return [torch.get_rng_state(), others[PYTHON], others.get(NUMPY)]


def _same(state: Any, seen: Any) -> bool:
    return torch.equal(state, seen) if isinstance(state, torch.Tensor) else state == seen
