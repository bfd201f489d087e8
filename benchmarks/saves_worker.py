"""One save-benchmark job (python, or torchrun by saves.py).

    saves_worker.py MODE OUT_JSONL FOLDER [--params-m 100] [--saves 3] [--steps-between 4]

A model of about ``params_m`` million parameters (Linear layers) trained with
Adam (so the state is about 12 bytes a parameter: 1.2 GB at 100M), DDP under
torchrun. The loop runs ``steps_between`` training steps (longer than one background write
here, as saves minutes apart would be), then a save, ``saves``
times, and times each save call on every rank: that is how long training is
blocked. MODE: ``none`` (no saves: the loop's own speed), ``speechbrain``
(SpeechBrain's Checkpointer), ``sync`` (ddp_eval, fsync on), ``sync-nofsync``,
``async`` (ddp_eval, async_save), ``copy`` (only the in-memory snapshot that
async_save makes: the floor of a non-blocking save). Checkpoints are kept until
the job ends, so every save writes new blocks.
"""

import argparse
import json
import os
import shutil
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import speechbrain as sb  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ddp_eval  # noqa: E402
from ddp_eval.checkpointing._async_save import snapshot_state  # noqa: E402


def _checkpointer(mode, folder, recoverables):
    if mode == "speechbrain":
        return sb.utils.checkpoints.Checkpointer(folder, recoverables)
    if mode in ("sync", "sync-nofsync", "async"):
        return ddp_eval.Checkpointer(folder, recoverables, fsync=mode != "sync-nofsync", async_save=mode == "async")
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("out")
    parser.add_argument("folder")
    parser.add_argument("--params-m", type=float, default=100)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps-between", type=int, default=8)
    args = parser.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    width = 4096
    layers = max(1, round(args.params_m * 1e6 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    trained = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    counter = sb.utils.epoch_loop.EpochCounter(10)
    data = torch.randn(8, width)

    def step():
        optimizer.zero_grad()
        trained(data).square().mean().backward()
        optimizer.step()

    step()  # Adam state exists from here on
    state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    state_mb += sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t)) / 2**20
    folder = os.path.join(args.folder, args.mode)
    ckpter = _checkpointer(args.mode, folder, {"model": model, "optimizer": optimizer, "counter": counter})
    stalls, writes, steps = [], [], 0
    if distributed:
        dist.barrier()
    start = time.perf_counter()
    for i in range(args.saves):
        for _ in range(args.steps_between):
            step()
            steps += 1
        t0 = time.perf_counter()
        if args.mode == "copy":
            snapshot_state({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        elif ckpter is not None:
            ckpter.save_checkpoint(meta={"i": i}, name=f"{args.mode}-{i}")
        stalls.append(time.perf_counter() - t0)
        if getattr(ckpter, "_background", None) is not None and ckpter._background.writer.seconds is not None:
            writes.append(ckpter._background.writer.seconds)  # the previous background write, finished by now
    loop_s = time.perf_counter() - start
    t0 = time.perf_counter()
    if isinstance(ckpter, ddp_eval.Checkpointer):
        ckpter.wait()  # the last background save, for completeness (not in the loop's time)
    final_wait = time.perf_counter() - t0
    if getattr(ckpter, "_background", None) is not None and ckpter._background.writer.seconds is not None:
        writes.append(ckpter._background.writer.seconds)
    record = {"mode": args.mode, "rank": rank, "world_size": dist.get_world_size() if distributed else 1,
              "state_mb": round(state_mb), "layers": layers, "stalls_s": stalls, "loop_s": loop_s,
              "steps": steps, "final_wait_s": final_wait,
              "background_writes_s": writes}
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    if distributed:
        dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
