"""Datasets: the synthetic "shapes" COCO dataset (instance + panoptic ground truth) and your own
data folder as it is (``--data DIR``: a Roboflow COCO export or mmdet's layout)."""
from .data_folder import (DataFolder, DataFolderError, apply_data_folder, find_data_folder,
                          set_num_classes)
from .shapes import (CLASSES, ShapesSpec, generate_dataset, generate_split, render_image,
                     render_scene, strokes_mask)
from .shapes_panoptic import STUFF_CLASSES, panoptic_classes
from . import rfdetr_transforms  # noqa: F401  (registers RF-DETR's resizes)
from . import deim_batch_augments, deim_transforms  # noqa: F401  (registers D-FINE's augments)

__all__ = [
    'CLASSES', 'ShapesSpec', 'generate_dataset', 'generate_split', 'render_image', 'render_scene',
    'strokes_mask', 'STUFF_CLASSES', 'panoptic_classes', 'DataFolder', 'DataFolderError',
    'apply_data_folder', 'find_data_folder', 'set_num_classes'
]
