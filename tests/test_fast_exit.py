"""A job that ends right after evaluate() is reported as finished, whoever hosts the store."""

import os
import subprocess
import sys

import pytest

from tests import workers
from tests.mp_harness import _free_port, results, run_ranks

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = 4  # without the acknowledgement 6 of 6 runs failed, launched so (docs/never-hangs.md)


def _launch(ckpt_dir):
    """Both ranks of one job, started as srun starts them (no torchrun agent):
    ``env://``, so rank 0 hosts the store."""
    port = str(_free_port())
    jobs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        jobs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "exit_job.py"), str(ckpt_dir)],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True))
    return jobs


def test_rank_0_exiting_at_once_after_evaluate_leaves_every_rank_exit_0(tmp_path):
    """Rank 0 calls os._exit(0) right after evaluate(); rank 1 reads every answer late."""
    failures = []
    for pair in range(RUNS // 2):  # two jobs at a time
        jobs = [_launch(tmp_path / f"run{pair}-{i}") for i in range(2)]
        for job in jobs:
            outputs, codes = [], []
            for rank, process in enumerate(job):
                try:
                    output, _ = process.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, 9)
                    output, _ = process.communicate()
                outputs.append(f"rank {rank}:\n{output[-2000:]}")
                codes.append(process.returncode)
            if codes != [0, 0]:
                failures.append(f"exit codes {codes}:\n" + "\n".join(outputs))
    assert not failures, f"{len(failures)} of {RUNS} runs failed; first:\n{failures[0]}"


def test_the_exit_hook_destroys_the_process_group_on_a_normal_exit_only():
    """Left to interpreter teardown, gloo's worker threads aborted a finished recipe run
    (SIGABRT, "terminate called without an active exception"); ddp_eval's exit hook
    destroys the group first, except after an uncaught exception (peers may still be in
    a collective). Fresh processes: the hook ends their process group."""
    assert results(run_ranks(workers.exit_hook, 2, 1, timeout=60, fresh=True)) == [False, True]
