"""A watched container that a place outside the Brain also holds (a closure's
variable, a ``functools.partial``'s argument or keyword, a module's global, the
recipe's hparams dict two dicts down, a list's entry, a tuple or namedtuple a
closure holds, an object of the recipe's own, two objects down, and a dict, a list
or an object that ``self.hparams`` holds, two places down): for the stage that
place holds the container's recording copy, so a batch's append through it is
merged and its read there is seen, in one process as in plain Python; after the
stage it holds the container again, with the merged contents. A tuple the Brain
holds itself cannot take the copy: its container is named when batches change it."""

import collections
import functools
import sys
import types

import pytest

from tests.test_attribute_tracking import simulate


class Report:
    """An object of the recipe's own, outside the Brain."""

    def __init__(self, ids):
        self.ids = ids


Pair = collections.namedtuple("Pair", ["items", "name"])

_MADE = []


def _module_holding(ids):
    """A module of the recipe's own whose global holds ``ids``."""
    module = types.ModuleType(f"recipe_globals_{len(_MADE)}")
    module.HELD = ids
    sys.modules[module.__name__] = module
    _MADE.append(module)
    return module


def _count(held):
    return len(held)


def _add(i, held):
    held.append(i)


def _brain(place):
    """A Brain whose ``size()`` reads, and ``add(i)`` appends to, its ``ids`` through
    ``place``; with a function giving what that place holds."""
    ids = []
    if place == "partial":  # functools.partial's arguments and keywords
        size, add = functools.partial(_count, ids), functools.partial(_add, held=ids)
        brain = types.SimpleNamespace(ids=ids, sizes=[], size=size, add=add)
        return brain, lambda: (size.args[0], add.keywords["held"])
    if place.startswith("hparams"):  # read through self.hparams, as a recipe's batch code reads its YAML's values
        brain = types.SimpleNamespace(ids=ids, sizes=[], hparams=types.SimpleNamespace(
            lists={"data": {"ids": ids}}, groups=[[ids]], report=Report(Report(ids))))
        reach = {"hparams_dict": lambda h: h.lists["data"]["ids"], "hparams_list": lambda h: h.groups[0][0],
                 "hparams_object": lambda h: h.report.ids.ids}[place]
        brain.size, brain.add = lambda: len(reach(brain.hparams)), lambda i: reach(brain.hparams).append(i)
        return brain, lambda: (reach(brain.hparams),)
    if place == "closure":
        holder = ids
    elif place == "global":
        holder = _module_holding(ids)
    elif place == "recipe_dict":  # a recipe's hparams dict, a global of its module: {"data": {"ids": ids}}
        holder = _module_holding({"data": {"ids": ids}})
    elif place == "list":
        holder = [ids]
    elif place == "tuple":  # for the stage, a tuple like it holding the recording copy
        holder = (ids, "ids")
    elif place == "namedtuple":
        holder = Pair(ids, "ids")
    else:
        holder = Report(Report(ids) if place == "object_in_object" else ids)
    reach = {"closure": lambda h: h, "global": lambda h: h.HELD, "recipe_dict": lambda h: h.HELD["data"]["ids"],
             "list": lambda h: h[0], "tuple": lambda h: h[0], "namedtuple": lambda h: h.items,
             "object": lambda h: h.ids, "object_in_object": lambda h: h.ids.ids}[place]
    size, add = (lambda h: lambda: len(reach(h)))(holder), (lambda h: lambda i: reach(h).append(i))(holder)
    brain = types.SimpleNamespace(ids=ids, sizes=[], size=size, add=add)
    cells = [f.__closure__[f.__code__.co_freevars.index("h")] for f in (size, add)]  # where they read it
    return brain, lambda: tuple(reach(cell.cell_contents) for cell in cells)


PLACES = ["closure", "global", "object", "partial", "recipe_dict", "list", "tuple", "namedtuple", "object_in_object",
          "hparams_dict", "hparams_list", "hparams_object"]
SB = ("hparams",)  # set up by sb.Brain: not one of the Brain's watched values


@pytest.fixture(autouse=True)
def _forget_modules():
    yield
    for module in _MADE:
        sys.modules.pop(module.__name__, None)
    _MADE.clear()


@pytest.mark.fast
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", [[[0, 1, 2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]], [[0, 2], [1, 3, 4, 5], []]],
                         ids=["1", "2", "3-one-idle"])
def test_a_read_through_another_place_sees_the_batches_appends_or_is_named(place, layout):
    holders = {}

    def make():
        brain, held = _brain(place)
        holders[id(brain)] = held
        return brain

    def batch(brain, b):
        brain.ids.append(f"u{b}")
        brain.sizes.append(brain.size())  # steered by what earlier batches appended

    single, brains, merged = simulate(make, batch, layout, brain_attributes=SB)
    assert single.sizes == [1, 2, 3, 4, 5, 6]
    for brain in brains:
        assert brain.ids == single.ids
        for held in holders[id(brain)]():
            assert held is brain.ids and type(held) is list  # the container itself again, merged
    if len(layout) == 1:
        assert brains[0].sizes == single.sizes  # one process: what plain Python computes
    else:
        assert brains[0].sizes != single.sizes and "sizes" in merged.assumed, merged.assumed
        where = {"hparams_dict": "hparams.lists['data']['ids']", "hparams_list": "hparams.groups[0][0]",
                 "hparams_object": "hparams.report.ids.ids", "global": "['global recipe_globals_",
                 "recipe_dict": "HELD['data']['ids']", "partial": "size.args[0]"}.get(place, "'s variable 0")
        assert "'ids' was also held at stage start by [" in merged.assumed["sizes"], merged.assumed["sizes"]
        assert where in merged.assumed["sizes"], merged.assumed["sizes"]  # the place the read went through


@pytest.mark.fast
@pytest.mark.parametrize("place", PLACES)
def test_appends_through_another_place_merge_exactly(place):
    holders = {}

    def make():
        brain, held = _brain(place)
        holders[id(brain)] = held
        return brain

    single, brains, merged = simulate(make, lambda brain, b: brain.add(f"u{b}"), [[0, 2], [1, 3, 4], []],
                                      brain_attributes=SB)
    assert not merged.assumed and not merged.conflicts, (merged.assumed, merged.conflicts)
    for brain in brains:
        assert brain.ids == single.ids == [f"u{b}" for b in range(5)]
        assert all(held is brain.ids for held in holders[id(brain)]())


def _tuple_brain():
    """A Brain whose ``size()`` reads its ``ids`` through its own attribute ``pair``, a
    tuple, which the Brain's watch holds: no recording copy can stand in it."""
    ids = []
    brain = types.SimpleNamespace(ids=ids, sizes=[], pair=(ids, "ids"))
    brain.size = lambda: len(brain.pair[0])
    return brain


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2, 3]], [[0, 2], [1, 3], []]], ids=["1", "3-one-idle"])
def test_a_read_through_the_brains_own_tuple_is_named(layout):
    def batch(brain, b):
        brain.ids.append(f"u{b}")
        brain.sizes.append(brain.size())

    single, brains, merged = simulate(_tuple_brain, batch, layout)
    assert single.sizes == [1, 2, 3, 4]
    assert brains[0].sizes != single.sizes  # the tuple held the container itself: the stage-start contents
    assert "sizes" in merged.assumed, merged.assumed
    assert "(a tuple)" in merged.assumed["sizes"] and "'pair[0]'" in merged.assumed["sizes"], merged.assumed["sizes"]
    for brain in brains:
        assert brain.ids == single.ids  # the appends, through the Brain, merge exactly
        assert brain.size() == 4  # after the stage the tuple holds the container, merged


@pytest.mark.fast
def test_the_brains_own_tuple_holding_a_container_no_batch_changes_is_not_named():
    single, brains, merged = simulate(_tuple_brain, lambda brain, b: brain.sizes.append(brain.size()),
                                      [[0, 2], [1, 3], []])
    assert not merged.assumed and not merged.conflicts, (merged.assumed, merged.conflicts)
    assert all(brain.sizes == single.sizes == [0, 0, 0, 0] for brain in brains)


@pytest.mark.fast
def test_the_brains_own_tuple_is_named_beside_a_read_that_steers():
    """A batch that also reads the list whole through the Brain: the message of that
    read names the tuple's place too."""
    def batch(brain, b):
        brain.ids.append(f"u{b}")
        brain.sizes.append((len(brain.ids), brain.size()))

    single, brains, merged = simulate(_tuple_brain, batch, [[0, 2], [1, 3], []])
    assert brains[0].sizes != single.sizes
    why = merged.assumed["sizes"]
    assert "batches read ['ids']" in why and "'pair[0]'" in why and "(a tuple)" in why, why


@pytest.mark.fast
@pytest.mark.parametrize("place", PLACES)
def test_a_stage_ended_by_an_exception_gives_each_place_its_container_back(place):
    """``ShardedStage.abandon`` releases the stage's book: every place outside the
    Brain holds the container itself again, of its own type, with what the batches
    that ran appended (no stand-in outlives a failed stage)."""
    from ddp_eval.config import DDPEvalConfig
    from ddp_eval.state.bookkeeping import StageBook

    brain, held = _brain(place)
    brain._ddp_brain_attributes = frozenset({"_ddp_brain_attributes", *SB})
    book = StageBook(brain, DDPEvalConfig())
    book.start()
    assert all(h is brain.ids for h in held())  # the Brain's recording copy stands there too, for the stage
    brain.add("u0")
    book.after_batch()
    brain.add("u1")  # the batch that raised
    book.release()
    assert type(brain.ids) is list and brain.ids == ["u0", "u1"]
    for h in held():
        assert h is brain.ids and type(h) is list
