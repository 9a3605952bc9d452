"""Resampling a single-stride map to pyramid levels (ViTDet's layout) and the NCHW norms of the
pyramid necks (:class:`~vitdet_plugin.models.necks.ViTSimpleFPN`, RF-DETR's projector)."""
from types import MappingProxyType
from typing import Any, Mapping, Optional, Tuple

from mmcv.cnn import build_activation_layer, build_norm_layer
from torch import nn

from .norm import LayerNorm2d

#: Scale factors with a defined resampling (output stride = ``in_stride / scale``).
SUPPORTED_SCALES = (4.0, 2.0, 1.0, 0.5)
#: detectron2's channels-first LayerNorm epsilon.
LN2D_EPS = 1e-6
#: :class:`ViTSimpleFPN`'s default ``norm_cfg`` (read-only: every use copies it).
DEFAULT_NORM_CFG: Mapping[str, Any] = MappingProxyType(dict(type='LN2d', eps=LN2D_EPS))


def build_norm2d(norm_cfg: Optional[Mapping[str, Any]], channels: int) -> nn.Module:
    """Norm for NCHW maps: ``type='LN2d'`` is a channel LayerNorm (detectron2 ``"LN"``), any
    other type goes through mmcv's ``build_norm_layer`` (``BN``, ``SyncBN``, ``GN``, ...);
    ``None`` gives no norm."""
    if norm_cfg is None:
        return nn.Identity()
    cfg = dict(norm_cfg)
    if 'type' not in cfg:
        raise ValueError(f"norm_cfg={norm_cfg!r} needs a 'type', e.g. dict(type='LN2d')")
    if cfg['type'] == 'LN2d':
        cfg.pop('type')
        cfg.pop('requires_grad', None)
        return LayerNorm2d(channels, eps=cfg.pop('eps', LN2D_EPS), **cfg)
    return build_norm_layer(cfg, channels)[1]


def scale_resampler(scale: float, dim: int, norm_cfg: Optional[Mapping[str, Any]],
               act_cfg: dict) -> Tuple[nn.Module, int]:
    """The layers resampling a ``dim``-channel map by ``scale`` (one of
    :data:`SUPPORTED_SCALES`) and their output channels, detectron2's ViTDet layout: scale 4,
    deconv 2x, norm, activation, deconv 2x (``dim / 4`` channels); 2, one deconv (``dim / 2``);
    1, nothing; 0.5, a 2x2 max-pool."""
    if scale == 4.0:
        return nn.Sequential(
            nn.ConvTranspose2d(dim, dim // 2, kernel_size=2, stride=2),
            build_norm2d(norm_cfg, dim // 2),
            build_activation_layer(act_cfg),
            nn.ConvTranspose2d(dim // 2, dim // 4, kernel_size=2, stride=2)), dim // 4
    if scale == 2.0:
        return nn.Sequential(nn.ConvTranspose2d(dim, dim // 2, kernel_size=2, stride=2)), dim // 2
    if scale == 1.0:
        return nn.Sequential(), dim
    return nn.Sequential(nn.MaxPool2d(kernel_size=2, stride=2)), dim  # scale 0.5
