"""The property of tests/test_operations_from_types.py fails with each check switched
off: for each, hypothesis finds a program whose value is silently wrong, and the
same program is equal or named with the check back on. (Apart from the property
tests, so that the two files run side by side.)"""

import pytest
from hypothesis import Phase, find, settings

from ddp_eval.state import _recording, _slot_changes
from tests.test_operations_from_types import (
    ALIASED,
    LAZY_BLEU,
    METRIC,
    REBOUND,
    STEERED_FEW,
    STEERING,
    programs,
    run_program,
    silently_wrong,
)

# the first silently wrong program found is enough: shrinking it costs more than finding it
NO_SHRINKING = settings(max_examples=500, derandomize=True, database=None, deadline=None, phases=[Phase.generate])


def _fails_when_switched_off(monkeypatch, module, switch, names, off=False):
    """With ``module.switch`` off (set to ``off``), hypothesis finds a silently wrong
    program over ``names``; with it back on, that program is equal or named."""
    monkeypatch.setattr(module, switch, off)
    wrong = find(programs(names=names), lambda p: any(p[0]) and silently_wrong(*p) is not None,
                 settings=NO_SHRINKING)
    assert silently_wrong(*wrong) is not None
    monkeypatch.undo()
    assert silently_wrong(*wrong) is None



@pytest.mark.fast
def test_the_property_fails_with_the_stage_end_checks_off(monkeypatch):
    """With the recording containers and the in-place checks switched off, hypothesis
    finds a program whose values are silently wrong: the checks are what hold it."""
    monkeypatch.setattr(_recording, "ENABLED", False)
    wrong = find(programs(names=["list.sort", "list.append", "Tensor.mul_", "Tensor.add_", "set.discard",
                                 "set.add", "deque.append"]),
                 lambda p: any(p[0]) and silently_wrong(*p) is not None,
                 settings=NO_SHRINKING)
    assert silently_wrong(*wrong) is not None
    monkeypatch.setattr(_recording, "ENABLED", True)
    assert silently_wrong(*wrong) is None


@pytest.mark.fast
def test_without_sending_up_entries_set_below_the_watched_depth_the_property_fails(monkeypatch):
    """With an entry three subscripts down set anew (``self.deep[a][b]["n"] += 1``) left
    out of its attribute's record, hypothesis finds a program whose nested counter is
    silently one rank's."""
    from ddp_eval.state import _watches

    _fails_when_switched_off(monkeypatch, _watches, "SETS_BELOW_GO_UP", [
        "deep[a][b][n] += 1", "if (deep[a][b][n] += 1) == 1: first.append", "first.append", "list.append"])


@pytest.mark.fast
def test_without_naming_steered_appends_the_property_fails(monkeypatch):
    """With the read-then-append naming switched off, hypothesis finds a program whose
    list is silently wrong (each rank's read saw its own batches only)."""
    _fails_when_switched_off(monkeypatch, _recording, "STEERABLE", STEERING)


@pytest.mark.fast
def test_without_metric_lists_on_the_attribute_engine_the_property_fails(monkeypatch):
    """With a metric object's lists back on a recorder of lengths (0.6.0), hypothesis
    finds a program whose metric object is silently wrong (a subclass that sorts, an
    insert, a read that steers an append)."""
    from ddp_eval.state import metrics

    _fails_when_switched_off(monkeypatch, metrics, "WATCH_FLAT_LISTS",
                             [name for name in METRIC if not name.startswith("lazy") and "bleu" not in name])


@pytest.mark.fast
def test_without_following_what_metric_holders_hold_besides_them_the_property_fails(monkeypatch):
    """With what an attribute holding metric objects holds besides them left unfollowed
    (0.9.21), hypothesis finds a program whose counter or list beside a metric object
    is silently each rank's own."""
    from ddp_eval.state import _metric_holders

    _fails_when_switched_off(monkeypatch, _metric_holders, "FOLLOW_HOLDERS", [
        "holding metric.append", "holding metric's dict['n'] += 1", "holding metric's dict['ids'].append",
        "own metric.append", "own metric's dict['n'] = get + 1"])


@pytest.mark.fast
def test_without_shared_recording_copies_the_property_fails(monkeypatch):
    """With each place left holding the container itself or a recording copy of its own
    (0.9.1), hypothesis finds a program that is silently wrong (a read or an append
    through hparams, two attributes, a dict entry)."""
    _fails_when_switched_off(monkeypatch, _recording, "SHARE_COPIES", ALIASED)


@pytest.mark.fast
def test_without_naming_what_a_read_steers_the_property_fails(monkeypatch):
    """With the stage-wide naming after a read that gave another answer than one process's
    switched off, hypothesis finds a program whose value is silently wrong."""
    from ddp_eval.state import bookkeeping

    _fails_when_switched_off(monkeypatch, bookkeeping, "NAME_WHAT_READS_STEER", STEERED_FEW)


@pytest.mark.fast
def test_without_hooking_bleus_append_and_targets_the_property_fails(monkeypatch):
    """With ``BLEUStats.append`` and ``targets`` left unhooked for the stage, hypothesis
    finds a program whose reference lists are silently wrong: an insert or a reverse in
    the batch whose append bound them (each rank's first), or a batch's own ``targets
    is None`` test that steered."""
    from ddp_eval.state import _lazy_metrics

    _fails_when_switched_off(monkeypatch, _lazy_metrics, "HOOK_NESTED_FIELDS", LAZY_BLEU)


@pytest.mark.fast
@pytest.mark.parametrize("check,off", [("_unreadable", lambda value: False),
                                       ("unprobed", lambda value, found: value)], ids=["unreadable", "probes"])
def test_without_naming_unreadable_rebinds_or_handing_back_probes_the_property_fails(monkeypatch, check, off):
    """With rebinds over a value whose reads no probe sees taken as set anew, or the
    probes a batch stored elsewhere left in place, hypothesis finds a program whose
    value is silently wrong (a Fraction summed, a bool or-ed) or holds a stand-in."""
    from ddp_eval.state import _slot_changes

    _fails_when_switched_off(monkeypatch, _slot_changes, check, REBOUND, off)


@pytest.mark.fast
def test_without_the_check_of_ints_made_floats_the_property_fails(monkeypatch):
    """``n = max(n, 0.5)`` or ``n = 0.5 + n`` on an int: the float compares with or adds
    the int in C, where no probe sees it. With that set not taken as an unseen read,
    hypothesis finds a program whose ``n`` is silently wrong."""
    _fails_when_switched_off(monkeypatch, _slot_changes, "UNSEEN_INT_READS", ["n = max(n, v)", "n = v + n"])


def test_without_choices_running_extremes_are_named(monkeypatch):
    """``best = max(best, v)`` at interleaved ranks: replayed as a choice it names
    nothing; merged as a comparison it is named (exact either way)."""
    program = [["best = max(best, v)", "low = min(v, low)", "best_by[k] = max(best_by[k], v)"]] * 6
    owners = [0, 1, 1, 0, 2, 0]
    assert run_program(program, owners, 3)[2] == set()
    monkeypatch.setattr(_slot_changes, "CHOICES", False)
    assert {"best", "low", "best_by"} <= {label.split("[")[0] for label in run_program(program, owners, 3)[2]}


@pytest.mark.fast
@pytest.mark.parametrize("operation", ["read in C through a local", "read in C by a function given self",
                                       "read in C by a held object's method",
                                       "read in C by a function given a field", "a dict's int entry read in C",
                                       "read in C by a method of an object in a dict",
                                       "an int read in C as a list's index", "read in C through a local unpacked",
                                       "read in C through a conditional expression",
                                       "read in C in a loop over objects",
                                       "read in C by a method found by name",
                                       "read in C by a function held in hparams",
                                       "read in C through a list display",
                                       "read in C by a function held in a dict",
                                       "read in C of what a function given a dict hands back",
                                       "read in C of what a dict's get hands back",
                                       "read in C in a comprehension over a tuple of objects",
                                       "read in C by a lambda given to map with a tuple of objects",
                                       "read in C by a nested function given an object",
                                       "read in C of a dict display's values",
                                       "read in C by C code given a tuple display",
                                       "a list of tensors torch.stack takes the entries of",
                                       "an object's fields json.dumps(vars(o)) reads in C",
                                       "read in C by a callable a library's call makes",
                                       "read in C by a library's function hparams hold",
                                       "read in C of vars(self) by a held object's method",
                                       "read in C by a helper's parameter given to a library's function",
                                       "read in C of what a method of the recipe's hands back",
                                       "read in C of what a function of the recipe's hands back",
                                       "read in C by a library's function held in a dict",
                                       "read in C by a helper given a field ahead of a spread tuple",
                                       "read in C by a helper packing its arguments (*values)",
                                       "read in C of what a function of the recipe's hparams hold hands back",
                                       "read in C by a closure on the Brain", "a number a text's % formats",
                                       "read in C by a property's getter"])
def test_without_the_bytecode_scan_numbers_read_in_c_are_silently_wrong(monkeypatch, operation):
    """``2.5 * count`` through a local, a module's function given the Brain, a held
    object's method: a float reads a watched int in C, where no probe sees it. Without
    the scan of the batch code, hypothesis finds a program silently wrong."""
    from ddp_eval.state import bookkeeping

    _fails_when_switched_off(monkeypatch, bookkeeping, "SCAN_C_READS", [operation])


@pytest.mark.fast
@pytest.mark.parametrize("operation", ["steer by a partial's len(c_list)", "steer by k in a tuple's c_dict",
                                       "steer by len of a closure's dict's nested"])
def test_without_copies_in_partials_tuples_and_dicts_outside_the_brain_reads_there_are_silently_wrong(
        monkeypatch, operation):
    """A read through a ``functools.partial``'s argument, a tuple or a dict a closure
    holds: without the recording copy in those places (0.9.14 left the container
    itself there), hypothesis finds a program silently wrong."""
    _fails_when_switched_off(monkeypatch, _recording, "SHARE_COPIES",
                             [operation, "list.append", "dict.__setitem__", "nested.append([b])"])
