"""A float or tensor on the left of a watched number reads it in C, where no probe
sees it (``100.0 * self.correct``): the batch code's bytecode names such reads."""

import types

import pytest
import torch

from ddp_eval.state._c_reads import read_in_c
from tests.test_attribute_tracking import simulate


class Counting:
    """A recipe's Brain keeping counters, and what its batches compute from them."""

    def __init__(self):
        self.correct, self.seen, self.weight = 0, 0, 2
        self.running_acc, self.late, self.scaled = 0.0, [], []

    def compute_objectives(self, b):
        self.correct += b % 2
        self.seen += 1
        self._progress(b)

    def _progress(self, b):  # a method of its own, called from the batch
        self.running_acc = 100.0 * self.correct / self.seen

    def on_stage_end(self):  # after the merge: the merged counters
        return 100.0 * self.correct / self.seen


class Steering(Counting):
    def _progress(self, b):
        if 2.5 < self.seen:
            self.late.append(b)


class Tensors(Counting):
    def _progress(self, b):
        self.scaled.append(float(torch.tensor(1.5) * self.seen))


class Constant(Counting):
    def _progress(self, b):  # read in C, but no batch changes it; a probe's own method; its reflected one
        self.scaled.append(2.5 * self.weight + self.weight * 1.5)
        self.late.append(1 + self.weight)


@pytest.mark.fast
def test_the_scan_finds_right_operands_read_in_c():
    assert read_in_c(Counting) == {"correct", "seen"}
    assert read_in_c(Steering) == {"seen"} and read_in_c(Tensors) == {"seen"}
    assert read_in_c(Constant) == {"weight"}


@pytest.mark.fast
@pytest.mark.parametrize("recipe", [Counting, Steering, Tensors])
def test_what_a_batch_computes_from_a_number_read_in_c_is_named(recipe):
    """Merged as each rank did it (wrong), so named with the read that steered it."""
    single, holders, merged = simulate(recipe, lambda h, b: h.compute_objectives(b), [[0, 1, 2], [3, 4, 5]])
    named = set(merged.assumed) | set(merged.conflicts)
    differs = {name for name, want in vars(single).items() if getattr(holders[0], name) != want}
    assert differs and differs <= named, (differs, named)
    why = merged.assumed[sorted(differs)[0]]
    assert f"batches read {sorted(read_in_c(recipe))}" in why and "read accumulated values in on_stage_end" in why


@pytest.mark.fast
def test_a_number_no_batch_changes_read_in_c_and_reads_after_the_merge_name_nothing():
    single, holders, merged = simulate(Constant, lambda h, b: h.compute_objectives(b), [[0, 2, 4], [1, 3, 5]])
    assert not merged.assumed and all(vars(h) == vars(single) for h in holders)
    assert all(h.on_stage_end() == single.on_stage_end() for h in holders)


def test_a_class_without_batch_methods_has_none():
    assert read_in_c(types.SimpleNamespace) == frozenset()
