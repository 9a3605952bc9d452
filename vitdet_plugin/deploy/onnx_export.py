"""ONNX export of a detector's network with dynamic batch, height and width.

What is exported: the network from the *normalised, padded* image tensor ``(B, C, H, W)`` to

* ``'backbone'``: the backbone's feature maps,
* ``'neck'``: the neck's maps (backbone + neck),
* ``'head'``: a single-stage dense head's raw per-level outputs before decoding and NMS
  (backbone + neck + head: RetinaNet's ``cls_score_i`` ``(B, A * K, H_i, W_i)`` logits and
  ``bbox_pred_i`` ``(B, A * 4, H_i, W_i)`` box deltas).

What is not: the data preprocessor (BGR -> RGB, mean / std, padding to ``pad_size_divisor``),
anchor generation and box decoding, the score threshold and NMS (mmcv ops), and two-stage
heads (RoIAlign is an mmcv op). The caller runs those, or uses mmdeploy.

The exporter is torch's dynamo-based one (``torch.onnx.export(..., dynamo=True)``, via
``torch.export``): sizes are symbolic while it traces, so the graph holds the padding,
shifted-window masks and position-table resizes as functions of the input size.
"""
import logging
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..models.layers import eager_attention
from .graph_ops import translation_table
from .runner import INPUT_NAME  # the graph's input name, one for every export

#: Parts of a detector that can be exported (each includes the ones before it).
PARTS = ('backbone', 'neck', 'head')
#: Size of the example input the exporter traces with. Any size works (the graph is dynamic);
#: an odd one that is no multiple of a patch or window keeps every padding path in the trace.
EXPORT_SAMPLE_SIZE: Tuple[int, int] = (233, 311)
#: The exported graph's opset (torch's dynamo exporter supports 18 and newer).
OPSET = 18


class DetectorPart(nn.Module):
    """The exported network: ``image -> backbone [-> neck [-> dense head]]`` as a flat tuple.

    Args:
        model: an mmdet detector (``backbone``, optional ``neck``, ``bbox_head``), or a bare
            backbone (``part='backbone'`` only).
        part: one of :data:`PARTS`.
    """

    def __init__(self, model: nn.Module, part: str) -> None:
        super().__init__()
        if part not in PARTS:
            raise ValueError(f'part={part!r} is not one of {PARTS}')
        backbone = getattr(model, 'backbone', model)
        neck = getattr(model, 'neck', None) if part in ('neck', 'head') else None
        head = getattr(model, 'bbox_head', None) if part == 'head' else None
        if part in ('neck', 'head') and neck is None and not hasattr(model, 'backbone'):
            raise ValueError(f'part={part!r} needs a detector; got a bare '
                             f'{type(model).__name__}: export part="backbone"')
        if part == 'neck' and neck is None:
            raise ValueError(f'{type(model).__name__} has no neck: export part="backbone"')
        if part == 'head':
            if hasattr(model, 'roi_head') or hasattr(model, 'rpn_head'):
                raise ValueError(f'{type(model).__name__} is a two-stage detector: its RoI head '
                                 'needs RoIAlign (an mmcv op) and proposals from NMS, which '
                                 'this exporter leaves out; export part="neck" (or use '
                                 'mmdeploy)')
            if head is None:
                raise ValueError(f'{type(model).__name__} has no bbox_head: export '
                                 'part="neck" or part="backbone"')
        self.part = part
        self.backbone = backbone
        self.neck = neck
        self.head = head

    def fit_size(self, size: Tuple[int, int]) -> Tuple[int, int]:
        """The smallest input size, at least ``size``, that the backbone takes (its contract's
        ``fit_input``; ``size`` itself for a backbone without one)."""
        fit = getattr(self.backbone, 'fit_input', None)
        return size if fit is None else tuple(fit(tuple(size)))

    @property
    def in_channels(self) -> int:
        """Image channels the backbone takes (3 when it does not say)."""
        return int(getattr(self.backbone, 'in_channels', 3))

    def output_names(self, num_levels: int) -> List[str]:
        """Names of the flat outputs for ``num_levels`` feature levels."""
        if self.part == 'head':
            return ([f'cls_score_{i}' for i in range(num_levels)]
                    + [f'bbox_pred_{i}' for i in range(num_levels)])
        prefix = 'neck' if self.part == 'neck' else 'feat'
        return [f'{prefix}_{i}' for i in range(num_levels)]

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        feats = self.backbone(x)
        feats = (feats,) if isinstance(feats, Tensor) else tuple(feats)
        if self.neck is not None:
            feats = tuple(self.neck(feats))
        if self.head is None:
            return feats
        cls_scores, bbox_preds = self.head(feats)[:2]
        return tuple(cls_scores) + tuple(bbox_preds)


def build_detector_part(config: str, checkpoint: Optional[str] = None, part: str = 'auto',
                        cfg_options: Optional[dict] = None) -> DetectorPart:
    """The model of ``config`` (weights from ``checkpoint``, else its own init) as a
    :class:`DetectorPart`; ``part='auto'``: backbone + neck when there is a neck."""
    model = build_model(config, checkpoint, cfg_options)[1]
    if part == 'auto':
        part = 'neck' if getattr(model, 'neck', None) is not None else 'backbone'
    return DetectorPart(model, part).eval()


def build_model(config: str, checkpoint: Optional[str] = None,
                cfg_options: Optional[dict] = None) -> Tuple[Any, nn.Module]:
    """``(config, model)`` of ``config`` in eval mode, weights from ``checkpoint`` or the
    config's own initialisation. The checkpoint loads as ``tools/test.py`` and ``load_from``
    load it (mmengine's ``load_checkpoint`` with the layout table's conversions: an mmdet
    checkpoint, rfdetr's ``.pth``, an official D-FINE / DEIMv2 file, a transformers folder;
    tensors of another shape refused naming the fix), then strictly: every key of the model."""
    from mmdet.registry import MODELS
    from mmengine.logging import MMLogger
    from mmengine.runner import load_checkpoint

    from ..config import load_config
    from ..weights.checkpoint_io import CheckpointError
    from ..weights.common import unwrap_state_dict
    from ..weights.model_load import revise_key

    cfg = load_config(config, cfg_options)
    model = MODELS.build(cfg.model)
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(logging.WARNING)  # not one INFO line per initialised parameter
    try:
        if not checkpoint:
            model.init_weights()
            return cfg, model.eval()
        loaded = load_checkpoint(model, checkpoint, map_location='cpu', logger='current')
    finally:
        logger.setLevel(level)
    keys = {revise_key(k) for k in unwrap_state_dict(loaded)}  # as load_checkpoint reads them
    missing = sorted(set(model.state_dict()) - keys)
    unexpected = sorted(keys - set(model.state_dict()))
    if missing or unexpected:
        raise CheckpointError(
            f'checkpoint {checkpoint!r} does not match the model of {config!r}: '
            f'{len(missing)} missing keys (e.g. {missing[:3]}), {len(unexpected)} '
            f'unexpected (e.g. {unexpected[:3]}); give the checkpoint this config trained')
    return cfg, model.eval()


def dynamic_shapes() -> Tuple[dict, ...]:
    """``torch.export`` dynamic-shape spec of the image: batch, height and width free."""
    dynamic = torch.export.Dim.DYNAMIC
    return ({0: dynamic, 2: dynamic, 3: dynamic},)


def export_onnx(module: DetectorPart, path: str, sample_size: Tuple[int, int] = EXPORT_SAMPLE_SIZE,
                sample_batch: int = 2, opset: int = OPSET) -> List[str]:
    """Export ``module`` (put in eval mode) to ``path`` with dynamic batch, height and width,
    traced at ``sample_size`` fitted to the backbone (``DetectorPart.fit_size``); returns the
    output names. ``sample_batch`` must be >= 2 (a batch of 1 would be specialised by the
    tracer)."""
    module.eval()
    x = torch.randn(sample_batch, module.in_channels, *module.fit_size(sample_size))
    with torch.no_grad():
        levels = len(module(x)) // (2 if module.part == 'head' else 1)
    names = module.output_names(levels)
    export_graph(module, (x,), path, dynamic_shapes(), [INPUT_NAME], names, opset)
    return names


def export_graph(module: nn.Module, args: Tuple[Tensor, ...], path: str,
                 shapes: Tuple[dict, ...], input_names: List[str], output_names: List[str],
                 opset: int = OPSET) -> None:
    """``torch.onnx.export`` (dynamo) of ``module`` traced on ``args`` with the dynamic
    ``shapes``, attention in its explicit form and our translations (:mod:`.graph_ops`), every
    tensor inside the file; a clear error when the deploy extra is missing."""
    try:
        with eager_attention(module):
            torch.onnx.export(module, args, path, dynamo=True, dynamic_shapes=shapes,
                              input_names=input_names, output_names=output_names,
                              opset_version=opset, external_data=False,
                              custom_translation_table=translation_table())
    except ImportError as e:  # onnxscript / onnx missing
        raise SystemExit(f'ONNX export needs the deploy extra ({e}): pip install -e ".[deploy]" '
                         '(or `make env`)') from e
