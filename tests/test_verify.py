"""``ddp_eval: {verify: ...}`` (issue 26): a converted recipe proves itself on its own
data. Each rank evaluates the verified stage again as one process would and compares
what on_stage_end sees; at 2 ranks."""

import pathlib
import tempfile
import time

import pytest

from ddp_eval.stage._verify import first_difference
from tests import patterns, workers
from tests.mp_harness import results, run_ranks
from tests.test_recipe_patterns import assert_records_equal, evaluation_records

pytestmark = pytest.mark.timeout(300)


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [2])  # 3 ranks with an idle one: the same code (test_recipe_patterns)
def test_an_exact_recipe_verifies_clean_and_keeps_its_results(world_size, tmp_path):
    scratch = set(pathlib.Path(tempfile.gettempdir()).glob("ddp_eval-verify-*"))
    want = patterns.single_process(tmp_path / "single", "containers")
    outs = results(run_ranks(patterns.verify_worker, world_size, str(tmp_path / "ranks"), "containers", "first",
                             timeout=240))
    for out in outs:  # the reference pass leaves what on_stage_end sees as it was
        assert_records_equal(evaluation_records(out), evaluation_records(want))
    said = outs[0]["verification"]
    # first: the first VALID (of 2 epochs) and the first TEST only
    assert [m.split(":")[1].strip() if ":" in m else m for m in said] == ["VALID verified", "TEST verified"], said
    assert all("values equal one process" in m for m in said)
    assert all(out["verification"] == [] for out in outs[1:])  # rank 0 says it
    assert set(pathlib.Path(tempfile.gettempdir()).glob("ddp_eval-verify-*")) == scratch  # scratch files removed


def test_what_cannot_be_made_exact_is_named_by_verify(tmp_path):
    """BEST-RQ's accuracy appended under if_main_process() holds rank 0's batches only:
    verify names the attribute and both values."""
    outs = results(run_ranks(patterns.verify_worker, 2, str(tmp_path), "files", "every", timeout=240))
    said = [m for m in outs[0]["verification"] if "differ from one process" in m]
    assert said and all("main_acc: on_stage_end would see" in m and "one process 8 entries" in m
                        for m in said[:2]), outs[0]["verification"]
    assert len(said) == 3  # every: VALID of both epochs and TEST


@pytest.mark.fast
def test_strict_fails_on_every_rank_within_seconds(tmp_path):
    start = time.monotonic()
    outs = results(run_ranks(patterns.verify_worker, 2, str(tmp_path), "files", "strict", timeout=240))
    assert [out["error"] for out in outs] == ["VerificationError", "VerificationError"]
    assert all("VALID verification" in out["message"] and "main_acc" in out["message"] for out in outs)
    assert time.monotonic() - start < 120


def test_first_difference_names_the_path_and_both_values():
    assert first_difference({"a": [1, {"b": 2.0}]}, {"a": [1, {"b": 2.5}]}) == ("['a'][1]['b']", "2.0", "2.5")
    assert first_difference([1], [1, 2])[0] == ""
    assert first_difference(float("nan"), float("nan")) is None


@pytest.mark.fast
def test_first_difference_reads_a_namespace_field_by_field():
    """A ``SimpleNamespace`` keeps its state in ``__dict__`` (its reduce is C's): its
    fields are compared one by one, so two holding equal metric objects are equal
    (before: compared with ``==``, by the metric objects' identity), and a difference
    names its field."""
    import types

    from speechbrain.utils.metric_stats import ErrorRateStats

    def tracked(n, hyp):
        wer = ErrorRateStats()
        wer.append(["u1"], [["a"]], [[hyp]])
        return types.SimpleNamespace(wer=wer, n=n)

    assert first_difference(tracked(1, "a"), tracked(1, "a"), "t") is None
    assert first_difference(tracked(1, "a"), tracked(2, "a"), "t") == ("t['n']", "1", "2")
    assert first_difference(tracked(1, "a"), tracked(1, "b"), "t")[0].startswith("t['wer']")


class Slotted:
    __slots__ = ("n",)

    def __init__(self, n):
        self.n = n


@pytest.mark.fast
def test_first_difference_compares_what_the_engine_reads_by_digest_and_reports_what_it_cannot():
    """Issue 37: a stream, a random generator and a class with ``__slots__`` keep no state
    in ``__dict__``: they are compared by what they hold and pickle to; a generator
    cannot be compared and is reported, never taken as equal."""
    import io
    import random

    log, other = io.StringIO(), io.StringIO()
    log.write("utt1 yes\n")
    other.write("utt1 no\n")
    assert first_difference(log, other, "log") == ("log", "'utt1 yes\\n'", "'utt1 no\\n'")
    same = io.StringIO()
    same.write("utt1 yes\n")
    assert first_difference(log, same, "log") is None
    drawn = random.Random(0)
    drawn.random()
    assert first_difference(drawn, random.Random(0), "rng") is not None
    assert first_difference(Slotted(1), Slotted(2), "s") is not None
    assert first_difference(Slotted(1), Slotted(1)) is None
    uncompared = []
    assert first_difference((i for i in range(3)), (i for i in range(3)), "gen", uncompared) is None
    assert uncompared and uncompared[0][0] == "gen" and "cannot be compared" in uncompared[0][1]


def test_first_difference_compares_what_a_function_keeps_and_reports_a_shared_closure():
    """A closure's counter and a partial's bound list are compared by what they hold;
    the same closure on both sides (``copy.deepcopy`` keeps a function as it is, so
    the one-process pass shares it) is reported as not compared; plain code is equal."""
    import functools

    from tests.generated_programs import closure_counter

    counted, fresh = closure_counter(), closure_counter()
    counted(1.5)
    assert first_difference(counted, fresh, "count") == ("count (captured)[0][0]", "1.5", "0.0")
    assert first_difference(functools.partial(max, [1]), functools.partial(max, [2]), "p") is not None
    assert first_difference(functools.partial(max, [1]), functools.partial(max, [1]), "p") is None
    uncompared = []
    assert first_difference(counted, counted, "count", uncompared) is None
    assert [path for path, _ in uncompared] == ["count"] and "shares" in uncompared[0][1]
    assert first_difference(len, len, "len", uncompared) is None and len(uncompared) == 1


def test_verify_does_not_change_training(tmp_path):
    """A scheduler stepped in compute_objectives (state outside the Brain) is put back
    after the reference pass: every stage's learning rate and scheduler count, on every
    rank, are those of the same run without verify (the pass used to step it twice)."""
    plain = results(run_ranks(workers.cyclic_scheduler_recipe, 2, str(tmp_path / "off"), "off", timeout=240))
    verified = results(run_ranks(workers.cyclic_scheduler_recipe, 2, str(tmp_path / "on"), "every", timeout=240))
    assert verified == plain
    assert len({count for _, _, count in plain[0]}) > 3  # the scheduler did step, stage after stage


def test_a_recipe_s_own_update_average_verifies_clean(tmp_path):
    """The reference pass averages the stage loss as the recipe does (its own
    update_average over a dict of losses, own_average), so an exact run verifies clean."""
    want = patterns.single_process(tmp_path / "single", "own_average")
    outs = results(run_ranks(patterns.verify_worker, 2, str(tmp_path / "ranks"), "own_average", "first",
                             timeout=240))
    for out in outs:
        assert out["test_loss"] == want["test_loss"]
    said = outs[0]["verification"]
    assert len(said) == 2 and all("verified" in m and "values equal one process" in m for m in said), said
