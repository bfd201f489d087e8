"""Plain Brain attributes and streaming eval sets, merged exactly (real gloo groups)."""

import math
from collections import Counter

import pytest
import speechbrain as sb

from tests import toy
from tests.mp_harness import results, run_ranks
from tests.workers import (
    BestAndWorst,
    HeldProgress,
    RunningAccuracy,
    accumulating_recipe,
    builtin_extremes,
    running_accuracy,
    running_max_attribute,
    unmakeable_metric_object,
    unpicklable_last_value,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The same recipe, plain SpeechBrain, one process."""
    return toy.run_accumulating(toy.build(toy.AccumulatingBrain, tmp_path_factory.mktemp("plain"),
                                          epochs=1, checkpointer_cls=sb.utils.checkpoints.Checkpointer))


@pytest.mark.parametrize("world_size,stream", [(1, False), pytest.param(2, False, marks=pytest.mark.fast), (3, False),
                                                    (2, True), (3, True)],
                         ids=["1", "2", "3", "2-stream", "3-stream"])
def test_lists_counters_dicts_and_accumulators_equal_one_process(world_size, stream, single_process,
                                                                   tmp_path):
    per_rank = results(run_ranks(accumulating_recipe, world_size, str(tmp_path), stream, timeout=120))
    want = single_process["log"]
    for out in per_rank:
        assert [r["stage"] for r in out["log"]] == ["VALID", "TEST"]
        for got, exp in zip(out["log"], want):
            # lists in single-process order, exact counters, dict in insertion order
            for key in ("acc_metric", "valid_acc", "counters", "predictions", "confusion"):
                assert got[key] == exp[key], key
            # float accumulator: per-batch increments in global order (README bound)
            assert math.isclose(got["loss_total"], exp["loss_total"], rel_tol=1e-12)
            assert math.isclose(got["loss"], exp["loss"], rel_tol=1e-9)
    # each utterance evaluated once in the whole job, and some rank had no TEST batch
    assert Counter(i for out in per_rank for i in out["seen"]) == Counter(single_process["seen"])
    if world_size == 3:  # 4 TEST items at batch 3: 2 batches, none for rank 2
        assert not [i for i in per_rank[2]["seen"] if i.startswith("tst")]


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.fast), 3])
def test_running_extremes_kept_by_the_builtin_max_and_min_equal_one_process_unnamed(world_size, tmp_path):
    """``self.best = max(self.best, x)``, ``min``, on floats, an int and dict entries:
    a rank's first batch compares with the start value where one process compares
    another batch's, but the call only chooses which value is kept, so the merge
    replays the choice on one process's value: exact, and nothing is named."""
    single = toy.run_accumulating(toy.build(BestAndWorst, tmp_path / "plain", epochs=1,
                                            checkpointer_cls=sb.utils.checkpoints.Checkpointer))
    per_rank = results(run_ranks(builtin_extremes, world_size, str(tmp_path / "ddp"), None, timeout=120))
    want = [entry["extremes"] for entry in single["log"]]
    assert len(want) == 2 and want[0] != want[1]
    for out in per_rank:
        assert [entry["extremes"] for entry in out["log"]] == want
        assert out["warnings"] == [], out["warnings"]


@pytest.mark.parametrize("recipe,value,read", [
    (RunningAccuracy, "'running_acc'", "['n_correct', 'n_seen']"),
    (HeldProgress, "'progress'", "['progress.hits', 'progress.seen']")], ids=["brain", "held-object"])
def test_a_counter_a_float_reads_in_c_in_a_batch_is_named(recipe, value, read, tmp_path):
    """``self.running_acc = 100.0 * self.n_correct / self.n_seen`` in each batch, or
    the same in a method of an object the Brain holds: the float reads the ints where
    no probe sees, so on a rank it is computed from that rank's batches only. Not
    merged as if it were one process's: named, with what it steered; the counters
    themselves stay exact."""
    single = toy.run_accumulating(toy.build(recipe, tmp_path / "plain", epochs=1,
                                            checkpointer_cls=sb.utils.checkpoints.Checkpointer))
    per_rank = results(run_ranks(running_accuracy, 2, str(tmp_path / "ddp"), None, recipe.__name__, timeout=120))
    valid = [w for w in per_rank[0]["warnings"] if "VALID" in w]
    assert len(valid) == 1 and value in valid[0] and f"batches read {read}" in valid[0], valid
    assert per_rank[0]["log"][0]["running_acc"] != single["log"][0]["running_acc"]  # the naming matters
    assert [out["log"][0]["counters"] for out in per_rank] == [single["log"][0]["counters"]] * 2


@pytest.mark.fast
def test_a_value_computed_from_its_previous_one_is_named_in_a_warning(tmp_path):
    """A running maximum kept by an ``if`` (what it steers is not seen): each batch's
    comparison is replayed on one process's value;
    in VALID one gives another answer (a rank's first batch compares with 0.0), so it
    is named, and with it what batches did after that read (the ids of the last
    batch among them), in a warning on rank 0 only."""
    per_rank = results(run_ranks(running_max_attribute, 2, str(tmp_path), None, timeout=120))
    warnings = per_rank[0]
    assert warnings and all("sharded" in w for w in warnings), warnings
    valid = [w for w in warnings if "VALID" in w]
    assert len(valid) == 1, warnings
    assert "'best_batch_acc': a batch compared it" in valid[0] and "another answer on one process's value" in valid[0]
    assert "'last_ids'" in valid[0] and "batches read ['best_batch_acc'] when it held" in valid[0]
    assert per_rank[1] == []


def test_a_value_computed_from_its_previous_one_can_be_an_error_on_every_rank(tmp_path):
    outcomes = run_ranks(running_max_attribute, 3, str(tmp_path), {"on_unmergeable_attribute": "error"}, timeout=120)
    for outcome in outcomes:
        assert outcome.get("error") == "ConfigError", outcome
        assert "'best_batch_acc'" in outcome["message"]


def test_excluded_attribute_stays_rank_local_without_warning(tmp_path):
    per_rank = results(run_ranks(running_max_attribute, 2, str(tmp_path),
                                 {"attributes_exclude": ["best_batch_acc"]}, timeout=120))
    assert per_rank == [[], []]


def test_a_last_value_that_cannot_be_sent_is_an_error_on_every_rank(tmp_path):
    outcomes = run_ranks(unpicklable_last_value, 2, str(tmp_path), timeout=120)
    for outcome in outcomes:
        assert outcome.get("error") == "ConfigError", outcome
        assert "'last_hook'" in outcome["message"] and "cannot be sent" in outcome["message"]


def test_a_metric_object_no_rank_can_make_is_an_error_on_every_rank_at_once(tmp_path):
    """Rank 2 evaluates no TEST batch (4 items at batch 3), so it lacks the
    ErrorRateStats(split_tokens=True) the others created: every rank raises, not
    only rank 2 while the others wait in the loss all_reduce."""
    outcomes = results(run_ranks(unmakeable_metric_object, 3, str(tmp_path), timeout=90))
    for outcome in outcomes:
        assert outcome["error"] == "ConfigError", outcome
        assert "metric object 'per_label[l" in outcome["message"] and "defaultdict" in outcome["message"]
        assert outcome["seconds"] < 30, outcome
