"""Attribute tracking and merging in one process: every rank's tracker driven
by hand over its share of the batches, merged and applied as the stage does,
compared with one process running the same batches (no process group: the
multi-process path of the same code is tests/test_recipe_patterns.py)."""

import collections
import re
import types

import numpy as np
import pytest
import speechbrain as sb
import torch

from ddp_eval.config import DDPEvalConfig
from ddp_eval.stage._verify import first_difference
from ddp_eval.state._attributes import AttributeTracker
from ddp_eval.state._numbers import is_probe
from ddp_eval.state._values import ELSEWHERE, Kind
from ddp_eval.state.attribute_merge import merge_attribute_states
from ddp_eval.state.bookkeeping import simulate as simulate_stage
from ddp_eval.state.metrics import MetricFinder, MetricRecorder, merge_metric_stats

pytestmark = pytest.mark.fast

LAYOUTS = {"2 ranks": [[0, 3, 4], [1, 2, 5]], "3 ranks, one idle": [[0, 3], [1, 2], []],
           "one batch each": [[0], [1], [2]]}


def simulate(make, batch, layout, budget_mb=64.0, brain_attributes=()):
    """``(one process, [each rank after the merge], merge result)`` for ``batch(holder, b)``
    run over every batch, and over each rank's share (``layout``), with the stage's own
    record, merge and apply (:func:`ddp_eval.state.bookkeeping.simulate`);
    ``brain_attributes`` are those ``sb.Brain`` sets up (``hparams``), never watched."""
    single = make()
    for b in range(sum(map(len, layout))):
        batch(single, b)

    def brain():
        holder = make()
        holder._ddp_brain_attributes = frozenset({"_ddp_brain_attributes", *brain_attributes})
        return holder

    holders, records, merged = simulate_stage(layout, brain, batch, DDPEvalConfig(attribute_memory_mb=budget_mb))
    for record in records:
        assert not record.report["unmergeable"], record.report["unmergeable"]
    for holder in holders:
        del holder._ddp_brain_attributes
    return single, holders, merged.attributes


def assert_same(single, holder):
    for name, want in vars(single).items():
        got = getattr(holder, name)
        if isinstance(want, (np.ndarray, torch.Tensor)):
            assert type(got) is type(want) and got.dtype == want.dtype and (got == want).all(), name
        else:
            assert repr(got) == repr(want) and type(got) is type(want), name


def recipe_state():
    return types.SimpleNamespace(
        items=[], n=0, total=0.0, last_ids=None, stats={"TRAIN": {"loss": 1.0}}, preds={},
        conf=np.zeros((3, 3), dtype=int), cnt=torch.zeros(3, dtype=torch.long), vec=torch.zeros(2),
        last_batch=None, flag="", name="x", per_class=collections.defaultdict(int),
        per_spk=collections.defaultdict(list), counts=collections.Counter(), mean=collections.defaultdict(float))


def recipe_batch(h, b):
    h.items.append(b)  # a list that grows
    h.n += 2  # a counter
    h.total += 0.1 * b  # a float accumulator: replayed in global order, bit for bit
    h.last_ids = [f"u{b}", f"v{b}"]  # a new list every batch: the last one
    h.stats["VALID"] = {"loss": float(b)}  # HiFi-GAN's last_loss_stats[stage]
    h.preds[f"u{b}"] = b * 10  # one key per utterance
    h.conf[b % 3, (b + 1) % 3] += 1  # UrbanSound8k's confusion matrix
    h.cnt[b % 3] += 1
    h.vec += b
    h.last_batch = (torch.ones(2) * b, b)  # HiFi-GAN's last_batch
    h.flag = None if b % 2 else f"odd{b}"  # None and a string, set anew each batch
    h.name = f"batch{b}"
    h.per_class[b % 2] += 1
    h.per_spk[b % 3].append(b)
    h.counts[f"k{b % 2}"] += 2
    h.mean["x"] += 0.1 * b


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_kind_of_change_merges_to_one_process(layout):
    single, holders, result = simulate(recipe_state, recipe_batch, layout)
    assert not result.conflicts
    for holder in holders:
        assert_same(single, holder)
        assert not any(is_probe(v) for v in vars(holder).values())  # no probe left behind
        assert holder.per_class.default_factory is int  # nor a wrapped factory
    if len(layout) == 3 and all(len(p) == 1 for p in layout):  # cannot tell = from += for a new dict entry
        assert "stats['VALID']" in result.assumed
        # None at stage start, bound once per rank: an assignment or a lazy accumulator (issue 37): named as assumed
        assert "last_ids" in result.assumed


@pytest.mark.parametrize("start,add", [(np.float64(0.0), 0.5), (0.0, np.float64(0.5))], ids=["started", "added"])
def test_a_numpy_scalar_accumulator_is_named_with_its_remedy(start, add):
    """``total += x`` on a NumPy scalar: no probe of its kind, so = and += cannot be told
    apart: named, the remedy a Python float (start it as 0.0, add float(x))."""
    _, records, _ = simulate_stage([[0, 1], [2]], lambda: _brain(lambda: types.SimpleNamespace(total=start)),
                                   lambda h, b: setattr(h, "total", h.total + add), DDPEvalConfig())
    why = records[0].report["unmergeable"]["total"]
    assert "a float64 changed" in why and ("float(x)" in why or "float()" in why), why


@pytest.mark.parametrize("batch", [lambda h, b: setattr(h, "flag", b % 2 == 1),
                                   lambda h, b: setattr(h, "flag", h.flag or b == 1)], ids=["set", "or"])
def test_a_bool_a_batch_binds_is_named_and_exact_when_declared(batch):
    """A bool's reads and a bind of the object already there (True over True) are
    invisible, so ``flag = b % 2 == 1`` and ``flag = flag or x`` cannot be told
    apart: named; ``merge: {flag: max}`` makes the second exact."""
    layout = [[0], [1], [2]]
    _, records, _ = simulate_stage(layout, lambda: _brain(lambda: types.SimpleNamespace(flag=False)), batch,
                                   DDPEvalConfig())
    assert "a new bool over a bool" in records[1].report["unmergeable"]["flag"]
    single = types.SimpleNamespace(flag=False)
    for b in range(3):
        batch(single, b)
    holders, records, merged = simulate_stage(layout, lambda: _brain(lambda: types.SimpleNamespace(flag=False)),
                                              batch, DDPEvalConfig(merge={"flag": "max"}))
    if single.flag:  # flag or x: True once any batch saw it
        assert not any(r.report["unmergeable"] for r in records) and [h.flag for h in holders] == [True] * 3


def test_kinds_as_the_tracker_tells_them():
    single, holders, result = simulate(recipe_state, recipe_batch, LAYOUTS["2 ranks"])
    kinds = {label: kind for label, (kind, _) in result.merged.items()}
    assert kinds == {"items": Kind.APPEND, "n": Kind.FOLD, "total": Kind.FOLD, "last_ids": Kind.LAST,
                     "stats": Kind.KEYS, "preds": Kind.KEYS, "conf": Kind.SUM, "cnt": Kind.SUM,
                     "vec": Kind.ACCUMULATE, "last_batch": Kind.LAST, "flag": Kind.LAST, "name": Kind.LAST,
                     "per_class": Kind.KEYS, "per_spk": Kind.KEYS, "counts": Kind.KEYS, "mean": Kind.KEYS}
    assert result.merged["n"][1] == [("+", 2)] * 6


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_created_during_the_stage_counts_from_its_first_value(layout):
    """A counter created by the first batch that sees it (getattr default, or
    `if not hasattr`) counts from that batch's value, as in one process."""
    def batch(h, b):
        h.seen_n = getattr(h, "seen_n", 0) + 1
        if not hasattr(h, "total"):
            h.total = 0.0
        h.total += 0.5

    single, holders, result = simulate(types.SimpleNamespace, batch, layout)
    if all(len(p) == 1 for p in layout):  # no rank saw a second batch add to it: named, not guessed
        assert set(result.assumed) == {"seen_n", "total"}
        assert "create it in on_stage_start" in result.assumed["total"]
        return
    for holder in holders:
        assert_same(single, holder)


@pytest.mark.parametrize("pattern,why", [
    (lambda h, b: setattr(h, "ratio", h.ratio * h.best), "computed its new value from its previous one"),
    (lambda h, b: h.items.pop() if b % 2 else h.items.append(b), "entries were removed"),
    (lambda h, b: setattr(h, "holder", types.SimpleNamespace(n=b)) if b == 0 else setattr(h.holder, "n", b),
     "whose contents changed in place"),
])
def test_what_cannot_be_merged_is_named(pattern, why):
    holder = types.SimpleNamespace(best=0.0, ratio=1.0, items=[0, 1, 2], holder=None)
    tracker = AttributeTracker({name: (holder, name) for name in vars(holder)})
    tracker.before_batch()
    for b in range(3):
        pattern(holder, b)
        tracker.after_batch()
        tracker.before_batch()
    _, unmergeable = tracker.finish([0, 2, 4])
    assert any(why in text for text in unmergeable.values()), unmergeable


SCORES = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]


@pytest.mark.parametrize("pattern", ["max", "min", "ema"])
def test_a_number_computed_from_its_previous_value_is_one_process_where_its_reads_replay_alike_and_named_else(
        pattern):
    """``best = max(best, s)``, ``min``, ``ema = 0.9 ema + s``: each batch's reads of its
    batch-start value are replayed on one process's value at the merge; where they give
    the same answers the result is one process's, where one does not it is named."""
    def batch(h, b):
        if pattern == "ema":
            h.value = h.value * 0.9 + SCORES[b]
        else:
            h.value = (max if pattern == "max" else min)(h.value, SCORES[b])

    def make():
        return types.SimpleNamespace(value={"max": 0.0, "min": 1.0, "ema": 0.0}[pattern])

    single = make()
    for b in range(len(SCORES)):
        batch(single, b)
    # layouts where each batch's comparison answers as in one process (each rank's first batch a new best)
    alike = {"max": [[0, 1, 3], [2, 4, 5]], "min": [[0, 2, 4], [1, 3, 5]], "ema": [[0, 1, 2, 3, 4, 5], []]}[pattern]
    holders, records, merged = simulate_stage(alike, lambda: _brain(make), batch, DDPEvalConfig())
    assert not merged.attributes.assumed and not any(r.report["unmergeable"] for r in records)
    assert [h.value for h in holders] == [single.value] * len(alike)
    holders, records, merged = simulate_stage([[0, 1, 2], [3, 4, 5]], lambda: _brain(make), batch, DDPEvalConfig())
    named = set(merged.attributes.assumed) | {k for r in records for k in r.report["unmergeable"]}
    assert named == {"value"}, named
    assert "compared it" in merged.attributes.assumed["value"]


def _brain(make):
    holder = make()
    holder._ddp_brain_attributes = frozenset({"_ddp_brain_attributes"})
    return holder


def test_bound_on_one_rank_and_changed_in_place_on_another_is_a_conflict():
    def make():
        return types.SimpleNamespace(items=[])

    def batch(h, b):
        if b == 1:
            h.items = [b]  # bound anew on the rank holding batch 1
        else:
            h.items.append(b)

    _, holders, result = simulate(make, batch, [[0, 2], [1]])
    # rank 1's new list over an empty one reads as a rebuild (items = items + [b]): either way, named
    assert any(why in result.conflicts["items"] for why in ("bound new objects to it", "and as fold")), result


def test_float_accumulators_replay_in_global_order_bit_for_bit():
    values = [0.1 * k + 1e-17 * k * k for k in range(40)]

    def batch(h, b):
        h.total += values[b]

    layout = [list(range(r, 40, 3)) for r in range(3)]
    single, holders, _ = simulate(lambda: types.SimpleNamespace(total=1e16), batch, layout)
    assert all(h.total == single.total for h in holders)  # ==, not approximately


def test_tensors_unchanged_are_never_copied_and_float_ones_fall_back_to_totals(caplog):
    h = types.SimpleNamespace(table=torch.arange(6.0), acc=torch.zeros(1024, dtype=torch.float64))
    tracker = AttributeTracker({n: (h, n) for n in vars(h)}, budget_mb=20 / 1024)  # 2 increments of 8 kB
    version = h.table._version
    with caplog.at_level("WARNING"):
        for _ in range(5):
            tracker.before_batch()
            h.acc += 0.5
            tracker.after_batch()
    changes, _ = tracker.finish([0, 1, 2, 3, 4])
    assert "table" not in changes and h.table._version == version
    assert changes["acc"].data[0] == "total" and changes["acc"].data[1].unique().tolist() == [2.5]
    assert tracker.used_bytes == 6 * 4  # the table's start copy (it could change in place); increments released
    assert caplog.text.count("'acc' exceed ddp_eval: attribute_memory_mb") == 1


def test_a_tensor_changed_in_place_without_room_for_its_start_copy_is_named():
    h = types.SimpleNamespace(table=torch.arange(1.0, 257.0), moved=torch.arange(1.0, 257.0))
    tracker = AttributeTracker({n: (h, n) for n in vars(h)}, budget_mb=0.0)
    tracker.before_batch()
    h.table += 1
    h.moved = h.moved + 1  # bound anew: the last batch's tensor, no copy needed
    tracker.after_batch()
    changes, unmergeable = tracker.finish([4])
    assert "no room for its start copy" in unmergeable["table"]
    assert changes["moved"].kind is Kind.FOLD and changes["moved"].data[0][1] == "+"


def test_journal_pieces_merge_to_the_whole_stage():
    """A rank's pieces (cut every 3 batches) merge to what its whole-stage state merges to."""

    h = types.SimpleNamespace(err=sb.utils.metric_stats.ErrorRateStats(), items=[], seen={"old": 0}, n=0,
                              total=0.0, counts=torch.zeros(4, dtype=torch.long), vec=torch.zeros(3),
                              last=None, per=collections.defaultdict(int))
    recorder = MetricRecorder(MetricFinder(), h)
    names = ("items", "seen", "n", "total", "counts", "vec", "last", "per")
    tracker = AttributeTracker({**{n: (h, n) for n in names}, **recorder.fields})  # err.ids: one engine
    positions = [3 * b + 1 for b in range(10)]
    metric_pieces, attribute_pieces = [], []
    tracker.before_batch()
    for b in range(10):
        h.err.append([f"u{b}"], [["a", "b"][: 1 + b % 2]], [["a", "c"]])
        h.items.append(b)
        h.seen[f"u{b}"] = b
        h.seen["old"] = b  # an entry replaced
        h.n += b
        h.total += 0.1 * b
        h.counts[b % 4] += 1
        h.vec += b * 0.5
        h.last = f"batch {b}"
        h.per[b % 2] += 1
        recorder.after_batch(h)
        tracker.after_batch()
        if b % 3 == 2:
            metric_pieces.append(recorder.piece(positions))
            attribute_pieces.append(tracker.piece(positions))
        tracker.before_batch()
    metric_pieces.append(recorder.piece(positions))
    attribute_pieces.append(tracker.piece(positions))
    assert merge_metric_stats(metric_pieces) == merge_metric_stats([recorder.finish(h, positions)])
    whole, _ = tracker.finish(positions)
    pieced = merge_attribute_states(attribute_pieces).merged
    merged = merge_attribute_states([whole]).merged
    for label in ("items", "seen", "n", "total", "per", "err.ids", "err.scores"):
        assert repr(pieced[label]) == repr(merged[label]), label
    assert pieced["last"] == (Kind.LAST, "batch 9") and merged["last"] == (Kind.LAST, ELSEWHERE)
    assert torch.equal(pieced["counts"][1], merged["counts"][1])
    assert torch.equal(torch.stack(list(pieced["vec"][1])), torch.stack(list(merged["vec"][1])))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_dict_entries_created_during_the_stage_get_probes_once_they_change(layout):
    """Entries a stage creates in a plain dict are watched by identity until they
    change again (one per utterance, set once: no probe, no cost); that change,
    seen without a probe, is told by the others: += or =, on any rank. An entry
    ``setdefault`` created with a number starts from that number (a probe), so
    ``+=`` on it is told even when each rank created it once."""
    def make():
        return types.SimpleNamespace(stats={})

    def batch(h, b):
        for key, value in (("n", 0), ("last", 0), ("loss", 0.0)):
            h.stats.setdefault(key, value)
        h.stats["n"] += 2
        h.stats["last"] = b * 10
        h.stats["loss"] += 0.25 * b

    single, holders, result = simulate(make, batch, layout)
    if all(len(p) == 1 for p in layout):  # each rank set 'last' once over the default: = or += cannot be told;
        # its setdefault read that named value, rank-local: what the batch computed from it is named too
        assert set(result.assumed) == {"stats['last']", "stats"}
    for holder in holders:
        assert holder.stats["n"] == single.stats["n"] and holder.stats["last"] == single.stats["last"]
        assert holder.stats["loss"] == pytest.approx(single.stats["loss"], rel=1e-15)
    kinds = {label: kind for label, (kind, _) in result.merged["stats"][1][1].items()}
    assert kinds == {"n": Kind.FOLD, "last": Kind.FOLD, "loss": Kind.FOLD}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_dict_of_one_entry_per_utterance_merges_in_order(layout):
    """Past 64 entries a dict is watched by its new keys; past 16 new keys, new
    entries get probes only once they change again; ``get(k, 0.0) + 1`` on a rank
    that lacks the key starts from the default it handed out (a probe): exact
    whatever the split."""
    def batch(h, b):
        for i in range(30):
            h.scores[f"u{b}-{i}"] = 0.5 * i + b
        h.scores["u0-0"] = h.scores.get("u0-0", 0.0) + 1.0 if b else h.scores["u0-0"]

    single, holders, result = simulate(lambda: types.SimpleNamespace(scores={}), batch, layout)
    assert not result.assumed and not result.conflicts
    for holder in holders:
        assert list(holder.scores.items()) == list(single.scores.items())


def _deep_counter(h, b):  # three subscripts down: the dict holding "n" is not watched entry by entry
    h.deep["VALID"]["spk"]["n"] += 1


def _field_deep_counter(h, b):  # a field counts as a level: the dict holding "n" is two levels down
    h.tally.per_spk["spk"]["n"] += 1


def _deep_counter_steering(h, b):
    h.deep["VALID"]["spk"]["n"] += 1
    if h.deep["VALID"]["spk"]["n"] == 1:  # a rank's own count: on each rank its first batch finds 1
        h.first.append(b)


def _late_key_counter_steering(h, b):  # past the first 64 keys
    h.big["k99"] += 1
    if h.big["k99"] < 3:
        h.first.append(b)


def _deep_counter_steering_after_many_reads(h, b):  # 70 other keys read first: the report keeps wide[*]
    spk = h.wide["VALID"]["spk"]
    assert sum(spk[f"k{i}"] for i in range(70)) == 70 * 69 // 2  # reads that steer nothing
    spk["n"] += 1
    if spk["n"] == 1:
        h.first.append(b)


def _deep_set_once(h, b):  # one key per utterance, three subscripts down, read back: each rank sets its own
    h.deep["VALID"]["spk"][f"u{b}"] = 10 * b
    h.first.append(h.deep["VALID"]["spk"][f"u{b}"])


def _fields(value):
    return vars(value) if isinstance(value, types.SimpleNamespace) else value


def _counts():
    return collections.defaultdict(int)


def _counts_per_word():
    return collections.defaultdict(_counts)


def _made_deep_counter_steering(h, b):  # made during the stage, three levels down: its reads are plain
    h.made["VALID"]["spk"]["n"] += 1
    if h.made["VALID"]["spk"]["n"] == 2:
        h.first.append(b)


def _unwatched():
    return types.SimpleNamespace(deep={"VALID": {"spk": {"n": 0, **{f"u{b}": None for b in range(6)}}}}, first=[],
                                 big={f"k{i}": 0 for i in range(100)}, other=0,
                                 wide={"VALID": {"spk": {"n": 0, **{f"k{i}": i for i in range(70)}}}},
                                 tally=types.SimpleNamespace(per_spk={"spk": {"n": 0}}),
                                 made=collections.defaultdict(_counts_per_word))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("batch, named", [(_deep_counter, {"deep"}), (_field_deep_counter, {"tally"}),
                                          (_deep_counter_steering, {"deep", "first"}),
                                          (_late_key_counter_steering, {"big", "first"}), (_deep_set_once, set()),
                                          (_made_deep_counter_steering, {"made", "first"}),
                                          (_deep_counter_steering_after_many_reads, {"wide", "first"})],
                         ids=["deep counter", "field deep counter", "deep counter steering", "late key steering",
                              "deep set once", "made deep counter steering", "deep counter after 70 reads"])
def test_entries_not_watched_one_by_one_set_on_several_ranks_are_named_with_what_their_reads_steered(
        batch, named, layout):
    """A dict's entries past its first 64 keys, or three levels below the attribute,
    are taken as set once (one per utterance): exact when one rank sets each. Set on
    several ranks (``self.stats[stage][spk]["n"] += 1``), the entry is named, with what
    a batch computed from reading it (each rank read its own count); before, the
    nested counter took one rank's value, unnamed. So is what a batch computed from a
    read of a nested ``defaultdict``'s entry made during the stage (plain, its reads
    unseen), at any split."""
    def counting(h, b):
        batch(h, b)
        h.other += 1  # a value no read steers: named with the rest when one is

    single, holders, result = simulate(_unwatched, counting, layout)
    labels = {label.split("[")[0] for label in (*result.conflicts, *result.assumed)}
    differs = {name for name, want in vars(single).items() if repr(_fields(getattr(holders[0], name))) != repr(
        _fields(want))}
    if not named:
        assert not labels and not differs, (labels, differs)
        return
    assert named <= labels and differs <= labels, (named, labels, differs)
    assert {"deep", "big", "tally", "made", "wide"} & differs  # one rank's count: no merge is right
    why = next(why for label, why in {**result.assumed, **result.conflicts}.items() if "[" in label)  # the entry's
    assert ("not watch one by one" in why or batch is _made_deep_counter_steering) and "on_stage_" in why, why


def test_a_ranks_report_of_entry_reads_holds_at_most_64_keys_of_a_dict():
    """The stage-end report names each dict key batches read (``scores[utt]``) up to
    64 keys a dict; past them, the dict as a whole (``scores[*]``, which names more,
    never less): it grows with the dicts read, not with the data."""
    def batch(h, b):
        h.total += sum(h.scores[f"u{100 * b + i}"] for i in range(100))  # 100 keys a batch
        h.small[f"k{b % 3}"] += 1

    _, records, _ = simulate_stage([[0, 1, 2, 3], [4, 5, 6]], lambda: _brain(lambda: types.SimpleNamespace(
        scores={f"u{i}": float(i) for i in range(700)}, total=0.0, small={"k0": 0, "k1": 0, "k2": 0})), batch,
        DDPEvalConfig())
    for record in records:
        reads = record.report["entry_reads"]
        assert "scores[*]" in reads and not any(r.startswith("scores['") for r in reads), reads
        assert {r for r in reads if r.startswith("small")} == {"small['k0']", "small['k1']", "small['k2']"}, reads


@pytest.mark.parametrize("layout", [[list(range(0, 30, 2)), list(range(1, 30, 2))],
                                    [list(range(12)), list(range(12, 30)), []]], ids=["interleaved", "blocks"])
def test_dict_and_list_entries_that_go_quiet_then_change_again(layout):
    """Entries looked at every batch until they stop changing (QUIET_BATCHES), and a
    dict's entries past its first new keys (one per utterance), are then watched by
    identity alone: a later change of either, by += or by =, is still merged as one
    process's. 30 batches, so entries are quiet for longer than QUIET_BATCHES."""
    def make():
        return types.SimpleNamespace(counts={"a": 0, "b": 0}, hist=[0, 0, 0], results={}, made=collections.Counter())

    def batch(h, b):
        if b < 3 or b in (20, 27):
            h.counts["a"] += b + 1  # busy, quiet from batch 3 to 19, then += again
        if b in (2, 24):
            h.counts["b"] = 10 * b  # set, quiet, set again
        if b < 2 or b == 22:
            h.hist[b % 3] += 1
        h.results.update((f"u{b}-{i}", b) for i in range(4))  # 4 new keys a batch: most watched by identity
        if b in (18, 25):
            h.results["u1-0"] = -b  # an early entry set again
            h.results[f"u{b - 12}-3"] = 1000 + b  # another rank's key, in blocks
        if b % 7 == 0:
            h.made[f"k{b % 3}"] += 1

    single, holders, _ = simulate(make, batch, layout)
    for holder in holders:
        assert_same(single, holder)
    assert single.counts == {"a": 1 + 2 + 3 + 21 + 28, "b": 240} and single.results["u1-0"] == -25


def _declared(layout, make, batch, config):
    """``(one process, [each rank after the merge])`` of a stage with declared merges, nothing named."""
    single = make()
    for b in range(sum(map(len, layout))):
        batch(single, b)
    holders, records, merged = simulate_stage(layout, make, batch, config)
    assert not merged.attributes.conflicts and not any(r.report["unmergeable"] for r in records)
    return single, holders


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_declared_merges_equal_one_process(layout):
    """``ddp_eval: merge`` (issue 32): a running maximum and minimum, a sum and a set,
    merged by their declared reduction; exact at any split, nothing named."""
    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), best=-1.0,
                                     worst=9.0, total=torch.zeros(2, dtype=torch.long), seen={"x"})

    def batch(h, b):
        h.best = max(h.best, (b * 7 % 5) * 0.1)
        h.worst = min(h.worst, (b * 3 % 4) + 0.5)
        h.total = h.total + b
        h.seen = h.seen | {b % 3}

    config = DDPEvalConfig(merge={"best": "max", "worst": "min", "total": "sum", "seen": "union"})
    single, holders = _declared(layout, make, batch, config)
    for holder in holders:
        assert (holder.best, holder.worst, holder.seen) == (single.best, single.worst, single.seen)
        assert torch.equal(holder.total, single.total)


def test_a_declared_merge_the_record_contradicts_is_named():
    """A value declared ``max`` that fell on a rank is named there, never merged."""
    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), best=1.0)

    def batch(h, b):
        h.best = h.best - 0.5 if b == 1 else max(h.best, 2.0)

    _, records, merged = simulate_stage([[0], [1]], make, batch, DDPEvalConfig(merge={"best": "max"}))
    assert "declared 'merge: max', but it fell below" in records[1].report["unmergeable"]["best"]
    assert "best" not in records[0].report["unmergeable"]


@pytest.mark.parametrize("merge,message", [({"best": "maximum"}, "expects one of ['max', 'min', 'sum', 'union']"),
                                           (["best"], "a mapping of attribute names to reductions")])
def test_a_declared_merge_is_validated(merge, message):
    from ddp_eval.errors import ConfigError
    with pytest.raises(ConfigError, match=re.escape(message)):
        DDPEvalConfig.from_hparams({"ddp_eval": {"merge": merge}})


def top_two(values):
    """A recipe's own merge: the two best scores over every rank's (a module-level function)."""
    return sorted({score for pair in values for score in pair}, reverse=True)[:2]


def keeps_first(values):
    """Not a merge: it drops a rank's own value when alone."""
    return []


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_declared_merge_function_of_the_recipe_equals_one_process(layout):
    """Issue 37: ``merge:`` also takes a function of every rank's value, as torchmetrics'
    ``dist_reduce_fx`` (here from the YAML, as ``!name:`` gives it): the two best
    scores, kept by a batch that compares, sorts and cuts, exact at any split."""
    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), best=[0.0])

    def batch(h, b):
        h.best = sorted(set(h.best) | {(b * 7 % 5) * 0.1}, reverse=True)[:2]

    from hyperpyyaml import load_hyperpyyaml
    config = DDPEvalConfig.from_hparams(load_hyperpyyaml(
        "ddp_eval:\n    merge:\n        best: !name:tests.test_attribute_tracking.top_two\n"))
    single, holders = _declared(layout, make, batch, config)
    for holder in holders:
        assert holder.best == single.best
    # the same recipe without the declaration: named (a value computed from the previous one)
    _, records, _ = simulate_stage(layout, make, batch, DDPEvalConfig())
    assert any("best" in r.report["unmergeable"] for r in records) or len(layout) == 1


def test_a_declared_merge_function_is_checked_and_validated():
    """A function that does not give a rank's value from it alone is named on that rank;
    one that cannot travel by reference (a lambda) is refused with what to do."""
    from ddp_eval.errors import ConfigError

    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), best=[1.0])

    def batch(h, b):
        h.best = [float(b)]

    _, records, _ = simulate_stage([[0], [1]], make, batch, DDPEvalConfig(merge={"best": keeps_first}))
    assert "declared 'merge: keeps_first', but the function gives [] from this rank's value" in \
        records[1].report["unmergeable"]["best"]
    with pytest.raises(ConfigError, match="a module-level function"):
        DDPEvalConfig.from_hparams({"ddp_eval": {"merge": {"best": lambda values: values[0]}}})


class _Slotted:
    __slots__ = ("n",)

    def __init__(self):
        self.n = 0


def test_state_the_engine_cannot_read_is_named_when_it_changes():
    """Issue 32, item 2: a deque, a class with ``__slots__``, a random generator and an
    iterator, changed by batches: each named (by its operations or by a digest of its
    pickled state), never trusted by identity; the same objects left alone name nothing."""
    import random

    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}),
                                     recent=collections.deque(maxlen=3), slotted=_Slotted(), rng=random.Random(0),
                                     it=iter(range(100)), kept=_Slotted(), idle_rng=random.Random(1))

    def batch(h, b):
        h.recent.append(b)
        h.slotted.n += 1
        h.rng.random()
        next(h.it)

    _, records, _ = simulate_stage([[0, 2], [1]], make, batch, DDPEvalConfig())
    for record in records:
        assert set(record.report["unmergeable"]) == {"recent", "slotted", "rng", "it"}, record.report["unmergeable"]


@pytest.mark.parametrize("layout", [[[0, 2, 4], [1, 3]], [[0], [1, 2], [3, 4]], [[], [0, 1, 2, 3, 4]]],
                         ids=["2 ranks", "3 ranks", "one idle"])
def test_streams_written_per_batch_merge_in_global_order(layout):
    """Issue 37: an ``io.StringIO`` log and an ``io.BytesIO`` batches write to at their
    end are concatenated in global batch order, as ``s += line`` is: every rank holds
    one process's text; the read hooks are gone after the stage."""
    import io

    def make():
        blob = io.BytesIO(b"header;")
        blob.seek(0, io.SEEK_END)
        return types.SimpleNamespace(log=io.StringIO(), blob=blob)

    def batch(h, b):
        h.log.write(f"utt{b} \u00e9t\u00e9 {b * 0.1}\n")
        print(f"utt{b}", file=h.log)
        h.blob.write(bytes([65 + b]))

    single, holders, _ = simulate(make, batch, layout)
    for holder in holders:
        assert holder.log.getvalue() == single.log.getvalue() and holder.blob.getvalue() == single.blob.getvalue()
        assert holder.log.tell() == single.log.tell() and vars(holder.log) == {}


def test_streams_and_generators_batches_touch_are_named():
    """Issue 37: a stream a batch reads back and writes to (``tell()``, ``getvalue()``),
    one written before its end, and a generator batches advance (no recording copy's)
    are named with what to do, at 2 ranks; the same objects left alone name nothing."""
    import io

    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}),
                                     numbered=io.StringIO(), first=io.StringIO(), head=io.StringIO("kept\n"),
                                     quiet=io.StringIO("kept\n"), idle_gen=(i for i in range(5)), lengths=[])

    def batch(h, b):
        h.numbered.write(f"{len(h.numbered.getvalue().splitlines())} utt{b}\n")  # a read steers the write
        h.lengths.append(len(h.numbered.getvalue()))  # ... and another value
        if h.first.tell() < 10:
            h.first.write(f"utt{b}\n")
        h.head.write(f"{b}")  # at position 0: over what it held
        if b == 0:  # bound and started by a batch, advanced again by a later one on the same rank: its place in
            h.gen = (i for i in range(100))  # the code is the same yield, only its locals tell
            next(h.gen)
        elif hasattr(h, "gen"):
            next(h.gen)

    _, records, merged = simulate_stage([[0, 2], [1, 3]], make, batch, DDPEvalConfig())
    named = records[0].report["unmergeable"]
    assert {"numbered", "first", "head", "gen"} <= set(named) and not {"quiet", "idle_gen"} & set(named), named
    assert "read it back" in named["numbered"] and "read it back" in named["first"]
    assert "append the lines to a list" in named["head"] and "stage_output" in named["head"]
    assert set(records[1].report["unmergeable"]) >= {"numbered", "first", "head"}
    assert "lengths" in merged.attributes.assumed and "numbered" in merged.attributes.assumed["lengths"]


def test_a_stream_closed_during_the_stage_is_named():
    """A log a batch writes to and then closes: named on its rank, the stage ends."""
    import io

    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), log=io.StringIO())

    def batch(h, b):
        h.log.write(f"utt{b}\n")
        if b == 2:
            h.log.close()

    _, records, _ = simulate_stage([[0, 2], [1, 3]], make, batch, DDPEvalConfig())
    assert "closed during the stage" in records[0].report["unmergeable"]["log"]


def test_a_list_of_tensors_travels_stacked_and_merges_to_one_process():
    """A metric object's list of 0-d tensors (BinaryMetricStats.scores, one per
    utterance) travels as one stacked tensor: pickling 10,000 tensors one by one took
    1.5 s of a stage end that takes 80 ms (benchmarks.md); rows come back equal."""

    def make():
        return types.SimpleNamespace(bins=sb.utils.metric_stats.BinaryMetricStats())

    def batch(h, b):
        h.bins.append([f"u{b}_{i}" for i in range(4)], torch.arange(4.0) / (b + 1), torch.tensor([0, 1, 1, 0]))

    single, holders, _ = simulate(make, batch, [[0, 2, 4], [1, 3]])
    _, records, _ = simulate_stage([[0, 2, 4], [1, 3]], lambda: types.SimpleNamespace(
        _ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), **vars(make())), batch, DDPEvalConfig())
    sent = records[0].state[1]["bins.scores"].data
    assert isinstance(sent[2], torch.Tensor) and sent[2].shape == (12,)  # (positions, sizes, one stacked tensor)
    for holder in holders:
        assert [float(x) for x in holder.bins.scores] == [float(x) for x in single.bins.scores]
        assert all(type(x) is torch.Tensor and x.shape == () for x in holder.bins.scores)
        assert holder.bins.summarize() == single.bins.summarize()


THREE_RANKS_EACH_MAKES = [[0, 3], [1, 4], [2, 5]]  # each rank makes each key's container anew


def _two_zeros():
    return torch.zeros(2, dtype=torch.float64)


@pytest.mark.parametrize("layout", [THREE_RANKS_EACH_MAKES, [[0, 1, 2, 3, 4], [5]], [[], [0, 1, 2, 3, 4, 5]]],
                         ids=["3 ranks", "2 ranks", "one idle"])
def test_containers_made_for_a_new_key_merge_exactly_when_only_grown(layout):
    """Issue 37 (containers created inside a batch): lists, sets, Counters, tensors and
    dicts a ``defaultdict`` or ``setdefault`` makes for a new key, then grows in that
    batch, equal one process on every rank; a key made but left empty is every
    rank's too; what the stage made is plain again after it."""
    def make():
        return types.SimpleNamespace(by=collections.defaultdict(list), sets=collections.defaultdict(set),
                                     words=collections.defaultdict(collections.Counter), per_key={},
                                     sums=collections.defaultdict(_two_zeros))

    def batch(h, b):
        key = f"k{b % 2}"
        h.by[key].append(b * 0.25)
        h.sets[key].add(b % 3)
        h.words[key].update(["a", "b"][: b % 2 + 1])
        h.sums[key] += b * 0.5
        h.per_key.setdefault(key, []).extend([b, -b])
        h.per_key.setdefault(f"empty{b % 2}", set())  # made, never grown
        h.by[f"u{b}"].extend([b, b - 1])  # one key per utterance, sorted: made once in all, exact
        h.by[f"u{b}"].sort()

    single, holders, merged = simulate(make, batch, layout)
    assert not merged.conflicts and not merged.assumed, (merged.conflicts, merged.assumed)
    for holder in holders:
        assert_same(single, holder)
        for name in ("by", "sets", "words", "per_key"):
            assert all(type(v) in (list, set, collections.Counter) for v in getattr(holder, name).values()), name
        assert all(type(v) is torch.Tensor for v in holder.sums.values())


@pytest.mark.parametrize("change", ["sort", "insert(0)", "trim", "hist[0] += 1", "max(get)", "discard", "mul_",
                                    "deque", "max(d.get(k, 0))"])
def test_a_container_made_anew_on_several_ranks_and_changed_otherwise_is_named(change):
    """Issue 37: where each of three ranks makes a key's container anew and a batch
    also sorts, inserts into, trims, sets by position, reads or scales it, in one
    process that batch found the entries earlier batches made: the ranks' values
    differ from one process, and each that does is named (merged as appended to,
    unnamed, before)."""
    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}),
                                     lists=collections.defaultdict(list), by_setdefault={},
                                     hist=collections.defaultdict(lambda: [0, 0]), best=collections.defaultdict(dict),
                                     sets=collections.defaultdict(set), sums=collections.defaultdict(
                                         lambda: torch.zeros(2, dtype=torch.float64)))

    def batch(h, b):
        key, score = b % 2, (0.3, 1.1, 0.7, 2.9, 0.2, 2.6)[b]
        if change == "sort":
            h.lists[key].append(score)
            h.lists[key].sort()
        elif change == "insert(0)":
            h.by_setdefault.setdefault(key, []).insert(0, score)
        elif change == "trim":
            h.lists[key].append(score)
            del h.lists[key][:-2]
        elif change == "hist[0] += 1":
            h.hist[key][0] += 1
        elif change == "max(get)":
            h.best[key]["max"] = max(h.best[key].get("max", 0.0), score)
        elif change == "deque":
            h.by_setdefault.setdefault(key, collections.deque(maxlen=2)).append(b)
        elif change == "max(d.get(k, 0))":
            h.by_setdefault[key] = max(h.by_setdefault.get(key, 0.0), score)
        elif change == "discard":
            h.sets[key].add(b)
            h.sets[key].discard(b - 2)
        else:
            h.sums[key].mul_(0.5).add_(score)

    single = make()
    for b in range(6):
        batch(single, b)
    holders, records, merged = simulate_stage(THREE_RANKS_EACH_MAKES, make, batch, DDPEvalConfig())
    named = {label.split("[")[0] for label in (*merged.attributes.conflicts, *merged.attributes.assumed)} | {
        label.split("[")[0] for record in records for label in record.report["unmergeable"]}
    changed = {name for name in vars(single) if name != "_ddp_brain_attributes"
               and any(first_difference(getattr(h, name), getattr(single, name), name) for h in holders)}
    assert changed and changed <= named, (changed, named)  # each rank's own value, named


@pytest.mark.parametrize("read", ["len < 2", "in", "[-1]", "pop(k, None)"])
def test_a_container_made_over_none_is_watched_as_one_held_at_stage_start(read):
    """Issue 37 (a lazy None accumulator): ``if self.x is None: self.x = []`` made in a
    batch gets a recording copy from the next batch on, so a read of what batches
    added that steers a later batch is named at 2 and 3 ranks (merged as appended
    before); the list beside it, only grown, equals one process, plain after the stage."""
    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), x=None, grown=None)

    def batch(h, b):
        if h.x is None:
            h.x, h.grown = ({} if read == "pop(k, None)" else []), []
        h.grown.append(b)
        if read == "len < 2" and len(h.x) < 2:
            h.x.append(b)
        elif read == "in" and b % 3 not in h.x:
            h.x.append(b % 3)
        elif read == "[-1]":
            h.x.append(b + (h.x[-1] if h.x else 0))
        elif read == "pop(k, None)":
            h.x[b] = b
            h.x.pop(b - 1, None)

    single = make()
    for b in range(6):
        batch(single, b)
    for layout in ([[0, 2, 4], [1, 3, 5]], [[0, 3], [1, 4], [2, 5]]):
        holders, records, merged = simulate_stage(layout, make, batch, DDPEvalConfig())
        named = {*merged.attributes.conflicts, *merged.attributes.assumed} | {
            label for record in records for label in record.report["unmergeable"]}
        assert "x" in named, named  # (and, as what such a read may steer, the rest as assumed)
        for holder in holders:
            assert holder.grown == single.grown and type(holder.grown) is list and type(holder.x) is type(single.x)


def test_a_tuple_of_numbers_rebuilt_from_its_previous_value_is_named_and_min_stays_exact():
    """A tuple attribute (``self.pair = (self.pair[0] + 1, self.pair[1] + x)``, ``self.best =
    (s, i) if s > self.best[0] else self.best``) was merged as the last batch's tuple: its
    reads are now seen (a probe stands in for it), replayed at the merge on one process's
    value, and it is named where they answer otherwise (``min(low, (s, i))`` too, as
    for a number); a tuple set anew each batch equals one process."""
    scores = (0.3, 1.1, 0.7, 2.9, 0.2, 2.6)

    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), pair=(0, 0.0),
                                     best=(0.0, -1), low=(9.0, -1), last=(-1, ""))

    def batch(h, b):
        h.pair = (h.pair[0] + 1, h.pair[1] + scores[b])
        h.best = (scores[b], b) if scores[b] > h.best[0] else h.best
        h.low = min(h.low, (scores[b], b))
        h.last = (b, f"u{b}")

    single = make()
    for b in range(6):
        batch(single, b)
    for layout in ([[0, 2, 4], [1, 3, 5]], [[0, 3], [1, 4], [2, 5]], [[0, 1, 2, 3, 4], [5]]):
        holders, records, merged = simulate_stage(layout, make, batch, DDPEvalConfig())
        named = {*merged.attributes.conflicts, *merged.attributes.assumed} | {
            label for record in records for label in record.report["unmergeable"]}
        assert {"pair", "best"} <= named, named  # their reads give other answers on one process's value
        for holder in holders:
            assert (holder.low == single.low or "low" in named) and holder.last == single.last
            assert type(holder.low) is tuple and type(holder.pair) is tuple


def test_a_new_key_set_from_a_default_its_batch_compared_is_named_where_another_rank_made_it():
    """``d[k] = max(d.get(k, 0.0), s)`` in a dict held at stage start: a rank whose batch
    found ``k`` absent compared the default where one process compared another batch's
    value. Made on one rank only it is exact; made on two it was the last batch's
    value, unnamed, and is now named."""
    scores = (0.3, 1.1, 0.7, 2.9, 0.2, 2.6)

    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}), best={})

    def batch(h, b):
        h.best[b % 2] = max(h.best.get(b % 2, 0.0), scores[b])

    single = make()
    for b in range(6):
        batch(single, b)
    holders, _, merged = simulate_stage([[0, 2, 4], [1, 3, 5]], make, batch, DDPEvalConfig())
    assert not merged.attributes.conflicts and all(h.best == single.best for h in holders)
    holders, _, merged = simulate_stage([[0, 1, 2, 3, 4], [5]], make, batch, DDPEvalConfig())
    assert "best[1]" in merged.attributes.conflicts and holders[1].best[1] != single.best[1]


@pytest.mark.fast
@pytest.mark.parametrize("start", [[], [0]])
def test_a_number_no_batch_changes_appended_to_a_list_names_nothing(start):
    """``items.append(self.weight)``, ``items.append(1 + self.weight)``, to a list empty
    or not at stage start, with ``self.weight * 1.5`` read too: the plain number goes
    in, and a read of a number no batch changed is one process's read."""
    def make():
        return types.SimpleNamespace(weight=2, items=list(start), scaled=[])

    def batch(h, b):
        h.items.append(h.weight)
        h.items.append(1 + h.weight)
        h.scaled.append(h.weight * 1.5)

    single, holders, merged = simulate(make, batch, [[0, 2, 4], [1, 3, 5]])
    assert not merged.assumed and not merged.conflicts
    assert all(vars(h) == vars(single) and type(h.items[-1]) is int for h in holders)


_THROUGH_DATA = {  # a change of a rebuilt tensor through .data: no _version moves
    "data.add_": lambda x, b: x.data.add_(1.0), "data +=": lambda x, b: x.data.__iadd__(float(b)),
    "data.sub_": lambda x, b: x.data.sub_(0.5), "data.mul_": lambda x, b: x.data.mul_(2.0),
    "data[0] =": lambda x, b: x.data.__setitem__(0, 100.0 * b), "data.fill_": lambda x, b: x.data.fill_(b),
    "data.copy_": lambda x, b: x.data.copy_(torch.full_like(x, 7.0)), "data =": lambda x, b: setattr(x, "data", x * 2),
    "data.dtype only": lambda x, b: x.data.dtype,
    # other writes that move no _version: through NumPy, the storage, DLPack, .detach()
    "numpy()[0] =": lambda x, b: x.numpy().__setitem__(0, 9.0 * b),
    "numpy.asarray()[0] =": lambda x, b: np.asarray(x).__setitem__(0, 5.0 * b),
    "untyped_storage().fill_": lambda x, b: x.untyped_storage().fill_(b),
    "from_dlpack()[0] =": lambda x, b: torch.from_dlpack(x).__setitem__(0, 6.0 * b),
    "detach().add_": lambda x, b: x.detach().add_(1.0)}


@pytest.mark.parametrize("size", ["small", "too large to replay"])
@pytest.mark.parametrize("rebuild", ["x = x + y", "torch.cat"])
@pytest.mark.parametrize("write", sorted(_THROUGH_DATA))
def test_a_rebuilt_tensor_changed_through_data_in_the_same_batch_is_named_at_any_size(write, rebuild, size,
                                                                                       monkeypatch):
    """``self.x = self.x + y`` then ``self.x.data.add_(1)``: the change moves no ``_version``
    and no in-place record sees it; the replay of the rebuilds at stage end does, but
    it ran only for tensors small enough (batches x elements under 2**24), so a large
    one was merged as rebuilt, silently wrong. A batch that reads ``.data`` of a
    rebuilt tensor now has it replayed at any size; one that reads nothing through it
    stays exact."""
    from ddp_eval.state import _attributes

    if size != "small":
        monkeypatch.setattr(_attributes, "REPLAY_ELEMENTS", 0)  # as for 2**24 elements and more

    def make():
        return types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}),
                                     x=torch.zeros(4, dtype=torch.float64))

    def batch(h, b):
        y = torch.full((4,), float(b), dtype=torch.float64)
        h.x = h.x + y if rebuild == "x = x + y" else torch.cat([h.x, y])
        _THROUGH_DATA[write](h.x, b)

    single = make()
    for b in range(6):
        batch(single, b)
    for layout in ([[0, 1, 2], [3, 4, 5]], [[0, 2, 4], [1, 3, 5], []]):
        holders, records, merged = simulate_stage(layout, make, batch, DDPEvalConfig())
        named = {*merged.attributes.conflicts, *merged.attributes.assumed} | {
            label for record in records for label in record.report["unmergeable"]}
        equal = all(torch.equal(h.x, single.x) for h in holders)
        if write == "data.dtype only":
            assert equal and not named, named
        else:  # each rank's own change: named, not merged (data.copy_ of a constant, the last, is equal too)
            assert "x" in named and (not equal or write == "data.copy_"), (equal, named)


def _holding(**rest):
    return types.SimpleNamespace(stats={"wer": sb.utils.metric_stats.ErrorRateStats(), **rest})


def _score(h, b):
    h.stats.setdefault("wer", sb.utils.metric_stats.ErrorRateStats()).append(
        [f"u{b}"], [["a", "b"]], [["a", "b" if b % 2 else "c"]])


def _counter_beside(h, b):
    _score(h, b)
    h.stats["n"] += 1


def _ids_beside(h, b):
    _score(h, b)
    h.stats["ids"].append(b)


def _made_with_count(h, b):
    if not hasattr(h, "made"):
        h.made = {"wer": sb.utils.metric_stats.ErrorRateStats(), "n": 0}
    h.made["wer"].append([f"u{b}"], [["a"]], [["a"]])
    h.made["n"] += 1


def _one_process_and_named(make, batch, layout):
    """``(one process, [each rank after the merge], records, the labels the ranks named)``."""
    single = make()
    for b in range(sum(map(len, layout))):
        batch(single, b)
    holders, records, _ = simulate_stage(layout, lambda: _brain(make), batch, DDPEvalConfig())
    return single, holders, records, set().union(*(record.report["unmergeable"] for record in records))


HOLDERS = {  # make, batch, what is named
    "counter beside": (lambda: _holding(n=0), _counter_beside, {"stats"}),
    "ids beside": (lambda: _holding(ids=[]), _ids_beside, {"stats"}),
    "metric put in later": (lambda: types.SimpleNamespace(stats={"n": 0}), _counter_beside, {"stats"}),
    "holder made by a batch": (lambda: types.SimpleNamespace(), _made_with_count, {"made"}),
    "settings beside, unchanged": (lambda: _holding(name="dev", n=0), _score, set()),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("case", HOLDERS, ids=HOLDERS)
def test_what_an_attribute_holding_metric_objects_holds_besides_them_is_named_if_batches_change_it(case, layout):
    """``self.stats = {"wer": ErrorRateStats(), "n": 0}``: the metric object is merged,
    the attribute is not watched; before, ``stats["n"] += 1`` kept each rank's own
    count (and a count beside a metric object put in later lost the batch that put
    it), unnamed. What it holds besides metric objects is now named when a batch
    changes it; the metric object merges exactly either way."""
    make, batch, named = HOLDERS[case]
    single, holders, records, got = _one_process_and_named(make, batch, layout)
    assert got == named, got
    for name in named:
        why = next(r.report["unmergeable"][name] for r in records if name in r.report["unmergeable"])
        assert "holds metric objects" in why and "attribute of its own" in why, why
    holder_attr = "made" if named == {"made"} else "stats"
    want = getattr(single, holder_attr)["wer"].summarize("error_rate")
    assert all(getattr(h, holder_attr)["wer"].summarize("error_rate") == want for h in holders)


@pytest.mark.parametrize("case", HOLDERS, ids=HOLDERS)
def test_in_one_process_an_attribute_holding_metric_objects_keeps_every_batchs_change(case):
    """The mixin in one process (``finish_alone``): a count beside a metric object put
    in during the stage keeps the batch that put it (before: that batch's ``+= 1``
    was undone when the attribute engine stopped watching the dict)."""
    from ddp_eval.state.bookkeeping import StageBook
    make, batch, _ = HOLDERS[case]
    single, brain = make(), _brain(make)
    book = StageBook(brain, DDPEvalConfig())
    book.start()
    for b in range(5):
        batch(single, b)
        batch(brain, b)
        book.after_batch()
    book.finish_alone(range(5))
    del brain._ddp_brain_attributes
    for name, want in vars(single).items():
        got = getattr(brain, name)
        assert {k: v for k, v in got.items() if k != "wer"} == {k: v for k, v in want.items() if k != "wer"}
        assert got["wer"].summarize("error_rate") == want["wer"].summarize("error_rate")


class _Trackers:
    def __init__(self):
        self.wer, self.per = sb.utils.metric_stats.ErrorRateStats(), {"spk": sb.utils.metric_stats.ErrorRateStats()}
        self.n = 0


def _deeper():
    return types.SimpleNamespace(per_stage={"VALID": {"wer": sb.utils.metric_stats.ErrorRateStats()}},
                                 trackers=_Trackers(),
                                 hparams=types.SimpleNamespace(wer_stats=sb.utils.metric_stats.ErrorRateStats()))


def _deeper_metrics(h):
    return [h.per_stage["VALID"]["wer"], h.trackers.wer, h.trackers.per["spk"], h.hparams.wer_stats]


def _append_deeper(h, b):
    for metric in _deeper_metrics(h):
        metric.append([f"u{b}"], [["a", "b"]], [["a", "b" if b % 2 else "c"]])


def _put_deeper(h, b):  # a metric object put two levels down by a batch
    _append_deeper(h, b)
    h.per_stage["VALID"].setdefault("cer", sb.utils.metric_stats.ErrorRateStats()).append([f"u{b}"], [["a"]],
                                                                                           [["a"]])


def _replace_deeper(h, b):  # a metric object found at stage start replaced by a batch
    _append_deeper(h, b)
    if b == 1:
        h.trackers.wer = sb.utils.metric_stats.ErrorRateStats()


def _count_beside_deeper(h, b):  # a field beside metric objects in an object of the recipe's own
    _append_deeper(h, b)
    h.trackers.n += 1


def _past_64_deeper(h, b):  # the 65th metric object of a dict of stages: not found, so its holder is named
    h.per_stage["k64"]["wer"].append([f"u{b}"], [["a"]], [["a" if b % 2 else "b"]])


DEEPER = {  # make, batch, named (None: exact, every metric object equal to one process's)
    "held deeper": (_deeper, _append_deeper, None),
    "put by a batch": (_deeper, _put_deeper, {"per_stage[VALID][cer]", "per_stage"}),  # and its holder's rest
    "replaced by a batch": (_deeper, _replace_deeper, {"trackers.wer", "trackers"}),
    "count beside them": (_deeper, _count_beside_deeper, {"trackers"}),
    "past 64 entries": (lambda: types.SimpleNamespace(per_stage={
        **{f"k{i}": {"wer": sb.utils.metric_stats.ErrorRateStats()} for i in range(65)}}), _past_64_deeper,
        {"per_stage"}),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("case", DEEPER, ids=DEEPER)
def test_metric_objects_held_below_the_attributes_entries_merge_exactly_or_are_named(case, layout):
    """A metric object two levels into a dict (``self.metrics[stage]["wer"]``), in an
    object of the recipe's own and its dict (``self.trackers.wer``), or in ``hparams``
    (``!new:``) is found at stage start and merges exactly (before: its holder named,
    each rank its own; in ``hparams``, a warning). One a batch put there, took away or
    replaced is named, so is what else the holder holds when a batch changes it."""
    make, batch, named = DEEPER[case]
    single, holders, records, got = _one_process_and_named(make, batch, layout)
    if named is not None:
        assert got == named, got
        return
    assert not got, got
    for holder in holders:
        for mine, want in zip(_deeper_metrics(holder), _deeper_metrics(single)):
            assert (mine.ids, mine.summarize("error_rate")) == (want.ids, want.summarize("error_rate"))


@pytest.mark.parametrize("make, batch, named", [
    (lambda: types.SimpleNamespace(t=types.SimpleNamespace(inner=types.SimpleNamespace(
        wer=sb.utils.metric_stats.ErrorRateStats()))), lambda h, b: h.t.inner.wer.append(
        [f"u{b}"], [["a"]], [["a" if b % 2 else "b"]]), "t"),
    (lambda: types.SimpleNamespace(metrics={"VALID": [sb.utils.metric_stats.ErrorRateStats()]}),
     lambda h, b: h.metrics["VALID"][0].append([f"u{b}"], [["a"]], [["a" if b % 2 else "b"]]), "metrics"),
], ids=["object in an object", "list in a dict"])
def test_a_metric_object_held_where_ddp_eval_does_not_look_is_named_with_where_to_hold_it(make, batch, named):
    """A metric object deeper than ddp_eval looks (an object's object, a list in a dict)
    that batches append to is named, saying where metric objects are found."""
    _, records, _ = simulate_stage([[0, 3], [1, 2], []], lambda: _brain(make), batch, DDPEvalConfig())
    why = records[0].report["unmergeable"][named]
    assert "does not look for metric objects" in why and "self.trackers.wer" in why, why


def _shared_with_holder():
    ids = []
    return types.SimpleNamespace(ids=ids, stats={"wer": sb.utils.metric_stats.ErrorRateStats(), "ids": ids})


def _append_through_holder(h, b):
    _score(h, b)
    h.stats["ids"].append(b)


@pytest.mark.parametrize("layout", [[[0, 1, 2, 3]], *LAYOUTS.values()], ids=["one process", *LAYOUTS])
def test_a_list_an_attribute_and_a_holder_of_metric_objects_share_merges_through_either(layout):
    """``self.ids`` also held in ``self.stats = {"wer": ..., "ids": self.ids}`` and
    appended through ``self.stats["ids"]``: the holder's entry holds the list's
    recording copy for the stage, so the list merges exactly and stays shared. Before,
    the appends went to the list behind the copy's back and were lost at stage end,
    also in one process (``finish_alone``)."""
    n = sum(map(len, layout))
    if len(layout) == 1:
        from ddp_eval.state.bookkeeping import StageBook
        brain = _brain(_shared_with_holder)
        book = StageBook(brain, DDPEvalConfig())
        book.start()
        for b in range(n):
            _append_through_holder(brain, b)
            book.after_batch()
        book.finish_alone(range(n))
        holders = [brain]
    else:
        holders, records, _ = simulate_stage(layout, lambda: _brain(_shared_with_holder), _append_through_holder,
                                             DDPEvalConfig())
        assert not set().union(*(record.report["unmergeable"] for record in records))
    for holder in holders:
        assert holder.ids == list(range(n)) and holder.stats["ids"] is holder.ids
