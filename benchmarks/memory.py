#!/usr/bin/env python3
"""Memory benchmark: peak RSS the mixin adds per rank, against plain SpeechBrain.

    python benchmarks/memory.py [--data_folder ../shared/data/fsdd/recordings] [--repeats 3]

For each case, torchrun with 2 processes runs plain ``sb.Brain`` (every rank
evaluates everything) and ``DDPEvalMixin``; each rank reports how far its peak
RSS grew during ``evaluate()`` (the kernel's high-water mark, reset just before
the call). Cases: the FSDD evaluation of run_benchmark.py (3,000 utterances, or
generated data without FSDD), and a Brain with 64 MB of tensor attributes at
60 and 600 batches, so growth with the number of batches shows. Median over
``--repeats`` runs of the largest rank. Also the per-batch bookkeeping's time and
records early and late in a 20,000-batch stage (one process). Writes out/memory.json and prints a
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


def per_batch_costs(batches=20000):
    """Time and memory of the per-batch bookkeeping, early and late in a long stage.

    One process: what the mixin does after each batch (find metric objects, note
    list lengths, watch attributes, put probes in place for the next batch), on a
    Brain-like holder whose ErrorRateStats, list and dict grow by 4 utterances a
    batch, with a counter (+=), a number set every batch, and HiFi-GAN's
    ``last_loss_stats[stage]`` and ``last_batch`` bound anew, as a recipe's would.
    """
    import array
    import sys
    import types

    import speechbrain as sb

    from ddp_eval.config import DDPEvalConfig
    from ddp_eval.state._watches import DictWatch, ListWatch
    from ddp_eval.state.bookkeeping import StageBook

    holder = types.SimpleNamespace(wer=sb.utils.metric_stats.ErrorRateStats(), acc_metric=[], predictions={},
                                   n_correct=0, last_loss=0.0, last_loss_stats={}, last_batch=None,
                                   _ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}))
    book = StageBook(holder, DDPEvalConfig())  # the stage's own per-batch record
    recorder, tracker = book.metrics, book.attributes
    windows = {}
    book.start()
    for b in range(batches):
        ids = [f"u{b}-{i}" for i in range(4)]
        holder.wer.append(ids, [["a", "b"]] * 4, [["a", "c"]] * 4)
        holder.acc_metric.append(0.5)
        holder.predictions.update((i, 1) for i in ids)
        holder.n_correct += 3
        holder.last_loss = 0.25 * (b % 7)
        holder.last_loss_stats["VALID"] = {"loss": holder.last_loss}
        holder.last_batch = (ids, b)
        t = time.perf_counter()
        book.after_batch()
        elapsed = time.perf_counter() - t
        windows.setdefault("first 1000" if b < 1000 else "last 1000" if b >= batches - 1000 else None, []).append(
            elapsed)
    kept = sum(a.buffer_info()[1] * a.itemsize for a in recorder._changes.values() if isinstance(a, array.array))
    for slot in tracker.tracks.values():
        watch = slot.watch
        kept += sys.getsizeof(slot.events) + sum(sys.getsizeof(e) for e in slot.events)
        for records in ([watch.changes] if isinstance(watch, ListWatch) else
                        [watch.added] if isinstance(watch, DictWatch) else []):
            kept += records.buffer_info()[1] * records.itemsize
    return {"batches": batches, "us_per_batch_first_1000": 1e6 * statistics.mean(windows["first 1000"]),
            "us_per_batch_last_1000": 1e6 * statistics.mean(windows["last 1000"]),
            "record_bytes_per_batch": kept / batches}


def stage_edge_costs(sizes=(10_000, 100_000)):
    """Time of the stage-start record (fingerprints of every watched value) and of the
    stage-end check and collection, on a Brain holding ``size`` entries from earlier
    stages (a list, a dict, an ErrorRateStats), after 100 batches: what issue 26's
    check adds once per stage, flat in the number of batches."""
    import types

    import speechbrain as sb

    from ddp_eval.config import DDPEvalConfig
    from ddp_eval.state.bookkeeping import StageBook

    out = {}
    for size in sizes:
        wer = sb.utils.metric_stats.ErrorRateStats()
        wer.append([f"old{i}" for i in range(size)], [["a"]] * size, [["a"]] * size)
        holder = types.SimpleNamespace(wer=wer, history=[0.5 * i for i in range(size)],
                                       results={f"u{i}": i for i in range(size)}, hist=[0] * 10, n=0,
                                       _ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}))
        t = time.perf_counter()
        book = StageBook(holder, DDPEvalConfig())
        book.start()
        started = time.perf_counter() - t
        for b in range(100):
            holder.history.append(b)
            holder.hist[b % 10] += 1
            holder.n += 1
            holder.wer.append([f"n{b}"], [["a"]], [["b"]])
            book.after_batch()
        t = time.perf_counter()
        book.collect(list(range(100)))
        out[size] = {"start_ms": 1e3 * started, "end_ms": 1e3 * (time.perf_counter() - t)}
    return out


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

    per_batch = per_batch_costs()
    edges = stage_edge_costs()
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "python": platform.python_version(), "torch": torch.__version__,
              "speechbrain": speechbrain.__version__, "data": source, "repeats": args.repeats,
              "wall_s": round(time.time() - start, 1), "cases": table, "per_batch": per_batch,
              "stage_edges": edges}
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
    pb = per_batch
    print(f"\nPer-batch bookkeeping over {pb['batches']} batches (ErrorRateStats, a list and a dict growing by 4 "
          "utterances a batch, a counter, a number set per batch, HiFi-GAN's last_loss_stats[stage] and last_batch): "
          f"{pb['us_per_batch_first_1000']:.0f} us a batch over the first 1000, "
          f"{pb['us_per_batch_last_1000']:.0f} us over the last 1000; {pb['record_bytes_per_batch']:.0f} bytes of "
          "records kept a batch.")
    print("Stage start (record and fingerprints) / stage end (check and collect) on a Brain holding N entries from "
          "earlier stages: " + "; ".join(f"N = {n}: {e['start_ms']:.1f} / {e['end_ms']:.1f} ms" for n, e in
                                          edges.items()) + ".")


if __name__ == "__main__":
    main()
