"""Single-process: on-disk compatibility with SpeechBrain, skipping incomplete checkpoints."""

import logging

import pytest
import speechbrain as sb
import torch

import ddp_eval
from ddp_eval.checkpointing.commit import MANIFEST_KEY

pytestmark = pytest.mark.fast


def _model(value):
    model = torch.nn.Linear(8, 8)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def test_ddp_eval_checkpoints_load_in_speechbrain(tmp_path):
    saved = _model(3.0)
    counter = sb.utils.epoch_loop.EpochCounter(5)
    counter.current = 2
    ckpt = ddp_eval.Checkpointer(tmp_path, {"model": saved, "counter": counter}).save_checkpoint(
        meta={"loss": 0.5})
    assert ckpt.path.name.startswith("CKPT+") and (ckpt.path / "CKPT.yaml").exists()
    loaded, counter2 = _model(0.0), sb.utils.epoch_loop.EpochCounter(5)
    found = sb.utils.checkpoints.Checkpointer(
        tmp_path, {"model": loaded, "counter": counter2}).recover_if_possible(min_key="loss")
    assert found.path == ckpt.path and found.meta["loss"] == 0.5
    assert torch.equal(loaded.weight, saved.weight) and counter2.current == 2


def test_speechbrain_checkpoints_resume_with_ddp_eval(tmp_path):
    saved = _model(4.0)
    sb_ckpt = sb.utils.checkpoints.Checkpointer(tmp_path, {"model": saved}).save_checkpoint(
        meta={"wer": 12.0}, name="sb")
    loaded = _model(0.0)
    found = ddp_eval.Checkpointer(tmp_path, {"model": loaded}).recover_if_possible(min_key="wer")
    assert found.path == sb_ckpt.path and torch.equal(loaded.weight, saved.weight)


def test_every_public_method_behaves_as_speechbrain(tmp_path):
    """save / find / list / delete / keep-only side by side with SpeechBrain's."""
    kept = {}
    for name, cls in (("sb", sb.utils.checkpoints.Checkpointer), ("ddp", ddp_eval.Checkpointer)):
        ck = cls(tmp_path / name, {"model": _model(1.0)})
        for i, loss in enumerate([3.0, 1.0, 2.0, 5.0]):  # recency by the times in the meta
            ck.save_and_keep_only(meta={"loss": loss, "i": i, "unixtime": 1000.0 + i}, min_keys=["loss"],
                                  num_to_keep=2, importance_keys=[])
        assert ck.find_checkpoint(min_key="loss").meta["i"] == 1
        assert ck.find_checkpoint().meta["i"] == 3
        assert [c.meta["i"] for c in ck.find_checkpoints(max_key="loss")] == [3, 2, 1]
        ck.delete_checkpoints(num_to_keep=1, min_keys=["loss"], importance_keys=[])
        kept[name] = sorted(c.meta["i"] for c in ck.list_checkpoints())
    assert kept["ddp"] == kept["sb"] == [1]


@pytest.mark.parametrize("damage", ["truncate", "delete_file", "garble_meta", "sb_missing_file"])
def test_incomplete_checkpoint_is_skipped_with_warning(damage, tmp_path, caplog):
    ck = ddp_eval.Checkpointer(tmp_path, {"model": _model(1.0)})
    good = ck.save_checkpoint(meta={"v": 1, "unixtime": 1.0})
    writer = sb.utils.checkpoints.Checkpointer if damage == "sb_missing_file" else ddp_eval.Checkpointer
    bad = writer(tmp_path, {"model": _model(2.0)}).save_checkpoint(meta={"v": 2, "unixtime": 2.0}, name="bad")
    model_file = bad.path / "model.ckpt"
    if damage == "truncate":
        model_file.write_bytes(model_file.read_bytes()[:100])
    elif damage in ("delete_file", "sb_missing_file"):
        model_file.unlink()
    else:
        (bad.path / "CKPT.yaml").write_text("unixtime: [unclosed")
    loaded = _model(0.0)
    with caplog.at_level(logging.WARNING):
        found = ddp_eval.Checkpointer(tmp_path, {"model": loaded}).recover_if_possible()
    assert found.path == good.path and found.meta["v"] == 1
    assert torch.equal(loaded.weight, _model(1.0).weight)
    assert f"skipping incomplete checkpoint {bad.path}" in caplog.text


def test_meta_records_file_sizes_and_optional_checksums(tmp_path):
    ck = ddp_eval.Checkpointer(tmp_path, {"model": _model(1.0)}, checksums=True)
    files = ck.save_checkpoint().meta[MANIFEST_KEY]
    assert files["model.ckpt"]["size"] == (ck.find_checkpoint().path / "model.ckpt").stat().st_size
    assert len(files["model.ckpt"]["sha256"]) == 64
