"""Functions run on every rank of a real process group by tests (see mp_harness)."""

import functools
import os
import random
import sys
import time

import speechbrain as sb
import torch
from speechbrain.dataio.batch import PaddedBatch

import ddp_eval
from tests import toy
from tests.mp_harness import ddp_eval_messages


def recipe(rank, world_size, ckpt_dir, ddp_eval_opts=None, async_save=False):
    """Runs the toy recipe converted with the mixin; returns what on_stage_end saw."""
    checkpointer_cls = functools.partial(ddp_eval.Checkpointer, async_save=async_save)
    brain = toy.build(toy.DDPToyBrain, ckpt_dir, ddp_eval_opts=ddp_eval_opts, checkpointer_cls=checkpointer_cls)
    out = toy.run_recipe(brain)
    saved = brain.checkpointer.save_checkpoint(meta={"extra": True})
    brain.checkpointer.wait()
    out["save_return"] = (str(saved.path), saved.meta, sorted(map(str, saved.paramfiles.values())))
    out["ckpt_files"] = sorted(os.listdir(ckpt_dir))
    return out


def fail_in_on_stage_end(rank, world_size, ckpt_dir, bad_rank):
    class Failing(toy.DDPToyBrain):
        def on_stage_end(self, stage, stage_loss, epoch=None):
            if stage == sb.Stage.VALID and int(os.environ["RANK"]) == bad_rank:
                raise ValueError("boom on purpose")
            super().on_stage_end(stage, stage_loss, epoch)

    toy.run_recipe(toy.build(Failing, ckpt_dir))


def fail_in_evaluation_loop(rank, world_size, ckpt_dir, bad_rank):
    class Failing(toy.DDPToyBrain):
        def compute_objectives(self, logits, batch, stage):
            if stage == sb.Stage.TEST and rank == bad_rank:
                raise RuntimeError("bad utterance on purpose")
            return super().compute_objectives(logits, batch, stage)

    toy.run_recipe(toy.build(Failing, ckpt_dir))


def unpicklable_metric_entry(rank, world_size, ckpt_dir, bad_rank):
    class Odd(toy.DDPToyBrain):
        def compute_objectives(self, logits, batch, stage):
            loss = super().compute_objectives(logits, batch, stage)
            if stage == sb.Stage.TEST and rank == bad_rank:
                self.cls.targets[-1] = lambda: None  # cannot travel to the other ranks
            return loss

    toy.run_recipe(toy.build(Odd, ckpt_dir))


def slow_rank(rank, world_size, ckpt_dir, late_rank):
    class Slow(toy.DDPToyBrain):
        def on_stage_start(self, stage, epoch=None):
            if stage == sb.Stage.VALID and rank == late_rank:
                time.sleep(5)  # the others give up after 1.5 s (+0.5 s to report)
            super().on_stage_start(stage, epoch)

    brain = toy.build(Slow, ckpt_dir, ddp_eval_opts={"collective_timeout": 1.5})
    toy.run_recipe(brain)


def diverging_scheduler(rank, world_size, ckpt_dir):
    class Diverging(toy.DDPToyBrain):
        def on_stage_end(self, stage, stage_loss, epoch=None):
            if stage == sb.Stage.VALID:
                stage_loss = stage_loss + rank  # a rank-local value drives the scheduler
            super().on_stage_end(stage, stage_loss, epoch)

    brain = toy.build(Diverging, ckpt_dir, ddp_eval_opts={"check_consistency": True})
    toy.run_recipe(brain)


def keep_plain_batchnorm():
    """SpeechBrain converts BatchNorm to SyncBatchNorm under DDP, which cannot
    train on CPU; within this context, plain BatchNorm stays (buffers DDP broadcasts)."""
    from unittest import mock

    import torch

    return mock.patch.object(torch.nn.SyncBatchNorm, "convert_sync_batchnorm",
                             staticmethod(lambda module, *a, **k: module))


BN_SETS = {"train": (10, 0), "valid": (5, 8), "test": (7, 9)}


def batchnorm_train_then_eval(rank, world_size, ckpt_dir):
    """A BatchNorm model trained under DDP for one epoch (lr > 0, so weights and
    running statistics change), then VALID (5 items, batch 4: 2 batches) and
    TEST (7 items, batch 2: 4 batches), so some ranks get no batch."""
    with ddp_eval_messages() as warnings, keep_plain_batchnorm():  # SpeechBrain wraps modules in on_fit_start
        brain = toy.build(toy.DDPToyBrain, ckpt_dir, batchnorm=True, epochs=1, lr=0.5)
        sets = {name: toy.make_dataset(n, seed) for name, (n, seed) in BN_SETS.items()}
        brain.fit(brain.hparams.counter, sets["train"], sets["valid"],
                  train_loader_kwargs={"batch_size": 4}, valid_loader_kwargs={"batch_size": 4})
        seen_valid = list(brain.seen.ids)
        brain.evaluate(sets["test"], min_key="loss", test_loader_kwargs={"batch_size": 2})
    return {"log": brain.log, "wrapped": type(brain.modules.model).__name__,
            "seen": {"valid": seen_valid, "test": brain.seen.ids[len(seen_valid):]}, "warnings": warnings}


def accumulating_recipe(rank, world_size, ckpt_dir, stream, ddp_eval_opts=None):
    class Converted(ddp_eval.DDPEvalMixin, toy.AccumulatingBrain):
        pass

    brain = toy.build(Converted, ckpt_dir, epochs=1, ddp_eval_opts=ddp_eval_opts)
    return toy.run_accumulating(brain, stream)


def running_max_attribute(rank, world_size, ckpt_dir, ddp_eval_opts):
    """A Brain keeping a running maximum by an ``if`` (a comparison that steers code:
    kept rank-local, reported), and the ids of its last batch (merged)."""
    class LastBatch(ddp_eval.DDPEvalMixin, toy.AccumulatingBrain):
        def on_stage_start(self, stage, epoch=None):
            super().on_stage_start(stage, epoch)
            self.best_batch_acc = 0.0

        def compute_objectives(self, logits, batch, stage):
            self.last_ids = list(batch.id)
            accuracy = float((logits.argmax(-1) == batch.label.data[:, 0]).float().mean())
            if accuracy > self.best_batch_acc:
                self.best_batch_acc = accuracy
            return super().compute_objectives(logits, batch, stage)

        def on_stage_end(self, stage, stage_loss, epoch=None):
            super().on_stage_end(stage, stage_loss, epoch)
            if stage != sb.Stage.TRAIN:
                self.log[-1]["last_ids"] = self.last_ids

    with ddp_eval_messages() as warnings:
        toy.run_accumulating(toy.build(LastBatch, ckpt_dir, epochs=1, ddp_eval_opts=ddp_eval_opts))
    return warnings


def tensor_state_evaluations(rank, world_size, use_mixin, batch_counts):
    """Evaluates sets of ``batch_counts`` batches (batch size 2) with a
    TensorStateBrain; returns per set the tensors, loss, peak RSS growth of
    evaluate() in MB, and the warnings this rank logged."""
    from tests.memory import fixed_mmap_threshold, peak_growth

    fixed_mmap_threshold()
    base = toy.TensorStateBrain
    cls = type("Converted", (ddp_eval.DDPEvalMixin, base), {}) if use_mixin else base
    out = []
    with ddp_eval_messages() as warnings:
        brain = toy.build_tensor_state(cls)
        for batches in batch_counts:
            data = toy.make_dataset(2 * batches, seed=batches)
            loss, growth, seconds = peak_growth(brain.evaluate, data, test_loader_kwargs={"batch_size": 2})
            out.append({"loss": loss, "growth_mb": growth, "seconds": seconds, "counts": brain.counts.clone(),
                        "acc_small": brain.acc_small.clone(), "acc_big": brain.acc_big.clone(),
                        "table_version": brain.table._version})
    return {"runs": out, "warnings": warnings}


def alignment_example(rank, world_size, ddp_eval_opts):
    """The ASR_alignment_viterbi-shaped recipe under the mixin; its result and warnings."""
    from tests import alignment

    with ddp_eval_messages() as warnings:
        out = alignment.run(alignment.DDPAlignBrain, ddp_eval_opts)
    return {**out, "warnings": warnings}


def save_test_checkpoint(directory, shift=0.0, loss=1.0):
    """One checkpoint of the toy model (weights shifted by ``shift``) with meta loss ``loss``."""
    import torch

    brain = toy.build(toy.ToyBrain, directory, epochs=1)
    with torch.no_grad():
        brain.modules.model[0].weight.add_(shift)
    brain.checkpointer.save_checkpoint(meta={"loss": loss})


TEST_SET = (23, 2, "tst")  # 23 utterances: 12 batches of 2


def plain_test(directory, batch_size=2, stream=False):
    """One plain SpeechBrain process evaluating the best checkpoint: the reference."""
    import speechbrain as sb

    brain = toy.build(toy.FullBrain, directory, epochs=1, checkpointer_cls=sb.utils.checkpoints.Checkpointer)
    loss = brain.evaluate(*_test_args(batch_size, stream))
    return {"loss": loss, "log": brain.log[-1]}


def _test_args(batch_size, stream):
    from speechbrain.dataio.batch import PaddedBatch

    data = toy.make_dataset(*TEST_SET)
    kwargs = {"batch_size": batch_size}
    if stream:
        data, kwargs = toy.UtteranceStream(data), {"batch_size": batch_size, "collate_fn": PaddedBatch}
    return data, None, "loss", None, kwargs


class ReadsBeforeTheInterruption(toy.FullBrain):
    """In TEST, only in the run that is interrupted (as a condition on the data may
    hold only in its batches): keeps the first ids (a read that steers an append)
    and sorts ``ranked`` in place; every run extends ``ranked``."""

    def on_stage_start(self, stage, epoch=None):
        super().on_stage_start(stage, epoch)
        self.first, self.ranked = [], []

    def compute_objectives(self, logits, batch, stage):
        loss = super().compute_objectives(logits, batch, stage)
        if stage == sb.Stage.TEST:
            self.ranked.extend(batch.id)
            if self.interrupt_after is not None:
                if len(self.first) < 3:
                    self.first.extend(batch.id)
                self.ranked.sort()
        return loss


def resumable_test(rank, world_size, directory, interrupt_after=None, batch_size=2, stream=False, opts=None,
                   after_fit=False, brain_class=toy.FullBrain):
    """The mixin evaluates the best checkpoint, journaling after every batch; with
    ``interrupt_after`` each rank stops after that many batches (all ranks raise).
    ``after_fit``: the Brain holds what a fit() leaves (a restart that finds every
    epoch done skips fit, so the resumed run does not)."""
    import logging

    cls = type("Converted", (ddp_eval.DDPEvalMixin, brain_class), {})
    brain = toy.build(cls, directory, epochs=1, ddp_eval_opts={"resume_eval_every_s": 0, **(opts or {})})
    brain.interrupt_after = interrupt_after
    if after_fit:
        brain.train_stats, brain.avg_train_loss = {"loss": 1.0}, 1.0
    out = {"notes": [], "batches": 0, "ids": []}
    with ddp_eval_messages(logging.INFO) as notes:
        try:
            out["loss"] = brain.evaluate(*_test_args(batch_size, stream))
            out["log"] = brain.log[-1]
        except ddp_eval.DDPEvalError as error:  # the other ranks of an interrupted one
            out["error"] = type(error).__name__
        except toy.Interrupted:
            out["error"] = "Interrupted"
    out["batches"], out["ids"] = getattr(brain.seen, "batches", 0), list(brain.seen.ids)
    return {**out, "notes": notes}


def transformer_style_recipe(rank, world_size, ckpt_dir, async_save=False):
    """SpeechBrain's transformer recipes' saving pattern, converted by the README's diff."""
    class Converted(ddp_eval.DDPEvalMixin, toy.TransformerStyleBrain):
        pass

    checkpointer_cls = functools.partial(ddp_eval.Checkpointer, async_save=async_save)
    brain = toy.build(Converted, ckpt_dir, checkpointer_cls=checkpointer_cls, epochs=3)
    return toy.run_transformer_style(brain)


def guarded_save_fails(rank, world_size, ckpt_dir):
    """ENOSPC in the save VALID's on_stage_end makes under `if if_main_process():`."""
    import errno

    class Converted(ddp_eval.DDPEvalMixin, toy.TransformerStyleBrain):
        pass

    brain = toy.build(Converted, ckpt_dir, epochs=3, ddp_eval_opts={"collective_timeout": 60})
    write = brain.checkpointer.folder.write

    def full_disk_at_epoch_2(dirname, meta, fill):
        if meta.get("epoch") == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(dirname, meta, fill)

    brain.checkpointer.folder.write = full_disk_at_epoch_2
    start = time.monotonic()
    try:
        toy.run_transformer_style(brain)
    except ddp_eval.DDPEvalError as error:
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start,
                "log": brain.log}
    return {"error": None}


def unpicklable_last_value(rank, world_size, ckpt_dir):
    """A Brain that binds an object that cannot be pickled in every batch: the one
    of the globally last batch cannot be sent to the other ranks."""
    class Unsendable(ddp_eval.DDPEvalMixin, toy.AccumulatingBrain):
        def compute_objectives(self, logits, batch, stage):
            ids = list(batch.id)
            self.last_hook = lambda: ids  # a local closure: not picklable
            return super().compute_objectives(logits, batch, stage)

    toy.run_accumulating(toy.build(Unsendable, ckpt_dir, epochs=1))


def unmakeable_metric_object(rank, world_size, ckpt_dir):
    """TEST creates one ErrorRateStats(split_tokens=True) per label, in a plain dict:
    a rank without the batch that created one cannot make one configured the same."""
    from speechbrain.utils.metric_stats import ErrorRateStats

    class PerLabel(ddp_eval.DDPEvalMixin, toy.AccumulatingBrain):
        def on_stage_start(self, stage, epoch=None):
            super().on_stage_start(stage, epoch)
            self.per_label = {}

        def compute_objectives(self, logits, batch, stage):
            for utt, label in zip(batch.id, batch.label.data[:, 0].tolist()):
                if stage == sb.Stage.TEST and f"l{label}" not in self.per_label:
                    self.per_label[f"l{label}"] = ErrorRateStats(split_tokens=True)
                if stage == sb.Stage.TEST:
                    self.per_label[f"l{label}"].append([utt], [["a"]], [["a"]])
            return super().compute_objectives(logits, batch, stage)

    brain = toy.build(PerLabel, ckpt_dir, epochs=1, ddp_eval_opts={"collective_timeout": 60})
    start = time.monotonic()
    try:
        toy.run_accumulating(brain)
    except ddp_eval.DDPEvalError as error:
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    return {"error": None}


def leave_traces(rank, world_size, patch):
    """Changes what a pooled rank must not carry to the next test: an environment
    variable, the working directory, the torch seed and (``patch``) a function of
    ddp_eval, none of them undone."""
    import torch

    import ddp_eval.distributed

    os.environ["DDP_EVAL_TEST_TRACE"] = "left"
    os.chdir("/")
    torch.manual_seed(rank + 5)
    if patch:
        ddp_eval.distributed.get_rank = lambda: rank
    return os.getpid()


def what_a_rank_starts_with(rank, world_size):
    import torch

    import ddp_eval.distributed

    return {"pid": os.getpid(), "trace": os.environ.get("DDP_EVAL_TEST_TRACE"), "cwd": os.getcwd(),
            "get_rank": ddp_eval.distributed.get_rank.__module__, "seed": torch.initial_seed()}


def fail_together(rank, world_size, how):
    """Ends a task as ``how`` says: ``"agreed"``, rank 1's own exception raised on every
    rank through ddp_eval's decide; ``"timeout"``, a collective timeout on every rank;
    ``"thread"``, a thread of the test's still running."""
    import threading

    from ddp_eval import distributed as dist
    from ddp_eval.errors import CollectiveTimeoutError

    def local():
        if rank == 1:
            raise RuntimeError("rank 1 fails")
        return os.getpid()

    if how == "agreed":
        dist.decide("fail together", local)
    if how == "timeout":
        raise CollectiveTimeoutError("a collective timed out (raised by the test)")
    if how == "thread":
        threading.Thread(target=threading.Event().wait, args=(60,), name="ddp_eval test: left running",
                         daemon=True).start()
    return os.getpid()


def exit_hook(rank, world_size, uncaught_on):
    """Runs ddp_eval's exit hook after an exchange, rank ``uncaught_on`` as if the
    script had ended by an uncaught exception; whether the process group is still there."""
    import torch.distributed

    from ddp_eval import distributed as dist

    dist.decide("the last exchange", lambda: rank)
    if rank == uncaught_on:
        sys.last_value = RuntimeError("uncaught")  # what the interpreter records before atexit runs
    dist._settle_at_exit()
    return torch.distributed.is_initialized()


def cyclic_scheduler_recipe(rank, world_size, ckpt_dir, verify):
    """A recipe whose cyclic learning-rate scheduler (in hparams) steps in
    compute_objectives, at every batch of every stage, as a SpeechBrain sound
    classification recipe's does; returns the lr and the scheduler's count after
    each stage."""
    from speechbrain.nnet.schedulers import CyclicLRScheduler

    class Cyclic(toy.DDPToyBrain):
        def compute_objectives(self, logits, batch, stage):
            self.hparams.cyclic.on_batch_end(self.optimizer)
            return super().compute_objectives(logits, batch, stage)

        def on_stage_end(self, stage, stage_loss, epoch=None):
            super().on_stage_end(stage, stage_loss, epoch)
            self.lrs.append((stage.name, self.optimizer.param_groups[0]["lr"], self.hparams.cyclic.clr_iterations))

    brain = toy.build(Cyclic, ckpt_dir, ddp_eval_opts={"verify": verify}, lr=0.05)
    brain.hparams.cyclic = CyclicLRScheduler(base_lr=0.01, max_lr=0.1, step_size=3)
    brain.lrs = []
    toy.run_recipe(brain)
    return brain.lrs


class UnevenLossBrain(toy.ToyBrain):
    """TEST losses over seven orders of magnitude and a non-finite one (SpeechBrain's
    running average skips it, and counts its step): where a sum over a count and
    the running average differ in the last bits. ``interrupt_after``: TEST batches
    this process evaluates before a stand-in preemption."""

    interrupt_after = None

    def compute_objectives(self, logits, batch, stage):
        loss = super().compute_objectives(logits, batch, stage)
        if stage != sb.Stage.TEST:
            return loss
        if self.interrupt_after is not None:
            if self.interrupt_after == 0:
                raise toy.Interrupted("preempted during TEST")
            self.interrupt_after -= 1
        number = int(batch.id[0][-3:])
        return loss * 10.0 ** (number * 7 % 8 - 3) * (float("inf") if number == 41 else 1.0)


class DDPUnevenLossBrain(ddp_eval.DDPEvalMixin, UnevenLossBrain):
    """The same recipe, converted."""


def uneven_test_losses(rank, world_size, directory, sizes, interrupt_after=None):
    """The stage loss ``evaluate()`` returns for TEST sets of ``sizes`` one-utterance
    batches, journaled after every batch; interrupted after ``interrupt_after``
    batches on each rank (then ``{"error": ...}``)."""
    cls = DDPUnevenLossBrain if world_size else UnevenLossBrain
    opts = {"resume_eval_every_s": 0}
    brain = toy.build(cls, directory, ddp_eval_opts=opts,
                      checkpointer_cls=ddp_eval.Checkpointer if world_size else sb.utils.checkpoints.Checkpointer)
    brain.interrupt_after = interrupt_after
    losses = []
    for size in sizes:
        try:
            losses.append(brain.evaluate(toy.make_dataset(size, size, "tst"), test_loader_kwargs={"batch_size": 1}))
        except (toy.Interrupted, ddp_eval.DDPEvalError) as error:
            return {"error": type(error).__name__}
        assert brain.log[-1]["loss"] == losses[-1]  # what on_stage_end saw
    return {"losses": losses}


class BestAndWorst(toy.AccumulatingBrain):
    """Running extremes kept with the builtin ``max`` and ``min``, as recipes keep
    them: on the Brain, per label in a dict, and started as a float or an int."""

    def on_stage_start(self, stage, epoch=None):
        super().on_stage_start(stage, epoch)
        self.best_acc, self.lowest_loss, self.most_wrong = 0.0, float("inf"), 0
        self.best_per_label = {label: -1.0 for label in range(toy.CLASSES)}

    def compute_objectives(self, logits, batch, stage):
        labels = batch.label.data[:, 0]
        hits = logits.argmax(-1) == labels
        self.best_acc = max(self.best_acc, float(hits.double().mean()))
        loss = super().compute_objectives(logits, batch, stage)
        self.lowest_loss = min(float(loss), self.lowest_loss)
        self.most_wrong = max(self.most_wrong, int((~hits).sum()))
        top = {}  # the batch's best score per label, then one max per label
        for label, score in zip(labels.tolist(), logits.detach().double().max(-1).values.tolist()):
            top[label] = max(top.get(label, score), score)
        for label, score in top.items():
            self.best_per_label[label] = max(self.best_per_label[label], score)
        return loss

    def on_stage_end(self, stage, stage_loss, epoch=None):
        super().on_stage_end(stage, stage_loss, epoch)
        if stage != sb.Stage.TRAIN:
            self.log[-1]["extremes"] = (self.best_acc, self.lowest_loss, self.most_wrong, dict(self.best_per_label))


def _converted_accumulating(base, ckpt_dir, ddp_eval_opts):
    """``base`` (an ``AccumulatingBrain``) converted and run: its log and the warnings
    this rank logged."""
    converted = type("Converted", (ddp_eval.DDPEvalMixin, base), {})
    with ddp_eval_messages() as warnings:
        out = toy.run_accumulating(toy.build(converted, ckpt_dir, epochs=1, ddp_eval_opts=ddp_eval_opts))
    return {"log": out["log"], "warnings": warnings}


def builtin_extremes(rank, world_size, ckpt_dir, ddp_eval_opts):
    """``BestAndWorst`` converted: its log and the warnings this rank logged."""
    return _converted_accumulating(BestAndWorst, ckpt_dir, ddp_eval_opts)


class RunningAccuracy(toy.AccumulatingBrain):
    """A progress figure computed in each batch from the counters batches keep:
    ``100.0 * self.n_correct`` reads the int in C (a float on its left)."""

    def compute_objectives(self, logits, batch, stage):
        loss = super().compute_objectives(logits, batch, stage)
        if stage != sb.Stage.TRAIN:
            self.running_acc = 100.0 * self.n_correct / self.n_seen
        return loss

    def on_stage_end(self, stage, stage_loss, epoch=None):
        super().on_stage_end(stage, stage_loss, epoch)
        if stage != sb.Stage.TRAIN:
            self.log[-1]["running_acc"] = self.running_acc


GLOBAL_IDS = []  # what GlobalState's batches accumulate outside the Brain


class GlobalState(toy.AccumulatingBrain):
    """Accumulates into a global of its module and a class attribute: state outside
    the Brain, each rank holding its own batches' share."""

    per_class = {}

    def compute_objectives(self, logits, batch, stage):
        if stage != sb.Stage.TRAIN:
            GLOBAL_IDS.extend(batch.id)
            self.per_class.update((utt, 1) for utt in batch.id)
        return super().compute_objectives(logits, batch, stage)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        super().on_stage_end(stage, stage_loss, epoch)
        if stage != sb.Stage.TRAIN:
            self.log[-1]["outside"] = (len(GLOBAL_IDS), len(self.per_class))


def global_state(rank, world_size, ckpt_dir, ddp_eval_opts):
    """``GlobalState`` converted (its global and class attribute emptied first: pool
    workers are reused): its log and the warnings this rank logged."""
    GLOBAL_IDS.clear()
    GlobalState.per_class = {}
    return _converted_accumulating(GlobalState, ckpt_dir, ddp_eval_opts)


class Progress:
    """The recipe's own progress meter; its ``update`` reads its ints in C."""

    def __init__(self):
        self.hits, self.seen = 0, 0

    def update(self, hits, seen):
        self.hits += hits
        self.seen += seen
        self.rate = 100.0 * self.hits / self.seen


class HeldProgress(toy.AccumulatingBrain):
    """``RunningAccuracy`` kept by an object of the recipe's own, made per stage."""

    def on_stage_start(self, stage, epoch=None):
        super().on_stage_start(stage, epoch)
        self.progress = Progress()

    def compute_objectives(self, logits, batch, stage):
        if stage != sb.Stage.TRAIN:
            hits = int((logits.argmax(-1) == batch.label.data[:, 0]).sum())
            self.progress.update(hits, len(batch.id))
        return super().compute_objectives(logits, batch, stage)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        super().on_stage_end(stage, stage_loss, epoch)
        if stage != sb.Stage.TRAIN:
            self.log[-1]["running_acc"] = self.progress.rate


def running_accuracy(rank, world_size, ckpt_dir, ddp_eval_opts, recipe="RunningAccuracy"):
    """``RunningAccuracy`` (or ``HeldProgress``) converted: its log and the warnings
    this rank logged."""
    return _converted_accumulating(globals()[recipe], ckpt_dir, ddp_eval_opts)


def train_losses(rank, world_size, losses, steps):
    """What ``on_stage_end(TRAIN)`` gets on this rank, whose loop averaged ``losses[rank]``
    over ``steps[rank]`` batches: the loss, or the error raised."""
    try:
        return {"loss": ddp_eval.stage.global_train_loss(losses[rank], steps[rank])}
    except ddp_eval.DDPEvalError as error:
        return {"error": str(error)}


def _worst_batch_loss(brain, loss, avg_loss):
    """An ``update_average`` of a recipe's own: the worst batch loss of the stage."""
    return max(float(avg_loss), float(loss)) if brain.step > 1 else float(loss)


class AssignedHooks(toy.AccumulatingBrain):
    """A recipe that assigns its hooks on the instance after the Brain was made:
    ``where`` says when (``script``: between ``__init__`` and ``fit``, its
    ``on_stage_end`` wrapping the one in place; ``on_evaluate_start``: an
    ``update_average`` for TEST only; ``on_stage_start_late``: an ``on_stage_start``
    replaced in ``on_evaluate_start``; ``in_a_batch``: an ``update_average``
    assigned by TEST's first batch)."""

    where = None

    def on_evaluate_start(self, max_key=None, min_key=None):
        super().on_evaluate_start(max_key, min_key)
        if self.where == "on_evaluate_start":
            self.update_average = functools.partial(_worst_batch_loss, self)
        if self.where == "on_stage_start_late":
            self.on_stage_start = functools.partial(toy.AccumulatingBrain.on_stage_start, self)

    def compute_objectives(self, logits, batch, stage):
        if self.where == "in_a_batch" and stage == sb.Stage.TEST and "update_average" in vars(self):
            self.update_average = functools.partial(_worst_batch_loss, self)
        return super().compute_objectives(logits, batch, stage)


class DDPAssignedHooks(ddp_eval.DDPEvalMixin, AssignedHooks):
    """The same recipe, converted."""


def assigned_hooks(rank, world_size, directory, where):
    """``AssignedHooks`` (plain in one process, ``world_size`` 0): fit, then TEST;
    its log, the stage ends its own ``on_stage_end`` saw, or the error raised."""
    cls = DDPAssignedHooks if world_size else AssignedHooks
    brain = toy.build(cls, directory,
                      checkpointer_cls=ddp_eval.Checkpointer if world_size else sb.utils.checkpoints.Checkpointer)
    brain.where, brain.ends = where, []
    if where == "script":
        brain.update_average = functools.partial(_worst_batch_loss, brain)
        in_place = brain.on_stage_end

        def on_stage_end(stage, stage_loss, epoch=None):
            brain.ends.append(stage.name)
            return in_place(stage, stage_loss, epoch)

        brain.on_stage_end = on_stage_end
    try:
        brain.fit(brain.hparams.counter, toy.make_dataset(8, 0), toy.make_dataset(23, 1),
                  train_loader_kwargs={"batch_size": 4}, valid_loader_kwargs={"batch_size": 3})
        test_loss = brain.evaluate(toy.make_dataset(4, 2, "tst"), test_loader_kwargs={"batch_size": 2})  # 2 batches
    except ddp_eval.DDPEvalError as error:
        return {"error": str(error)}
    return {"log": brain.log, "test_loss": test_loss, "ends": brain.ends}


def noisy_collate(items):
    """A collate_fn that draws noise from torch's global generator (in a DataLoader worker)."""
    batch = PaddedBatch(items)
    batch.x.data.add_(torch.rand(batch.x.data.shape))
    return batch


def python_drawing_collate(items):
    """A collate_fn that draws from Python's ``random``, and changes nothing it returns."""
    random.random()
    return PaddedBatch(items)


def worker_draws(rank, world_size, directory, cases):
    """For each ``(collate, exclude, stream)`` of ``cases``: TEST of 4 utterances at
    batch 2 (at 3 ranks, rank 2 has no batch), loaded by DataLoader workers with ``collate`` (two; a stream: one, its
    utterances read whole on every rank) (one process: plain SpeechBrain, ``world_size``
    0), its loss and what ddp_eval warned. ``stream`` "seeded apart": each rank's
    generator, which seeds the workers, seeded by its rank."""
    cls = toy.DDPToyBrain if world_size else toy.ToyBrain
    found = []
    for index, (collate, exclude, stream) in enumerate(cases):
        brain = toy.build(cls, os.path.join(directory, str(index)), ddp_eval_opts={"attributes_exclude": list(exclude)},
                          checkpointer_cls=ddp_eval.Checkpointer if world_size else sb.utils.checkpoints.Checkpointer)
        torch.manual_seed(7 + (rank if stream == "seeded apart" else 0))  # the workers' seeds come from it
        kwargs = {"batch_size": 2, "num_workers": 1 if stream else 2,
                  "collate_fn": globals().get(collate, PaddedBatch),
                  "multiprocessing_context": "fork"}  # the toy set's pipeline is a local function
        data = toy.make_dataset(4, 3, "tst")
        with ddp_eval_messages() as warnings:
            loss = brain.evaluate(toy.UtteranceStream(data) if stream else data, test_loader_kwargs=kwargs)
        found.append({"loss": loss, "warnings": warnings})
    return found
