"""Non-blocking saves (async_save=True): the state at call time, errors on every
rank, the same results as synchronous saves, and a clear memory error."""

import os

import pytest
import torch

import ddp_eval
from ddp_eval.checkpointing.commit import TMP_PREFIX
from tests import ckpt_workers as w
from tests import workers
from tests.mp_harness import results, run_ranks

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.fast)])
def test_checkpoint_holds_the_state_at_call_time(world_size, tmp_path):
    per_rank = results(run_ranks(w.async_snapshot_then_change, world_size, str(tmp_path), timeout=60))
    for out in per_rank:
        assert out["found"] == out["saved"] == per_rank[0]["saved"]
        assert (out["weight"], out["blob"]) == (3.0, 3)  # not 103.0 / 4
        assert out["live_weight"] == 103.0


def test_background_enospc_is_raised_on_every_rank_at_the_next_call(tmp_path):
    outcomes = results(run_ranks(w.async_enospc, 3, str(tmp_path / "ck"), timeout=60))
    for rank, out in enumerate(outcomes):
        assert out["returned"] == "CKPT+second"
        assert out["error"] == ("CheckpointWriteError" if rank == 0 else "RankFailedError"), out
        assert "background save of checkpoint" in out["message"] and "CKPT+second" in out["message"]
        assert "No space left on device" in out["message"]
    assert sorted(os.listdir(tmp_path / "ck")) == [n for n in sorted(os.listdir(tmp_path / "ck"))
                                                   if not n.startswith(TMP_PREFIX)]
    per_rank = results(run_ranks(w.resume, 2, str(tmp_path / "ck"), timeout=60))
    assert all(out == (1, 1.0, 1) for out in per_rank)  # the previous checkpoint, intact


def test_fit_then_evaluate_with_async_saves_equals_synchronous_saves(tmp_path):
    outcomes = {}
    for mode in ("sync", "async"):
        per_rank = results(run_ranks(workers.recipe, 2, str(tmp_path / mode), {"check_consistency": True},
                                     mode == "async", timeout=150))
        outcomes[mode] = per_rank
    for sync_out, async_out in zip(outcomes["sync"], outcomes["async"]):
        assert repr(async_out["log"]) == repr(sync_out["log"])  # best checkpoints loaded: same numbers
        for key in ("test_loss", "tiny_loss", "ready_loss", "ready_sharded_loss"):
            assert async_out[key] == sync_out[key]
        assert async_out["probe_loaded"] == "0"
    names = [f for f in outcomes["async"][0]["ckpt_files"] if f.startswith("CKPT")]
    assert len(names) == len([f for f in outcomes["sync"][0]["ckpt_files"] if f.startswith("CKPT")])


def test_a_snapshot_that_memory_cannot_hold_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(ddp_eval.checkpointing._async_save, "available_memory_bytes", lambda: 1024)
    ckpter = ddp_eval.Checkpointer(tmp_path, {"model": torch.nn.Linear(64, 64)}, async_save=True)
    with pytest.raises(ddp_eval.CheckpointWriteError, match=r"async_save needs one copy .* only 0 MB are "
                                                            r"available.*async_save: false"):
        ckpter.save_checkpoint()
    assert os.listdir(tmp_path) == []  # nothing half-written


@pytest.mark.fast
def test_async_save_accepts_only_a_bool(tmp_path):
    with pytest.raises(ddp_eval.ConfigError, match="'async_save' expects true or false"):
        ddp_eval.Checkpointer(tmp_path, async_save="yes")


@pytest.mark.fast
def test_a_script_that_ends_right_after_an_async_save_keeps_its_checkpoint(tmp_path):
    """The background write is held until someone waits for it, so it is surely
    still running when the script ends; the exit waits for it instead of killing
    the daemon thread."""
    import subprocess
    import sys

    script = (
        "import sys, threading, torch, ddp_eval\n"
        "from ddp_eval.checkpointing._async_save import BackgroundWriter\n"
        "release, save = threading.Event(), torch.save\n"
        "def held(*args, **kwargs):\n"
        "    release.wait(60)\n"
        "    return save(*args, **kwargs)\n"
        "torch.save, wait = held, BackgroundWriter.wait\n"
        "def waiting(self, timeout=None):\n"
        "    release.set()\n"
        "    return wait(self, timeout)\n"
        "BackgroundWriter.wait = waiting\n"
        "model = torch.nn.Linear(700, 700)\n"
        "ckpter = ddp_eval.Checkpointer(sys.argv[1], {'model': model}, async_save=True)\n"
        "ckpter.save_checkpoint(meta={'last': True})\n"
        "print('running while the script ends:', ckpter._background.writer.running, flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "running while the script ends: True" in proc.stdout
    loaded = torch.nn.Linear(700, 700)
    found = ddp_eval.Checkpointer(tmp_path, {"model": loaded}).recover_if_possible()
    assert found is not None and found.meta["last"] is True
    assert not [n for n in os.listdir(tmp_path) if n.startswith(TMP_PREFIX)]


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.fast)])
def test_checkpoint_averaging_right_after_an_async_save_sees_it_on_every_rank(world_size, tmp_path):
    per_rank = results(run_ranks(w.async_saves_then_average, world_size, str(tmp_path), timeout=90))
    assert per_rank[0]["running"]  # the last save was still running when the recipe looked
    for out in per_rank:
        assert out["found"] == [3, 2]  # the two best kept, the newest included
        assert out["averaged"] == 2.5
        assert out["best"] == 3
