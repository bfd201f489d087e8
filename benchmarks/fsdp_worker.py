#!/usr/bin/env python3
"""One rank of the FSDP benchmark (run by benchmarks/fsdp.py under torchrun).

    torchrun --nproc_per_node=N benchmarks/fsdp_worker.py MODE OUT FOLDER [--params-m 50]

MODE is ``ddp`` (SpeechBrain's DDP wrap) or ``fsdp`` (``ddp_eval: {fsdp: ...}``,
each Linear sharded on its own). A classifier of 12 square Linear layers trains
with Adam, then: the bytes this rank holds of parameters, gradients and optimizer
state, and its peak RSS; the stall of a synchronous ``ddp_eval.Checkpointer``
save (every rank, largest); the time of a sharded VALID stage. Appends one JSON
line per rank to OUT.
"""

import argparse
import json
import os
import resource
import sys
import time

import speechbrain as sb
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ddp_eval  # noqa: E402
from ddp_eval.distributed import fsdp  # noqa: E402


class Classifier(sb.Brain):
    def compute_forward(self, batch, stage):
        return self.modules.model(batch[0])

    def compute_objectives(self, logits, batch, stage):
        return torch.nn.functional.cross_entropy(logits, batch[1])


class Converted(ddp_eval.DDPEvalMixin, Classifier):
    def on_evaluate_start(self, max_key=None, min_key=None):
        """No checkpoint load: the timed evaluation is the stage alone."""


def local_bytes(tensors):
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("ddp", "fsdp"))
    parser.add_argument("out")
    parser.add_argument("folder")
    parser.add_argument("--params-m", type=float, default=50)
    args = parser.parse_args()
    run_opts = {"device": "cpu", "distributed_backend": "gloo", "noprogressbar": True}
    sb.utils.distributed.ddp_init_group(run_opts)
    torch.manual_seed(0)
    width = int((args.params_m * 1e6 / 12) ** 0.5)
    layers = []
    for _ in range(12):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    n_params = sum(p.numel() for p in model.parameters())
    opts = {"fsdp": {"shard_modules": ["Linear"]}} if args.mode == "fsdp" else {}
    folder = os.path.join(args.folder, args.mode)
    checkpointer = ddp_eval.Checkpointer(folder, {"model": model})
    brain = Converted({"model": model}, opt_class=lambda p: torch.optim.Adam(p, lr=1e-4),
                      hparams={"ddp_eval": {**opts, "resume_eval": False}}, checkpointer=checkpointer,
                      run_opts=run_opts)
    g = torch.Generator().manual_seed(1)
    train = [(torch.randn(8, width, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(6)]
    valid = torch.utils.data.TensorDataset(torch.randn(96, width, generator=g), torch.randint(0, 10, (96,), generator=g))
    brain.on_fit_start()
    for batch in train:
        brain.fit_batch(batch)
    holds = {"params": local_bytes(model.parameters()), "grads": local_bytes(p.grad for p in model.parameters()),
             "optimizer": local_bytes(v for s in brain.optimizer.state.values() for v in s.values()
                                      if isinstance(v, torch.Tensor))}
    stalls, async_stalls = [], []
    for _ in range(2):
        torch.distributed.barrier()
        start = time.perf_counter()
        checkpointer.save_and_keep_only()
        stalls.append(time.perf_counter() - start)
    checkpointer.async_save = True
    for _ in range(2):  # the first allocates its copies; the background write is waited for, untimed
        torch.distributed.barrier()
        start = time.perf_counter()
        checkpointer.save_and_keep_only()
        async_stalls.append(time.perf_counter() - start)
        checkpointer.wait()
    checkpointer.async_save = False
    loader = torch.utils.data.DataLoader(valid, batch_size=8)
    torch.distributed.barrier()
    start = time.perf_counter()
    brain.evaluate(ddp_eval.shard_dataloader(loader), progressbar=False)
    evaluation = time.perf_counter() - start
    record = {"mode": args.mode, "world_size": torch.distributed.get_world_size(), "rank": int(os.environ["RANK"]), "params": n_params,
              "sharded": fsdp.is_sharded(model), "holds_bytes": holds,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "save_stall_s": stalls, "async_save_stall_s": async_stalls, "eval_s": evaluation}
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
