"""Accelerated kernels, apart from the models' plain path, behind one switch (``accel``).

See :mod:`.dispatch` for where they run (measured: the CPU) and why; each kernel has a parity
test against the plain path (``tests/test_accel.py``).
"""
from .dispatch import (ACCEL_MODES, PLAIN, AccelPlan, capturing_graph, check_accel,
                       exporting_graph, plan_for, plan_for_tensor)
from .padding_free import padding_free_window_attention
from .recompute import gelu_linear, recompute_attention
from .swin_inference import swin_chunked_inference

__all__ = [
    'ACCEL_MODES', 'PLAIN', 'AccelPlan', 'capturing_graph', 'check_accel', 'exporting_graph',
    'gelu_linear', 'padding_free_window_attention',
    'plan_for', 'plan_for_tensor', 'recompute_attention', 'swin_chunked_inference',
]
