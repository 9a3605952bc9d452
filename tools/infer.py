"""Detect objects in images: COCO-style JSON and drawn pictures, with PyTorch or onnxruntime.

    python tools/infer.py IMAGES_OR_FOLDERS... --out-dir DIR --backend onnxruntime --onnx M.onnx
    python tools/infer.py IMAGES_OR_FOLDERS... --out-dir DIR --backend pytorch --config C
        [--checkpoint W] [--draw-thr 0.3] [--no-draw] [--ann-file val.json]
        [--panoptic-ann-file panoptic_val.json [--panoptic-seg-dir panoptic_val/]]

Writes ``DIR/predictions.json`` (``images``: id, file_name, width, height; ``annotations``:
image_id, bbox ``[x, y, w, h]`` in original pixels, score, category_id = the label index, and
for a detector with masks ``segmentation``, COCO RLE of the original image's size;
``categories``: id, name) and, unless ``--no-draw``, ``DIR/<image name>`` with the detections
scoring at least ``--draw-thr`` drawn. ``--ann-file``: a COCO annotation file of the images (by
file name) to print the COCO bbox (and segm) mAP of the predictions (pycocotools).

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
import importlib.util
import json
import os
import os.path as osp
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if importlib.util.find_spec('vitdet_plugin') is None:  # a checkout that is not pip-installed
    sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import numpy as np

from vitdet_plugin.deploy.panoptic import INSTANCE_OFFSET
from vitdet_plugin.deploy.runner import Detections, OnnxDetector, load_image

#: File name endings read from a folder.
IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp', '.tif', '.tiff', '.webp')
#: Drawing: box colour (BGR), line width, text scale, weight of the colour over a mask.
BOX_COLOUR = (0, 200, 255)
LINE_WIDTH = 2
TEXT_SCALE = 0.4
MASK_ALPHA = 0.5
#: Sub-folder of --out-dir with the panoptic PNGs, and the panoptic JSON's name.
PANOPTIC_DIR, PANOPTIC_JSON = 'panoptic', 'panoptic.json'
#: Segment id of void pixels in a COCO panoptic PNG (black).
VOID_ID = 0
#: Label of pixels no ground truth segment covers (mmdet's LoadPanopticAnnotations).
IGNORE_INDEX = 255
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


def run_pytorch(files: Sequence[str], config: str, checkpoint: Optional[str]
                ) -> Tuple[List[Detections], List[str]]:
    import vitdet_plugin  # noqa: F401  (registers our modules)
    from mmdet.apis import DetInferencer

    inferencer = DetInferencer(model=config, weights=checkpoint, device='cpu',
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


def gt_image_ids(images: Sequence[Dict[str, Any]], gt_images: Sequence[Dict[str, Any]],
                 key: Callable[[str], str]) -> Dict[int, int]:
    """Our image id -> the ground truth's, matched by ``key(file_name)``; images the ground
    truth does not hold are left out (:func:`note_missing` says which)."""
    by_key = {key(im['file_name']): im['id'] for im in gt_images}
    return {im['id']: by_key[key(im['file_name'])] for im in images
            if key(im['file_name']) in by_key}


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


def coco_map(predictions: Dict[str, Any], ann_file: str, iou_type: str = 'bbox') -> float:
    """COCO mAP (``iou_type`` bbox or segm) of ``predictions`` against ``ann_file`` (images
    matched by file name, classes by name)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt = COCO(ann_file)
    cat_by_name = {c['name']: c['id'] for c in gt.dataset['categories']}
    names = {c['id']: c['name'] for c in predictions['categories']}
    image_ids = gt_image_ids(predictions['images'], gt.dataset['images'], osp.basename)
    # segm: the mask without the box, as mmdet's CocoMetric (with a bbox, pycocotools' loadRes
    # would take the box's area for the small / medium / large split)
    shape = 'segmentation' if iou_type == 'segm' else 'bbox'
    results = [dict(image_id=image_ids[a['image_id']], score=a['score'],
                    category_id=cat_by_name[names[a['category_id']]], **{shape: a[shape]})
               for a in predictions['annotations'] if a['image_id'] in image_ids]
    evaluator = COCOeval(gt, gt.loadRes(results) if results else COCO(), iou_type)
    evaluator.params.imgIds = sorted(image_ids.values())
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    return float(evaluator.stats[0])


def _stem(path: str) -> str:
    """A file's name without folder and suffix: how images meet their annotations."""
    return osp.splitext(osp.basename(path))[0]


def panoptic_json(files: Sequence[str], detections: Sequence[Detections],
                  classes: Sequence[str], out_dir: str) -> Optional[Dict[str, Any]]:
    """Write each image's panoptic map as a COCO panoptic PNG under ``out_dir/panoptic/`` and
    return the COCO panoptic JSON (category_id = label index); None without panoptic maps.
    mmdet's ids (``label + k * INSTANCE_OFFSET``) stay the segment ids; void is 0, as in
    mmdet's CocoPanopticMetric (panopticapi's ``id2rgb`` colours)."""
    if all(d.panoptic is None for d in detections):
        return None
    import cv2
    from panopticapi.utils import id2rgb
    folder = osp.join(out_dir, PANOPTIC_DIR)
    os.makedirs(folder, exist_ok=True)
    annotations = []
    for i, (path, det) in enumerate(zip(files, detections)):
        assert det.panoptic is not None
        ids = det.panoptic.copy()                                         # (H, W)
        ids[ids % INSTANCE_OFFSET == len(classes)] = VOID_ID
        segments = [dict(id=segment, category_id=segment % INSTANCE_OFFSET,
                         area=int((ids == segment).sum()))
                    for segment in np.unique(ids).tolist() if segment != VOID_ID]
        name = _stem(path) + '.png'
        cv2.imwrite(osp.join(folder, name), id2rgb(ids)[..., ::-1])  # OpenCV writes BGR
        annotations.append(dict(image_id=i, file_name=name, segments_info=segments))
    return dict(annotations=annotations,
                categories=[dict(id=i, name=n) for i, n in enumerate(classes)])


def coco_pq(predictions: Dict[str, Any], panoptic: Dict[str, Any], out_dir: str,
            gt: Dict[str, Any], seg_dir: str) -> Dict[str, Dict[str, float]]:
    """PQ / SQ / RQ (``All``, ``Things``, ``Stuff``) of the panoptic maps written under
    ``out_dir`` against the COCO panoptic ground truth ``gt`` (the annotation file's JSON, its
    PNGs in ``seg_dir``): images matched by file name, classes by name; panopticapi's
    ``pq_compute`` on the matched images."""
    from panopticapi.evaluation import pq_compute
    cat_by_name = {c['name']: c['id'] for c in gt['categories']}
    names = {c['id']: c['name'] for c in panoptic['categories']}
    image_ids = gt_image_ids(predictions['images'], gt['images'], _stem)
    ours = [dict(a, image_id=image_ids[a['image_id']], segments_info=[
        dict(s, category_id=cat_by_name[names[s['category_id']]]) for s in a['segments_info']])
        for a in panoptic['annotations'] if a['image_id'] in image_ids]
    kept = set(image_ids.values())
    gt = dict(gt, images=[im for im in gt['images'] if im['id'] in kept],
              annotations=[a for a in gt['annotations'] if a['image_id'] in kept])
    gt_file, pred_file = (osp.join(out_dir, f'{n}_for_pq.json') for n in ('gt', 'panoptic'))
    for path, content in ((gt_file, gt), (pred_file, dict(gt, annotations=ours))):
        with open(path, 'w') as f:
            json.dump(content, f)
    return pq_compute(gt_file, pred_file, seg_dir, osp.join(out_dir, PANOPTIC_DIR))


def semantic_miou(files: Sequence[str], detections: Sequence[Detections],
                  classes: Sequence[str], gt: Dict[str, Any], seg_dir: str) -> float:
    """mIoU (%) over things + stuff of the panoptic maps' classes against the COCO panoptic
    ground truth ``gt`` (its PNGs in ``seg_dir``), as mmdet's SemSegMetric on
    LoadPanopticAnnotations' semantic maps: pixels without a ground truth segment ignored, void
    predictions wrong, classes that neither the ground truth nor the predictions hold left out
    of the mean."""
    from panopticapi.utils import rgb2id
    image_id = {_stem(im['file_name']): im['id'] for im in gt['images']}
    annotation = {a['image_id']: a for a in gt['annotations']}
    label_of = {c['id']: list(classes).index(c['name']) for c in gt['categories']}
    n = len(classes)
    intersect, predicted, truth = np.zeros(n), np.zeros(n), np.zeros(n)
    for path, det in zip(files, detections):
        assert det.panoptic is not None
        if _stem(path) not in image_id:  # not in the ground truth (note_missing)
            continue
        ann = annotation[image_id[_stem(path)]]
        ids = rgb2id(load_image(osp.join(seg_dir, ann['file_name']))[..., ::-1])  # (H, W)
        label = np.full(ids.shape, IGNORE_INDEX)
        for segment in ann['segments_info']:
            label[ids == segment['id']] = label_of[segment['category_id']]
        known = label != IGNORE_INDEX
        pred, label = det.panoptic[known] % INSTANCE_OFFSET, label[known]
        intersect += np.bincount(pred[pred == label], minlength=n)[:n]
        predicted += np.bincount(pred[pred < n], minlength=n)[:n]  # void (n) is no class
        truth += np.bincount(label, minlength=n)[:n]
    union = predicted + truth - intersect
    return float(100 * np.mean((intersect / np.maximum(union, 1))[union > 0]))


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
                               predictions['images'], gt['images'], _stem)
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
