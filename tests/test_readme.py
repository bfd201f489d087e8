"""The README's commands, as a newcomer runs them: every ``torchrun`` command whose
script ships with the project, and every ``python -m ddp_eval...`` command, read
from README.md and run one after the other in one clean copy of the project, so
that later commands find what earlier ones left (issue 38: the FSDP demo resumed
the DDP demo's checkpoint and failed). The README cannot drift from what works."""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from ddp_eval.distributed import fsdp

pytestmark = pytest.mark.timeout(600)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands(text):
    """``(environment, argv)`` of each command of the README's bash blocks, in order."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            env = {}
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                key, value = words.pop(0).split("=", 1)
                env[key] = value
            if words:
                commands.append((env, words))
    return commands


def test_the_readme_lists_the_commands_this_test_runs():
    """The parser sees what a reader sees: the install, both demos, verify, inspect."""
    with open(os.path.join(ROOT, "README.md")) as f:
        commands = readme_commands(f.read())
    heads = [" ".join(argv[:3]) for _, argv in commands]
    assert heads[0] == 'pip install -e'
    assert sum(argv[0] == "torchrun" for _, argv in commands) == 3
    assert any(env.get("DDP_EVAL") for env, _ in commands)
    assert any(argv[:3] == ["python", "-m", "ddp_eval.inspect"] for _, argv in commands)


@pytest.mark.skipif(fsdp.support_problem() is not None, reason=str(fsdp.support_problem()))
def test_the_readmes_commands_in_order_in_a_fresh_copy(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        commands = readme_commands(f.read())
    clone = tmp_path / "clone"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if os.path.exists(os.path.join(ROOT, name)):
            os.makedirs(clone / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), clone / name)
    ran = []
    for env, argv in commands:
        if argv[0] == "torchrun" and os.path.exists(clone / next(a for a in argv[1:] if not a.startswith("-"))):
            argv = [sys.executable, "-m", "torch.distributed.run"] + argv[1:]
        elif argv[:3] == ["python", "-m", "ddp_eval.inspect"]:
            argv = [sys.executable] + argv[1:]
        else:
            continue  # the install (done), or a placeholder command
        job = subprocess.run(argv, cwd=clone, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                             capture_output=True, text=True, timeout=300)
        assert job.returncode == 0, f"{' '.join(argv)}: exit {job.returncode}\n{job.stdout[-3000:]}{job.stderr[-5000:]}"
        ran.append((argv, job.stdout + job.stderr))
    assert len(ran) == 4, [a for a, _ in ran]
    fsdp_run = next(out for argv, out in ran if any("fsdp" in a for a in argv))
    assert "Loading a checkpoint from" in fsdp_run or "Epoch loaded" in fsdp_run  # it resumed the DDP demo's
    assert re.search(r"TEST verified: \d+ values equal one process", ran[2][1])
    assert "CKPT+" in ran[3][1]
