"""Two torchrun launches on one machine (--nnodes 2), one checkpoint directory per node."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_node_run(dirs, storage, epochs, out_dir, timeout=120):
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               os.path.join(ROOT, "tests", "two_node_job.py"), str(dirs[node]), storage, str(epochs),
               str(out_dir / f"node{node}-e{epochs}.json")]
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"two-node job hung:\n{p.communicate()[0][-3000:]}")
    for p in procs:
        out = p.communicate()[0]
        assert p.returncode == 0, out[-4000:]
    return [json.loads((out_dir / f"node{n}-e{epochs}.json").read_text()) for n in (0, 1)]


@pytest.mark.parametrize("storage", ["shared", "node_local"])
def test_two_nodes_save_and_resume(storage, tmp_path):
    if storage == "shared":
        dirs = [tmp_path / "shared", tmp_path / "shared"]
    else:
        dirs = [tmp_path / "node0", tmp_path / "node1"]
    first = _two_node_run(dirs, storage, 1, tmp_path)
    resumed = _two_node_run(dirs, storage, 2, tmp_path)
    for node, (a, b) in enumerate(zip(first, resumed)):
        assert a["epochs_run"] == [1] and b["epochs_run"] == [2]
        assert a["checkpoints"], "no checkpoint written"
        if storage == "shared":  # global rank 0 alone writes the one copy
            assert set(a["writers"]) == set(b["writers"]) == {"0"}
            assert b["loaded_from_writer"] == "0"
        else:  # every node's local rank 0 writes its own full copy and resumes from it
            assert set(a["writers"]) == set(b["writers"]) == {str(node)}
            assert b["loaded_from_writer"] == str(node)
    assert first[0]["checkpoints"] == first[1]["checkpoints"]
    assert resumed[0]["checkpoints"] == resumed[1]["checkpoints"]
