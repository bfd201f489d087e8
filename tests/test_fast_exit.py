"""A job that ends right after evaluate() is reported as finished, whoever hosts the store."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = 6  # without the acknowledgement 4 of 4 runs failed (docs/never-hangs.md)


def _launch(ckpt_dir):
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 hosts the store (as with srun + env://)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "tests", "exit_job.py"), str(ckpt_dir)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def test_rank_0_exiting_at_once_after_evaluate_leaves_every_rank_exit_0(tmp_path):
    """Rank 0 calls os._exit(0) right after evaluate(); rank 1 reads every answer late."""
    failures = []
    for pair in range(RUNS // 2):  # two jobs at a time
        jobs = [_launch(tmp_path / f"run{pair}-{i}") for i in range(2)]
        for job in jobs:
            try:
                output, _ = job.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, 9)
                output, _ = job.communicate()
                failures.append(f"hung:\n{output[-2000:]}")
                continue
            if job.returncode != 0:
                failures.append(f"exit {job.returncode}:\n{output[-3000:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs failed; first:\n{failures[0]}"
