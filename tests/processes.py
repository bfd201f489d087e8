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


def kill_when(job: subprocess.Popen, condition, timeout=120.0):
    """SIGKILLs ``job`` (started with ``start_new_session=True``) and every process
    below it as soon as ``condition()`` holds; fails if the job ended first."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and job.poll() is None and not condition():
            time.sleep(0.02)
        assert job.poll() is None, "the job ended before it could be killed"
    finally:
        pids = descendants(job.pid)
        os.killpg(job.pid, signal.SIGKILL)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.wait()
