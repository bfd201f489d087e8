"""Which statements ddp_eval replays as a choice (``self.best = max(self.best, s)``),
told from the calling code's bytecode; everything else stays a comparison."""

import builtins
import sys
import types

import pytest

from ddp_eval.state._select import stored_choice
from tests.test_attribute_tracking import simulate


class Seen(float):
    """A float that notes, at each comparison, what ``stored_choice`` tells of its caller."""

    kinds: list = []

    def __lt__(self, other):
        Seen.kinds.append(stored_choice(sys._getframe(1)))
        return float.__lt__(self, other)

    def __gt__(self, other):
        Seen.kinds.append(stored_choice(sys._getframe(1)))
        return float.__gt__(self, other)


def _stored_back(h, k, s):
    h.best = max(h.best, s)


def _reversed(h, k, s):
    h.best = min(s, h.best)


def _by_key(h, k, s):
    h.by[k] = max(h.by[k], float(s))


def _argument_called(h, k, s):
    h.best = max(h.best, float(abs(s)))


def _elsewhere(h, k, s):
    h.other = max(h.best, s)


def _in_a_local(h, k, s):
    best = max(h.best, s)
    h.best = best


def _three_arguments(h, k, s):
    h.best = max(h.best, s, 0.1)


def _by_if(h, k, s):
    if s > h.best:
        h.best = s


def _nested(h, k, s):
    h.best = max(max(h.best, 0.1), s)


def _another_key(h, k, s):
    h.by[k + 1] = max(h.by[k], s)


def _a_jump_in_an_argument(h, k, s):
    h.best = max(h.best, s if k else 0.0)


def _own_max(h, k, s):
    h.best = max(h.best, s)  # with the module's own max in its globals (below)


CHOICES = [(_stored_back, "max"), (_reversed, "min"), (_by_key, "max"), (_argument_called, "max")]
COMPARISONS = [_elsewhere, _in_a_local, _three_arguments, _by_if, _nested, _another_key, _a_jump_in_an_argument]


def _kinds(statement, **globals_):
    h = types.SimpleNamespace(best=Seen(0.5), other=None, by={0: Seen(0.5), 1: Seen(0.5)})
    run = types.FunctionType(statement.__code__, {**statement.__globals__, **globals_})
    Seen.kinds = []
    run(h, 0, 0.75)
    return Seen.kinds


@pytest.mark.fast
@pytest.mark.parametrize("statement,kind", CHOICES, ids=[s.__name__ for s, _ in CHOICES])
def test_the_builtin_stored_back_is_a_choice(statement, kind):
    assert _kinds(statement) == [kind]


@pytest.mark.fast
@pytest.mark.parametrize("statement", COMPARISONS, ids=[s.__name__ for s in COMPARISONS])
def test_any_other_comparison_is_not(statement):
    kinds = _kinds(statement)
    assert kinds and set(kinds) == {None}, kinds


@pytest.mark.fast
def test_a_max_of_the_modules_own_is_not():
    assert _kinds(_own_max) == ["max"]
    assert set(_kinds(_own_max, max=lambda a, b: builtins.max(a, b))) == {None}


@pytest.mark.fast
@pytest.mark.parametrize("layout", [[[0, 1, 2], [3, 4, 5]], [[0, 2, 4], [1, 3, 5]], [[5, 1], [4, 0], [3, 2]]])
@pytest.mark.parametrize("start", [0.0, 0])
def test_choices_equal_one_process_at_any_order_and_name_nothing(layout, start):
    """Float and int extremes, both argument orders, dict entries and repeated calls in
    a batch, over layouts where a rank's first batch compares with the start value
    while one process compares another batch's."""
    scores = [3, 1, 7, 2, 9, 4]

    def make():
        return types.SimpleNamespace(best=start, low=start + 100, by={0: start, 1: start})

    def batch(h, b):
        s = scores[b] if isinstance(start, int) else scores[b] / 10
        h.best = max(h.best, s)
        h.low = min(s, h.low)
        for k in (b % 2, b % 2):
            h.by[k] = max(h.by[k], s)

    single, holders, merged = simulate(make, batch, layout)
    assert not merged.assumed and not merged.conflicts, (merged.assumed, merged.conflicts)
    for holder in holders:
        assert vars(holder) == vars(single)
        assert all(type(getattr(holder, name)) is type(getattr(single, name)) for name in vars(single))


@pytest.mark.fast
def test_an_int_a_float_made_from_in_c_is_named_where_it_matters():
    """``min(n, 2.0)`` on an int compares in C (no probe sees it): named when a rank's
    batch found another value than one process's, not merged as the last batch's."""
    def make():
        return types.SimpleNamespace(low=100)

    def batch(h, b):
        h.low = min(h.low, [3.0, 1.0, 7.0, 2.0, 9.0, 4.0][b])

    single, holders, merged = simulate(make, batch, [[0, 1, 2], [3, 4, 5]])
    assert single.low == 1.0 and holders[0].low == 2.0  # merged as each rank's batches did it
    assert "low" in merged.assumed and "start it as a float" in merged.assumed["low"]
    single, holders, merged = simulate(make, batch, [[0, 1, 2, 3, 4, 5], []])
    assert not merged.assumed and [h.low for h in holders] == [1.0, 1.0]
