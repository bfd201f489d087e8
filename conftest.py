"""Markers of the suite (see docs/testing.md).

* ``fast``: the quick lane (``python -m pytest -m fast``): the doctests of every
  module of ddp_eval and the tests marked ``fast``.
* ``releases``: the tests whose code depends on the SpeechBrain and torch releases
  beyond the quick lane, which CI runs again on the oldest supported pair
  (``.ci/run``): SpeechBrain's Brain loop, samplers, metrics, InputNormalization and
  Checkpointer (exactness at 1-4 ranks, batch plans, recipe patterns and saves,
  verify, checkpoint formats and faults) and torch's launcher and store (torchrun
  --max-restarts, SIGKILLed jobs, rank 0 exiting at once, the demo recipe under
  torchrun). Not marked: the SIGKILL-at-every-file-system-step tests and the
  200-round stress (the checkpoint code of test_checkpoint_distributed and
  test_async_save), 8 ranks of the exactness test (the code of 1-4), the two-node
  launch (the code of the single-node torchrun tests), and the tests of
  version-independent code (control channel, attribute bookkeeping, outside state,
  streams, async saves, inspect, resumable evaluation).
"""

import pytest

RELEASE_FILES = {
    "test_mixin_distributed.py", "test_checkpoint_distributed.py", "test_checkpoint_compat.py",
    "test_restarts.py", "test_resume_kill.py", "test_fast_exit.py", "test_recipe_saves.py",
    "test_batch_plan.py", "test_recipe_patterns.py", "test_verify.py",
}
RELEASE_TESTS = {"test_recipes.py::test_demo_recipe"}
NOT_RELEASES = {
    "test_mixin_distributed.py::test_distributed_equals_single_process[8]",
    "test_checkpoint_distributed.py::test_stress_200_rounds_on_4_ranks_keeps_what_speechbrain_keeps",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if isinstance(item, pytest.DoctestItem):
            item.add_marker(pytest.mark.fast)
            continue
        name = f"{item.path.name}::{item.name}"
        if (item.path.name in RELEASE_FILES or name in RELEASE_TESTS) and name not in NOT_RELEASES:
            item.add_marker(pytest.mark.releases)
