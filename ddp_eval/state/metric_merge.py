"""Merging every rank's metric state into what one process would hold (a pure
function, the same result on every rank).

A rank's state (:meth:`ddp_eval.state.metrics.MetricRecorder.finish`) is, per metric
object path, the entries each list field gained, cut per batch and tagged with
global positions (a field holding fixed lists that grow, such as
``BLEUStats.targets``, one list per reference, is cut per inner list), and the
increments of numeric fields.

Example
-------
>>> rank0 = {"m": {"lists": {"ids": ([0, 2], [1, 1], ["a", "c"])}, "numbers": {"n": 2}, "nested": {}}}
>>> rank1 = {"m": {"lists": {"ids": ([1], [1], ["b"])}, "numbers": {"n": 1}, "nested": {}}}
>>> merged = merge_metric_stats([rank0, rank1])["m"]
>>> merged["lists"]["ids"], merged["numbers"]
(['a', 'b', 'c'], {'n': 3})
"""

from typing import Any, Dict, List, Mapping, Sequence

import torch

from ddp_eval.state._order import in_global_order


def unpack(packed: Any) -> list:
    """A field's entries as sent (one stacked tensor, or a list) as a list."""
    return list(packed.unbind(0)) if isinstance(packed, torch.Tensor) else packed


def merge_metric_stats(rank_states: Sequence[Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Merges per-rank metric states: list entries in global batch order (ties:
    rank order), numeric increments summed in rank order, nested fields (a
    fixed list of growing lists) merged list by list.

    Example
    -------
    >>> r0 = {"acc": {"lists": {}, "numbers": {"correct": 3.0, "total": 4.0}}}
    >>> r1 = {"acc": {"lists": {}, "numbers": {"correct": 1.0, "total": 4.0}}}
    >>> merge_metric_stats([r0, r1])["acc"]["numbers"]
    {'correct': 4.0, 'total': 8.0}
    """
    paths: List[str] = []
    for state in rank_states:
        paths.extend(p for p in state if p not in paths)
    merged: Dict[str, Dict[str, Any]] = {}
    for path in paths:
        chunks: Dict[str, list] = {}
        numbers: Dict[str, Any] = {}
        nested: Dict[str, int] = {}
        for state in rank_states:
            entry = state.get(path, {})
            for name, (positions, sizes, packed) in entry.get("lists", {}).items():
                chunks.setdefault(name, []).append((positions, sizes, unpack(packed)))
            for name, delta in entry.get("numbers", {}).items():
                numbers[name] = numbers.get(name, 0) + delta
            for name, count in entry.get("nested", {}).items():
                nested[name] = max(nested.get(name, 0), count)
        lists = {name: in_global_order(per_rank) for name, per_rank in chunks.items()}
        merged[path] = {"lists": lists, "numbers": numbers, "nested": nested}
    return merged
