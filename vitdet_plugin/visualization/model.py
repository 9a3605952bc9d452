"""The detector of a config, its weights, and the input its backbone sees.

The model is built from the config (every backbone has one forward, so the hooks fire); a
checkpoint, when given, is loaded strictly through :mod:`vitdet_plugin.weights` (safe
``weights_only`` loading). The input is either an image run through the config's test pipeline
and the detector's data preprocessor (what the detector sees at test time), or a zero image of
a given size padded like the preprocessor pads it.
"""
import os.path as osp
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from mmengine.config import Config
from torch import Tensor

from .pyramid import pad_size_divisor, padded_shape
from . import VisualizeError
from ..config import load_config
from ..weights import checkpoint_state_dict, load_state_dict_checked

#: Transforms of a test pipeline that need annotations; an image given alone has none.
ANNOTATION_TRANSFORMS = ('LoadAnnotations', 'LoadPanopticAnnotations')
#: The loader that replaces the pipeline's file loader (the image is read here first).
NDARRAY_LOADER = 'mmdet.LoadImageFromNDArray'


@dataclass
class Detector:
    """A config's detector in eval mode, and where it came from."""

    cfg: Config
    model: Any  # an mmdet detector, read by duck typing (backbone, neck, data_preprocessor)
    config_path: str
    checkpoint: Optional[str]

    @property
    def backbone(self) -> Any:
        return self.model.backbone

    @property
    def weights_label(self) -> str:
        """``'checkpoint <name>'`` or ``'random init'`` (for picture titles)."""
        return f'checkpoint {osp.basename(self.checkpoint)}' if self.checkpoint else 'random init'


@dataclass
class ModelInput:
    """One image as the backbone receives it.

    ``inputs``: ``(1, 3, Hp, Wp)`` normalised and padded; ``image``: the picture to draw on,
    ``(h, w, 3)`` RGB uint8 after the test pipeline (None for a zero input given by size);
    ``image_hw``: the valid (unpadded) area ``(h, w)``; ``source``: how it was made.
    """

    inputs: Tensor
    image: Optional[np.ndarray]
    image_hw: Tuple[int, int]
    source: str

    @property
    def input_hw(self) -> Tuple[int, int]:
        return int(self.inputs.shape[-2]), int(self.inputs.shape[-1])


def build_detector(config: str, checkpoint: Optional[str] = None,
                   cfg_options: Optional[dict] = None) -> Detector:
    """The config's detector in eval mode on the CPU, with ``checkpoint`` loaded if given."""
    from mmdet.registry import MODELS

    cfg = load_config(config, cfg_options)
    backbone_cfg = cfg.model.get('backbone')
    if backbone_cfg is None:
        raise VisualizeError(f'{config}: the model has no backbone to look inside')
    model = MODELS.build(cfg.model).eval()
    if checkpoint is not None:
        if not osp.isfile(checkpoint):
            raise FileNotFoundError(f'checkpoint file {checkpoint!r} does not exist')
        load_state_dict_checked(model, checkpoint_state_dict(checkpoint),
                                source=f'checkpoint {checkpoint}')
    return Detector(cfg, model, config, checkpoint)


def zero_input(detector: Detector, shape: Sequence[int]) -> ModelInput:
    """A zero image of ``shape = (H, W)``, padded to the preprocessor's ``pad_size_divisor``."""
    h, w = (int(s) for s in shape)
    if min(h, w) < 1:
        raise VisualizeError(f'--shape {h} {w}: H and W must be positive')
    hp, wp = padded_shape((h, w), pad_size_divisor(detector.cfg))
    return ModelInput(torch.zeros(1, 3, hp, wp), None, (h, w), f'zero image {h} x {w}')


def _test_pipeline(cfg: Config) -> List[dict]:
    """The config's test pipeline for an image given as an array (annotations dropped), or a
    bare load-and-pack pipeline for configs without one."""
    from mmdet.utils import get_test_pipeline_cfg

    try:
        steps = [dict(t) for t in get_test_pipeline_cfg(cfg)]
    except (AttributeError, KeyError, RuntimeError):
        steps = [dict(type='LoadImageFromFile'), dict(type='mmdet.PackDetInputs')]
    steps = [t for t in steps if t['type'].split('.')[-1] not in ANNOTATION_TRANSFORMS]
    if steps and 'LoadImage' in steps[0]['type']:
        steps[0] = dict(type=NDARRAY_LOADER)
    else:
        steps.insert(0, dict(type=NDARRAY_LOADER))
    return steps


def image_input(detector: Detector, path: str) -> ModelInput:
    """``path`` through the config's test pipeline and the detector's data preprocessor."""
    import mmcv
    from mmcv.transforms import Compose
    from mmengine.dataset import pseudo_collate

    if not osp.isfile(path):
        raise FileNotFoundError(f'image {path!r} does not exist')
    img = mmcv.imread(path)  # BGR, as mmdet's loaders read it
    if img is None:
        raise VisualizeError(f'image {path!r} cannot be read as an image')
    data = Compose(_test_pipeline(detector.cfg))(dict(img=img, img_id=0))
    with torch.no_grad():
        batch = detector.model.data_preprocessor(pseudo_collate([data]), False)
    shown = data['inputs'].permute(1, 2, 0).numpy()[..., ::-1]  # (h, w, 3) BGR -> RGB
    h, w = shown.shape[:2]
    return ModelInput(batch['inputs'], np.ascontiguousarray(shown), (h, w),
                      f'{osp.basename(path)} at {h} x {w}')


def make_input(detector: Detector, image: Optional[str],
               shape: Optional[Sequence[int]]) -> ModelInput:
    """:func:`image_input` for an image path, else :func:`zero_input` for a size."""
    if image is not None:
        return image_input(detector, image)
    if shape is None:
        raise VisualizeError('give --image IMG or --shape H W')
    return zero_input(detector, shape)
