#!/usr/bin/env python3
"""What the stage-end checks cost at the edges of a stage, on one process.

    python benchmarks/stage_edges.py [--repeats 5] [--out out/stage_edges.json]

One rank's record of a stage (``StageBook``), driven by hand: stage start (the
record, the recording copies of containers, the fingerprints), 100 batches, then
stage end: the check and collection of what travels (``collect``), the pure merge
of this one record, and writing it back (``apply``, which puts the original
containers back). On a Brain holding

* ``N`` entries from earlier stages, ``N`` = 10,000 and 100,000: a list of floats, a
  dict of per-utterance numbers and an ``ErrorRateStats``, with a counter, a pre-sized
  histogram and the list growing by one entry a batch;
* a 32 MB float64 tensor changed in place every batch (``add_``) and a 32 MB one
  rebuilt every batch (``x = x + y``).

Reports the median milliseconds of each edge over ``--repeats`` runs. The same
script runs against an older checkout (``PYTHONPATH=<checkout>``) to compare.
"""

import argparse
import json
import os
import statistics
import time
import types


def _brain(case):
    import speechbrain as sb
    import torch

    holder = types.SimpleNamespace(_ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}))
    if case.startswith("entries"):
        size = int(case.split("=")[1])
        wer = sb.utils.metric_stats.ErrorRateStats()
        wer.append([f"old{i}" for i in range(size)], [["a"]] * size, [["a"]] * size)
        holder.wer, holder.history = wer, [0.5 * i for i in range(size)]
        holder.results, holder.hist, holder.n = {f"u{i}": i for i in range(size)}, [0] * 10, 0
    else:
        holder.acc = torch.zeros(2 ** 22, dtype=torch.float64)  # 32 MB
        holder.rebuilt = torch.zeros(2 ** 22, dtype=torch.float64)
    return holder


def _batch(holder, b):
    if hasattr(holder, "history"):
        holder.history.append(b)
        holder.hist[b % 10] += 1
        holder.n += 1
        holder.wer.append([f"n{b}"], [["a"]], [["b"]])
    else:
        holder.acc.add_(0.5)
        holder.rebuilt = holder.rebuilt + 0.25


def edges(case, batches=100):
    from ddp_eval.config import DDPEvalConfig
    from ddp_eval.state.bookkeeping import StageBook, merge_stage, winners_of

    holder = _brain(case)
    t0 = time.perf_counter()
    book = StageBook(holder, DDPEvalConfig(attribute_memory_mb=64))
    book.start()
    start = time.perf_counter() - t0
    for b in range(batches):
        _batch(holder, b)
        book.after_batch()
    t0 = time.perf_counter()
    record = book.collect(list(range(batches)))
    collect = time.perf_counter() - t0
    t0 = time.perf_counter()
    merged = merge_stage([record.state])
    winners = winners_of([record.report])
    book.apply(merged, [record.report["layout"]], winners, [record.bound], 0)
    apply = time.perf_counter() - t0
    return {"start_ms": 1e3 * start, "collect_ms": 1e3 * collect, "merge_apply_ms": 1e3 * apply}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import ddp_eval

    results = {"ddp_eval": ddp_eval.__version__, "repeats": args.repeats, "cases": {}}
    for case in ("entries=10000", "entries=100000", "tensors=32MB"):
        runs = [edges(case) for _ in range(args.repeats)]
        results["cases"][case] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        row = results["cases"][case]
        print(f"| {case} | {row['start_ms']:.1f} | {row['collect_ms']:.1f} | {row['merge_apply_ms']:.1f} |",
              flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
