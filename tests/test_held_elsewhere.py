"""A watched container that a place outside the Brain also holds (a closure's
variable, a module's global, a field of an object of the recipe's own): for the
stage that place holds the container's recording copy, so a batch's append through
it is merged and its read there is seen, in one process as in plain Python; after
the stage it holds the container again, with the merged contents."""

import sys
import types

import pytest

from tests.test_attribute_tracking import simulate


class Report:
    """An object of the recipe's own, outside the Brain."""

    def __init__(self, ids):
        self.ids = ids


_MADE = []


def _module_holding(ids):
    """A module of the recipe's own whose global holds ``ids``."""
    module = types.ModuleType(f"recipe_globals_{len(_MADE)}")
    module.HELD = ids
    sys.modules[module.__name__] = module
    _MADE.append(module)
    return module


def _brain(place):
    ids = []
    if place == "closure":
        size, add = (lambda held: lambda: len(held))(ids), (lambda held: lambda i: held.append(i))(ids)
        holder = None
    elif place == "global":
        holder = _module_holding(ids)
        size, add = (lambda m: lambda: len(m.HELD))(holder), (lambda m: lambda i: m.HELD.append(i))(holder)
    else:
        holder = Report(ids)
        size, add = (lambda r: lambda: len(r.ids))(holder), (lambda r: lambda i: r.ids.append(i))(holder)
    brain = types.SimpleNamespace(ids=ids, sizes=[], size=size, add=add)
    return brain, holder


def _held(place, brain, holder):
    """The container the outside place holds."""
    if place == "closure":
        return brain.size.__closure__[0].cell_contents
    return holder.HELD if place == "global" else holder.ids


@pytest.fixture(autouse=True)
def _forget_modules():
    yield
    for module in _MADE:
        sys.modules.pop(module.__name__, None)
    _MADE.clear()


@pytest.mark.fast
@pytest.mark.parametrize("place", ["closure", "global", "object"])
@pytest.mark.parametrize("layout", [[[0, 1, 2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]], [[0, 2], [1, 3, 4, 5], []]],
                         ids=["1", "2", "3-one-idle"])
def test_a_read_through_another_place_sees_the_batches_appends_or_is_named(place, layout):
    holders = {}

    def make():
        brain, holder = _brain(place)
        holders[id(brain)] = holder
        return brain

    def batch(brain, b):
        brain.ids.append(f"u{b}")
        brain.sizes.append(brain.size())  # steered by what earlier batches appended

    single, brains, merged = simulate(make, batch, layout)
    assert single.sizes == [1, 2, 3, 4, 5, 6]
    for brain in brains:
        assert brain.ids == single.ids
        held = _held(place, brain, holders[id(brain)])
        assert held is brain.ids and type(held) is list  # the container itself again, merged
    if len(layout) == 1:
        assert brains[0].sizes == single.sizes  # one process: what plain Python computes
    else:
        assert brains[0].sizes != single.sizes and "sizes" in merged.assumed, merged.assumed


@pytest.mark.fast
@pytest.mark.parametrize("place", ["closure", "global", "object"])
def test_appends_through_another_place_merge_exactly(place):
    holders = {}

    def make():
        brain, holder = _brain(place)
        holders[id(brain)] = holder
        return brain

    single, brains, merged = simulate(make, lambda brain, b: brain.add(f"u{b}"), [[0, 2], [1, 3, 4], []])
    assert not merged.assumed and not merged.conflicts, (merged.assumed, merged.conflicts)
    for brain in brains:
        assert brain.ids == single.ids == [f"u{b}" for b in range(5)]
        assert _held(place, brain, holders[id(brain)]) is brain.ids
