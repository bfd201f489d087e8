#!/usr/bin/env python3
"""Save benchmark: how long a save stalls training, synchronous against async_save.

    python benchmarks/saves.py [--params-m 100] [--repeats 3] [--folder DIR]

Runs benchmarks/saves_worker.py with one process (python) and two (torchrun,
DDP) in each mode: no saves, an in-memory copy into fresh memory (the floor of
a non-blocking save that allocates its copy), SpeechBrain's Checkpointer,
ddp_eval synchronous with and without fsync, and ddp_eval with async_save
(which refills the same buffers from the second save on, so the first save's
stall, which allocates them, is reported apart). Each job trains 8 steps between
saves, 3 saves, keeping every checkpoint until it ends (so each save writes new
blocks instead of reusing those of a checkpoint just deleted). Reports the
median stall per save (largest rank), the background write it hides, and
training throughput with a save every 8 steps. Writes out/saves.json and prints a Markdown table. Needs about 4 x the
state in free disk space (1.2 GB state at 100M parameters).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "out")
MODES = ("none", "copy", "speechbrain", "sync", "sync-nofsync", "async")


def _run(mode, nproc, out, folder, params_m):
    worker = os.path.join(ROOT, "benchmarks", "saves_worker.py")
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    os.sync()  # no job inherits the previous one's dirty pages
    subprocess.run(launcher + [worker, mode, out, folder, "--params-m", str(params_m)], cwd=ROOT, env=env,
                   check=True, capture_output=True, text=True, timeout=1800)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--params-m", type=float, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where checkpoints are written (default: a temp dir)")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    records = os.path.join(OUT, "saves_records.jsonl")
    if os.path.exists(records):
        os.remove(records)
    folder = args.folder or tempfile.mkdtemp(prefix="ddp_eval_saves_")
    start = time.time()
    for _ in range(args.repeats):
        for nproc in (1, 2):
            for mode in MODES:
                _run(mode, nproc, records, folder, args.params_m)
    with open(records) as f:
        rows = [json.loads(line) for line in f]
    table = []
    for nproc in (1, 2):
        base = None
        for mode in MODES:
            jobs = [r for r in rows if r["mode"] == mode and r["world_size"] == nproc]
            runs = [jobs[i: i + nproc] for i in range(0, len(jobs), nproc)]  # one run: its ranks
            per_save = [[max(rank["stalls_s"][k] for rank in run) for k in range(len(run[0]["stalls_s"]))]
                        for run in runs]
            first = [saves[0] for saves in per_save]
            stalls = [s for saves in per_save for s in saves[1:]]  # later saves (async: buffers reused)
            throughput = statistics.median(run[0]["steps"] / max(r["loop_s"] for r in run) for run in runs)
            if mode == "none":
                base = throughput
            writes = [w for run in runs for w in run[0].get("background_writes_s", [])]
            table.append({"processes": nproc, "mode": mode, "state_mb": jobs[0]["state_mb"],
                          "background_write_median_s": statistics.median(writes) if writes else None,
                          "first_stall_median_s": statistics.median(first),
                          "stall_median_s": statistics.median(stalls), "stall_range_s": [min(stalls), max(stalls)],
                          "steps_per_s": throughput, "vs_no_saves": throughput / base})
    import speechbrain
    import torch

    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "python": platform.python_version(), "torch": torch.__version__,
              "speechbrain": speechbrain.__version__, "repeats": args.repeats, "folder": folder,
              "wall_s": round(time.time() - start), "rows": table}
    with open(os.path.join(OUT, "saves.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"Measured {result['date']}, {result['machine']}, torch {result['torch']}; state "
          f"{table[0]['state_mb']} MB (model + Adam); {args.repeats} runs x 3 saves each; checkpoints "
          f"kept until each run ends; 8 training steps between saves.\n")
    print("| processes | save | first save's stall | later saves' stall, median (range) | background write | "
          "training steps/s, save every 8 steps | vs no saves |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        first = "" if r["mode"] == "none" else f"{r['first_stall_median_s']:.2f} s"
        stall = "" if r["mode"] == "none" else \
            f"{r['stall_median_s']:.2f} s ({r['stall_range_s'][0]:.2f}-{r['stall_range_s'][1]:.2f})"
        write = f"{r['background_write_median_s']:.2f} s" if r["background_write_median_s"] else ""
        print(f"| {r['processes']} | {r['mode']} | {first} | {stall} | {write} | {r['steps_per_s']:.2f} | "
              f"{r['vs_no_saves']:.2f} |")


if __name__ == "__main__":
    main()
