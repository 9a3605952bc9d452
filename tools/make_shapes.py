"""Generate the synthetic "shapes" COCO instance-segmentation dataset.

    python tools/make_shapes.py [--out data/shapes/] [--seed 0] [--num-train 2000] [--num-val 200]
                                [--image-size 256] [--classes square circle ...] [--overwrite]

Deterministic: the same seed and options give byte-identical images and annotation files
(the generator lives in ``vitdet_plugin.datasets.shapes``). An existing dataset with the same
seed and options is kept; a different one is only replaced with ``--overwrite``.
"""
import argparse
import importlib.util
import os.path as osp
import sys
from dataclasses import replace

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from vitdet_plugin.datasets.shapes import CLASSES, SHAPE_MAKERS, ShapesSpec, generate_dataset


def parse_args(argv=None) -> argparse.Namespace:
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
    parser.add_argument('--quiet', action='store_true', help='no progress bar')
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        spec = replace(ShapesSpec(), image_size=args.image_size, classes=tuple(args.classes),
                       objects=tuple(args.objects), object_size=tuple(args.object_size))
        status = generate_dataset(args.out, seed=args.seed, num_train=args.num_train,
                                  num_val=args.num_val, spec=spec, overwrite=args.overwrite,
                                  progress=not args.quiet)
    except (ValueError, FileExistsError) as e:
        sys.exit(f'error: {e}')
    for split, state in status.items():
        print(f'{split}: {state} ({args.out.rstrip("/")}/annotations/instances_{split}.json)')


if __name__ == '__main__':
    main()
