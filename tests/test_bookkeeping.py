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
