"""Evaluates, then ends at once: rank 0 with ``os._exit(0)`` (a fast shutdown).

Run under torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so rank 0 hosts
the store. Rank 1 reads every control answer late (its store client sleeps
before each wait and get), so without the acknowledgement of the last answer
rank 0 would take the store down while rank 1 still reads it. Rank 1 then
destroys the process group and exits normally (its store client must not be
left to interpreter teardown, where destroying it aborted some runs).

Usage: torchrun --nproc_per_node=2 tests/exit_job.py CKPT_DIR
"""

import os
import sys
import time

import speechbrain as sb
import torch.distributed

import ddp_eval
from tests import toy


class _SlowReader:
    """Forwards to a store; sleeps before each wait and get."""

    def __init__(self, store, seconds):
        self._store, self._seconds = store, seconds

    def __getattr__(self, name):
        method = getattr(self._store, name)
        if name not in ("wait", "get"):
            return method

        def slow(*args, **kwargs):
            time.sleep(self._seconds)
            return method(*args, **kwargs)

        return slow


def main(ckpt_dir):
    sb.utils.distributed.ddp_init_group({"distributed_backend": "gloo"})
    channel = ddp_eval.distributed.default_channel()
    if os.environ["RANK"] == "1":
        channel.store = _SlowReader(channel.store, 0.3)
    brain = toy.build(toy.DDPToyBrain, ckpt_dir, ddp_eval_opts={"collective_timeout": 30})
    brain.evaluate(toy.make_dataset(7, 9), test_loader_kwargs={"batch_size": 2})
    if os.environ["RANK"] == "0":
        os._exit(0)
    torch.distributed.destroy_process_group()  # then a normal exit, as scripts that clean up end


if __name__ == "__main__":
    main(sys.argv[1])
