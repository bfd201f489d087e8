"""Evaluation loaders whose samplers change from one pass to the next, as
SpeechBrain recipes build them, and a recipe that reports what each pass saw.

Every sampler here is deterministic given the passes made so far, so one plain
SpeechBrain process and N ranks of the converted recipe can be compared: the
utterances each stage evaluated, its loss and metrics, and the sampler's state
after the run.
"""

import types

import speechbrain as sb
import torch
from speechbrain.dataio.sampler import DynamicBatchSampler, ReproducibleRandomSampler
from torch.utils.data import Sampler

import ddp_eval
from tests import toy

KINDS = ("dynamic_shuffle", "dynamic_random_order", "reproducible_random", "stateful")
VALID_SET, TEST_SET = (41, 1), (23, 2, "tst")


class RotatingSampler(Sampler):
    """A sampler of the test's own: every pass starts one item further on, and
    reverses the order on odd passes (state that advances per pass)."""

    def __init__(self, n):
        self.n, self.passes = n, 0

    def __iter__(self):
        shift, self.passes = self.passes, self.passes + 1
        order = [(i + shift) % self.n for i in range(self.n)]
        return iter(order[::-1] if shift % 2 else order)

    def __len__(self):
        return self.n


def loader_kwargs(kind, dataset):
    """``*_loader_kwargs`` for ``fit``/``evaluate``, and the sampler object."""
    if kind.startswith("dynamic"):
        lengths = [dataset.data[i]["length"] for i in dataset.data_ids]
        shuffle = kind == "dynamic_shuffle"
        sampler = DynamicBatchSampler(dataset, max_batch_length=20, num_buckets=3, length_func=lambda d: d["length"],
                                      shuffle=shuffle, batch_ordering="ascending" if shuffle else "random",
                                      lengths_list=lengths)
        return {"batch_sampler": sampler}, sampler
    sampler = ReproducibleRandomSampler(dataset, seed=7) if kind == "reproducible_random" else RotatingSampler(
        len(dataset))
    return {"sampler": sampler, "batch_size": 3}, sampler


def sampler_state(sampler):
    """What the sampler will yield next, and its counters."""
    if isinstance(sampler, DynamicBatchSampler):
        return {"batches": [list(b) for b in sampler._batches], "epoch": sampler._epoch}
    if isinstance(sampler, ReproducibleRandomSampler):
        return {"epoch": sampler.epoch, "next": list(sampler)}  # reseeded at every pass: reading is harmless
    return {"passes": sampler.passes}


class SamplerBrain(toy.FullBrain):
    """Every metric type and plain attribute of FullBrain, recorded for VALID and
    TEST; NewBob stepped from VALID; a ReproducibleRandomSampler gets
    ``set_epoch`` at every VALID start, as its docstring asks."""

    def on_stage_start(self, stage, epoch=None):
        super().on_stage_start(stage, epoch)
        if stage == sb.Stage.VALID and hasattr(self.valid_sampler, "epoch"):
            self.valid_sampler.set_epoch(epoch)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        if stage == sb.Stage.TRAIN:
            return
        toy.AccumulatingBrain.on_stage_end(self, stage, stage_loss, epoch)
        record = self.log[-1]
        record["metrics"] = toy._summaries(self)
        if stage == sb.Stage.VALID:
            self.hparams.scheduler(stage_loss)
            record["scheduler"] = (self.hparams.scheduler.hyperparam_value,
                                   list(self.hparams.scheduler.metric_values))


class DDPSamplerBrain(ddp_eval.DDPEvalMixin, SamplerBrain):
    """The same recipe, converted."""


def run(brain, kind, fit=True, interrupt_after=None):
    """fit 2 epochs (VALID: 41 utterances through the ``kind`` sampler), then TEST
    (23 utterances, a sampler of the same kind), stopped after ``interrupt_after``
    TEST batches on every rank if given. Returns the VALID and TEST records, the
    ids each stage evaluated here, and both samplers' states."""
    valid, test = toy.make_dataset(*VALID_SET), toy.make_dataset(*TEST_SET)
    valid_kwargs, brain.valid_sampler = loader_kwargs(kind, valid)
    test_kwargs, test_sampler = loader_kwargs(kind, test)
    seen = {}
    if fit:
        brain.fit(brain.hparams.counter, toy.make_dataset(8, 0), valid,
                  train_loader_kwargs={"batch_size": 4}, valid_loader_kwargs=valid_kwargs)
        seen["valid"] = list(brain.seen.ids)
    brain.interrupt_after = interrupt_after
    start = len(brain.seen.ids)
    out = {"seen": seen}
    try:
        out["test_loss"] = brain.evaluate(test, min_key="loss", test_loader_kwargs=test_kwargs)
    except (toy.Interrupted, ddp_eval.DDPEvalError) as error:
        out["error"] = type(error).__name__
    seen["test"] = brain.seen.ids[start:]
    out.update(log=brain.log, valid_sampler=sampler_state(brain.valid_sampler),
               test_sampler=sampler_state(test_sampler), test_batches=getattr(brain.seen, "batches", 0))
    return out


def build(brain_cls, ckpt_dir, opts=None, checkpointer_cls=ddp_eval.Checkpointer):
    brain = toy.build(brain_cls, ckpt_dir, ddp_eval_opts=opts, checkpointer_cls=checkpointer_cls)
    brain.seen = types.SimpleNamespace(ids=[])
    return brain


def single_process(ckpt_dir, kind):
    """Plain SpeechBrain in one process: the reference."""
    return run(build(SamplerBrain, ckpt_dir, checkpointer_cls=sb.utils.checkpoints.Checkpointer), kind)


def ranks_worker(rank, world_size, ckpt_dir, kind, opts, fit=True, interrupt_after=None):
    """One rank of the converted recipe (run by tests.mp_harness)."""
    torch.manual_seed(0)
    return run(build(DDPSamplerBrain, ckpt_dir, opts), kind, fit, interrupt_after)
