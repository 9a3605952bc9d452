import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py

# The CI machine has 2 cores; keep runs deterministic and avoid oversubscription.
torch.manual_seed(0)


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
