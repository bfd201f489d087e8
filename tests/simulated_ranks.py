"""Hundreds of ranks simulated as threads of one process.

Each thread is one rank with its own ``TCPStore`` client of one server, as
torchrun's agent store serves every worker. Used by the control-plane tests
and by ``benchmarks/scale.py``.
"""

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ddp_eval.distributed import ControlChannel


class SimulatedRanks:
    """A TCPStore server and one client (and ControlChannel) per simulated rank."""

    def __init__(self, world_size, namespace="sim", store_timeout=30.0):
        self.world_size = world_size
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=store_timeout))
        self.clients = [dist.TCPStore("127.0.0.1", self.server.port, is_master=False,
                                      timeout=timedelta(seconds=store_timeout))
                        for _ in range(world_size)]
        self.channels = [ControlChannel(c, r, world_size, namespace)
                         for r, c in enumerate(self.clients)]

    def run(self, fn, ranks=None, deadline=60.0):
        """Runs ``fn(rank, channel)`` on ``ranks`` (default all) in threads.

        Returns ``{rank: (result or exception, seconds)}``. Fails if a thread is
        still running after ``deadline`` seconds (a hang fails, it never blocks CI).
        """
        ranks = range(self.world_size) if ranks is None else ranks
        outcomes = {}

        def body(rank):
            start = time.monotonic()
            try:
                result = fn(rank, self.channels[rank])
            except BaseException as exc:  # the outcome under test
                result = exc
            outcomes[rank] = (result, time.monotonic() - start)

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in ranks]
        for t in threads:
            t.start()
        end = time.monotonic() + deadline
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        stuck = [r for r, t in zip(ranks, threads) if t.is_alive()]
        assert not stuck, f"simulated ranks {stuck[:10]} still waiting after {deadline} s"
        return outcomes


class CountingStore:
    """Forwards to a store and counts the requests made through it."""

    def __init__(self, store):
        self._store = store
        self.requests = 0

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            self.requests += 1
            return method(*args, **kwargs)

        return counted
