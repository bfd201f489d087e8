"""An interrupted TEST resumes from its journal, with any number of ranks, exactly
as one uninterrupted plain SpeechBrain process (real gloo groups).

Here an exception raised in the evaluation loop stands in for the preemption
(every rank stops, the journal stays); test_resume_kill.py SIGKILLs torchrun.
"""

import math
from collections import Counter

import pytest

from ddp_eval.inspect import describe_folder, format_report
from tests import workers
from tests.mp_harness import results, run_ranks

pytestmark = pytest.mark.timeout(240)
TOTAL_BATCHES = 12  # workers.TEST_SET at batch size 2


def assert_as_one_process(out, reference):
    """Loss, every metric summary and write_stats text, and the plain attributes."""
    log, want = out["log"], reference["log"]
    assert out["loss"] == reference["loss"]  # bit for bit
    assert repr(log["metrics"]) == repr(want["metrics"])  # summaries, write_stats text, id order
    for key in ("acc_metric", "valid_acc", "counters", "predictions", "confusion"):
        assert log[key] == want[key], key
    assert math.isclose(log["loss_total"], want["loss_total"], rel_tol=1e-12)


def interrupt(directory, world_size, after, batch_size=2, stream=False):
    """Every rank evaluates ``after`` batches, then all stop: the journal holds them.
    The interrupted run had fit() first (the resumed ones do not)."""
    outcomes = results(run_ranks(workers.resumable_test, world_size, directory, after, batch_size, stream, None,
                                 True, timeout=120))
    assert {o.get("error") for o in outcomes} <= {"Interrupted", "RankFailedError"}
    return outcomes


@pytest.mark.parametrize("before,after,stream", [pytest.param(2, 3, False, marks=pytest.mark.fast),
                                                          (3, 1, False), (2, 3, True)],
                         ids=["2-then-3", "3-then-1", "stream-2-then-3"])
def test_interrupted_test_resumes_with_another_world_size_exactly(before, after, stream, tmp_path):
    workers.save_test_checkpoint(tmp_path)
    reference = workers.plain_test(tmp_path, stream=stream)
    first = interrupt(str(tmp_path), before, 2, stream=stream)
    journaled = sum(min(2, o["batches"]) for o in first)  # batches finished before the stop
    resumed = results(run_ranks(workers.resumable_test, after, str(tmp_path), None, 2, stream, timeout=120))
    for out in resumed:
        assert_as_one_process(out, reference)
    # only the missing batches were evaluated, each utterance once in all
    assert sum(o["batches"] for o in resumed) == TOTAL_BATCHES - journaled
    every_utterance = [utt for utt, _ in reference["log"]["predictions"]]
    evaluated = [i for o in first + resumed for i in o["ids"]]
    assert Counter(evaluated) == Counter(every_utterance)
    assert f"resuming TEST from its journal: {journaled} of {TOTAL_BATCHES if not stream else '?'} batches done" \
        in " ".join(resumed[0]["notes"])
    assert not list((tmp_path / ".ddp_eval-journal").rglob("piece-*"))  # removed once on_stage_end ran


def test_journal_of_another_checkpoint_is_ignored_with_the_reason(tmp_path):
    workers.save_test_checkpoint(tmp_path, loss=2.0)
    interrupt(str(tmp_path), 2, 2)
    workers.save_test_checkpoint(tmp_path, shift=0.5, loss=1.0)  # a better checkpoint: min_key picks it
    reference = workers.plain_test(tmp_path)
    out = results(run_ranks(workers.resumable_test, 2, str(tmp_path), timeout=120))
    for rank_out in out:
        assert_as_one_process(rank_out, reference)
    assert sum(o["batches"] for o in out) == TOTAL_BATCHES  # nothing resumed
    notes = " ".join(out[0]["notes"])
    assert "not resuming TEST from 4 journal piece(s)" in notes and "written with another model" in notes
    assert list((tmp_path / ".ddp_eval-journal").rglob("piece-*"))  # left for the user


def test_journal_of_another_batch_size_is_ignored_with_the_reason(tmp_path):
    workers.save_test_checkpoint(tmp_path)
    interrupt(str(tmp_path), 2, 2)
    reference = workers.plain_test(tmp_path, batch_size=3)
    out = results(run_ranks(workers.resumable_test, 2, str(tmp_path), None, 3, timeout=120))
    for rank_out in out:
        assert_as_one_process(rank_out, reference)
    notes = " ".join(out[0]["notes"])
    assert "not resuming TEST from journal" in notes and "its data differ (12 batches" in notes
    assert "now 8 batches" in notes


def test_truncated_piece_is_skipped_and_its_batches_evaluated_again(tmp_path):
    workers.save_test_checkpoint(tmp_path)
    reference = workers.plain_test(tmp_path)
    interrupt(str(tmp_path), 2, 2)
    pieces = sorted((tmp_path / ".ddp_eval-journal").rglob("piece-*.pkl"))
    assert len(pieces) == 4
    pieces[0].write_bytes(pieces[0].read_bytes()[:100])
    shown = format_report(describe_folder(tmp_path))  # what python -m ddp_eval.inspect prints
    assert f"evaluation journal {pieces[0].parent.name}: TEST, epoch None, 4 piece(s); model " in shown
    assert "3 of 12 batches done" in shown and f"damaged: {pieces[0].name}" in shown
    out = results(run_ranks(workers.resumable_test, 2, str(tmp_path), timeout=120))
    for rank_out in out:
        assert_as_one_process(rank_out, reference)
    assert sum(o["batches"] for o in out) == TOTAL_BATCHES - 3
    assert f"skipping damaged journal piece {pieces[0]}" in " ".join(out[0]["notes"])


@pytest.mark.fast
def test_a_journal_that_cannot_be_written_leaves_the_evaluation_exact(tmp_path):
    """One process; resume_eval_dir below a file: every piece fails to be written."""
    workers.save_test_checkpoint(tmp_path)
    reference = workers.plain_test(tmp_path)
    (tmp_path / "a-file").write_text("")
    out = workers.resumable_test(0, 1, str(tmp_path), opts={"resume_eval_dir": str(tmp_path / "a-file" / "j")})
    assert_as_one_process(out, reference)
    failed = [n for n in out["notes"] if "could not write its evaluation journal" in n]
    assert len(failed) == 1 and "stops journaling this stage" in failed[0]


@pytest.mark.fast
def test_one_process_leaves_a_shuffled_loader_alone(tmp_path):
    """Sharding into one share only serves the journal: a shuffled TEST loader is not refused."""
    workers.save_test_checkpoint(tmp_path)
    cls = type("Converted", (workers.ddp_eval.DDPEvalMixin, workers.toy.FullBrain), {})
    brain = workers.toy.build(cls, str(tmp_path), epochs=1)
    brain.evaluate(workers.toy.make_dataset(*workers.TEST_SET), min_key="loss",
                   test_loader_kwargs={"batch_size": 2, "shuffle": True})
    assert len(brain.seen.ids) == workers.TEST_SET[0]


def test_the_stage_loss_is_one_process_running_average_bit_for_bit(tmp_path):
    """TEST sets of 97, 53 and 31 one-utterance batches with losses over seven orders
    of magnitude and one non-finite: at 2 and 3 ranks, the stage loss that
    evaluate() returns and on_stage_end sees equals plain SpeechBrain's running
    average in one process bit for bit (a global sum over a global count differs
    in the last bits); and so does a TEST interrupted at 2 ranks, resumed at 3
    (issue 37)."""
    sizes = [97, 53, 31]
    want = workers.uneven_test_losses(0, 0, str(tmp_path / "single"), sizes)["losses"]
    assert len(set(want)) == 3 and all(math.isfinite(loss) for loss in want)
    for world_size in (2, 3):
        for out in results(run_ranks(workers.uneven_test_losses, world_size, str(tmp_path / f"ws{world_size}"),
                                     sizes, timeout=120)):
            assert out["losses"] == want, (world_size, out["losses"], want)
    folder = str(tmp_path / "resumed")
    first = results(run_ranks(workers.uneven_test_losses, 2, folder, [97], 20, timeout=120))
    assert {out["error"] for out in first} <= {"Interrupted", "RankFailedError"}
    for out in results(run_ranks(workers.uneven_test_losses, 3, folder, [97], timeout=120)):
        assert out["losses"] == want[:1]


def test_what_only_the_interrupted_run_did_is_named_after_the_resume(tmp_path):
    """The interrupted run's batches (journaled) read ``len(self.first)`` before
    extending it and sorted ``ranked`` in place; the resumed run's batches do
    neither. Both are named after the resume, as in a run without interruption
    (the journal pieces carry what no merge replays); the rest stays exact."""
    workers.save_test_checkpoint(tmp_path)
    reference = workers.plain_test(tmp_path)
    cls = workers.ReadsBeforeTheInterruption
    first = results(run_ranks(workers.resumable_test, 2, str(tmp_path), 2, 2, False, None, True, cls, timeout=120))
    assert {o.get("error") for o in first} <= {"Interrupted", "RankFailedError"}
    resumed = results(run_ranks(workers.resumable_test, 3, str(tmp_path), None, 2, False, None, False, cls,
                                timeout=120))
    for out in resumed:
        assert_as_one_process(out, reference)
    notes = " ".join(resumed[0]["notes"])
    resumes = "(in a batch of the interrupted run this stage resumes)"
    assert "then called extend() on it" in notes and "'first': a batch read this list's accumulated entries" in notes
    assert "'ranked': a batch changed it in place by sort()" in notes
    assert notes.count(resumes) == 2, notes
    assert "batches read ['first'] when it held, on their rank, another value" in notes, notes
