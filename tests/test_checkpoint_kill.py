"""Kill tests: SIGKILL the writer at every step of a save, then resume."""

import pytest
import torch

from ddp_eval.checkpointing.commit import TMP_PREFIX, inspect_checkpoint_dir
from tests import kill_points
from tests.mp_harness import FORKSERVER as _ctx  # the one forkserver, its preload list there

pytestmark = pytest.mark.timeout(300)


def _run_child(directory, kill_at, log_path, renameat2, async_save):
    proc = _ctx.Process(target=kill_points.run,
                        args=(str(directory), kill_at, str(log_path), renameat2, async_save))
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        pytest.fail(f"save sequence hung at kill point {kill_at}")
    return proc.exitcode


def _committed(log_path):
    return [int(v) for v in log_path.read_text().split()] if log_path.exists() else []


@pytest.mark.parametrize("renameat2,async_save", [(True, False), (False, False), (True, True)],
                         ids=["renameat2", "two-renames", "async-background-write"])
def test_sigkill_at_every_point_of_a_save_leaves_newest_complete_checkpoint(renameat2, async_save, tmp_path):
    assert _run_child(tmp_path / "dry", None, tmp_path / "dry.log", renameat2, async_save) == 0
    names = (tmp_path / "dry.log.points").read_text().splitlines()
    assert len(names) >= 20, names  # the armed part of the sequence has this many points
    for k in range(1, len(names) + 1):
        directory, log_path = tmp_path / f"k{k}", tmp_path / f"k{k}.log"
        exitcode = _run_child(directory, k, log_path, renameat2, async_save)
        assert exitcode == -9, f"kill point {k} ({names[k - 1]}) not reached: exit {exitcode}"
        committed = _committed(log_path)
        # Atomicity: every visible checkpoint directory is complete, whatever the instant.
        visible = [d for d in directory.iterdir() if d.name.startswith("CKPT")]
        for d in visible:
            problem, _ = inspect_checkpoint_dir(d)
            assert problem is None, f"kill at {names[k - 1]}: partial {d.name}: {problem}"
        ckpter, model, blob = kill_points.make_checkpointer(directory, version=-1)
        found = ckpter.recover_if_possible()
        assert found is not None, f"kill at {names[k - 1]}: nothing to resume from"
        version = found.meta["version"]
        # newest complete: the last logged save, or the one whose commit preceded the kill
        assert version in (committed[-1], committed[-1] + 1), (names[k - 1], committed, version)
        assert torch.equal(model.weight, torch.full_like(model.weight, float(version)))
        assert torch.equal(model.bias, torch.full_like(model.bias, -float(version)))
        assert blob.version == version
        assert not [d for d in directory.iterdir() if d.name.startswith(TMP_PREFIX)], \
            "stale temporary directories survive start-up"
