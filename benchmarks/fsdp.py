#!/usr/bin/env python3
"""FSDP benchmark: per-rank memory, save stall and evaluation time, FSDP against DDP.

    python benchmarks/fsdp.py [--params-m 50] [--repeats 2] [--folder DIR]

Runs benchmarks/fsdp_worker.py under torchrun at 2 and 3 processes (gloo, CPU),
in DDP and FSDP mode: a 12-layer classifier (about --params-m million
parameters) trains 6 Adam steps, then each rank reports the bytes it holds of
parameters, gradients and optimizer state, its peak RSS, the stall of a
ddp_eval.Checkpointer save, synchronous (median of 2; largest rank) and with
async_save (the first, which allocates its copies, and the second), and the time
of a sharded VALID stage of 12 batches (largest rank). Writes out/fsdp.json and
prints a Markdown table.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "out")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--params-m", type=float, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--folder", default=None)
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    records = os.path.join(OUT, "fsdp_records.jsonl")
    if os.path.exists(records):
        os.remove(records)
    worker = os.path.join(ROOT, "benchmarks", "fsdp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for _ in range(args.repeats):
        for nproc in (2, 3):
            for mode in ("ddp", "fsdp"):
                folder = tempfile.mkdtemp(prefix="ddp_eval_fsdp_", dir=args.folder)
                subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc_per_node={nproc}", worker, mode, records, folder,
                                "--params-m", str(args.params_m)], cwd=ROOT, env=env, check=True,
                               capture_output=True, text=True, timeout=1800)
                subprocess.run(["rm", "-rf", folder], check=True)
    with open(records) as f:
        rows = [json.loads(line) for line in f]
    table = {}
    for nproc in (2, 3):
        for mode in ("ddp", "fsdp"):
            mine = [r for r in rows if r["world_size"] == nproc and r["mode"] == mode]
            holds = [sum(r["holds_bytes"].values()) / 2**20 for r in mine]
            table[f"{mode}-{nproc}"] = {
                "params": mine[0]["params"],
                "holds_mb_per_rank": max(holds),
                "params_grads_optimizer_mb": {k: max(r["holds_bytes"][k] for r in mine) / 2**20
                                              for k in mine[0]["holds_bytes"]},
                "peak_rss_mb": max(r["peak_rss_mb"] for r in mine),
                "save_stall_s": statistics.median(max(r["save_stall_s"]) for r in mine),
                "async_first_stall_s": statistics.median(r["async_save_stall_s"][0] for r in mine),
                "async_stall_s": statistics.median(r["async_save_stall_s"][1] for r in mine),
                "eval_s": statistics.median(r["eval_s"] for r in mine),
            }
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "torch": __import__("torch").__version__, "params_m": args.params_m, "results": table}
    with open(os.path.join(OUT, "fsdp.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("| processes | mode | params + grads + Adam state per rank | peak RSS per rank | save stall | "
          "async save stall (1st / 2nd) | VALID stage |")
    print("|---|---|---|---|---|---|---|")
    for key, r in table.items():
        mode, nproc = key.split("-")
        print(f"| {nproc} | {mode} | {r['holds_mb_per_rank']:.0f} MB | {r['peak_rss_mb']:.0f} MB | "
              f"{r['save_stall_s']:.2f} s | {r['async_first_stall_s']:.2f} / {r['async_stall_s']:.2f} s | "
              f"{r['eval_s']:.2f} s |")


if __name__ == "__main__":
    main()
