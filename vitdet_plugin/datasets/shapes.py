"""Deterministic synthetic COCO-format instance-segmentation dataset ("shapes").

Each image is a noisy colour field with distractor lines and arcs, on which 1-5 textured,
randomly rotated shapes of several classes are drawn, possibly overlapping (later shapes occlude
earlier ones; every object keeps at least ``1 - max_occlusion`` of its area visible). The
annotation of an object is its *visible* region: COCO polygons traced from the visible mask,
the tight box of that mask (``[x, y, w, h]`` in pixel-edge coordinates) and its pixel area.

Everything is derived from one seed: image ``i`` of a split draws from
``numpy.random.default_rng([seed, split_key, i])``, so an image does not depend on how many
images are generated, and the same seed always gives byte-identical PNGs and JSON.

Layout written by :func:`generate_dataset` (mmdet ``CocoDataset`` reads it as is)::

    root/annotations/instances_train.json   root/train/000000.png ...
    root/annotations/instances_val.json     root/val/000000.png ...
"""
import json
import math
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import cv2
import numpy as np

#: Shape classes of the default dataset, in category-id order (category id = index + 1).
CLASSES: Tuple[str, ...] = ('square', 'circle', 'triangle', 'star', 'cross')
SPLITS: Tuple[str, ...] = ('train', 'val')
ANN_FILE = 'annotations/instances_{split}.json'
FORMAT_VERSION = 1

CIRCLE_VERTICES = 64
STAR_POINTS = 5
STAR_INNER_RATIO = (0.38, 0.55)   # inner / outer radius of a star
CROSS_ARM_RATIO = (0.28, 0.42)    # half arm width / outer radius of a cross
MIN_COLOUR_CONTRAST = 70.0        # L2 distance in RGB from the local background mean
MIN_VISIBLE_PIXELS = 30           # an object keeps at least this many visible pixels
PLACEMENT_TRIES = 30
CONTOUR_UPSAMPLE = 4              # polygon tracing resolution, sub-pixels per pixel
CONTOUR_TOLERANCE = 0.25          # polygon simplification tolerance, px


@dataclass(frozen=True)
class ShapesSpec:
    """What a shapes dataset looks like; stored in the annotation files' ``info``.

    Args:
        image_size: side of the square images, px.
        classes: shape classes (any of :data:`SHAPE_MAKERS`), category id = index + 1.
        objects: (min, max) objects per image, inclusive.
        object_size: (min, max) outer diameter of a shape before occlusion, px.
        max_occlusion: largest fraction of an object that later objects may hide.
        lines: (min, max) distractor lines and arcs per image.
        noise_std: std of the per-pixel Gaussian noise added to the whole image.
    """
    image_size: int = 256
    classes: Tuple[str, ...] = CLASSES
    objects: Tuple[int, int] = (1, 5)
    object_size: Tuple[int, int] = (20, 100)
    max_occlusion: float = 0.45
    lines: Tuple[int, int] = (3, 8)
    noise_std: float = 10.0

    def __post_init__(self) -> None:
        unknown = [c for c in self.classes if c not in SHAPE_MAKERS]
        if not self.classes or unknown:
            raise ValueError(f'ShapesSpec.classes={self.classes!r}: unknown classes {unknown}; '
                             f'accepted: {sorted(SHAPE_MAKERS)}')
        lo, hi = self.objects
        if not 1 <= lo <= hi:
            raise ValueError(f'ShapesSpec.objects={self.objects!r} must be (min, max) '
                             'with 1 <= min <= max')
        lo, hi = self.object_size
        if not 4 <= lo <= hi <= self.image_size:
            raise ValueError(f'ShapesSpec.object_size={self.object_size!r} must be (min, max) '
                             f'with 4 <= min <= max <= image_size={self.image_size}')
        if not 0.0 <= self.max_occlusion < 1.0:
            raise ValueError(f'ShapesSpec.max_occlusion={self.max_occlusion!r} must be in [0, 1)')


# ----------------------------------------------------------------------------- shape outlines
def _regular_polygon(n: int, radius: float, phase: float = 0.0) -> np.ndarray:
    t = phase + 2 * math.pi * np.arange(n) / n
    return radius * np.stack([np.cos(t), np.sin(t)], axis=1)


def _square(rng: np.random.Generator, r: float) -> np.ndarray:
    return _regular_polygon(4, r, math.pi / 4)


def _circle(rng: np.random.Generator, r: float) -> np.ndarray:
    return _regular_polygon(CIRCLE_VERTICES, r)


def _triangle(rng: np.random.Generator, r: float) -> np.ndarray:
    return _regular_polygon(3, r, -math.pi / 2)


def _star(rng: np.random.Generator, r: float) -> np.ndarray:
    outer = _regular_polygon(STAR_POINTS, r, -math.pi / 2)
    inner = _regular_polygon(STAR_POINTS, r * rng.uniform(*STAR_INNER_RATIO),
                             -math.pi / 2 + math.pi / STAR_POINTS)
    return np.stack([outer, inner], axis=1).reshape(-1, 2)


def _cross(rng: np.random.Generator, r: float) -> np.ndarray:
    a = r * rng.uniform(*CROSS_ARM_RATIO)   # half arm width
    b = math.sqrt(r * r - a * a)            # arm length, so the tips touch the outer circle
    return np.array([(a, b), (-a, b), (-a, a), (-b, a), (-b, -a), (-a, -a), (-a, -b),
                     (a, -b), (a, -a), (b, -a), (b, a), (a, a)], dtype=np.float64)


#: class name -> ``f(rng, radius) -> (N, 2) outline centred at 0, before rotation``.
SHAPE_MAKERS: Dict[str, Callable[[np.random.Generator, float], np.ndarray]] = {
    'square': _square, 'circle': _circle, 'triangle': _triangle, 'star': _star,
    'cross': _cross,
}


def shape_outline(name: str, rng: np.random.Generator, center: Tuple[float, float],
                  diameter: float, angle: float) -> np.ndarray:
    """(N, 2) float outline (x, y) of shape ``name`` of outer ``diameter``, rotated by ``angle``."""
    pts = SHAPE_MAKERS[name](rng, diameter / 2)
    c, s = math.cos(angle), math.sin(angle)
    rot = np.array([[c, -s], [s, c]])
    return pts @ rot.T + np.asarray(center, dtype=np.float64)


def _fill_mask(outline: np.ndarray, size: int) -> np.ndarray:
    """(H, W) bool mask of a polygon; vertices are in pixel-edge coordinates."""
    mask = np.zeros((size, size), np.uint8)
    shift = 4  # sub-pixel vertex precision for cv2
    pts = np.round((outline - 0.5) * (1 << shift)).astype(np.int32)
    cv2.fillPoly(mask, [pts], 1, lineType=cv2.LINE_8, shift=shift)
    return mask.astype(bool)


# ----------------------------------------------------------------------------- image synthesis
def _colour_field(rng: np.random.Generator, size: int) -> np.ndarray:
    """(H, W, 3) float32 smooth random colour field with some finer structure."""
    field = np.zeros((size, size, 3), np.float32)
    for cells, amp in ((int(rng.integers(2, 5)), 1.0), (int(rng.integers(6, 16)), 0.35)):
        grid = rng.uniform(0, 255, (cells, cells, 3)).astype(np.float32)
        field += amp * cv2.resize(grid, (size, size), interpolation=cv2.INTER_CUBIC)
    field /= 1.35
    return np.clip(field, 0, 255)


def _draw_distractors(rng: np.random.Generator, img: np.ndarray, count: int) -> None:
    size = img.shape[0]
    for _ in range(count):
        colour = tuple(float(v) for v in rng.uniform(0, 255, 3))
        thickness = int(rng.integers(1, 4))
        if rng.random() < 0.65:
            p0 = tuple(int(v) for v in rng.integers(-size // 4, size + size // 4, 2))
            p1 = tuple(int(v) for v in rng.integers(-size // 4, size + size // 4, 2))
            cv2.line(img, p0, p1, colour, thickness, cv2.LINE_AA)
        else:
            center = tuple(int(v) for v in rng.integers(0, size, 2))
            axes = tuple(int(v) for v in rng.integers(size // 8, size // 2, 2))
            start = float(rng.uniform(0, 360))
            cv2.ellipse(img, center, axes, float(rng.uniform(0, 180)), start,
                        start + float(rng.uniform(40, 200)), colour, thickness, cv2.LINE_AA)


def _texture(rng: np.random.Generator, size: int, colour: np.ndarray) -> np.ndarray:
    """(H, W, 3) float32 object fill: base colour with a linear gradient or stripes."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    theta = rng.uniform(0, 2 * math.pi)
    proj = math.cos(theta) * xx + math.sin(theta) * yy
    if rng.random() < 0.5:
        mod = (proj - proj.mean()) * rng.uniform(20, 60)
    else:
        mod = np.sin(proj * 2 * math.pi * rng.uniform(8, 20)) * rng.uniform(8, 20)
    return np.clip(colour[None, None, :] + mod[..., None], 0, 255)


def _pick_colour(rng: np.random.Generator, background: np.ndarray) -> np.ndarray:
    best: Optional[np.ndarray] = None
    best_d = -1.0
    for _ in range(10):
        colour = rng.uniform(0, 255, 3).astype(np.float32)
        d = float(np.linalg.norm(colour - background))
        if d >= MIN_COLOUR_CONTRAST:
            return colour
        if d > best_d:
            best, best_d = colour, d
    if best is None:  # unreachable: the first draw's distance (>= 0) beats -1
        raise RuntimeError('_pick_colour drew no colour')
    return best


@dataclass
class ShapeObject:
    """One drawn object: class index into ``spec.classes`` and its visible (H, W) bool mask."""
    label: int
    mask: np.ndarray = field(repr=False)


def _has_hole(mask: np.ndarray) -> bool:
    _, hierarchy = cv2.findContours(mask.astype(np.uint8), cv2.RETR_CCOMP,
                                    cv2.CHAIN_APPROX_SIMPLE)
    return hierarchy is not None and bool((hierarchy[0, :, 3] >= 0).any())


def _admissible(visible: np.ndarray, full_area: int, max_occlusion: float) -> bool:
    """Whether an object may keep ``visible`` as its visible part.

    It must keep enough pixels, and no hole (an occluder strictly inside it), because COCO
    polygons cannot describe holes.
    """
    n = int(visible.sum())
    return n >= max((1 - max_occlusion) * full_area, MIN_VISIBLE_PIXELS) and not _has_hole(visible)


def render_image(rng: np.random.Generator, spec: ShapesSpec
                 ) -> Tuple[np.ndarray, List[ShapeObject]]:
    """Draw one image. Returns ``(img (H, W, 3) uint8 RGB, objects)`` with visible masks."""
    size = spec.image_size
    img = _colour_field(rng, size)
    _draw_distractors(rng, img, int(rng.integers(spec.lines[0], spec.lines[1] + 1)))
    objects: List[ShapeObject] = []
    full_area: List[int] = []
    n = int(rng.integers(spec.objects[0], spec.objects[1] + 1))
    for _ in range(n):
        for _try in range(PLACEMENT_TRIES):
            label = int(rng.integers(len(spec.classes)))
            diameter = float(rng.uniform(*spec.object_size))
            r = diameter / 2
            center = (float(rng.uniform(r, size - r)), float(rng.uniform(r, size - r)))
            outline = shape_outline(spec.classes[label], rng, center, diameter,
                                    float(rng.uniform(0, 2 * math.pi)))
            mask = _fill_mask(outline, size)
            if mask.sum() < MIN_VISIBLE_PIXELS:
                continue
            ok = all(_admissible(o.mask & ~mask, a, spec.max_occlusion)
                     for o, a in zip(objects, full_area))
            if ok:
                break
        else:
            continue  # no admissible placement for this object
        for o in objects:
            o.mask &= ~mask
        background = img[mask].mean(axis=0)
        img[mask] = _texture(rng, size, _pick_colour(rng, background))[mask]
        objects.append(ShapeObject(label, mask))
        full_area.append(int(mask.sum()))
    if rng.random() < 0.5:  # soften edges sometimes
        img = cv2.GaussianBlur(img, (3, 3), 0)
    img += rng.normal(0, spec.noise_std, img.shape).astype(np.float32)
    return np.clip(np.round(img), 0, 255).astype(np.uint8), objects


# ----------------------------------------------------------------------------- COCO conversion
def mask_to_polygons(mask: np.ndarray) -> List[List[float]]:
    """COCO polygons (flat ``[x0, y0, x1, y1, ...]``, pixel-edge coordinates) of a bool mask.

    Contours are traced on a :data:`CONTOUR_UPSAMPLE`-times nearest-upsampled mask, so they run
    within a fraction of a pixel of the mask's pixel edges (tracing pixel centres would shrink
    every object by half a pixel all round). Outer contours only: the visible region of an
    occluded shape may have several parts; parts with fewer than 3 vertices are dropped.
    """
    k = CONTOUR_UPSAMPLE
    big = np.repeat(np.repeat(mask.astype(np.uint8), k, axis=0), k, axis=1)
    contours, _ = cv2.findContours(big, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    polys = []
    for c in contours:
        c = cv2.approxPolyDP(c, CONTOUR_TOLERANCE * k, True).reshape(-1, 2)
        if len(c) >= 3:
            xy = (c.astype(np.float64) + 0.5) / k  # upsampled pixel centres, original units
            polys.append([round(float(v), 2) for v in xy.reshape(-1)])
    return polys


def mask_to_bbox(mask: np.ndarray) -> List[float]:
    """Tight COCO box ``[x, y, w, h]`` (pixel-edge coordinates) of a non-empty bool mask."""
    ys, xs = np.nonzero(mask)
    x0, y0 = int(xs.min()), int(ys.min())
    return [float(x0), float(y0), float(xs.max() + 1 - x0), float(ys.max() + 1 - y0)]


def _split_key(split: str) -> int:
    return zlib.crc32(split.encode())


def image_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator that draws image ``index`` of ``split``; independent of the image count."""
    return np.random.default_rng([int(seed), _split_key(split), int(index)])


def generate_split(root: str, split: str, num_images: int, seed: int = 0,
                   spec: ShapesSpec = ShapesSpec(), progress: bool = True) -> dict:
    """Write ``root/<split>/*.png`` and ``root/annotations/instances_<split>.json``.

    Returns the COCO dict that was written.
    """
    from tqdm import tqdm

    root_p = Path(root)
    img_dir = root_p / split
    img_dir.mkdir(parents=True, exist_ok=True)
    (root_p / 'annotations').mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    ann_id = 1
    for i in tqdm(range(num_images), desc=f'shapes/{split}', unit='img', disable=not progress,
                  dynamic_ncols=True):
        img, objects = render_image(image_rng(seed, split, i), spec)
        file_name = f'{i:06d}.png'
        if not cv2.imwrite(str(img_dir / file_name), img[..., ::-1]):  # cv2 writes BGR
            raise OSError(f'could not write {img_dir / file_name}')
        images.append(dict(id=i + 1, file_name=file_name, width=spec.image_size,
                           height=spec.image_size))
        for obj in objects:
            polys = mask_to_polygons(obj.mask)
            if not polys:
                continue
            annotations.append(dict(id=ann_id, image_id=i + 1, category_id=obj.label + 1,
                                    bbox=mask_to_bbox(obj.mask), area=float(obj.mask.sum()),
                                    segmentation=polys, iscrowd=0))
            ann_id += 1
    info = dict(description='vitdet_plugin synthetic shapes', version=FORMAT_VERSION,
                seed=int(seed), split=split, spec=asdict(spec))
    coco = dict(info=info, licenses=[], images=images, annotations=annotations,
                categories=[dict(id=k + 1, name=n, supercategory='shape')
                            for k, n in enumerate(spec.classes)])
    ann_path = root_p / ANN_FILE.format(split=split)
    tmp = ann_path.with_suffix('.json.tmp')
    tmp.write_text(json.dumps(coco))
    os.replace(tmp, ann_path)  # the annotation file appears only when the split is complete
    return coco


def dataset_info(root: str, split: str) -> Optional[dict]:
    """The ``info`` of an existing split (None when its annotation file is absent)."""
    path = Path(root) / ANN_FILE.format(split=split)
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f).get('info')


def generate_dataset(root: str, seed: int = 0, num_train: int = 2000, num_val: int = 200,
                     spec: ShapesSpec = ShapesSpec(), overwrite: bool = False,
                     progress: bool = True) -> Dict[str, str]:
    """Generate the train and val splits under ``root``; returns ``{split: status}``.

    A split whose annotation file already records the same seed, spec and image count is kept
    (``'exists'``) unless ``overwrite``; a different one raises :class:`FileExistsError` naming
    the difference (pass ``overwrite=True`` or another ``root``).
    """
    counts = dict(train=num_train, val=num_val)
    for split, n in counts.items():
        if n < 1:
            raise ValueError(f'num_{split}={n}: need at least 1 image')
    want = dict(seed=int(seed), spec=json.loads(json.dumps(asdict(spec))))
    status: Dict[str, str] = {}
    for split in SPLITS:
        info = dataset_info(root, split)
        if info is not None and not overwrite:
            with open(Path(root) / ANN_FILE.format(split=split)) as f:
                have_n = len(json.load(f)['images'])
            have = dict(seed=info.get('seed'), spec=info.get('spec'))
            if have == want and have_n == counts[split]:
                status[split] = 'exists'
                continue
            raise FileExistsError(
                f'{Path(root) / ANN_FILE.format(split=split)} holds a different shapes dataset '
                f'(seed={have["seed"]}, {have_n} images) than requested (seed={seed}, '
                f'{counts[split]} images{", other spec" if have["spec"] != want["spec"] else ""})'
                '; pass overwrite=True (--overwrite) or choose another output directory')
        generate_split(root, split, counts[split], seed, spec, progress)
        status[split] = 'generated'
    return status
