"""Single-process tests: config validation, sharding, the pure merge, no-op without a group."""

import random
import types

import pytest
import speechbrain as sb
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import ddp_eval
from ddp_eval.stage.sharding import ShardedBatchSampler, shard_batches
from ddp_eval.state.bookkeeping import simulate
from ddp_eval.state.metrics import MetricFinder
from tests import toy

pytestmark = pytest.mark.fast


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
        n_batches = rng.randint(0, 9)
        batches = []
        for g in range(n_batches):
            ids = [f"u{g}-{i}" for i in range(rng.randint(1, 3))]
            batches.append((ids, [[rng.choice("ab")] for _ in ids], [[rng.choice("ab"), "c"] for _ in ids]))

        def make():
            return {"m": sb.utils.metric_stats.ErrorRateStats()}

        def append(objs, g, batches=batches):
            objs["m"].append(*batches[g])

        single, ranks = _simulate_ranks(make, append, n_batches, world)
        for objs in ranks:
            assert objs["m"].ids == single["m"].ids
            assert objs["m"].scores == single["m"].scores
            if n_batches:
                assert objs["m"].summarize() == single["m"].summarize()


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
    """Single-process: deal batches to simulated ranks (the stage's own record,
    merge and apply, :func:`ddp_eval.state.bookkeeping.simulate`); returns the
    objects one process holds and those of each rank after the merge."""
    class Holder:
        def __init__(self):
            self._ddp_brain_attributes = frozenset()
            vars(self).update(make_objects())

    single = Holder()
    for g in range(n_batches):
        append(vars(single), g)
    layout = [shard_batches(n_batches, r, world) for r in range(world)]
    holders, records, _ = simulate(layout, Holder, lambda h, g: append(vars(h), g), ddp_eval.DDPEvalConfig())
    assert not any(r.report["unmergeable"] for r in records)
    return vars(single), [vars(h) for h in holders]


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


def test_append_watch_sees_the_batch_loop_thread_only(tmp_path):
    """A file a data-loading or logging thread appends to during a stage is not the
    recipe's per-batch file (issue 27)."""
    import threading

    from ddp_eval.stage._effects import AppendWatch

    watch = AppendWatch()
    with watch:
        other = threading.Thread(target=lambda: open(tmp_path / "log.txt", "a").close())
        other.start()
        other.join()
        with open(tmp_path / "predictions.jsonl", "a"):
            pass
    assert list(watch.paths) == [str(tmp_path / "predictions.jsonl")]


def test_a_journal_piece_of_the_old_layout_is_refused_with_a_clear_reason(tmp_path):
    """0.3 pickled its attribute changes as ddp_eval.values.Change: 0.4 moved the module
    (issue 27) and raised the journal format; such a piece is evaluated again, said why."""
    import pickle
    import sys

    from ddp_eval.stage import _journal

    old = types.ModuleType("ddp_eval.values")

    class Change:
        pass

    Change.__module__, Change.__qualname__ = "ddp_eval.values", "Change"
    old.Change = Change
    sys.modules["ddp_eval.values"] = old
    try:
        blob = pickle.dumps({"format": 2, "attributes": Change()})
    finally:
        del sys.modules["ddp_eval.values"]
    piece = tmp_path / "piece.pkl"
    piece.write_bytes(blob)
    found, why = _journal._read(piece)
    assert found is None and "written by an older ddp_eval" in why and "evaluated again" in why


def test_fingerprint_shares_cover_the_model_once_and_give_the_whole_fingerprint():
    from ddp_eval.stage._model import fingerprint_share, model_fingerprint, model_tensors, tensor_crc

    torch.manual_seed(0)
    lm = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    tied = torch.nn.Linear(16, 50)
    tied.weight = lm[1].weight  # a tensor two modules hold is read once
    tensors = model_tensors([toy.make_model(batchnorm=True), lm, tied])
    assert len(tensors) == 9 + 3 + 1  # toy model with BatchNorm, the LM, the tied layer's bias
    whole = model_fingerprint(tensors)
    sizes = [t.numel() * t.element_size() for _, t, _ in tensors]
    for world_size in range(1, 6):
        shares = [fingerprint_share(tensors, rank, world_size) for rank in range(world_size)]
        assert sorted(i for share in shares for i in share) == list(range(len(tensors)))
        assert all(i in shares[0] for i, (_, _, is_buffer) in enumerate(tensors) if is_buffer)
        loads = [sum(sizes[i] for i in share) for share in shares]
        assert max(loads) - min(loads) <= max(sizes)  # spread by bytes, largest first
        crcs = {i: tensor_crc(tensors[i][1]) for share in shares for i in share}
        assert model_fingerprint(tensors, crcs) == whole
    with torch.no_grad():
        lm[0].weight[3, 3] += 1
    assert model_fingerprint(tensors) != whole
