"""ddp_eval.Checkpointer on real process groups: faults, stress, elastic resume."""

import contextlib
import os
import re
import subprocess

import pytest
import speechbrain as sb
import torch

from ddp_eval.checkpointing.commit import TMP_PREFIX
from tests import ckpt_workers as w
from tests import kill_points
from tests.mp_harness import results, run_ranks

pytestmark = pytest.mark.timeout(240)


def _elapsed(timing_dir, rank):
    return float((timing_dir / f"elapsed-{rank}").read_text())


def _only_previous_checkpoint_loads(directory, version):
    outcome = results(run_ranks(w.resume, 2, str(directory), timeout=60))
    assert all(o == (version, float(version), version) for o in outcome), outcome
    assert not [p for p in os.listdir(directory) if p.startswith(TMP_PREFIX)]


@pytest.mark.fast
def test_disk_full_in_save_hook_fails_fast_on_all_ranks(tmp_path):
    timing = tmp_path / "timing"
    timing.mkdir()
    outcomes = run_ranks(w.enospc_on_second_save, 3, str(tmp_path / "ck"), timeout=60,
                         env={"TIMING_DIR": str(timing)})
    assert outcomes[0]["error"] == "CheckpointWriteError", outcomes[0]
    assert "rank 0 could not write checkpoint" in outcomes[0]["message"]
    assert "CKPT+second" in outcomes[0]["message"] and "No space left" in outcomes[0]["message"]
    for rank in (1, 2):
        message = outcomes[rank]["message"]
        assert outcomes[rank]["error"] == "RankFailedError", outcomes[rank]
        assert "rank 0 failed" in message and "CKPT+second" in message and "No space left" in message
    assert max(_elapsed(timing, r) for r in range(3)) < 5
    _only_previous_checkpoint_loads(tmp_path / "ck", 1)


@contextlib.contextmanager
def read_only(directory):
    """Makes a directory read-only, also for root (who ignores permission bits)."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(directory)], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)


def test_read_only_checkpoint_directory_fails_fast_on_all_ranks(tmp_path):
    directory, timing = tmp_path / "ck", tmp_path / "timing"
    timing.mkdir()
    env = {"TIMING_DIR": str(timing)}
    results(run_ranks(w.save_into_read_only_dir, 1, str(directory), timeout=60, env=env))
    with read_only(directory):
        outcomes = run_ranks(w.save_into_read_only_dir, 2, str(directory), timeout=60, env=env)
    assert outcomes[0]["error"] == "CheckpointWriteError", outcomes[0]
    assert re.search("Permission denied|Operation not permitted|Read-only", outcomes[0]["message"])
    assert outcomes[1]["error"] == "RankFailedError" and "rank 0 failed" in outcomes[1]["message"]
    assert max(_elapsed(timing, r) for r in range(2)) < 5
    _only_previous_checkpoint_loads(directory, 2)


def test_storage_without_atomic_rename_errors_on_every_rank(tmp_path):
    outcomes = run_ranks(w.storage_without_rename, 2, str(tmp_path), "error", timeout=60)
    assert outcomes[0]["error"] == "CheckpointWriteError"
    assert "does not support atomic directory rename" in outcomes[0]["message"]
    assert outcomes[1]["error"] == "RankFailedError"
    assert "does not support atomic directory rename" in outcomes[1]["message"]


def test_storage_without_atomic_rename_falls_back_when_configured(tmp_path):
    per_rank = results(run_ranks(w.storage_without_rename, 2, str(tmp_path), "fallback", timeout=60))
    for version, listing in per_rank:
        assert version == 7
        assert [n for n in listing if n.startswith("CKPT")] == sorted(
            n for n in listing if n.startswith("CKPT"))
        assert "CKPT+same" in listing and not [n for n in listing if n.startswith(".")]


def test_writer_killed_mid_save_other_rank_errors_and_resume_loads_previous(tmp_path):
    timing = tmp_path / "timing"
    timing.mkdir()
    outcomes = run_ranks(w.writer_killed_mid_save, 2, str(tmp_path / "ck"), timeout=60,
                         env={"TIMING_DIR": str(timing)})
    assert outcomes[0] == {"exitcode": -9}
    assert outcomes[1]["error"] == "CollectiveTimeoutError", outcomes[1]
    assert "ranks that did not arrive: [0]" in outcomes[1]["message"]
    # the 2 s timeout, plus up to 1 s by which the test's FileStore overshoots waits
    assert _elapsed(timing, 1) < 2 + 2
    _only_previous_checkpoint_loads(tmp_path / "ck", 1)


def test_stress_200_rounds_on_4_ranks_keeps_what_speechbrain_keeps(tmp_path):
    rounds = 200
    per_rank = results(run_ranks(w.stress, 4, str(tmp_path / "ddp"), rounds, timeout=200))
    reference = w.stress(0, 1, str(tmp_path / "sb"), rounds, sb.utils.checkpoints.Checkpointer)
    # SpeechBrain keeps the most recent and the best (the newest of the loss-0 rounds)
    assert reference == [154, 199]
    assert all(kept == reference for kept in per_rank)
    assert len([n for n in os.listdir(tmp_path / "ddp") if n.startswith("CKPT")]) == 2


def test_elastic_resume_4_to_2_to_1_and_back_to_4(tmp_path):
    directory = str(tmp_path)
    previous = None
    for world_size, epochs in ((4, 1), (2, 2), (1, 3), (4, 4)):
        per_rank = results(run_ranks(w.elastic_fit, world_size, directory, epochs, timeout=90))
        for out in per_rank:
            assert out["epochs_run"] == [epochs]
            if previous is not None:
                for key, value in previous.items():
                    assert torch.equal(out["started_from"][key], value), (world_size, key)
        previous = per_rank[0]["weights"]


def test_time_based_intra_epoch_checkpoints_stay_in_step(tmp_path):
    per_rank = results(run_ranks(w.time_based_intra_epoch_saves, 2, str(tmp_path), timeout=90))
    saves, kept = per_rank[0]
    assert per_rank[1] == per_rank[0]
    assert saves == [False] * 4 + [True]  # 4 batches per rank, each followed by a save
    # the intra-epoch one is deleted by the end-of-epoch save_and_keep_only
    assert kept == [(False, True)]


def test_saves_guarded_by_run_on_main_work_and_bare_guards_fail_clearly(tmp_path):
    per_rank = results(run_ranks(w.guarded_saves, 2, str(tmp_path), timeout=60))
    for version, error, message in per_rank:
        assert version == 1  # saved under run_on_main, found on both ranks
        assert error == "OutOfStepError", message
        assert "'checkpoint save: begin'" in message and "'delete checkpoints: begin'" in message


def _speechbrain_saves(directory):
    """Two checkpoints written by SpeechBrain's own Checkpointer (meta file first)."""
    saved = []
    for version in (1, 2):
        model, counter = kill_points.model_for(version), sb.utils.epoch_loop.EpochCounter(10)
        counter.current = version
        ckpter = sb.utils.checkpoints.Checkpointer(directory, {"model": model, "counter": counter})
        saved.append(ckpter.save_checkpoint(name=f"v{version}"))
    return saved


@pytest.mark.parametrize("damage", ["truncated model", "missing model", "empty meta file"])
def test_damaged_speechbrain_checkpoint_is_skipped_on_every_rank(damage, tmp_path):
    good, bad = _speechbrain_saves(tmp_path)
    model_file = bad.path / "model.ckpt"
    if damage == "truncated model":
        model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])
    elif damage == "missing model":
        model_file.unlink()
    else:
        (bad.path / "CKPT.yaml").write_bytes(b"")
    per_rank = results(run_ranks(w.recover_with_warnings, 2, str(tmp_path), timeout=60))
    for out in per_rank:
        assert (out["found"], out["weight"], out["counter"]) == (good.path.name, 1.0, 1)
    warnings = per_rank[0]["warnings"] + per_rank[1]["warnings"]
    assert any(f"skipping incomplete checkpoint {bad.path}" in m for m in warnings), warnings


@pytest.mark.fast
def test_a_load_that_fails_names_checkpoint_and_file_on_every_rank(tmp_path):
    _, newest = _speechbrain_saves(tmp_path)
    (newest.path / "counter.ckpt").write_text("not a number")  # exists, not a zip: passes the checks
    outcomes = run_ranks(w.recover_with_warnings, 2, str(tmp_path), timeout=60)
    for rank, outcome in enumerate(outcomes):  # both ranks read the same file, both fail
        assert outcome.get("error") == "CheckpointLoadError", outcome
        assert f"rank {rank} could not load recoverable 'counter' from {newest.path / 'counter.ckpt'}" \
            in outcome["message"]
