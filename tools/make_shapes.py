"""Generate the synthetic "shapes" COCO dataset: instance and panoptic segmentation.

    python tools/make_shapes.py [--out data/shapes/] [--seed 0] [--num-train 2000] [--num-val 200]
                                [--image-size 256] [--classes square circle ...]
                                [--objects MIN MAX] [--object-size MIN MAX] [--overwrite]

Writes, per split (train, val): the images ``<split>/000000.png ...``, the instance JSON
``annotations/instances_<split>.json`` (configs/_base_/datasets/shapes_instance.py) and the
COCO panoptic ground truth ``annotations/panoptic_<split>.json`` + ``annotations/
panoptic_<split>/000000.png ...`` (configs/_base_/datasets/shapes_panoptic.py): things = the
``--classes`` (category ids 1..T in the given order), stuff = ``lines`` (T+1) and
``background`` (T+2).

Deterministic: the same seed and options give byte-identical images and annotation files
(the generator lives in ``vitdet_plugin.datasets.shapes``). An existing dataset with the same
seed and options is kept; one written before the panoptic ground truth existed gets it added
(``upgraded``); a different one is only replaced with ``--overwrite``. ``--reuse`` keeps any
existing dataset under ``--out`` with the seed, spec and image counts it was made with (and adds
missing panoptic ground truth); ``make demo`` / ``make demo-seg`` use it, so ``DEMO_DATA`` can
point to a shapes set made with other options.
"""
import argparse
import importlib.util
import json
import os.path as osp
import sys
from dataclasses import replace
from typing import Any, Dict, Optional, Sequence, Tuple

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from vitdet_plugin.datasets.shapes import (CLASSES, SHAPE_MAKERS, ShapesSpec, dataset_info,
                                           generate_dataset)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    default = ShapesSpec()
    parser = argparse.ArgumentParser(description='Generate the shapes COCO dataset')
    parser.add_argument('--out', default='data/shapes/', help='output directory')
    parser.add_argument('--seed', type=int, default=0, help='dataset seed')
    parser.add_argument('--num-train', type=int, default=2000, help='training images')
    parser.add_argument('--num-val', type=int, default=200, help='validation images')
    parser.add_argument('--image-size', type=int, default=default.image_size,
                        help='image side, px')
    parser.add_argument('--classes', nargs='+', default=list(CLASSES),
                        choices=sorted(SHAPE_MAKERS), help='shape classes')
    parser.add_argument('--objects', type=int, nargs=2, default=list(default.objects),
                        metavar=('MIN', 'MAX'), help='objects per image')
    parser.add_argument('--object-size', type=int, nargs=2, default=list(default.object_size),
                        metavar=('MIN', 'MAX'), help='outer diameter of a shape, px')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing dataset')
    parser.add_argument('--reuse', action='store_true',
                        help='keep an existing dataset with the seed and options it was made '
                             'with (adding missing panoptic ground truth)')
    parser.add_argument('--quiet', action='store_true', help='no progress bar')
    return parser.parse_args(argv)


def _stored(root: str, args: argparse.Namespace, spec: ShapesSpec) -> Tuple[int, ShapesSpec]:
    """The seed and spec an existing dataset under ``root`` was made with (``args.num_*`` set to
    its image counts); the requested ones when there is none."""
    info = dataset_info(root, 'train')
    if info is None:
        return args.seed, spec
    stored: Dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                              for k, v in info['spec'].items()}
    for split in ('train', 'val'):
        with open(osp.join(root, 'annotations', f'instances_{split}.json')) as f:
            setattr(args, f'num_{split}', len(json.load(f)['images']))
    return int(info['seed']), ShapesSpec(**stored)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    try:
        spec = replace(ShapesSpec(), image_size=args.image_size, classes=tuple(args.classes),
                       objects=tuple(args.objects), object_size=tuple(args.object_size))
        if args.reuse:
            args.seed, spec = _stored(args.out, args, spec)
        status = generate_dataset(args.out, seed=args.seed, num_train=args.num_train,
                                  num_val=args.num_val, spec=spec, overwrite=args.overwrite,
                                  progress=not args.quiet)
    except (ValueError, FileExistsError) as e:
        sys.exit(f'error: {e}')
    out = args.out.rstrip('/')
    for split, state in status.items():
        print(f'{split}: {state} ({out}/annotations/instances_{split}.json, '
              f'{out}/annotations/panoptic_{split}.json)')


if __name__ == '__main__':
    main()
