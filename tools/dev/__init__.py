"""Developer kits, not user entry points: the benchmark harness of ``tools/benchmark.py``
(:mod:`dev.bench`), the op-parity module (:mod:`dev.op_parity`, also a command line) and the GPU
check kit (``gpu_check.sh`` / ``gpu_check.py`` / ``gpu_check_kit/``, run with ``tools/dev/`` on the
path). Imported as ``dev`` with ``tools/`` on the path."""
