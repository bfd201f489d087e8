#!/usr/bin/env python3
"""What ``resume_eval`` adds to a sharded stage: the model fingerprint and the journal.

    python benchmarks/stage_costs.py [--sizes fsdd,1gb] [--repeats 5]

torchrun with 2 processes runs ``evaluate()`` of a small TEST set (8 batches of 4
generated utterances) with a model of each size, ``resume_eval`` off, then on with
``resume_eval_every_s: 0`` (a journal piece after every batch, so the model
fingerprint is always taken), then on with the default interval (60 s: these
stages write no piece), each ``--repeats`` times after one warm-up. Per
rank and configuration it reports the median seconds of a stage; "added" is the
median with the journal minus the median without, the slower rank's. Sizes:
``fsdd``, the Conv+BiGRU encoder of run_benchmark.py (0.49 M parameters), and ``1gb``,
the same encoder next to 64 parameters of 16 MiB (1 GiB) the forward never reads. Writes
out/stage_costs.json and prints a Markdown table.
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


def _worker(size: str, repeats: int, out: str) -> None:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import speechbrain as sb
    import torch
    import torch.distributed as dist
    from common import ConvGRUEncoder

    import ddp_eval

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    encoder = ConvGRUEncoder(n_mels=40, hidden=192, n_outputs=16)
    modules = {"encoder": encoder}
    if size == "1gb":
        modules["layers"] = torch.nn.ParameterList([torch.nn.Parameter(torch.full((2 ** 22,), float(i)))
                                                    for i in range(64)])

    class StageBrain(ddp_eval.DDPEvalMixin, sb.Brain):
        def compute_forward(self, batch, stage):
            return self.modules.encoder(batch)

        def compute_objectives(self, logits, batch, stage):
            return logits.float().pow(2).mean()

    times = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, journal, every_s in (("plain", False, 0.0), ("journal", True, 0.0), ("default", True, 60.0)):
            brain = StageBrain(modules=modules, hparams={"ddp_eval": {
                "resume_eval": journal, "resume_eval_every_s": every_s, "resume_eval_dir": folder}},
                run_opts={"device": "cpu", "noprogressbar": True, "distributed_backend": "gloo"})
            data = list(torch.randn(32, 50, 40, generator=torch.Generator().manual_seed(0)))
            seconds = []
            for _ in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                brain.evaluate(data, test_loader_kwargs={"batch_size": 4})
                seconds.append(time.perf_counter() - start)
            times[name] = statistics.median(seconds[1:])
    parameters = sum(p.numel() for m in modules.values() for p in m.parameters())
    with open(out, "a") as f:
        f.write(json.dumps({"size": size, "rank": dist.get_rank(), "parameters": parameters, **times}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="fsdd,1gb")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    rows = []
    for size in args.sizes.split(","):
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            os.path.abspath(__file__), "--worker", size, str(args.repeats), out.name],
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, timeout=1800)
            ranks = [json.loads(line) for line in out.read().splitlines()]
        rows.append({"size": size, "parameters": ranks[0]["parameters"],
                     "plain_s": max(r["plain"] for r in ranks), "journal_s": max(r["journal"] for r in ranks),
                     "added_s": max(r["journal"] - r["plain"] for r in ranks),
                     "added_default_s": max(r["default"] - r["plain"] for r in ranks)})
    result = {"host": platform.node(), "cpus": os.cpu_count(), "repeats": args.repeats, "rows": rows,
              "when": time.strftime("%Y-%m-%d %H:%M")}
    with open(os.path.join(OUT, "stage_costs.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("| model | parameters | stage, resume_eval off | on, a piece per batch | added | added, default "
          "interval (60 s: no piece) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['parameters']:,} | {r['plain_s']:.3f} s | {r['journal_s']:.3f} s | "
              f"{r['added_s']:+.3f} s | {r['added_default_s']:+.3f} s |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
