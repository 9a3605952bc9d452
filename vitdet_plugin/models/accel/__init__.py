"""Accelerated kernels beside the models' plain path, behind one switch (``accel``).

A backbone asks once per forward for a runner (:mod:`.runners`) from the plan of its input
(:mod:`.dispatch` says where each kernel runs: measured, the CPU); the runners read the model
classes through the typed :mod:`.protocols`. Each kernel has a parity test against the plain
path (``tests/test_accel.py``).
"""
from .dispatch import (ACCEL_MODES, PLAIN, AccelPlan, capturing_graph, check_accel,
                       exporting_graph, plan_for, plan_for_tensor)
from .protocols import BlockFn
from .recompute import gelu_linear, recompute_attention
from .runners import (StageRunner, padding_free_window_attention, swin_runner, swin_v2_runner,
                      vit_block_runner)

__all__ = [
    'ACCEL_MODES', 'PLAIN', 'AccelPlan', 'BlockFn', 'StageRunner', 'capturing_graph',
    'check_accel', 'exporting_graph', 'gelu_linear', 'padding_free_window_attention',
    'plan_for', 'plan_for_tensor', 'recompute_attention', 'swin_runner', 'swin_v2_runner',
    'vit_block_runner',
]
