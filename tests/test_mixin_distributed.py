"""DDPEvalMixin on real gloo process groups, compared with one process."""

import math
from collections import Counter

import pytest
import speechbrain as sb

from tests import toy, workers
from tests.mp_harness import results, run_ranks
from tests.workers import (
    batchnorm_train_then_eval,
    diverging_scheduler,
    fail_in_evaluation_loop,
    fail_in_on_stage_end,
    recipe,
    slow_rank,
    unpicklable_metric_entry,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """Plain SpeechBrain (no mixin, SpeechBrain's Checkpointer) in one process."""
    brain = toy.build(toy.ToyBrain, tmp_path_factory.mktemp("plain"),
                      checkpointer_cls=sb.utils.checkpoints.Checkpointer)
    return toy.run_recipe(brain)


def _assert_same_metrics(dist_record, single_record):
    assert dist_record["stage"] == single_record["stage"]
    assert dist_record["epoch"] == single_record["epoch"]
    assert dist_record["loss"] == single_record["loss"]  # bit for bit
    if "metrics" in single_record:
        # summaries, write_stats text and utterance order: bit for bit
        assert repr(dist_record["metrics"]) == repr(single_record["metrics"])
    if "scheduler" in single_record:
        assert dist_record["scheduler"][0] == single_record["scheduler"][0]
        assert dist_record["scheduler"][1] == pytest.approx(single_record["scheduler"][1], rel=1e-6)


# 5 and 6 ranks run the code of 4 (every rank a batch of VALID, some none of the tiny set)
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.fast), 3, 4, 8])
def test_distributed_equals_single_process(world_size, single_process, tmp_path):
    """Valid (23 samples, batch 3: 8 batches), test (DynamicBatchSampler) and a
    2-sample set (ranks with nothing from world size 3 on) give single-process numbers."""
    per_rank = results(run_ranks(recipe, world_size, str(tmp_path), {"check_consistency": True},
                                 timeout=150))
    single = single_process
    eval_records = [r for r in single["log"] if r["stage"] != "TRAIN"]
    for out in per_rank:
        dist_eval = [r for r in out["log"] if r["stage"] != "TRAIN"]
        assert len(dist_eval) == len(eval_records)
        for d, s in zip(dist_eval, eval_records):
            _assert_same_metrics(d, s)
        for key in ("test_loss", "tiny_loss", "ready_loss", "ready_sharded_loss"):
            assert out[key] == single[key], key  # bit for bit
        # on_stage_end ran on every rank for TRAIN, VALID and TEST
        assert [r["stage"] for r in out["log"]] == [r["stage"] for r in single["log"]]
        # identical arguments on every rank, bit for bit (TRAIN loss included)
        assert repr(out["log"]) == repr(per_rank[0]["log"])
        # checkpoints were written by rank 0 only, and loaded on every rank
        assert out["probe_loaded"] == "0"
        # save_checkpoint returns the same Checkpoint on every rank
        assert out["save_return"] == per_rank[0]["save_return"]
    # each sample evaluated exactly once per sharded pass in the whole job (a ready
    # DataLoader the recipe built is sharded too, as BEST-RQ and wav2vec2 pass theirs)
    for name in ("fit", "test", "tiny", "ready", "ready_sharded"):
        seen = Counter(i for out in per_rank for i in out["seen"][name])
        assert seen == Counter(single["seen"][name]), name
    assert set(Counter(single["seen"]["fit"]).values()) == {2}  # two validation epochs
    if world_size > 1:
        assert all(out["seen"]["test"] != single["seen"]["test"] for out in per_rank)


def test_sharding_switched_off_per_stage(single_process, tmp_path):
    """shard_test: false keeps SpeechBrain's behaviour for TEST (every rank evaluates
    everything) while VALID stays sharded; the numbers are the same either way."""
    per_rank = results(run_ranks(recipe, 2, str(tmp_path), {"shard_test": False}, timeout=150))
    single = single_process
    for out in per_rank:
        assert out["seen"]["test"] == single["seen"]["test"]  # the whole test set
        assert len(out["log"]) == len(single["log"])
        for d, s in zip(out["log"], single["log"]):
            if d["stage"] != "TRAIN":
                _assert_same_metrics(d, s)
        assert out["test_loss"] == single["test_loss"]
    seen_valid = Counter(i for out in per_rank for i in out["seen"]["fit"])
    assert seen_valid == Counter(single["seen"]["fit"])  # still sharded


@pytest.mark.parametrize("worker,bad_rank,error,where", [
    (fail_in_on_stage_end, 1, "ValueError: boom on purpose", "VALID on_stage_end"),
    (fail_in_evaluation_loop, 2, "RuntimeError: bad utterance on purpose", "evaluate"),
], ids=["in-on_stage_end", "in-evaluation-loop"])
def test_failure_on_one_rank_raises_on_all(worker, bad_rank, error, where, tmp_path):
    outcomes = run_ranks(worker, 3, str(tmp_path), bad_rank, timeout=60)
    assert f"{outcomes[bad_rank]['error']}: {outcomes[bad_rank]['message']}" == error
    for rank in {0, 1, 2} - {bad_rank}:
        assert outcomes[rank]["error"] == "RankFailedError", outcomes[rank]
        assert f"rank {bad_rank} failed at '{where}' with {error}" in outcomes[rank]["message"]


def test_metric_state_that_cannot_be_sent_fails_on_all_ranks(tmp_path):
    outcomes = run_ranks(unpicklable_metric_entry, 3, str(tmp_path), 1, timeout=60)
    assert "pickle" in outcomes[1]["message"], outcomes[1]
    for rank in (0, 2):
        assert outcomes[rank]["error"] == "RankFailedError", outcomes[rank]
        assert "rank 1 failed at 'TEST stage end'" in outcomes[rank]["message"]


def test_collective_timeout_names_missing_rank(tmp_path):
    outcomes = run_ranks(slow_rank, 3, str(tmp_path), 2, timeout=60)
    for rank in (0, 1):
        assert outcomes[rank]["error"] == "CollectiveTimeoutError", outcomes[rank]
        assert "ranks that did not arrive: [2]" in outcomes[rank]["message"]
        assert "VALID" in outcomes[rank]["message"]
    # the late rank, when it arrives, is told instead of entering a dead collective
    assert outcomes[2]["error"] == "RankFailedError", outcomes[2]
    assert "CollectiveTimeoutError" in outcomes[2]["message"]


@pytest.mark.fast
def test_consistency_check_names_diverging_object_and_rank(tmp_path):
    outcomes = run_ranks(diverging_scheduler, 2, str(tmp_path), timeout=60)
    for outcome in outcomes:
        assert outcome["error"] == "StateDivergenceError", outcome
        assert "'scheduler'" in outcome["message"] and "rank 1" in outcome["message"]


@pytest.mark.parametrize("world_size", [3])  # rank 2 has no VALID batch (more ranks have none at 5: same code)
def test_batchnorm_trained_under_ddp_then_ranks_without_a_batch(world_size, tmp_path):
    """DDP broadcasts buffers at the first forward after a training step; a rank
    without a VALID or TEST batch must not leave the others waiting there. Every
    rank's numbers equal one process evaluating the checkpointed model."""
    per_rank = results(run_ranks(batchnorm_train_then_eval, world_size, str(tmp_path), timeout=120))
    # one process, plain SpeechBrain, loads the checkpoint the DDP run wrote
    single = toy.build(toy.ToyBrain, tmp_path, batchnorm=True, epochs=1,
                       checkpointer_cls=sb.utils.checkpoints.Checkpointer)
    single.checkpointer.recover_if_possible()
    sets = {name: toy.make_dataset(n, seed) for name, (n, seed) in workers.BN_SETS.items()}
    single.evaluate(sets["valid"], test_loader_kwargs={"batch_size": 4})
    single.evaluate(sets["test"], test_loader_kwargs={"batch_size": 2})
    expected = single.log  # [valid as TEST stage, test]
    for out in per_rank:
        assert out["wrapped"] == "DistributedDataParallel"
        # each rank's last TRAIN forward moved its own running statistics; the stage-start
        # broadcast brought them into step, so no module is named as differing
        assert out["warnings"] == []
        records = [r for r in out["log"] if r["stage"] != "TRAIN"]
        assert [r["stage"] for r in records] == ["VALID", "TEST"]
        for got, want in zip(records, expected):
            assert got["loss"] == want["loss"], (got["loss"], want["loss"])
            assert repr(got["metrics"]) == repr(want["metrics"])
    n_valid = workers.BN_SETS["valid"][0]
    for stage, want in (("valid", single.seen.ids[:n_valid]), ("test", single.seen.ids[n_valid:])):
        assert Counter(i for out in per_rank for i in out["seen"][stage]) == Counter(want)
    idle_valid = [r for r, out in enumerate(per_rank) if not out["seen"]["valid"]]
    idle_test = [r for r, out in enumerate(per_rank) if not out["seen"]["test"]]
    # 3 ranks: rank 2 has no VALID batch, then a TEST batch; 5 ranks: idle in both
    assert idle_valid == list(range(2, world_size))
    assert idle_test == ([] if world_size == 3 else [4])


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_train_loss_is_averaged_over_every_rank_s_batches_a_dict_of_losses_too(world_size):
    """A recipe's own update_average may average a dict of TRAIN losses: each entry is
    averaged over every rank's batches, as a number is (a dict used to stop the stage
    with a TypeError); ranks whose dicts hold other keys raise the same error on every rank."""
    steps = [3, 5, 1][:world_size]
    numbers = [1.0, 2.0, 4.0][:world_size]
    dicts = [{"mse": 0.5 + rank, "total": 2.0 * (rank + 1)} for rank in range(world_size)]
    want = {key: sum(d[key] * s for d, s in zip(dicts, steps)) / sum(steps) for key in ("mse", "total")}
    for losses, expected in ((numbers, sum(n * s for n, s in zip(numbers, steps)) / sum(steps)), (dicts, want)):
        for out in results(run_ranks(workers.train_losses, world_size, losses, steps, timeout=60)):
            got = out["loss"]
            assert type(got) is type(expected)
            if isinstance(expected, dict):
                assert got.keys() == expected.keys() and all(math.isclose(got[k], expected[k]) for k in expected)
            else:
                assert math.isclose(got, expected)
    odd = dicts[:1] + [{"mse": 1.0}] + dicts[2:]
    errors = [out["error"] for out in results(run_ranks(workers.train_losses, world_size, odd, steps, timeout=60))]
    assert len(set(errors)) == 1 and "rank 1: ['mse']" in errors[0] and "rank 0: ['mse', 'total']" in errors[0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_hooks_a_recipe_assigns_after_init_are_wrapped_or_their_gap_is_an_error(world_size, tmp_path):
    """A recipe that assigns ``self.update_average`` (the worst batch loss) or wraps
    ``on_stage_end`` on the instance after the Brain was made, or assigns
    ``update_average`` in ``on_evaluate_start``: every batch still reaches ddp_eval, and
    the stage losses, metrics and accumulators equal one process's (the batches went
    unobserved, the loss 0.0 on every rank, with no error). Replaced where ddp_eval
    cannot wrap it (``on_stage_start`` in ``on_evaluate_start``, ``update_average`` in a
    batch): the same error on every rank, naming what to do. TEST has two batches: at 3
    ranks, rank 2 evaluates none."""
    for where in ("script", "on_evaluate_start"):
        want = workers.assigned_hooks(0, 0, str(tmp_path / f"single_{where}"), where)
        losses = [r["loss"] for r in want["log"]]
        assert want["test_loss"] == losses[-1] > 0 and losses[0] == losses[1] != losses[-1]  # VALID twice, lr 0
        for out in results(run_ranks(workers.assigned_hooks, world_size, str(tmp_path / where), where,
                                     timeout=120)):
            assert out == want, where
    assert want["ends"] == [] and workers.assigned_hooks(0, 0, str(tmp_path / "ends"), "script")["ends"] == [
        "TRAIN", "VALID", "TRAIN", "VALID", "TEST"]
    for where, expected in (("on_stage_start_late", "ddp_eval's on_stage_start did not run"),
                            ("in_a_batch", "update_average called 0 time(s)")):
        errors = [out["error"] for out in results(run_ranks(workers.assigned_hooks, world_size,
                                                               str(tmp_path / where), where, timeout=120))]
        assert len(set(errors)) == 1 and expected in errors[0] and "before fit() or evaluate()" in errors[0], where


def test_random_draws_in_dataloader_workers_are_named(tmp_path):
    """A TEST of two batches at 3 ranks (rank 2 has none), loaded by DataLoader
    workers: a map-style loader's worker loads other batches on a rank than in one
    process, so noise its collate_fn draws from torch's generator differs (the loss
    too): named, as drawn in DataLoader workers (it was unseen), and silenced by
    attributes_exclude; a draw from Python's ``random`` is named too; a collate_fn
    that draws nothing: one process's loss, nothing named. A stream's worker reads
    every batch on every rank: seeded alike on every rank, it draws as one process's
    (exact, nothing named); seeded apart, it is named."""
    cases = [("plain", (), None), ("noisy_collate", (), None), ("python_drawing_collate", (), None),
             ("noisy_collate", ("torch.random",), None), ("noisy_collate", (), "alike"),
             ("noisy_collate", (), "seeded apart")]
    single = workers.worker_draws(0, 0, str(tmp_path / "single"), cases[:2] + cases[4:5])
    outs = results(run_ranks(workers.worker_draws, 3, str(tmp_path / "ranks"), cases, timeout=120, fresh=True))
    plain, noisy, python, excluded, alike, apart = zip(*outs)
    assert all(out["loss"] == single[0]["loss"] for out in plain) and plain[0]["warnings"] == []
    assert all(out["loss"] != single[1]["loss"] for out in noisy)  # why it is named
    named = [w for w in noisy[0]["warnings"] if "drew from the global random" in w]
    assert len(named) == 1 and "torch.random in DataLoader workers (on rank(s) 0, 1)" in named[0]
    named = [w for w in python[0]["warnings"] if "drew from the global random" in w]
    assert len(named) == 1 and "random in DataLoader workers (on rank(s) 0, 1)" in named[0]
    assert "torch.random in" not in named[0] and excluded[0]["warnings"] == []
    assert single[2]["loss"] != single[0]["loss"]  # the stream's noise changes the loss
    assert all(out["loss"] == single[2]["loss"] for out in alike) and alike[0]["warnings"] == []
    named = [w for w in apart[0]["warnings"] if "drew from the global random" in w]
    assert len(named) == 1 and "torch.random in DataLoader workers (on rank(s) 0, 1, 2)" in named[0]
    assert apart[0]["loss"] != single[2]["loss"]  # why it is named
