"""Single-process tests: config validation, sharding, the pure merge, no-op without a group."""

import random
import types

import pytest
import speechbrain as sb
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import ddp_eval
from ddp_eval.metrics import MetricFinder, MetricRecorder, merge_metric_stats
from ddp_eval.sharding import ShardedBatchSampler, shard_batches
from tests import toy


@pytest.mark.parametrize("n,world", [(0, 3), (1, 4), (2, 3), (7, 2), (23, 4), (29, 3)])
def test_shards_cover_every_batch_once(n, world):
    shards = [shard_batches(n, r, world) for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_sharded_sampler_yields_the_single_process_batches():
    batches = BatchSampler(SequentialSampler(range(11)), 3, drop_last=False)
    samplers = [ShardedBatchSampler(batches, r, 3) for r in range(3)]
    by_position = {g: b for s in samplers for g, b in zip(s.global_batch_ids(), s)}
    assert [by_position[g] for g in range(len(batches))] == list(batches)
    assert [len(s) for s in samplers] == [len(list(s)) for s in samplers] == [1, 1, 2]


def test_shuffled_eval_loader_is_refused():
    with pytest.raises(ddp_eval.ConfigError, match="shuffle=True"):
        ddp_eval.shard_dataloader(DataLoader(list(range(4)), batch_size=2, shuffle=True))


@pytest.mark.parametrize("section,match", [
    ({"shard_tset": True}, "unknown option 'shard_tset'"),
    ({"shard_valid": "yes"}, "'shard_valid' expects true or false"),
    ({"collective_timeout": 0}, "'collective_timeout' expects a number"),
    ({"metrics_exclude": "wer"}, "'metrics_exclude' expects a list"),
    ([1, 2], "must be a mapping"),
])
def test_bad_config_fails_at_start_with_the_key(section, match, tmp_path):
    with pytest.raises(ddp_eval.ConfigError, match=match):
        toy.build(toy.DDPToyBrain, tmp_path, ddp_eval_opts=section)


def test_bad_checkpointer_option_names_allowed_values(tmp_path):
    with pytest.raises(ddp_eval.ConfigError, match=r"expects one of \['shared', 'node_local'\]"):
        ddp_eval.Checkpointer(tmp_path, storage="nfs")


def test_merge_restores_single_process_order_for_any_split():
    """Random per-batch appends split round-robin over ranks merge back exactly."""
    rng = random.Random(0)
    for world in (1, 2, 3, 4):
        single = sb.utils.metric_stats.ErrorRateStats()
        ranks = [types.SimpleNamespace(m=sb.utils.metric_stats.ErrorRateStats()) for _ in range(world)]
        recorders = [MetricRecorder(MetricFinder(), h) for h in ranks]
        n_batches = rng.randint(0, 9)
        for g in range(n_batches):
            ids = [f"u{g}-{i}" for i in range(rng.randint(1, 3))]
            hyp = [[rng.choice("ab")] for _ in ids]
            ref = [[rng.choice("ab"), "c"] for _ in ids]
            single.append(ids, hyp, ref)
            owner = ddp_eval.sharding.batch_owner(g, world)
            ranks[owner].m.append(ids, hyp, ref)
            recorders[owner].after_batch(ranks[owner])
        states = [rec.finish(h, shard_batches(n_batches, r, world))
                  for r, (rec, h) in enumerate(zip(recorders, ranks))]
        merged = merge_metric_stats(states)
        for rec, h in zip(recorders, ranks):
            ddp_eval.metrics.apply_merged(rec.objects, rec.start, merged)
            assert h.m.ids == single.ids
            assert h.m.scores == single.scores
            if n_batches:
                assert h.m.summarize() == single.summarize()


def test_without_process_group_mixin_changes_nothing(tmp_path):
    plain = toy.run_recipe(toy.build(toy.ToyBrain, tmp_path / "a",
                                     checkpointer_cls=sb.utils.checkpoints.Checkpointer))
    mixed = toy.run_recipe(toy.build(toy.DDPToyBrain, tmp_path / "b"))
    assert repr(plain["log"]) == repr(mixed["log"])
    for key in ("test_loss", "tiny_loss", "ready_loss", "ready_sharded_loss"):
        assert plain[key] == mixed[key]


def test_command_line_override_of_the_ddp_eval_section():
    from hyperpyyaml import load_hyperpyyaml

    _, _, overrides = sb.parse_arguments(
        ["hparams.yaml", "--ddp_eval={shard_test: false, collective_timeout: 30}"])
    hparams = load_hyperpyyaml("ddp_eval:\n    shard_valid: true\n    shard_test: true\n", overrides)
    cfg = ddp_eval.DDPEvalConfig.from_hparams(hparams)
    assert (cfg.shard_valid, cfg.shard_test, cfg.collective_timeout) == (True, False, 30)


def _simulate_ranks(make_objects, append, n_batches, world):
    """Single-process: deal batches to simulated ranks, merge, return merged objects per rank."""
    single = make_objects()
    ranks = [make_objects() for _ in range(world)]
    holders = [types.SimpleNamespace(**objs) for objs in ranks]
    recorders = [MetricRecorder(MetricFinder(), h) for h in holders]
    for g in range(n_batches):
        append(single, g)
        owner = ddp_eval.sharding.batch_owner(g, world)
        append(ranks[owner], g)
        recorders[owner].after_batch(holders[owner])
    states = [rec.finish(h, shard_batches(n_batches, r, world))
              for r, (rec, h) in enumerate(zip(recorders, holders))]
    merged = merge_metric_stats(states)
    for rec in recorders:
        ddp_eval.metrics.apply_merged(rec.objects, rec.start, merged)
    return single, ranks


def test_weighted_error_rate_and_base_stats_held_twice_merge_once():
    def make():
        base = sb.utils.metric_stats.ErrorRateStats()
        weighted = sb.utils.metric_stats.WeightedErrorRateStats(base, lambda e, a, b: 0.5)
        return {"base": base, "weighted": weighted}

    def append(objs, g):
        objs["base"].append([f"u{g}"], [["a", "b"][: 1 + g % 2]], [["a", "c"]])

    single, ranks = _simulate_ranks(make, append, 5, 3)
    for objs in ranks:
        assert objs["base"].ids == single["base"].ids  # not duplicated
        assert objs["weighted"].summarize() == single["weighted"].summarize()


def test_multimetric_on_a_rank_with_no_batches_gets_every_key():
    def make():
        return {"multi": sb.utils.metric_stats.MultiMetricStats(
            lambda a, b: {"sum": a + b, "diff": a - b}, batch_eval=True)}

    def append(objs, g):
        objs["multi"].append([f"u{g}"], a=torch.tensor([float(g)]), b=torch.tensor([1.0]))

    single, ranks = _simulate_ranks(make, append, 1, 2)  # rank 1 evaluates nothing
    for objs in ranks:
        assert objs["multi"].summarize() == single["multi"].summarize()


# -- plain Brain attributes: hand-made per-rank states ------------------------

INF = float("inf")


def test_attribute_merge_puts_lists_and_dicts_in_global_batch_order():
    from ddp_eval.attributes import merge_attribute_states

    # 4 batches dealt 0, 1, 1, 0; rank 1 appended nothing in batch 2
    rank0 = {"acc": ("append", ([0, 3], [1, 2], ["a", "d1", "d2"])),
             "pred": ("keys", ([0, 3], [1, 1], [("u0", 1), ("u3", 0)], {"old": 9}))}
    rank1 = {"acc": ("append", ([1], [1], ["b"])),
             "pred": ("keys", ([1, 2], [1, 1], [("u1", 2), ("u2", 2)], {}))}
    merged = merge_attribute_states([rank0, rank1])
    assert merged["acc"] == ("append", ["a", "b", "d1", "d2"])
    assert merged["pred"] == ("keys", ([("u0", 1), ("u1", 2), ("u2", 2), ("u3", 0)], {"old": 9}))


def test_attribute_merge_sums_counters_and_orders_float_increments():
    from ddp_eval.attributes import merge_attribute_states

    rank0 = {"n": ("sum", 3), "total": ("accumulate", ("batches", [0, 2], [0.1, 0.3]))}
    rank1 = {"n": ("sum", 2), "total": ("accumulate", ("batches", [1, INF], [0.2, 0.0]))}
    rank2 = {}  # a rank without a batch changed nothing
    merged = merge_attribute_states([rank0, rank1, rank2])
    assert merged["n"] == ("sum", 5)
    assert merged["total"] == ("accumulate", [0.1, 0.2, 0.3, 0.0])


def test_attribute_merge_over_budget_adds_one_total_per_rank_in_rank_order():
    from ddp_eval.attributes import merge_attribute_states

    rank0 = {"t": ("accumulate", ("total", torch.tensor([1.0])))}
    rank1 = {"t": ("accumulate", ("batches", [1, 3], [torch.tensor([2.0]), torch.tensor([4.0])]))}
    kind, totals = merge_attribute_states([rank0, rank1])["t"]
    assert kind == "accumulate" and [float(t) for t in totals] == [1.0, 6.0]


@pytest.mark.parametrize("states,match", [
    ([{"d": ("keys", ([0], [1], [("u1", 1)], {}))},
      {"d": ("keys", ([1], [1], [("u1", 2)], {}))}], "key 'u1' of dict attribute 'd' was set by more"),
    ([{"d": ("keys", ([], [], [], {"u1": 1}))},
      {"d": ("keys", ([], [], [], {"u1": 2}))}], "key 'u1' of dict attribute 'd' was set by more"),
    ([{"x": ("sum", 1)},
      {"x": ("accumulate", ("batches", [1], [0.5]))}], "'x' changed as 'sum' on one rank and as 'accumulate'"),
])
def test_attribute_merge_refuses_what_one_process_could_not_hold(states, match):
    from ddp_eval.attributes import merge_attribute_states

    with pytest.raises(ddp_eval.ConfigError, match=match):
        merge_attribute_states(states)


def test_attribute_tracker_follows_each_batch_without_copying_unchanged_tensors():
    from ddp_eval.attributes import AttributeTracker

    h = types.SimpleNamespace(items=[], count=0, flag=False, replaced=[], vec=torch.zeros(2),
                              table=torch.arange(6.0), counts=torch.zeros(3, dtype=torch.long),
                              seen={"old": 1})
    targets = lambda: {n: (h, n) for n in vars(h)}  # noqa: E731
    tracker = AttributeTracker(targets())
    versions = {"table": h.table._version}
    for batch in range(3):
        h.items.append(batch)
        h.count += 2
        h.vec += 1.0
        h.counts[batch] += 5
        h.replaced = [batch]
        h.seen[f"u{batch}"] = batch
        if batch == 1:
            h.late = 10  # created during the stage
            h.seen["old"] = 2  # a value replaced
        tracker.add(targets())
        tracker.after_batch()
    h.flag = True
    kinds, unmergeable, state = tracker.finish([0, 3, 6])
    assert kinds == {"count": "sum", "counts": "sum", "items": "append", "late": "sum",
                     "seen": "keys", "vec": "accumulate"}
    assert set(unmergeable) == {"flag", "replaced"}
    assert state["items"] == ("append", ([0, 3, 6], [1, 1, 1], [0, 1, 2]))
    assert state["seen"] == ("keys", ([0, 3, 6], [1, 1, 1], [("u0", 0), ("u1", 1), ("u2", 2)], {"old": 2}))
    assert state["late"] == ("sum", 10)
    assert state["counts"][1].tolist() == [5, 5, 5]  # one increment per rank, not per batch
    places, increments = state["vec"][1][1:]
    assert places == [0, 3, 6] and [i.tolist() for i in increments] == [[1.0, 1.0]] * 3
    assert "table" not in state and h.table._version == versions["table"]  # never changed


def test_attribute_tracker_applies_a_merge_on_a_rank_that_had_nothing():
    from ddp_eval.attributes import AttributeTracker

    other = types.SimpleNamespace(items=["kept"], count=0, vec=torch.zeros(2), seen={"old": 1})
    tracker = AttributeTracker({n: (other, n) for n in vars(other)})
    tracker.finish([])
    tracker.apply({"items": ("append", [0, 1]), "count": ("sum", 4), "late": ("sum", 10),
                   "vec": ("accumulate", [torch.ones(2)] * 3),
                   "seen": ("keys", ([("u0", 0)], {"old": 2}))},
                  locate=lambda label: (other, label))
    assert other.items == ["kept", 0, 1] and other.count == 4 and other.late == 10
    assert other.vec.tolist() == [3.0, 3.0]
    assert list(other.seen.items()) == [("old", 2), ("u0", 0)]


def test_float_tensor_increments_over_the_budget_fall_back_to_one_total(caplog):
    from ddp_eval.attributes import AttributeTracker

    h = types.SimpleNamespace(acc=torch.zeros(1024, dtype=torch.float64))  # 8 kB per increment
    tracker = AttributeTracker({"acc": (h, "acc")}, budget_mb=20 / 1024)  # room for 2
    with caplog.at_level("WARNING"):
        for _ in range(5):
            h.acc += 0.5
            tracker.after_batch()
    kinds, _, state = tracker.finish([0, 1, 2, 3, 4])
    assert state["acc"][1][0] == "total" and state["acc"][1][1].unique().tolist() == [2.5]
    assert tracker.used_bytes == 0
    assert caplog.text.count("'acc' exceed ddp_eval: attribute_memory_mb") == 1
    assert "2 (n + N) eps max|value|" in caplog.text


def test_metric_finder_scans_only_what_a_container_gained():
    finder = MetricFinder()
    h = types.SimpleNamespace(scores=[0.0] * 10, metrics={"a": sb.utils.metric_stats.ErrorRateStats()})
    assert list(finder.find(h)) == ["metrics[a]"]

    class Exploding(list):
        def __getitem__(self, index):
            if isinstance(index, int) and index < 10:
                raise AssertionError(f"old item {index} scanned again")
            return super().__getitem__(index)

    h.scores = Exploding(h.scores)
    finder.find(h)  # a new list: scanned once
    h.scores.append(sb.utils.metric_stats.ErrorRateStats())
    assert list(finder.find(h)) == ["metrics[a]", "scores[10]"]
    h.metrics["a"] = sb.utils.metric_stats.ErrorRateStats()  # replaced: the new one is found
    assert finder.find(h)["metrics[a]"] is h.metrics["a"]


def test_journal_pieces_merge_to_the_whole_stage():
    """A rank's pieces (cut every 3 batches) merge to what its whole-stage state merges to."""
    from ddp_eval.attributes import AttributeTracker, merge_attribute_states

    h = types.SimpleNamespace(err=sb.utils.metric_stats.ErrorRateStats(), acc=sb.utils.Accuracy.AccuracyStats(),
                              items=[], seen={"old": 0}, n=0, total=0.0, counts=torch.zeros(4, dtype=torch.long),
                              vec=torch.zeros(3, dtype=torch.float64))
    recorder = MetricRecorder(MetricFinder(), h)
    tracker = AttributeTracker({n: (h, n) for n in ("items", "seen", "n", "total", "counts", "vec")})
    positions = [3 * b + 1 for b in range(10)]
    metric_pieces, attribute_pieces = [], []
    for b in range(10):
        h.err.append([f"u{b}"], [["a", "b"][: 1 + b % 2]], [["a", "c"]])
        h.acc.append(torch.randn(1, 1, 3).log_softmax(-1), torch.tensor([[b % 3]]), torch.ones(1))
        h.items.append(b)
        h.seen[f"u{b}"] = b
        if b == 4:
            h.seen["old"] = 4  # a replaced value
        h.n += b
        h.total += 0.1 * b
        h.counts[b % 4] += 1
        h.vec += b * 0.5
        recorder.after_batch(h)
        tracker.after_batch()
        if b % 3 == 2:
            metric_pieces.append(recorder.piece(positions))
            attribute_pieces.append(tracker.piece(positions))
    metric_pieces.append(recorder.piece(positions))
    attribute_pieces.append(tracker.piece(positions))
    whole_metrics = merge_metric_stats([recorder.finish(h, positions)])
    assert merge_metric_stats(metric_pieces) == whole_metrics
    whole = merge_attribute_states([tracker.finish(positions)[2]])
    pieced = merge_attribute_states(attribute_pieces)
    assert pieced["items"] == whole["items"] and pieced["seen"] == whole["seen"] and pieced["n"] == whole["n"]
    assert pieced["seen"][1][1] == {"old": 4}
    assert torch.equal(pieced["counts"][1], whole["counts"][1])
    assert [float(x) for x in pieced["total"][1]] == [float(x) for x in whole["total"][1]]
    assert torch.equal(torch.stack(list(pieced["vec"][1])), torch.stack(list(whole["vec"][1])))


def test_tensors_are_copied_only_when_their_start_value_is_needed():
    from ddp_eval.attributes import AttributeTracker

    h = types.SimpleNamespace(prior=torch.arange(1.0, 257.0),      # 1 kB, never changed
                              table=torch.arange(1.0, 257.0),      # changed in place
                              moved=torch.arange(1.0, 257.0),      # reassigned, never in place
                              acc=torch.zeros(256, dtype=torch.float64))  # a fresh accumulator
    tracker = AttributeTracker({n: (h, n) for n in vars(h)}, budget_mb=0.0)  # room for no copy at all
    assert all(t.base is None for t in tracker.tracks.values())  # nothing copied at stage start
    h.table += 1
    h.moved = h.moved + 1
    h.acc += 0.5
    tracker.after_batch()
    kinds, unmergeable, state = tracker.finish([4])
    assert "prior" not in kinds and "prior" not in unmergeable  # unchanged: no copy, nothing to report
    assert "no room for its start copy" in unmergeable["table"] and "attributes_exclude" in unmergeable["table"]
    assert kinds == {"acc": "accumulate", "moved": "accumulate"}  # the start object, or zeros, suffice
    assert state["moved"][1][0] == "total" and state["moved"][1][1].unique().tolist() == [1.0]
    assert state["acc"][1][0] == "total" and state["acc"][1][1].unique().tolist() == [0.5]
