#!/usr/bin/env python
"""Convert a Swin or ViT checkpoint of any supported format to vitdet_plugin's layout.

    python tools/convert_weights.py swin_tiny_patch4_window7_224.pth swin_t_ours.pth
    python tools/convert_weights.py mae_pretrain_vit_base.pth vit_b_ours.pth --model vit
    python tools/convert_weights.py ckpt.pth out.pth --window-size 12   # resize bias tables
    python tools/convert_weights.py swinv2_tiny_patch4_window8_256.pth swinv2_t_ours.pth
    python tools/convert_weights.py dinov2_vitb14_reg4_pretrain.pth dinov2_b_ours.pth
    python tools/convert_weights.py eva02_B_pt_in21k_p14.pt eva02_b16_ours.pth --patch-size 16
    python tools/convert_weights.py path/to/dinov2-base dinov2_b_ours.pth   # transformers folder

The source layout is detected by the one table of ``vitdet_plugin.weights.layouts`` (official
Microsoft Swin, Swin detection repo, timm, mmdet / mmpretrain for Swin; official, timm,
mmpretrain for Swin V2; timm / DeiT / MAE, SAM, detectron2 ViTDet, mmpretrain for ViT; the
official facebookresearch / baaivision files and timm's for DINOv2, DINOv3, EVA-02 and
EVA-02/det's detectors, ``--model vit_family``; Hugging Face transformers ``Dinov2Model``,
``Dinov2WithRegistersModel``, ``DINOv3ViTModel``, ``SwinModel``, ``Swinv2Model``, ``ViTModel``,
``ViTMAEModel`` and their task wrappers; a bare simple-FPN neck). A transformers model folder
(``config.json`` + ``model.safetensors``, or its shards and index, or ``pytorch_model.bin``) is
read like a file. Files are read with ``torch.load(weights_only=True)``; the output is
``{'state_dict': sd, 'meta': {...}}``, loadable with ``init_cfg=dict(type='Pretrained',
checkpoint=OUT)``.
"""
import argparse
import os
import sys
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vitdet_plugin.weights import (FAMILY_BACKBONES, CheckpointError, CheckpointTarget,
                                   checkpoint_state_dict, detect_layout, load_checkpoint_file)

#: ``--model``: the checkpoint families each choice converts (``auto``: every family).
MODEL_FAMILIES = {'swin': ('Swin',), 'swinv2': ('Swin V2',), 'vit': ('ViT',),
                  'vit_family': ('DINOv2', 'DINOv3', 'EVA-02'), 'simple_fpn': ('simple FPN',)}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('src', help='input checkpoint: a file, a URL or a transformers model folder')
    p.add_argument('dst', help='output checkpoint (.pth)')
    p.add_argument('--model', choices=['auto', *MODEL_FAMILIES], default='auto')
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
        layout = detect_layout(sd)
        family = layout.family
        model = next((m for m, families in MODEL_FAMILIES.items() if family in families), None)
        if args.model != 'auto' and model != args.model:
            raise CheckpointError(f'the checkpoint is {layout.describe()}, not --model '
                                  f'{args.model}: give --model {model or "auto"} (it loads into '
                                  f"type='{FAMILY_BACKBONES[family]}')")
        if args.patch_size is not None and model != 'vit_family':
            p.error('--patch-size applies to DINOv2 / DINOv3 / EVA-02 checkpoints only')
        if (window or args.src_window_size) and family != 'Swin':
            p.error('--window-size / --src-window-size apply to Swin V1 checkpoints only')
        if pos_grid and family in ('Swin V2', 'simple FPN'):
            p.error(f'--pos-grid does not apply to {family} checkpoints')
        target = CheckpointTarget(
            family, 'tools/convert_weights.py', window_size=window, pos_grid=pos_grid,
            src_window_size=tuple(args.src_window_size) if args.src_window_size else None,
            patch_size=(args.patch_size, args.patch_size) if args.patch_size else None)
        converted, dropped = layout.convert(sd, target)
    except (CheckpointError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    os.makedirs(os.path.dirname(os.path.abspath(args.dst)), exist_ok=True)
    tmp = args.dst + '.tmp'
    torch.save({'state_dict': converted,
                'meta': {'converted_from': layout.name, 'family': family, 'model': model,
                         'backbone': FAMILY_BACKBONES[family], 'source': args.src}}, tmp)
    os.replace(tmp, args.dst)
    print(f'{args.src}: {layout.describe()} -> {args.dst} ({len(converted)} tensors, '
          f"{len(dropped)} keys dropped); load it with type='{FAMILY_BACKBONES[family]}'")
    return 0


if __name__ == '__main__':
    sys.exit(main())
