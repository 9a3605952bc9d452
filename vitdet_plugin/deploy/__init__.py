"""Deployment: ONNX export (backbone / neck / dense-head raw outputs, or the whole detector from
the uint8 image to its detections) and onnxruntime checks; the ``deploy`` extra (``onnx``,
``onnxscript``, ``onnxruntime``) is needed for those, not for importing this package.

:mod:`.runner` runs an exported end-to-end graph with numpy + onnxruntime only: this package
imports nothing at import time (the export side needs torch), so the runner loads without torch.
The export names below are loaded on first use.
"""
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .onnx_export import (EXPORT_SAMPLE_SIZE, INPUT_NAME, OPSET, PARTS, DetectorPart,
                              build_detector_part, dynamic_shapes, export_onnx)
    from .ort_check import (CHECK_SIZES, DEFAULT_TOLERANCE, Latency, SizeCheck, check_sizes,
                            latency, ort_session)

__all__ = ['EXPORT_SAMPLE_SIZE', 'INPUT_NAME', 'OPSET', 'PARTS', 'DetectorPart',
           'build_detector_part', 'dynamic_shapes', 'export_onnx', 'CHECK_SIZES',
           'DEFAULT_TOLERANCE', 'Latency', 'SizeCheck', 'check_sizes', 'latency', 'ort_session']
#: The submodule of each public name (the first eight: onnx_export, the rest: ort_check).
_LAZY = {name: 'onnx_export' if i < 8 else 'ort_check' for i, name in enumerate(__all__)}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    return getattr(importlib.import_module(f'.{_LAZY[name]}', __name__), name)
