"""Killing a whole torchrun job, as a crash or a preemption would."""

import os
import signal
import subprocess
import time


def descendants(pid):
    """Every process below ``pid`` (torchrun's workers may sit in sessions of their own)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start(command, log_path, **popen_args):
    """Starts ``command`` in a session of its own (so :func:`kill_when` can kill it all),
    its output to ``log_path``."""
    with open(log_path, "wb") as log:
        job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen_args)
    job.log_path = log_path
    return job


def kill_when(job: subprocess.Popen, condition, timeout=120.0):
    """SIGKILLs ``job`` (started by :func:`start`) and every process below it as soon as
    ``condition()`` holds; fails with the end of the job's output if it ended first."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and job.poll() is None and not condition():
            time.sleep(0.02)
        if job.poll() is not None:
            with open(job.log_path, errors="replace") as log:
                output = log.read()[-4000:]
            raise AssertionError(f"the job ended (exit {job.returncode}) before it could be killed:\n{output}")
    finally:
        pids = descendants(job.pid)
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:  # the job's group is gone: it ended by itself
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.wait()
