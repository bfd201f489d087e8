"""Runs a function on a real gloo process group of N processes, bounded in time.

Each rank runs ``fn(rank, world_size, *args)`` in a spawned process with the
torchrun environment variables set (so ``sb.Brain`` sees a distributed launch)
and a ``file://`` rendezvous. The parent polls the processes; past the deadline
it kills every one of them and fails the test, so a hang costs seconds.

By default the ranks come from a pool of processes started once per pytest
session (:class:`RankPool`, as torchmetrics' tests share one pool): each call
creates a new process group in them, and tears it down after. A call whose
ranks fail, die or hang discards the pool (the next call starts new ones), so
a test that checks failures never leaves a broken process for the next. Ranks
that failed together, as ddp_eval makes them (its errors, agreed on every rank
before they are raised; not a timeout), are kept if tearing the group down
leaves no patch and no thread of the test's behind.
``fresh=True`` starts new processes for the call alone, forked from a server
that imported torch, SpeechBrain and ddp_eval once (multiprocessing's
forkserver, as ``test_checkpoint_kill`` uses): for tests that kill, patch or
exit their processes, in a fraction of a second instead of seconds of imports.
``fresh="spawn"`` (or ``env``: variables read at import) spawns new interpreters:
for measurements of a fresh process's memory.
"""

import atexit
import contextlib
import logging
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings

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


def _workdir_and_init(store):
    workdir = tempfile.mkdtemp(prefix=f"ddp_eval_mp_{os.getpid()}_")  # per pytest process
    os.chmod(workdir, 0o777)
    init_method = (f"tcp://127.0.0.1:{_free_port()}" if store == "tcp"
                   else f"file://{workdir}/rendezvous")
    return workdir, init_method


# One forkserver per pytest process (multiprocessing has one): every module a fresh
# rank or test_checkpoint_kill's child imports, imported once by the server.
FORKSERVER = mp.get_context("forkserver")
FORKSERVER.set_forkserver_preload(["torch", "torch.distributed", "speechbrain", "ddp_eval", "tests.toy",
                                   "tests.workers", "tests.fsdp_workers", "tests.fsdp_kill", "tests.kill_points"])


def run_ranks(fn, world_size, *args, timeout=60.0, env=None, store="file", fresh=False):
    """Returns one outcome dict per rank: {"result": ...} or {"error", "message"}.

    A rank that died without reporting gets {"exitcode": code}. ``store="tcp"``
    rendezvouses through a TCPStore, as torchrun does (default: a FileStore).
    """
    if fresh or env:
        spawn = fresh == "spawn" or env is not None
        return _run_fresh(fn, world_size, args, timeout, env, store, mp.get_context("spawn") if spawn else FORKSERVER)
    return POOL.run(fn, world_size, args, timeout, store)


def _run_fresh(fn, world_size, args, timeout, env, store, ctx):
    workdir, init_method = _workdir_and_init(store)
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


class _Snapshot:
    """What a task may change in a pooled process and the next task must not see."""

    def __init__(self):
        self.environ, self.cwd, self.path = dict(os.environ), os.getcwd(), list(sys.path)
        self.filters = list(warnings.filters)
        self.loggers = {name: (list(lg.handlers), lg.level, lg.propagate, lg.disabled)
                        for name, lg in [("", logging.root), *logging.root.manager.loggerDict.items()]
                        if isinstance(lg, logging.Logger)}

    def restore(self):
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        warnings.filters[:] = self.filters
        for name, lg in [("", logging.root), *logging.root.manager.loggerDict.items()]:
            if isinstance(lg, logging.Logger):
                lg.handlers[:], lg.level, lg.propagate, lg.disabled = self.loggers.get(name, ([], 0, True, False))


def _module_globals():
    """``{module: {name: id}}`` of the functions and classes of the modules a task could patch."""
    # torch wraps some of its functions once, on a first use (torch.manual_seed, for
    # dynamo): a function whose __wrapped__ is the one before is the same function
    found = {}
    with warnings.catch_warnings():  # torch.distributed.reduce_op warns when looked at
        warnings.simplefilter("ignore")
        _collect_callables(found)
    return found


def _collect_callables(found):
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in ("ddp_eval", "speechbrain", "torch", "tests"):
            continue
        for owner, where in [(module, name)] + [(v, f"{name}.{k}") for k, v in list(vars(module).items())
                                                 if isinstance(v, type) and v.__module__ == name]:
            found[where] = {k: (id(v), id(getattr(v, "__wrapped__", None))) for k, v in list(vars(owner).items())
                            if callable(v) or isinstance(v, (staticmethod, classmethod))}


def _patched(before, after):
    """Functions and classes a task rebound in a module it found loaded (a
    monkeypatch left behind: the next task would run with it)."""
    return [f"{name}.{k}" for name, values in before.items() for k, v in values.items()
            if k in after.get(name, {}) and after[name][k][0] != v[0] and after[name][k][1] != v[0]]


def _failure_kind(exc):
    """``"agreed"``: one of ddp_eval's errors, which the ranks agree on before raising
    (:func:`ddp_eval.distributed.decide`, a failing rank raising its own exception);
    ``"timeout"``: a collective timed out, and may still be under way; else ``"other"``."""
    from ddp_eval.errors import CollectiveTimeoutError, DDPEvalError

    if isinstance(exc, CollectiveTimeoutError):
        return "timeout"
    return "agreed" if isinstance(exc, DDPEvalError) else "other"


def _ours(thread):
    """A thread the task started from ddp_eval or the tests (not a library's
    once-per-process helper, as tqdm's monitor or multiprocessing's resource sharer)."""
    module = getattr(getattr(thread, "_target", None), "__module__", None) or ""
    return thread.name.startswith("ddp_eval") or module.startswith(("ddp_eval", "tests"))


def _reusable(outcomes):
    """Whether the ranks stand where a finished job leaves them: each returned, or
    the failures are ddp_eval's agreed errors (with the failing rank's own exception
    beside them), none a timeout."""
    kinds = [o.get("failure") for o in outcomes if "result" not in o]
    return not kinds or ("agreed" in kinds and all(k in ("agreed", "other") for k in kinds))


def _serve(conn):
    """A pooled rank: runs tasks until told to stop; exits on anything unexpected."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import gc

    import torch
    import torch.distributed as dist

    import ddp_eval.distributed

    torch.set_num_threads(1)
    before = _module_globals()  # then after each task: what the next one starts with
    while True:
        message = conn.recv()
        if message[0] == "stop":
            os._exit(0)
        _, fn, rank, world_size, args, init_method = message
        snapshot = _Snapshot()
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_WORLD_SIZE": str(world_size)})
        torch.seed()  # a new process's generator starts from a nondeterministic seed
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        threads = set(threading.enumerate())
        try:
            outcome = {"result": fn(rank, world_size, *args)}
        except BaseException as exc:  # reported to the parent (see RankPool.run)
            outcome = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc(),
                       "failure": _failure_kind(exc)}
        try:
            conn.send(outcome)
        except Exception as exc:  # a result that cannot be pickled
            conn.send({"error": type(exc).__name__, "message": f"the result could not be sent: {exc}",
                       "traceback": traceback.format_exc()})
        if conn.recv()[0] != "release":
            os._exit(0)
        dist.destroy_process_group()
        ddp_eval.distributed.set_timeout(ddp_eval.distributed.DEFAULT_TIMEOUT_S)
        # As in a new process: ddp_eval counts the default groups a process made (its
        # store keys carry the count); pooled ranks of one group have made different numbers.
        ddp_eval.distributed._default.update(group=None, channel=None, generation=0)
        snapshot.restore()
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        gc.collect()
        after = _module_globals()
        patched = _patched(before, after)
        before = after
        left = [t.name for t in threading.enumerate() if t not in threads and t.is_alive() and _ours(t)]
        conn.send(f"patched {patched[:5]}" if patched else f"threads left running {left[:5]}" if left
                  else "released")


class RankPool:
    """Spawned processes reused as the ranks of successive process groups."""

    def __init__(self):
        self.workers = []  # (process, connection), worker i is rank i
        self.started, self.discarded = 0, []  # for the session's summary

    def pids(self):
        return {p.pid for p, _ in self.workers}

    def _grow(self, world_size):
        ctx = mp.get_context("spawn")
        while len(self.workers) < world_size:
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(child,), daemon=True)
            process.start()
            self.started += 1
            child.close()
            self.workers.append((process, parent))

    def discard(self, why=None):
        """Kills every pooled process (a hang, a failure, the end of the session)."""
        if why is not None and self.workers:
            self.discarded.append(why)
        for process, conn in self.workers:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join()
            conn.close()
        self.workers = []

    def run(self, fn, world_size, args, timeout, store):
        if not all(process.is_alive() for process, _ in self.workers):
            self.discard()
        self._grow(world_size)
        workers = self.workers[:world_size]
        workdir, init_method = _workdir_and_init(store)
        outcomes = [None] * world_size
        try:
            for rank, (_, conn) in enumerate(workers):
                conn.send(("run", fn, rank, world_size, args, init_method))
            deadline = time.monotonic() + timeout
            while None in outcomes and time.monotonic() < deadline:
                pending = {conn: r for r, (_, conn) in enumerate(workers) if outcomes[r] is None}
                for conn in multiprocessing.connection.wait(list(pending), timeout=0.05):
                    try:
                        outcomes[pending[conn]] = conn.recv()
                    except EOFError:  # the rank died
                        process = workers[pending[conn]][0]
                        process.join()
                        outcomes[pending[conn]] = {"exitcode": process.exitcode}
            if None in outcomes:
                alive = [r for r, o in enumerate(outcomes) if o is None]
                self.discard(f"{fn.__name__}: hang")
                raise Hang(f"ranks {alive} still running after {timeout} s (killed)")
            if not _reusable(outcomes):
                self.discard(f"{fn.__name__}: a rank failed")
            else:  # every rank returned, or raised an error all ranks agreed on: the group is torn down
                answer = self._release(workers)
                if answer != "released":
                    self.discard(f"{fn.__name__}: {answer}")
        except BaseException as exc:
            self.discard(f"{fn.__name__}: {type(exc).__name__}")
            raise
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return outcomes

    @staticmethod
    def _release(workers, timeout=30.0):
        """Tears the group down in every rank: "released", or why a rank is not clean."""
        for _, conn in workers:
            conn.send(("release",))
        deadline = time.monotonic() + timeout
        answers = []
        for _, conn in workers:
            try:
                answers.append(conn.recv() if conn.poll(max(deadline - time.monotonic(), 0)) else "no answer")
            except (EOFError, OSError):
                answers.append("died tearing its group down")
        return next((a for a in answers if a != "released"), "released")


POOL = RankPool()
atexit.register(POOL.discard)


@contextlib.contextmanager
def ddp_eval_messages(level=logging.WARNING):
    """The messages ddp_eval logs at ``level`` and up while inside: a list, filled as
    they come (the logger's level lowered to ``level`` meanwhile; a pool's worker
    keeps no handler after)."""
    messages = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("ddp_eval")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level, logger.getEffectiveLevel()))
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
