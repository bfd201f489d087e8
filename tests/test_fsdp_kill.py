"""SIGKILL of either rank at each file-system step of a sharded (FSDP) save, then
resume in one process: the newest complete checkpoint loads, never a partial one."""

import os

import pytest

from ddp_eval.distributed import fsdp
from tests import fsdp_kill
from tests.mp_harness import results, run_ranks

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(fsdp.support_problem() is not None, reason=str(fsdp.support_problem()))]

# By default each kind of step is killed right before its first occurrence on that
# rank (and once after the last step); DDP_EVAL_EVERY_KILL_POINT=1 kills at every
# single point before and after each step, of all three saves (about 190 points a
# rank, 8 s each; what was run by hand is in docs/testing.md).
EVERY_POINT = os.environ.get("DDP_EVAL_EVERY_KILL_POINT") == "1"
# the commit's file-system steps (tests/kill_points.py): the same code with and without async_save
COMMIT_STEPS = ("_fsync_file", "_fsync_dir", "_rename_dir", "rmtree", "_exchange_dirs")


def _points(tmp_path, kill_rank, async_save):
    """The armed saves' kill points on ``kill_rank`` (an unarmed run lists them)."""
    names = results(run_ranks(fsdp_kill.run, 2, str(tmp_path / f"list{kill_rank}"), kill_rank, None, async_save,
                              timeout=90, fresh=True))  # it instruments (patches) the rank: not in the pool
    return names[kill_rank]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kill_rank", [0, 1])
def test_sigkill_at_each_step_of_a_sharded_save_leaves_the_newest_complete_checkpoint(kill_rank, async_save,
                                                                                      tmp_path):
    names = _points(tmp_path, kill_rank, async_save)
    assert any("shard files" in n for n in names) and (kill_rank == 1 or any("_rename_dir" in n for n in names))
    kinds = {names.index(n) for n in set(names) if n.startswith("before")} | {len(names) - 1}
    if async_save:  # the commit's steps are the sync variant's code, run by the background writer: killed there
        kinds = {k for k in kinds if names[k] not in {f"before {step}" for step in COMMIT_STEPS}}
    chosen = range(len(names)) if EVERY_POINT else sorted(kinds)
    for k in chosen:
        directory = tmp_path / f"kill{k}"
        # a TCPStore on rank 0, as torchrun's: a rank left alone learns at once that rank 0 died
        outcomes = run_ranks(fsdp_kill.run, 2, str(directory), kill_rank, k + 1, async_save, timeout=90,
                             fresh=True, store="tcp")
        assert outcomes[kill_rank].get("exitcode") == -9, (names[k], outcomes[kill_rank])
        log = directory / "committed.log"
        committed = [int(v) for v in log.read_text().split()] if log.exists() else []
        version, whole = fsdp_kill.resume(str(directory))
        # the save in flight may have committed before the kill; an older or partial one never loads
        assert version is not None and version >= max(committed), (names[k], version, committed)
        assert version <= max(committed) + 1, (names[k], version, committed)
        assert whole, (names[k], version)
