"""Benchmark of our backbones against the reference implementations (``tools/benchmark.py``).

Modules: :mod:`.plan` (per-device defaults, timer, precision, memory measure; no device
touched), :mod:`.models` (the compared models with the same weights, through public APIs),
:mod:`.rows` (one measured row, pooling, printing), :mod:`.cli` (the command line).
Imported as ``bench`` with ``tools/`` on the path, which running ``python tools/benchmark.py``
gives.
"""
