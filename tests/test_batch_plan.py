"""One batch plan per stage, shared by every rank (issue 19).

Samplers whose batches change from one pass to the next (SpeechBrain's
DynamicBatchSampler with shuffle or random batch order, ReproducibleRandomSampler
with set_epoch, a sampler of the test's own) are iterated once per stage, as one
process iterates them, with ``resume_eval`` on and off; a sampler that differs
across ranks is a loud error on every rank, naming the first batch that differs.
"""

import math
import types
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from ddp_eval.stage._loop import LoopWatch
from ddp_eval.stage.sharding import (
    BatchLedger,
    BatchPlan,
    ShardedBatchSampler,
    ShardedStreamLoader,
    first_difference,
    new_plan,
)
from tests import samplers
from tests.mp_harness import results, run_ranks

pytestmark = pytest.mark.timeout(240)
RESUME = ({"resume_eval": True}, {"resume_eval": False})


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Plain SpeechBrain in one process, per sampler kind."""
    return {kind: samplers.single_process(tmp_path_factory.mktemp(kind), kind) for kind in samplers.KINDS}


def assert_as_one_process(out, reference, stages=("VALID", "TEST")):
    records = [r for r in out["log"] if r["stage"] in stages]
    expected = [r for r in reference["log"] if r["stage"] in stages]
    assert [r["stage"] for r in records] == [r["stage"] for r in expected]
    for got, want in zip(records, expected):
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-9)
        # summaries, write_stats text and utterance order, bit for bit; plain attributes too
        for key in ("metrics", "acc_metric", "counters", "predictions", "confusion"):
            assert repr(got[key]) == repr(want[key]), key
        if "scheduler" in want:  # NewBob stepped from the global loss, the same on every rank
            assert got["scheduler"][0] == want["scheduler"][0]
            assert got["scheduler"][1] == pytest.approx(want["scheduler"][1], rel=1e-9)


def several_settings(rank, world_size, directory, kind):
    """The recipe with resume_eval on, then off, in one process group."""
    return [samplers.ranks_worker(rank, world_size, f"{directory}/{i}", kind, opts) for i, opts in enumerate(RESUME)]


@pytest.mark.parametrize("kind,world_size", [  # the fast lane: issue 19's case, at 3 ranks
    pytest.param(kind, size, id=f"{kind}-{size}",
                 marks=[pytest.mark.fast] if (kind, size) == ("dynamic_random_order", 3) else [])
    for kind in ("dynamic_random_order", *samplers.KINDS[:1], *samplers.KINDS[2:]) for size in (2, 3)])
def test_samplers_that_change_per_pass_evaluate_every_utterance_once(kind, world_size, references, tmp_path):
    reference = references[kind]
    per_rank = results(run_ranks(several_settings, world_size, str(tmp_path), kind, timeout=200))
    for setting, opts in enumerate(RESUME):
        outs = [out[setting] for out in per_rank]
        for stage in ("valid", "test"):  # each utterance once per pass (VALID: 2 epochs)
            evaluated = Counter(i for out in outs for i in out["seen"][stage])
            assert evaluated == Counter(reference["seen"][stage]), (opts, stage)
        for out in outs:
            assert_as_one_process(out, reference)
            assert math.isclose(out["test_loss"], reference["test_loss"], rel_tol=1e-9)
            # the samplers were iterated as one process iterates them: same state after
            assert out["valid_sampler"] == reference["valid_sampler"], opts
            assert out["test_sampler"] == reference["test_sampler"], opts


@pytest.mark.parametrize("kind", samplers.KINDS)
def test_a_resumed_stage_with_these_samplers_equals_one_process(kind, references, tmp_path):
    """TEST interrupted after 2 batches per rank at 2 ranks, resumed at 3."""
    reference = references[kind]
    opts = {"resume_eval_every_s": 0}
    first = results(run_ranks(samplers.ranks_worker, 2, str(tmp_path), kind, opts, True, 2, timeout=200))
    assert {out["error"] for out in first} <= {"Interrupted", "RankFailedError"}
    resumed = results(run_ranks(samplers.ranks_worker, 3, str(tmp_path), kind, opts, False, timeout=200))
    total = len(reference["test_sampler"]["batches"]) if kind.startswith("dynamic") else math.ceil(23 / 3)
    assert sum(out["test_batches"] for out in resumed) == total - 4  # only what the journal lacks
    evaluated = Counter(i for out in first + resumed for i in out["seen"]["test"])
    assert evaluated == Counter(reference["seen"]["test"])
    for out in resumed:
        assert_as_one_process(out, reference, stages=("TEST",))
        assert out["test_sampler"] == reference["test_sampler"]


def differing_sampler(rank, world_size, directory, stream):
    """A TEST set whose order depends on the rank: map-style, or a stream."""
    import ddp_eval
    from tests import toy

    brain = samplers.build(samplers.DDPSamplerBrain, directory, {"resume_eval": False})
    test = toy.make_dataset(11, 2, "tst")
    if stream:
        order = list(range(11))
        order[5:7] = order[6:4:-1] if rank == 1 else order[5:7]
        data = ToyStream(test, order)
        kwargs = {"batch_size": 2, "collate_fn": __import__("speechbrain").dataio.batch.PaddedBatch}
    else:
        data, kwargs = test, {"sampler": samplers.RotatingSampler(11), "batch_size": 2}
        kwargs["sampler"].passes = 1 if rank == 2 else 0  # this rank's sampler made a pass of its own
    try:
        brain.evaluate(data, test_loader_kwargs=kwargs)
    except ddp_eval.DDPEvalError as error:
        return {"error": type(error).__name__, "message": str(error), "evaluated": len(brain.seen.ids)}
    return {"error": None}


class ToyStream(__import__("torch").utils.data.IterableDataset):
    def __init__(self, dataset, order):
        self.dataset, self.order = dataset, order

    def __iter__(self):
        return (self.dataset[i] for i in self.order)


@pytest.mark.fast
def test_ranks_with_different_batches_fail_at_stage_start_naming_the_batch(tmp_path):
    outs = results(run_ranks(differing_sampler, 3, str(tmp_path), False, timeout=60))
    for out in outs:
        assert out["error"] == "BatchPlanError", out
        assert out["evaluated"] == 0  # raised before any batch was evaluated
        message = out["message"]
        assert "the TEST loader (RotatingSampler)" in message
        assert "Batches built: rank 0: 6, rank 1: 6, rank 2: 6" in message
        assert "the first that differs is batch 0: rank 0 held 2 item(s): ['tst002', 'tst" in message
        assert "rank 2 held 2 item(s): ['tst002', 'tst" in message and "set_epoch" in message
    assert outs[0]["message"] == outs[1]["message"] == outs[2]["message"]


def test_a_stream_read_differently_on_one_rank_fails_at_stage_end(tmp_path):
    outs = results(run_ranks(differing_sampler, 2, str(tmp_path), True, timeout=60))
    for out in outs:
        assert out["error"] == "BatchPlanError", out
        assert "the TEST loader (ToyStream)" in out["message"]
        assert "the first that differs is batch 2" in out["message"]  # items 5 and 6 swapped
    assert outs[0]["message"] == outs[1]["message"]


class CountingBatches:
    """A batch sampler that counts its passes."""

    def __init__(self, batches):
        self.batches, self.passes = batches, 0

    def __iter__(self):
        self.passes += 1
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


@pytest.mark.fast
def test_the_plan_is_built_once_per_stage_and_read_by_the_iteration():
    inner = CountingBatches([[0, 1], [2], [3, 4], [5]])
    sampler = ShardedBatchSampler(inner, rank=1, world_size=2)
    plan = sampler.new_plan()
    assert inner.passes == 1 and len(sampler) == 2
    assert list(sampler) == [[2], [3, 4]] and inner.passes == 1  # the stage's plan, no second pass
    assert list(sampler) == [[2], [3, 4]] and inner.passes == 2  # iterated again: one more pass
    assert sampler.plan is not plan and sampler.global_batch_ids() == [1, 2]


@pytest.mark.fast
def test_a_debug_plan_holds_the_first_batches_only():
    inner = CountingBatches([[0], [1], [2], [3]])
    sampler = ShardedBatchSampler(inner, rank=0, world_size=1)
    sampler.new_plan(limit=2)
    assert list(sampler) == [[0], [1]]


@pytest.mark.fast
def test_plan_and_ledger_keep_batches_and_name_the_first_difference():
    batches = list(BatchSampler(SequentialSampler(range(7)), 3, drop_last=False))
    plan = BatchPlan(batches, names=[f"u{i}" for i in range(7)])
    assert [plan[i] for i in range(len(plan))] == batches
    assert plan.ledger.held(2) == "1 item(s): ['u6']"
    assert BatchPlan([range(5)]).ledger.held(0) == "5 item(s): [0, 1, 2, ...]"
    keys = BatchPlan([["a", "b"], ["c"]])  # indices that are not ints are kept as they are
    assert [keys[0], keys[1]] == [["a", "b"], ["c"]]
    shorter = BatchLedger()
    for batch in batches[:2]:
        shorter.add([f"u{i}" for i in batch])
    assert first_difference([plan.ledger.crcs, shorter.crcs]) == 2  # one rank ran out of batches
    assert first_difference([plan.ledger.crcs, plan.ledger.crcs, shorter.crcs]) == 2


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.fast
@settings(max_examples=60, derandomize=True, deadline=None)
@given(n_items=st.integers(0, 25), batch_size=st.integers(1, 4), world_size=st.integers(1, 8),
       start=st.integers(0, 3), done=st.sets(st.integers(0, 12), max_size=4), stream=st.booleans())
def test_every_batch_sees_one_process_s_step_at_any_world_size(n_items, batch_size, world_size, start, done,
                                                               stream):
    """Invariant: on every rank, in each batch, ``self.step`` (SpeechBrain's loop adds 1
    right before the batch) is one process's there, start + global position + 1, and
    ``evaluate`` leaves one process's count; for planned loaders and streams read whole,
    a journal's batches taken out (resumed), world sizes 1-8 (ranks with no batch)."""
    dataset = _Stream(n_items) if stream else list(range(n_items))
    n_batches = -(-n_items // batch_size)
    done = {d for d in done if d < n_batches}
    seen = {}
    for rank in range(world_size):
        brain = types.SimpleNamespace(step=start)
        if stream:
            loader = ShardedStreamLoader(DataLoader(dataset, batch_size=batch_size), "batches", rank, world_size)
        else:
            batches = BatchSampler(SequentialSampler(dataset), batch_size, drop_last=False)
            loader = DataLoader(dataset, batch_sampler=ShardedBatchSampler(batches, rank, world_size))
        plan = new_plan(loader)
        (loader if stream else loader.batch_sampler).skip(done)  # a journal's batches (resumed)
        watch = LoopWatch(brain, loader, plan)
        for batch in loader:  # SpeechBrain's loop
            brain.step += 1
            seen[int(batch[0]) // batch_size] = brain.step
            watch.after_batch()
        watch.stop()
        watch.steps.at_test_end()
        assert brain.step == start + n_batches
    assert seen == {p: start + p + 1 for p in range(n_batches) if p not in done}
