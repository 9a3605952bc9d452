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
#: The submodules that define the names above (imported on first use).
_SUBMODULES = ('onnx_export', 'ort_check')


def __getattr__(name: str) -> Any:
    if name in __all__:
        for sub in _SUBMODULES:
            module = importlib.import_module(f'.{sub}', __name__)
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
