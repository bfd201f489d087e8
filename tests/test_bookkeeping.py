"""What the mixin's bookkeeping costs: tensor attributes at 1 and 3 ranks against one
plain SpeechBrain process, values and peak memory, at two numbers of batches."""

import pytest
import torch

from tests.mp_harness import results, run_ranks
from tests.workers import tensor_state_evaluations

pytestmark = pytest.mark.timeout(300)
BATCH_COUNTS = (30, 240)
EPS64 = 2.0**-53
# Tensor attributes of toy.TensorStateBrain, MB: table 32 (never changed), counts 8
# (int64), acc_big 8 (float64), acc_small (tiny).
ATTRIBUTES_MB, CHANGED_MB, BUDGET_MB = 48, 16, 64


def allowed_overhead_mb(world_size):
    """What the bookkeeping may hold at its peak, whatever the number of batches:
    one CPU copy of every tensor attribute at stage start, one more of the float
    tensor that changes, its increments up to the budget, and at stage end the
    changed tensors' increments, pickled, gathered from every rank and unpickled."""
    return ATTRIBUTES_MB + 8 + BUDGET_MB + CHANGED_MB * (2 + 2 * world_size) + 16  # 16: allocator slack


@pytest.fixture(scope="module")
def plain():
    """Plain SpeechBrain, one process per number of batches (a fresh allocator each)."""
    return {b: results(run_ranks(tensor_state_evaluations, 1, False, (b,), timeout=120, fresh="spawn"))[0]["runs"][0]
            for b in BATCH_COUNTS}


@pytest.mark.parametrize("world_size", [1, 3])  # 2 ranks: the code of 3 (gather, merge, apply)
def test_tensor_attributes_equal_one_process_and_memory_does_not_grow_with_batches(world_size, plain):
    growth = {}
    for batches in BATCH_COUNTS:
        per_rank = results(run_ranks(tensor_state_evaluations, world_size, True, (batches,), timeout=120,
                                       fresh="spawn"))  # a new interpreter per measurement
        want = plain[batches]
        for out in per_rank:
            got = out["runs"][0]
            assert torch.equal(got["counts"], want["counts"])  # integer tensor: exact
            n = batches
            for name, bound in (("acc_small", 2 * n), ("acc_big", 2 * (n + world_size))):
                scale = max(want[name].abs().max().item(), 1.0)
                error = (got[name] - want[name]).abs().max().item()
                assert error <= bound * EPS64 * scale, (name, error)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-9)
            assert got["table_version"] == 0  # only read, never written
            if world_size > 1:  # acc_big's 8 MB increments pass the 64 MB budget: warned once
                over = [w for w in out["warnings"] if "attribute_memory_mb" in w]
                assert len(over) == 1 and "'acc_big'" in over[0] and "2 (n + N) eps" in over[0]
            else:
                assert out["warnings"] == []
        growth[batches] = max(out["runs"][0]["growth_mb"] for out in per_rank)
    for batches in BATCH_COUNTS:
        overhead = growth[batches] - plain[batches]["growth_mb"]
        assert overhead <= allowed_overhead_mb(world_size), (batches, growth, plain[batches]["growth_mb"])
    # 8x the batches: the peak does not follow. The slack covers where the allocator
    # places the recipe's transient 8 MB tensors (+-16 MB seen, also at world size 1,
    # where nothing is tracked); keeping 0.15 MB more a batch would exceed it, and the
    # per-batch clones of 0.2.0 kept 48 MB a batch.
    assert growth[BATCH_COUNTS[1]] <= growth[BATCH_COUNTS[0]] + 32, growth


def _per_batch_us(untouched, batches=240, read=False):
    """Median time of the per-batch bookkeeping (one process) beside one untouched
    watched value, a metric object, a list and a counter changing every batch; with
    ``read``, every other batch reads the value (``len``), so its probe is remade."""
    import gc
    import statistics
    import time
    import types

    import speechbrain as sb

    from ddp_eval.config import DDPEvalConfig
    from ddp_eval.state.bookkeeping import StageBook

    holder = types.SimpleNamespace(wer=sb.utils.metric_stats.ErrorRateStats(), ids=[], n=0, big=untouched,
                                   _ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}))
    book = StageBook(holder, DDPEvalConfig())
    book.start()
    times, lengths = [], []
    gc.disable()
    try:
        for b in range(batches):
            holder.wer.append([f"u{b}"], [["a", "b"]], [["a", "c"]])
            holder.ids.append(f"u{b}")
            holder.n += 1
            if read and b % 2:
                lengths.append(len(holder.big))
            start = time.perf_counter()
            book.after_batch()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
        book.release()
    return 1e6 * statistics.median(times[40:])


_UNTOUCHED = {  # kind -> a value of n entries (characters, elements)
    "tuple of numbers": lambda n: tuple(range(n)),
    "tuple of labels": lambda n: tuple(f"label{i}" for i in range(n)),
    "str": lambda n: "x" * n,
    "bytes": lambda n: b"x" * n,
    "list": lambda n: [0.5] * n,
    "dict": lambda n: {f"k{i}": i for i in range(n)},
    "set": lambda n: set(range(n)),
    "tensor": lambda n: torch.zeros(n),
}


@pytest.mark.parametrize("kind", sorted(_UNTOUCHED))
def test_per_batch_cost_does_not_grow_with_the_size_of_a_value_no_batch_touches(kind):
    """Per-batch work scales with what the batch changed: a 200,000-entry value no
    batch touches costs a batch what a 100-entry one does (a tuple's probe check read
    every entry, and its probe copied it, every batch: 128x at this size, 5 ms a batch).
    A value a batch reads gets a new probe the next batch (its read was noted)."""
    small = _per_batch_us(_UNTOUCHED[kind](100))
    large = _per_batch_us(_UNTOUCHED[kind](200_000))
    assert large < 3 * small + 20, f"{kind}: {small:.0f} us a batch beside 100 entries, {large:.0f} beside 200,000"


def test_a_probe_no_batch_used_stands_in_again_and_a_used_or_kept_one_does_not(monkeypatch):
    """The spare probe is placed again only if nothing used it and nothing kept it."""
    import types

    from ddp_eval.config import DDPEvalConfig
    from ddp_eval.state import _attributes
    from ddp_eval.state._numbers import is_probe, untouched
    from ddp_eval.state._values import Op
    from ddp_eval.state.bookkeeping import StageBook

    made = []
    monkeypatch.setattr(_attributes, "probe", lambda value, label="", make=_attributes.probe: made.append(label)
                        or make(value, label))
    holder = types.SimpleNamespace(labels=("a", "b", "c"), text="abc", n=0,
                                   _ddp_brain_attributes=frozenset({"_ddp_brain_attributes"}))
    book = StageBook(holder, DDPEvalConfig())
    book.start()
    kept = []
    try:
        assert sorted(made) == ["labels", "n", "text"] and is_probe(holder.labels) and is_probe(holder.text)
        made.clear()
        book.after_batch()  # nothing used them: the same probes stand in again
        assert made == []
        assert len(holder.labels) == 3  # a read: noted, and the next batch gets a new probe
        kept.append(holder.text)  # kept outside the Brain: its next uses would be noted as the batch's
        holder.n += 1
        book.after_batch()
        assert sorted(made) == ["labels", "n", "text"]
        assert untouched(holder.labels) and untouched(holder.text) and holder.text is not kept[0]
        slot = book.attributes.tracks["labels"]
        assert slot.compared and [op for _, op, _ in slot.events] == [Op.COMPARED]  # len() kept, replayed at the merge
        holder.labels += ("d",)  # extended by scalars: still a probe's (only the tail was checked)
        book.after_batch()
        assert is_probe(holder.labels) and holder.labels == ("a", "b", "c", "d")
        holder.labels += ([1],)  # a list in it: no probe stands in for it any more
        book.after_batch()
        assert not is_probe(holder.labels) and type(holder.labels) is tuple
    finally:
        book.release()
