"""Detect objects in images: COCO-style JSON and drawn pictures, with PyTorch or onnxruntime.

    python tools/infer.py IMAGES_OR_FOLDERS... --out-dir DIR --backend onnxruntime --onnx M.onnx
    python tools/infer.py IMAGES_OR_FOLDERS... --out-dir DIR --backend pytorch --config C
        [--checkpoint W] [--draw-thr 0.3] [--no-draw] [--ann-file val.json]

Writes ``DIR/predictions.json`` (``images``: id, file_name, width, height; ``annotations``:
image_id, bbox ``[x, y, w, h]`` in original pixels, score, category_id = the label index, and
for a detector with masks ``segmentation``, COCO RLE of the original image's size;
``categories``: id, name) and, unless ``--no-draw``, ``DIR/<image name>`` with the detections
scoring at least ``--draw-thr`` drawn. ``--ann-file``: a COCO annotation file of the images (by
file name) to print the COCO bbox (and segm) mAP of the predictions (pycocotools).

``--backend onnxruntime`` runs a graph from ``tools/export_onnx.py CONFIG [CKPT] --part
detector`` with numpy + onnxruntime + OpenCV only (``vitdet_plugin.deploy.runner``; torch and
mmdet are not imported). ``--backend pytorch`` runs mmdet's ``DetInferencer`` on the config
(weights from ``--checkpoint``, else the config's initialisation).
"""
import argparse
import importlib.util
import json
import os
import os.path as osp
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import numpy as np

from vitdet_plugin.deploy.runner import Detections, OnnxDetector, load_image

#: File name endings read from a folder.
IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp', '.tif', '.tiff', '.webp')
#: Drawing: box colour (BGR), line width, text scale, weight of the colour over a mask.
BOX_COLOUR = (0, 200, 255)
LINE_WIDTH = 2
TEXT_SCALE = 0.4
MASK_ALPHA = 0.5


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


def run_pytorch(files: Sequence[str], config: str, checkpoint: Optional[str]
                ) -> Tuple[List[Detections], List[str]]:
    import vitdet_plugin  # noqa: F401  (registers our modules)
    from mmdet.apis import DetInferencer

    inferencer = DetInferencer(model=config, weights=checkpoint, device='cpu',
                               show_progress=False)
    out = inferencer(list(files), no_save_vis=True, return_datasamples=False)
    detections = []
    for p in out['predictions']:
        scores = np.asarray(p['scores'], np.float32)
        order = np.argsort(-scores, kind='stable')
        masks = None
        if 'masks' in p:  # DetInferencer's COCO RLEs (counts as text)
            from pycocotools import mask as mask_utils
            rles = [dict(rle, counts=rle['counts'].encode()) for rle in p['masks']]
            masks = np.stack([mask_utils.decode(r) for r in rles])[order] if rles else None
        detections.append(Detections(boxes=np.asarray(p['bboxes'], np.float32)[order],
                                     scores=scores[order],
                                     labels=np.asarray(p['labels'], np.int64)[order],
                                     masks=masks))
    # the config's classes, else the checkpoint's (mmdet falls back to COCO's without them)
    metainfo = inferencer.cfg.test_dataloader.dataset.get('metainfo') or {}
    classes = list(metainfo.get('classes') or inferencer.model.dataset_meta['classes'])
    return detections, classes


def rle(mask: np.ndarray) -> Dict[str, Any]:
    """COCO's compressed RLE of an ``(H, W)`` 0 / 1 mask, counts as text (JSON)."""
    from pycocotools import mask as mask_utils
    encoded = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    return dict(size=[int(v) for v in encoded['size']], counts=encoded['counts'].decode())


def coco_json(files: Sequence[str], detections: Sequence[Detections], classes: Sequence[str]
              ) -> Dict[str, Any]:
    images: List[Dict[str, Any]] = []
    annotations: List[Dict[str, Any]] = []
    for i, (path, det) in enumerate(zip(files, detections)):
        h, w = load_image(path).shape[:2]
        images.append(dict(id=i, file_name=osp.basename(path), width=w, height=h))
        for j, (box, score, label) in enumerate(zip(det.boxes, det.scores, det.labels)):
            x1, y1, x2, y2 = (float(v) for v in box)
            annotations.append(dict(id=len(annotations) + 1, image_id=i,
                                    bbox=[x1, y1, x2 - x1, y2 - y1], score=float(score),
                                    category_id=int(label)))
            if det.masks is not None:
                annotations[-1]['segmentation'] = rle(det.masks[j])
    return dict(images=images, annotations=annotations,
                categories=[dict(id=i, name=n) for i, n in enumerate(classes)])


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


def coco_map(predictions: Dict[str, Any], ann_file: str, iou_type: str = 'bbox') -> float:
    """COCO mAP (``iou_type`` bbox or segm) of ``predictions`` against ``ann_file`` (images
    matched by file name, classes by name)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt = COCO(ann_file)
    by_name = {osp.basename(im['file_name']): im['id'] for im in gt.dataset['images']}
    cat_by_name = {c['name']: c['id'] for c in gt.dataset['categories']}
    names = {c['id']: c['name'] for c in predictions['categories']}
    image_ids = {im['id']: by_name[im['file_name']] for im in predictions['images']}
    # segm: the mask without the box, as mmdet's CocoMetric (with a bbox, pycocotools' loadRes
    # would take the box's area for the small / medium / large split)
    shape = 'segmentation' if iou_type == 'segm' else 'bbox'
    results = [dict(image_id=image_ids[a['image_id']], score=a['score'],
                    category_id=cat_by_name[names[a['category_id']]], **{shape: a[shape]})
               for a in predictions['annotations']]
    evaluator = COCOeval(gt, gt.loadRes(results) if results else COCO(), iou_type)
    evaluator.params.imgIds = sorted(image_ids.values())
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    return float(evaluator.stats[0])


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
                   help='COCO annotations of the images: print the bbox (and segm) mAP')
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
        detections, classes = run_pytorch(files, args.config, args.checkpoint)
    os.makedirs(args.out_dir, exist_ok=True)
    predictions = coco_json(files, detections, classes)
    out = osp.join(args.out_dir, 'predictions.json')
    with open(out, 'w') as f:
        json.dump(predictions, f)
    if not args.no_draw:
        for path, det in zip(files, detections):
            draw(path, det, classes, args.draw_thr, osp.join(args.out_dir, osp.basename(path)))
    print(f'{len(files)} images, {len(predictions["annotations"])} detections ({args.backend}) '
          f'-> {out}', flush=True)
    if args.ann_file:
        with_masks = any('segmentation' in a for a in predictions['annotations'])
        for iou_type in ('bbox', 'segm') if with_masks else ('bbox',):
            print(f'COCO {iou_type} mAP {coco_map(predictions, args.ann_file, iou_type):.4f} '
                  f'({args.backend}, {len(files)} images)', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
