"""Export a detector's network to ONNX with dynamic batch, height and width, and check it.

    python tools/export_onnx.py CONFIG [CHECKPOINT] --out model.onnx
        [--part auto|backbone|neck|head|detector] [--check-sizes 200x312 480x640 801x1217]
        [--batch 1] [--tolerance 1e-4] [--repeats 5] [--no-check] [--cfg-options k=v ...]

Exports the network from the normalised image to the backbone's maps (``--part backbone``),
the neck's (``neck``; the default when the config has a neck) or a single-stage detector's raw
head outputs before box decoding and NMS (``head``: RetinaNet's per-level class logits and box
deltas). Then runs onnxruntime at each check size, compares every output with PyTorch (max
abs difference / max abs PyTorch value, at most ``--tolerance``) and prints onnxruntime vs
PyTorch CPU latency (median of ``--repeats`` interleaved runs at the largest check size).
Without a checkpoint the model keeps its initialisation (enough to check the graph).
Not exported by these parts: the data preprocessor, anchors / box decoding, NMS, RoI heads.

``--part detector``: the whole detector, uint8 image -> padded detections (data preprocessor,
network, decoding, test_cfg's score threshold / top-k / NMS inside; see docs/deploy.md for the
I/O contract), the test pipeline's load / resize parameters stored in the file for
``vitdet_plugin.deploy.runner``; checked against mmdet's own predict at each check size
(boxes within 1e-3 of the image side, scores within 1e-4, labels equal, mask IoU >= 0.99),
at the config's ``score_thr`` and, when it is positive, at 0: the raw top-k below it, so that a
model with no detection above it (under-trained) is still checked; a size with no detection to
compare fails.
SdpaDETR, sigmoid anchor heads (RetinaNet), Faster / Mask R-CNN (RPN + StandardRoIHead; Mask
R-CNN adds the outputs masks and mask_probs), mmdet's DINO, RF-DETR (LWDETRHead: top-k, no
NMS; any input size; RF-DETR-Seg adds masks and mask_logits) and D-FINE / DEIMv2 (DFineHead);
other detectors are refused with the reason.
Exit status 1 when a check fails, 2 when the part cannot be exported.
"""
import argparse
import importlib.util
import os
import os.path as osp
import sys
import time
from typing import List, Optional, Sequence, Tuple

from mmengine.config import DictAction

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch

import vitdet_plugin  # noqa: F401  (registers our modules)
from vitdet_plugin.deploy.onnx_export import PARTS, build_detector_part, build_model, export_onnx
from vitdet_plugin.deploy.ort_check import (CHECK_SIZES, DEFAULT_TOLERANCE, check_sizes, latency,
                                            ort_session)

#: ``--part`` of the whole detector (image -> detections).
DETECTOR = 'detector'

#: Milliseconds per second (latency printout).
MS = 1e3


def _size(text: str) -> Tuple[int, int]:
    h, _, w = text.lower().partition('x')
    try:
        size = (int(h), int(w or h))
    except ValueError:
        raise argparse.ArgumentTypeError(f'size {text!r} is not N or HxW (e.g. 480x640)') from None
    if min(size) < 1:
        raise argparse.ArgumentTypeError(f'size {text!r} must be positive')
    return size


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog='tools/export_onnx.py', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('config')
    p.add_argument('checkpoint', nargs='?', default=None,
                   help='weights (default: the config\'s own initialisation)')
    p.add_argument('--out', required=True, help='the .onnx file to write')
    p.add_argument('--part', choices=('auto',) + PARTS + (DETECTOR,), default='auto',
                   help='auto: backbone + neck when the config has a neck, else the backbone; '
                        'detector: image -> detections (end to end)')
    p.add_argument('--check-sizes', nargs='+', type=_size, default=list(CHECK_SIZES),
                   metavar='HxW', help='onnxruntime vs PyTorch at these input sizes')
    p.add_argument('--batch', type=int, default=1, help='images per check batch')
    p.add_argument('--tolerance', type=float, default=DEFAULT_TOLERANCE,
                   help='largest max|onnx - torch| / max|torch| per output')
    p.add_argument('--repeats', type=int, default=5,
                   help='timed runs per runtime for the latency line (0: no timing)')
    p.add_argument('--no-check', action='store_true', help='export only')
    p.add_argument('--cfg-options', nargs='+', action=DictAction, default=None,
                   help='override config settings, key=value')
    args = p.parse_args(argv)
    if args.batch < 1 or args.repeats < 0:
        p.error('--batch must be >= 1 and --repeats >= 0')
    return args


def export_detector(args: argparse.Namespace) -> int:
    """``--part detector``: export, then onnxruntime vs mmdet's predict per check size."""
    from vitdet_plugin.deploy.end_to_end import (EndToEndDetector, add_metadata,
                                                 export_end_to_end, graph_resize, pipeline_meta)
    from vitdet_plugin.deploy.end_to_end_check import report
    try:
        cfg, model = build_model(args.config, args.checkpoint, args.cfg_options)
        module = EndToEndDetector(model, graph_resize(cfg))
        meta = pipeline_meta(cfg, module)
    except ValueError as e:  # a detector / pipeline the graph cannot hold: one line
        print(f'error: {e}', file=sys.stderr)
        return 2
    os.makedirs(osp.dirname(osp.abspath(args.out)), exist_ok=True)
    start = time.perf_counter()
    export_end_to_end(module, args.out)
    add_metadata(args.out, meta)
    inside = f' (resized to {module.resize_to[0]}x{module.resize_to[1]} inside the graph)' \
        if module.resize_to else ''
    print(f'exported the {module.kind} detector of {args.config} to {args.out} '
          f'({osp.getsize(args.out) / 2**20:.1f} MiB, {time.perf_counter() - start:.0f} s); '
          f'input image (B, 3, H, W) uint8 dynamic{inside}; outputs '
          f'{", ".join(module.output_names)} (max_per_img {module.max_per_img})', flush=True)
    if args.no_check:
        return 0
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
              for h, w in args.check_sizes]
    failed = []
    for size, line, ok in report(args.out, model, images, module.score_thr):
        print(line, flush=True)
        if not ok and size not in failed:
            failed.append(size)
    if failed:
        print(f'error: onnxruntime differs from mmdet\'s predict at {", ".join(failed)}',
              file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.part == DETECTOR:
        return export_detector(args)
    try:
        module = build_detector_part(args.config, args.checkpoint, args.part, args.cfg_options)
    except ValueError as e:  # a part the model does not have (a two-stage head, no neck): one line
        print(f'error: {e}', file=sys.stderr)
        return 2
    os.makedirs(osp.dirname(osp.abspath(args.out)), exist_ok=True)
    names = export_onnx(module, args.out)
    print(f'exported {module.part} of {args.config} to {args.out} '
          f'({osp.getsize(args.out) / 2**20:.1f} MiB); input image (B, {module.in_channels}, '
          f'H, W) dynamic; outputs {", ".join(names)}', flush=True)
    if args.no_check:
        return 0
    session = ort_session(args.out)
    failed: List[str] = []
    sizes = [module.fit_size(s) for s in args.check_sizes]
    for (h, w), fit in zip(args.check_sizes, sizes):
        if fit != (h, w):
            print(f'  check size {h}x{w} -> {fit[0]}x{fit[1]}: the smallest size the backbone '
                  f'takes (the detector pads its images to such sizes)', flush=True)
    for check in check_sizes(session, module, module.in_channels, sizes, args.batch):
        ok = check.max_error <= args.tolerance
        h, w = check.size
        print(f'  {h}x{w} batch {check.batch}: max rel. error {check.max_error:.2e} '
              f'(tolerance {args.tolerance:.0e}) {"ok" if ok else "FAILED"}; '
              f'shapes {" ".join("x".join(map(str, s)) for s in check.shapes)}', flush=True)
        if not ok:
            failed.append(f'{h}x{w}')
    if args.repeats:
        size = max(sizes, key=lambda s: s[0] * s[1])
        lat = latency(session, module, module.in_channels, size, args.batch, args.repeats)
        print(f'  latency {size[0]}x{size[1]} batch {lat.batch} (CPU, {torch.get_num_threads()} '
              f'threads, median of {args.repeats}): onnxruntime {lat.onnxruntime * MS:.1f} ms, '
              f'PyTorch {lat.torch * MS:.1f} ms, ratio onnxruntime/PyTorch {lat.ratio:.2f}x',
              flush=True)
    if failed:
        print(f'error: onnxruntime differs from PyTorch beyond {args.tolerance:.0e} at '
              f'{", ".join(failed)}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
