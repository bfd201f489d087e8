"""TEST of the best checkpoint, journaled after every batch and slowed down, so
that a test can kill it mid-way and run it again (same command, any number of
processes). Each evaluated batch's ids go to ``OUT_DIR/evaluated-r<rank>-<pid>.txt``
(fsync'ed) before the batch counts, so a test can tell work lost from work
journaled; the result goes to ``OUT_DIR/result-r<rank>.json``.

Usage: [torchrun --nproc_per_node=N] tests/eval_job.py CKPT_DIR OUT_DIR [SECONDS_PER_BATCH]
"""

import json
import os
import signal
import sys
import time

import speechbrain as sb

import ddp_eval
from tests import toy, workers

FIELDS = ("acc_metric", "valid_acc", "counters", "predictions", "confusion", "loss_total")


class SlowBrain(ddp_eval.DDPEvalMixin, toy.FullBrain):
    def compute_objectives(self, logits, batch, stage):
        # EVAL_JOB_KILL_RANK1_AFTER=k: in torchrun's first attempt, rank 1 dies after k batches
        kill_after = os.environ.get("EVAL_JOB_KILL_RANK1_AFTER")
        if (kill_after and os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
                and getattr(self.seen, "batches", 0) >= int(kill_after)):
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().compute_objectives(logits, batch, stage)
        time.sleep(self.seconds_per_batch)
        with open(os.path.join(self.out_dir, f"evaluated-r{os.environ.get('RANK', '0')}-{os.getpid()}.txt"),
                  "a") as f:
            f.write(" ".join(batch.id) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return loss


def main(ckpt_dir, out_dir, seconds_per_batch=0.02):
    if "RANK" in os.environ:
        sb.utils.distributed.ddp_init_group({"distributed_backend": "gloo"})
    brain = toy.build(SlowBrain, ckpt_dir, epochs=1,
                      ddp_eval_opts={"resume_eval_every_s": 0, "collective_timeout": 60})
    brain.out_dir, brain.seconds_per_batch = out_dir, float(seconds_per_batch)
    loss = brain.evaluate(*workers._test_args(2, False))
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out_dir, f"result-r{rank}.json"), "w") as f:
        record = brain.log[-1]
        json.dump({"loss": loss, "metrics": repr(record["metrics"]), "fields": {k: record[k] for k in FIELDS},
                   "batches": brain.seen.batches,
                   "world_size": ddp_eval.distributed.get_world_size(),
                   "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
