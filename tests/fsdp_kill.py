"""A sharded (FSDP) save sequence whose rank ``kill_rank`` SIGKILLs itself at its
k-th file-system step (see :mod:`tests.kill_points`, the same points for the
commit, plus every shard write and DCP's metadata). Each saved version ``v``
fills the model with ``v``, so a resume can check what it loaded.
"""

import os

import speechbrain as sb
import torch
import torch.distributed.checkpoint.filesystem as dcp_files

import ddp_eval
from ddp_eval.distributed import dcp, fsdp
from tests import kill_points


def fill(model, version):
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float(version))


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


def _instrument():
    def wrap(owner, attr, name=None):
        original = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            kill_points.point(f"before {name or attr}")
            result = original(*args, **kwargs)
            kill_points.point(f"after {name or attr}")
            return result

        setattr(owner, attr, wrapper)

    kill_points._instrument()  # the commit's fsyncs and renames, rmtree, torch.save
    wrap(dcp, "save_state", "a sharded recoverable")
    wrap(dcp_files.FileSystemWriter, "write_data", "this rank's shard files")
    wrap(dcp_files.FileSystemWriter, "finish", "DCP metadata")


def run(rank, world_size, directory, kill_rank=None, kill_at=None, async_save=False):
    """Saves v1 (unarmed), then armed: keep-only v2, named 'last' v3, then v4 over it.
    Rank 0 logs each version once its save returned on every rank (with ``async_save``,
    once ``wait()`` returned: the background writes are where most points then are)."""
    model = fsdp.shard_module(make_model(), ["Linear"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()  # the optimizer has state (sharded, as the parameters)
    counter = sb.utils.epoch_loop.EpochCounter(10)
    # a rank left alone waits at most 15 s for the killed one (as torchrun's agent would end it); long
    # enough that a save on a loaded machine is not taken for a dead rank
    ckpter = ddp_eval.Checkpointer(directory, {"model": model, "optimizer": optimizer, "counter": counter},
                                   timeout=15, async_save=async_save)
    log = os.path.join(directory, "committed.log")

    def save(version, **kwargs):
        fill(model, version)
        counter.current = version
        kill_points.save_logged(ckpter, version, log if rank == 0 else None, **kwargs)

    save(1)
    if rank == kill_rank:
        _instrument()
    kill_points._state.update(count=0, names=[], kill_at=kill_at if rank == kill_rank else None)
    save(2, num_to_keep=1)
    save(3, name="last")
    save(4, name="last")
    return kill_points._state["names"]


def resume(directory):
    """One process, plain modules: what resume loads (version, or None) and whether
    every tensor of it holds that version."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    counter = sb.utils.epoch_loop.EpochCounter(10)
    ckpter = ddp_eval.Checkpointer(directory, {"model": model, "optimizer": optimizer, "counter": counter})
    found = ckpter.recover_if_possible()
    if found is None:
        return None, True
    version = found.meta["version"]
    whole = all(bool((p == float(version)).all()) for p in model.parameters()) and counter.current == version
    return version, whole and len(optimizer.state) == len(list(model.parameters()))
