"""WebDataset tar shards of real FSDD recordings evaluated as a stream under DDP."""

import math
import os

import pytest

from tests.mp_harness import results, run_ranks
from tests.test_recipes import FSDD, needs_fsdd

pytestmark = [pytest.mark.timeout(180), needs_fsdd]
streaming = pytest.importorskip("tests.streaming", reason="webdataset is a test extra")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return streaming.write_shards(FSDD, str(tmp_path_factory.mktemp("shards")))


@pytest.fixture(scope="module")
def single_process(shards):
    return streaming.evaluate(streaming.DigitBrain, shards)


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.fast), 3])
def test_stream_dealt_by_batches_equals_one_process(world_size, shards, single_process):
    """100 utterances at batch 4 = 25 batches, dealt unevenly at 3 ranks (9, 8, 8).
    Every rank reads the stream and sees one process's numbers. (A streamed set with
    an idle rank: test_attributes_distributed, 3-stream.)"""
    assert len(shards) == 4
    per_rank = results(run_ranks(streaming.worker, world_size, shards, False, timeout=120))
    for out in per_rank:
        assert out["ids"] == single_process["ids"]  # global order
        assert out["acc_metric"] == single_process["acc_metric"]
        assert out["scores"] == single_process["scores"]
        assert out["accuracy"] == single_process["accuracy"]
        assert math.isclose(out["loss"], single_process["loss"], rel_tol=1e-9)


@pytest.mark.fast
def test_stream_split_by_node_keeps_each_utterance_once(shards, single_process):
    """wds.split_by_node: each rank reads 2 of the 4 shards. Batches differ from one
    process, so the order and the running loss differ; each utterance is evaluated
    once and its result is the same."""
    per_rank = results(run_ranks(streaming.worker, 2, shards, True, timeout=120))
    for out in per_rank:
        assert sorted(out["ids"]) == sorted(single_process["ids"])
        assert len(out["ids"]) == len(set(out["ids"])) == 100
        assert out["scores"].keys() == single_process["scores"].keys()
        for utt, row in out["scores"].items():
            assert row == pytest.approx(single_process["scores"][utt], rel=1e-5)
        assert out["accuracy"] == single_process["accuracy"]
    assert os.path.basename(shards[0]) == "fsdd-00.tar"
