"""Deployment: ONNX export (backbone / neck / dense-head raw outputs, :mod:`.onnx_export` and its
check :mod:`.ort_check`; or the whole detector from the uint8 image to its detections,
:mod:`.end_to_end` and :mod:`.end_to_end_check`) and :mod:`.runner`, which runs an exported
end-to-end graph with numpy + onnxruntime only. The ``deploy`` extra (``onnx``, ``onnxscript``,
``onnxruntime``) is needed for those, not for importing this package, which imports nothing:
the runner loads without torch.
"""
