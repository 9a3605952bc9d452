"""Detections as COCO files and their COCO metrics (``tools/infer.py``): the predictions JSON,
COCO bbox / segm mAP (pycocotools), a panoptic detector's maps as COCO panoptic PNGs + JSON,
PQ (panopticapi's ``pq_compute``) and the semantic mIoU. numpy, OpenCV, pycocotools and
panopticapi only (each imported where used): usable beside the onnxruntime runner, without
torch. Images meet their annotations by file name; those an annotation file does not hold are
left out of its metrics.
"""
import json
import os
import os.path as osp
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from .panoptic import INSTANCE_OFFSET
from .runner import Detections, load_image

#: Sub-folder of the output folder with the panoptic PNGs, and the panoptic JSON's name.
PANOPTIC_DIR, PANOPTIC_JSON = 'panoptic', 'panoptic.json'
#: Segment id of void pixels in a COCO panoptic PNG (black).
VOID_ID = 0
#: Label of pixels no ground truth segment covers (mmdet's LoadPanopticAnnotations).
IGNORE_INDEX = 255


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


def gt_image_ids(images: Sequence[Dict[str, Any]], gt_images: Sequence[Dict[str, Any]],
                 key: Callable[[str], str]) -> Dict[int, int]:
    """Our image id -> the ground truth's, matched by ``key(file_name)``; images the ground
    truth does not hold are left out (``tools/infer.py`` names them)."""
    by_key = {key(im['file_name']): im['id'] for im in gt_images}
    return {im['id']: by_key[key(im['file_name'])] for im in images
            if key(im['file_name']) in by_key}


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


def file_stem(path: str) -> str:
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
        name = file_stem(path) + '.png'
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
    image_ids = gt_image_ids(predictions['images'], gt['images'], file_stem)
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
    image_id = {file_stem(im['file_name']): im['id'] for im in gt['images']}
    annotation = {a['image_id']: a for a in gt['annotations']}
    label_of = {c['id']: list(classes).index(c['name']) for c in gt['categories']}
    n = len(classes)
    intersect, predicted, truth = np.zeros(n), np.zeros(n), np.zeros(n)
    for path, det in zip(files, detections):
        assert det.panoptic is not None
        if file_stem(path) not in image_id:  # not in the ground truth (left out)
            continue
        ann = annotation[image_id[file_stem(path)]]
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
