import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py

# The CI machine has 2 cores; keep runs deterministic and avoid oversubscription.
torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
