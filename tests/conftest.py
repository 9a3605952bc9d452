import collections
import os
import sys
from typing import Any, Dict

import pytest
import torch

# tests/ mirrors the package (tests/weights/ holds the tests of vitdet_plugin/weights/, ...);
# the shared helpers (tests/helpers.py, the worker scripts) and the test modules that others
# build their references from (e.g. the checkpoint builders of tests/weights/) import by name
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS] + sorted(root for root, _, files in os.walk(_TESTS)
                                 if root != _TESTS and any(f.startswith('test_') for f in files))

# pytest-xdist runs TEST_JOBS workers side by side (make test: one per core). Each worker, and
# each process a test starts (torchrun, a tool), gets its share of the cores: left at torch's
# default (every core each), the OpenMP threads of the workers fight over the cores and the
# suite ran 2-5x slower per file (measured 2026-12-02: 3 heavy files 107 s -> 49 s).
_WORKERS = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
if _WORKERS > 1:
    _THREADS = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    for _var in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
        os.environ[_var] = _THREADS
    torch.set_num_threads(int(_THREADS))

torch.manual_seed(0)


def pytest_configure(config: pytest.Config) -> None:
    """Every process a test starts runs tests/subprocess_site/sitecustomize.py (transformers,
    which mmengine and mmdet import at start-up when installed, reads as not installed: ~1.7 s
    a process); pytest's own processes do not (xdist's controller starts its workers after
    this hook, and the workers run the tests that compare with transformers)."""
    from helpers import SUBPROCESS_SITE
    if hasattr(config, 'workerinput') or not config.getoption('numprocesses', default=None):
        os.environ['PYTHONPATH'] = os.pathsep.join(
            p for p in (os.environ.get('PYTHONPATH'), SUBPROCESS_SITE) if p)


@pytest.fixture(autouse=True)
def _restore_num_threads():
    """A test that sets ``torch.set_num_threads(1)`` (bitwise-reproducible runs) leaves the
    thread count as it found it: every later test would otherwise run on one core, slower, and
    with another summation order than when run on its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _uninitialized_memory_is_nan():
    """Fill every ``torch.empty`` with NaN (ints: their max) for the duration of each test.

    A read of memory nothing wrote (a parameter left to ``init_weights``, a padded buffer only
    partly filled) then fails every time instead of once in a while, depending on what the
    allocator hands back. ``fill_uninitialized_memory`` only acts in deterministic mode; on CPU
    that mode changes no kernel we use, and ``warn_only`` keeps it from raising elsewhere.
    """
    prev_mode = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(prev_mode, warn_only=prev_warn)
    torch.utils.deterministic.fill_uninitialized_memory = prev_fill


# ------------------------------------------------------------------ the slowest files, printed
#: Files listed at the end of a run that spans several (``make test`` prints them; .ci/run also
#: holds the whole suite to a time budget).
SLOWEST_FILES_SHOWN = 15
_FILE_SECONDS: Dict[str, float] = collections.defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sum setup + call + teardown per test file (under xdist the controller gets every
    worker's reports here)."""
    _FILE_SECONDS[report.nodeid.split('::', 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if len(_FILE_SECONDS) < 2:
        return
    ranked = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES_SHOWN]
    terminalreporter.section(f'slowest {len(ranked)} test files (setup + call + teardown, '
                             f's; {sum(_FILE_SECONDS.values()):.0f} s in all '
                             f'{len(_FILE_SECONDS)} files)')
    for path, seconds in ranked:
        terminalreporter.write_line(f'{seconds:8.1f}  {path}')
