"""Runs a function on a real gloo process group of N processes, bounded in time.

Each rank runs ``fn(rank, world_size, *args)`` in a spawned process with the
torchrun environment variables set (so ``sb.Brain`` sees a distributed launch)
and a ``file://`` rendezvous. The parent polls the processes; past the deadline
it kills every one of them and fails the test, so a hang costs seconds.
"""

import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp


class Hang(AssertionError):
    """Ranks were still running at the deadline (they were killed)."""


def _entry(fn, rank, world_size, workdir, args, env, init_method):
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
         "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", **(env or {})}
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        outcome = {"result": fn(rank, world_size, *args)}
    except BaseException as exc:  # reported to the parent
        outcome = {"error": type(exc).__name__, "message": str(exc),
                   "traceback": traceback.format_exc()}
    with open(os.path.join(workdir, f"result-{rank}.pkl"), "wb") as f:
        pickle.dump(outcome, f)
    os._exit(0)  # no teardown collectives that could wait for a failed peer


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world_size, *args, timeout=60.0, env=None, store="file"):
    """Returns one outcome dict per rank: {"result": ...} or {"error", "message"}.

    A rank that died without reporting gets {"exitcode": code}. ``store="tcp"``
    rendezvouses through a TCPStore, as torchrun does (default: a FileStore).
    """
    workdir = tempfile.mkdtemp(prefix=f"ddp_eval_mp_{os.getpid()}_")  # per pytest process
    os.chmod(workdir, 0o777)
    init_method = (f"tcp://127.0.0.1:{_free_port()}" if store == "tcp"
                   else f"file://{workdir}/rendezvous")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, workdir, args, env, init_method))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join()
    if alive:
        shutil.rmtree(workdir)
        raise Hang(f"ranks {alive} still running after {timeout} s (killed)")
    outcomes = []
    for r, p in enumerate(procs):
        path = os.path.join(workdir, f"result-{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                outcomes.append(pickle.load(f))
        else:
            outcomes.append({"exitcode": p.exitcode})
    shutil.rmtree(workdir)
    return outcomes


def results(outcomes):
    """The per-rank results; fails with every rank's traceback if any rank failed."""
    bad = [o for o in outcomes if "result" not in o]
    assert not bad, "\n".join(o.get("traceback", str(o)) for o in bad)
    return [o["result"] for o in outcomes]
