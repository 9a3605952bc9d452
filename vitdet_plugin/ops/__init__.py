"""Compile-free mmcv ops: mmcv's compiled extension (``mmcv._ext``) on torchvision and PyTorch.

mmdet's detectors call mmcv's ops (``nms``, ``batched_nms``, ``RoIAlign``, ``sigmoid_focal_loss``,
``MultiScaleDeformableAttention``, deformable convolution, ...), which call the compiled
extension. With ``mmcv-lite`` (mmcv's Python code without the extension) installed, the finder of
:mod:`.startup` answers ``import mmcv._ext`` with this backend: each function has mmcv's
signature and semantics, on torchvision's kernels where they exist (nms, RoIAlign avg mode,
deformable convolution) and PyTorch elsewhere, on CPU and CUDA, in float16 / bfloat16 / float32
/ float64. Functions it does not provide raise :class:`.registry.MissingCompiledOpError` naming
the op and how to get compiled mmcv (:data:`.registry.COMPILED_FIX`). ``VITDET_MMCV_OPS``
(``auto`` | ``torch`` | ``off``) selects the backend (:mod:`.startup`).

A leaf of the package: it imports nothing of ours outside ``vitdet_plugin.ops``.
"""
from .checks import OpInputError
from .registry import COMPILED_FIX, IMPLEMENTED, MissingCompiledOpError
from .startup import ENV_VAR, MODES, install, installed, mode

__all__ = ['COMPILED_FIX', 'ENV_VAR', 'IMPLEMENTED', 'MODES', 'MissingCompiledOpError',
           'OpInputError', 'install', 'installed', 'mode']
