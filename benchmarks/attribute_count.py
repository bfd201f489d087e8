"""Per-batch bookkeeping against the number and the size of watched values no batch touches.

``python benchmarks/attribute_count.py`` (about 40 s): one process, a Brain-like
holder whose ``ErrorRateStats``, list and counter change every batch, beside 0, 30
and 100 each of untouched ints, lists and dicts (0, 90 and 300 attributes); then
beside one untouched value of each kind at 100 and 200,000 entries (characters,
elements). The median time of ``StageBook.after_batch`` over batches 500-1,500 (the
size table: 100-400), the garbage collector paused. What it shows: how the per-batch
cost grows with the Brain's whole state, not only with what the batch changed.
"""

import gc
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def per_batch_us(untouched: int, batches: int = 1500) -> float:
    import speechbrain as sb

    from ddp_eval.config import DDPEvalConfig
    from ddp_eval.state.bookkeeping import StageBook

    holder = types.SimpleNamespace(wer=sb.utils.metric_stats.ErrorRateStats(), acc_metric=[], n_correct=0,
                                   _ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}))
    if isinstance(untouched, int):
        for i in range(untouched):
            setattr(holder, f"n{i}", i)
            setattr(holder, f"l{i}", [1, 2, 3])
            setattr(holder, f"d{i}", {"a": 1})
    else:  # one value of a given size
        holder.value = untouched
    book = StageBook(holder, DDPEvalConfig())
    book.start()
    times = []
    for b in range(batches):
        ids = [f"u{b}-{i}" for i in range(4)]
        holder.wer.append(ids, [["a", "b"]] * 4, [["a", "c"]] * 4)
        holder.acc_metric.append(0.5)
        holder.n_correct += 3
        start = time.perf_counter()
        book.after_batch()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times[min(500, batches // 4):])


SIZED = {  # kind -> a value of n entries
    "tuple of labels": lambda n: tuple(f"label{i}" for i in range(n)),
    "tuple of numbers": lambda n: tuple(range(n)),
    "str": lambda n: "x" * n,
    "list": lambda n: [0.5] * n,
    "dict": lambda n: {f"k{i}": i for i in range(n)},
    "set": lambda n: set(range(n)),
    "tensor": lambda n: __import__("torch").zeros(n),
    "numpy array": lambda n: __import__("numpy").zeros(n),
}


if __name__ == "__main__":
    gc.disable()
    for untouched in (0, 30, 100):
        print(f"{3 * untouched:4d} untouched attributes: {per_batch_us(untouched):7.1f} us a batch")
    for kind, make in SIZED.items():
        small, large = per_batch_us(make(100), 400), per_batch_us(make(200_000), 400)
        print(f"one untouched {kind}: {small:7.1f} us a batch at 100 entries, {large:7.1f} at 200,000")
