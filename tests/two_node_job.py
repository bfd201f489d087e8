"""One node of a two-node torchrun job (see test_two_nodes.py).

Usage: torchrun --nnodes 2 --node_rank R ... two_node_job.py CKPT_DIR STORAGE EPOCHS OUT_JSON
"""

import functools
import json
import os
import sys

import speechbrain as sb

import ddp_eval
from tests import toy


def main(ckpt_dir, storage, epochs, out_path):
    sb.utils.distributed.ddp_init_group({"distributed_backend": "gloo"})
    checkpointer = functools.partial(ddp_eval.Checkpointer, storage=storage, timeout=30)
    brain = toy.build(toy.DDPToyBrain, ckpt_dir, checkpointer_cls=checkpointer, lr=0.1, epochs=epochs)
    brain.fit(brain.hparams.counter, toy.make_dataset(8, 0), toy.make_dataset(5, 1),
              train_loader_kwargs={"batch_size": 2}, valid_loader_kwargs={"batch_size": 2})
    ckpts = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("CKPT"))
    writers = [open(os.path.join(ckpt_dir, d, "probe.ckpt")).read() for d in ckpts]
    with open(out_path, "w") as f:
        json.dump({"rank": int(os.environ["RANK"]), "checkpoints": ckpts, "writers": writers,
                   "loaded_from_writer": brain.hparams.probe.loaded,
                   "epochs_run": [r["epoch"] for r in brain.log if r["stage"] == "TRAIN"]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
