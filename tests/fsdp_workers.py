"""Functions run on every rank of a real gloo group by the FSDP tests (see mp_harness)."""

import functools
import os
import time

import speechbrain as sb
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

import ddp_eval
from ddp_eval.distributed import fsdp
from tests import toy

SHARD_LINEARS = {"fsdp": {"shard_modules": ["Linear"]}}


class DecoderBrain(toy.ToyBrain):
    """A decoder whose number of forward calls depends on the data (as a beam search's
    number of steps does): under a sharded FSDP stage, ranks make different numbers
    of forward calls per batch and have different numbers of batches."""

    def compute_forward(self, batch, stage):
        logits = super().compute_forward(batch, stage)
        steps = 1 + int(batch.label.data.sum()) % 3 if stage != sb.Stage.TRAIN else 0
        for _ in range(steps):
            x, lens = batch.x
            logits = logits + 0.1 * self.modules.model(x[:, 0] * lens[:, None])
        return logits


class DDPDecoderBrain(ddp_eval.DDPEvalMixin, DecoderBrain):
    """The decoder recipe converted."""


def full_state(brain):
    """The model's and optimizer's full state (every rank gathers; collective under FSDP)."""
    model, full = brain.modules.model, StateDictOptions(full_state_dict=True)
    model_state = get_model_state_dict(model, options=full)
    optimizer = get_optimizer_state_dict(torch.nn.ModuleDict({"model": model}), brain.optimizer, options=full)
    return {"model": model_state, "optimizer": optimizer["state"]}


def recipe(rank, world_size, ckpt_dir, opts=SHARD_LINEARS, brain_cls=toy.DDPToyBrain, lr=0.0, async_save=False):
    """The toy recipe (fit, then four evaluations) under FSDP; what on_stage_end saw."""
    checkpointer_cls = functools.partial(ddp_eval.Checkpointer, async_save=async_save)
    brain = toy.build(brain_cls, ckpt_dir, ddp_eval_opts=opts, lr=lr, checkpointer_cls=checkpointer_cls)
    out = toy.run_recipe(brain)
    out["sharded"] = (fsdp.is_sharded(brain.modules.model), fsdp.is_sharded(brain.optimizer))
    out["ckpt_files"] = sorted(os.listdir(ckpt_dir))
    return out


def train_steps(rank, world_size, ckpt_dir, opts, epochs=3):
    """Training only (Adam, lr 0.05): every step's loss, then the final full state."""
    class Recording(toy.DDPToyBrain):
        def fit_batch(self, batch):
            loss = super().fit_batch(batch)
            self.steps.append(float(loss))
            return loss

    brain = toy.build(Recording, ckpt_dir, ddp_eval_opts=opts, lr=0.05, epochs=epochs, optimizer=torch.optim.Adam)
    brain.steps = []
    brain.fit(brain.hparams.counter, toy.make_dataset(24, 0), toy.make_dataset(11, 1),
              train_loader_kwargs={"batch_size": 4}, valid_loader_kwargs={"batch_size": 3})
    valid = [r["loss"] for r in brain.log if r["stage"] == "VALID"]
    return {"steps": brain.steps, "valid": valid, "state": full_state(brain)}


def resume(rank, world_size, ckpt_dir, opts):
    """Builds the recipe at this world size (FSDP or DDP by ``opts``), recovers the
    latest checkpoint as fit() would, and returns the full state and epoch."""
    brain = toy.build(toy.DDPToyBrain, ckpt_dir, ddp_eval_opts=opts, lr=0.05, optimizer=torch.optim.Adam)
    brain.on_fit_start()  # wraps (FSDP or DDP), makes the optimizer, recovers
    return {"state": full_state(brain), "epoch": brain.hparams.counter.current,
            "sharded": fsdp.is_sharded(brain.modules.model), "loaded": brain.checkpointer.loaded}


def fail_in_forward(rank, world_size, ckpt_dir, bad_rank):
    """An exception inside a forward on one rank during a sharded FSDP TEST."""
    class Failing(toy.DDPToyBrain):
        def compute_forward(self, batch, stage):
            if stage == sb.Stage.TEST and rank == bad_rank:
                raise RuntimeError("bad utterance on purpose")
            return super().compute_forward(batch, stage)

    toy.run_recipe(toy.build(Failing, ckpt_dir, ddp_eval_opts=SHARD_LINEARS))


def fail_in_training_forward(rank, world_size, ckpt_dir, bad_rank):
    """An exception inside a TRAIN forward on one rank: the others wait inside an
    FSDP collective (the next all-gather or the backward's reduce-scatter)."""
    class Failing(toy.DDPToyBrain):
        def compute_forward(self, batch, stage):
            if stage == sb.Stage.TRAIN and rank == bad_rank and self.hparams.counter.current == 2:
                raise RuntimeError("bad batch on purpose")
            return super().compute_forward(batch, stage)

    toy.run_recipe(toy.build(Failing, ckpt_dir, ddp_eval_opts=SHARD_LINEARS, lr=0.05))


def full_disk_in_a_shard_write(rank, world_size, ckpt_dir, bad_rank):
    """Trains one epoch (one checkpoint saved), then a save whose shard write on
    ``bad_rank`` fails with ENOSPC: every rank must raise, and the first checkpoint stay."""
    import errno
    from unittest import mock

    import torch.distributed.checkpoint.filesystem as dcp_files

    brain = toy.build(toy.DDPToyBrain, ckpt_dir, ddp_eval_opts=SHARD_LINEARS, lr=0.05, epochs=1)
    brain.fit(brain.hparams.counter, toy.make_dataset(8, 0), toy.make_dataset(6, 1),
              train_loader_kwargs={"batch_size": 4}, valid_loader_kwargs={"batch_size": 3})
    original = dcp_files.FileSystemWriter.write_data

    def no_space(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    with mock.patch.object(dcp_files.FileSystemWriter, "write_data", no_space if rank == bad_rank else original):
        brain.checkpointer.save_checkpoint(meta={"second": True})


def async_saves(rank, world_size, ckpt_dir):
    """FSDP with ``async_save``: fit (saves planned in on_stage_end), then a save whose
    state is changed right after the call; returns the state at the call."""
    checkpointer_cls = functools.partial(ddp_eval.Checkpointer, async_save=True)
    brain = toy.build(toy.DDPToyBrain, ckpt_dir, ddp_eval_opts=SHARD_LINEARS, lr=0.05,
                      optimizer=torch.optim.Adam, checkpointer_cls=checkpointer_cls)
    brain.fit(brain.hparams.counter, toy.make_dataset(16, 0), toy.make_dataset(6, 1),
              train_loader_kwargs={"batch_size": 4}, valid_loader_kwargs={"batch_size": 3})
    at_call = full_state(brain)
    start = time.perf_counter()
    saved = brain.checkpointer.save_checkpoint(meta={"final": True})
    stall = time.perf_counter() - start
    with torch.no_grad():
        for parameter in brain.modules.model.parameters():
            parameter.fill_(123.0)  # after the call: must not reach the checkpoint
    brain.checkpointer.wait()
    # the shards were written by a background job on this rank (its duration, set when it ended)
    return {"state": at_call, "path": str(saved.path), "stall": stall,
            "background_s": brain.checkpointer._background.writer.seconds}


class ScheduledBrain(toy.DDPToyBrain):
    """The toy recipe with the learning-rate schedules SpeechBrain recipes use: Noam and
    linear warm-up (WarmAndExpDecayLRSchedule) after every step, NewBob through
    ``update_learning_rate`` (``prev_lr``) and torch's StepLR (``initial_lr``) after
    VALID, and an entry of the recipe's own in every parameter group."""

    def init_optimizers(self):
        super().init_optimizers()  # a torch scheduler is made on the optimizer, as recipes do (initial_lr)
        self.step_lr = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.noam = sb.nnet.schedulers.NoamScheduler(lr_initial=0.05, n_warmup_steps=3)
        self.warmup = sb.nnet.schedulers.WarmAndExpDecayLRSchedule(lr=0.05, n_warmup_steps=2, total_steps=40)

    def on_fit_batch_end(self, batch, outputs, loss, should_step):
        self.noam(self.optimizer)
        self.warmup(self.optimizer)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        if stage == sb.Stage.VALID:  # before the checkpoint the toy recipe saves here
            self.step_lr.step()
            sb.nnet.schedulers.update_learning_rate(self.optimizer, self.optimizer.param_groups[0]["lr"] * 0.8)
            for group in self.optimizer.param_groups:
                group["recipe_epoch"] = (epoch, "after VALID")
        super().on_stage_end(stage, stage_loss, epoch)


def _groups(optimizer):
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def scheduled_training(rank, world_size, ckpt_dir, opts):
    """Two epochs of the scheduled recipe (Adam); the param groups and full state the
    last checkpoint holds (saved at the end of the last VALID)."""
    brain = toy.build(ScheduledBrain, ckpt_dir, ddp_eval_opts=opts, lr=0.05, epochs=2, optimizer=torch.optim.Adam)
    brain.fit(brain.hparams.counter, toy.make_dataset(16, 0), toy.make_dataset(6, 1),
              train_loader_kwargs={"batch_size": 4}, valid_loader_kwargs={"batch_size": 3})
    return {"groups": _groups(brain.optimizer), "state": full_state(brain),
            "sharded": fsdp.is_sharded(brain.optimizer)}


def scheduled_resume(rank, world_size, ckpt_dir, opts):
    """The scheduled recipe built anew (its StepLR made before the recovery, as in a
    recipe), recovered as fit() does: the param groups and full state it then holds."""
    brain = toy.build(ScheduledBrain, ckpt_dir, ddp_eval_opts=opts, lr=0.05, epochs=3, optimizer=torch.optim.Adam)
    brain.on_fit_start()
    return {"groups": _groups(brain.optimizer), "state": full_state(brain),
            "sharded": fsdp.is_sharded(brain.optimizer)}


def resume_into_two_groups(rank, world_size, ckpt_dir, opts):
    """The scheduled recipe resumed with an optimizer of two parameter groups (weights
    and biases apart): the checkpoint's one group cannot load into it."""
    def two_groups(parameters):
        parameters = list(parameters)
        return torch.optim.Adam([{"params": parameters[::2]}, {"params": parameters[1::2]}], lr=0.05)

    brain = toy.build(ScheduledBrain, ckpt_dir, ddp_eval_opts=opts, lr=0.05, epochs=3)
    brain.opt_class = two_groups
    brain.on_fit_start()


DEBUG = {"debug": True, "debug_batches": 2, "debug_epochs": 2}


def debug_recipe(rank, world_size, ckpt_dir):
    """The toy recipe (its checkpoint saved in on_stage_end) under FSDP and SpeechBrain's
    --debug: what it evaluated, where its checkpointer wrote, and what that folder holds."""
    brain = toy.build(toy.DDPToyBrain, ckpt_dir, ddp_eval_opts=SHARD_LINEARS, run_opts=DEBUG)
    out = toy.run_recipe(brain)
    folder = brain.checkpointer.checkpoints_dir
    out["folder"] = str(folder)
    out["checkpoints"] = sorted(p.name for p in folder.iterdir() if p.name.startswith("CKPT+"))
    out["shards"] = sorted(p.name for c in folder.glob("CKPT+*") for p in c.iterdir() if p.suffix == ".dcp")
    out["loaded"] = brain.checkpointer.loaded
    return out


def fail_in_gather(rank, world_size, ckpt_dir, bad_rank):
    """Training, then a sharded TEST whose stage-start gather fails on ``bad_rank``
    (as an out-of-memory in the all-gather's allocation would), while the other ranks
    wait inside the gather's collective."""
    brain = toy.build(toy.DDPToyBrain, ckpt_dir, ddp_eval_opts={**SHARD_LINEARS, "collective_timeout": 10})
    brain.fit(brain.hparams.counter, toy.make_dataset(8, 0), toy.make_dataset(6, 1),
              train_loader_kwargs={"batch_size": 4}, valid_loader_kwargs={"batch_size": 3})
    if rank == bad_rank:
        def unshard(self, *args, **kwargs):
            raise RuntimeError("out of memory while unsharding (injected)")

        fsdp.FSDPModule.unshard = unshard  # this process is discarded after the test
    start = time.monotonic()
    try:
        brain.evaluate(toy.make_dataset(5, 2, "tst"), test_loader_kwargs={"batch_size": 2})
    finally:  # how long the failure took to reach this rank, start-up and training left out
        with open(os.path.join(ckpt_dir, f"evaluate_seconds_{rank}"), "w") as f:
            f.write(str(time.monotonic() - start))
