"""Datasets: the synthetic "shapes" COCO dataset (instance + panoptic ground truth) and
dataset-location helpers for configs."""
from .checks import (DatasetNotFoundError, apply_cfg_options, check_data, data_root_override,
                     data_root_paths, load_config, missing_data, propagate_data_root)
from .shapes import (CLASSES, ShapesSpec, generate_dataset, generate_split, render_image,
                     render_scene, strokes_mask)
from .shapes_panoptic import STUFF_CLASSES, panoptic_classes

__all__ = [
    'DatasetNotFoundError', 'apply_cfg_options', 'check_data', 'data_root_override',
    'data_root_paths', 'load_config', 'missing_data', 'propagate_data_root', 'CLASSES',
    'ShapesSpec', 'generate_dataset', 'generate_split', 'render_image', 'render_scene',
    'strokes_mask', 'STUFF_CLASSES', 'panoptic_classes'
]
