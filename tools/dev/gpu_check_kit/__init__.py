"""Python parts of ``tools/dev/gpu_check.sh`` (the one-call check on a lent GPU machine), the
code of the command line ``tools/dev/gpu_check.py``: :mod:`.steps` (the step list and its
runner: dependencies, budget, timeouts), :mod:`.env` (versions, the carried wheels, the
installed stack), :mod:`.checks` and :mod:`.op_checks` (the functional GPU checks),
:mod:`.bench` (the benchmark row by row), :mod:`.results` and :mod:`.report` (results written as
they come, the compact table). Not an entry point: imported as ``gpu_check_kit`` with
``tools/dev/`` on the path, as running ``tools/dev/gpu_check.py`` gives."""
