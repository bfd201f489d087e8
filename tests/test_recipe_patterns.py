"""The evaluation-time patterns of SpeechBrain's own recipes (issue 20), written
as the recipes write them (tests/patterns.py), against plain SpeechBrain in one
process, at 2 and 3 ranks (at 3, rank 2 evaluates no TEST batch): exact, or
named in a warning with the remedy."""

import json
import math
import re

import pytest
import speechbrain as sb

from tests import patterns
from tests.mp_harness import results, run_ranks

pytestmark = pytest.mark.timeout(400)
EXACT = ("last_values", "containers", "arrays", "loaders", "ordinary_code", "idioms", "training_only", "steps",
         "seeded_draws")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {p: patterns.single_process(tmp_path_factory.mktemp(p), p) for p in patterns.PATTERNS}


@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.fast), 3])
def ranks(request, tmp_path_factory):
    """Every pattern on ``params`` ranks, in one process group."""
    folder = tmp_path_factory.mktemp(f"ranks{request.param}")
    outs = results(run_ranks(patterns.ranks_worker, request.param, str(folder), patterns.PATTERNS,
                             {"collective_timeout": 60, "merge": {"best_score": "max"}}, timeout=360))
    return request.param, outs


def evaluation_records(out):
    return [r for r in out["log"] if r["stage"] != "TRAIN"]


def assert_records_equal(got, want, skip=()):
    assert [r["stage"] for r in got] == [r["stage"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == w["loss"]  # bit for bit
        for key in set(w) - {"loss"} - set(skip):
            assert repr(g[key]) == repr(w[key]), (g["stage"], key)


@pytest.mark.parametrize("pattern", EXACT)
def test_exact_patterns_equal_one_process_on_every_rank(pattern, ranks, references):
    world_size, outs = ranks
    want = references[pattern]
    for out in (o[pattern] for o in outs):
        assert_records_equal(evaluation_records(out), evaluation_records(want))
        assert math.isclose(out["test_loss"], want["test_loss"], rel_tol=1e-9)
        # the checkpoint chosen by min_key from the meta (HiFi-GAN: the last batch's loss stats)
        assert out["loaded_meta"].keys() == want["loaded_meta"].keys()
        assert out["loaded_meta"]["epoch"] == want["loaded_meta"]["epoch"]
    for stage in ("valid", "test"):  # each utterance evaluated as often as in one process
        assert sorted(i for o in outs for i in o[pattern]["seen"][stage]) == sorted(want["seen"][stage])


def test_values_assigned_per_batch_are_the_last_batch_ones(ranks, references):
    world_size, outs = ranks
    want = {r["stage"]: r for r in evaluation_records(references["last_values"])}
    for out in outs:
        got = {r["stage"]: r for r in evaluation_records(out["last_values"])}
        for stage in ("VALID", "TEST"):
            assert got[stage]["last_ids"] == want[stage]["last_ids"]  # self.last_batch: the global last
            assert got[stage]["last_attn"] == want[stage]["last_attn"]  # a tensor bound anew every batch
            assert got[stage]["last_loss"] == want[stage]["last_loss"]  # a number set every batch
            assert got[stage]["n_batches"] == want[stage]["n_batches"]  # a counter (+=)
            assert got[stage]["per_class"] == want[stage]["per_class"]  # defaultdict(int)
            assert got[stage]["per_label"] == want[stage]["per_label"]  # Counter
    warnings = " ".join(outs[0]["last_values"]["warnings"])
    assert "'last_loss_stats[<Stage.VALID: 2>]'" not in warnings  # told, not assumed: several batches per rank


def test_metric_containers_created_lazily_are_merged_in_creation_order(ranks, references):
    world_size, outs = ranks
    want = evaluation_records(references["containers"])
    for out in outs:
        for got, expected in zip(evaluation_records(out["containers"]), want):
            assert got["methods"] == ["1best", "rescored"] == expected["methods"]
            assert got["group_order"] == expected["group_order"]  # a plain dict filled lazily
            assert got["wer_stats"] == expected["wer_stats"]
            assert got["bleu_targets"] == expected["bleu_targets"]  # one growing list per reference
            # two levels down, in an object of the recipe's own, in hparams (before: named, each rank its own)
            assert got["held_deeper"] == expected["held_deeper"] and len(expected["held_deeper"][0][1]) > 1
        assert out["containers"]["warnings"] == []


def test_numpy_arrays_changed_in_place_are_merged(ranks, references):
    world_size, outs = ranks
    for out in outs:
        for got, want in zip(evaluation_records(out["arrays"]), evaluation_records(references["arrays"])):
            assert got["confusion"] == want["confusion"] and got["dtype"] == want["dtype"]  # ints: exact
            assert got["prob_sum"] == pytest.approx(want["prob_sum"], rel=1e-12)  # floats: as float tensors
        assert out["arrays"]["warnings"] == []


def test_ordinary_code_outside_the_recipe_patterns_is_exact(ranks, references):
    """Issue 26: a pre-sized list changed in place, a MetricStats subclass with a dict of
    lists and a nested list, values rebuilt from their previous one (tensors, arrays,
    lists), an attribute set to None and assigned per batch: one process's values on
    every rank (exact_patterns compares every field); named only what cannot be told
    (issue 37): a value bound once over None by each rank's one batch."""
    world_size, outs = ranks
    want = evaluation_records(references["ordinary_code"])
    assert want[-1]["hist"] != [0] * len(want[-1]["hist"])  # the patterns ran
    for out in outs:
        for got, expected in zip(evaluation_records(out["ordinary_code"]), want):
            assert got["spk"] == expected["spk"] and got["targets"] == expected["targets"]
            assert got["all_preds"] == expected["all_preds"] and got["hist"] == expected["hist"]
            assert got["logit_sum"] == expected["logit_sum"]  # x = x + y replayed in order: bit for bit
            assert got["last_loss"] == expected["last_loss"]  # bound over None: the last batch's
            # ids = ids + [...]: also where a rank's one TEST batch extends the empty list (its probe)
            assert got["order"] == expected["order"]
        # TEST has 2 batches: each rank that evaluates one binds last_loss once over None, which cannot be told
        # from a lazy accumulator (if x is None: x = 0.0; x += ...): the last batch's value, named as assumed
        assert only_bound_once_over_none(out["ordinary_code"]["warnings"], "last_loss"), out["ordinary_code"]
    assert outs[0]["ordinary_code"]["warnings"]  # rank 0 warns


def test_per_batch_file_through_stage_output_equals_one_process(ranks, references):
    world_size, outs = ranks
    want = references["files"]["predictions"]
    assert outs[0]["files"]["predictions"] == want  # rank 0 appended every rank's part in batch order
    assert len(want.splitlines()) == 4 and json.loads(want.splitlines()[0])["file"].startswith("tst")
    for out in outs:
        assert out["files"]["leftovers"] == []  # the parts are removed


def test_appends_without_the_helper_and_main_process_only_effects_are_named(ranks):
    world_size, outs = ranks
    warnings = outs[0]["files"]["warnings"]
    appended = [w for w in warnings if "eder.txt" in w]
    assert appended and all("self.stage_output(path)" in w for w in appended)
    main_only = [w for w in warnings if "['main_acc']" in w]
    assert main_only and "if_main_process" in main_only[0] and "VALID" in main_only[0]
    assert all(out["files"]["warnings"] == [] for out in outs[1:])  # rank 0 warns


def test_a_training_only_module_that_differs_across_ranks_is_not_named(ranks):
    """TIMIT seq2seq's ``speed_perturb`` in hparams: random, called in TRAIN only, so
    its state differs across ranks after TRAIN; VALID and TEST never call it, every
    value equals one process (EXACT), and no warning says otherwise (issue 38)."""
    world_size, outs = ranks
    assert len({out["training_only"]["speed_perturb"] for out in outs}) > 1  # it did differ: the check is real
    for out in outs:
        assert out["training_only"]["warnings"] == []


def test_a_module_learning_statistics_through_hparams_is_named(ranks):
    world_size, outs = ranks
    warnings = outs[0]["modules"]["warnings"]
    named = [w for w in warnings if "'hparams.input_norm'" in w]
    assert named and "modules differ across ranks" in named[0] and "eval mode" in named[0]

    # TEST in eval mode: unchanged by the stage, but apart since TRAIN (a model per rank): named too
    test = [w for w in named if "sharded TEST stage" in w]
    assert test and "differed across ranks when the stage started" in test[0], named
    differed = re.search(r"against rank 0: ([^)]*)\)", test[0])  # what differed: its statistics, by name
    assert differed and {"'glob_mean'", "'glob_std'"} <= set(differed.group(1).split(", ")), test
    assert not [w for w in warnings if "state outside the Brain" in w]  # said once, as a module


DEBUG = {"debug": True, "debug_batches": 2, "debug_epochs": 1}


@pytest.mark.fast
def test_a_debug_run_evaluates_the_global_batches_one_process_would(tmp_path):
    """--debug stops each loop after debug_batches: under sharding, counted in
    global batches, for loaders the mixin made and loaders the recipe built."""
    shown = ("last_values", "loaders")
    want = {p: patterns.single_process(tmp_path / f"single-{p}", p, run_opts=DEBUG) for p in shown}
    outs = results(run_ranks(patterns.ranks_worker, 2, str(tmp_path / "ranks"), shown, None, DEBUG, timeout=200))
    for pattern in shown:
        assert len(want[pattern]["seen"]["valid"]) == 2 * 3  # 2 batches of 3
        for stage in ("valid", "test"):
            assert sorted(i for o in outs for i in o[pattern]["seen"][stage]) == sorted(want[pattern]["seen"][stage])
        for out in outs:
            assert_records_equal(evaluation_records(out[pattern]), evaluation_records(want[pattern]))


def test_the_batch_count_speechbrain_keeps_is_one_process_s_and_names_nothing(ranks, references):
    """``self.step`` in each VALID/TEST batch is one process's count (not the rank's own),
    so what it steers is exact; at TEST's on_stage_end it is the stage's count, also on
    a rank with no TEST batch; with loaders the mixin made and loaders the recipe
    built (a LoopedLoader, sharded as a stream)."""
    world_size, outs = ranks
    want = evaluation_records(references["steps"])
    assert [r["steps_seen"] for r in want] == [[1, 2, 3, 4, 5, 6, 7, 8]] * 2 + [[1, 2]]  # 8 VALID, 2 TEST batches
    assert [r["step_at_end"] for r in want] == [0, 0, 2]  # fit() sets 0 before VALID's end; evaluate() leaves it
    for out in outs:
        assert out["steps"]["warnings"] == []
        assert_records_equal(evaluation_records(out["steps"]), want)
        got, loops = evaluation_records(out["loaders"]), evaluation_records(references["loaders"])
        assert [(r["loader_steps"], r["step_at_end"]) for r in got] == [
            (r["loader_steps"], r["step_at_end"]) for r in loops]


def test_draws_from_the_global_random_generators_are_named_and_draws_seeded_by_the_batch_are_exact(ranks,
                                                                                                   references):
    """Masks drawn in evaluation from torch's, Python's and NumPy's global generators:
    on a rank from another state than one process's at that batch, so the values
    differ; named on every stage, with the ranks that drew (not rank 2 at 3 ranks,
    which has no TEST batch). Drawn from generators seeded by the batch: exact
    (test_exact_patterns...), nothing named."""
    world_size, outs = ranks
    warned = [w for w in outs[0]["random_draws"]["warnings"] if "drew from the global random" in w]
    assert [re.search(r"sharded (\w+) stage", w)[1] for w in warned] == ["VALID", "VALID", "TEST"]
    every = ", ".join(map(str, range(world_size)))
    for w in warned[:2]:
        assert f"torch.random (on rank(s) {every})" in w and f"random (on rank(s) {every})" in w
        assert f"numpy.random (on rank(s) {every})" in w
    assert "torch.random (on rank(s) 0, 1)" in warned[2]  # at 3 ranks, rank 2 evaluated no TEST batch
    got, want = evaluation_records(outs[0]["random_draws"]), evaluation_records(references["random_draws"])
    assert [r["noise"] for r in got] != [r["noise"] for r in want]  # why it is named
    assert all(out["seeded_draws"]["warnings"] == [] for out in outs)


def test_a_recipe_s_own_update_average_gives_one_process_s_stage_loss(ranks, references):
    """A recipe whose update_average (without super()) averages a dict of losses: every
    batch still reaches ddp_eval, and the stage loss on_stage_end sees and evaluate()
    returns is one process's, bit for bit, also on a rank with no TEST batch (was 0.0
    on every rank, with no warning: the per-batch hook never ran); its TRAIN dict is
    averaged over every rank's batches, the same on every rank (was a TypeError)."""
    world_size, outs = ranks
    want = references["own_average"]
    assert isinstance(want["test_loss"], dict) and want["test_loss"]["loss"] > 0
    train = [[r["loss"] for r in out["own_average"]["log"] if r["stage"] == "TRAIN"] for out in outs]
    assert all(t == train[0] and isinstance(t[-1], dict) and t[-1].keys() == {"loss", "half"} for t in train)
    for out in outs:
        got = out["own_average"]
        assert got["test_loss"] == want["test_loss"]
        assert_records_equal(evaluation_records(got), evaluation_records(want))
        assert got["warnings"] == []


@pytest.mark.parametrize("pattern", ["files", "last_values", "steps", "own_average"])
def test_a_resumed_stage_keeps_what_its_journal_holds(pattern, tmp_path):
    """TEST (9 utterances, 5 batches) interrupted after one batch per rank at 2
    ranks, resumed at 3: the per-batch file and the last batch's values equal one
    process."""
    want = patterns.single_process(tmp_path / "single", pattern, n_test=9)
    folder = str(tmp_path / "ranks")
    first = results(run_ranks(patterns.interrupted_worker, 2, folder, pattern, True, 1, 9, timeout=200))
    assert {out["error"] for out in first} <= {"Interrupted", "RankFailedError"}
    # restarted as a recipe is: fit (the checkpoint's epochs are done: nothing to train), then TEST
    resumed = results(run_ranks(patterns.interrupted_worker, 3, folder, pattern, True, None, 9, timeout=200))
    assert len([i for o in resumed for i in o["seen"]["test"]]) < 9  # only what the journal lacked
    for out in resumed:
        test = evaluation_records(out)[-1]
        expected = evaluation_records(want)[-1]
        assert test["stage"] == "TEST"
        if pattern == "own_average":  # the recipe's own average, replayed over every batch: bit for bit
            assert test["loss"] == expected["loss"]
        else:
            assert math.isclose(test["loss"], expected["loss"], rel_tol=1e-9)
        # main_acc: main-process-only, named (above); stats: its VALID entry is not
        # checkpointed (HiFi-GAN's neither), and a restart trains no more epochs
        for key in set(expected) - {"loss", "main_acc", "stats"}:
            assert repr(test[key]) == repr(expected[key]), key
        if pattern == "last_values":
            assert test["stats"][sb.Stage.TEST] == expected["stats"][sb.Stage.TEST]
    if pattern == "files":
        assert resumed[0]["predictions"] == want["predictions"]
        assert len(want["predictions"].splitlines()) == 9


@pytest.mark.fast
def test_an_ordinary_recipe_warns_about_nothing(tmp_path):
    """Metric objects of every type, lists, counters, dicts and tensors, fit then
    TEST with a rank that gets no TEST batch: nothing to name."""
    assert results(run_ranks(patterns.ordinary_recipe, 3, str(tmp_path), timeout=200)) == [[], [], []]


def only_bound_once_over_none(warnings, label):
    """Whether ``warnings`` are at most the one issue 37 asks for where every rank evaluated
    one TEST batch: ``label``, bound once over None by each, taken as set (=) and named."""
    return len(warnings) <= 1 and all("sharded TEST" in w and f"'{label}': it did not exist (or held None)" in w
                                      for w in warnings)


def test_idioms_name_nothing(ranks):
    """Issue 32: the idioms recipes write merge exactly (test_exact_patterns...) and warn about nothing
    but ``last_ids = list(batch.id)`` over None at TEST, 2 batches: one per rank cannot tell = from a lazy
    accumulator (issue 37)."""
    world_size, outs = ranks
    for out in outs:
        assert only_bound_once_over_none(out["idioms"]["warnings"], "last_ids"), out["idioms"]["warnings"]


def test_code_whose_order_one_process_alone_knows_is_named(ranks, references):
    """Issue 32: a list sorted after each append, a deque of recent ids and a count read from
    accumulated state: each named on every rank where it differs, with the idiom that merges."""
    world_size, outs = ranks
    warnings = " ".join(outs[0]["unmergeable_code"]["warnings"])
    assert "'sorted_scores': a batch" in warnings and "sort()" in warnings, warnings
    assert "'recent': a batch called extend() on this deque" in warnings
    assert "'n_scores': a batch (on rank" in warnings and "set it after reading [" in warnings
    read = re.search(r"'n_scores': a batch \(on rank \d\) set it after reading \[([^]]*)\]", warnings).group(1)
    assert "'sorted_scores'" in read and "'first_ids'" in read  # the reads of its batch (first_ids: after the set)
    assert "'first_ids': a batch read this list's accumulated entries" in warnings and "append()" in warnings
    want = evaluation_records(references["unmergeable_code"])
    got = evaluation_records(outs[0]["unmergeable_code"])
    assert any(g[k] != w[k] for g, w in zip(got, want) for k in ("sorted", "recent", "n_scores"))  # named, not merged
    assert any(g["first_ids"] != w["first_ids"] for g, w in zip(got, want))  # the read steered: no merge is right
    # issue 37: a metric object's lists sorted and cut, inserted into, trimmed, or appended after a read
    for field in ("hardest.ids", "hardest.scores", "newest.ids", "trimmed.ids", "first_five.ids"):
        assert f"'{field}'" in warnings, (field, warnings)
    assert "insert()" in warnings and "then bound a new value to it" in warnings
    assert all(any(g[k] != w[k] for g, w in zip(got, want)) for k in ("hardest", "newest", "trimmed", "first_five"))
    # a count three subscripts down, set on several ranks: named (before, one rank's count, unnamed), and so is
    # what its reads steered
    assert "'per_stage[" in warnings and "not watch one by one" in warnings, warnings
    assert "'early'" in warnings, warnings
    assert any(g["deep_n"] != w["deep_n"] for g, w in zip(got, want)) and any(
        g["early"] != w["early"] for g, w in zip(got, want))
    # a count beside a metric object in one dict: the metric object merges, the count is named (before: each
    # rank's own count, unnamed)
    assert "'wer_and_count': it holds metric objects" in warnings and "attribute of its own" in warnings, warnings
    assert [g["beside_err"] for g in got] == [w["beside_err"] for w in want]
    assert any(g["beside_n"] != w["beside_n"] for g, w in zip(got, want))


def test_a_value_a_batch_computed_from_state_outside_the_brain_is_named_with_it(ranks, references):
    """A count kept in an object of hparams (not listed) steers what batches append to a
    Brain list: the list holds each rank's answer, so it is named with the outside state."""
    world_size, outs = ranks
    warnings = " ".join(outs[0]["outside_reads"]["warnings"])
    assert "'hparams.tally.inner'" in warnings and "state outside the Brain" in warnings, warnings
    assert "'odd_ids'" in warnings and "state outside the Brain ['hparams.tally.inner'] changed" in warnings, warnings
    want = evaluation_records(references["outside_reads"])
    assert any(g["odd_ids"] != w["odd_ids"] for g, w in zip(evaluation_records(outs[0]["outside_reads"]), want))


def test_a_container_a_closure_also_holds_is_merged_and_its_reads_there_are_named(ranks, references):
    """A Brain list a closure also holds: what batches append through the closure is
    merged exactly (the closure holds the list's recording copy for the stage), and a
    read of its length through an object only a closure holds or through a dict of
    ``hparams``, which steers an append, is seen and named. After the stage each place
    holds the merged list itself."""
    world_size, outs = ranks
    want = evaluation_records(references["held_outside"])
    assert want[0]["ids"] and want[0]["sizes"] == sorted(want[0]["sizes"])  # the pattern ran
    assert all(w["held"] and len(w["losses"]) == len(w["sizes"]) and len(w["labels"]) == len(w["ids"])
               and w["pair_ids"] == w["ids"] and w["globals_held"] and w["kept_held"] and w["kept"] for w in want)
    for out in outs:
        got = evaluation_records(out["held_outside"])
        assert [g["ids"] for g in got] == [w["ids"] for w in want]
        assert [g["count"] for g in got] == [len(w["ids"]) for w in want]  # the closure's object: merged too
        for key in ("losses", "labels", "held", "pair_ids", "held_labels", "globals_held", "kept", "kept_held"):
            # through a partial's argument, a closure's dict, a global tuple, a global list, hparams' dict: exact
            assert [g[key] for g in got] == [w[key] for w in want], key
        assert any(g["sizes"] != w["sizes"] for g, w in zip(got, want))  # each rank's own count: no merge is right
        assert any(g["kept_sizes"] != w["kept_sizes"] for g, w in zip(got, want))
    warnings = " ".join(outs[0]["held_outside"]["warnings"])
    assert "state outside the Brain" not in warnings, warnings  # no global, nor hparams' dict, named as changed
    assert "'kept_sizes'" in warnings and "'kept' was also held at stage start by" in warnings, warnings
    assert "hparams.lists['kept']" in warnings, warnings  # where the read that steered went through
    assert "'sizes'" in warnings and "read accumulated values in on_stage_end" in warnings, warnings


def test_summaries_json_dumps_writes_of_an_accumulator_are_named(ranks, references):
    """Issue 37: ``json.dumps`` of what an accumulator's method hands back, of the
    accumulator given to a helper with a second parameter (also ahead of a spread
    tuple), through ``json.dumps`` held in a dict of ``hparams``, and of what a
    function of the recipe's ``hparams`` hold hands back, reads its numbers in C, on a
    rank its own batches' only: each summary is named, with the read; the accumulator
    itself is exact."""
    world_size, outs = ranks
    want = evaluation_records(references["c_reads"])
    assert want[0]["count"] == 8 and want[0]["by_method"][-1] == json.dumps({"count": 8, "total": want[0]["total"]})
    for out in outs:
        got = evaluation_records(out["c_reads"])
        assert [(g["count"], g["total"]) for g in got] == [(w["count"], w["total"]) for w in want]
        for key in ("by_method", "by_helper", "by_hparams", "by_spread", "by_callback"):
            assert any(g[key] != w[key] for g, w in zip(got, want)), key  # each rank's own count: no merge is right
    warnings = " ".join(outs[0]["c_reads"]["warnings"])
    for key in ("by_method", "by_helper", "by_hparams", "by_spread", "by_callback"):
        assert f"'{key}'" in warnings, (key, warnings)
    assert "batches read [" in warnings and "'loss_stats.count'" in warnings, warnings
