#!/usr/bin/env python
"""Convert a Swin or ViT checkpoint of any supported format to vitdet_plugin's layout.

    python tools/convert_weights.py swin_tiny_patch4_window7_224.pth swin_t_ours.pth
    python tools/convert_weights.py mae_pretrain_vit_base.pth vit_b_ours.pth --model vit
    python tools/convert_weights.py ckpt.pth out.pth --window-size 12   # resize bias tables
    python tools/convert_weights.py swinv2_tiny_patch4_window8_256.pth swinv2_t_ours.pth
    python tools/convert_weights.py dinov2_vitb14_reg4_pretrain.pth dinov2_b_ours.pth
    python tools/convert_weights.py eva02_B_pt_in21k_p14.pt eva02_b16_ours.pth --patch-size 16

The source format is detected (official Microsoft Swin, Swin detection repo, timm, mmdet /
mmpretrain for Swin; official, timm, mmpretrain for Swin V2; timm / DeiT / MAE, SAM, detectron2
ViTDet for ViT; the official facebookresearch / baaivision files and timm's for DINOv2, DINOv3,
EVA-02 and EVA-02/det's detectors, ``--model vit_family``). Files are read with
``torch.load(weights_only=True)``; the output is ``{'state_dict': sd, 'meta': {...}}``, loadable
with ``init_cfg=dict(type='Pretrained', checkpoint=OUT)``.
"""
import argparse
import os
import sys
from typing import List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vitdet_plugin.weights import (CheckpointError, checkpoint_state_dict,
                                   load_checkpoint_file)
from vitdet_plugin.weights.swin import convert_swin, detect_swin_format
from vitdet_plugin.weights.swin_v2 import convert_swin_v2, detect_swin_v2_format
from vitdet_plugin.weights.vit import convert_vit, detect_vit_format
from vitdet_plugin.weights.vit_families import (FAMILY_BACKBONES, convert_vit_family_checkpoint,
                                                vit_family_layout)


def detect_vit_family_format(sd) -> str:
    """The layout of a DINOv2 / DINOv3 / EVA-02 state dict (official, timm or ours)."""
    return vit_family_layout(sd)[1]


# the family detector first: the plain-ViT one refuses their checkpoints, naming them
DETECTORS = {'swin': detect_swin_format, 'swinv2': detect_swin_v2_format,
             'vit_family': detect_vit_family_format, 'vit': detect_vit_format}


def _detect(sd) -> Tuple[str, str]:
    """``(model, format)`` by the detector that recognises ``sd``; both reasons if neither."""
    errors = []
    for model, detect in DETECTORS.items():
        try:
            return model, detect(sd)
        except CheckpointError as e:
            errors.append(f'as {model}: {e}')
    raise CheckpointError('neither a Swin nor a ViT checkpoint (' + '; '.join(errors) + '). If '
                          'the weights sit under a prefix (e.g. encoder.), pass --prefix')


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('src', help='input checkpoint')
    p.add_argument('dst', help='output checkpoint (.pth)')
    p.add_argument('--model', choices=['auto', *DETECTORS], default='auto')
    p.add_argument('--prefix', default=None,
                   help="keep only the keys under this prefix, removed (e.g. 'encoder.')")
    p.add_argument('--window-size', type=int, nargs='+', default=None, metavar='N',
                   help='Swin V1: target window size (h [w]); bias tables are resized (Swin '
                        'V2 has none: give the model pretrained_window_sizes instead)')
    p.add_argument('--src-window-size', type=int, nargs=2, default=None, metavar=('H', 'W'),
                   help='Swin: the window (h w) the checkpoint was trained with, needed only '
                        'for rectangular windows of checkpoints without relative_position_index')
    p.add_argument('--pos-grid', type=int, nargs=2, default=None, metavar=('H', 'W'),
                   help='target absolute position grid (h w)')
    p.add_argument('--patch-size', type=int, default=None, metavar='P',
                   help='DINOv2 / DINOv3 / EVA-02: resample the patch kernel to P x P '
                        '(FlexiViT; e.g. 14 -> 16 for a stride-16 pyramid)')
    args = p.parse_args(argv)
    window = None
    if args.window_size:
        if len(args.window_size) > 2:
            p.error(f'--window-size takes 1 or 2 values (h [w]), got {args.window_size}')
        window = tuple(args.window_size * (3 - len(args.window_size)))
    pos_grid = tuple(args.pos_grid) if args.pos_grid else None
    if args.patch_size is not None and args.model not in ('auto', 'vit_family'):
        p.error('--patch-size applies to DINOv2 / DINOv3 / EVA-02 checkpoints only')

    try:
        sd = checkpoint_state_dict(load_checkpoint_file(args.src), args.prefix)
        model, fmt = (_detect(sd) if args.model == 'auto'
                      else (args.model, DETECTORS[args.model](sd)))
        if args.patch_size is not None and model != 'vit_family':
            p.error('--patch-size applies to DINOv2 / DINOv3 / EVA-02 checkpoints only')
        if model == 'swin':
            converted, dropped = convert_swin(
                sd, window_size=window, pos_grid=pos_grid, src_format=fmt,
                src_window_size=tuple(args.src_window_size) if args.src_window_size else None)
        elif window or args.src_window_size:
            p.error('--window-size / --src-window-size apply to Swin V1 checkpoints only')
        elif model == 'swinv2':
            if pos_grid:
                p.error('--pos-grid does not apply to Swin V2 checkpoints')
            converted, dropped = convert_swin_v2(sd, src_format=fmt)
        elif model == 'vit_family':
            family, fmt, converted, dropped = convert_vit_family_checkpoint(
                sd, pos_grid=pos_grid, patch_size=args.patch_size)
            model = FAMILY_BACKBONES[family]
        else:
            converted, dropped = convert_vit(sd, pos_grid=pos_grid, src_format=fmt)
    except (CheckpointError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    os.makedirs(os.path.dirname(os.path.abspath(args.dst)), exist_ok=True)
    tmp = args.dst + '.tmp'
    torch.save({'state_dict': converted,
                'meta': {'converted_from': fmt, 'model': model, 'source': args.src}}, tmp)
    os.replace(tmp, args.dst)
    print(f'{args.src}: {model} checkpoint in {fmt!r} format -> {args.dst} '
          f'({len(converted)} tensors, {len(dropped)} non-backbone keys dropped)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
