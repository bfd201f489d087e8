"""A toy recipe under ``torchrun --max-restarts=1`` whose rank 1 dies mid-training.

Attempt 0: rank 1 SIGKILLs itself in the training stage of epoch 4 (checkpoints
of epochs 1-3 exist). torchrun restarts both workers with the same agent store.
Attempt 1: rank 1 reaches every stage end's exchange after rank 0 (it waits for
rank 0's envelope in the store), so a rank that read keys of attempt 0 would take
them for answers. The job resumes, finishes, tests
the best checkpoint and writes what each rank saw.

Usage: torchrun --max-restarts=1 ... restart_job.py CKPT_DIR OUT_DIR
"""

import datetime
import json
import os
import signal
import sys

import speechbrain as sb

import ddp_eval
from tests import toy

EPOCHS = 6
SETS = {"train": (8, 0), "valid": (7, 1), "test": (7, 9)}


class RestartedBrain(toy.DDPToyBrain):
    def compute_objectives(self, logits, batch, stage):
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if (attempt == 0 and stage == sb.Stage.TRAIN and self.hparams.counter.current == 4
                and os.environ["RANK"] == "1"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().compute_objectives(logits, batch, stage)

    def on_stage_end(self, stage, stage_loss, epoch=None):
        if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) > 0 and os.environ["RANK"] == "1":
            channel = ddp_eval.distributed.default_channel()  # rank 0 reaches the next exchange first
            channel.store.wait([channel.envelope_key(0)], datetime.timedelta(seconds=60))
        super().on_stage_end(stage, stage_loss, epoch)


def main(ckpt_dir, out_dir):
    sb.utils.distributed.ddp_init_group({"distributed_backend": "gloo"})
    brain = toy.build(RestartedBrain, ckpt_dir, lr=0.1, epochs=EPOCHS,
                      ddp_eval_opts={"collective_timeout": 60, "check_consistency": True})
    sets = {name: toy.make_dataset(n, seed) for name, (n, seed) in SETS.items()}
    brain.fit(brain.hparams.counter, sets["train"], sets["valid"],
              train_loader_kwargs={"batch_size": 2}, valid_loader_kwargs={"batch_size": 2})
    best = brain.checkpointer.find_checkpoint(min_key="loss")
    test_loss = brain.evaluate(sets["test"], min_key="loss", test_loader_kwargs={"batch_size": 2})
    rank = os.environ["RANK"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"attempt": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                   "best": best.path.name, "test_loss": test_loss,
                   "test_metrics": repr(brain.log[-1]["metrics"]),
                   "epochs": [r["epoch"] for r in brain.log if r["stage"] == "VALID"]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
