"""Datasets: the synthetic "shapes" COCO dataset and dataset-location helpers for configs."""
from .checks import (DatasetNotFoundError, apply_cfg_options, check_data, data_root_override,
                     data_root_paths, load_config, missing_data, propagate_data_root)
from .shapes import CLASSES, ShapesSpec, generate_dataset, generate_split, render_image

__all__ = [
    'DatasetNotFoundError', 'apply_cfg_options', 'check_data', 'data_root_override',
    'data_root_paths', 'load_config', 'missing_data', 'propagate_data_root', 'CLASSES',
    'ShapesSpec', 'generate_dataset', 'generate_split', 'render_image'
]
