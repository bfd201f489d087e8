"""A save sequence that SIGKILLs its own process at the k-th file-system step.

Used by the kill tests: every step of ``ddp_eval.Checkpointer``'s write
(inside and between parameter files, fsyncs, the meta file, renames, the
removal of old versions) is a numbered point; ``run(directory, kill_at=k)``
dies with SIGKILL right there. Each saved version ``v`` holds parameters
computable from ``v``, so a resume can check what it loaded.
"""

import os
import shutil
import signal

import torch
from speechbrain.utils.checkpoints import mark_as_loader, mark_as_saver, register_checkpoint_hooks

import ddp_eval
import ddp_eval.checkpointing.commit as ckpt_module

_state = {"count": 0, "kill_at": None, "names": []}


def point(name):
    """One numbered kill point."""
    _state["count"] += 1
    _state["names"].append(name)
    if _state["count"] == _state["kill_at"]:
        os.kill(os.getpid(), signal.SIGKILL)


@register_checkpoint_hooks
class Blob:
    """A parameter file written in two halves, with a kill point in between."""

    def __init__(self):
        self.version = None

    @mark_as_saver
    def save(self, path):
        data = f"version={self.version};".encode() * 2000
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            point("inside blob.ckpt")
            f.write(data[len(data) // 2 :])

    @mark_as_loader
    def load(self, path, end_of_epoch):
        with open(path, "rb") as f:
            data = f.read()
        self.version = int(data.split(b";")[0].split(b"=")[1])
        assert data == f"version={self.version};".encode() * 2000, "truncated blob loaded"


def model_for(version):
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.fill_(float(version))
        model.bias.fill_(-float(version))
    return model


def _instrument():
    def wrap(owner, attr):
        original = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            point(f"before {attr}")
            result = original(*args, **kwargs)
            point(f"after {attr}")
            return result

        setattr(owner, attr, wrapper)

    for attr in ("_fsync_file", "_fsync_dir", "_rename_dir", "_exchange_dirs"):
        wrap(ckpt_module, attr)
    wrap(shutil, "rmtree")
    wrap(torch, "save")


def make_checkpointer(directory, version=0):
    model, blob = model_for(version), Blob()
    blob.version = version
    return ddp_eval.Checkpointer(directory, recoverables={"model": model, "blob": blob}), model, blob


def save_logged(ckpter, version, log_path, **kwargs):
    """Saves ``version`` in its meta (keep-only with ``num_to_keep``), waits for the
    save, then appends ``version`` to ``log_path`` durably (None: no log)."""
    kwargs.setdefault("meta", {})["version"] = version
    if "num_to_keep" in kwargs:
        ckpter.save_and_keep_only(**kwargs)
    else:
        ckpter.save_checkpoint(**kwargs)
    ckpter.wait()
    if log_path is not None:
        with open(log_path, "a") as f:
            f.write(f"{version}\n")
            f.flush()
            os.fsync(f.fileno())


def run(directory, kill_at=None, log_path=None, renameat2=True, async_save=False):
    """Saves v1 (unarmed), then armed: keep-only v2, named 'last' v3 then v4 (a re-save).

    With ``renameat2=False`` the re-save uses the two-rename fallback. With
    ``async_save`` the write, commit and deletions run in the background
    thread (where most kill points then are); a save counts as committed once
    ``wait()`` returned.
    """
    if not renameat2:
        ckpt_module._exchange_dirs = lambda a, b: False
    ckpter, model, blob = make_checkpointer(directory)
    ckpter.async_save = async_save

    def save(version, **kwargs):
        with torch.no_grad():
            model.weight.fill_(float(version))
            model.bias.fill_(-float(version))
        blob.version = version
        save_logged(ckpter, version, log_path, **kwargs)

    save(1)
    _instrument()
    _state.update(count=0, names=[], kill_at=kill_at)
    save(2, num_to_keep=1)
    save(3, name="last")
    save(4, name="last")
    with open(f"{log_path}.points", "w") as f:
        f.write("\n".join(_state["names"]))
