"""Python parts of ``tools/gpu_check.sh`` (the one-call check on a lent GPU machine):
:mod:`.steps` (the step list and its runner: dependencies, budget, timeouts), :mod:`.env`
(versions, the carried wheels, the installed stack), :mod:`.checks` and :mod:`.op_checks` (the
functional GPU checks), :mod:`.bench` (the benchmark row by row), :mod:`.results` and
:mod:`.report` (results written as they come, the compact table), :mod:`.cli`
(``tools/gpu_check.py``). Imported as ``gpu_check_kit`` with ``tools/`` on the path, as running
a script in ``tools/`` gives."""
