"""What the stage-end exchange tells every rank, and the messages that name
what a sharded stage could not make exact.

Every rank reads the same per-rank reports, so every rank draws the same
conclusions: which rank's object a ``LAST`` merge takes, and what to name.
Messages are warnings on rank 0, or, with ``ddp_eval: on_unmergeable_attribute:
error``, a :class:`~ddp_eval.errors.ConfigError` on every rank.

Example
-------
>>> reports = [{"last": {"x": (3.0, None)}, "piece_last": [], "batches": 2},
...            {"last": {"x": (5.0, None)}, "piece_last": [], "batches": 2}]
>>> StageReport("TEST", reports, "warn").winners
{'x': 1}
"""

import logging
from typing import Any, Dict, List, Mapping, Sequence

from ddp_eval import distributed as dist
from ddp_eval.errors import ConfigError
from ddp_eval.stage._draws import IN_WORKERS
from ddp_eval.stage._effects import main_only
from ddp_eval.stage._model import differing_modules
from ddp_eval.state.attribute_merge import last_writer
from ddp_eval.state.bookkeeping import last_candidates_of, of_a_module

logger = logging.getLogger(__name__)


class StageReport:
    """Conclusions from every rank's stage-end report (see ``ShardedStage._collect``)."""

    def __init__(self, stage: str, per_rank: Sequence[Mapping[str, Any]], action: str) -> None:
        self.stage, self.per_rank, self.action = stage, per_rank, action
        self.layouts = [r.get("layout", {}) for r in per_rank]
        self.stream_read = [r.get("stream") for r in per_rank]
        self.winners, self.unsendable = self._winners()
        modules = [r.get("modules", ({}, {}, [])) for r in per_rank]
        self.modules = differing_modules([m[0] for m in modules], [m[1] for m in modules],
                                         [m[2] for m in modules]) if modules[0][1] else {}

    def _winners(self):
        candidates = last_candidates_of(self.per_rank)
        winners, unsendable = {}, {}
        for path, found in candidates.items():
            winner = last_writer([(index, position) for index, position, _ in found])
            winners[path] = winner
            error = next(e for i, _, e in found if i == winner)
            if error is not None:
                unsendable[path] = f"the value of the last batch that set it (on rank {winner}) cannot be sent: {error}"
        return winners, unsendable

    def raise_or_warn(self) -> None:
        """Names attributes that changed in ways no merge can follow, and state
        outside the Brain that changed (modules named by :meth:`warn_effects` left out)."""
        name = self.stage.lower()
        unobserved = {rank: r["observed"] for rank, r in enumerate(self.per_rank)
                      if r["observed"][0] != r["observed"][1]}
        if unobserved:
            raise ConfigError(
                f"ddp_eval: in the sharded {self.stage} stage, the Brain's update_average, where ddp_eval notes "
                "each batch, was not called once per batch the loader handed out, so what the batches did cannot "
                "be merged: " + "; ".join(f"rank {rank}: {handed} batch(es) handed out, update_average called "
                                           f"{called} time(s)" for rank, (handed, called) in unobserved.items())
                + ". Expected SpeechBrain's loop (fit, evaluate), which calls self.update_average(loss, avg) once "
                "after each batch. A loop of the recipe's own must do the same; a replacement of update_average "
                f"must be assigned before fit() or evaluate(), where ddp_eval wraps it; or set shard_{name}: false.")
        messages = []
        found = _first_seen([r.get("unmergeable", {}) for r in self.per_rank])
        if found:
            messages.append(
                f"ddp_eval: at the end of the sharded {self.stage} stage, attributes changed "
                f"in a way that cannot be merged across ranks, so each rank holds only its own "
                f"batches' values: {found}. Expected lists that only grow, dicts that gain keys "
                "or change entries, numbers changed by += or set by =, tensors and arrays changed in "
                "place, or objects bound anew. Compute the value in on_stage_end from merged state, "
                f"or list the attribute in ddp_eval: attributes_exclude (silences this), or set shard_{name}: false.")
        outside = [{label: why for label, why in r.get("outside", {}).items()
                    if not of_a_module(label, self.modules)}
                   for r in self.per_rank]
        found = _first_seen(outside)
        if found:
            messages.append(
                f"ddp_eval: during the sharded {self.stage} stage, state outside the Brain "
                f"changed, so each rank holds only its own batches' share of it: {found}. "
                "Expected state a stage accumulates on the Brain. To merge it like a Brain "
                "attribute, list its path in ddp_eval: attributes_include (e.g. "
                "[hparams.aligner.align_dict]); a module's global or a class attribute ('global X', "
                "'class C.x'): keep it on the Brain instead (self.x, bound in on_stage_start); "
                f"or set shard_{name}: false; or list the path "
                "in ddp_eval: attributes_exclude if it is rank-local on purpose.")
        seeds = [r.get("seeds") for r in self.per_rank]  # a stream's workers, seeded alike: one process's draws
        alike = seeds[0] is not None and all(s == seeds[0] for s in seeds)
        random = [[g for g in r.get("random", ()) if not (alike and g.endswith(IN_WORKERS))] for r in self.per_rank]
        drew = {generator: [rank for rank, found in enumerate(random) if generator in found]
                for generator in sorted({g for found in random for g in found})}
        if drew:
            messages.append(
                f"ddp_eval: during the sharded {self.stage} stage, batches drew from the global random "
                "generator(s) " + ", ".join(f"{g} (on rank(s) {', '.join(map(str, ranks))})" for g, ranks in
                                            drew.items()) +
                ": on a rank a batch draws from another state than one process at that batch (which has drawn "
                "for every earlier batch; a DataLoader worker loads other batches on a rank than in one process), "
                "so what it computed from the draws (masks, sampled negatives, noise: "
                "the stage loss, metrics) may differ from one process, and the generators' states after the stage "
                "differ across ranks. Expected evaluation that draws nothing, or draws from a generator seeded by "
                "the batch, which draws the same on any rank (torch.Generator().manual_seed(zlib.crc32(' '.join("
                "batch.id).encode())), or torch.manual_seed(seed + self.step) inside torch.random.fork_rng()); "
                f"or set shard_{name}: false; or list the generator in ddp_eval: attributes_exclude if its draws "
                "do not change what the stage computes.")
        if self.unsendable:
            raise ConfigError(f"ddp_eval: at the end of the sharded {self.stage} stage, "
                              + "; ".join(f"'{p}': {why}" for p, why in sorted(self.unsendable.items()))
                              + ". Keep picklable values in attributes a batch sets, or list the attribute "
                              "in ddp_eval: attributes_exclude.")
        self._emit(messages)

    def conflicts(self, conflicts: Mapping[str, str], assumed: Mapping[str, str]) -> None:
        """Names what the merge found that one process could not hold, and what it assumed."""
        messages = []
        if conflicts:
            messages.append(f"ddp_eval: at the end of the sharded {self.stage} stage, these attributes could not "
                            "be merged, so each rank keeps its own value: " + _by_reason(conflicts) + ".")
        if assumed:
            messages.append(f"ddp_eval: at the end of the sharded {self.stage} stage, " + _by_reason(assumed) + ".")
        self._emit(messages)

    def warn_effects(self) -> None:
        """Main-process-only per-batch effects, modules whose state differs across
        ranks, files opened for appending."""
        messages = []
        changed: Dict[str, List[int]] = {}
        for rank, report in enumerate(self.per_rank):
            for label, count in report.get("changed", {}).items():
                changed.setdefault(label, [0] * len(self.per_rank))[rank] = count
        batches = [r.get("batches", 0) for r in self.per_rank]
        only = main_only(changed, batches)
        if only:
            messages.append(
                f"ddp_eval: during the sharded {self.stage} stage, {only} changed in every batch rank 0 "
                f"evaluated ({batches[0]}) and in none of the {sum(batches[1:])} batches of the other ranks: a "
                "per-batch effect under `if if_main_process():` (as BEST-RQ appends its accuracy) then holds rank "
                "0's batches only. Remove the guard in the batch code (the merge gives every rank one "
                "process's values; keep it for writing files in on_stage_end), or set "
                f"shard_{self.stage.lower()}: false.")
        if self.modules:
            messages.append(
                f"ddp_eval: after the sharded {self.stage} stage, modules differ across ranks: "
                + "; ".join(f"'{m}': {why}" for m, why in sorted(self.modules.items()))
                + ". A module that learns statistics when called (InputNormalization, BatchNorm in train "
                "mode) should be in the Brain's modules, which SpeechBrain puts in eval mode for VALID and "
                "TEST, or be called in eval mode there; one that learnt on each rank's own batches during "
                "TRAIN must also be brought into step before VALID and TEST.")
        appends = sorted({p for r in self.per_rank for p in r.get("appends", [])})
        if appends:
            messages.append(
                f"ddp_eval: during the sharded {self.stage} stage, batches appended to {appends}: each rank "
                "appended its own batches, interleaved in no fixed order. Open such files as "
                "self.stage_output(path) in the batch code: each rank then appends to a part of its own, "
                "and at stage end rank 0 appends them to the file in one process's batch order.")
        self._emit(messages)

    def _emit(self, messages: List[str]) -> None:
        if not messages:
            return
        if self.action == "error":
            raise ConfigError(" ".join(messages))
        if dist.get_rank() == 0:
            for message in messages:
                logger.warning(message)


def _first_seen(per_rank: List[Dict[str, str]]) -> str:
    """``'name': why (first seen on rank r); ...`` over the ranks' reports."""
    found: Dict[str, str] = {}
    for rank, report in enumerate(per_rank):
        for name, why in report.items():
            found.setdefault(name, f"{why} (first seen on rank {rank})")
    return "; ".join(f"'{name}': {why}" for name, why in sorted(found.items()))


def _by_reason(named: Mapping[str, str]) -> str:
    """``'a', 'b': why; 'c': why2``: the labels that share a reason, with it once.

    Example
    -------
    >>> _by_reason({"b": "x", "a": "x", "c": "y"})
    "'a', 'b': x; 'c': y"
    """
    labels: dict = {}
    for label, why in sorted(named.items()):
        labels.setdefault(why, []).append(f"'{label}'")
    return "; ".join(f"{', '.join(found)}: {why}" for why, found in labels.items())
