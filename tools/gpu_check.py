#!/usr/bin/env python
"""The GPU check (``bash tools/gpu_check.sh`` runs ``tools/gpu_check.py run``) and its steps'
commands: ``environment``, ``wheels``, ``stack``, ``checks GROUP``, ``bench NAME``, ``report``
(``--help``). The code lives in the ``gpu_check_kit`` package beside this script."""
import sys

from gpu_check_kit.cli import main

if __name__ == '__main__':
    sys.exit(main())
