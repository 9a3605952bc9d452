"""Deterministic synthetic COCO-format instance and panoptic segmentation dataset ("shapes").

Each image is a noisy colour field with distractor lines and arcs, on which 1-5 textured,
randomly rotated shapes of several classes are drawn, possibly overlapping (later shapes occlude
earlier ones; every object keeps at least ``1 - max_occlusion`` of its area visible). The
annotation of an object is its *visible* region: COCO polygons traced from the visible mask,
the tight box of that mask (``[x, y, w, h]`` in pixel-edge coordinates) and its pixel area.

Panoptic ground truth (:mod:`vitdet_plugin.datasets.shapes_panoptic`): things = the shape
classes (same category ids, one segment per object = its visible mask), stuff = ``lines`` (the
pixels the distractor strokes painted, :func:`strokes_mask`, where no object covers them) and
``background`` (the rest), with ids after the things'; mmdet label order: things, then stuff.

Everything is derived from one seed: image ``i`` of a split draws from
``numpy.random.default_rng([seed, split_key, i])``, so an image does not depend on how many
images are generated, and the same seed always gives byte-identical PNGs and JSON. The panoptic
masks draw no random numbers: images and instance JSON are the same as before they existed.

Layout written by :func:`generate_dataset` (mmdet ``CocoDataset`` reads the instance files,
``CocoPanopticDataset`` / ``CocoPanopticMetric`` the panoptic ones as they are)::

    root/train/000000.png ...                   root/val/000000.png ...
    root/annotations/instances_train.json       root/annotations/instances_val.json
    root/annotations/panoptic_train.json        root/annotations/panoptic_val.json
    root/annotations/panoptic_train/000000.png  root/annotations/panoptic_val/000000.png ...
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

from .shapes_panoptic import PanopticWriter, panoptic_matches

#: Shape classes of the default dataset, in category-id order (category id = index + 1).
CLASSES: Tuple[str, ...] = ('square', 'circle', 'triangle', 'star', 'cross')
SPLITS: Tuple[str, ...] = ('train', 'val')
ANN_FILE = 'annotations/instances_{split}.json'
#: Version of the dataset: 1 = images + instance JSON, 2 = those (unchanged) + panoptic ground
#: truth. Recorded in the panoptic JSON's ``info``; the instance JSON keeps recording
#: :data:`INSTANCES_VERSION`, so its bytes are those version 1 wrote. A version-1 dataset is
#: upgraded in place by :func:`generate_dataset` (panoptic files added).
FORMAT_VERSION = 2
INSTANCES_VERSION = 1

CIRCLE_VERTICES = 64
STAR_POINTS = 5
STAR_INNER_RATIO = (0.38, 0.55)   # inner / outer radius of a star
CROSS_ARM_RATIO = (0.28, 0.42)    # half arm width / outer radius of a cross
MIN_COLOUR_CONTRAST = 70.0        # L2 distance in RGB from the local background mean
MIN_VISIBLE_PIXELS = 30           # an object keeps at least this many visible pixels
PLACEMENT_TRIES = 30
CONTOUR_UPSAMPLE = 4              # polygon tracing resolution, sub-pixels per pixel
CONTOUR_TOLERANCE = 0.25          # polygon simplification tolerance, px
LINE_COVERAGE = 0.5               # a pixel is `lines` stuff when strokes cover this much of it


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


@dataclass(frozen=True)
class Stroke:
    """One distractor: a line ``p0 -> p1``, or an elliptic arc when ``arc`` is set.

    ``points`` are ``(p0, p1)`` of a line or ``(center, axes)`` of an arc (integer pixels);
    ``arc`` is ``(angle, start, end)`` in degrees.
    """
    thickness: int
    points: Tuple[Tuple[int, int], Tuple[int, int]]
    arc: Optional[Tuple[float, float, float]] = None

    def draw(self, canvas: np.ndarray, colour: Tuple[float, ...]) -> None:
        """Paint the stroke on ``canvas`` in place."""
        a, b = self.points
        if self.arc is None:
            cv2.line(canvas, a, b, colour, self.thickness, cv2.LINE_AA)
        else:
            cv2.ellipse(canvas, a, b, *self.arc, colour, self.thickness, cv2.LINE_AA)


def _point(rng: np.random.Generator, lo: int, hi: int) -> Tuple[int, int]:
    x, y = (int(v) for v in rng.integers(lo, hi, 2))
    return x, y


def _draw_distractors(rng: np.random.Generator, img: np.ndarray, count: int) -> List[Stroke]:
    """Paint ``count`` random lines / arcs on ``img``; returns them (for :func:`strokes_mask`)."""
    size = img.shape[0]
    strokes = []
    for _ in range(count):
        colour = tuple(float(v) for v in rng.uniform(0, 255, 3))
        thickness = int(rng.integers(1, 4))
        if rng.random() < 0.65:
            p0 = _point(rng, -size // 4, size + size // 4)
            stroke = Stroke(thickness, (p0, _point(rng, -size // 4, size + size // 4)))
        else:
            center = _point(rng, 0, size)
            axes = _point(rng, size // 8, size // 2)
            start = float(rng.uniform(0, 360))
            angle = float(rng.uniform(0, 180))
            stroke = Stroke(thickness, (center, axes),
                            (angle, start, start + float(rng.uniform(40, 200))))
        stroke.draw(img, colour)
        strokes.append(stroke)
    return strokes


def strokes_mask(strokes: List[Stroke], size: int) -> np.ndarray:
    """(H, W) bool mask of the pixels ``strokes`` paint: the ``lines`` stuff before occlusion.

    The strokes are drawn with the image's own calls on a float32 canvas like the image's, and a
    pixel counts when its coverage is at least :data:`LINE_COVERAGE` (1/2). OpenCV applies
    ``LINE_AA`` to 8-bit images only, so on float32 the coverage is 0 or 1 and the mask is exactly
    the set of pixels the strokes recoloured; the 1/2 rule fixes the answer should anti-aliasing
    ever apply (a pixel is a line pixel when the line contributes at least half its colour). The
    later blur and noise of some images spread line colour to neighbours; those stay background.
    """
    canvas = np.zeros((size, size), np.float32)
    for stroke in strokes:
        stroke.draw(canvas, (1.0,))
    return canvas >= LINE_COVERAGE


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


@dataclass
class Scene:
    """One rendered image: ``img`` (H, W, 3) uint8 RGB, its objects and distractor strokes."""
    img: np.ndarray = field(repr=False)
    objects: List[ShapeObject]
    strokes: List[Stroke]


def render_image(rng: np.random.Generator, spec: ShapesSpec
                 ) -> Tuple[np.ndarray, List[ShapeObject]]:
    """Draw one image. Returns ``(img (H, W, 3) uint8 RGB, objects)`` with visible masks."""
    scene = render_scene(rng, spec)
    return scene.img, scene.objects


def render_scene(rng: np.random.Generator, spec: ShapesSpec) -> Scene:
    """Draw one image (:func:`render_image`), also returning its distractor strokes."""
    size = spec.image_size
    img = _colour_field(rng, size)
    strokes = _draw_distractors(rng, img, int(rng.integers(spec.lines[0], spec.lines[1] + 1)))
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
    return Scene(np.clip(np.round(img), 0, 255).astype(np.uint8), objects, strokes)


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
                   spec: ShapesSpec = ShapesSpec(), progress: bool = True,
                   images: bool = True) -> dict:
    """Write ``root/<split>/*.png``, ``annotations/instances_<split>.json`` and the panoptic
    ground truth ``annotations/panoptic_<split>.json`` + ``annotations/panoptic_<split>/*.png``.

    With ``images=False`` only the panoptic files are written (the upgrade of a version-1
    split); the images already there must be the ones this seed and spec draw, else
    :class:`FileExistsError`. Returns the instance COCO dict (written or not).
    """
    from tqdm import tqdm

    root_p = Path(root)
    img_dir = root_p / split
    img_dir.mkdir(parents=True, exist_ok=True)
    (root_p / 'annotations').mkdir(parents=True, exist_ok=True)
    panoptic = PanopticWriter(root, split, spec.classes, dict(
        description='vitdet_plugin synthetic shapes, panoptic', version=FORMAT_VERSION,
        seed=int(seed), split=split, spec=asdict(spec), line_coverage=LINE_COVERAGE))
    image_infos, annotations = [], []
    ann_id = 1
    for i in tqdm(range(num_images), desc=f'shapes/{split}', unit='img', disable=not progress,
                  dynamic_ncols=True):
        scene = render_scene(image_rng(seed, split, i), spec)
        file_name = f'{i:06d}.png'
        path = img_dir / file_name
        if images:
            if not cv2.imwrite(str(path), scene.img[..., ::-1]):  # cv2 writes BGR
                raise OSError(f'could not write {path}')
        else:
            have = cv2.imread(str(path))
            if have is None or not np.array_equal(have[..., ::-1], scene.img):
                raise FileExistsError(
                    f'{path} is not the image seed={seed} and this spec draw (another '
                    'generator wrote it); pass overwrite=True (--overwrite) to regenerate')
        image_infos.append(dict(id=i + 1, file_name=file_name, width=spec.image_size,
                                height=spec.image_size))
        things = []
        void = np.zeros((spec.image_size, spec.image_size), bool)
        for obj in scene.objects:
            polys = mask_to_polygons(obj.mask)
            if not polys:
                void |= obj.mask  # not annotated: unlabelled (void) in the panoptic map too
                continue
            annotations.append(dict(id=ann_id, image_id=i + 1, category_id=obj.label + 1,
                                    bbox=mask_to_bbox(obj.mask), area=float(obj.mask.sum()),
                                    segmentation=polys, iscrowd=0))
            things.append((obj.label + 1, obj.mask))
            ann_id += 1
        panoptic.add(i + 1, file_name, things, strokes_mask(scene.strokes, spec.image_size),
                     void)
    info = dict(description='vitdet_plugin synthetic shapes', version=INSTANCES_VERSION,
                seed=int(seed), split=split, spec=asdict(spec))
    coco = dict(info=info, licenses=[], images=image_infos, annotations=annotations,
                categories=[dict(id=k + 1, name=n, supercategory='shape')
                            for k, n in enumerate(spec.classes)])
    if images:
        ann_path = root_p / ANN_FILE.format(split=split)
        tmp = ann_path.with_suffix('.json.tmp')
        tmp.write_text(json.dumps(coco))
        os.replace(tmp, ann_path)  # the annotation file appears only when the split is complete
    panoptic.close()  # last: a split with both files is complete
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
    (``'exists'``) unless ``overwrite``; one without (complete, matching) panoptic ground truth,
    e.g. from version 1 of the generator, gets it added (``'upgraded'``); a different one raises
    :class:`FileExistsError` naming the difference (pass ``overwrite=True`` or another ``root``).
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
            version = info.get('version')
            if have != want or have_n != counts[split] or version != INSTANCES_VERSION:
                raise FileExistsError(
                    f'{Path(root) / ANN_FILE.format(split=split)} holds a different shapes '
                    f'dataset (seed={have["seed"]}, {have_n} images'
                    f'{"" if version == INSTANCES_VERSION else f", version {version}"}) than '
                    f'requested (seed={seed}, {counts[split]} images'
                    f'{", other spec" if have["spec"] != want["spec"] else ""}); pass '
                    'overwrite=True (--overwrite) or choose another output directory')
            if panoptic_matches(root, split, dict(want, version=FORMAT_VERSION), counts[split]):
                status[split] = 'exists'
            else:  # version 1 (or an interrupted run): add the panoptic ground truth
                generate_split(root, split, counts[split], seed, spec, progress, images=False)
                status[split] = 'upgraded'
            continue
        generate_split(root, split, counts[split], seed, spec, progress)
        status[split] = 'generated'
    return status
