#!/usr/bin/env python3
"""Benchmark: evaluation scaling, load balance, merge cost and checkpoint cost.

    python benchmarks/run_benchmark.py [--data_folder ../shared/data/fsdd/recordings]

Runs, on the same data and model (a Conv+BiGRU CTC encoder on all FSDD
recordings, or on generated data without FSDD):
  * evaluation wall time: plain sb.Brain under torchrun with 2 processes (each
    rank evaluates everything) vs DDPEvalMixin with 1 and 2 processes;
  * load balance: each rank's busy time with length-sorted data, max/mean;
  * the cross-rank merge of 10,000 utterances of ErrorRateStats + BinaryMetricStats;
  * the cost of resume_eval's journal (default interval, and after every batch),
    median of 5 interleaved runs each;
  * save time of a ~50 MB model: SpeechBrain's Checkpointer vs ddp_eval's
    (with and without fsync).
Every process uses one thread (OMP_NUM_THREADS=1). Writes out/results.json,
out/benchmark.png and prints a Markdown table.
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
sys.path.insert(0, os.path.join(ROOT, "recipes"))
OUT = os.path.join(ROOT, "benchmarks", "out")
DEFAULT_FSDD = os.path.join(ROOT, os.pardir, "shared", "data", "fsdd", "recordings")


def manifest(data_folder):
    """One manifest of every utterance, sorted by duration; FSDD or generated."""
    path = os.path.join(OUT, "all.json")
    entries = {}
    if data_folder and os.path.isdir(data_folder):
        from fsdd.fsdd_prepare import prepare_fsdd

        prep = os.path.join(OUT, "fsdd")
        prepare_fsdd(data_folder, prep)
        source = f"FSDD, {data_folder}"
    else:
        from demo.demo_prepare import SPLITS, prepare_demo

        prep = os.path.join(OUT, "demo")
        SPLITS.update(train=1500, valid=250, test=250)
        prepare_demo(os.path.join(prep, "data"), prep)
        source = "generated demo data (FSDD not found)"
    for split in ("train", "valid", "test"):
        with open(os.path.join(prep, f"{split}.json")) as f:
            for key, entry in json.load(f).items():
                entry.setdefault("word", str(entry.get("label")))
                entries[key] = entry
    entries = dict(sorted(entries.items(), key=lambda kv: (kv[1]["duration"], kv[0])))
    with open(path, "w") as f:
        json.dump(entries, f)
    return path, source, len(entries)


def torchrun(mode, nproc, manifest_path, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", os.path.join(ROOT, "benchmarks", "eval_worker.py"),
           mode, manifest_path, out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} on {nproc} processes failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(out) as f:
        return json.loads(f.read().splitlines()[-1])


def checkpoint_costs(reps=5):
    import speechbrain as sb
    import torch

    import ddp_eval

    torch.set_num_threads(1)
    model = torch.nn.Linear(3600, 3600)  # 12.96 M parameters, 51.9 MB
    size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    makers = {
        "speechbrain": lambda d: sb.utils.checkpoints.Checkpointer(d, {"model": model}),
        "ddp_eval, fsync": lambda d: ddp_eval.Checkpointer(d, {"model": model}),
        "ddp_eval, no fsync": lambda d: ddp_eval.Checkpointer(d, {"model": model}, fsync=False),
    }
    times = {name: [] for name in makers}
    for rep in range(reps):
        for name, make in makers.items():  # interleaved, so disk state drifts evenly
            with tempfile.TemporaryDirectory(dir=OUT) as d:
                ck = make(d)
                ck.save_checkpoint(name="warm")
                start = time.perf_counter()
                ck.save_checkpoint(name=f"r{rep}")
                times[name].append(time.perf_counter() - start)
    return size_mb, {name: statistics.median(t) for name, t in times.items()}


def machine():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import speechbrain
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "speechbrain": speechbrain.__version__,
            "date": time.strftime("%Y-%m-%d")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_folder", default=DEFAULT_FSDD)
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    started = time.perf_counter()
    path, source, n = manifest(args.data_folder)
    runs = {}
    for key, mode, nproc in (("plain_2", "plain", 2), ("mixin_1", "mixin", 1), ("mixin_2", "mixin", 2)):
        runs[key] = torchrun(mode, nproc, path, os.path.join(OUT, f"{key}.jsonl"))
    merge = torchrun("merge", 2, path, os.path.join(OUT, "merge.jsonl"))
    journal = {mode: [] for mode in ("mixin", "mixin+journal", "mixin+journal0")}
    for _ in range(5):  # interleaved: the differences are small against run-to-run noise
        for mode in journal:
            journal[mode].append(torchrun(mode, 2, path, os.path.join(OUT, f"journal-{mode}.jsonl"))["eval_s"])
    size_mb, saves = checkpoint_costs()
    busy = runs["mixin_2"]["busy_s"]
    per_utt = runs["mixin_2"]["eval_s"] / n
    results = {
        "machine": machine(), "data": source, "utterances": n, "runs": runs, "merge": merge,
        "speedup_vs_plain_2": runs["plain_2"]["eval_s"] / runs["mixin_2"]["eval_s"],
        "speedup_vs_mixin_1": runs["mixin_1"]["eval_s"] / runs["mixin_2"]["eval_s"],
        "balance_max_over_mean": max(busy) / statistics.mean(busy),
        "merge_share_of_eval": merge["merge_ms"] / 1000 / (per_utt * merge["utterances"]),
        "checkpoint_mb": size_mb, "save_s": saves,
        "save_ratio_no_fsync": saves["ddp_eval, no fsync"] / saves["speechbrain"],
        "save_ratio_fsync": saves["ddp_eval, fsync"] / saves["speechbrain"],
        "identical_wer": len({r["summary_wer"] for r in runs.values()}) == 1,
        "journal_eval_s": journal,
        "journal_overhead": {m: statistics.median(t) / statistics.median(journal["mixin"]) - 1
                             for m, t in journal.items() if m != "mixin"},
        "total_s": time.perf_counter() - started,
    }
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    plot(results, os.path.join(OUT, "benchmark.png"))


def table(r):
    m, runs = r["machine"], r["runs"]
    rows = [
        f"Measured {m['date']} on {m['cpu']}, {m['cores']} cores, Python {m['python']}, "
        f"torch {m['torch']}, SpeechBrain {m['speechbrain']}; {r['utterances']} utterances of "
        f"{r['data']}; one thread per process.",
        "",
        "| measurement | value | target |",
        "|---|---|---|",
        f"| evaluation, plain sb.Brain, torchrun 2 processes | {runs['plain_2']['eval_s']:.2f} s | |",
        f"| evaluation, DDPEvalMixin, 1 process | {runs['mixin_1']['eval_s']:.2f} s | |",
        f"| evaluation, DDPEvalMixin, 2 processes | {runs['mixin_2']['eval_s']:.2f} s | |",
        f"| speed-up vs plain SpeechBrain under torchrun (2 proc) | {r['speedup_vs_plain_2']:.2f}x | >= 1.7x |",
        f"| speed-up vs DDPEvalMixin on 1 process | {r['speedup_vs_mixin_1']:.2f}x | |",
        f"| per-rank busy time (length-sorted data) | {', '.join(f'{b:.2f} s' for b in runs['mixin_2']['busy_s'])} | |",
        f"| load balance max/mean | {r['balance_max_over_mean']:.3f} | <= 1.05 |",
        f"| merge of {r['merge']['utterances']:,} utterances (ErrorRateStats + BinaryMetricStats), 2 proc | {r['merge']['merge_ms']:.0f} ms | |",
        f"| merge as share of evaluating as many utterances | {100 * r['merge_share_of_eval']:.2f} % | < 2 % |",
        f"| save {r['checkpoint_mb']:.0f} MB, SpeechBrain Checkpointer | {r['save_s']['speechbrain'] * 1000:.0f} ms | |",
        f"| save, ddp_eval.Checkpointer, fsync on | {r['save_s']['ddp_eval, fsync'] * 1000:.0f} ms ({r['save_ratio_fsync']:.2f}x) | |",
        f"| save, ddp_eval.Checkpointer, fsync off | {r['save_s']['ddp_eval, no fsync'] * 1000:.0f} ms ({r['save_ratio_no_fsync']:.2f}x) | <= 1.1x |",
        f"| same WER in all three evaluations | {r['identical_wer']} | True |",
        f"| resume_eval journal, default interval (60 s), 2 proc: evaluation | {statistics.median(r['journal_eval_s']['mixin+journal']):.2f} s vs {statistics.median(r['journal_eval_s']['mixin']):.2f} s ({100 * r['journal_overhead']['mixin+journal']:+.1f} %) | <= 1 % |",
        f"| resume_eval journal after every batch, 2 proc: evaluation | {statistics.median(r['journal_eval_s']['mixin+journal0']):.2f} s ({100 * r['journal_overhead']['mixin+journal0']:+.1f} %) | |",
        f"| benchmark wall time | {r['total_s']:.0f} s | <= 300 s |",
    ]
    return "\n".join(rows)


def plot(r, path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = r["runs"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["plain SB\n2 proc", "mixin\n1 proc", "mixin\n2 proc"]
    a.bar(names, [runs[k]["eval_s"] for k in ("plain_2", "mixin_1", "mixin_2")],
          color=["grey", "tab:blue", "tab:green"])
    a.set_ylabel("evaluation wall time (s)")
    a.set_title(f"{r['utterances']} utterances, {r['machine']['cores']} cores")
    saves = r["save_s"]
    b.bar([k.replace(", ", "\n") for k in saves], [v * 1000 for v in saves.values()],
          color=["grey", "tab:orange", "tab:green"])
    b.set_ylabel("save time (ms)")
    b.set_title(f"checkpoint save, {r['checkpoint_mb']:.0f} MB")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
