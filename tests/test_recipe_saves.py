"""Saving as SpeechBrain's transformer recipes do, converted by the README's diff:
VALID's checkpoint saved under ``if if_main_process():`` in on_stage_end, an
averaged checkpoint saved at TEST end on every rank, checkpoints averaged in
on_evaluate_start. Compared with plain SpeechBrain in one process."""

import math

import pytest
import speechbrain as sb

from tests import toy, workers
from tests.mp_harness import results, run_ranks

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    brain = toy.build(toy.TransformerStyleBrain, tmp_path_factory.mktemp("plain"),
                      checkpointer_cls=sb.utils.checkpoints.Checkpointer, epochs=3)
    return toy.run_transformer_style(brain)


@pytest.mark.parametrize("world_size,async_save", [(2, False), (3, False), (2, True)])
def test_guarded_and_averaged_saves_equal_one_process(world_size, async_save, single_process, tmp_path):
    per_rank = results(run_ranks(workers.transformer_style_recipe, world_size, str(tmp_path), async_save,
                                 timeout=150))
    single = single_process
    assert [r for r in single["log"] if "averaged" in r] == [{"averaged": [2, 3]}]  # the 2 best of 3 epochs
    for out in per_rank:
        assert len(out["log"]) == len(single["log"])
        for got, want in zip(out["log"], single["log"]):
            assert got.keys() == want.keys()
            if "loss" in want:
                assert (got["stage"], got["epoch"]) == (want["stage"], want["epoch"])
            if "metrics" in want:  # VALID and TEST (a TRAIN loss averages per-rank shards)
                assert math.isclose(got["loss"], want["loss"], rel_tol=1e-6)
            if "metrics" in want:
                assert repr(got["metrics"]) == repr(want["metrics"])
            if "averaged" in want:
                assert got["averaged"] == want["averaged"]
        assert math.isclose(out["test_loss"], single["test_loss"], rel_tol=1e-6)
        assert out["kept"] == single["kept"] == [None]  # only the TEST-end checkpoint remains


def test_a_failed_guarded_save_is_raised_on_every_rank_within_seconds(tmp_path):
    per_rank = results(run_ranks(workers.guarded_save_fails, 3, str(tmp_path), timeout=90))
    for rank, out in enumerate(per_rank):
        assert out["error"] == ("CheckpointWriteError" if rank == 0 else "RankFailedError"), out
        assert "No space left on device" in out["message"]
        assert rank == 0 or "rank 0 failed at 'VALID on_stage_end' with CheckpointWriteError" in out["message"]
        assert out["seconds"] < 30  # not the 60 s collective timeout
        # epoch 2's on_stage_end stopped at the save on rank 0 only (the others skip it)
        assert [r["epoch"] for r in out["log"] if r.get("stage") == "VALID"] == ([1] if rank == 0 else [1, 2])
    resumed = toy.build(toy.TransformerStyleBrain, tmp_path, checkpointer_cls=sb.utils.checkpoints.Checkpointer)
    assert resumed.checkpointer.find_checkpoint(min_key="loss").meta["epoch"] == 1  # epoch 1's, intact
