"""Per-batch bookkeeping of this checkout beside other checkouts, interleaved.

``python benchmarks/per_batch.py [--trees DIR ...] [--processes 5]`` (about 2 minutes
for three trees): each tree's own ``benchmarks/memory.py per_batch_costs`` (one
process, a Brain-like holder, the garbage collector paused) in a fresh process per
run, the trees taking turns. A run times 7 loops of 2,000 batches and keeps each
loop's fastest mean over the first and the last 1,000 batches: what the code
costs, with the host's hiccups left out. The median over ``--processes`` runs is
printed per tree, with the range: on a shared VM, processes of the same code
differ by up to a third (memory layout), so single runs compare nothing.

Compare with another release through a worktree, e.g.
``git worktree add /tmp/v040 6658a38`` (0.4.0), then
``python benchmarks/per_batch.py --trees . /tmp/v040``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ONE_RUN = """
import gc, importlib.util, json, sys
tree = sys.argv[1]
sys.path.insert(0, tree)
spec = importlib.util.spec_from_file_location("memory_benchmark", tree + "/benchmarks/memory.py")
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
import ddp_eval
assert ddp_eval.__file__.startswith(tree), (ddp_eval.__file__, tree)
gc.disable()
runs = [memory.per_batch_costs(2000) for _ in range(7)]
print(json.dumps([min(r["us_per_batch_first_1000"] for r in runs), min(r["us_per_batch_last_1000"] for r in runs),
                  runs[0]["record_bytes_per_batch"]]))
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trees", nargs="+", default=[ROOT], help="checkouts to compare (default: this one)")
    parser.add_argument("--processes", type=int, default=5)
    args = parser.parse_args()
    trees = [os.path.abspath(t) for t in args.trees]
    runs = {tree: [] for tree in trees}
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same string hashes in every run
    for _ in range(args.processes):
        for tree in trees:
            out = subprocess.run([sys.executable, "-c", ONE_RUN, tree], env=env, cwd=tree, check=True,
                                 capture_output=True, text=True).stdout
            runs[tree].append(json.loads(out.strip().splitlines()[-1]))
    print(f"per-batch bookkeeping, us a batch: median (range) of {args.processes} processes, each the fastest of "
          "7 loops of 2,000 batches")
    print("| tree | first 1,000 batches | last 1,000 batches | records a batch |")
    print("|---|---|---|---|")
    for tree, found in runs.items():
        cells = []
        for i in (0, 1):
            values = [r[i] for r in found]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"| {tree} | {cells[0]} | {cells[1]} | {found[0][2]:.0f} B |")


if __name__ == "__main__":
    main()
