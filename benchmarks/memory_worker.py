"""One memory-benchmark job, run under torchrun by memory.py.

    torchrun ... memory_worker.py MODE BRAIN ARG OUT

MODE is ``plain`` (sb.Brain: every rank evaluates everything) or ``mixin``.
BRAIN is ``fsdd`` (ARG: a manifest; the Conv+BiGRU CTC evaluation of
run_benchmark.py) or ``tensors`` (ARG: number of batches; a Brain holding 64 MB
of tensor attributes: a 32 MB table it only reads, 16 MB of int64 counts and a
16 MB float64 accumulator, batch size 2). Appends one JSON line per rank to OUT:
peak RSS growth during evaluate() and the process's peak, in MB, and seconds.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import speechbrain as sb  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ddp_eval  # noqa: E402
from tests import toy  # noqa: E402
from tests.memory import _status_kb, peak_growth  # noqa: E402


def _brain_and_data(mode, brain, arg):
    if brain == "fsdd":
        import eval_worker
        from common import ConvGRUEncoder

        base = sb.Brain if mode == "plain" else type("M", (ddp_eval.DDPEvalMixin, sb.Brain), {})
        torch.manual_seed(0)
        made = eval_worker._eval_brain_class(base)(
            modules={"encoder": ConvGRUEncoder(n_mels=40, hidden=192, n_outputs=16)},
            hparams={"fbank": sb.lobes.features.Fbank(sample_rate=8000, n_fft=256, n_mels=40)},
            run_opts={"device": "cpu", "noprogressbar": True, "distributed_backend": "gloo"})
        return made, eval_worker._dataset(arg), 8
    base = toy.TensorStateBrain
    cls = base if mode == "plain" else type("M", (ddp_eval.DDPEvalMixin, base), {})
    made = toy.build_tensor_state(cls, table_mb=32, counts_mb=16, acc_mb=16)
    return made, toy.make_dataset(2 * int(arg), seed=1), 2


def main(mode, brain, arg, out):
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    made, data, batch_size = _brain_and_data(mode, brain, arg)
    if dist.is_initialized():
        dist.barrier()
    _, growth, seconds = peak_growth(made.evaluate, data, test_loader_kwargs={"batch_size": batch_size})
    record = {"mode": mode, "brain": brain, "arg": arg, "rank": dist.get_rank() if dist.is_initialized() else 0,
              "world_size": dist.get_world_size() if dist.is_initialized() else 1,
              "growth_mb": round(growth, 1), "peak_mb": round(_status_kb("VmHWM") / 1024, 1),
              "seconds": round(seconds, 3)}
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
