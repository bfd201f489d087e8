"""ControlChannel at 64 simulated ranks: order, errors, timeouts, tags, restarts."""

import pytest

from ddp_eval import CollectiveTimeoutError, OutOfStepError, RankFailedError
from ddp_eval.distributed import ControlChannel, incarnation_namespace
from tests.simulated_ranks import SimulatedRanks

pytestmark = pytest.mark.timeout(120)
N = 64
TIMEOUT = 1.0


@pytest.fixture(scope="module")
def sim():
    return SimulatedRanks(N)


@pytest.fixture
def channels(sim, request):
    """Fresh channels (own namespace) on the shared server for each test."""
    for r, channel in enumerate(sim.channels):
        sim.channels[r] = ControlChannel(channel.store, r, N, namespace=request.node.name)
    return sim


def test_payloads_in_rank_order_and_keys_do_not_pile_up(channels):
    before = channels.server.num_keys()
    out = channels.run(lambda r, ch: [ch.exchange(f"step {i}", payload=(r, i)) for i in range(5)])
    for r in range(N):
        rounds = out[r][0]
        assert rounds == [[(s, i) for s in range(N)] for i in range(5)]
    # per exchange, rank 0 deletes the previous one's keys and each rank its envelope:
    # only the last exchange's 6 keys remain (verdict, answer, count, ready, read, all_read)
    assert channels.server.num_keys() - before <= 6


@pytest.mark.fast
def test_error_on_one_rank_is_raised_on_every_rank(channels):
    def fn(rank, ch):
        ch.exchange("before")
        return ch.exchange("stage end", error=ValueError("boom") if rank == 17 else None)

    out = channels.run(fn)
    assert isinstance(out[17][0], ValueError)
    for r in set(range(N)) - {17}:
        error, seconds = out[r]
        assert isinstance(error, RankFailedError), error
        assert "rank 17 failed at 'stage end' with ValueError: boom" in str(error)
        assert seconds < 5


@pytest.mark.parametrize("missing", [33, 0], ids=["rank-33", "coordinator"])
def test_rank_that_never_arrives_is_named_within_timeout(channels, missing):
    out = channels.run(lambda r, ch: ch.exchange("valid end", timeout=TIMEOUT),
                       ranks=[r for r in range(N) if r != missing])
    for r, (error, seconds) in out.items():
        assert isinstance(error, CollectiveTimeoutError), (r, error)
        assert f"ranks that did not arrive: [{missing}]" in str(error)
        assert "'valid end'" in str(error)
        assert TIMEOUT - 0.5 <= seconds < TIMEOUT + 3, (r, seconds)  # arrivals are skewed
    # the late rank, when it comes, is told at once instead of waiting
    late = channels.run(lambda r, ch: ch.exchange("valid end", timeout=30), ranks=[missing])
    error, seconds = late[missing]
    assert isinstance(error, RankFailedError) and "CollectiveTimeoutError" in str(error)
    assert seconds < 5


@pytest.mark.fast
def test_rank_at_another_tag_raises_out_of_step_everywhere(channels):
    out = channels.run(lambda r, ch: ch.exchange("delete: end" if r == 5 else "valid end"))
    for r in range(N):
        error = out[r][0]
        assert isinstance(error, OutOfStepError), (r, error)
        assert "'delete: end'" in str(error) and "'valid end'" in str(error)


@pytest.mark.fast
def test_keys_of_an_earlier_attempt_are_never_read(sim, monkeypatch):
    """A crashed attempt left envelopes and answers behind in the same store; the
    restarted attempt (next TORCHELASTIC_RESTART_COUNT) reads only its own."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = incarnation_namespace(1)
    attempt0 = [ControlChannel(c, r, N, first) for r, c in enumerate(sim.clients)]
    sim.channels[:] = attempt0
    sim.run(lambda r, ch: ch.exchange("find checkpoint", payload="CKPT-old"))
    # half the ranks post, the attempt dies: envelopes and a timeout verdict stay behind
    sim.run(lambda r, ch: ch.exchange("find checkpoint", payload="stale", timeout=0.5),
            ranks=range(N // 2))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = incarnation_namespace(1)
    assert second != first
    sim.channels[:] = [ControlChannel(c, r, N, second) for r, c in enumerate(sim.clients)]
    out = sim.run(lambda r, ch: [ch.exchange("find checkpoint", payload=f"new{r % 2}")
                                 for _ in range(2)])
    for r in range(N):
        assert out[r][0] == [[f"new{s % 2}" for s in range(N)]] * 2


@pytest.mark.parametrize("world_size", [16, 64])
def test_store_requests_per_exchange_grow_linearly(world_size, sim):
    """Per exchange: 6 requests per rank other than the coordinator (the 6th
    acknowledges the answer) and one more by the last to arrive (it sets
    ``ready``) and by the last to acknowledge (``all_read``); the coordinator
    makes 8, plus 6 deleting the previous exchange's keys: O(N) in all, not N^2."""
    from tests.simulated_ranks import CountingStore

    # the first world_size clients of the module's 64 (a TCPStore takes 5 s per 25 new clients here)
    counters = [CountingStore(c) for c in sim.clients[:world_size]]
    channels = [ControlChannel(c, r, world_size, f"count{world_size}") for r, c in enumerate(counters)]
    sim.run(lambda r, ch: [channels[r].exchange(f"step {i}", payload=r) for i in range(4)], ranks=range(world_size))
    others = sum(c.requests for c in counters[1:]) / 4
    assert others <= 6 * (world_size - 1) + 2, others
    assert counters[0].requests <= 8 + 3 * 14 + 4, counters[0].requests


@pytest.mark.fast
def test_coordinator_waits_until_every_rank_has_read_the_last_answer(channels):
    """Rank 0 may host the store: it must not leave while a rank still reads."""
    import threading
    import time

    release = threading.Event()
    read_at = {}

    def fn(rank, ch):
        ch.exchange("before")
        if rank == 40:  # slow to read the last answer
            original = ch.store

            class Slow:
                def __getattr__(self, name):
                    if name not in ("wait", "get"):
                        return getattr(original, name)
                    release.wait(10)

                    def timed(*args, **kwargs):  # when the answer was read, before the ack
                        value = getattr(original, name)(*args, **kwargs)
                        read_at[rank] = time.monotonic()
                        return value

                    return timed

            ch.store = Slow()
        out = ch.exchange("TEST on_stage_end")
        if rank == 0:
            threading.Timer(0.3, release.set).start()
            assert ch.wait_for_readers(timeout=10)
            return time.monotonic()
        return out

    out = channels.run(fn)
    left = out[0][0]
    assert left >= read_at[40], "rank 0 returned before rank 40 had read the answer"
    assert all(out[r][0] == [None] * N for r in range(1, N))
    # a timeout verdict: the missing ranks may never read, so no wait
    sim = channels
    res = sim.run(lambda r, ch: ch.exchange("lonely", timeout=0.3), ranks=[0])
    assert isinstance(res[0][0], CollectiveTimeoutError)
    assert sim.channels[0].wait_for_readers(timeout=5)
