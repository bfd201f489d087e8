"""Checkpointer scenarios run on every rank of a real process group."""

import errno
import os
import pathlib
import time
from unittest import mock

import torch
from speechbrain.core import INTRA_EPOCH_CKPT_FLAG

import ddp_eval
import ddp_eval.checkpointing.commit as ckpt_module
from tests import kill_points, toy
from tests.mp_harness import ddp_eval_messages


def _timed(fn):
    start = time.monotonic()
    try:
        fn()
    finally:
        pathlib.Path(os.environ["TIMING_DIR"], f"elapsed-{os.environ['RANK']}").write_text(
            str(time.monotonic() - start))


def enospc_on_second_save(rank, world_size, directory):
    """A save hook raises OSError(ENOSPC) on the writer during the second save."""
    ckpter, model, blob = kill_points.make_checkpointer(directory, version=1)
    ckpter.timeout = 20
    ckpter.save_checkpoint(meta={"version": 1})

    def full_disk(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    ckpter.custom_save_hooks["blob"] = full_disk
    _timed(lambda: ckpter.save_checkpoint(meta={"version": 2}, name="second"))


def save_into_read_only_dir(rank, world_size, directory):
    ckpter, model, blob = kill_points.make_checkpointer(directory, version=2)
    ckpter.timeout = 20
    _timed(lambda: ckpter.save_checkpoint(meta={"version": 2}))


def storage_without_rename(rank, world_size, directory, action):
    def no_rename(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted (simulated FUSE mount)", str(src))

    with mock.patch.object(ckpt_module, "_rename_dir", no_rename):
        ckpter, model, blob = kill_points.make_checkpointer(directory, version=5)
        ckpter.on_unsupported_storage = action
        ckpter.timeout = 20
        ckpter.save_checkpoint(meta={"version": 5})
        ckpter.save_checkpoint(meta={"version": 6}, name="same")
        ckpter.save_checkpoint(meta={"version": 7}, name="same")  # re-save in place
        found = ckpter.find_checkpoint()
    return found.meta["version"], sorted(p.name for p in pathlib.Path(directory).iterdir())


def writer_killed_mid_save(rank, world_size, directory):
    """Rank 0 dies with SIGKILL inside a parameter file of the second save."""
    ckpter, model, blob = kill_points.make_checkpointer(directory, version=1)
    ckpter.timeout = 2
    ckpter.save_checkpoint(meta={"version": 1})
    if rank == 0:
        kill_points._state.update(count=0, kill_at=1)
    blob.version = 2
    _timed(lambda: ckpter.save_checkpoint(meta={"version": 2}))


def resume(rank, world_size, directory):
    ckpter, model, blob = kill_points.make_checkpointer(directory, version=-1)
    found = ckpter.recover_if_possible()
    return found.meta["version"], float(model.weight[0, 0]), blob.version


def stress(rank, world_size, directory, rounds, checkpointer_cls=ddp_eval.Checkpointer):
    """Intra-epoch and end-of-epoch save_and_keep_only interleaved, as Brain does them."""
    model = torch.nn.Linear(4, 4)
    ckpter = checkpointer_cls(directory, recoverables={"model": model})
    for i in range(rounds):
        if i % 5 == 4:  # end of epoch, keep best loss and most recent
            ckpter.save_and_keep_only(meta={"loss": float((i * 7) % 11), "round": i},
                                      min_keys=["loss"], importance_keys=[])
        else:  # intra-epoch, as Brain._save_intra_epoch_ckpt
            # a fresh importance_keys list: SpeechBrain's default grows on every call
            ckpter.save_and_keep_only(end_of_epoch=False, num_to_keep=1, importance_keys=[],
                                      ckpt_predicate=lambda c: INTRA_EPOCH_CKPT_FLAG in c.meta,
                                      meta={INTRA_EPOCH_CKPT_FLAG: True, "round": i})
    return sorted(c.meta["round"] for c in ckpter.list_checkpoints())


def _weights(brain):
    model = brain.modules.model
    return {k: v.clone() for k, v in getattr(model, "module", model).state_dict().items()}


class ElasticBrain(toy.DDPToyBrain):
    def on_fit_start(self):
        super().on_fit_start()
        self.started_from = _weights(self)


def elastic_fit(rank, world_size, directory, epochs):
    """Trains the toy recipe to `epochs`, resuming whatever checkpoint is there."""
    brain = toy.build(ElasticBrain, directory, lr=0.1, epochs=epochs)
    brain.fit(brain.hparams.counter, toy.make_dataset(12, 0), toy.make_dataset(7, 1),
              train_loader_kwargs={"batch_size": 2}, valid_loader_kwargs={"batch_size": 2})
    return {"epochs_run": [r["epoch"] for r in brain.log if r["stage"] == "TRAIN"],
            "weights": _weights(brain), "started_from": brain.started_from}


def time_based_intra_epoch_saves(rank, world_size, directory):
    """A time-based interval (here: always elapsed) decided on rank 0 and broadcast
    by SpeechBrain; every rank must take the same branch into the checkpointer."""
    brain = toy.build(toy.DDPToyBrain, directory, lr=0.1, epochs=1)
    brain.ckpt_interval_minutes = 1e-9
    saves, save = [], brain.checkpointer.save_checkpoint
    brain.checkpointer.save_checkpoint = lambda **kw: saves.append(kw) or save(**kw)
    brain.fit(brain.hparams.counter, toy.make_dataset(16, 0), toy.make_dataset(5, 1),
              train_loader_kwargs={"batch_size": 2}, valid_loader_kwargs={"batch_size": 2})
    kept = sorted((c.meta.get(INTRA_EPOCH_CKPT_FLAG, False), c.meta.get("loss") is not None)
                  for c in brain.checkpointer.list_checkpoints())
    return [s["end_of_epoch"] for s in saves], kept


def guarded_saves(rank, world_size, directory):
    """Old recipes save under run_on_main (rank 0 only): still works, without hangs.
    A bare `if if_main_process():` guard is reported as ranks out of step."""
    from speechbrain.utils.distributed import if_main_process, run_on_main

    ckpter, model, blob = kill_points.make_checkpointer(directory, version=1)
    ckpter.timeout = 5
    run_on_main(ckpter.save_and_keep_only, kwargs={"meta": {"version": 1}, "importance_keys": []})
    found = ckpter.find_checkpoint()
    try:
        if if_main_process():
            ckpter.save_checkpoint(meta={"version": 2})
        ckpter.delete_checkpoints(num_to_keep=5)
    except ddp_eval.DDPEvalError as error:
        return found.meta["version"], type(error).__name__, str(error)
    return found.meta["version"], None, None


def recover_with_warnings(rank, world_size, directory):
    """Resumes a toy model + epoch counter from `directory`; returns what loaded
    and the warnings ddp_eval logged, or the error."""
    import speechbrain as sb

    model, counter = torch.nn.Linear(64, 64), sb.utils.epoch_loop.EpochCounter(10)
    with ddp_eval_messages() as warnings:
        ckpter = ddp_eval.Checkpointer(directory, recoverables={"model": model, "counter": counter})
        found = ckpter.recover_if_possible()
    return {"found": found.path.name, "weight": float(model.weight[0, 0]), "counter": counter.current,
            "warnings": warnings}


def async_snapshot_then_change(rank, world_size, directory):
    """An async save, the parameters changed at once (as the next training step
    would), then wait(): every rank loads the values of save time."""
    ckpter, model, blob = kill_points.make_checkpointer(directory, version=3)
    ckpter.async_save = True
    saved = ckpter.save_checkpoint(meta={"version": 3})
    with torch.no_grad():
        model.weight.add_(100.0)
    blob.version = 4
    ckpter.wait()
    loader, loaded, loaded_blob = kill_points.make_checkpointer(directory, version=-1)
    found = loader.recover_if_possible()
    return {"found": found.path.name, "saved": saved.path.name, "weight": float(loaded.weight[0, 0]),
            "blob": loaded_blob.version, "live_weight": float(model.weight[0, 0])}


def async_enospc(rank, world_size, directory):
    """The background write of the second save fails with ENOSPC on the writer."""
    import threading

    ckpter, model, blob = kill_points.make_checkpointer(directory, version=1)
    ckpter.async_save, ckpter.timeout = True, 20
    ckpter.save_checkpoint(meta={"version": 1})
    original = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if threading.current_thread().name.startswith("ddp_eval save"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return original(obj, path, *args, **kwargs)

    with mock.patch.object(torch, "save", full_disk):
        blob.version = 2
        second = ckpter.save_checkpoint(meta={"version": 2}, name="second")  # returns: the write is later
        try:
            ckpter.save_checkpoint(meta={"version": 3}, name="third")  # the next call raises
        except ddp_eval.DDPEvalError as error:
            return {"returned": second.path.name, "error": type(error).__name__, "message": str(error)}
    return {"returned": second.path.name, "error": None}


def async_saves_then_average(rank, world_size, directory):
    """SpeechBrain's transformer recipes average checkpoints in on_evaluate_start:
    ``find_checkpoints(min_key=...)`` then ``average_checkpoints``, on every rank.
    Here it runs right after the last async save returned, while its write is held
    until someone waits for it: surely still running when the recipe looks."""
    import threading

    import speechbrain as sb

    from ddp_eval.checkpointing._async_save import BackgroundWriter

    hold, release = threading.Event(), threading.Event()
    original_save, original_wait = torch.save, BackgroundWriter.wait

    def held_save(obj, path, *args, **kwargs):
        if hold.is_set() and threading.current_thread().name.startswith("ddp_eval save"):
            release.wait(60)
        return original_save(obj, path, *args, **kwargs)

    def releasing_wait(self, timeout=None):
        if hold.is_set():
            release.set()
        return original_wait(self, timeout)

    with mock.patch.object(torch, "save", held_save), mock.patch.object(BackgroundWriter, "wait", releasing_wait):
        model = torch.nn.Linear(200, 500)
        ckpter = ddp_eval.Checkpointer(directory, {"model": model}, async_save=True)
        for version, loss in ((1, 3.0), (2, 2.0), (3, 1.0)):
            with torch.no_grad():
                model.weight.fill_(float(version))
            if version == 3:
                ckpter.wait()
                hold.set()  # the last save's write is held until the recipe's find_checkpoints waits for it
            ckpter.save_and_keep_only(meta={"loss": loss, "version": version}, min_keys=["loss"], num_to_keep=2)
        running = ckpter._background.writer.running
        found = ckpter.find_checkpoints(min_key="loss")
        averaged = sb.utils.checkpoints.average_checkpoints(found, recoverable_name="model")
        best = ckpter.find_checkpoint(min_key="loss")
    return {"running": running, "found": [c.meta["version"] for c in found],
            "averaged": float(averaged["weight"][0, 0]), "best": best.meta["version"]}
