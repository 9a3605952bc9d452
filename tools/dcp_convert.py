#!/usr/bin/env python
"""Convert a sharded run's DCP checkpoint directory to one mmengine checkpoint file (what
``tools/test.py``, ``load_from`` and DDP runs read), or a file to a DCP directory.

    python tools/dcp_convert.py work_dirs/run/iter_5000 iter_5000.pth   # DCP -> file
    python tools/dcp_convert.py iter_5000.pth iter_5000_dcp              # file -> DCP
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vitdet_plugin.engine.dcp import convert


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('src', help='a DCP checkpoint directory or a .pth file')
    parser.add_argument('dst', help='the file or directory to write (must not exist)')
    args = parser.parse_args(argv)
    try:
        direction = convert(args.src, args.dst)
    except (ValueError, FileExistsError) as e:
        sys.exit(f'error: {e}')
    print(f'{direction}: {args.src} -> {args.dst}')


if __name__ == '__main__':
    main()
