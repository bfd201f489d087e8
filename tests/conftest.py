import glob
import multiprocessing
import os
import sys
import tempfile

import pytest
import torch.distributed as dist

from tests.mp_harness import POOL


def _forget_lazy_modules_that_cannot_import():
    """Hypothesis reads ``__file__`` of every module in ``sys.modules``; SpeechBrain's
    lazy modules of optional integrations (k2) raise ImportError there."""
    for name, module in list(sys.modules.items()):
        if type(module).__name__.endswith(("LazyModule", "Redirect")):
            try:
                getattr(module, "__file__", None)
            except ImportError:
                del sys.modules[name]


@pytest.fixture(autouse=True, scope="module")
def lazy_modules_that_cannot_import_forgotten():
    """After a test module imported SpeechBrain, before hypothesis looks."""
    _forget_lazy_modules_that_cannot_import()


_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_leaked_process_group_or_env():
    """Fails a test that leaves a process group, torchrun variables, child
    processes (other than the harness's pool of ranks) or harness work
    directories behind."""
    before = {k: os.environ.get(k) for k in _RANK_VARS}
    pattern = os.path.join(tempfile.gettempdir(), f"ddp_eval_mp_{os.getpid()}_*")  # this session only
    workdirs = set(glob.glob(pattern))
    yield
    children = [c for c in multiprocessing.active_children() if c.pid not in POOL.pids()]
    for child in children:
        child.kill()
    assert not children, f"test left processes running: {children}"
    assert set(glob.glob(pattern)) <= workdirs, "test left process-group work directories behind"
    leaked = dist.is_available() and dist.is_initialized()
    if leaked:
        dist.destroy_process_group()
    after = {k: os.environ.get(k) for k in _RANK_VARS}
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    assert not leaked, "test left a process group initialised"
    assert before == after, f"test leaked environment variables: {before} -> {after}"


def pytest_configure(config):
    """The quick lane (``-m fast`` alone) draws fewer programs in the property tests
    (``tests.test_operations_from_types.SHORT``); the full suite draws them all."""
    if config.getoption("markexpr", "") == "fast":
        os.environ["DDP_EVAL_QUICK_LANE"] = "1"


def pytest_terminal_summary(terminalreporter):
    if POOL.started:
        terminalreporter.write_line(
            f"rank pool: {POOL.started} processes started, discarded {len(POOL.discarded)} times "
            f"({'; '.join(POOL.discarded[:12]) or 'never'})")
