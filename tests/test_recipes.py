"""Recipes end to end under torchrun: train with 2 processes, then evaluate the
same checkpoint with python and with torchrun and compare the reports."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.processes import kill_when, start

pytestmark = pytest.mark.timeout(600)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDD = os.path.normpath(os.path.join(ROOT, os.pardir, "shared", "data", "fsdd", "recordings"))
needs_fsdd = pytest.mark.skipif(
    not os.path.isdir(FSDD), reason=f"FSDD recordings not found at {FSDD} (see README: Data)")


def _start(script, hparams, output, *args, nproc=2, env=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    cmd = launcher + [os.path.join(ROOT, script), os.path.join(ROOT, hparams),
                      f"--output_folder={output}", "--device=cpu", "--noprogressbar"]
    if nproc:
        cmd.append("--distributed_backend=gloo")
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(cmd + list(args), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _finish(jobs, timeout=300):
    """Waits for every job (the whole process tree of one that overruns is killed); all must exit 0."""
    failed = []
    for job in jobs:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, 9)
            out, err = job.communicate()
        if job.returncode != 0:
            failed.append(f"{job.args[-1]} exit {job.returncode}:\n{out[-3000:]}{err[-5000:]}")
    for job in jobs:
        if job.poll() is None:  # a job left running by a failure above
            os.killpg(job.pid, 9)
            job.wait()
    assert not failed, "\n".join(failed)


def _run(script, hparams, output, *args, nproc=2, timeout=300):
    _finish([_start(script, hparams, output, *args, nproc=nproc)], timeout)


def _lines(path):
    with open(path) as f:
        return f.read().splitlines()


def _train_then_compare_evaluations(tmp_path, script, hparams, reports, *args, world_sizes=(2,), resume=True):
    """Trains with 2 processes (``resume``: one epoch, then a second run resumes at
    epoch 2), then evaluates the checkpoint with python and each world size."""
    trained, epochs = tmp_path / "trained", 2 if resume else 1
    if resume:
        _run(script, hparams, trained, "--number_of_epochs=1", *args)
    _run(script, hparams, trained, f"--number_of_epochs={epochs}", *args)
    log = _lines(trained / "train_log.txt")
    # written once, by one rank; the resumed run appended epoch 2 only
    assert [line.split(",")[0] for line in log if line.startswith("epoch")] == [
        f"epoch: {e}" for e in range(1, epochs + 1)]
    assert sum(line.startswith("Epoch loaded") for line in log) == epochs
    ckpts = [d for d in os.listdir(trained / "save") if d.startswith("CKPT")]
    assert 1 <= len(ckpts) <= 2 and not [d for d in os.listdir(trained / "save") if d.startswith(".")]
    evaluations, jobs = {}, []
    for nproc in (None,) + tuple(world_sizes):  # side by side: one job's imports while another evaluates
        copy = tmp_path / f"eval-{nproc or 'python'}"
        shutil.copytree(trained, copy)
        for report in reports:
            os.remove(copy / report)
        jobs.append(_start(script, hparams, copy, f"--number_of_epochs={epochs}", "--test_only", *args,
                           nproc=nproc))
    _finish(jobs)
    for nproc in (None,) + tuple(world_sizes):
        copy = tmp_path / f"eval-{nproc or 'python'}"
        evaluations[nproc] = ({r: (copy / r).read_text() for r in reports},
                              _lines(copy / "train_log.txt")[-1])
    single = evaluations[None]
    for nproc in world_sizes:  # reports byte for byte, and the test-stats line
        assert evaluations[nproc] == single, f"torchrun --nproc_per_node={nproc} differs"
    assert single[1].startswith(f"Epoch loaded: {epochs} - test loss")
    return single


def test_demo_recipe(tmp_path):
    reports, stats = _train_then_compare_evaluations(
        tmp_path, "recipes/demo/train.py", "hparams/demo.yaml", ["test_confusion.txt"],
        world_sizes=(3,))  # 1, 2 and 4 processes: test_mixin_distributed, on the same code; the
    # README's FSDP command (test_readme) evaluates this recipe's checkpoint at 2
    assert reports["test_confusion.txt"].count("Overall Accuracy") == 1
    assert re.search(r"test accuracy: [0-9.e+-]+", stats)


def test_demo_recipe_under_fsdp(tmp_path):
    """The README's FSDP command: trained at 2 processes with its convolutions and
    linear layer sharded (one epoch, then a run that resumes from the sharded
    checkpoint), then its checkpoint evaluated at 3 processes and by one process
    (plain modules: every rank loads the shards resharded): the same report."""
    reports, stats = _train_then_compare_evaluations(
        tmp_path, "recipes/demo/train.py", "hparams/demo.yaml", ["test_confusion.txt"],
        "--ddp_eval={fsdp: {shard_modules: [Conv1d, Linear]}}", world_sizes=(3,))
    saves = [d for d in os.listdir(tmp_path / "trained" / "save") if d.startswith("CKPT")]
    assert all(os.path.isdir(tmp_path / "trained" / "save" / d / "model.dcp") for d in saves)
    assert reports["test_confusion.txt"].count("Overall Accuracy") == 1
    assert re.search(r"test accuracy: [0-9.e+-]+", stats)


def test_readme_verify_command_on_a_yaml_without_a_ddp_eval_section(tmp_path):
    """A converted recipe's YAML has no ddp_eval: section, so hyperpyyaml refuses
    --ddp_eval overrides; the README's command sets DDP_EVAL instead, and verifies."""
    with open(os.path.join(ROOT, "hparams/demo.yaml")) as f:
        text = f.read()
    start = text.index("ddp_eval:")
    end = text.index("\n\n", start)
    plain = tmp_path / "demo_plain.yaml"
    plain.write_text(text[:start] + text[end + 2:])
    assert not re.search(r"^ddp_eval:", plain.read_text(), re.M)
    refused = _start("recipes/demo/train.py", str(plain), tmp_path / "refused", "--debug",
                     "--ddp_eval={verify: first}")
    out, err = refused.communicate(timeout=300)
    assert refused.returncode != 0 and "ddp_eval" in err
    job = _start("recipes/demo/train.py", str(plain), tmp_path / "run", "--debug", env={"DDP_EVAL": "{verify: first}"})
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    assert re.search(r"ddp_eval: VALID verified: \d+ values equal one process", out + err)
    assert re.search(r"ddp_eval: TEST verified: \d+ values equal one process", out + err)


def test_demo_recipe_resumes_after_sigkill(tmp_path):
    """Kill the whole torchrun job (SIGKILL) once a checkpoint exists, then rerun."""
    output = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "recipes/demo/train.py"), os.path.join(ROOT, "hparams/demo.yaml"),
           f"--output_folder={output}", "--device=cpu", "--noprogressbar",
           "--distributed_backend=gloo", "--number_of_epochs=30"]
    job = start(cmd, tmp_path / "job.log", cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    def checkpointed():
        save = output / "save"
        return save.is_dir() and any(d.startswith("CKPT") for d in os.listdir(save))

    kill_when(job, checkpointed)  # torchrun and both workers, mid-training
    epochs_before = [int(line.split(",")[0].split()[1]) for line in _lines(output / "train_log.txt")
                     if line.startswith("epoch")]
    assert epochs_before, "killed before an epoch ended"
    last = epochs_before[-1] + 2  # the rerun trains up to two more epochs
    _run("recipes/demo/train.py", "hparams/demo.yaml", output, f"--number_of_epochs={last}")
    epochs = [int(line.split(",")[0].split()[1]) for line in _lines(output / "train_log.txt")
              if line.startswith("epoch")]
    resumed = epochs[len(epochs_before):]
    assert resumed, (epochs_before, resumed)
    # resumed after the last complete checkpoint: no epoch restarted from scratch
    assert resumed[0] in (epochs_before[-1], epochs_before[-1] + 1)
    assert resumed == list(range(resumed[0], last + 1))
    assert not [d for d in os.listdir(output / "save") if d.startswith(".")]


@needs_fsdd
def test_fsdd_digit_recipe(tmp_path):
    reports, _ = _train_then_compare_evaluations(
        tmp_path, "recipes/fsdd/train_digits.py", "hparams/fsdd_digits.yaml",
        ["test_confusion.txt"], f"--data_folder={FSDD}", "--train_takes_limit=14",
        resume=False)  # a recipe resuming under torchrun: test_demo_recipe
    # every one of the 300 test utterances counted once
    counts = re.findall(r"^\d: (\d+) / (\d+)", reports["test_confusion.txt"], re.M)
    assert sum(int(total) for _, total in counts) == 300


@needs_fsdd
def test_fsdd_ctc_recipe(tmp_path):
    reports, _ = _train_then_compare_evaluations(
        tmp_path, "recipes/fsdd/train_ctc.py", "hparams/fsdd_ctc.yaml",
        ["test_wer.txt", "test_cer.txt"], f"--data_folder={FSDD}", "--train_takes_limit=14",
        resume=False)
    assert "Scored 300 sentences" in reports["test_wer.txt"]
    assert reports["test_wer.txt"].count("%SER") == 1  # one report, not one per rank
    utterances = re.findall(r"^(\d_\w+_\d), %WER", reports["test_wer.txt"], re.M)
    assert len(utterances) == len(set(utterances)) == 300  # each utterance listed once
