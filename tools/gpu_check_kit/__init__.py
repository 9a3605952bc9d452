"""Python parts of ``tools/gpu_check.sh`` (the one-call check on a lent GPU machine):
:mod:`.mmcv_ops` (build only the CUDA ops the detectors need), :mod:`.checks` (functional GPU
checks), :mod:`.report` (the compact table), :mod:`.cli` (``tools/gpu_check.py``). Imported as
``gpu_check_kit`` with ``tools/`` on the path, as running a script in ``tools/`` gives."""
