"""``DDPEvalMixin``: sharded, exact validation and test for SpeechBrain's Brain."""

import logging
import pathlib
from contextlib import contextmanager
from typing import Any, Dict, Optional

import speechbrain as sb
from speechbrain.dataio.dataloader import LoopedLoader
from torch.utils.data import DataLoader

from ddp_eval import distributed as dist
from ddp_eval.checkpointing.checkpoint import share_debug_folder, writer_only_saves
from ddp_eval.config import DDPEvalConfig
from ddp_eval.distributed import fsdp
from ddp_eval.errors import ConfigError
from ddp_eval.stage import JOURNAL_DIRNAME, ShardedStage, check_states_agree, global_train_loss, state_summaries
from ddp_eval.stage.sharding import is_sharded, shard_dataloader

logger = logging.getLogger(__name__)


class DDPEvalMixin:
    """Shards VALID and TEST across ranks and makes every rank see global results.

    Use it before ``sb.Brain`` in the bases: ``class MyBrain(DDPEvalMixin,
    sb.Brain)``. Under ``torchrun``:

    * ``fit(valid_set=...)`` and ``evaluate(test_set)`` evaluate each batch on
      exactly one rank (the batches one process would build, dealt in snake
      order), map-style and streaming sets and loaders the recipe built alike;
      DDP buffers are broadcast from rank 0 at stage start, so a rank without a
      batch never blocks the others;
    * before ``on_stage_end``, the stage loss is SpeechBrain's running average
      replayed over every rank's per-batch losses in one process's order (bit
      for bit), and every SpeechBrain metric object and every plain
      attribute the stage changed (lists, dicts, counters, arrays, values set
      per batch) is merged, so ``on_stage_end`` runs on every rank with the
      single-process loss, metrics and attributes (the TRAIN loss becomes the
      average over all ranks); what cannot be merged is named in a warning;
    * an exception on one rank is raised on every rank, and every wait is
      bounded by ``ddp_eval: collective_timeout``.

    Without a process group (``python train.py hparams.yaml``) the results
    are SpeechBrain's own; with ``resume_eval`` on (the default) VALID/TEST
    are still journaled, in ``.ddp_eval-journal`` beside the checkpoints, so
    an interrupted evaluation resumes where it stopped.

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
        if self.ddp_eval_config.fsdp is not None and fsdp.support_problem():
            raise ConfigError(fsdp.support_problem())
        dist.set_timeout(self.ddp_eval_config.collective_timeout)
        if getattr(self.checkpointer, "tempdir", None) is not None:  # --debug: one folder for every rank
            share_debug_folder(self.checkpointer)
        self._ddp_loaders: Dict[Any, Any] = {}
        self._ddp_stage: Optional[ShardedStage] = None  # the sharded VALID/TEST stage under way
        self._ddp_global_loss: Dict[Any, float] = {}
        self._ddp_own_average: Any = None  # the recipe's own update_average, replayed at the merge
        _wrap_hooks(self)

    # -- Brain overrides ---------------------------------------------------

    def make_dataloader(self, dataset, stage: sb.Stage, ckpt_prefix: Optional[str] = "dataloader-",
                        **loader_kwargs) -> Any:
        """Makes SpeechBrain's loader, then shards VALID and TEST ones (SpeechBrain
        shards only TRAIN): each rank gets its share of the batches."""
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
        """SpeechBrain's ``fit``, with a loader the recipe built for VALID sharded too;
        a failure on one rank is raised on every rank, and rank 0 returns once
        every rank has read the last control answer."""
        _wrap_hooks(self)
        valid_set = self._ddp_loaders[sb.Stage.VALID] = self._ddp_shard_ready(valid_set, sb.Stage.VALID)
        try:
            with dist.fail_together("fit"), self._ddp_abandon_on_error():
                return super().fit(epoch_counter, train_set, valid_set, *args, **kwargs)
        finally:
            dist.settle()

    def evaluate(self, test_set, *args, **kwargs) -> float:
        """SpeechBrain's ``evaluate``, with a loader the recipe built sharded too;
        returns the global TEST loss on every rank. A failure on one rank is
        raised on every rank, and rank 0 returns once every rank has read the
        last control answer."""
        _wrap_hooks(self)
        test_set = self._ddp_loaders[sb.Stage.TEST] = self._ddp_shard_ready(test_set, sb.Stage.TEST)
        self._ddp_global_loss.pop(sb.Stage.TEST, None)
        try:
            with dist.fail_together("evaluate"), self._ddp_abandon_on_error():
                local_loss = super().evaluate(test_set, *args, **kwargs)
        finally:
            dist.settle()
        return self._ddp_global_loss.get(sb.Stage.TEST, local_loss)

    def stage_output(self, path: Any) -> Any:
        """The file a batch appends its results to (SLURP's ``predictions.jsonl``).

        Arguments
        ---------
        path : str or path-like
            The file the recipe appends to, e.g. ``open(self.stage_output(path), "a")``.

        Returns
        -------
        str or path-like
            During a sharded VALID/TEST batch, a part of ``path`` of this rank's
            own, which rank 0 appends to ``path`` at stage end, in one process's
            batch order; anywhere else, ``path`` itself.

        Example
        -------
        >>> brain = DDPEvalMixin.__new__(DDPEvalMixin)
        >>> brain._ddp_stage = None  # no sharded stage under way
        >>> brain.stage_output("predictions.jsonl")
        'predictions.jsonl'
        """
        return self._ddp_stage.stage_output(path) if self._ddp_stage is not None else path

    def _wrap_distributed(self) -> None:
        """SpeechBrain wraps each trainable module in DDP; with ``fsdp:`` each is sharded
        with torch's ``fully_shard`` instead (a module the recipe sharded is kept)."""
        options = self.ddp_eval_config.fsdp
        if options is None or not self.distributed_launch:
            return super()._wrap_distributed()
        for module in self.modules.values():
            if any(p.requires_grad for p in module.parameters()) and not fsdp.is_sharded(module):
                fsdp.shard_module(module, options.shard_modules, options.reshard_after_forward,
                                  options.mixed_precision, options.cpu_offload)

    # -- internals ---------------------------------------------------------

    def _ddp_shard_ready(self, loader, stage):
        """A DataLoader or LoopedLoader the recipe built itself (SpeechBrain passes it
        through without make_dataloader): sharded like those make_dataloader makes."""
        ready = isinstance(loader, (DataLoader, LoopedLoader)) and not is_sharded(loader)
        if not ready or not self._ddp_should_shard(stage):
            return loader
        try:
            return shard_dataloader(loader, self.ddp_eval_config.stream_split)
        except ConfigError as error:
            log = logger.warning if dist.get_world_size() > 1 else logger.info  # one process: only not journaled
            log(f"ddp_eval: the {stage.name} loader the recipe built cannot be sharded, so every rank "
                f"evaluates all of it, as in SpeechBrain: {error}")
            return loader

    @contextmanager
    def _ddp_abandon_on_error(self):
        try:
            yield
        except BaseException:
            if self._ddp_stage is not None:
                self._ddp_stage.abandon()  # the user's objects get back plain numbers and factories
                self._ddp_stage = None
            raise

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

    def _ddp_wrap_stage_start(self, user_on_stage_start):
        def on_stage_start(stage, epoch=None):
            user_on_stage_start(stage, epoch)
            if not _bookkeeps(self, "on_stage_start", on_stage_start):
                return
            _wrap_hooks(self)  # one the recipe assigned since (in on_fit_start, on_stage_start)
            loader = self._ddp_loaders.get(stage)
            self._ddp_stage = None
            if stage != sb.Stage.TRAIN and is_sharded(loader):
                self._ddp_stage = ShardedStage(self, stage, epoch, loader, self._ddp_journal_root())
                self._ddp_stage.start()

        return on_stage_start

    def _ddp_wrap_stage_end(self, user_on_stage_end):
        def on_stage_end(stage, stage_loss, epoch=None):
            if not _bookkeeps(self, "on_stage_end", on_stage_end):
                return user_on_stage_end(stage, stage_loss, epoch)
            sharded = self._ddp_stage  # a nested evaluate() in on_stage_end replaces it
            if sharded is not None:
                stage_loss = self._ddp_global_loss[stage] = sharded.finish(stage_loss)
            elif stage == sb.Stage.TRAIN:
                stage_loss = global_train_loss(stage_loss, self.step)  # every rank's batches
            elif dist.get_world_size() > 1 and is_sharded(self._ddp_loaders.get(stage)):
                raise _not_started(stage.name)
            check = self.ddp_eval_config.check_consistency

            def run_user_hook():
                # Between two exchanges every rank passes: saves need no synchronisation
                # of their own, so a save under `if if_main_process():` works as in SpeechBrain.
                with writer_only_saves() as planned:  # saves of FSDP shards, run by every rank below
                    user_on_stage_end(stage, stage_loss, epoch)
                return state_summaries(self, self._ddp_recoverables()) if check else None, planned

            per_rank = dist.decide(f"{stage.name} on_stage_end", run_user_hook)
            if per_rank[0][1]:
                self.checkpointer.save_planned(per_rank[0][1])
            if sharded is not None:
                sharded.close()  # on_stage_end has finished on every rank
            if check:
                check_states_agree([summaries for summaries, _ in per_rank], stage.name)
            self._ddp_stage = None

        return on_stage_end

    def _ddp_wrap_update_average(self, user_update_average):
        def update_average(loss, avg_loss):
            if self._ddp_stage is not None and _bookkeeps(self, "update_average", update_average):
                self._ddp_stage.after_batch(loss)  # records the batch for the merge
            return user_update_average(loss, avg_loss)

        return update_average

    def _ddp_recoverables(self):
        return getattr(self.checkpointer, "recoverables", {}) if self.checkpointer else {}


def _wrap_hooks(brain: DDPEvalMixin) -> None:
    """Wraps the Brain's stage hooks and per-batch hook on the instance, also one the
    recipe assigned after ``__init__`` (``self.update_average = f``): recipes override
    them without ``super()``, so the bookkeeping wraps the bound methods. Run at
    ``__init__``, ``fit``, ``evaluate`` and each stage start."""
    for name, wrap in (("on_stage_start", brain._ddp_wrap_stage_start),
                       ("on_stage_end", brain._ddp_wrap_stage_end),
                       ("update_average", brain._ddp_wrap_update_average)):
        hook = getattr(brain, name)
        if getattr(hook, "_ddp_brain", None) is brain:
            continue
        if name == "update_average":  # SpeechBrain's own needs no replay: the merge has its formula
            brain._ddp_own_average = None if getattr(hook, "__func__", None) is sb.Brain.update_average else hook
        wrapper = wrap(hook)
        wrapper.__doc__, wrapper._ddp_brain = hook.__doc__, brain
        setattr(brain, name, wrapper)


def _bookkeeps(brain: DDPEvalMixin, name: str, wrapper: Any) -> bool:
    """Whether ``wrapper`` does the bookkeeping: not when another of ours is in place (a
    replacement the recipe made of it, calling it, was wrapped: that wrapper does it)."""
    in_place = vars(brain).get(name)
    return in_place is wrapper or getattr(in_place, "_ddp_brain", None) is not brain


def _not_started(stage: str) -> ConfigError:
    return ConfigError(
        f"ddp_eval: the sharded {stage} stage ended, but ddp_eval's on_stage_start did not run for it (the "
        "Brain's on_stage_start was replaced after fit() or evaluate() began), so its batches were not merged: "
        "each rank holds only its own. Expected the Brain's on_stage_start as ddp_eval left it. Assign a "
        "replacement before fit() or evaluate() (ddp_eval wraps it there), not in on_fit_start or "
        "on_evaluate_start.")
