"""Datasets: the synthetic "shapes" COCO dataset (instance + panoptic ground truth)."""
from .shapes import (CLASSES, ShapesSpec, generate_dataset, generate_split, render_image,
                     render_scene, strokes_mask)
from .shapes_panoptic import STUFF_CLASSES, panoptic_classes
from . import deim_batch_augments, deim_transforms  # noqa: F401  (registers D-FINE's augments)

__all__ = [
    'CLASSES', 'ShapesSpec', 'generate_dataset', 'generate_split', 'render_image', 'render_scene',
    'strokes_mask', 'STUFF_CLASSES', 'panoptic_classes'
]
