"""python -m ddp_eval.inspect: what resume will load, and why."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import speechbrain as sb
import torch

import ddp_eval
import ddp_eval.inspect
from ddp_eval.checkpointing.commit import TMP_PREFIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _folder(tmp_path):
    """complete (loss 3), SpeechBrain-written (loss 2), truncated (loss 1), temporary."""
    def recoverables():
        return {"model": torch.nn.Linear(32, 32), "counter": sb.utils.epoch_loop.EpochCounter(5)}

    # saved in this order, said by their times (recency orders checkpoints by unixtime)
    ddp_eval.Checkpointer(tmp_path, recoverables()).save_checkpoint(meta={"loss": 3.0, "unixtime": 1.0},
                                                                    name="complete")
    sb.utils.checkpoints.Checkpointer(tmp_path, recoverables()).save_checkpoint(meta={"loss": 2.0, "unixtime": 2.0},
                                                                                name="sb")
    bad = ddp_eval.Checkpointer(tmp_path, recoverables()).save_checkpoint(meta={"loss": 1.0, "unixtime": 3.0},
                                                                          name="truncated")
    model = bad.path / "model.ckpt"
    model.write_bytes(model.read_bytes()[:200])
    temporary = tmp_path / f"{TMP_PREFIX}CKPT+next.1a2b3c4d"
    temporary.mkdir()
    (temporary / "model.ckpt").write_bytes(b"PK\x03\x04 half")
    return recoverables


def _inspect(*args):
    """``python -m ddp_eval.inspect ARGS``'s output, run in this process (the command
    line itself: test_inspect_refuses_what_is_not_a_folder)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ddp_eval.inspect.main([str(a) for a in args]) == 0
    return out.getvalue()


@pytest.mark.fast
def test_inspect_names_every_status_and_the_checkpoint_resume_picks(tmp_path):
    recoverables = _folder(tmp_path)
    text = _inspect(tmp_path, "--min-key", "loss")
    lines = {line.split()[0]: line for line in text.splitlines()[1:-1]}
    assert "complete" in lines["CKPT+complete"] and "written by ddp_eval" in lines["CKPT+complete"]
    assert "complete" in lines["CKPT+sb"] and "written by SpeechBrain" in lines["CKPT+sb"]
    assert "skipped: parameter file model.ckpt has 200 bytes, expected" in lines["CKPT+truncated"]
    assert "skipped: temporary directory" in lines[f"{TMP_PREFIX}CKPT+next.1a2b3c4d"]
    picked = ddp_eval.Checkpointer(tmp_path, recoverables()).find_checkpoint(min_key="loss")
    assert picked.path.name == "CKPT+sb"  # the best complete one: the truncated loss-1 one is skipped
    assert text.splitlines()[-1] == "recover_if_possible(min_key='loss') would load: CKPT+sb"
    report = json.loads(_inspect(tmp_path, "--json"))  # no key: the most recent complete one
    assert report["would_load"] == ddp_eval.Checkpointer(tmp_path, recoverables()).find_checkpoint().path.name
    assert report["required"] == ["counter", "model"] and report["required_inferred"]
    assert {c["name"]: c["status"] for c in report["checkpoints"]} == {
        "CKPT+complete": "complete", "CKPT+sb": "complete", "CKPT+truncated": "skipped",
        f"{TMP_PREFIX}CKPT+next.1a2b3c4d": "skipped"}


def test_inspect_sees_a_damaged_speechbrain_checkpoint(tmp_path):
    recoverables = _folder(tmp_path)
    model = tmp_path / "CKPT+sb" / "model.ckpt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    text = _inspect(tmp_path, "--min-key", "loss", "--require", "model,counter")
    assert "CKPT+sb  skipped: parameter file model.ckpt is not a readable zip archive" in text
    picked = ddp_eval.Checkpointer(tmp_path, recoverables()).find_checkpoint(min_key="loss")
    assert text.splitlines()[-1].endswith(f"would load: {picked.path.name}") and picked.path.name == "CKPT+complete"


def test_inspect_refuses_what_is_not_a_folder(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddp_eval.inspect", str(tmp_path / "nope")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is not a directory; expected a checkpoints folder" in proc.stderr
