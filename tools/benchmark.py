#!/usr/bin/env python
"""Speed and memory of our backbones vs mmdet / timm, as ratios: ``python tools/benchmark.py
--help``. The code lives in the ``bench`` package beside this script (``tools/bench/``)."""
from bench.cli import main

if __name__ == '__main__':
    main()
