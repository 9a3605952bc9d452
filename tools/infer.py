"""Detect objects in images: COCO-style JSON and drawn pictures, with PyTorch or onnxruntime.

    python tools/infer.py IMAGES_OR_FOLDERS... --out-dir DIR --backend onnxruntime --onnx M.onnx
    python tools/infer.py IMAGES_OR_FOLDERS... --out-dir DIR --backend pytorch --config C
        [--checkpoint W] [--data DATA_DIR] [--draw-thr 0.3] [--no-draw] [--ann-file val.json]
        [--panoptic-ann-file panoptic_val.json [--panoptic-seg-dir panoptic_val/]]

Writes ``DIR/predictions.json`` (``images``: id, file_name, width, height; ``annotations``:
image_id, bbox ``[x, y, w, h]`` in original pixels, score, category_id, and for a detector with
masks ``segmentation``, COCO RLE of the original image's size; ``categories``: id, name) and,
unless ``--no-draw``, ``DIR/<image name>`` with the detections scoring at least ``--draw-thr``
drawn. ``--ann-file``: a COCO annotation file of the images (by file name) to print the COCO
bbox (and segm) mAP of the predictions (pycocotools). ``--data DATA_DIR``: the data folder the
model was trained on with ``tools/train.py --data`` (its classes; with ``--backend pytorch`` the
config is pointed at it as there).

The ids are the dataset's, so ``annotations`` is a COCO results list that pycocotools'
``COCO(ann_file).loadRes`` takes: category_id is the category id of the class's name and
image_id the image's id (by file name) in ``--ann-file``, else in the annotation file of
``--data``'s test split (its validation split without one); an image that file lacks gets an
id above its largest. Without either, category_id is the label index (0 .. K-1) and image_id
the image's position in the input, and the tool says so.

A panoptic detector (Panoptic FPN) also writes its panoptic maps in the COCO panoptic format:
``DIR/panoptic/<image stem>.png`` (segment id ``R + 256 G + 256^2 B``, 0 = void) and
``DIR/panoptic.json`` (``annotations``: image_id, file_name, ``segments_info`` with id,
category_id = the label index, area; ``categories``). ``--panoptic-ann-file``: COCO panoptic
ground truth of the images (its PNGs in ``--panoptic-seg-dir``, default: the JSON's path without
``.json``) to print PQ, SQ and RQ (all, things, stuff; panopticapi's ``pq_compute``, which
mmdet's CocoPanopticMetric repeats) and the mIoU of the maps' classes (as mmdet's SemSegMetric
on ``AllOutputsPanopticFPN``'s semantic map).

``--backend onnxruntime`` runs a graph from ``tools/export_onnx.py CONFIG [CKPT] --part
detector`` with numpy + onnxruntime + OpenCV only (``vitdet_plugin.deploy.runner``; torch and
mmdet are not imported). ``--backend pytorch`` runs mmdet's ``DetInferencer`` on the config
(weights from ``--checkpoint``, else the config's initialisation).
"""
import argparse
import copy
import importlib.util
import json
import os
import os.path as osp
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import numpy as np

from vitdet_plugin.deploy.coco_eval import (PANOPTIC_JSON, coco_json, coco_map, coco_pq,
                                            file_stem, gt_image_ids, panoptic_json,
                                            semantic_miou)
from vitdet_plugin.deploy.runner import Detections, OnnxDetector, load_image

#: File name endings read from a folder.
IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp', '.tif', '.tiff', '.webp')
#: Drawing: box colour (BGR), line width, text scale, weight of the colour over a mask.
BOX_COLOUR = (0, 200, 255)
LINE_WIDTH = 2
TEXT_SCALE = 0.4
MASK_ALPHA = 0.5
#: Names shown in the line about images an annotation file does not hold.
MISSING_SHOWN = 3


def image_files(inputs: Sequence[str]) -> List[str]:
    """Files as given and the images inside given folders (sorted), in order."""
    files = []
    for item in inputs:
        if osp.isdir(item):
            found = sorted(osp.join(item, f) for f in os.listdir(item)
                           if f.lower().endswith(IMAGE_SUFFIXES))
            if not found:
                raise SystemExit(f'error: folder {item} holds no image '
                                 f'({", ".join(IMAGE_SUFFIXES)})')
            files.extend(found)
        elif osp.isfile(item):
            files.append(item)
        else:
            raise SystemExit(f'error: {item} is neither an image file nor a folder')
    return files


def run_onnxruntime(files: Sequence[str], model: str) -> Tuple[List[Detections], List[str]]:
    detector = OnnxDetector(model)
    return [detector.predict_file(f) for f in files], detector.classes


def run_pytorch(files: Sequence[str], config: str, checkpoint: Optional[str],
                data: Optional[str] = None) -> Tuple[List[Detections], List[str]]:
    import vitdet_plugin  # noqa: F401  (registers our modules)
    from mmdet.apis import DetInferencer

    from vitdet_plugin.config import load_config
    from vitdet_plugin.datasets.data_folder import apply_data_folder

    cfg = load_config(config)
    if data is not None:  # the classes and class counts training had with --data
        apply_data_folder(cfg, data, ())
    inferencer = DetInferencer(model=cfg, weights=checkpoint, device='cpu',
                               show_progress=False)
    out = inferencer(list(files), no_save_vis=True, return_datasamples=True)
    detections = []
    for sample in out['predictions']:
        pred = sample.pred_instances
        order = np.argsort(-pred.scores.numpy(), kind='stable')
        masks = pred.masks.numpy().astype(np.uint8)[order] if 'masks' in pred else None
        panoptic = sample.pred_panoptic_seg.sem_seg[0].numpy() \
            if 'pred_panoptic_seg' in sample else None
        detections.append(Detections(boxes=pred.bboxes.numpy()[order],
                                     scores=pred.scores.numpy()[order],
                                     labels=pred.labels.numpy()[order], masks=masks,
                                     panoptic=panoptic))
    # the config's classes, else the checkpoint's (mmdet falls back to COCO's without them)
    metainfo = inferencer.cfg.test_dataloader.dataset.get('metainfo') or {}
    classes = list(metainfo.get('classes') or inferencer.model.dataset_meta['classes'])
    return detections, classes


def draw(path: str, det: Detections, classes: Sequence[str], threshold: float, out: str
         ) -> None:
    import cv2
    image = load_image(path)
    for j, (box, score, label) in enumerate(zip(det.boxes, det.scores, det.labels)):
        if score < threshold:
            continue
        if det.masks is not None:
            inside = det.masks[j].astype(bool)
            image[inside] = (image[inside] * (1 - MASK_ALPHA)
                             + np.array(BOX_COLOUR) * MASK_ALPHA).astype(np.uint8)
        x1, y1, x2, y2 = (round(float(v)) for v in box)
        cv2.rectangle(image, (x1, y1), (x2, y2), BOX_COLOUR, LINE_WIDTH)
        cv2.putText(image, f'{classes[int(label)]} {score:.2f}', (x1, max(y1 - 2, 0)),
                    cv2.FONT_HERSHEY_SIMPLEX, TEXT_SCALE, BOX_COLOUR, 1)
    cv2.imwrite(out, image)


def note_missing(option: str, path: str, images: Sequence[Dict[str, Any]],
                 gt_images: Sequence[Dict[str, Any]], key: Callable[[str], str]) -> int:
    """How many of ``images`` the annotation file ``path`` holds; one line naming the others
    (left out of its metrics: a folder of train and val images against val's annotations), an
    error line when it holds none."""
    matched = gt_image_ids(images, gt_images, key)
    missing = [im['file_name'] for im in images if im['id'] not in matched]
    shown = ', '.join(missing[:MISSING_SHOWN]) + (', ...' if len(missing) > MISSING_SHOWN else '')
    if not matched:
        print(f'error: {option} {path} holds none of the {len(images)} images (matched by file '
              f'name: {shown}); give the annotation file of these images', file=sys.stderr)
    elif missing:
        print(f'{option} {path}: skipped {len(missing)} of {len(images)} images that it does not '
              f'hold: {shown}', flush=True)
    return len(matched)


def to_dataset_ids(predictions: Dict[str, Any], gt: Dict[str, Any], source: str
                   ) -> Dict[str, Any]:
    """``predictions`` (:func:`coco_json`: label indices, input positions) with the ids of the
    COCO annotation dict ``gt`` (read from ``source``): category_id by class name, image_id by
    file name; images ``gt`` lacks get ids above its largest. Raises SystemExit when a class of
    the model is not among its categories."""
    predictions = copy.deepcopy(predictions)
    cat_by_name = {c['name']: int(c['id']) for c in gt.get('categories') or []}
    names = {c['id']: c['name'] for c in predictions['categories']}
    unknown = [n for n in names.values() if n not in cat_by_name]
    if unknown:
        raise SystemExit(f'error: {source} has no category named {", ".join(map(repr, unknown))} '
                         f'(its categories: {", ".join(cat_by_name) or "none"}); give the '
                         "annotation file of the model's classes")
    by_file = {osp.basename(im['file_name']): int(im['id']) for im in gt.get('images') or []}
    next_id = max(by_file.values(), default=-1) + 1
    image_ids = {}
    for im in predictions['images']:
        found = by_file.get(im['file_name'])
        if found is None:
            found, next_id = next_id, next_id + 1
        image_ids[im['id']] = found
        im['id'] = found
    for a in predictions['annotations']:
        a['image_id'] = image_ids[a['image_id']]
        a['category_id'] = cat_by_name[names[a['category_id']]]
    predictions['categories'] = [dict(id=cat_by_name[n], name=n) for n in names.values()]
    return predictions


def ids_file(args: argparse.Namespace) -> Optional[str]:
    """The annotation file whose ids ``predictions.json`` takes: ``--ann-file``, else the test
    (else validation) split's of ``--data``; None without either."""
    if args.ann_file or not args.data:
        return args.ann_file
    from vitdet_plugin.datasets.data_folder import DataFolderError, find_data_folder
    try:
        folder = find_data_folder(args.data)
    except DataFolderError as e:
        raise SystemExit(f'error: {e}') from None
    split = folder.split_for('test')
    return osp.join(folder.root, folder.splits[split].ann_file) if split else None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog='tools/infer.py', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('inputs', nargs='+', help='image files and / or folders of images')
    p.add_argument('--out-dir', required=True)
    p.add_argument('--backend', choices=('pytorch', 'onnxruntime'), default='onnxruntime')
    p.add_argument('--onnx', help='end-to-end graph (--backend onnxruntime)')
    p.add_argument('--config', help='config (--backend pytorch)')
    p.add_argument('--checkpoint', help='weights (--backend pytorch; default: the init)')
    p.add_argument('--draw-thr', type=float, default=0.3, help='draw detections scoring >= this')
    p.add_argument('--no-draw', action='store_true', help='write the JSON only')
    p.add_argument('--ann-file',
                   help="COCO annotations of the images: print the bbox (and segm) mAP; "
                   "predictions.json takes its category and image ids")
    p.add_argument('--data', metavar='DATA_DIR',
                   help='the data folder of tools/train.py --data: its classes (--backend '
                   "pytorch) and its test split's category and image ids")
    p.add_argument('--panoptic-ann-file',
                   help='COCO panoptic annotations of the images: print PQ (panoptic detectors)')
    p.add_argument('--panoptic-seg-dir',
                   help='the ground truth panoptic PNGs (default: --panoptic-ann-file without '
                        '.json)')
    args = p.parse_args(argv)
    if args.backend == 'onnxruntime' and not args.onnx:
        p.error('--backend onnxruntime needs --onnx MODEL.onnx (tools/export_onnx.py CONFIG '
                '--part detector)')
    if args.backend == 'pytorch' and not args.config:
        p.error('--backend pytorch needs --config CONFIG')
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    files = image_files(args.inputs)
    if args.backend == 'onnxruntime':
        detections, classes = run_onnxruntime(files, args.onnx)
    else:
        detections, classes = run_pytorch(files, args.config, args.checkpoint, args.data)
    os.makedirs(args.out_dir, exist_ok=True)
    predictions = coco_json(files, detections, classes)
    source = ids_file(args)
    if source is None:
        print('predictions.json: category_id is the label index and image_id the position of '
              "the image (no --ann-file or --data to take the dataset's ids from)", flush=True)
        written = predictions
    else:
        with open(source) as f:
            written = to_dataset_ids(predictions, json.load(f), source)
    out = osp.join(args.out_dir, 'predictions.json')
    with open(out, 'w') as f:
        json.dump(written, f)
    if not args.no_draw:
        for path, det in zip(files, detections):
            draw(path, det, classes, args.draw_thr, osp.join(args.out_dir, osp.basename(path)))
    print(f'{len(files)} images, {len(predictions["annotations"])} detections ({args.backend}) '
          f'-> {out}', flush=True)
    panoptic = panoptic_json(files, detections, classes, args.out_dir)
    if panoptic is not None:
        with open(osp.join(args.out_dir, PANOPTIC_JSON), 'w') as f:
            json.dump(panoptic, f)
    if args.panoptic_ann_file and panoptic is None:
        print('error: --panoptic-ann-file: the detector gives no panoptic maps', file=sys.stderr)
        return 2
    if args.panoptic_ann_file and panoptic is not None:
        seg_dir = args.panoptic_seg_dir or osp.splitext(args.panoptic_ann_file)[0]
        with open(args.panoptic_ann_file) as f:
            gt = json.load(f)
        matched = note_missing('--panoptic-ann-file', args.panoptic_ann_file,
                               predictions['images'], gt['images'], file_stem)
        if not matched:
            return 2
        pq = coco_pq(predictions, panoptic, args.out_dir, gt, seg_dir)
        print(f'COCO panoptic PQ {100 * pq["All"]["pq"]:.2f} SQ {100 * pq["All"]["sq"]:.2f} '
              f'RQ {100 * pq["All"]["rq"]:.2f} (things {100 * pq["Things"]["pq"]:.2f}, stuff '
              f'{100 * pq["Stuff"]["pq"]:.2f}; {args.backend}, {matched} images)', flush=True)
        miou = semantic_miou(files, detections, classes, gt, seg_dir)
        print(f'semantic mIoU {miou:.2f} (classes of the panoptic maps; {args.backend})',
              flush=True)
    if args.ann_file:
        with open(args.ann_file) as f:
            gt_images = json.load(f)['images']
        matched = note_missing('--ann-file', args.ann_file, predictions['images'], gt_images,
                               osp.basename)
        if not matched:
            return 2
        with_masks = any('segmentation' in a for a in predictions['annotations'])
        for iou_type in ('bbox', 'segm') if with_masks else ('bbox',):
            print(f'COCO {iou_type} mAP {coco_map(predictions, args.ann_file, iou_type):.4f} '
                  f'({args.backend}, {matched} images)', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
