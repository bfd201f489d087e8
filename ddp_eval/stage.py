"""One sharded VALID/TEST stage on this rank, from its start to its merge.

A :class:`ShardedStage` is created by :class:`ddp_eval.DDPEvalMixin` when a
sharded stage starts and dropped once ``on_stage_end`` has run on every rank:

1. :meth:`ShardedStage.start` (collective): builds the stage's batch plan,
   starts recording metric objects, Brain attributes and the state outside
   the Brain, and in one exchange checks the plans agree and learns from
   rank 0 which batches a journal already holds; then broadcasts DDP buffers.
2. :meth:`ShardedStage.after_batch`: after every batch this rank evaluates,
   notes the loss and what the batch changed (and journals it when due).
3. :meth:`ShardedStage.finish` (collective): reduces the loss, gathers every
   rank's changes and applies the merge, so ``on_stage_end`` sees what one
   process would hold; names what could not be merged.
4. :meth:`ShardedStage.close`: removes the stage's journal.
"""

import gc
import logging
import pickle
from contextlib import contextmanager
from typing import Any, Dict, List, Optional

import torch

from ddp_eval import dist
from ddp_eval.attributes import AttributeTracker, merge_attribute_states, resolve
from ddp_eval.errors import ConfigError
from ddp_eval.metrics import (
    MetricFinder,
    MetricRecorder,
    apply_merged,
    check_same_objects,
    describe_objects,
    merge_metric_stats,
)
from ddp_eval.outside import changed_outside, outside_markers
from ddp_eval.resume import StageResume
from ddp_eval.sharding import ShardedStreamLoader, check_same_batches, describe_loader, global_batch_ids, new_plan

logger = logging.getLogger(__name__)


@contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class ShardedStage:
    """The bookkeeping of one sharded stage on this rank.

    Arguments
    ---------
    brain : DDPEvalMixin
        The Brain (its ``ddp_eval_config``, metric objects and attributes).
    stage : sb.Stage
        VALID or TEST.
    epoch : int, optional
        As passed to ``on_stage_start``.
    loader : DataLoader
        The sharded loader of the stage.
    journal_root : path, optional
        Where evaluation journals live (None: not journaled).
    """

    def __init__(self, brain: Any, stage: Any, epoch: Optional[int], loader: Any, journal_root=None) -> None:
        self.brain, self.stage, self.epoch, self.loader = brain, stage, epoch, loader
        self.config = brain.ddp_eval_config
        by_dataset = isinstance(loader, ShardedStreamLoader) and loader.split == "by_dataset"
        # by_dataset positions differ per rank: such a stage is not journaled
        self.journal_root = None if by_dataset else journal_root
        self.metrics: Optional[MetricRecorder] = None
        self.attributes: Optional[AttributeTracker] = None
        self.outside: Dict[str, Any] = {}
        self.resume: Optional[StageResume] = None
        self.loss_sum, self.loss_count = 0.0, 0

    # -- start -------------------------------------------------------------------

    def start(self) -> None:
        """Collective: plan, recorders, the stage-start exchange, DDP buffers."""
        cfg, brain = self.config, self.brain
        self.metrics = MetricRecorder(MetricFinder(cfg.metrics_include, cfg.metrics_exclude), brain)
        self.attributes = AttributeTracker(self._targets(self.metrics.objects), cfg.attribute_memory_mb)
        self.outside = self._outside_markers()
        plan, old = None, []

        def local():  # the plan on every rank; the journal's answer on rank 0
            nonlocal plan, old
            plan = new_plan(self.loader)
            proposal = None
            if self.journal_root is not None and dist.get_rank() == 0:
                *proposal, old = StageResume.propose(brain, self, self.journal_root)
            return plan.ledger.summary() if plan else None, proposal

        per_rank = dist.decide(f"{self.stage.name} stage start", local)
        if plan is not None:
            check_same_batches(describe_loader(self.loader, self.stage.name), [p[0] for p in per_rank], plan.ledger)
        dist.broadcast_ddp_buffers(list(brain.modules.values()))
        if self.journal_root is not None:
            self.resume = StageResume.accept(per_rank[0][1], old, self, self.journal_root, cfg.resume_eval_every_s)

    def _targets(self, metric_objects) -> Dict[str, Any]:
        """``{label: (owner, name)}``: the Brain's attributes, then dotted paths to merge."""
        cfg = self.config
        targets = {n: (self.brain, n) for n in self.attribute_names(metric_objects)}
        for path in cfg.attributes_include or ():
            if "." in path and path not in cfg.attributes_exclude:
                targets[path] = resolve(self.brain, path)
        return targets

    def attribute_names(self, metric_objects) -> List[str]:
        """Plain attributes of the recipe's Brain that may be merged (not those
        holding the ``metric_objects`` found, nor what ``sb.Brain`` set up)."""
        cfg, brain = self.config, self.brain
        metric_holders = {path.split("[")[0] for path in metric_objects}
        names = set(vars(brain)) - brain._ddp_brain_attributes - metric_holders - set(cfg.attributes_exclude)
        names -= {"on_stage_start", "on_stage_end", "ddp_eval_config"}  # the mixin's own
        plain = [n for n in cfg.attributes_include or () if "." not in n]
        if plain:  # names without a dot restrict the Brain's attributes; paths only add
            names &= set(plain)
        return sorted(n for n in names if not n.startswith("_ddp"))

    def _outside_markers(self):
        """State outside the Brain (hparams, recoverables), minus what the Brain
        itself holds as mergeable attributes."""
        own = [id(v) for v in vars(self.brain).values() if isinstance(v, (list, dict, torch.Tensor))]
        return outside_markers(self.brain, skip_ids=own)

    # -- per batch -----------------------------------------------------------------

    def after_batch(self, loss: Any) -> None:
        """Notes the batch's loss and what it changed; journals when due."""
        if torch.isfinite(torch.as_tensor(loss)):  # as SpeechBrain's average skips non-finite losses
            self.loss_sum += float(loss)
            self.loss_count += 1
        objects = self.metrics.after_batch(self.brain)
        self.attributes.add({n: (self.brain, n) for n in self.attribute_names(objects)})
        self.attributes.after_batch()
        if self.resume is not None:
            self.resume.after_batch(self.brain, self)

    # -- end ------------------------------------------------------------------------

    def finish(self, local_loss: float) -> float:
        """Collective: the global stage loss, with metrics and attributes merged."""
        if dist.get_world_size() == 1 and not (self.resume is not None and self.resume.done):
            return local_loss  # one process that evaluated everything itself: nothing to merge
        packed, objects = None, {}

        def local():  # everything that can fail on one rank happens before the exchange
            nonlocal packed, objects
            positions = global_batch_ids(self.loader)
            metric_state = self.metrics.finish(self.brain, positions)
            objects = self.metrics.objects
            _, unmergeable, attribute_state = self.attributes.finish(positions)
            excluded = set(self.config.attributes_exclude) | set(self.attributes.tracks)
            outside = {label: why for label, why in changed_outside(self.outside, self._outside_markers()).items()
                       if label not in excluded}
            old = self.resume.old_states() if self.resume is not None else []
            packed = pickle.dumps((metric_state, attribute_state, old))
            return describe_objects(objects), unmergeable, outside, self._stream_read()

        per_rank = dist.decide(f"{self.stage.name} stage end", local)
        if self._stream_read() is not None:  # a stream's batches are known once read: checked here
            check_same_batches(describe_loader(self.loader, self.stage.name), [p[3] for p in per_rank],
                               self.loader.ledger)
        check_same_objects([p[0] for p in per_rank], self.stage.name)
        report_unmergeable(self.stage.name, [p[1] for p in per_rank], [p[2] for p in per_rank],
                           self.config.on_unmergeable_attribute)
        old_sum, old_count = self.resume.old_loss() if self.resume is not None else (0.0, 0)
        total, count = dist.all_reduce_sum([self.loss_sum + old_sum, self.loss_count + old_count])
        with _gc_paused():  # unpickling many small objects triggers costly full GCs
            states = [pickle.loads(view) for view in dist.all_gather_bytes(packed)]
            # every rank's stage, then the journal's pieces (rank 0 sent them): all by global position
            states = [(m, a) for m, a, _ in states] + [piece for _, _, old in states for piece in old]
            apply_merged(objects, self.metrics.start, merge_metric_stats([m for m, _ in states]))
            self.attributes.apply(merge_attribute_states([a for _, a in states]), self._locate)
        return total / count if count else 0.0

    def _stream_read(self):
        """A stream read whole on every rank: ``(batches, digest)`` of what it read."""
        loader = self.loader
        return loader.ledger.summary() if isinstance(loader, ShardedStreamLoader) and loader.split == "batches" \
            else None

    def _locate(self, label: str):
        return resolve(self.brain, label) if "." in label else (self.brain, label)

    def close(self) -> None:
        """After ``on_stage_end`` ran on every rank: the journal is no longer needed."""
        if self.resume is not None:
            self.resume.close()


def report_unmergeable(stage_name: str, unmergeable: List[Dict[str, str]], outside: List[Dict[str, str]],
                       action: str) -> None:
    """Warns (rank 0) or raises (every rank, ``action == "error"``) about state
    left rank-local, from every rank's reports."""
    messages = []
    name = stage_name.lower()
    found = _first_seen(unmergeable)
    if found:
        messages.append(
            f"ddp_eval: at the end of the sharded {stage_name} stage, attributes changed "
            f"in a way that cannot be merged across ranks, so each rank holds only its own "
            f"batches' values: {found}. Expected lists that only grow, dicts that gain keys "
            "or replace values, numbers or fixed-shape tensors that accumulate. Compute the "
            "value in on_stage_end from merged state, or list the attribute in "
            f"ddp_eval: attributes_exclude (silences this), or set shard_{name}: false."
        )
    found = _first_seen(outside)
    if found:
        messages.append(
            f"ddp_eval: during the sharded {stage_name} stage, state outside the Brain "
            f"changed, so each rank holds only its own batches' share of it: {found}. "
            "Expected state a stage accumulates on the Brain. To merge it like a Brain "
            "attribute, list its path in ddp_eval: attributes_include (e.g. "
            f"[hparams.aligner.align_dict]); or set shard_{name}: false; or list the path "
            "in ddp_eval: attributes_exclude if it is rank-local on purpose."
        )
    if not messages:
        return
    if action == "error":
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
