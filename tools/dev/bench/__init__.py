"""Benchmark of our backbones against the reference implementations: the measuring code of
``tools/benchmark.py`` (the command line, which holds the argument parser and ``main``).

Modules: :mod:`.plan` (per-device defaults, timer, precision, memory measure; no device
touched), :mod:`.models` (the compared models with the same weights, through public APIs),
:mod:`.rows` (one measured row, pooling, printing), :mod:`.compiled` (``--compile``),
:mod:`.ops` (``--model ops``), :mod:`.fsdp_memory` (``--fsdp-memory``),
:mod:`.end_to_end_latency` (``--end-to-end``), :mod:`.rfdetr_onnx` (``--rfdetr-onnx``),
:mod:`.rfdetr_train` (``--rfdetr-train``), :mod:`.dfine_latency` (``--dfine-latency``). Not an
entry point: imported as ``dev.bench`` with ``tools/`` on the path, which running ``python
tools/benchmark.py`` gives. The op rows share the op-parity module ``dev.op_parity``
(``tools/dev/op_parity.py``).
"""
