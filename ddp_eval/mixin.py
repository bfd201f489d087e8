"""``DDPEvalMixin``: sharded, exact validation and test for SpeechBrain's Brain."""

import gc
import logging
import pathlib
import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import speechbrain as sb
import torch

from ddp_eval import dist
from ddp_eval.attributes import AttributeTracker, merge_attribute_states, resolve
from ddp_eval.checkpoint import writer_only_saves
from ddp_eval.config import DDPEvalConfig
from ddp_eval.consistency import check_states_agree, state_summaries
from ddp_eval.errors import ConfigError
from ddp_eval.journal import JOURNAL_DIRNAME
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
from ddp_eval.sharding import ShardedStreamLoader, global_batch_ids, is_sharded, shard_dataloader

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


@dataclass
class _StageRun:
    """Bookkeeping of one stage on this rank."""

    stage: Any
    sharded: bool
    loader: Any = None
    metrics: Optional[MetricRecorder] = None  # list lengths of metric objects, per batch
    attributes: Optional[AttributeTracker] = None  # Brain attributes and included paths
    outside: Dict[str, Any] = field(default_factory=dict)  # state outside the Brain at start
    resume: Optional[StageResume] = None  # the stage's journal, and what it resumed
    loss_sum: float = 0.0
    loss_count: int = 0


class DDPEvalMixin:
    """Shards VALID and TEST across ranks and makes every rank see global results.

    Use it before ``sb.Brain`` in the bases: ``class MyBrain(DDPEvalMixin,
    sb.Brain)``. Under ``torchrun``:

    * ``fit(valid_set=...)`` and ``evaluate(test_set)`` evaluate each batch on
      exactly one rank (the batches one process would build, dealt in snake
      order), map-style and streaming sets alike; DDP buffers are broadcast from
      rank 0 at stage start, so a rank without a batch never blocks the others;
    * before ``on_stage_end``, the stage loss is reduced with ``all_reduce``
      (sums and counts), and every SpeechBrain metric object and every plain
      attribute the stage grew (lists, dicts, counters, accumulators) is merged,
      so ``on_stage_end`` runs on every rank with the single-process loss,
      metrics and attributes (the TRAIN loss becomes the average over all ranks);
    * an exception on one rank is raised on every rank, and every wait is
      bounded by ``ddp_eval: collective_timeout``.

    Without a process group (``python train.py hparams.yaml``) nothing changes.

    Configuration: an optional ``ddp_eval:`` section in the hparams, see
    :class:`ddp_eval.DDPEvalConfig`.

    Example
    -------
    >>> import torch
    >>> class SimpleBrain(DDPEvalMixin, sb.Brain):
    ...     def compute_forward(self, batch, stage):
    ...         return self.modules.model(batch[0])
    ...     def compute_objectives(self, predictions, batch, stage):
    ...         return torch.nn.functional.l1_loss(predictions, batch[0])
    >>> brain = SimpleBrain({"model": torch.nn.Linear(10, 10)}, run_opts={"device": "cpu"})
    >>> loss = brain.evaluate([(torch.ones(2, 10),)])
    >>> isinstance(loss, float)
    True
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # What sb.Brain set up is SpeechBrain's business (step, optimizer, ...):
        # never merged as a recipe attribute.
        self._ddp_brain_attributes = frozenset(vars(self))
        hparams = vars(self.hparams) if hasattr(self, "hparams") else None
        self.ddp_eval_config = DDPEvalConfig.from_hparams(hparams)
        dist.set_timeout(self.ddp_eval_config.collective_timeout)
        self._ddp_loaders: Dict[Any, Any] = {}
        self._ddp_run: Optional[_StageRun] = None
        self._ddp_global_loss: Dict[Any, float] = {}
        # Why instance wrappers: recipes override on_stage_start/on_stage_end
        # without calling super(), so the sync is wrapped around the bound methods.
        self.on_stage_start = self._ddp_wrap_stage_start(self.on_stage_start)
        self.on_stage_end = self._ddp_wrap_stage_end(self.on_stage_end)

    # -- Brain overrides ---------------------------------------------------

    def make_dataloader(self, dataset, stage: sb.Stage, ckpt_prefix: Optional[str] = "dataloader-",
                        **loader_kwargs) -> Any:
        """Why: SpeechBrain shards only TRAIN; this also shards VALID and TEST."""
        loader = super().make_dataloader(dataset, stage, ckpt_prefix, **loader_kwargs)
        if self._ddp_should_shard(stage):
            try:
                loader = shard_dataloader(loader, self.ddp_eval_config.stream_split)
            except ConfigError:
                if dist.get_world_size() > 1:
                    raise
                # one process only shards to journal; a loader that cannot be (shuffled) stays as it is
                logger.info(f"ddp_eval: the {stage.name} loader cannot be sharded; not journaled.")
        self._ddp_loaders[stage] = loader
        return loader

    def fit(self, epoch_counter, train_set, valid_set=None, *args, **kwargs):
        """Why: note whether VALID is sharded; turn a failure here into an error on
        all ranks; return on rank 0 only once every rank has read the last answer."""
        self._ddp_loaders[sb.Stage.VALID] = valid_set  # make_dataloader replaces a Dataset
        try:
            with dist.fail_together("fit"):
                return super().fit(epoch_counter, train_set, valid_set, *args, **kwargs)
        finally:
            dist.settle()

    def evaluate(self, test_set, *args, **kwargs) -> float:
        """Why: note whether TEST is sharded, return the global loss, fail together,
        and (rank 0) return once every rank has read the last answer."""
        self._ddp_loaders[sb.Stage.TEST] = test_set
        self._ddp_global_loss.pop(sb.Stage.TEST, None)
        try:
            with dist.fail_together("evaluate"):
                local_loss = super().evaluate(test_set, *args, **kwargs)
        finally:
            dist.settle()
        return self._ddp_global_loss.get(sb.Stage.TEST, local_loss)

    def update_average(self, loss: torch.Tensor, avg_loss: float) -> float:
        """Why: the one per-batch hook of every Brain loop; it records exact loss
        sums and what each batch added to metrics and Brain attributes, for the merge."""
        run = self._ddp_run
        if run is not None and run.sharded:
            if torch.isfinite(torch.as_tensor(loss)):
                run.loss_sum += float(loss)
                run.loss_count += 1
            objects = run.metrics.after_batch(self)
            run.attributes.add({n: (self, n) for n in self._ddp_attribute_names(objects)})
            run.attributes.after_batch()
            if run.resume is not None:
                run.resume.after_batch(self, run)
        return super().update_average(loss, avg_loss)

    # -- internals ---------------------------------------------------------

    def _ddp_should_shard(self, stage) -> bool:
        cfg = self.ddp_eval_config
        wanted = {sb.Stage.VALID: cfg.shard_valid, sb.Stage.TEST: cfg.shard_test}
        # One process shards too (into one share) when it journals: it may resume a journal.
        return wanted.get(stage, False) and (dist.get_world_size() > 1 or self._ddp_journal_root() is not None)

    def _ddp_journal_root(self):
        """Where journals live, or None when resume_eval is off or has no folder."""
        cfg = self.ddp_eval_config
        if not cfg.resume_eval:
            return None
        if cfg.resume_eval_dir is not None:
            return pathlib.Path(cfg.resume_eval_dir)
        folder = getattr(self.checkpointer, "checkpoints_dir", None) if self.checkpointer else None
        return None if folder is None else pathlib.Path(folder) / JOURNAL_DIRNAME

    def _ddp_attribute_names(self, metric_objects) -> List[str]:
        """Plain attributes of the recipe's Brain that may be merged (not those
        holding the ``metric_objects`` found)."""
        cfg = self.ddp_eval_config
        metric_holders = {path.split("[")[0] for path in metric_objects}
        names = set(vars(self)) - self._ddp_brain_attributes - metric_holders - set(cfg.attributes_exclude)
        names -= {"on_stage_start", "on_stage_end", "ddp_eval_config"}  # the mixin's own
        plain = [n for n in cfg.attributes_include or () if "." not in n]
        if plain:  # names without a dot restrict the Brain's attributes; paths only add
            names &= set(plain)
        return sorted(n for n in names if not n.startswith("_ddp"))

    def _ddp_attribute_targets(self, metric_objects) -> Dict[str, Any]:
        """``{label: (owner, name)}``: Brain attributes, then dotted paths to merge."""
        cfg = self.ddp_eval_config
        targets = {n: (self, n) for n in self._ddp_attribute_names(metric_objects)}
        for path in cfg.attributes_include or ():
            if "." in path and path not in cfg.attributes_exclude:
                targets[path] = resolve(self, path)
        return targets

    def _ddp_locate(self, label: str):
        return resolve(self, label) if "." in label else (self, label)

    def _ddp_outside_markers(self):
        """State outside the Brain (hparams, recoverables), minus what the Brain
        itself holds as mergeable attributes."""
        own = [id(v) for v in vars(self).values() if isinstance(v, (list, dict, torch.Tensor))]
        return outside_markers(self, skip_ids=own)

    def _ddp_wrap_stage_start(self, user_on_stage_start):
        def on_stage_start(stage, epoch=None):
            user_on_stage_start(stage, epoch)
            loader = self._ddp_loaders.get(stage)
            run = _StageRun(stage, stage != sb.Stage.TRAIN and is_sharded(loader), loader)
            if run.sharded:
                dist.sync_ddp_buffers(list(self.modules.values()), f"{stage.name} stage start")
                cfg = self.ddp_eval_config
                run.metrics = MetricRecorder(MetricFinder(cfg.metrics_include, cfg.metrics_exclude), self)
                run.attributes = AttributeTracker(self._ddp_attribute_targets(run.metrics.objects),
                                                  cfg.attribute_memory_mb)
                run.outside = self._ddp_outside_markers()
                root = self._ddp_journal_root()
                by_dataset = isinstance(loader, ShardedStreamLoader) and loader.split == "by_dataset"
                if root is not None and not by_dataset:  # by_dataset positions differ per rank: no resume
                    run.resume = StageResume.open(self, stage, epoch, run, root, cfg.resume_eval_every_s)
            self._ddp_run = run

        on_stage_start.__doc__ = user_on_stage_start.__doc__
        return on_stage_start

    def _ddp_wrap_stage_end(self, user_on_stage_end):
        def on_stage_end(stage, stage_loss, epoch=None):
            run = self._ddp_run  # a nested evaluate() in on_stage_end replaces it
            stage_loss = self._ddp_sync_stage(stage, stage_loss)
            check = self.ddp_eval_config.check_consistency
            error, payload = None, None
            try:
                # Between two exchanges every rank passes: saves need no synchronisation
                # of their own, so a save under `if if_main_process():` works as in SpeechBrain.
                with writer_only_saves():
                    user_on_stage_end(stage, stage_loss, epoch)
                if check:
                    payload = state_summaries(self, self._ddp_recoverables())
            except BaseException as exc:  # noqa: B036 - re-raised by exchange
                if dist.raised_on_every_rank(exc):
                    raise  # an exchange inside raised it on every rank already
                error = exc
            per_rank = dist.exchange(f"{stage.name} on_stage_end", payload, error=error)
            if run is not None and run.resume is not None:
                run.resume.close()  # on_stage_end has finished on every rank
            if check:
                check_states_agree(per_rank, stage.name)
            self._ddp_run = None

        on_stage_end.__doc__ = user_on_stage_end.__doc__
        return on_stage_end

    def _ddp_recoverables(self):
        return getattr(self.checkpointer, "recoverables", {}) if self.checkpointer else {}

    def _ddp_sync_stage(self, stage, stage_loss):
        """Returns the global stage loss after merging metrics (collective)."""
        run = self._ddp_run
        resumed = run is not None and run.resume is not None and run.resume.done
        if dist.get_world_size() == 1 and not resumed:
            return stage_loss  # one process that evaluated everything itself: nothing to merge
        if stage == sb.Stage.TRAIN:
            dist.exchange("TRAIN stage end")
            total, count = dist.all_reduce_sum([stage_loss * self.step, self.step])
            return total / count if count else stage_loss
        if run is None or not run.sharded:
            return stage_loss  # every rank evaluated everything itself
        # Everything that can fail on one rank happens before the exchange, so a
        # failure is reported there instead of leaving the others in a collective.
        error, objects, packed, unmergeable, outside = None, {}, None, {}, {}
        try:
            positions = global_batch_ids(run.loader)
            metric_state = run.metrics.finish(self, positions)
            objects = run.metrics.objects
            _, unmergeable, attribute_state = run.attributes.finish(positions)
            excluded = set(self.ddp_eval_config.attributes_exclude) | set(run.attributes.tracks)
            outside = {label: why for label, why in
                       changed_outside(run.outside, self._ddp_outside_markers()).items()
                       if label not in excluded}
            old = run.resume.old_states() if run.resume is not None else []
            packed = pickle.dumps((metric_state, attribute_state, old))
        except Exception as exc:
            error = exc
        per_rank = dist.exchange(f"{stage.name} stage end",
                                 (describe_objects(objects), unmergeable, outside), error=error)
        check_same_objects([p[0] for p in per_rank], stage.name)
        self._ddp_report_unmergeable(stage, [p[1] for p in per_rank], [p[2] for p in per_rank])
        old_sum, old_count = run.resume.old_loss() if run.resume is not None else (0.0, 0)
        total, count = dist.all_reduce_sum([run.loss_sum + old_sum, run.loss_count + old_count])
        with _gc_paused():  # unpickling many small objects triggers costly full GCs
            states = [pickle.loads(view) for view in dist.all_gather_bytes(packed)]
            # every rank's stage, then the journal's pieces (rank 0 sent them): all by global position
            states = [(m, a) for m, a, _ in states] + [piece for _, _, old in states for piece in old]
            apply_merged(objects, run.metrics.start, merge_metric_stats([m for m, _ in states]))
            run.attributes.apply(merge_attribute_states([a for _, a in states]), self._ddp_locate)
        loss = total / count if count else 0.0
        self._ddp_global_loss[stage] = loss
        return loss

    def _ddp_report_unmergeable(self, stage, unmergeable: List[Dict[str, str]],
                                outside: List[Dict[str, str]]) -> None:
        """Warns (rank 0) or raises (every rank) about state left rank-local."""
        messages = []
        name = stage.name.lower()
        found = _first_seen(unmergeable)
        if found:
            messages.append(
                f"ddp_eval: at the end of the sharded {stage.name} stage, attributes changed "
                f"in a way that cannot be merged across ranks, so each rank holds only its own "
                f"batches' values: {found}. Expected lists that only grow, dicts that gain keys "
                "or replace values, numbers or fixed-shape tensors that accumulate. Compute the "
                "value in on_stage_end from merged state, or list the attribute in "
                f"ddp_eval: attributes_exclude (silences this), or set shard_{name}: false."
            )
        found = _first_seen(outside)
        if found:
            messages.append(
                f"ddp_eval: during the sharded {stage.name} stage, state outside the Brain "
                f"changed, so each rank holds only its own batches' share of it: {found}. "
                "Expected state a stage accumulates on the Brain. To merge it like a Brain "
                "attribute, list its path in ddp_eval: attributes_include (e.g. "
                f"[hparams.aligner.align_dict]); or set shard_{name}: false; or list the path "
                "in ddp_eval: attributes_exclude if it is rank-local on purpose."
            )
        if not messages:
            return
        if self.ddp_eval_config.on_unmergeable_attribute == "error":
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
