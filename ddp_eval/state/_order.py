"""Global batch order: the one rule every merge of ddp_eval follows.

Each rank records what its batches added, cut per batch and tagged with the
batch's global position (its place in the batch plan one process would run).
:func:`in_global_order` puts the pieces of every rank back in that order, so a
merged list holds what one process would have appended, in the same order.

Example
-------
>>> rank0 = ([0, 2], [2, 1], ["a", "b", "e"])   # batch 0 added a, b; batch 2 added e
>>> rank1 = ([1], [2], ["c", "d"])
>>> in_global_order([rank0, rank1])
['a', 'b', 'c', 'd', 'e']
"""

import bisect
from typing import Any, List, Sequence, Tuple

import torch

Chunks = Tuple[Sequence[float], Sequence[int], Sequence[Any]]  # positions, sizes, items


def growth_since(changes: Sequence[int], from_batch: int, start_len: int) -> Tuple[Sequence[int], List[int]]:
    """From a flat record ``batch, length after it, batch, length, ...`` of a
    growing list: the batches from ``from_batch`` on that grew it, and the
    bounds of their growth (the first is its length before them).

    Example
    -------
    >>> growth_since([0, 2, 3, 5, 4, 6], from_batch=1, start_len=0)
    ([3, 4], [2, 5, 6])
    """
    batches, lengths = changes[0::2], changes[1::2]
    first = bisect.bisect_left(batches, from_batch)
    return batches[first:], [lengths[first - 1] if first else start_len] + list(lengths[first:])


def as_chunks(positions: Sequence[float], batches: Sequence[int], bounds: Sequence[int], items: Sequence[Any]
              ) -> Chunks:
    """The chunks of :func:`in_global_order` for ``items`` (the entries from
    ``bounds[0]`` to ``bounds[-1]``), cut at ``bounds`` by the batches that
    added them; ``positions[batch]`` is a batch's global position."""
    return [positions[b] for b in batches], [b - a for a, b in zip(bounds, bounds[1:])], items


def in_global_order(per_rank: Sequence[Chunks]) -> list:
    """Every rank's items, chunk by chunk, sorted by global position (a tie, such
    as items added after the last batch, at position ``inf``: by rank)."""
    pieces = []
    for rank, (positions, sizes, items) in enumerate(per_rank):
        offset = 0
        for position, size in zip(positions, sizes):
            pieces.append((position, rank, offset, offset + size, items))
            offset += size
    pieces.sort(key=lambda piece: piece[:2])
    return [item for _, _, start, end, items in pieces for item in items[start:end]]


def packed(items: list) -> Any:
    """``items`` as they travel: same-shaped tensors that need no grad as one stacked
    tensor (on their device; pickling thousands of 0-d tensors one by one costs far
    more than the merge), else the list. :func:`in_global_order` slices and iterates
    either: a stacked tensor's rows come back as tensors equal to the entries."""
    if len(items) > 1 and all(type(x) is torch.Tensor for x in items):
        first = items[0]
        if all(x.shape == first.shape and x.dtype == first.dtype and x.device == first.device
               and not x.requires_grad for x in items):
            return torch.stack(items)
    return items
