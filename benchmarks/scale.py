#!/usr/bin/env python3
"""Scale benchmark: the control plane at up to 1024 simulated ranks, and real
gloo process groups at 1-16 ranks.

    python benchmarks/scale.py [--quick]

1. Control plane. Ranks are threads of one process, each with its own TCPStore
   client of one server (as torchrun's agent store serves every worker).
   Seconds per exchange of ``ddp_eval.distributed.ControlChannel`` (rank 0 gathers,
   posts one answer) against the 0.1.0 shape (every rank reads all N keys),
   measured in the same run.
2. Real gloo groups on this machine (TCPStore rendezvous, as under torchrun):
   a tiny model evaluates a VALID set
   (length-sorted toy data, batch 16) with DDPEvalMixin. Per world size: the
   evaluation time, the stage-end overhead (exchange, loss all_reduce, metric
   and attribute merge), and the bytes of merge state each rank receives in
   ``all_gather_bytes`` (N times the largest rank's state: the gather pads).

Writes benchmarks/out/scale.json and scale.png and prints Markdown tables.
"""

import argparse
import datetime
import hashlib
import json
import os
import pickle
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "benchmarks", "out")

from tests.mp_harness import results, run_ranks  # noqa: E402
from tests.simulated_ranks import SimulatedRanks  # noqa: E402

PAYLOAD = [("acc_metric", "append"), ("wer_metric", "ErrorRateStats")]  # a stage-end-like payload


def all_read_exchange(store, rank, world_size, seq, tag, payload, timeout=120.0):
    """The 0.1.0 exchange: every rank posts, waits for and reads all N envelopes."""
    store.set(f"allread/{seq}/{rank}", pickle.dumps((tag, payload)))
    keys = [f"allread/{seq}/{r}" for r in range(world_size)]
    store.wait(keys, datetime.timedelta(seconds=timeout))
    out = [pickle.loads(store.get(k)) for k in keys]
    if seq > 1:
        store.delete_key(f"allread/{seq - 1}/{rank}")
    return out


def control_plane(sizes, rounds, all_read_limit):
    rows = []
    for n in sizes:
        sim = SimulatedRanks(n, namespace=f"bench{n}", store_timeout=300)
        row = {"ranks": n}
        start = time.monotonic()
        sim.run(lambda r, ch: [ch.exchange(f"stage {i}", PAYLOAD) for i in range(rounds)], deadline=600)
        row["channel_s"] = (time.monotonic() - start) / rounds
        if n <= all_read_limit:
            start = time.monotonic()
            sim.run(lambda r, ch, n=n: [all_read_exchange(ch.store, r, n, i + 1, f"stage {i}", PAYLOAD)
                                   for i in range(rounds)], deadline=900)
            row["all_read_s"] = (time.monotonic() - start) / rounds
            row["speedup"] = row["all_read_s"] / row["channel_s"]
        rows.append(row)
        print(f"  {n} ranks: {row}", flush=True)
        for client in sim.clients:
            del client
    return rows


def eval_worker(rank, world_size, n_items):
    """Evaluates a toy VALID set; returns eval time, stage-end time, state bytes."""
    import torch

    import ddp_eval
    from tests import toy

    timings = {}
    sizes = []

    class Timed(ddp_eval.DDPEvalMixin, toy.AccumulatingBrain):
        pass

    finish = ddp_eval.stage._sharded.ShardedStage.finish

    def timed_finish(stage, local_loss):  # the stage-end merge
        start = time.perf_counter()
        try:
            return finish(stage, local_loss)
        finally:
            timings["stage_end_s"] = time.perf_counter() - start

    gather = ddp_eval.distributed.all_gather_bytes

    def recording_gather(*parts):
        sizes.append(sum(len(part) for part in parts))
        return gather(*parts)

    ddp_eval.stage._sharded.ShardedStage.finish = timed_finish
    ddp_eval.distributed.all_gather_bytes = recording_gather
    torch.manual_seed(0)
    brain = Timed({"model": torch.nn.Sequential(torch.nn.Linear(toy.FEATS, 2048), torch.nn.Tanh(),
                                                torch.nn.Linear(2048, 2048), torch.nn.Tanh(),
                                                torch.nn.Linear(2048, toy.CLASSES))},
                  hparams={"counter": None},
                  run_opts={"device": "cpu", "noprogressbar": True, "distributed_backend": "gloo"})
    brain.seen = type("Seen", (), {"ids": []})()
    brain.log = []
    data = toy.make_dataset(n_items, 1)
    start = time.perf_counter()
    brain.evaluate(data, test_loader_kwargs={"batch_size": 16})
    total = time.perf_counter() - start
    exact = {k: brain.log[-1][k] for k in ("acc_metric", "counters", "predictions", "confusion")}
    return {"eval_s": total, "stage_end_s": timings.get("stage_end_s", 0.0),
            "state_bytes": sizes[0] if sizes else 0,
            "log": hashlib.sha1(repr(exact).encode()).hexdigest()}  # compared across world sizes


def real_groups(world_sizes, n_items):
    rows = []
    for n in world_sizes:
        per_rank = results(run_ranks(eval_worker, n, n_items, timeout=600, store="tcp"))  # as torchrun
        assert all(r["log"] == per_rank[0]["log"] for r in per_rank), "ranks disagree"
        row = {"ranks": n, "items": n_items,
               "eval_s": max(r["eval_s"] for r in per_rank),
               "stage_end_s": max(r["stage_end_s"] for r in per_rank),
               "received_bytes_per_rank": n * max(r["state_bytes"] for r in per_rank) if n > 1 else 0,
               "log": per_rank[0]["log"]}
        rows.append(row)
        print(f"  {n} processes, {n_items} items: eval {row['eval_s']:.2f} s, stage end "
              f"{row['stage_end_s'] * 1000:.0f} ms, received {row['received_bytes_per_rank']} B", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    sim_sizes = [8, 64] if args.quick else [8, 64, 256, 1024]
    print("control plane (simulated ranks):", flush=True)
    control = control_plane(sim_sizes, rounds=3, all_read_limit=256)
    print("real gloo groups:", flush=True)
    world_sizes = [1, 2, 4] if args.quick else [1, 2, 4, 8, 16]
    groups = real_groups(world_sizes, 4000)
    set_sizes = real_groups([4], 1000) + real_groups([4], 16000) if not args.quick else []
    one = groups[0]["eval_s"]
    for row in groups:
        row["speedup"] = one / row["eval_s"]
    assert len({row["log"] for row in groups}) == 1, "merged results differ between world sizes"
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version(),
            "wall_s": time.monotonic() - started}
    import torch
    meta["torch"] = torch.__version__
    with open(os.path.join(OUT, "scale.json"), "w") as f:
        json.dump({"meta": meta, "control_plane": control, "real_groups": groups,
                   "set_sizes": set_sizes}, f, indent=1)
    print(f"\nMeasured {meta['date']}, {meta['cores']} cores, torch {meta['torch']}, "
          f"{meta['wall_s']:.0f} s in all.\n")
    print("| simulated ranks | ControlChannel s/exchange | all-read (0.1.0) s/exchange | speed-up |")
    print("|---|---|---|---|")
    for r in control:
        old = f"{r['all_read_s']:.3f}" if "all_read_s" in r else "not run"
        speed = f"{r['speedup']:.1f}x" if "speedup" in r else ""
        print(f"| {r['ranks']} | {r['channel_s']:.3f} | {old} | {speed} |")
    print("\n| gloo processes | VALID eval (4000 items) | speed-up vs 1 | stage-end overhead | "
          "merge state received per rank |")
    print("|---|---|---|---|---|")
    for r in groups:
        print(f"| {r['ranks']} | {r['eval_s']:.2f} s | {r['speedup']:.2f}x | "
              f"{r['stage_end_s'] * 1000:.0f} ms | {r['received_bytes_per_rank'] / 1e3:.0f} kB |")
    for r in set_sizes:
        print(f"| 4 ({r['items']} items) | {r['eval_s']:.2f} s | | {r['stage_end_s'] * 1000:.0f} ms | "
              f"{r['received_bytes_per_rank'] / 1e3:.0f} kB |")
    plot(control, groups, os.path.join(OUT, "scale.png"))


def plot(control, groups, path):
    """The two panels: seconds per exchange, stage-end overhead (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot; pip install -e '.[bench]')")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.loglog([r["ranks"] for r in control], [r["channel_s"] for r in control], "o-", label="ControlChannel")
    old = [r for r in control if "all_read_s" in r]
    a.loglog([r["ranks"] for r in old], [r["all_read_s"] for r in old], "s--", label="all-read (0.1.0)")
    a.set_xlabel("simulated ranks"), a.set_ylabel("seconds per exchange"), a.legend()
    a.set_title("control plane, one TCPStore server")
    b.plot([r["ranks"] for r in groups], [r["stage_end_s"] * 1000 for r in groups], "o-")
    b.set_xlabel("gloo processes (2 cores)"), b.set_ylabel("stage-end overhead (ms)")
    b.set_title("stage end per VALID stage")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
