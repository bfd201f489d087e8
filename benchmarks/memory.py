#!/usr/bin/env python3
"""Memory benchmark: peak RSS the mixin adds per rank, against plain SpeechBrain.

    python benchmarks/memory.py [--data_folder ../shared/data/fsdd/recordings] [--repeats 3]

For each case, torchrun with 2 processes runs plain ``sb.Brain`` (every rank
evaluates everything) and ``DDPEvalMixin``; each rank reports how far its peak
RSS grew during ``evaluate()`` (the kernel's high-water mark, reset just before
the call). Cases: the FSDD evaluation of run_benchmark.py (3,000 utterances, or
generated data without FSDD), and a Brain with 64 MB of tensor attributes at
60 and 600 batches, so growth with the number of batches shows. Median over
``--repeats`` runs of the largest rank. Writes out/memory.json and prints a
Markdown table.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "out")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "recipes"))


def _run(mode, brain, arg, out, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "benchmarks", "memory_worker.py"), mode, brain, str(arg), out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=900)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_folder", default=os.path.join(ROOT, os.pardir, "shared", "data", "fsdd",
                                                              "recordings"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    import run_benchmark

    manifest, source, _ = run_benchmark.manifest(args.data_folder)
    cases = [("fsdd", manifest), ("tensors", 60), ("tensors", 600)]
    records = os.path.join(OUT, "memory_records.jsonl")
    if os.path.exists(records):
        os.remove(records)
    start = time.time()
    for _ in range(args.repeats):
        for brain, arg in cases:
            for mode in ("plain", "mixin"):
                _run(mode, brain, arg, records)
    with open(records) as f:
        rows = [json.loads(line) for line in f]
    table = []
    for brain, arg in cases:
        entry = {"case": "FSDD evaluation, 3000 utterances" if brain == "fsdd" and "FSDD" in source
                 else "generated-data evaluation" if brain == "fsdd"
                 else f"64 MB of tensor attributes, {arg} batches"}
        for mode in ("plain", "mixin"):
            runs = {}
            for r in rows:
                if r["brain"] == brain and str(r["arg"]) == str(arg) and r["mode"] == mode:
                    runs.setdefault(len(runs) // 2, []).append(r)
            largest = [max(rs, key=lambda r: r["growth_mb"]) for rs in runs.values()]
            entry[mode] = {"growth_mb": statistics.median(r["growth_mb"] for r in largest),
                           "growth_range": [min(r["growth_mb"] for r in largest), max(r["growth_mb"] for r in largest)],
                           "peak_mb": statistics.median(r["peak_mb"] for r in largest),
                           "seconds": statistics.median(r["seconds"] for r in largest)}
        entry["overhead_mb"] = round(entry["mixin"]["growth_mb"] - entry["plain"]["growth_mb"], 1)
        table.append(entry)
    import speechbrain
    import torch

    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "python": platform.python_version(), "torch": torch.__version__,
              "speechbrain": speechbrain.__version__, "data": source, "repeats": args.repeats,
              "wall_s": round(time.time() - start, 1), "cases": table}
    with open(os.path.join(OUT, "memory.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"Measured {result['date']}, {result['machine']}, torch {result['torch']}, SpeechBrain "
          f"{result['speechbrain']}; torchrun, 2 processes; median of {args.repeats} runs of the rank "
          "whose peak grew most.\n")
    print("| case | peak RSS growth during evaluate(), plain sb.Brain | with DDPEvalMixin | overhead per rank | evaluate() s, plain / mixin |")
    print("|---|---|---|---|---|")
    for e in table:
        print(f"| {e['case']} | {e['plain']['growth_mb']:.0f} MB | {e['mixin']['growth_mb']:.0f} MB "
              f"({e['mixin']['growth_range'][0]:.0f}-{e['mixin']['growth_range'][1]:.0f}) | "
              f"{e['overhead_mb']:+.0f} MB | {e['plain']['seconds']:.2f} / {e['mixin']['seconds']:.2f} |")


if __name__ == "__main__":
    main()
