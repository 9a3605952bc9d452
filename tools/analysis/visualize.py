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
strictly), runs one real backbone forward (``decoder``: backbone, neck and head) and writes
one PNG (default ``work_dirs/visualize/<config>_<command>.png``). An image goes through the
config's test pipeline and data preprocessor, as at test time; ``--shape`` feeds a zero image
of that size, padded like the preprocessor pads it.

* ``windows``: the input with the token grid of a Swin stage, its windows (W-MSA) and the
  shifted windows (SW-MSA, wrapping around the map as the cyclic shift makes them), numbered;
  hatched: the preprocessor's padding and the window padding of the token map.
* ``shift-mask``: the region labels (0-8) of the stage's padded map after the cyclic shift and
  the ``(N, N)`` attention mask of chosen windows (default: the four corners), with a colour
  bar. The mask is the tensor the model passed to its attention module, captured with a
  forward pre-hook, not recomputed here; the drawn labels are checked against it.
* ``features``: every backbone output (``out_strides`` as declared), ``--neck`` adds the
  neck's: channel-norm heat map and the top three principal components as RGB.
* ``attention``: the attention probabilities of one query token (``--query`` row and column
  on the block's token map) over its window (Swin, ViT window blocks) or the whole map (ViT
  global blocks), mean over heads or ``--head``, over the input. The probabilities are
  recomputed from the attention module's captured input with its own parameters (``qkv``,
  ``scale``, relative-position bias, the captured shift mask); the tests check that they give
  the module's output. Blocks are numbered in forward order (Swin: stage by stage).
* ``decoder`` (configs with an ``SdpaDETRHead``): top row, the reference boxes of the top
  ``--top`` queries (default 5; ranked by their best class score of the last decoder layer,
  what prediction keeps) at every stage: the initial boxes the decoder receives (the encoder
  proposals with ``two_stage``, else the learned reference boxes), then the boxes after each
  decoder layer, one colour per query, labelled with its final class and score. Bottom row:
  the cross-attention of query ``--query`` (a rank among the top, default 0) in decoder layer
  ``--layer`` (default: the last; negative from the end), mean over heads or ``--head``, one
  heat map per memory level at its stride, with the query's reference box at that layer's
  input. The probabilities ``softmax(q k^T / sqrt(d) + bias)`` are recomputed from the
  module's captured inputs with its own projections, the bias being the captured padding mask
  plus box prior; the tests check that they give the module's output.

The backbone is built with ``accel='off'`` (the plain path; see ``vis_kit/model.py``).
"""
import argparse
import importlib.util
import os.path as osp
import sys
from typing import List, Optional

from mmengine.config import DictAction

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))

from vitdet_plugin.weights import CheckpointError

from vis_kit import VisualizeError
from vis_kit.decoder import DEFAULT_TOP, decoder_picture
from vis_kit.figures import Picture
from vis_kit.model import build_detector, make_input
from vis_kit.pictures import (attention_picture, features_picture,
                              shift_mask_picture, windows_picture)

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
