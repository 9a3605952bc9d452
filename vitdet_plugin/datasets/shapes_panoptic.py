"""COCO panoptic ground truth of the synthetic shapes dataset (``vitdet_plugin.datasets.shapes``).

Categories: the *things* are the spec's shape classes with the instance JSON's ids
(``1..T``, ``isthing=1``); the *stuff* classes :data:`STUFF_CLASSES` follow them (``T+1``,
``T+2``, ``isthing=0``):

* ``lines``: the pixels of the distractor lines and arcs that no object covers;
* ``background``: every other pixel.

The contiguous label order mmdet uses (``metainfo['classes']``) is things then stuff, i.e.
label = category id - 1 (:func:`panoptic_classes`). Each object is one thing segment that is
exactly its visible mask (the mask its instance annotation was traced from), ``lines`` and
``background`` are one segment each per image (absent when empty); every pixel belongs to a
segment, so the void id 0 is not used.

Layout, as mmdet 3.3 reads it (``CocoPanopticDataset`` with
``data_prefix=dict(img='<split>/', seg='annotations/panoptic_<split>/')``, whose segmentation
file name is the image's ``file_name``; ``CocoPanopticMetric(ann_file=..., seg_prefix=...)``)::

    root/annotations/panoptic_<split>.json     images, annotations (image_id, file_name,
                                               segments_info: id, category_id, iscrowd, bbox,
                                               area), categories (id, name, isthing, ...)
    root/annotations/panoptic_<split>/000000.png   RGB segment ids: id = R + 256 G + 256^2 B

Segment ids are a running counter over the split (unique in it, at most ``256**3 - 1``):
mmdet's ``COCOPanoptic`` index groups segments by id across images and every image's lookup
walks its ids' groups, so per-image ids ``1..n`` would make loading quadratic in the split size.
"""
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np

STUFF_CLASSES: Tuple[str, ...] = ('lines', 'background')
PANOPTIC_ANN_FILE = 'annotations/panoptic_{split}.json'
PANOPTIC_SEG_DIR = 'annotations/panoptic_{split}'
MAX_SEGMENT_ID = 256 ** 3 - 1


def panoptic_classes(classes: Sequence[str]) -> Tuple[str, ...]:
    """mmdet's label order of a panoptic shapes dataset: the thing classes, then the stuff."""
    return tuple(classes) + STUFF_CLASSES


def panoptic_categories(classes: Sequence[str]) -> List[dict]:
    """COCO panoptic categories: things ``1..T`` (as the instance JSON), then the stuff."""
    things = [dict(id=k + 1, name=n, supercategory='shape', isthing=1)
              for k, n in enumerate(classes)]
    stuff = [dict(id=len(classes) + k + 1, name=n, supercategory='stuff', isthing=0)
             for k, n in enumerate(STUFF_CLASSES)]
    return things + stuff


def encode_ids(ids: np.ndarray) -> np.ndarray:
    """(H, W) segment ids -> (H, W, 3) uint8 RGB with id = R + 256 G + 256^2 B (panopticapi)."""
    ids = ids.astype(np.int64)
    return np.stack([ids % 256, ids // 256 % 256, ids // 256 ** 2 % 256], -1).astype(np.uint8)


def decode_ids(rgb: np.ndarray) -> np.ndarray:
    """(H, W, 3) RGB -> (H, W) int64 segment ids; the inverse of :func:`encode_ids`."""
    rgb = rgb.astype(np.int64)
    return rgb[..., 0] + 256 * rgb[..., 1] + 256 ** 2 * rgb[..., 2]


def _bbox(mask: np.ndarray) -> List[int]:
    ys, xs = np.nonzero(mask)
    x0, y0 = int(xs.min()), int(ys.min())
    return [x0, y0, int(xs.max()) + 1 - x0, int(ys.max()) + 1 - y0]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix('.json.tmp')
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # the file appears only when it is complete


class PanopticWriter:
    """Writes one split's panoptic PNGs (:meth:`add`, one per image) and its JSON (:meth:`close`).

    Args:
        root: dataset root.
        split: split name (``train``, ``val``).
        classes: the thing classes, category id = index + 1.
        info: the JSON's ``info`` (seed, spec, format version).
    """

    def __init__(self, root: str, split: str, classes: Sequence[str], info: dict) -> None:
        self.num_things = len(classes)
        self.categories = panoptic_categories(classes)
        self.info = info
        self.ann_path = Path(root) / PANOPTIC_ANN_FILE.format(split=split)
        self.seg_dir = Path(root) / PANOPTIC_SEG_DIR.format(split=split)
        self.seg_dir.mkdir(parents=True, exist_ok=True)
        self.images: List[dict] = []
        self.annotations: List[dict] = []
        self._next_id = 1

    def add(self, image_id: int, file_name: str, things: Sequence[Tuple[int, np.ndarray]],
            lines: np.ndarray, void: Optional[np.ndarray] = None) -> dict:
        """Write the PNG of one image; returns its annotation (``segments_info``).

        Args:
            image_id: the image's id (as in the instance JSON).
            file_name: the image's file name; the PNG gets the same name.
            things: ``(category_id, (H, W) bool mask)`` per object; the masks must not overlap.
            lines: (H, W) bool mask of the distractor lines; objects win where both are set.
            void: (H, W) bool mask of pixels left unlabelled (id 0), or None.
        """
        h, w = lines.shape
        ids = np.zeros((h, w), np.int64)
        taken = np.zeros((h, w), bool) if void is None else void.astype(bool).copy()
        segments = []
        stuff = [(self.num_things + 1, lines.astype(bool)),
                 (self.num_things + 2, np.ones((h, w), bool))]
        for k, (category_id, mask) in enumerate(list(things) + stuff):
            if k < len(things) and (mask & taken).any():
                raise ValueError(f'image {image_id}: thing {k} overlaps an earlier segment')
            mask = mask & ~taken
            if not mask.any():
                continue
            if self._next_id > MAX_SEGMENT_ID:
                raise ValueError(f'more than {MAX_SEGMENT_ID} segments in one split')
            ids[mask] = self._next_id
            taken |= mask
            segments.append(dict(id=self._next_id, category_id=int(category_id), iscrowd=0,
                                 bbox=_bbox(mask), area=int(mask.sum())))
            self._next_id += 1
        path = self.seg_dir / file_name
        if not cv2.imwrite(str(path), encode_ids(ids)[..., ::-1]):  # cv2 writes BGR
            raise OSError(f'could not write {path}')
        self.images.append(dict(id=image_id, file_name=file_name, width=w, height=h))
        ann = dict(image_id=image_id, file_name=file_name, segments_info=segments)
        self.annotations.append(ann)
        return ann

    def close(self) -> dict:
        """Write the split's panoptic JSON (atomically); returns it."""
        data = dict(info=self.info, licenses=[], images=self.images,
                    annotations=self.annotations, categories=self.categories)
        _write_json(self.ann_path, data)
        return data


def panoptic_matches(root: str, split: str, info: dict, num_images: int) -> bool:
    """Whether ``root`` holds a complete panoptic ``split`` of ``num_images`` images whose
    ``info`` has every item of ``info`` (seed, spec, version, ...).

    Complete: its JSON exists (written last) and every PNG the JSON names is present.
    """
    path = Path(root) / PANOPTIC_ANN_FILE.format(split=split)
    if not path.is_file():
        return False
    with open(path) as f:
        data: Dict = json.load(f)
    have = data.get('info') or {}
    if len(data.get('images', [])) != num_images or any(have.get(k) != v
                                                        for k, v in info.items()):
        return False
    seg_dir = Path(root) / PANOPTIC_SEG_DIR.format(split=split)
    present = set(os.listdir(seg_dir)) if seg_dir.is_dir() else set()
    return all(a['file_name'] in present for a in data.get('annotations', []))
