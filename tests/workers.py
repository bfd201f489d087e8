"""Functions run on every rank of a real process group by tests (see mp_harness)."""

import os
import time

import speechbrain as sb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from tests import toy


def recipe(rank, world_size, ckpt_dir, ddp_eval_opts=None):
    """Runs the toy recipe converted with the mixin; returns what on_stage_end saw."""
    brain = toy.build(toy.DDPToyBrain, ckpt_dir, ddp_eval_opts=ddp_eval_opts)
    out = toy.run_recipe(brain)
    saved = brain.checkpointer.save_checkpoint(meta={"extra": True})
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
                time.sleep(8)
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


def batchnorm_eval(rank, world_size, ckpt_dir):
    """DDP-wrapped model with BatchNorm buffers, evaluated on uneven shards.

    DDP refuses SyncBatchNorm on CPU, so the modules are wrapped as SpeechBrain
    does but without the SyncBatchNorm conversion: plain BatchNorm buffers,
    which DDP broadcasts in forward passes that need it.
    """

    class BNBrain(toy.DDPToyBrain):
        def _wrap_distributed(self):
            for name, module in self.modules.items():
                self.modules[name] = DDP(module, broadcast_buffers=True)

    brain = toy.build(BNBrain, ckpt_dir, batchnorm=True, epochs=1)
    empty = DataLoader([], batch_size=1)  # no training step: SyncBatchNorm cannot train on CPU
    valid = toy.make_dataset(7, 1)
    brain.fit(brain.hparams.counter, empty, valid, valid_loader_kwargs={"batch_size": 2})
    wrapped = type(brain.modules.model).__name__
    return {"log": brain.log, "wrapped": wrapped, "seen": brain.seen_ids}
