"""Look inside a config's model: pictures of windows, shift masks, features, attention and
the DETR decoder.

    python tools/analysis/visualize.py windows    CONFIG (--shape H W | --image IMG) [--stage I]
    python tools/analysis/visualize.py shift-mask CONFIG (--shape H W | --image IMG) --stage I
                                                  [--window K ...]
    python tools/analysis/visualize.py features   CONFIG [CKPT] --image IMG [--neck]
    python tools/analysis/visualize.py attention  CONFIG [CKPT] --image IMG --block B
                                                  --query Y X [--head H]
    python tools/analysis/visualize.py decoder    CONFIG [CKPT] --image IMG [--top K]
                                                  [--query R] [--layer L] [--head H]
    common: [--out FILE.png] [--cfg-options k=v ...]

Each command builds the config's detector (random init, or the checkpoint's weights loaded
strictly), runs one real forward and writes one PNG (default
``work_dirs/visualize/<config>_<command>.png``); what each picture shows and how it is read
from the model: docs/look_inside.md. The library: :mod:`vitdet_plugin.visualization`.
"""
import argparse
import importlib.util
import os.path as osp
import sys
from typing import List, Optional

from mmengine.config import DictAction

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))

from vitdet_plugin.visualization import VisualizeError
from vitdet_plugin.visualization.decoder import DEFAULT_TOP, decoder_picture
from vitdet_plugin.visualization.figures import Picture
from vitdet_plugin.visualization.model import build_detector, make_input
from vitdet_plugin.visualization.pictures import (attention_picture, features_picture,
                                                  shift_mask_picture, windows_picture)
from vitdet_plugin.weights import CheckpointError

#: Where pictures go unless ``--out`` says otherwise.
DEFAULT_OUT_DIR = osp.join('work_dirs', 'visualize')


def _common(parser: argparse.ArgumentParser, checkpoint: bool) -> None:
    parser.add_argument('config', help='config file path')
    if checkpoint:
        parser.add_argument('checkpoint', nargs='?',
                            help='checkpoint to load (default: random init)')
    parser.add_argument('--out', help=f'PNG to write (default: {DEFAULT_OUT_DIR}/'
                        '<config>_<command>[_<detail>].png)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config settings, key=value')


def _input_args(parser: argparse.ArgumentParser, image_only: bool) -> None:
    if image_only:
        parser.add_argument('--image', required=True, help='input image')
        return
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument('--image', help='input image (through the test pipeline)')
    group.add_argument('--shape', type=int, nargs=2, metavar=('H', 'W'),
                       help='input size of a zero image')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description='Pictures of what a model does (windows, shift masks, features, '
                    'attention, the DETR decoder)')
    sub = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')

    p = sub.add_parser('windows', help='token grid, windows and shifted windows of a stage')
    _common(p, checkpoint=False)
    _input_args(p, image_only=False)
    p.add_argument('--stage', type=int, default=0, help='Swin stage (default: 0)')

    p = sub.add_parser('shift-mask', help='shift regions and attention masks of a stage')
    _common(p, checkpoint=False)
    _input_args(p, image_only=False)
    p.add_argument('--stage', type=int, required=True, help='Swin stage')
    p.add_argument('--window', type=int, nargs='+', metavar='K',
                   help='windows to show (row-major numbers; default: the four corners)')

    p = sub.add_parser('features', help='every pyramid level: channel norm and PCA')
    _common(p, checkpoint=True)
    _input_args(p, image_only=True)
    p.add_argument('--neck', action='store_true', help="also the neck's outputs")

    p = sub.add_parser('attention', help="one query token's attention in a block")
    _common(p, checkpoint=True)
    _input_args(p, image_only=True)
    p.add_argument('--block', type=int, required=True,
                   help='block index in forward order (Swin: stage by stage)')
    p.add_argument('--query', type=int, nargs=2, required=True, metavar=('Y', 'X'),
                   help="query token: row and column on the block's token map")
    p.add_argument('--head', type=int, help='one head (default: the mean over heads)')

    p = sub.add_parser('decoder', help="an SdpaDETRHead's box refinement and one query's "
                                       'cross-attention')
    _common(p, checkpoint=True)
    _input_args(p, image_only=True)
    p.add_argument('--top', type=int, default=DEFAULT_TOP,
                   help=f'queries drawn, ranked by last-layer class score (default: '
                        f'{DEFAULT_TOP})')
    p.add_argument('--query', type=int, default=0, metavar='R',
                   help='rank (among --top) of the query whose attention is drawn (default: 0)')
    p.add_argument('--layer', type=int, metavar='L',
                   help='decoder layer of the attention (default: the last; negative: from '
                        'the end)')
    p.add_argument('--head', type=int, help='one head (default: the mean over heads)')
    return parser


def default_out(args: argparse.Namespace) -> str:
    """``work_dirs/visualize/<config>_<command>[_<detail>].png``."""
    detail = {'windows': lambda: f'_stage{args.stage}',
              'shift-mask': lambda: f'_stage{args.stage}',
              'attention': lambda: f'_block{args.block}'}.get(args.command, lambda: '')()
    stem = osp.splitext(osp.basename(args.config))[0]
    return osp.join(DEFAULT_OUT_DIR, f'{stem}_{args.command}{detail}.png')


def run(args: argparse.Namespace) -> Picture:
    """Build the model and input of ``args`` and write its picture."""
    detector = build_detector(args.config, getattr(args, 'checkpoint', None), args.cfg_options)
    inp = make_input(detector, args.image, getattr(args, 'shape', None))
    out = args.out or default_out(args)
    if args.command == 'windows':
        return windows_picture(detector, inp, args.stage, out)
    if args.command == 'shift-mask':
        return shift_mask_picture(detector, inp, args.stage, args.window, out)
    if args.command == 'features':
        return features_picture(detector, inp, args.neck, out)
    if args.command == 'decoder':
        return decoder_picture(detector, inp, args.top, args.query, args.layer, args.head, out)
    return attention_picture(detector, inp, args.block, args.query, args.head, out)


def main(argv: Optional[List[str]] = None) -> Picture:
    args = build_parser().parse_args(argv)
    if args.out is not None and not args.out.lower().endswith('.png'):
        raise SystemExit(f'error: --out {args.out}: the picture is a PNG; name it *.png')
    try:
        picture = run(args)
    except (VisualizeError, CheckpointError, FileNotFoundError) as e:
        raise SystemExit(f'error: {e}') from e
    print(f'{args.command}: wrote {picture.path} ({picture.size_px[0]} x {picture.size_px[1]} '
          'px)')
    return picture


if __name__ == '__main__':
    main()
