"""Print the feature pyramid of a config's backbone and neck for an input size.

    python tools/analysis/feature_shapes.py CONFIG [--shape H W] [--cfg-options k=v ...]

For each backbone output and each neck level: name, channels, nominal stride (the stride the
level is built for; the map is ``ceil`` or ``floor`` of the input over it) and (B, C, H, W) shape,
from a real forward pass on a zero image (random init, no weights loaded). The input is padded
like the config's data preprocessor (``pad_size_divisor``) before the forward.
"""
import argparse
import importlib.util
import os.path as osp
import sys
from typing import List

import torch
from mmengine.config import DictAction

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))

import vitdet_plugin  # noqa: F401  (registers our modules)
from vitdet_plugin.config import load_config
from vitdet_plugin.visualization.pyramid import (Row, format_table, pad_size_divisor,
                                                  padded_shape, pyramid_rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Print a config's backbone/neck pyramid")
    parser.add_argument('config', help='config file path')
    parser.add_argument('--shape', type=int, nargs=2, default=[800, 1333], metavar=('H', 'W'),
                        help='input image size (default: 800 1333)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value')
    args = parser.parse_args(argv)
    if min(args.shape) < 1:
        parser.error(f'--shape {args.shape[0]} {args.shape[1]}: H and W must be positive')
    return args


def main(argv=None) -> List[Row]:
    from mmdet.registry import MODELS

    args = parse_args(argv)
    cfg = load_config(args.config, args.cfg_options)
    model = MODELS.build(cfg.model).eval()
    if not hasattr(model, 'backbone'):
        raise SystemExit(f'error: {type(model).__name__} has no backbone to inspect')
    divisor = pad_size_divisor(cfg)
    hw = padded_shape(args.shape, divisor)
    x = torch.zeros(1, 3, *hw)
    with torch.no_grad():
        feats = model.backbone(x)
        rows = pyramid_rows('backbone', feats, hw)
        if getattr(model, 'with_neck', False):
            rows += pyramid_rows('neck', model.neck(feats), hw)
    bb = model.backbone
    print(f'{args.config}: {type(model).__name__}, backbone {type(bb).__name__}'
          + (f', neck {type(model.neck).__name__}' if getattr(model, 'with_neck', False) else ''))
    print(f'input (1, 3, {args.shape[0]}, {args.shape[1]})'
          + (f' padded to {hw} (pad_size_divisor={divisor})' if hw != tuple(args.shape) else ''))
    for attr in ('out_channels', 'out_strides'):
        if hasattr(bb, attr):
            print(f'backbone.{attr} = {tuple(getattr(bb, attr))}')
    print(format_table(rows))
    return rows


if __name__ == '__main__':
    main()
