"""FSDP (``ddp_eval: {fsdp: ...}``) on real gloo groups: training equals DDP,
sharded evaluation equals one process, sharded checkpoints load at any world size."""

import math
import time
from collections import Counter

import pytest
import speechbrain as sb
import torch

import ddp_eval
import ddp_eval.inspect
from ddp_eval.distributed import fsdp
from tests import fsdp_workers, toy
from tests.mp_harness import results, run_ranks

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(fsdp.support_problem() is not None, reason=str(fsdp.support_problem()))]


def _same_records(dist_log, single_log):
    assert [r["stage"] for r in dist_log] == [r["stage"] for r in single_log]
    for d, s in zip(dist_log, single_log):
        if d["stage"] == "TRAIN":
            continue
        assert d["loss"] == s["loss"], (d["stage"], d["loss"], s["loss"])  # bit for bit
        # summaries, write_stats text and utterance order: bit for bit
        assert repr(d["metrics"]) == repr(s["metrics"])


def _single_process(tmp_path, brain_cls):
    brain = toy.build(brain_cls, tmp_path / "single", checkpointer_cls=sb.utils.checkpoints.Checkpointer)
    return toy.run_recipe(brain)


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.fast), 3])
def test_sharded_evaluation_under_fsdp_equals_one_process(world_size, tmp_path):
    """The toy recipe with its Linear layers sharded on their own: every VALID/TEST
    stage (uneven shards; at 3 ranks one rank has no batch of the 2-utterance set)
    equals plain SpeechBrain in one process, and each utterance is evaluated once."""
    single = _single_process(tmp_path, toy.ToyBrain)
    per_rank = results(run_ranks(fsdp_workers.recipe, world_size, str(tmp_path / "ckpt"), timeout=90))
    for out in per_rank:
        assert out["sharded"] == (True, True)  # the model and its optimizer are FSDP's
        _same_records(out["log"], single["log"])
        for key in ("test_loss", "tiny_loss", "ready_loss", "ready_sharded_loss"):
            assert math.isclose(out[key], single[key], rel_tol=1e-6), key
    for name in ("fit", "test", "tiny", "ready"):
        assert Counter(i for out in per_rank for i in out["seen"][name]) == Counter(single["seen"][name]), name


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_decoder_with_data_dependent_forward_calls_neither_hangs_nor_differs(world_size, tmp_path):
    """Ranks make different numbers of forward calls (1-3 per batch, by the data) and
    have different numbers of batches: a plain FSDP loop would wait forever in an
    all-gather; ddp_eval's stage gathers once at its start, so it finishes and equals one process."""
    single = _single_process(tmp_path, fsdp_workers.DecoderBrain)
    per_rank = results(run_ranks(fsdp_workers.recipe, world_size, str(tmp_path / "ckpt"), fsdp_workers.SHARD_LINEARS,
                                 fsdp_workers.DDPDecoderBrain, timeout=90))
    for out in per_rank:
        _same_records(out["log"], single["log"])
        assert math.isclose(out["test_loss"], single["test_loss"], rel_tol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_training_under_fsdp_equals_training_under_ddp(world_size, tmp_path):
    """Three epochs at lr 0.05: every step's loss on every rank, the VALID losses and
    the final parameters and optimizer state under FSDP equal DDP's within float tolerance."""
    ddp = results(run_ranks(fsdp_workers.train_steps, world_size, str(tmp_path / "ddp"), {}, timeout=90))
    sharded = results(run_ranks(fsdp_workers.train_steps, world_size, str(tmp_path / "fsdp"),
                                fsdp_workers.SHARD_LINEARS, timeout=90))
    for d, f in zip(ddp, sharded):
        assert len(f["steps"]) == len(d["steps"]) >= 3 * 24 // (4 * world_size)
        assert f["steps"] == pytest.approx(d["steps"], rel=1e-5, abs=1e-6)
        assert f["valid"] == pytest.approx(d["valid"], rel=1e-5)
        for name, value in d["state"]["model"].items():
            torch.testing.assert_close(f["state"]["model"][name], value, rtol=1e-4, atol=2e-5)  # Adam amplifies order
    assert sharded[0]["valid"][0] != sharded[0]["valid"][-1]  # the model did learn


def test_sharded_checkpoints_resume_at_any_world_size_and_into_ddp(tmp_path):
    """Saved at 2 ranks under FSDP (every rank its shard, inside the atomic commit),
    the checkpoint is complete (its full state equals what the ranks held), and it
    resumes at 3 ranks under FSDP, in one process, and under DDP; a DDP checkpoint
    resumes under FSDP."""
    folder = str(tmp_path / "ckpt")
    trained = results(run_ranks(fsdp_workers.train_steps, 2, folder, fsdp_workers.SHARD_LINEARS, 2, timeout=90))[0]
    checkpointer = ddp_eval.Checkpointer(folder, {"model": toy.make_model()})
    newest = checkpointer.find_checkpoint()  # the last end-of-epoch checkpoint: written after the last step
    assert sorted(p.name for p in newest.path.iterdir() if p.suffix == ".dcp") == ["model.dcp", "optimizer.dcp"]
    saved = ddp_eval.load_full_state_dict(newest.paramfiles["model"])
    for name, value in trained["state"]["model"].items():
        assert torch.equal(saved[name], value), name

    def same_state(got):
        for name, value in trained["state"]["model"].items():
            assert torch.equal(got["model"][name], value), name
        assert set(got["optimizer"]) == set(trained["state"]["optimizer"]) and got["optimizer"]  # Adam's state
        for name, value in trained["state"]["optimizer"].items():
            for key, tensor in value.items():
                assert torch.equal(torch.as_tensor(got["optimizer"][name][key]), torch.as_tensor(tensor)), (name, key)

    for world_size, opts in ((3, fsdp_workers.SHARD_LINEARS), (1, {}), (2, {})):
        per_rank = results(run_ranks(fsdp_workers.resume, world_size, folder, opts, timeout=90))
        for out in per_rank:
            assert out["sharded"] == (world_size > 1 and bool(opts))
            assert out["epoch"] == 2 and out["loaded"] == newest.path.name
            same_state(out["state"])
    # a checkpoint DDP wrote (plain .ckpt files, the optimizer's state by position) resumes under FSDP
    ddp_folder = str(tmp_path / "ddp")
    ddp_trained = results(run_ranks(fsdp_workers.train_steps, 2, ddp_folder, {}, 1, timeout=90))[0]
    for out in results(run_ranks(fsdp_workers.resume, 2, ddp_folder, fsdp_workers.SHARD_LINEARS, timeout=90)):
        assert out["sharded"] and out["epoch"] == 1
        for name, value in ddp_trained["state"]["model"].items():
            assert torch.equal(out["state"]["model"][name], value), name


def test_average_of_sharded_checkpoints(tmp_path):
    """SpeechBrain's average_checkpoints over sharded checkpoints, each read whole
    once by one process (``parameter_loader=ddp_eval.load_full_state_dict``)."""
    folder = str(tmp_path / "ckpt")
    results(run_ranks(fsdp_workers.train_steps, 2, folder, fsdp_workers.SHARD_LINEARS, 3, timeout=90))
    checkpointer = ddp_eval.Checkpointer(folder, {"model": toy.make_model()})
    found = checkpointer.find_checkpoints(max_num_checkpoints=2)
    assert len(found) == 2
    average = sb.utils.checkpoints.average_checkpoints(found, "model",
                                                       parameter_loader=ddp_eval.load_full_state_dict)
    each = [ddp_eval.load_full_state_dict(c.paramfiles["model"]) for c in found]
    for name in each[0]:
        torch.testing.assert_close(average[name], (each[0][name] + each[1][name]) / 2)
    assert not torch.equal(each[0]["0.weight"], each[1]["0.weight"])
    # a checkpoint missing one rank's shard is never listed, loaded or averaged
    newest = checkpointer.find_checkpoint()
    shard = sorted((newest.path / "model.dcp").glob("__1_*.distcp"))[0]
    shard.unlink()
    assert newest.path.name not in [c.path.name for c in checkpointer.find_checkpoints()]


def test_an_exception_in_a_forward_on_one_rank_is_raised_on_every_rank(tmp_path):
    """Rank 1 fails inside a forward of a sharded FSDP TEST stage: every rank raises,
    naming it, well within the test's deadline (no rank waits in an all-gather)."""
    start = time.monotonic()
    outcomes = run_ranks(fsdp_workers.fail_in_forward, 3, str(tmp_path), 1, timeout=120)
    assert f"{outcomes[1]['error']}: {outcomes[1]['message']}" == "RuntimeError: bad utterance on purpose"
    for rank in (0, 2):
        assert outcomes[rank]["error"] == "RankFailedError", outcomes[rank]
        assert "rank 1 failed at 'evaluate' with RuntimeError: bad utterance on purpose" in outcomes[rank]["message"]
    assert time.monotonic() - start < 60


def test_fsdp_options_are_checked_at_start_up():
    with pytest.raises(ddp_eval.ConfigError, match="fsdp.shard_modules"):
        ddp_eval.DDPEvalConfig.from_hparams({"ddp_eval": {"fsdp": {"shard_modules": "Linear"}}})
    with pytest.raises(ddp_eval.ConfigError, match="unknown option"):
        ddp_eval.DDPEvalConfig.from_hparams({"ddp_eval": {"fsdp": {"reshard": True}}})
    with pytest.raises(ddp_eval.ConfigError, match="mixed_precision"):
        ddp_eval.DDPEvalConfig.from_hparams({"ddp_eval": {"fsdp": {"mixed_precision": {"param_dtype": "fp8"}}}})


def test_a_training_forward_failing_on_one_rank_is_named_on_every_rank(tmp_path):
    """Rank 1 fails inside a TRAIN forward while the others wait inside FSDP's
    collectives (not a ddp_eval one). As under torchrun, the failing process
    leaves (fresh processes): the others' collective breaks, and they raise rank
    1's failure, named, not gloo's "connection closed", within seconds."""
    start = time.monotonic()
    outcomes = run_ranks(fsdp_workers.fail_in_training_forward, 3, str(tmp_path), 1, timeout=60, fresh=True)
    assert f"{outcomes[1]['error']}: {outcomes[1]['message']}" == "RuntimeError: bad batch on purpose"
    for rank in (0, 2):
        assert outcomes[rank]["error"] == "RankFailedError", outcomes[rank]
        assert "rank 1 failed at 'fit' with RuntimeError: bad batch on purpose" in outcomes[rank]["message"]
    assert time.monotonic() - start < 45


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_full_disk_in_one_rank_shard_write_fails_on_every_rank_and_keeps_the_previous_checkpoint(bad_rank, tmp_path):
    outcomes = run_ranks(fsdp_workers.full_disk_in_a_shard_write, 2, str(tmp_path), bad_rank, timeout=90)
    for rank, outcome in enumerate(outcomes):  # DCP raised the failure on every rank: each says so
        assert outcome.get("error") == "CheckpointWriteError", outcome
        assert f"rank {rank} could not write its shards" in outcome["message"], outcome
        assert "No space left on device (injected)" in outcome["message"], outcome
    folder = ddp_eval.inspect.describe_folder(tmp_path)
    complete = [e for e in folder["checkpoints"] if e["status"] == "complete"]
    assert len(complete) == 1 and "second" not in complete[0]["meta"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ddp_eval-tmp")]  # the work dir removed
    assert {"model", "optimizer"} <= set(folder["required"])  # a sharded recoverable is required as any


def test_async_sharded_saves_hold_the_state_at_call_time_and_resume(tmp_path):
    """With async_save every rank copies its shards during the call and writes them in
    the background (the writer then commits): a change right after the call is not
    in the checkpoint, which resumes at 3 ranks and in one process."""
    folder = str(tmp_path / "ckpt")
    per_rank = results(run_ranks(fsdp_workers.async_saves, 2, folder, timeout=90))
    assert all(out["background_s"] is not None for out in per_rank)  # every rank wrote in the background
    saved = per_rank[0]
    final = ddp_eval.Checkpointer(folder, {"model": toy.make_model()}).find_checkpoint(
        ckpt_predicate=lambda c: "final" in c.meta)
    assert str(final.path) == saved["path"]
    full = ddp_eval.load_full_state_dict(final.paramfiles["model"])
    for name, value in saved["state"]["model"].items():
        assert torch.equal(full[name], value), name
    for world_size, opts in ((3, fsdp_workers.SHARD_LINEARS), (1, {})):
        for out in results(run_ranks(fsdp_workers.resume, world_size, folder, opts, timeout=90)):
            assert out["loaded"] == final.path.name
            for name, value in saved["state"]["model"].items():
                assert torch.equal(out["state"]["model"][name], value), name


# (saved at world size, with options) -> (resumed at world size, with options): every direction
# between DDP, FSDP and one process, at 1, 2 and 3 ranks (issue 38)
DIRECTIONS = {
    "ddp2-to-fsdp3": ((2, {}), (3, fsdp_workers.SHARD_LINEARS)),
    "fsdp3-to-ddp2": ((3, fsdp_workers.SHARD_LINEARS), (2, {})),
    "fsdp2-to-one": ((2, fsdp_workers.SHARD_LINEARS), (1, {})),
    "one-to-fsdp2": ((1, {}), (2, fsdp_workers.SHARD_LINEARS)),
}


@pytest.mark.parametrize("direction", [pytest.param("ddp2-to-fsdp3", marks=pytest.mark.fast), "fsdp3-to-ddp2",
                                       "fsdp2-to-one", "one-to-fsdp2"])
def test_param_group_entries_of_schedulers_survive_resume_in_every_direction(direction, tmp_path):
    """A recipe with NewBob (``prev_lr``), Noam, linear warm-up and torch's StepLR
    (``initial_lr``) and a param-group entry of its own, saved under one setup and
    resumed under another: every entry of every group equal to the save's, and
    every tensor of the optimizer's state (issue 38: DDP -> FSDP failed with
    ``KeyError: 'param_groups.0.prev_lr'``; FSDP -> DDP dropped the entries). Saved
    under FSDP at 3 ranks, rank 2 has no VALID batch: the next epoch's training must
    not deadlock on the evaluation forwards FSDP recorded on the other ranks."""
    (save_ws, save_opts), (load_ws, load_opts) = DIRECTIONS[direction]
    folder = str(tmp_path / "ckpt")
    saved = results(run_ranks(fsdp_workers.scheduled_training, save_ws, folder, save_opts, timeout=90))[0]
    assert saved["sharded"] == bool(save_opts)
    assert {"prev_lr", "initial_lr", "recipe_epoch"} <= set(saved["groups"][0])
    for out in results(run_ranks(fsdp_workers.scheduled_resume, load_ws, folder, load_opts, timeout=90)):
        assert out["sharded"] == bool(load_opts)
        assert out["groups"] == saved["groups"]
        assert [{k: type(v) for k, v in g.items()} for g in out["groups"]] == [
            {k: type(v) for k, v in g.items()} for g in saved["groups"]]  # betas stays a tuple
        assert set(out["state"]["optimizer"]) == set(saved["state"]["optimizer"])
        for name, value in saved["state"]["optimizer"].items():
            for key, tensor in value.items():
                assert torch.equal(torch.as_tensor(out["state"]["optimizer"][name][key]), torch.as_tensor(tensor))
        for name, value in saved["state"]["model"].items():
            assert torch.equal(out["state"]["model"][name], value), name


def test_an_optimizer_that_cannot_take_the_checkpoint_is_named_with_both_sides(tmp_path):
    """A checkpoint of an optimizer with one parameter group resumed into one with two:
    the error names what the checkpoint holds and what the optimizer has, and what to do."""
    folder = str(tmp_path / "ckpt")
    results(run_ranks(fsdp_workers.scheduled_training, 2, folder, fsdp_workers.SHARD_LINEARS, timeout=90))
    outcomes = run_ranks(fsdp_workers.resume_into_two_groups, 2, folder, fsdp_workers.SHARD_LINEARS, timeout=90)
    for outcome in outcomes:
        assert outcome["error"] == "CheckpointLoadError", outcome
        assert "has 1 parameter group(s), this Adam has 2: expected the same groups" in outcome["message"]


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.fast), 3])
def test_fsdp_under_speechbrain_debug_saves_in_one_folder_and_evaluates_exactly(world_size, tmp_path):
    """SpeechBrain's --debug gives each rank a temporary checkpoint folder of its own;
    a sharded save in on_stage_end needs one (issue 38: CheckpointWriteError on every
    rank). Every rank uses rank 0's: the checkpoints there hold every shard, the
    recipe's folder stays empty, evaluate(min_key) loads one, and every VALID/TEST
    equals one process under --debug."""
    single = toy.run_recipe(toy.build(toy.ToyBrain, tmp_path / "single", run_opts=fsdp_workers.DEBUG,
                                      checkpointer_cls=sb.utils.checkpoints.Checkpointer))
    per_rank = results(run_ranks(fsdp_workers.debug_recipe, world_size, str(tmp_path / "ranks"), timeout=120))
    assert len({out["folder"] for out in per_rank}) == 1
    assert per_rank[0]["folder"] != str(tmp_path / "ranks")
    assert not (tmp_path / "ranks").exists() or not any((tmp_path / "ranks").iterdir())
    for out in per_rank:
        assert out["checkpoints"] and out["shards"] == sorted(["model.dcp", "optimizer.dcp"] * len(out["checkpoints"]))
        assert out["loaded"] in out["checkpoints"]
        _same_records(out["log"], single["log"])


@pytest.mark.parametrize("world_size,fresh", [pytest.param(2, False, marks=pytest.mark.fast), (2, True), (3, False),
                                              (3, True)], ids=["alive-2", "exits-2", "alive-3", "exits-3"])
def test_a_failure_inside_the_stage_start_gather_is_raised_on_every_rank_in_time(world_size, fresh, tmp_path):
    """Rank 1 fails while unsharding for a sharded TEST; the others wait inside the
    gather's all-gather. Whether rank 1's process stays (a caller that catches) or
    exits (torchrun), every other rank raises rank 1's failure, named, well within
    the collective timeout (10 s here), not the process group's (issue 38): timed from
    the start of ``evaluate`` on each rank, so that a loaded host's start-up and training
    do not count."""
    outcomes = run_ranks(fsdp_workers.fail_in_gather, world_size, str(tmp_path), 1, timeout=60, fresh=fresh)
    assert outcomes[1]["message"] == "out of memory while unsharding (injected)", outcomes[1]
    for rank in set(range(world_size)) - {1}:
        assert outcomes[rank]["error"] == "RankFailedError", outcomes[rank]
        assert "rank 1 failed at 'evaluate' with RuntimeError: out of memory while unsharding (injected)" \
            in outcomes[rank]["message"], outcomes[rank]
        seconds = float((tmp_path / f"evaluate_seconds_{rank}").read_text())
        assert seconds < 10, seconds  # before the collective timeout (10 s) could fire; the process group's: minutes
