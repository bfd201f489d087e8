"""The quick lane: ``python -m pytest -m fast`` runs the doctests of every module of
ddp_eval and the tests marked ``fast`` (see docs/testing.md)."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if isinstance(item, pytest.DoctestItem):
            item.add_marker(pytest.mark.fast)
