"""A TEST killed with SIGKILL (the whole torchrun tree) resumes from its journal when
the same command runs again, with as many processes or another number, exactly;
and under torchrun --max-restarts the restarted attempt resumes it by itself."""

import concurrent.futures
import json
import math
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from tests import workers
from tests.processes import kill_when, start

pytestmark = pytest.mark.timeout(400)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL_BATCHES = 12


def _command(nproc, ckpt_dir, out_dir, *job_args, restarts=None):
    job = [os.path.join(ROOT, "tests", "eval_job.py"), str(ckpt_dir), str(out_dir), *job_args]
    if nproc is None:
        return [sys.executable] + job
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if restarts:
        launcher.append(f"--max-restarts={restarts}")
    return launcher + job


def _env(**extra):
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **extra}


def _journaled(ckpt_dir):
    positions = []
    for piece in (ckpt_dir / ".ddp_eval-journal").rglob("piece-*.pkl"):
        positions += pickle.loads(piece.read_bytes())["positions"]
    return positions


def _evaluated(out_dir):
    """Batches whose evaluation finished, from the job's per-process logs."""
    return sum(len(open(out_dir / f).read().splitlines()) for f in os.listdir(out_dir) if f.startswith("evaluated"))


def _kill_half_way(nproc, ckpt_dir, out_dir):
    """Starts the job; SIGKILLs torchrun and its workers once half the batches are journaled."""
    out_dir.mkdir()
    job = start(_command(nproc, ckpt_dir, out_dir, "0.15"), out_dir / "job.log", cwd=ROOT, env=_env())
    kill_when(job, lambda: len(list((ckpt_dir / ".ddp_eval-journal").rglob("piece-*.pkl"))) >= TOTAL_BATCHES // 2)
    journaled = _journaled(ckpt_dir)
    assert TOTAL_BATCHES // 2 <= len(journaled) < TOTAL_BATCHES and len(set(journaled)) == len(journaled)
    # each rank loses at most the batch it was evaluating (journaled after every batch)
    assert _evaluated(out_dir) - len(journaled) <= nproc
    return len(journaled)


def _run_to_the_end(nproc, ckpt_dir, out_dir):
    out_dir.mkdir()
    proc = subprocess.run(_command(nproc, ckpt_dir, out_dir), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out_dir / f"result-r{r}.json").read_text()) for r in range(nproc or 1)]


def _assert_as_one_process(per_rank, reference):
    want = reference["log"]
    for out in per_rank:
        assert out["loss"] == reference["loss"]  # bit for bit
        assert out["metrics"] == repr(want["metrics"])  # summaries, write_stats text, id order
        got = out["fields"]
        for key in ("acc_metric", "valid_acc", "counters", "predictions", "confusion"):
            assert got[key] == json.loads(json.dumps(want[key])), key  # as JSON: tuples are lists
        assert math.isclose(got["loss_total"], want["loss_total"], rel_tol=1e-12)


def _kill_then_resume(tmp_path, killed_at, resumed_at, reference_dir):
    """Kills a TEST at ``killed_at`` ranks half way, then runs it again at ``resumed_at``
    (None: one process, no torchrun), in a checkpoint folder of its own."""
    ckpt_dir = tmp_path / f"save-{killed_at}-{resumed_at}"
    shutil.copytree(reference_dir, ckpt_dir)
    journaled = _kill_half_way(killed_at, ckpt_dir, tmp_path / f"killed-{killed_at}")
    per_rank = _run_to_the_end(resumed_at, ckpt_dir, tmp_path / f"resumed-{resumed_at}")
    assert not _journaled(ckpt_dir)  # removed once on_stage_end ran on every rank
    return per_rank, journaled


def test_sigkilled_test_resumes_at_3_ranks_then_from_3_ranks_in_one_process(tmp_path):
    ckpt_dir = tmp_path / "save"
    workers.save_test_checkpoint(ckpt_dir)
    reference = workers.plain_test(ckpt_dir)
    # killed at 2 ranks, the same command at 3 ranks finishes it; killed at 3 ranks, one
    # process (no torchrun) finishes it: the two jobs side by side, each on a copy
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_kill_then_resume, tmp_path, killed, resumed, ckpt_dir) for killed, resumed in
                ((2, 3), (3, None))]
        (per_rank, journaled), ((single,), journaled_at_3) = [run.result() for run in runs]
    _assert_as_one_process(per_rank, reference)
    assert sum(out["batches"] for out in per_rank) == TOTAL_BATCHES - journaled
    _assert_as_one_process([single], reference)
    assert single["batches"] == TOTAL_BATCHES - journaled_at_3


def test_worker_killed_during_test_under_max_restarts_resumes_from_the_journal(tmp_path):
    """Attempt 0: rank 1 SIGKILLs itself after 3 TEST batches; torchrun restarts both
    workers; attempt 1 evaluates only what the journal lacks."""
    ckpt_dir, out_dir = tmp_path / "save", tmp_path / "out"
    out_dir.mkdir()
    workers.save_test_checkpoint(ckpt_dir)
    reference = workers.plain_test(ckpt_dir)
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: gloo re-creates the group after a restart (see test_restarts.py)
    proc = subprocess.run(_command(2, ckpt_dir, out_dir, restarts=1), cwd=ROOT, timeout=300, capture_output=True,
                          text=True, env=_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", EVAL_JOB_KILL_RANK1_AFTER="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    per_rank = [json.loads((out_dir / f"result-r{r}.json").read_text()) for r in (0, 1)]
    assert [out["attempt"] for out in per_rank] == [1, 1], "the job was not restarted"
    _assert_as_one_process(per_rank, reference)
    assert per_rank[0]["metrics"] == per_rank[1]["metrics"] and per_rank[0]["fields"] == per_rank[1]["fields"]
    evaluated_in_attempt_1 = sum(out["batches"] for out in per_rank)
    assert evaluated_in_attempt_1 <= TOTAL_BATCHES - 3  # at least rank 1's 3 journaled batches resumed
