#!/usr/bin/env python
"""Python steps of tools/gpu_check.sh: ``prune-mmcv``, ``checks``, ``report`` (``--help``).
The code lives in the ``gpu_check_kit`` package beside this script."""
import sys

from gpu_check_kit.cli import main

if __name__ == '__main__':
    sys.exit(main())
