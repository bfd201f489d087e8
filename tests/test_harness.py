"""The pool of ranks the multi-process tests share (tests/mp_harness.py): a test never
sees what an earlier one left in a pooled process."""

import os

import pytest

from tests import workers
from tests.mp_harness import POOL, results, run_ranks


def _starts(world_size):
    return results(run_ranks(workers.what_a_rank_starts_with, world_size, timeout=60))


def _clean(outs):
    return all(o["trace"] is None and o["cwd"] == os.getcwd() and o["get_rank"] == "ddp_eval.distributed"
               and o["seed"] not in (5, 6, 7) for o in outs)  # leave_traces seeds rank + 5


@pytest.mark.fast  # the discarding tests below start new processes: full lane only
def test_the_next_test_finds_the_environment_directory_and_seed_of_a_new_process():
    first = _starts(3)
    assert _clean(first)
    left = results(run_ranks(workers.leave_traces, 3, False, timeout=60))
    assert left == [o["pid"] for o in first]  # the same processes ran both
    again = _starts(3)
    assert [o["pid"] for o in again] == left and _clean(again)  # nothing of leave_traces left
    # as in a new process, torch's generator starts from a nondeterministic seed each test
    assert not {o["seed"] for o in again} & {o["seed"] for o in first}


def test_a_monkeypatch_left_behind_discards_the_pool():
    pids = [o["pid"] for o in _starts(2)]
    assert results(run_ranks(workers.leave_traces, 2, True, timeout=60)) == pids
    assert POOL.discarded[-1].startswith("leave_traces: patched ['ddp_eval.distributed.get_rank'")
    after = _starts(2)
    assert not {o["pid"] for o in after} & set(pids) and _clean(after)  # new processes


def test_ranks_that_fail_together_are_kept_and_a_timeout_or_a_thread_left_discards_them():
    pids = [o["pid"] for o in _starts(2)]
    failed = run_ranks(workers.fail_together, 2, "agreed", timeout=60)
    assert [o.get("error") for o in failed] == ["RankFailedError", "RuntimeError"], failed
    assert [o["pid"] for o in _starts(2)] == pids  # kept: the failure ran ddp_eval's protocol to its end
    run_ranks(workers.fail_together, 2, "timeout", timeout=60)
    assert POOL.discarded[-1] == "fail_together: a rank failed"
    after = [o["pid"] for o in _starts(2)]
    assert not set(after) & set(pids)
    assert results(run_ranks(workers.fail_together, 2, "thread", timeout=60)) == after
    assert POOL.discarded[-1] == "fail_together: threads left running ['ddp_eval test: left running']"
    assert not {o["pid"] for o in _starts(2)} & set(after)
