"""Per-batch bookkeeping against the number of watched attributes no batch touches.

``python benchmarks/attribute_count.py`` (about 30 s): one process, a Brain-like
holder whose ``ErrorRateStats``, list and counter change every batch, beside 0, 30
and 100 each of untouched ints, lists and dicts (0, 90 and 300 attributes); the
median time of ``StageBook.after_batch`` over batches 500-1,500, the garbage
collector paused. What it shows: how the per-batch cost grows with the Brain's
whole state, not only with what the batch changed.
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
    for i in range(untouched):
        setattr(holder, f"n{i}", i)
        setattr(holder, f"l{i}", [1, 2, 3])
        setattr(holder, f"d{i}", {"a": 1})
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
    return 1e6 * statistics.median(times[500:])


if __name__ == "__main__":
    gc.disable()
    for untouched in (0, 30, 100):
        print(f"{3 * untouched:4d} untouched attributes: {per_batch_us(untouched):7.1f} us a batch")
