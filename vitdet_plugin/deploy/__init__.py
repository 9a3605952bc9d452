"""Deployment: ONNX export of backbone / neck / dense-head raw outputs with dynamic sizes, and
onnxruntime checks (parity with PyTorch, latency). Needs the ``deploy`` extra (``onnx``,
``onnxscript``, ``onnxruntime``); importing this package does not."""
from .onnx_export import (EXPORT_SAMPLE_SIZE, INPUT_NAME, OPSET, PARTS, DetectorPart,
                          build_detector_part, dynamic_shapes, export_onnx)
from .ort_check import (CHECK_SIZES, DEFAULT_TOLERANCE, Latency, SizeCheck, check_sizes,
                        latency, ort_session)

__all__ = ['EXPORT_SAMPLE_SIZE', 'INPUT_NAME', 'OPSET', 'PARTS', 'DetectorPart',
           'build_detector_part', 'dynamic_shapes', 'export_onnx', 'CHECK_SIZES',
           'DEFAULT_TOLERANCE', 'Latency', 'SizeCheck', 'check_sizes', 'latency', 'ort_session']
