#!/usr/bin/env python
"""Convert a Swin or ViT checkpoint of any supported format to vitdet_plugin's layout.

    python tools/convert_weights.py swin_tiny_patch4_window7_224.pth swin_t_ours.pth
    python tools/convert_weights.py mae_pretrain_vit_base.pth vit_b_ours.pth --model vit
    python tools/convert_weights.py ckpt.pth out.pth --window-size 12   # resize bias tables
    python tools/convert_weights.py swinv2_tiny_patch4_window8_256.pth swinv2_t_ours.pth
    python tools/convert_weights.py dinov2_vitb14_reg4_pretrain.pth dinov2_b_ours.pth
    python tools/convert_weights.py eva02_B_pt_in21k_p14.pt eva02_b16_ours.pth --patch-size 16
    python tools/convert_weights.py path/to/dinov2-base dinov2_b_ours.pth   # transformers folder
    python tools/convert_weights.py rf-detr-nano.pth rfdetr_n_coco80.pth
    python tools/convert_weights.py output/checkpoint_best_ema.pth rfdetr_n_mine.pth  # fine-tuned
    python tools/convert_weights.py path/to/dfine-small-coco dfine_s_ours.pth  # transformers
    python tools/convert_weights.py deimv2_hgnetv2_atto_coco.pth deimv2_atto_ours.pth  # official

The source layout is detected by the one table of ``vitdet_plugin.weights.layouts`` (official
Microsoft Swin, Swin detection repo, timm, mmdet / mmpretrain for Swin; official, timm,
mmpretrain for Swin V2; timm / DeiT / MAE, SAM, detectron2 ViTDet, mmpretrain for ViT; the
official facebookresearch / baaivision files and timm's for DINOv2, DINOv3, EVA-02 and
EVA-02/det's detectors, ``--model vit_family``; Hugging Face transformers ``Dinov2Model``,
``Dinov2WithRegistersModel``, ``DINOv3ViTModel``, ``SwinModel``, ``Swinv2Model``, ``ViTModel``,
``ViTMAEModel`` and their task wrappers; a bare simple-FPN neck; the ``rfdetr`` package's
``.pth`` files, whole detectors, RF-DETR-Seg with its mask head: ``--model rfdetr``;
transformers ``DFineForObjectDetection`` / ``Deimv2ForObjectDetection`` folders and the
official D-FINE / DEIMv2 ``.pth`` files over HGNetV2, whole detectors: backbone, encoder and
``DFineHead``; the DINOv3 ones load with ``load_from`` in their config). A
transformers model folder (``config.json`` + ``model.safetensors``, or its shards and index,
or ``pytorch_model.bin``) is read like a file. Files are read with
``torch.load(weights_only=True)``; the output is ``{'state_dict': sd, 'meta': {...}}``,
loadable with ``init_cfg=dict(type='Pretrained', checkpoint=OUT)``; an RF-DETR detector's with
``load_from=OUT`` in its ``configs/rfdetr/`` config, with the file's own classes (RF-DETR's 91
COCO logits as mmdet's 80 COCO classes; a file fine-tuned on K classes, K + 1 logits, as its K
in rfdetr's order, the no-object slot dropped): the tool prints the config, ``num_classes`` and
the class names. ``load_from`` and ``tools/test.py`` also read the rfdetr files themselves.
"""
import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vitdet_plugin.weights import (FAMILY_BACKBONES, CheckpointError, CheckpointTarget,
                                   checkpoint_state_dict, detect_layout, load_checkpoint_file)
from vitdet_plugin.weights.dfine_detector import dfine_detector_layout, dfine_to_detector
from vitdet_plugin.weights.dfine_official import LAYOUTS as OFFICIAL_LAYOUTS
from vitdet_plugin.weights.dfine_official import (official_detector_state, official_family,
                                                  official_to_detector)
from vitdet_plugin.weights.layout import Layout
from vitdet_plugin.weights.rfdetr import (RFDETR, has_mask_branch, matching_configs, read_size,
                                          rfdetr_to_detector)
from vitdet_plugin.weights.rfdetr_classes import (FileClasses, args_class_names, file_classes,
                                                  transformers_labels)
from vitdet_plugin.weights.transformers_folder import read_transformers_config

#: transformers' ``model_type`` of ``LwDetrForObjectDetection`` (LW-DETR, not loadable).
LW_DETR = 'lw_detr'
#: The classes of the configs of ``configs/rfdetr/`` (mmdet's COCO classes).
COCO_CLASSES = 80
#: ``--model``: the checkpoint families each choice converts (``auto``: every family).
MODEL_FAMILIES = {'swin': ('Swin',), 'swinv2': ('Swin V2',), 'vit': ('ViT',),
                  'vit_family': ('DINOv2', 'DINOv3', 'EVA-02'), 'simple_fpn': ('simple FPN',),
                  'rfdetr': (RFDETR,)}


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
    p.add_argument('--num-classes', type=int, default=None, metavar='K',
                   help="RF-DETR: the head's classes: the checkpoint's own (the default: a COCO "
                        "file's 91 logits as mmdet's 80 classes, a fine-tuned file's K + 1 "
                        "logits as its K classes) or its logits as saved")
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
        if (read_transformers_config(args.src) or {}).get('model_type') == LW_DETR:
            raise CheckpointError(
                f'{args.src} is a transformers LwDetrForObjectDetection folder: LW-DETR, whose '
                "backbone is LW-DETR's own ViT, which no backbone of ours builds (configs/rfdetr "
                "build RF-DETR's DINOv2); convert an RF-DETR folder (RfDetrForObjectDetection) "
                "or rfdetr's .pth")
        ckpt = load_checkpoint_file(args.src)
        official = official_detector_state(ckpt)
        if official is not None:  # an official D-FINE / DEIMv2 .pth: a whole detector
            if window or args.src_window_size or pos_grid or args.patch_size or \
                    args.num_classes is not None or args.prefix or args.model != 'auto':
                p.error('an official D-FINE / DEIMv2 checkpoint converts as saved: its config '
                        'builds its sizes and classes')
            converted, dropped = official_to_detector(official, None, 'tools/convert_weights.py')
            layout = next(lay for lay in OFFICIAL_LAYOUTS
                          if lay.family == official_family(official))
            return _save(args.src, args.dst, converted, dropped, layout, layout.family, None)
        sd = checkpoint_state_dict(ckpt, args.prefix)
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
        if family == RFDETR:
            if window or args.src_window_size or pos_grid or args.patch_size:
                p.error('an RF-DETR checkpoint converts as saved: its config builds its sizes')
            names = args_class_names(ckpt.get('args')) if isinstance(ckpt, dict) else None
            num_classes = args.num_classes
            classes: Optional[FileClasses] = None
            labels = transformers_labels(read_transformers_config(args.src))
            if labels is not None:  # num_labels logits, each a class: no no-object slot
                names = labels
                num_classes = num_classes or len(labels)
            else:
                classes = file_classes(int(sd['class_embed.bias'].shape[0]), names)
                if num_classes not in (None, classes.own, classes.logits):
                    raise CheckpointError(_classes_refusal(classes, num_classes))
            converted, dropped = rfdetr_to_detector(sd, None, 'tools/convert_weights.py',
                                                    num_classes, names=names)
            return _save(args.src, args.dst, converted, dropped, layout, family, model, classes,
                         names)
        if dfine_detector_layout(sd) is not None:  # a whole D-FINE / DEIMv2 detector
            if window or args.src_window_size or pos_grid or args.patch_size or \
                    args.num_classes is not None:
                p.error('a D-FINE / DEIMv2 detector converts as saved: its config builds its '
                        'sizes and classes')
            converted, dropped = dfine_to_detector(sd, None, 'tools/convert_weights.py')
            return _save(args.src, args.dst, converted, dropped, layout, family, model)
        if args.num_classes is not None:
            p.error('--num-classes applies to RF-DETR checkpoints only')
        target = CheckpointTarget(
            family, 'tools/convert_weights.py', window_size=window, pos_grid=pos_grid,
            src_window_size=tuple(args.src_window_size) if args.src_window_size else None,
            patch_size=(args.patch_size, args.patch_size) if args.patch_size else None)
        converted, dropped = layout.convert(sd, target)
    except (CheckpointError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    return _save(args.src, args.dst, converted, dropped, layout, family, model)


def _classes_refusal(classes: FileClasses, num_classes: int) -> str:
    """Why ``--num-classes`` does not fit the checkpoint's classifier, and the fix."""
    return (f"the checkpoint's classifier has {classes.describe()}; --num-classes "
            f'{num_classes} fits neither: give --num-classes {classes.own} (its own classes; '
            f'the default) or {classes.logits} (its logits as saved). To fine-tune a head of '
            "other classes from it, give the file itself as the detector's init_cfg=dict(type="
            "'Pretrained', checkpoint=...) (configs/rfdetr/rfdetr_nano_finetune_custom.py)")


def _save(src: str, dst: str, converted: Dict[str, torch.Tensor], dropped: List[str],
          layout: Layout, family: str, model: Optional[str],
          classes: Optional[FileClasses] = None,
          names: Optional[Tuple[str, ...]] = None) -> int:
    """Write ``{'state_dict': converted, 'meta': ...}`` to ``dst`` (atomically; ``classes``:
    an rfdetr file's classifier, ``names``: an RF-DETR's class names, as
    ``meta['dataset_meta']['classes']``) and say how to load it."""
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    tmp = dst + '.tmp'
    meta: Dict[str, Any] = {'converted_from': layout.name, 'family': family, 'model': model,
            'backbone': FAMILY_BACKBONES[family], 'source': src}
    if names:
        meta['dataset_meta'] = {'classes': names}
    torch.save({'state_dict': converted, 'meta': meta}, tmp)
    os.replace(tmp, dst)
    how = f"type='{FAMILY_BACKBONES[family]}'"
    if any(k.startswith('bbox_head.decoder.') for k in converted):
        how = (f"load_from='{dst}' in a D-FINE / DEIMv2 detector config (configs/dfine, "
               'configs/deimv2) of its sizes and classes')
    if family == RFDETR:
        exact, near = matching_configs(read_size({k: v.shape for k, v in converted.items()}),
                                       seg=has_mask_branch(converted))
        configs = ' or '.join(f'configs/rfdetr/{c.config}' for c in exact or near)
        how = (f"load_from='{dst}' in {configs or 'an RF-DETR detector config'}"
               f"{_head_fix(int(converted['bbox_head.cls_branch.bias'].shape[0]), classes, names)}")
    print(f'{src}: {layout.describe()} -> {dst} ({len(converted)} tensors, '
          f'{len(dropped)} keys dropped); load it with {how}')
    return 0


def _head_fix(num_classes: int, classes: Optional[FileClasses],
              names: Optional[Tuple[str, ...]]) -> str:
    """How the config's head takes ``num_classes`` of a file of ``classes`` (an rfdetr file's;
    None: a transformers folder's, of ``names``; the configs build mmdet's 80 COCO classes)."""
    if classes is not None and classes.coco and num_classes == COCO_CLASSES:
        return " (its head: mmdet's 80 COCO classes, as the configs build it)"
    if classes is not None and num_classes != classes.own:
        names = None
    listed = f": {', '.join(map(repr, names))}" if names else ''
    return (f' with --cfg-options model.bbox_head.num_classes={num_classes} (the '
            f"checkpoint's classes, in rfdetr's order{listed})")


if __name__ == '__main__':
    sys.exit(main())
