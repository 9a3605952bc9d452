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
from typing import List, Sequence, Tuple

import torch
from mmengine.config import Config, DictAction

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))

import vitdet_plugin  # noqa: F401  (registers our modules)
from vitdet_plugin.config import load_config


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


def pad_size_divisor(cfg: Config) -> int:
    """The ``pad_size_divisor`` of the config's data preprocessor (1 when it pads nothing)."""
    return int(cfg.model.get('data_preprocessor', {}).get('pad_size_divisor', 1) or 1)


def padded_shape(shape: Sequence[int], divisor: int) -> Tuple[int, int]:
    h, w = shape
    if divisor <= 1:
        return h, w
    return -(-h // divisor) * divisor, -(-w // divisor) * divisor


def nominal_stride(input_hw: Sequence[int], map_hw: Sequence[int]) -> str:
    """The stride a level is built for: the integer ``s`` for which ``floor`` or ``ceil`` of
    ``input / s`` gives the map's size on both sides (a power of two when one fits, e.g. the
    extra levels of an 800x1216 input: 13x19 maps, stride 64, not ``61.5x64``); the measured
    ratio when none fits."""
    (h, w), (mh, mw) = input_hw, map_hw

    def fits(size: int, side: int, s: int) -> bool:
        return side in (size // s, -(-size // s))

    fitting = [s for s in range(1, max(h, w) + 1) if fits(h, mh, s) and fits(w, mw, s)]
    powers = [s for s in fitting if s & (s - 1) == 0]
    if powers or fitting:
        return str(powers[0] if powers else min(fitting, key=lambda s: abs(s - h / mh)))
    return f'{h / mh:g}x{w / mw:g}'


def pyramid_rows(prefix: str, feats, input_hw: Tuple[int, int]) -> List[Tuple[str, int, str, str]]:
    """``(name, channels, nominal stride, shape)`` rows of a tuple/list/dict of NCHW maps."""
    if isinstance(feats, torch.Tensor):
        feats = [feats]
    items = feats.items() if isinstance(feats, dict) else enumerate(feats)
    return [(f'{prefix}[{key}]', int(f.shape[1]),
             nominal_stride(input_hw, (int(f.shape[-2]), int(f.shape[-1]))), str(tuple(f.shape)))
            for key, f in items]


def format_table(rows: Sequence[Tuple[str, int, str, str]]) -> str:
    header = ('name', 'channels', 'stride', 'shape (B, C, H, W)')
    cells = [header] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, '  '.join('-' * w for w in widths))
    return '\n'.join(lines)


def main(argv=None) -> List[Tuple[str, int, str, str]]:
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
